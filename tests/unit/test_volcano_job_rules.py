"""The rendered Volcano Jobs against v1.15.1's controller rules (tests/volcano_controller.py).

A long job on Spot capacity loses nodes all the time: 150 drains must leave it Running with
its PodGroup in place, while a crash loop, a wrong config or a diverged loss still ends it.
"""

from __future__ import annotations

import pytest

from tests.unit.test_charts import RENDERED, the_job
from tests.volcano_controller import ControlledJob, mutate, policy_problems
from training.contract import EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_DIVERGED, EXIT_RESTART_JOB

SIGKILL = 137  # the OOM killer, or a kubelet past the grace period


def training_job() -> ControlledJob:
    return ControlledJob.admitted(the_job(RENDERED, "resnet50-imagenet")["spec"])


@pytest.mark.parametrize("name", ["resnet50-imagenet", "resnet50-imagenet-nccl-check", "bert-large-mlm"])
def test_the_admission_webhook_accepts_every_rendered_job(name):
    assert policy_problems(the_job(RENDERED, name)["spec"]["policies"]) == []


def test_150_drains_leave_the_job_running_uncounted_and_its_podgroup_in_place():
    job = training_job()
    for drain in range(150):
        job.drained(drain % 4)
    assert job.phase == "Running" and job.retry_count == 0
    assert job.podgroup_deletions == 0 and job.plugin_deletions == 0
    assert sorted(job.pods.items()) == [(i, "Running") for i in range(4)]


def test_150_pod_failures_after_progress_leave_the_job_running():
    job = training_job()
    for failure in range(150):
        job.pod_exits(failure % 4, SIGKILL)
        assert job.pods[failure % 4] == "Running"  # replaced alone
    assert job.phase == "Running" and job.retry_count == 150 and job.version == 0


def test_the_old_spec_ended_a_long_spot_job_after_100_drains():
    """What this design replaced: maxRetry = --max-restarts, every drain a RestartPod, and plugins."""
    spec = the_job(RENDERED, "resnet50-imagenet")["spec"]
    old = {**spec, "maxRetry": 100, "plugins": {"svc": [], "env": []},
           "policies": [p for p in spec["policies"] if p.get("exitCode") not in (143, EXIT_CRASH_LOOP)]}
    job = ControlledJob.admitted(old)
    for drain in range(150):
        job.drained(drain % 4)
        if job.finished:
            break
    assert job.phase == "Failed" and drain == 99 and job.plugin_deletions == 200


@pytest.mark.parametrize("status", [EXIT_CONFIG, EXIT_DIVERGED, EXIT_CRASH_LOOP])
def test_a_status_that_retrying_cannot_fix_ends_the_job(status):
    job = training_job()
    job.pod_exits(0, status)
    assert job.phase == "Terminated" and job.retry_count == 0


def test_workers_failed_for_good_after_progress_restart_the_whole_job_with_a_new_version():
    job = training_job()
    job.pod_exits(2, EXIT_RESTART_JOB)
    assert job.phase == "Running" and job.version == 1 and job.retry_count == 1


def test_the_nccl_check_runs_once_whatever_the_webhook_defaults():
    spec = the_job(RENDERED, "resnet50-imagenet-nccl-check")["spec"]
    assert mutate(spec)["maxRetry"] == 1
    assert mutate({**spec, "maxRetry": 0})["maxRetry"] == 3  # why it is not 0
    for event in ("fail", "delete"):
        check = ControlledJob.admitted(spec)
        check.pod_exits(0, 1) if event == "fail" else check.pod_deleted(0)
        assert check.phase == "Terminated" and check.retry_count == 0

"""trainctl acts on exactly what it names, and every everyday mistake is one line (issue 17, items 1-3).

The CLI runs as users run it, in a subprocess, against the loopback API server of
test_trainctl_kube through a kubeconfig context; every request it makes is recorded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from kubernetes import client

from tests import trainctl_fixtures
from tests.conftest import REPO
from tests.unit.test_trainctl_kube import CONFIG, JOBS_PATH, SPEC
from tests.trainctl_fixtures import kubeconfig
from trainctl.errors import UserError
from trainctl.backends.eks import Jobs, render

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

# The fixtures of tests/trainctl_fixtures.py, under the names the tests ask for.
server = trainctl_fixtures.server
cli = trainctl_fixtures.cli


def jobs_of(server) -> Jobs:
    configuration = client.Configuration()
    configuration.host = server.url
    return Jobs(client.ApiClient(configuration), "training", sleep=lambda _s: None)


def one_line(stderr: str) -> str:
    return trainctl_fixtures.one_error(stderr)


# --- 1. No command deletes more than it names ---------------------------------------------------

def test_cancel_of_an_empty_name_reaches_no_api(cli, server):
    server.jobs["keep-me"] = {"metadata": {"name": "keep-me"}}
    code, _, err = cli("--context", "lab", "cancel", "")
    assert code == 2
    assert one_line(err).startswith('error: job name: got ""; fix: allowed: a job name')
    assert server.requests == []  # before: DELETE .../jobs, the whole collection
    assert "keep-me" in server.jobs


@pytest.mark.parametrize("name", ["", "UPPER", "a/b", "../jobs", "x?y", "-lead", "a" * 254])
def test_every_job_method_refuses_a_name_that_is_not_one_object(server, name):
    jobs = jobs_of(server)
    calls = [lambda: jobs.get(name), lambda: jobs.cancel(name), lambda: jobs.pods(name),
             lambda: jobs.log(name), lambda: jobs.why_waiting(name),
             lambda: jobs.submit({"metadata": {"name": name}, "spec": {}})]
    for call in calls:
        with pytest.raises(UserError, match=r"got "):
            call()
    assert server.requests == []


def test_cancel_all_without_a_terminal_or_yes_deletes_nothing(cli, server):
    for name in ("a", "b"):
        server.jobs[name] = {"metadata": {"name": name}}
    code, _, err = cli("--context", "lab", "cancel", "--all")
    assert code == 2 and "nobody can confirm" in one_line(err)
    assert set(server.jobs) == {"a", "b"}
    assert not [r for r in server.requests if r[0] == "DELETE"]


def test_cancel_all_with_yes_deletes_each_named_job_and_never_the_collection(cli, server):
    for name in ("a", "b"):
        server.jobs[name] = {"metadata": {"name": name}}
    code, out, _ = cli("--context", "lab", "cancel", "--all", "--yes")
    assert code == 0 and "cancelled a" in out and "cancelled b" in out
    deletes = [path.split("?")[0] for method, path, *_ in server.requests if method == "DELETE"]
    assert deletes == [f"{JOBS_PATH}/a", f"{JOBS_PATH}/b"]
    assert server.jobs == {}


def test_cancel_all_asks_and_a_wrong_answer_deletes_nothing(server, monkeypatch, tmp_path, capsys):
    from trainctl.backends import Connection
    from trainctl.backends.eks import EksBackend

    backend = EksBackend(Connection(CONFIG))
    backend._jobs = jobs_of(server)
    server.jobs["a"] = {"metadata": {"name": "a"}}
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "yes")
    assert backend.cancel_all(yes=False) == 1 and "nothing deleted" in capsys.readouterr().out
    assert "a" in server.jobs
    monkeypatch.setattr("builtins.input", lambda prompt: "training")  # the namespace, typed
    assert backend.cancel_all(yes=False) == 0 and server.jobs == {}


def test_cancel_needs_a_name_or_all_not_both(cli, server):
    assert "neither a name nor --all" in one_line(cli("--context", "lab", "cancel")[2])
    assert "both a name and --all" in one_line(cli("--context", "lab", "cancel", "x", "--all")[2])
    assert server.requests == []


# --- 3. One line for every everyday error ------------------------------------------------------

def test_a_profile_that_does_not_exist_is_one_line_naming_the_ones_that_do(tmp_path):
    (tmp_path / "config").write_text("[default]\nregion = us-west-2\n[profile ml-admin]\nregion = us-west-2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    for args, extra in ((["--profile", "nope", "preflight"], {}), (["preflight"], {"AWS_PROFILE": "nope"}),
                        (["preflight", "--profile", "nope"], {})):
        result = subprocess.run([sys.executable, "-m", "trainctl", *args], cwd=REPO, capture_output=True, text=True,
                                timeout=120, env={**env, **extra})
        assert result.returncode == 2
        assert one_line(result.stderr) == ("error: AWS profile 'nope' not found (--profile or AWS_PROFILE); "
                                           "fix: use one of: default, ml-admin")


def test_an_unknown_context_names_the_contexts_there_are(cli, server):
    code, _, err = cli("--context", "prod", "status", "j")
    assert code == 2 and one_line(err).startswith("error: --context: got 'prod', which ")
    assert one_line(err).endswith("fix: allowed: lab")
    assert server.requests == []


def test_no_kubeconfig_is_one_line(cli, tmp_path):
    code, _, err = cli("--context", "lab", "list", extra_env={"KUBECONFIG": str(tmp_path / "missing")})
    assert code == 2 and "no kubeconfig at" in one_line(err) and "aws eks update-kubeconfig" in err


def test_an_unreachable_api_server_is_one_line(cli, tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = kubeconfig(tmp_path / "dead", f"http://127.0.0.1:{port}")
    code, _, err = cli("--context", "lab", "list", extra_env={"KUBECONFIG": config})
    assert code == 2
    assert one_line(err).startswith(f"error: cannot reach the cluster's API server at http://127.0.0.1:{port}; "
                                    "fix: the endpoint admits only cluster.endpoint_access_cidrs")


@pytest.mark.parametrize(("status", "message", "expected"), [
    (400, 'admission webhook "validatejob.volcano.sh" denied the request: queue training is closed',
     "the cluster rejected the request (HTTP 400: admission webhook \"validatejob.volcano.sh\" denied the request: "
     "queue training is closed)"),
    (409, 'Operation cannot be fulfilled on jobs.batch.volcano.sh "j": the object has been modified',
     "the cluster reports a conflict (HTTP 409: Operation cannot be fulfilled"),
    (503, "etcdserver: leader changed", "the cluster's API server failed (HTTP 503: etcdserver: leader changed)"),
    (500, "Internal error occurred", "the cluster's API server failed (HTTP 500: Internal error occurred)"),
])
def test_http_errors_are_one_line_with_the_servers_reason(cli, server, status, message, expected):
    server.fail = (status, message)
    code, _, err = cli("--context", "lab", "list")
    assert code == 2 and one_line(err).startswith(f"error: {expected}")


def test_a_403_says_which_verb_on_which_resource_is_missing(cli, server):
    server.fail = (403, 'jobs.batch.volcano.sh is forbidden: User "arn:aws:sts::123456789012:assumed-role/ml-dev/'
                        'jane" cannot create resource "jobs" in API group "batch.volcano.sh" in the namespace '
                        '"training"')
    code, _, err = cli("--context", "lab", "submit", "k8s_charts/examples/resnet50-p4d.yaml")
    assert code == 2
    assert one_line(err) == ("error: arn:aws:sts::123456789012:assumed-role/ml-dev/jane may not create "
                             "jobs.batch.volcano.sh in namespace training (HTTP 403); fix: grant that verb through "
                             "its access entry's policy (e.g. AmazonEKSEditPolicy for the jobs namespace) or "
                             "Kubernetes RBAC")


def test_submit_replace_waits_until_the_old_job_and_its_pods_are_gone(server):
    jobs = jobs_of(server)
    job = render(CONFIG, SPEC)[0]
    jobs.submit(job)
    server.deletion_polls = 3  # foreground deletion: the job and its pods linger
    waited = []
    jobs.submit(job, replace=True, on_wait=waited.append)
    calls = [(m, p.split("?")[0]) for m, p, *_ in server.requests]
    delete = calls.index(("DELETE", f"{JOBS_PATH}/resnet50-imagenet"))
    post = len(calls) - 1 - calls[::-1].index(("POST", JOBS_PATH))
    gone = max(i for i, call in enumerate(calls) if call == ("GET", f"{JOBS_PATH}/resnet50-imagenet"))
    assert delete < gone < post and waited  # created only after a GET found the name free
    assert server.jobs["resnet50-imagenet"]["metadata"]["name"] == "resnet50-imagenet"


def test_submit_replace_keeps_the_old_job_when_the_cluster_would_refuse_the_new_one(server):
    jobs = jobs_of(server)
    job = render(CONFIG, SPEC)[0]
    jobs.submit(job)
    server.refuse_create = (422, 'admission webhook "validatejob.volcano.sh" denied the request: '
                                 "'minAvailable' should not be greater than total replicas in tasks")
    with pytest.raises(UserError, match=r"the cluster rejected the request \(HTTP 422: admission webhook"):
        jobs.submit(job, replace=True)
    assert "resnet50-imagenet" in server.jobs  # never deleted
    assert not [r for r in server.requests if r[0] == "DELETE"]
    probe = [r for r in server.requests if r[0] == "POST" and "dryRun=All" in r[1]]
    assert probe and probe[0][3]["metadata"]["name"] == "resnet50-imagenet-replace-check"


def test_submit_replace_says_what_happened_when_the_create_fails_after_the_delete(server):
    jobs = jobs_of(server)
    job = render(CONFIG, SPEC)[0]
    jobs.submit(job)
    server.deletion_polls = 2
    refused_after_delete = []

    def refuse_once_deleted(name):  # e.g. the caller's create permission was revoked meanwhile
        refused_after_delete.append(name)
        server.refuse_create = (403, 'jobs.batch.volcano.sh is forbidden: User "jane" cannot create resource '
                                     '"jobs" in API group "batch.volcano.sh" in the namespace "training"')

    with pytest.raises(UserError) as raised:
        jobs.submit(job, replace=True, on_wait=refuse_once_deleted)
    assert refused_after_delete and "resnet50-imagenet" not in server.jobs
    assert str(raised.value).startswith("job 'resnet50-imagenet' was deleted to be replaced, and creating the new "
                                        "one failed: jane may not create jobs.batch.volcano.sh in namespace training")
    assert "submit the spec again without --replace: the job resumes from its checkpoints" in str(raised.value)


def test_a_queue_or_priority_class_the_cluster_lacks_is_refused_before_the_job_is_created(server):
    jobs = jobs_of(server)
    job = render(CONFIG, SPEC)[0]
    job["spec"]["queue"] = "reserach"
    with pytest.raises(UserError, match=r"queue: got 'reserach', which the cluster does not have; fix: allowed: "
                                        r"training"):
        jobs.submit(job)
    job["spec"]["queue"] = "training"
    job["spec"]["priorityClassName"] = "urgent"
    with pytest.raises(UserError, match=r"priority_class: got 'urgent'"):
        jobs.submit(job)
    assert not [r for r in server.requests if r[0] == "POST"]


def test_status_says_why_a_job_waits(server):
    from trainctl.backends.eks import status

    jobs = jobs_of(server)
    jobs.submit(render(CONFIG, SPEC)[0])
    server.events = [{
        "metadata": {"name": "e1", "namespace": "training"}, "type": "Warning", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        "involvedObject": {"kind": "PodGroup", "name": "resnet50-imagenet-2f1c"},
        "lastTimestamp": "2026-11-22T10:00:00Z"}]
    report = status(jobs, "resnet50-imagenet")
    assert report.waiting == ["PodGroup resnet50-imagenet-2f1c: Unschedulable: 0/3 nodes are available: "
                              "3 Insufficient nvidia.com/gpu."]
    assert "waiting because:" in report.format()

"""A job's trainer arguments are judged by the trainer's own config model before anything is
rendered or submitted, on the platform side, without torch (issue 17, item 2)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import yaml

from config.job_spec import parse_job_spec
from tests.trainctl_fixtures import one_error
from tests.conftest import REPO
from tests.unit.test_trainctl_kube import CONFIG
from typed_config import ConfigError

EXAMPLE_JOB = yaml.safe_load((REPO / "k8s_charts" / "examples" / "resnet50-p4d.yaml").read_text())


def job(trainer_args: dict | None = None, **fields) -> dict:
    data = copy.deepcopy(EXAMPLE_JOB)
    data["trainer_args"].update(trainer_args or {})
    data.update(fields)
    return data


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_spec(data, CONFIG, "job.yaml")
    return caught.value.problems


@pytest.mark.parametrize(("args", "line"), [
    ({"optim.lrr": 0.1}, "trainer_args.optim.lrr: unknown key; allowed keys here: betas, decay_norms_and_biases, "),
    ({"optimm.lr": 0.1}, "trainer_args.optimm: unknown key; allowed keys here: checkpoint, data, distributed, eval, "),
    ({"optim.lr": None}, "trainer_args.optim.lr: got null; allowed: a valid number"),
    ({"optim.lr": "fast"}, 'trainer_args.optim.lr: got "fast"; allowed: a valid number'),
    ({"optim.lr": float("inf")}, 'trainer_args.optim.lr: got "inf"; allowed: a finite number'),
    ({"train.precision": "fp8"}, "trainer_args.train.precision: got \"fp8\"; allowed: 'auto', 'fp32', 'bf16' or 'fp16'"),
    ({"model.name": "resnet51"}, 'trainer_args.model.name: got "resnet51"; allowed: resnet18, '),
    ({"data.kind": "mlm_shards"}, 'trainer_args.data.kind: got "mlm_shards"; allowed: synthetic or imagefolder '
                                  "for resnet50"),
    ({"checkpoint.dir": "/fsx/mine"}, 'trainer_args.checkpoint.dir: got "/fsx/mine" (the job spec sets it); '
                                      "allowed: set checkpoint_path in the job spec instead"),
    ({"checkpoint": {"dir": "/fsx/mine"}}, 'trainer_args.checkpoint.dir: got "/fsx/mine" (the job spec sets it)'),
    ({"optim.betas": "[0.9"}, 'trainer_args.optim.betas: got "[0.9", which does not parse'),
    # Replacing needs what the spec's field gives the pods (a token that may taint their node).
    ({"metrics.straggler_policy": "replace"}, 'trainer_args.metrics.straggler_policy: got "replace" (the job spec '
                                              "sets it); allowed: set straggler_policy in the job spec instead"),
])
def test_a_bad_trainer_argument_is_one_line_naming_it(args, line):
    found = problems(job(args))
    assert len(found) == 1 and found[0].startswith(line), found


def test_the_example_jobs_pass_and_their_pods_get_what_was_judged():
    spec = parse_job_spec(job(), CONFIG)
    flags = spec.trainer_flags(CONFIG)
    assert "--optim.lr=0.8" in flags and "--checkpoint.dir=/fsx/checkpoints/resnet50-imagenet" in flags
    for path in (REPO / "k8s_charts" / "examples").glob("*.yaml"):
        parse_job_spec(yaml.safe_load(path.read_text()), CONFIG, str(path))


def test_with_a_trainer_config_file_only_the_jobs_own_keys_are_judged():
    # The file (inside the image) may set model.name: bert_base, which mlm_shards needs: not a mistake here.
    with_file = job({"data.kind": "mlm_shards"}, trainer_config="/fsx/configs/bert.yaml")
    parse_job_spec(with_file, CONFIG)
    # A key's own type and bounds still are.
    assert problems(job({"optim.lr": -1}, trainer_config="/fsx/configs/bert.yaml")) == [
        "trainer_args.optim.lr: got -1; allowed: greater than 0"]
    assert problems(job({"optim.lrr": 1}, trainer_config="/fsx/c.yaml"))[0].startswith(
        "trainer_args.optim.lrr: unknown key")


def test_render_refuses_a_typo_in_one_line_and_prints_no_manifest(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job({"optim.lrr": 0.1})))
    result = subprocess.run([sys.executable, "-m", "trainctl", "render", str(path)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert one_error(result.stderr) == (
        f"config error: {path}: trainer_args.optim.lrr: unknown key; allowed keys here: betas, "
        "decay_norms_and_biases, grad_clip_norm, lr, momentum, name, schedule, warmup_steps, weight_decay")


def test_the_trainer_config_model_imports_without_torch():
    code = ("import sys; import training.config, config.job_spec, trainctl.backends.eks; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_config_error_in_the_pod_exits_with_the_status_no_layer_retries():
    from k8s_charts.job_charts import job_policies
    from training.launcher.main import EXIT_CONFIG, main

    assert {"exitCode": EXIT_CONFIG, "action": "TerminateJob"} in [policy.to_dict() for policy in job_policies()]
    argv = ["--nnodes=1", "--nproc-per-node=1", "-m", "training", "train", "--optim.lrr=0.1"]
    assert main(argv) == EXIT_CONFIG  # before any agent starts: torchrun has nothing to restart


@pytest.mark.parametrize(("fields", "line"), [
    ({"queue": "Research Team"}, 'queue: got "Research Team"; allowed: a Kubernetes name: lowercase letters, '
                                 "digits and '-', at most 63"),
    ({"priority_class": ""}, 'priority_class: got ""; allowed: a Kubernetes name'),
    ({"priority_class": "system-node-critical"}, 'priority_class: got "system-node-critical" (system- classes are '
                                                 "reserved for the cluster's own critical pods)"),
])
def test_queue_and_priority_class_are_kubernetes_names_and_not_the_systems(fields, line):
    found = problems(job(**fields))
    assert len(found) == 1 and found[0].startswith(line), found


def test_the_job_spec_and_the_config_share_one_kubernetes_name_and_its_wording():
    from config import fields as model, loader
    from config import job_spec

    assert job_spec.K8sName is model.K8sName
    assert job_spec._PATTERN_HELP[model.K8S_NAME_PATTERN] == loader._PATTERN_HELP[model.K8S_NAME_PATTERN]


def test_replacing_stragglers_is_the_specs_choice_and_gives_its_pods_a_token():
    from trainctl.backends.eks import render

    spec = parse_job_spec(job(straggler_policy="replace"), CONFIG)
    assert "--metrics.straggler_policy=replace" in spec.trainer_flags(CONFIG)
    pod = render(CONFIG, spec)[-1]["spec"]["tasks"][0]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == "trainer"
    default = parse_job_spec(job(), CONFIG)
    assert not [f for f in default.trainer_flags(CONFIG) if "straggler_policy" in f]
    assert render(CONFIG, default)[-1]["spec"]["tasks"][0]["template"]["spec"]["automountServiceAccountToken"] is False
    assert problems(job(straggler_policy="evict")) == [
        "straggler_policy: got \"evict\"; allowed: 'report' or 'replace'"]

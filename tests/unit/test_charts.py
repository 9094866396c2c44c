"""The cdk8s charts: the job spec's rules, what the manifests say, and that Kubernetes and Volcano accept them."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cdk8s import App

from config import CATALOG, parse_config
from config.catalog import accelerated_types
from k8s_charts.job_charts import TERMINATION_GRACE_SECONDS, DataPrepChart
from config.job_spec import load_job_spec, parse_job_spec
from k8s_charts.platform_charts import LustreVolumeValues
from k8s_charts.render import manifests, render_job, render_platform
from k8s_charts.volcano import SCHEDULER_ACTIONS, helm_values
from training.contract import LAUNCHER_ENTRY, launch_command, launcher_copy_command
from tests.conftest import REPO, example_data
from typed_config import ConfigError

CRDS = REPO.parent / "shared" / "crds" / "volcano-v1.15.1"
EXAMPLES = REPO / "k8s_charts" / "examples"
VOLUME = LustreVolumeValues("fs-0123456789abcdef0", "fs-0123456789abcdef0.fsx.us-west-2.amazonaws.com", "abcdefgh", 1200)
CONFIG = parse_config(example_data())
# A job running its own program in its own image (docs/job-spec.md, "Your own torchrun program"),
# rendered beside the examples: snapshot, kubernetes-validate, the Volcano CRDs and the pod rules.
PROGRAM_JOB = {
    "name": "own-program", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/llm:torchtitan-0.2.0",
    "node_group": "p4d", "min_nodes": 1, "max_nodes": 2,
    "program": {"module": "torchtitan.train", "args": ["--job.config_file=/fsx/configs/llama3_8b.toml"]},
    "env": {"HF_HOME": "/fsx/cache/huggingface"},
}
# A job that must sit under one layer-2 network node (docs/job-spec.md, "Placement by network topology"),
# rendered beside the examples for the same checks: its Job carries spec.networkTopology.
TOPOLOGY_JOB = {
    "name": "network-hard", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0",
    "node_group": "p4d", "min_nodes": 2, "max_nodes": 4, "network_topology": {"mode": "hard", "tier": 2},
}


def render(config=CONFIG, specs=None, volume=VOLUME) -> dict[str, list[dict]]:
    app = App()
    render_platform(app, config, volume)
    specs = specs if specs is not None else [*(load_job_spec(p, config) for p in sorted(EXAMPLES.glob("*.yaml"))),
                                              parse_job_spec(PROGRAM_JOB, config), parse_job_spec(TOPOLOGY_JOB, config)]
    for spec in specs:
        render_job(app, config, spec)
    if specs:
        DataPrepChart(app, "prepare-imagenet", config, specs[0].image)
    return manifests(app)


def all_objects(rendered) -> list[dict]:
    return [obj for objects in rendered.values() for obj in objects]


def the_job(rendered, name) -> dict:
    return next(o for o in rendered[name] if o["kind"] == "Job")


def container(job) -> dict:
    return job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]


def flag(command: list[str], name: str) -> str:
    return next(part.split("=", 1)[1] for part in command if part.startswith(f"--{name}="))


RENDERED = render()


# --- snapshots and schema validation ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_manifest_snapshot(name, snapshot):
    assert yaml.safe_dump_all(RENDERED[name], sort_keys=False) == snapshot


BUILT_IN = [o for o in all_objects(RENDERED) if "volcano.sh" not in o["apiVersion"]
            and not o["apiVersion"].startswith("cert-manager.io/")]


@pytest.mark.parametrize("obj", BUILT_IN, ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_built_in_kinds_pass_kubernetes_validate_strict(obj):
    version = f"{CONFIG.cluster.kubernetes_version}.0"
    kubernetes_validate.validate(obj, version, strict=True)


@functools.cache
def _crd_validator(name: str, crds: Path = CRDS) -> jsonschema.protocols.Validator:
    """A CRD's schema, checked once and compiled once: each CRD is thousands of YAML lines (seconds a read)."""
    schema = _crd_schema(crds / name)
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def _crd_schema(path: Path) -> dict:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])

    def tighten(node):
        if isinstance(node, dict):
            if node.pop("x-kubernetes-int-or-string", False):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            # The API server prunes unknown fields of structural schemas; here they are errors.
            if node.get("type") == "object" and "properties" in node and not node.get(
                    "x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in list(node.values()):
                tighten(value)
        elif isinstance(node, list):
            for item in node:
                tighten(item)

    tighten(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


VOLCANO_KINDS = {"Job": "batch.volcano.sh_jobs.yaml", "Queue": "scheduling.volcano.sh_queues.yaml",
                 "PodGroup": "scheduling.volcano.sh_podgroups.yaml"}
VOLCANO_OBJECTS = [o for o in all_objects(RENDERED) if "volcano.sh" in o["apiVersion"]]


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"Volcano CRD schemas not found at {CRDS}")
@pytest.mark.parametrize("obj", VOLCANO_OBJECTS, ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_volcano_objects_match_the_crd_schemas(obj):
    _crd_validator(VOLCANO_KINDS[obj["kind"]]).validate(obj)


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"Volcano CRD schemas not found at {CRDS}")
def test_the_crd_check_catches_a_misspelt_field():
    job = copy.deepcopy(the_job(RENDERED, "resnet50-imagenet"))
    job["spec"]["minAvailabel"] = 2
    with pytest.raises(jsonschema.ValidationError):
        _crd_validator(VOLCANO_KINDS["Job"]).validate(job)


# --- what the training job says ---------------------------------------------------------------


def test_a_program_job_runs_its_program_under_the_injected_launcher_in_its_own_image():
    job = the_job(RENDERED, "own-program")
    pod = job["spec"]["tasks"][0]["template"]["spec"]
    trainer = container(job)
    assert trainer["image"] == PROGRAM_JOB["image"]
    expected = launch_command(min_nodes=1, max_nodes=2, nproc_per_node=8, endpoint=flag(trainer["command"], "rdzv-endpoint"),
                              run_id="$(PODGROUP)-v$(JOB_VERSION)", max_restarts=100, local_addr="$(POD_IP)",
                              grace_period_s=TERMINATION_GRACE_SECONDS, program=["-m", "torchtitan.train",
                              "--job.config_file=/fsx/configs/llama3_8b.toml"], launcher=LAUNCHER_ENTRY)
    assert trainer["command"] == expected
    assert trainer["command"][:2] == ["python", "/platform-launcher/training/launcher/__main__.py"]
    assert not any(arg.startswith("--start-method") for arg in trainer["command"])
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["PLATFORM_CHECKPOINT_DIR"] == "/fsx/checkpoints/own-program" and "PYTHONPATH" not in env
    assert env["HF_HOME"] == "/fsx/cache/huggingface"
    writable, launcher, _node_labels = pod["initContainers"]
    assert writable["image"] == launcher["image"] == CONFIG.jobs.launcher_image  # the platform's image, not theirs
    assert launcher["command"] == launcher_copy_command("/platform-launcher") and launcher["workingDir"] == "/app"
    assert launcher["volumeMounts"] == [{"name": "platform-launcher", "mountPath": "/platform-launcher"}]
    assert {"name": "platform-launcher", "mountPath": "/platform-launcher", "readOnly": True} in trainer["volumeMounts"]
    assert {"name": "platform-launcher", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    check = container(the_job(RENDERED, "own-program-nccl-check"))
    assert check["image"] == CONFIG.jobs.launcher_image and "allreduce-bench" in check["command"]
    check_pod = the_job(RENDERED, "own-program-nccl-check")["spec"]["tasks"][0]["template"]["spec"]
    assert [init["name"] for init in check_pod["initContainers"]] == ["node-labels"]  # no launcher, no directories


def test_a_program_job_without_a_launcher_image_or_with_trainer_fields_is_one_line_each():
    data = example_data()
    data["jobs"].pop("launcher_image")
    with pytest.raises(ConfigError) as caught:
        parse_job_spec(PROGRAM_JOB, parse_config(data))
    assert caught.value.problems == [
        'program: got {"module": "torchtitan.train", "args": ["--job.config_file=/fsx/configs/llama3_8b.toml"]} '
        "(the pods need the platform's launcher image); allowed: the packaged trainer only (no program), until the "
        "platform config sets jobs.launcher_image"]
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**PROGRAM_JOB, "trainer_args": {"train.epochs": 3}, "dataset_path": "/fsx/datasets/c4",
                        "env": {"PLATFORM_CHECKPOINT_DIR": "/tmp"}, "straggler_policy": "replace"}, CONFIG)
    assert caught.value.problems == [
        'trainer_args: got {"train.epochs": 3}; allowed: nothing with program: the packaged trainer\'s setting; give '
        "your program its own in program.args or env",
        'dataset_path: got "/fsx/datasets/c4"; allowed: nothing with program: the packaged trainer\'s setting; give '
        "your program its own in program.args or env",
        'straggler_policy: got "replace"; allowed: report with program (the packaged trainer names and replaces '
        "stragglers)",
        'env.PLATFORM_CHECKPOINT_DIR: got "/tmp"; allowed: nothing: the platform sets it from checkpoint_path',
    ]


@pytest.mark.parametrize(("program", "expected"), [
    ({}, 'program: got {"module": null, "script": null}; allowed: exactly one of program.module (python -m) and '
         "program.script"),
    ({"module": "a", "script": "/b.py"}, 'program: got {"module": "a", "script": "/b.py"}; allowed: exactly one of '
                                         "program.module (python -m) and program.script"),
    ({"module": "torchtitan-train"}, 'program.module: got "torchtitan-train"; allowed: a dotted Python module name, '
                                     "e.g. torchtitan.train"),
    ({"module": "torchtitan..train"}, 'program.module: got "torchtitan..train"; allowed: a dotted Python module name, '
                                      "e.g. torchtitan.train"),
    ({"script": "train.py"}, 'program.script: got "train.py"; allowed: an absolute path to a file inside the image, '
                             "without '..', e.g. /workspace/train.py"),
    ({"script": "/workspace/../etc/x.py"}, 'program.script: got "/workspace/../etc/x.py"; allowed: an absolute path '
                                           "to a file inside the image, without '..', e.g. /workspace/train.py"),
    ({"module": "m", "args": ["--a", 3]}, "program.args[1]: got 3; allowed: a valid string"),
    ({"module": "m", "args": "--a=3"}, 'program.args: got "--a=3"; allowed: a valid list'),
    ({"module": "m", "argv": []}, "program.argv: unknown key; allowed keys here: args, module, script"),
])
def test_each_bad_program_is_one_line(program, expected):
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**PROGRAM_JOB, "program": program}, CONFIG)
    assert caught.value.problems == [expected]



def config_with(instance_type: str):
    data = example_data()
    data["accelerated_node_groups"] = [{"name": "g", "instance_type": instance_type, "min_size": 0,
                                        "desired_size": 0, "max_size": 4}]
    return parse_config(data)


@pytest.mark.parametrize("instance_type", accelerated_types())
def test_gpus_efa_and_nproc_come_from_the_catalog(instance_type):
    config = config_with(instance_type)
    spec = parse_job_spec({"name": "j", "image": "repo.example.com/t:1", "node_group": "g", "max_nodes": 2}, config)
    job = the_job(render(config, [spec], None), "j")
    facts = CATALOG[instance_type]
    c = container(job)
    assert flag(c["command"], "nproc-per-node") == str(facts.nproc_per_node)
    assert c["resources"]["limits"][facts.accelerator_resource] == facts.accelerator_count
    assert c["resources"]["limits"].get("vpc.amazonaws.com/efa", 0) == facts.efa_interfaces
    assert ("FI_PROVIDER" in {e["name"] for e in c["env"]}) == facts.supports_efa
    pod = job["spec"]["tasks"][0]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": instance_type}
    assert pod["tolerations"][0]["key"] == facts.taint_key
    assert int(c["resources"]["requests"]["cpu"]) < facts.vcpus  # headroom for the system


def test_the_job_specs_scale_up_window_reaches_the_rendezvous():
    data = yaml.safe_load((EXAMPLES / "resnet50-p4d.yaml").read_text())
    spec = parse_job_spec({**data, "scale_up_after_s": 5}, CONFIG)
    from k8s_charts.job_charts import pod_command

    assert "scale_up_after_s=5," in flag(pod_command(spec, CONFIG, ["train"]), "rdzv-conf")
    with pytest.raises(ConfigError, match="scale_up_after_s"):
        parse_job_spec({**data, "scale_up_after_s": -1}, CONFIG)


def test_the_training_job_runs_the_platform_launcher_with_its_settings():
    job = the_job(RENDERED, "resnet50-imagenet")
    command = container(job)["command"]
    spec = load_job_spec(EXAMPLES / "resnet50-p4d.yaml", CONFIG)
    expected = launch_command(min_nodes=2, max_nodes=4, nproc_per_node=8,
                              endpoint=",".join(f"https://etcd-{i}.etcd-peers.training-platform.svc.cluster.local:2379"
                                                for i in range(3)),
                              run_id="$(PODGROUP)-v$(JOB_VERSION)", max_restarts=spec.max_restarts,
                              local_addr="$(POD_IP)", grace_period_s=TERMINATION_GRACE_SECONDS)
    assert command[:len(expected)] == expected  # built by launch_command, nothing added in between
    assert command[:3] == ["python", "-m", "training.launcher"] and expected[-3:] == ["-m", "training", "train"]
    assert flag(command, "nnodes") == "2:4" and job["spec"]["minAvailable"] == 2
    assert job["spec"]["tasks"][0]["replicas"] == 4
    assert flag(command, "rdzv-backend") == "platform-etcd" and flag(command, "start-method") == "forkserver"
    assert "keep_alive_interval=0.25" in flag(command, "rdzv-conf") and "outage_tolerance=600" in flag(
        command, "rdzv-conf")
    assert f"scale_up_after_s={spec.scale_up_after_s}" in flag(command, "rdzv-conf")
    # torchrun's 30 s default would SIGKILL checkpointing workers long before the pod's grace ends.
    assert int(flag(command, "shutdown-timeout")) == TERMINATION_GRACE_SECONDS - 15
    env = {e["name"]: e for e in container(job)["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
    annotations = {name: env[name]["valueFrom"]["fieldRef"]["fieldPath"] for name in ("PODGROUP", "JOB_VERSION")}
    assert annotations == {"PODGROUP": "metadata.annotations['scheduling.k8s.io/group-name']",
                           "JOB_VERSION": "metadata.annotations['volcano.sh/job-version']"}
    assert {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCHINDUCTOR_CACHE_DIR": "/fsx/cache/resnet50-imagenet/inductor"}.items() <= {
        k: v.get("value") for k, v in env.items()}.items()
    assert flag(command, "checkpoint.dir") == "/fsx/checkpoints/resnet50-imagenet"
    # Written beside the S3-linked tree, renamed into it: nothing half-written is exported.
    assert flag(command, "checkpoint.staging_dir") == "/fsx/staging/resnet50-imagenet"
    assert flag(command, "data.path") == "/fsx/datasets/imagenet/train"
    assert flag(command, "distributed.timeout_s") == "30"  # a dead GPU peer fails the step in 30 s


def test_a_lost_pod_is_replaced_alone_and_only_total_failure_restarts_the_job():
    spec = the_job(RENDERED, "resnet50-imagenet")["spec"]
    assert spec["schedulerName"] == "volcano" and spec["queue"] == "training"
    # No plugins: a RestartPod would delete and recreate their objects (killPods, v1.15.1).
    assert "plugins" not in spec
    # Exit-code policies first (Volcano takes the first match); no PodEvicted policy, so a deleted
    # pod is recreated alone by the controller's sync, and a SIGTERMed agent (143) asks for nothing.
    assert spec["policies"] == [{"exitCode": 78, "action": "TerminateJob"},
                                {"exitCode": 76, "action": "TerminateJob"},
                                {"exitCode": 77, "action": "TerminateJob"},
                                {"exitCode": 79, "action": "RestartJob"},
                                {"exitCode": 143, "action": "ResumeJob"},
                                {"event": "PodFailed", "action": "RestartPod"}]
    assert spec["maxRetry"] == 2**31 - 1  # out of reach: the agent bounds crash loops
    assert spec["minSuccess"] == 1  # done when training is, whatever pods still wait for nodes
    assert spec["ttlSecondsAfterFinished"] == 86400
    template = spec["tasks"][0]["template"]
    assert template["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    pod = template["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == TERMINATION_GRACE_SECONDS
    lost = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"] if t.get("effect") == "NoExecute"}
    assert lost == {"node.kubernetes.io/not-ready": 60, "node.kubernetes.io/unreachable": 60}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["fsx"]["persistentVolumeClaim"]["claimName"] == "fsx"


def test_the_nccl_check_runs_once():
    spec = the_job(RENDERED, "resnet50-imagenet-nccl-check")["spec"]
    # Not 0: Volcano's mutating webhook would make it 3 (mutate_job.go patchDefaultMaxRetry).
    assert spec["maxRetry"] == 1
    assert spec["policies"] == [{"events": ["PodFailed", "PodEvicted"], "action": "TerminateJob"}]


def test_the_nccl_check_requires_efa_on_all_nodes():
    job = the_job(RENDERED, "resnet50-imagenet-nccl-check")
    command = container(job)["command"]
    module = max(i for i, part in enumerate(command) if part == "-m")
    assert command[module + 1:module + 3] == ["training", "allreduce-bench"] and "--require-efa" in command
    assert job["spec"]["minAvailable"] == 4 and flag(command, "nnodes") == "4:4"


def test_efa_pods_use_no_huge_pages_and_request_none():
    c = container(the_job(RENDERED, "resnet50-imagenet"))
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FI_EFA_FORK_SAFE"] == "1" and env["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert not [r for r in c["resources"]["limits"] if r.startswith("hugepages-")]


def test_spot_pods_watch_for_the_interruption_notice():
    spot_group = {"name": "g5", "instance_type": "g5.xlarge", "min_size": 0, "desired_size": 0, "max_size": 4,
                  "placement_group": False, "capacity_type": "SPOT"}
    config = parse_config({**example_data(), "accelerated_node_groups": [spot_group]})
    spec = parse_job_spec({"name": "spot-job", "image": "repo.example.com/trainer:1", "node_group": "g5"}, config)
    spot = {e["name"]: e.get("value") for e in container(the_job(render(config, [spec]), "spot-job"))["env"]}
    on_demand = {e["name"] for e in container(the_job(RENDERED, "resnet50-imagenet"))["env"]}
    assert spot["PLATFORM_SPOT_NOTICE"] == "imds" and "PLATFORM_SPOT_NOTICE" not in on_demand


def test_trn1_runs_one_worker_per_neuron_core_with_its_compile_cache_on_fsx_and_no_nccl_check():
    job = the_job(RENDERED, "bert-large-mlm")
    c = container(job)
    assert flag(c["command"], "nproc-per-node") == "32"
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] == 16
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 8
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NEURON_CC_FLAGS"] == "--cache_dir=/fsx/cache/bert-large-mlm/neuron"
    assert env["CCOM_SOCKET_IFNAME"] == "eth0"
    assert "bert-large-mlm-nccl-check" not in RENDERED  # allreduce-bench cannot drive Neuron collectives
    assert "--distributed.timeout_s=30" not in c["command"]


# --- platform charts --------------------------------------------------------------------------


def etcd_object(kind: str, name: str | None = None) -> dict:
    return next(o for o in RENDERED["etcd"] if o["kind"] == kind and name in (None, o["metadata"]["name"]))


def test_etcd_is_three_members_on_separate_system_nodes_each_on_its_own_volume():
    members = etcd_object("StatefulSet")
    pod = members["spec"]["template"]["spec"]
    args = pod["containers"][0]["command"][1:]
    assert members["spec"]["replicas"] == 3 and members["spec"]["podManagementPolicy"] == "Parallel"
    assert members["spec"]["serviceName"] == "etcd-peers"
    assert etcd_object("Service", "etcd-peers")["spec"]["clusterIP"] == "None"
    assert etcd_object("Service", "etcd-peers")["spec"]["publishNotReadyAddresses"] is True
    assert "--initial-cluster=" + ",".join(
        f"etcd-{i}=https://etcd-{i}.etcd-peers.training-platform.svc.cluster.local:2380" for i in range(3)) in args
    assert "--name=$(POD_NAME)" in args and "--listen-peer-urls=https://$(POD_IP):2380" in args
    # The rendezvous needs only v3 (etcd 3.6 removed v2); Raft timing that lets a lease be 1 s.
    assert not [a for a in args if "enable-v2" in a] and "--listen-client-urls=https://0.0.0.0:2379" in args
    assert {"--heartbeat-interval=50", "--election-timeout=500", "--auto-compaction-mode=periodic"} <= set(args)
    assert pod["containers"][0]["image"].startswith("quay.io/coreos/etcd:v3.5.")
    assert pod["nodeSelector"] == {"training-platform/node-role": "system"}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == [{"labelSelector": {"matchLabels": {"app.kubernetes.io/name": "etcd"}},
                     "topologyKey": "kubernetes.io/hostname"}]
    lost = {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]}
    assert lost == {"node.kubernetes.io/not-ready": 30, "node.kubernetes.io/unreachable": 30}
    probes = {p: pod["containers"][0][p]["httpGet"] for p in ("readinessProbe", "livenessProbe")}
    assert probes == {"readinessProbe": {"path": "/readyz", "port": 2381},
                      "livenessProbe": {"path": "/livez", "port": 2381}}
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in args
    assert pod["automountServiceAccountToken"] is False
    claim = members["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "gp3" and claim["resources"]["requests"]["storage"] == "2Gi"
    assert etcd_object("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    service = etcd_object("Service", "etcd")
    assert service["spec"]["ports"][0]["port"] == 2379
    annotations = members["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def test_etcds_volume_size_comes_from_the_config():
    data = example_data()
    data["jobs"] = {"etcd": {"persistent_volume_gib": 5}}
    members = next(o for o in render(parse_config(data), [], None)["etcd"] if o["kind"] == "StatefulSet")
    assert members["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "5Gi"


def test_the_fsx_volume_is_bound_statically_to_the_stacks_file_system():
    volume = next(o for o in RENDERED["storage"] if o["kind"] == "PersistentVolume")
    claim = next(o for o in RENDERED["storage"] if o["kind"] == "PersistentVolumeClaim")
    csi = volume["spec"]["csi"]
    assert csi == {"driver": "fsx.csi.aws.com", "volumeHandle": VOLUME.file_system_id,
                   "volumeAttributes": {"dnsname": VOLUME.dns_name, "mountname": VOLUME.mount_name}}
    assert volume["spec"]["accessModes"] == ["ReadWriteMany"] and volume["spec"]["mountOptions"] == ["flock"]
    assert volume["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]


def test_queue_and_priority_class_come_from_config():
    kinds = {o["kind"]: o for o in RENDERED["scheduling"]}
    assert kinds["Queue"]["metadata"]["name"] == "training" and kinds["Queue"]["spec"]["weight"] == 1
    assert kinds["PriorityClass"]["value"] == 1000


def test_the_volcano_policy_leaves_out_enqueue_so_pods_exist_for_the_autoscaler():
    assert "enqueue" not in SCHEDULER_ACTIONS
    policy = yaml.safe_load(helm_values({})["custom"]["scheduler_config_override"])
    assert policy["actions"] == "allocate, backfill"
    assert {"name": "gang"} in policy["tiers"][0]["plugins"]


def test_data_preparation_runs_the_trainer_subcommand_on_system_nodes():
    job = RENDERED["prepare-imagenet"][0]
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"training-platform/node-role": "system"}
    assert pod["containers"][0]["command"][:4] == ["python", "-m", "training", "prepare-imagenet"]


# --- bad job specs: one line each ---------------------------------------------------------------


BASE = {"name": "j", "image": "repo.example.com/trainer:gpu-1", "node_group": "p4d"}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"node_group": "p5"}, 'node_group: got "p5" (not a node group of this platform); allowed: p4d, trn1'),
        ({"accelerators_per_node": 16},
         "accelerators_per_node: got 16 (p4d.24xlarge has 8 A100); allowed: 1 to 8"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes: got 3; allowed: at most max_nodes (2)"),
        ({"max_nodes": 9}, "max_nodes: got 9; allowed: at most 4, the node group's max_size"),
        ({"image": "trainer:latest"}, 'image: got "trainer:latest"; allowed: an image pinned by tag or digest'),
        # A repository with capitals: the runtime's pull fails and the job waits in ErrImagePull.
        ({"image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/Trainer:gpu-0.1.0"},
         'image: got "123456789012.dkr.ecr.us-west-2.amazonaws.com/Trainer:gpu-0.1.0"; allowed: an image pinned by '
         'tag or digest, its repository in lowercase'),
        ({"name": "Resnet_50"}, 'name: got "Resnet_50"; allowed: lowercase letters, digits and'),
        ({"checkpoint_path": "/tmp/ck"}, 'checkpoint_path: got "/tmp/ck"; allowed: an absolute path on the shared'),
        ({"gpus": 8}, "gpus: unknown key; allowed keys here: accelerators_per_node,"),
    ],
)
def test_each_bad_job_spec_is_one_line(changes, expected):
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**BASE, **changes}, CONFIG)
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(expected), caught.value.problems[0]


def test_a_spec_with_several_mistakes_reports_them_all_in_one_run():
    """Not one mistake per run (issue 36): the spec's own rules, those against the platform, and
    the trainer's arguments, even when the rest of the spec is wrong."""
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**BASE, "image": "trainer:latest", "min_nodes": 10, "max_nodes": 9,
                        "accelerators_per_node": 16, "trainer_args": {"optim.lrr": 0.1}}, CONFIG)
    assert [p.split(":")[0] for p in caught.value.problems] == [
        "image", "min_nodes", "max_nodes", "accelerators_per_node", "trainer_args.optim.lrr"]
    with pytest.raises(ConfigError) as caught:  # a field error too: pydantic then skips the rules
        parse_job_spec({**BASE, "name": "Resnet_50", "max_nodes": "four", "trainer_args": {"train.epochs": -1}}, CONFIG)
    assert [p.split(":")[0] for p in caught.value.problems] == ["name", "max_nodes", "trainer_args.train.epochs"]


def test_efa_on_a_type_without_it_is_one_line():
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**BASE, "node_group": "g", "efa": True}, config_with("p3.8xlarge"))
    assert caught.value.problems == ["efa: got true (p3.8xlarge has no EFA interfaces); allowed: false or null"]


def test_the_renderer_writes_dist_and_reports_a_bad_spec_in_one_line(tmp_path):
    outputs = tmp_path / "outputs.json"
    outputs.write_text('{"mltrain-storage": {"FileSystemId": "fs-1", "FileSystemDnsName": "d", '
                       '"FileSystemMountName": "m"}}')
    ok = subprocess.run([sys.executable, "-m", "k8s_charts", "--job", str(EXAMPLES / "resnet50-p4d.yaml"),
                         "--outputs", str(outputs), "--out", str(tmp_path / "dist")],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert sorted(p.name for p in (tmp_path / "dist").glob("*.yaml")) == [
        "etcd-certificates.yaml", "etcd.yaml", "namespaces.yaml", "node-check.yaml", "prepare-imagenet.yaml",
        "resnet50-imagenet-nccl-check.yaml",
        "resnet50-imagenet.yaml", "scheduling.yaml", "storage-class.yaml", "storage.yaml"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: j\nimage: repo.example.com/t:1\nnode_group: p5\n")
    result = subprocess.run([sys.executable, "-m", "k8s_charts", "--job", str(bad), "--out", str(tmp_path / "dist")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f'config error: {bad}: node_group: got "p5" (not a node group of this '
                                     'platform); allowed: p4d, trn1')
    assert (tmp_path / "dist" / "storage.yaml").exists()  # nothing was overwritten


@pytest.mark.parametrize("case", ["platform name", "the same job twice", "broken outputs"])
def test_the_renderer_refuses_what_would_overwrite_or_crash_in_one_line(tmp_path, case):
    # Each of these used to end in a traceback (cdk8s: "There is already a Construct with name ...",
    # or json's decoder message), after a platform manifest could have been overwritten in dist/.
    example = EXAMPLES / "resnet50-p4d.yaml"
    args, expected = {
        "platform name": ([], "error: --job {job}: name: got 'etcd', whose manifest etcd.yaml would overwrite the "
                              "platform's; allowed: a name no other manifest uses"),
        "the same job twice": ([str(example)], f"error: --job {example}: name: got 'resnet50-imagenet', whose manifest "
                                               f"resnet50-imagenet.yaml would overwrite the one of --job {example}; "
                                               "allowed: a name no other manifest uses"),
        "broken outputs": (["--outputs", str(tmp_path / "outputs.json")],
                           f"error: --outputs: {tmp_path / 'outputs.json'} is not JSON (Expecting property name enclosed "
                           "in double quotes, line 1 column 2); allowed: the file `cdk deploy --outputs-file` writes"),
    }[case]
    job = tmp_path / "job.yaml"
    job.write_text(example.read_text().replace("name: resnet50-imagenet", "name: etcd" if case == "platform name"
                                               else "name: resnet50-imagenet"))
    (tmp_path / "outputs.json").write_text("{broken")
    first = str(job) if case == "platform name" else str(example)
    result = subprocess.run([sys.executable, "-m", "k8s_charts", "--job", first, *(
        ["--job", *args] if case == "the same job twice" else args), "--out", str(tmp_path / "dist")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr.strip()) == (2, expected.format(job=job))
    assert not (tmp_path / "dist").exists()  # nothing written


def test_kubernetes_validate_catches_a_misspelt_field():
    service = copy.deepcopy(next(o for o in RENDERED["etcd"] if o["kind"] == "Service"))
    service["spec"]["portz"] = service["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, f"{CONFIG.cluster.kubernetes_version}.0", strict=True)


# --- etcd's certificates (cert-manager.io/v1, read at cert-manager v1.20.3: deploy/crds/*.yaml) --------


def certificates() -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in RENDERED["etcd-certificates"] if o["kind"] == "Certificate"}


def test_a_self_signed_root_makes_the_ca_whose_key_stays_in_cert_managers_namespace():
    issuers = {o["metadata"]["name"]: o["spec"] for o in RENDERED["etcd-certificates"] if o["kind"] == "ClusterIssuer"}
    assert issuers == {"mltrain-etcd-selfsigned": {"selfSigned": {}}, "mltrain-etcd-ca": {"ca": {"secretName": "etcd-ca"}}}
    ca = certificates()["etcd-ca"]
    # A ClusterIssuer of type ca reads its Secret from the cluster resource namespace, which the
    # chart sets to its own (cert-manager).
    assert ca["metadata"]["namespace"] == "cert-manager" and ca["spec"]["isCA"] is True
    assert ca["spec"]["issuerRef"] == {"name": "mltrain-etcd-selfsigned", "kind": "ClusterIssuer",
                                       "group": "cert-manager.io"}


def test_members_and_jobs_get_certificates_with_the_usages_etcd_checks():
    certs = certificates()
    server, peer, client = (certs[name]["spec"] for name in ("etcd-server", "etcd-peer", "etcd-client"))
    members = [f"etcd-{i}.etcd-peers.training-platform.svc.cluster.local" for i in range(3)]
    # The JSON gateway dials its own member with the server certificate: it needs client auth too.
    assert set(server["usages"]) >= {"server auth", "client auth"} and set(members) <= set(server["dnsNames"])
    assert "etcd.training-platform.svc.cluster.local" in server["dnsNames"]
    # A member checks that a peer's certificate names the address it connects from.
    assert set(peer["usages"]) >= {"server auth", "client auth"} and peer["dnsNames"] == members
    assert client["usages"] == ["digital signature", "client auth"]
    assert certs["etcd-client"]["metadata"]["namespace"] == "training"
    for spec in (server, peer, client):
        assert spec["issuerRef"]["name"] == "mltrain-etcd-ca" and spec["issuerRef"]["kind"] == "ClusterIssuer"
        assert (spec["duration"], spec["renewBefore"]) == ("2160h", "720h")
        # Values of the CRD's enums (privateKey.algorithm, rotationPolicy; usages' KeyUsage list).
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
        assert spec["privateKey"]["rotationPolicy"] in ("Never", "Always")


def test_etcd_and_the_jobs_mount_the_secrets_cert_manager_writes():
    members = next(o for o in RENDERED["etcd"] if o["kind"] == "StatefulSet")
    secrets = {v["secret"]["secretName"] for v in members["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secrets == {certificates()["etcd-server"]["spec"]["secretName"],
                       certificates()["etcd-peer"]["spec"]["secretName"]}
    args = members["spec"]["template"]["spec"]["containers"][0]["command"]
    assert {"--client-cert-auth=true", "--peer-client-cert-auth=true",
            "--trusted-ca-file=/etc/etcd/tls/server/ca.crt", "--peer-cert-file=/etc/etcd/tls/peer/tls.crt"} <= set(args)
    pod = the_job(RENDERED, "resnet50-imagenet")["spec"]["tasks"][0]["template"]["spec"]
    assert {"name": "etcd-tls", "secret": {"secretName": certificates()["etcd-client"]["spec"]["secretName"],
                                           "defaultMode": 0o444}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in container(the_job(RENDERED, "resnet50-imagenet"))["env"]}
    assert env["PLATFORM_ETCD_CA_FILE"] == "/etc/platform/etcd-tls/ca.crt"
    assert env["PLATFORM_ETCD_CERT_FILE"] == "/etc/platform/etcd-tls/tls.crt"


# --- the typed Volcano Job and the shared pod template --------------------------------------------

def test_every_pod_comes_from_the_one_pod_template():
    """Each workload's pod is written in its fields' order; a field set outside them is an error, not dropped."""
    from k8s_charts.pods import MEMBER_POD_FIELDS, ONE_OFF_POD_FIELDS, TRAINING_POD_FIELDS, PodTemplate

    rendered = render()
    worker = rendered["resnet50-imagenet"][0]["spec"]["tasks"][0]["template"]
    pods = {"resnet50-imagenet": (worker, TRAINING_POD_FIELDS),
            "prepare-imagenet": (rendered["prepare-imagenet"][0]["spec"]["template"], ONE_OFF_POD_FIELDS),
            "etcd": (next(o for o in rendered["etcd"] if o["kind"] == "StatefulSet")["spec"]["template"],
                     MEMBER_POD_FIELDS)}
    for name, (template, fields) in pods.items():
        assert list(template["spec"]) == [f for f in fields if f in template["spec"]], name
    with pytest.raises(ValueError, match="priorityClassName set but not in its fields"):
        PodTemplate(containers=[], priority_class_name="p", fields=ONE_OFF_POD_FIELDS).spec()
    assert PodTemplate(containers=[], init_containers=(), fields=TRAINING_POD_FIELDS).spec() == {
        "automountServiceAccountToken": False, "initContainers": [], "containers": []}


def test_a_volcano_policy_matches_an_exit_code_or_events():
    from k8s_charts.volcano import Action, Event, LifecyclePolicy

    assert LifecyclePolicy(Action.RESTART_POD, events=[Event.POD_FAILED]).to_dict() == {
        "event": "PodFailed", "action": "RestartPod"}
    assert LifecyclePolicy(Action.TERMINATE_JOB, events=[Event.POD_FAILED, Event.POD_EVICTED]).to_dict() == {
        "events": ["PodFailed", "PodEvicted"], "action": "TerminateJob"}
    for both_or_neither in ({}, {"exit_code": 78, "events": [Event.POD_FAILED]}):
        with pytest.raises(ValueError, match="an exit code or events"):
            LifecyclePolicy(Action.TERMINATE_JOB, **both_or_neither)

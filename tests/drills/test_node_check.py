"""The node check (issue 50, item 1): its verdicts on what the real tools print, the whole check run
against the loopback API server with those outputs, and the admission policy that holds it to its node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import celpy
import jsonpatch
import pytest

from k8s_charts.node_check import NODE_CHECK_NAMESPACE, NODE_CHECK_SERVICE_ACCOUNT, admission_policy, expected_devices
from tests.conftest import REPO, example_data
from tests.unit.test_trainctl_kube import FakeApiServer
from tests import trainctl_fixtures
from tests.trainctl_fixtures import kubeconfig
from config import parse_config
from training.contract import (
    ACCELERATOR_LABEL, NODE_CHECK_DCGM_LEVEL_ENV, NODE_CHECK_EXPECTED_ENV, NODE_CHECK_ON_FAILURE_ENV,
    NODE_CHECK_TAINT, NODE_CHECK_TAINT_VALUE, NODE_FAILED_CHECK_LABEL, NODE_GROUP_LABEL, NODE_HEALTH_LABEL,
    NODE_NAME_ENV, NODE_ROLE_LABEL, SCALE_DOWN_DISABLED_ANNOTATION,
)
from training.node_check import checks
from training.node_check.node_api import instance_id, verdict_patch

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

OUTPUTS = REPO / "tests" / "node_check_outputs"
CONFIG = parse_config(example_data())
EXPECTED = expected_devices(CONFIG)
NODE = "ip-10-0-1-23.us-west-2.compute.internal"


def output(name: str) -> str:
    return (OUTPUTS / name).read_text()


# --- the verdicts, on recorded outputs ---------------------------------------------------------


def test_the_gpus_the_driver_sees_are_counted_against_the_catalog():
    p4d = EXPECTED["p4d"]
    assert checks.nvidia_gpus(output("nvidia-smi-p4d.csv"), 0, p4d["devices"]) == checks.Finding(
        "gpu-count", True, "8 GPU(s): NVIDIA A100-SXM4-40GB")
    lost = checks.nvidia_gpus(output("nvidia-smi-p5-one-gpu-lost.csv"), 0, 8)
    assert (lost.check, lost.passed, lost.detail) == ("gpu-count", False, "7 GPU(s) seen by the driver, 8 expected")
    no_driver = checks.nvidia_gpus(output("nvidia-smi-no-driver.txt"), 9, 8)
    assert (no_driver.check, no_driver.passed) == ("gpu-driver", False)
    assert no_driver.detail.startswith("nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate")


@pytest.mark.parametrize(("log", "passed", "detail"), [
    ("kmsg-boot-clean.txt", True, "no hardware Xid in the kernel log"),
    ("kmsg-xid13-program.txt", True, "no hardware Xid in the kernel log; program Xids [13] ignored"),
    ("kmsg-xid79.txt", False, "Xid 79 on 0000:10:1c: pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
    ("kmsg-fallen-off-no-xid.txt", False, "GPU 0000:a0:1d.0 fell off the bus"),
])
def test_hardware_xids_in_the_kernel_log_fail_a_node_and_a_programs_own_do_not(log, passed, detail):
    assert checks.kernel_xids(output(log)) == checks.Finding("xid", passed, detail)


@pytest.mark.parametrize(("name", "returncode", "level", "passed", "detail"), [
    ("dcgmi-diag-r2-pass.json", 0, 2, True, "dcgmi diag -r 2: 3 test(s) passed or skipped"),
    ("dcgmi-diag-3.3-pass.json", 0, 2, True, "dcgmi diag -r 2: 3 test(s) passed or skipped"),
    ("dcgmi-diag-r2-memory-fail.json", 226, 2, False,
     "dcgmi diag -r 2: memory: Error using CUDA API cudaMemcpy Check DCGM and system logs for errors. Reset GPU. "
     "Restart DCGM. Rerun diagnostics."),
    ("dcgmi-diag-r1-persistence-fail.json", 226, 1, False,
     'dcgmi diag -r 1: software: Persistence Mode: Persistence mode for GPU 0 is disabled. Enable persistence mode '
     'by running "nvidia-smi -i <gpuId> -pm 1 " as root.'),
    ("dcgmi-diag-runtime-error.json", 226, 2, False,
     "dcgmi diag -r 2 could not run: Couldn't find the requested GPU(s): the host engine lost them"),
])
def test_dcgm_diagnostics_pass_only_when_every_test_passed_or_was_skipped(name, returncode, level, passed, detail):
    assert checks.dcgm_diag(output(name), returncode, level) == checks.Finding("dcgm", passed, detail[:200 + 30])


def test_dcgm_that_printed_no_json_fails_with_what_it_said():
    finding = checks.dcgm_diag("Error: unable to establish a connection to the specified host: localhost\n", 255, 2)
    assert finding == checks.Finding("dcgm", False, "dcgmi diag -r 2 exited 255: Error: unable to establish a "
                                                     "connection to the specified host: localhost")


@pytest.mark.parametrize(("name", "returncode", "passed", "detail"), [
    ("fi_info-p4de.txt", 0, True, "4 EFA device(s)"),
    ("fi_info-libfabric2-p4d.txt", 0, True, "4 EFA device(s)"),  # two entries per device, counted once
    ("fi_info-p4d-one-device-missing.txt", 0, False, "3 EFA device(s) found by libfabric, 4 expected"),
    ("fi_info-none.txt", 61, False, "0 EFA device(s) found by libfabric, 4 expected"),
])
def test_efa_devices_are_counted_once_each_against_the_groups_interfaces(name, returncode, passed, detail):
    assert checks.efa_devices(output(name), returncode, EXPECTED["p4d"]["efa"]) == checks.Finding(
        "efa-count", passed, detail)


def test_neuron_devices_are_counted_against_the_catalog():
    trn1 = EXPECTED["trn1"]
    assert checks.neuron_devices(output("neuron-ls-trn1-32xlarge.json"), 0, trn1["devices"]) == checks.Finding(
        "neuron-count", True, "16 Neuron device(s), 32 NeuronCore(s)")
    assert checks.neuron_devices(output("neuron-ls-trn1-32xlarge-15-devices.json"), 0, 16) == checks.Finding(
        "neuron-count", False, "15 Neuron device(s) seen by the driver, 16 expected")


def test_what_each_group_must_show_comes_from_the_instance_catalog():
    assert EXPECTED["p4d"] == {"instance": "p4d.24xlarge", "accelerator": "nvidia", "devices": 8,
                               "device_resource": "nvidia.com/gpu", "efa": 4, "efa_resource": "vpc.amazonaws.com/efa"}
    assert EXPECTED["trn1"]["devices"] == 16 and EXPECTED["trn1"]["device_resource"] == "aws.amazon.com/neuron"


# --- the whole check, against the loopback API server -------------------------------------------


def gpu_node(taints: bool = True, gpus: int = 8, efa: int = 4) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "uid": "0f4c2a8e-1b9d-4e1e-9d5a-7f2b8c3d4e5f", "labels": {
            NODE_ROLE_LABEL: "accelerated", ACCELERATOR_LABEL: "nvidia", NODE_GROUP_LABEL: "p4d",
            "node.kubernetes.io/instance-type": "p4d.24xlarge", "topology.kubernetes.io/region": "us-west-2"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"providerID": "aws:///us-west-2a/i-0a1b2c3d4e5f60718", "taints": [
            {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
            *([{"key": NODE_CHECK_TAINT, "value": NODE_CHECK_TAINT_VALUE, "effect": "NoSchedule"}] if taints else [])]},
        "status": {"allocatable": {"cpu": "95690m", "nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)}},
    }


TOOL = """\
#!{python}
import sys, time, socket
name, args = {name!r}, sys.argv[1:]
if name == "nv-hostengine":  # DCGM's host engine: listens until the check stops it
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 5555)); s.listen()
        except OSError:
            pass
        time.sleep(60)
    sys.exit(0)
if name == "nvidia-smi" and any(a.startswith("--query-compute-apps") for a in args):
    sys.exit(0)  # nothing uses the GPUs
text, code = {text!r}, {code}
sys.stdout.write(text)
sys.exit(code)
"""


def tools(directory: Path, **outputs: tuple[str, int]) -> Path:
    """Stand-ins for the node's tools that print a recorded output each: name -> (file, exit status)."""
    directory.mkdir()
    for name in ("nvidia-smi", "fi_info", "dcgmi", "nv-hostengine", "neuron-ls"):
        if name.replace("-", "_") in outputs or name == "nv-hostengine":
            file, code = outputs.get(name.replace("-", "_"), ("", 0))
            path = directory / name
            path.write_text(TOOL.format(python=sys.executable, name=name, text=output(file) if file else "", code=code))
            path.chmod(0o755)
    return directory


GOOD = {"nvidia_smi": ("nvidia-smi-p4d.csv", 0), "fi_info": ("fi_info-p4de.txt", 0),
        "dcgmi": ("dcgmi-diag-r2-pass.json", 0)}


@pytest.fixture
def server():
    fake = FakeApiServer()
    yield fake
    fake.httpd.shutdown()


def run_check(server, tmp_path, bin_dir: Path, kernel_log: str = "kmsg-boot-clean.txt", on_failure: str = "keep",
              extra_env: dict | None = None) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBERNETES_"))}
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "KUBECONFIG": kubeconfig(tmp_path / "kubeconfig", server.url),
        NODE_NAME_ENV: NODE, NODE_CHECK_EXPECTED_ENV: json.dumps(EXPECTED), NODE_CHECK_DCGM_LEVEL_ENV: "2",
        NODE_CHECK_ON_FAILURE_ENV: on_failure, **(extra_env or {})})
    done = subprocess.run([sys.executable, "-m", "training.node_check", "--once", "--kernel-log",
                           str(OUTPUTS / kernel_log), "--device-plugin-wait", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout + done.stderr
    return done.returncode, lines[-1], done.stderr


def check_taint(node: dict) -> list[dict]:
    return [t for t in node["spec"].get("taints", []) if t["key"] == NODE_CHECK_TAINT]


def test_a_healthy_gpu_node_loses_the_taint_and_is_labelled_passed(server, tmp_path):
    server.nodes[NODE] = gpu_node()
    code, line, stderr = run_check(server, tmp_path, tools(tmp_path / "bin", **GOOD))
    assert code == 0, stderr
    node = server.nodes[NODE]
    assert check_taint(node) == []
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]  # kept
    assert node["metadata"]["labels"][NODE_HEALTH_LABEL] == "passed"
    assert SCALE_DOWN_DISABLED_ANNOTATION not in node["metadata"]["annotations"]
    assert line["passed"] is True and [c["check"] for c in line["checks"]] == [
        "gpu-count", "xid", "efa-count", "dcgm", "device-plugin", "device-plugin"]
    (event,) = server.node_events
    assert event["reason"] == "NodeCheckPassed" and event["type"] == "Normal"
    assert event["involvedObject"]["name"] == NODE and event["involvedObject"]["kind"] == "Node"


@pytest.mark.parametrize(("kernel_log", "outputs", "node", "failed", "detail"), [
    ("kmsg-xid79.txt", GOOD, {}, "xid", "Xid 79 on 0000:10:1c"),
    ("kmsg-boot-clean.txt", {**GOOD, "dcgmi": ("dcgmi-diag-r2-memory-fail.json", 226)}, {}, "dcgm", "memory: Error"),
    ("kmsg-boot-clean.txt", {**GOOD, "nvidia_smi": ("nvidia-smi-p5-one-gpu-lost.csv", 0)}, {}, "gpu-count", "7 GPU"),
    ("kmsg-boot-clean.txt", {**GOOD, "fi_info": ("fi_info-p4d-one-device-missing.txt", 0)}, {}, "efa-count", "3 EFA"),
    ("kmsg-boot-clean.txt", GOOD, {"gpus": 7}, "device-plugin", "the node offers 7 nvidia.com/gpu, 8 expected"),
    ("kmsg-boot-clean.txt", {k: v for k, v in GOOD.items() if k != "dcgmi"}, {}, "check-tools", "dcgmi is not"),
])
def test_a_failed_check_keeps_the_taint_labels_the_check_and_reports_it(server, tmp_path, kernel_log, outputs, node,
                                                                         failed, detail):
    server.nodes[NODE] = gpu_node(**node)
    code, line, stderr = run_check(server, tmp_path, tools(tmp_path / "bin", **outputs), kernel_log=kernel_log)
    assert code == 1, stderr
    after = server.nodes[NODE]
    assert check_taint(after) == [{"key": NODE_CHECK_TAINT, "value": NODE_CHECK_TAINT_VALUE, "effect": "NoSchedule"}]
    assert after["metadata"]["labels"][NODE_HEALTH_LABEL] == "failed"
    assert after["metadata"]["labels"][NODE_FAILED_CHECK_LABEL] == failed
    # kept for a look: cluster-autoscaler must not remove it meanwhile
    assert after["metadata"]["annotations"][SCALE_DOWN_DISABLED_ANNOTATION] == "true"
    assert line["passed"] is False and line["failed_check"] == failed and detail in line["detail"]
    (event,) = server.node_events
    assert event["reason"] == "NodeCheckFailed" and event["type"] == "Warning" and event["message"].startswith(failed)


def test_a_node_that_passed_before_is_not_checked_again(server, tmp_path):
    # A restarted pod, or a DaemonSet update, on a node that may be training: no DCGM beside a job.
    server.nodes[NODE] = gpu_node(taints=False)
    before = json.dumps(server.nodes[NODE], sort_keys=True)
    code, line, _ = run_check(server, tmp_path, tools(tmp_path / "bin", dcgmi=("dcgmi-diag-r2-memory-fail.json", 226)))
    assert code == 0 and line["skipped"] is True
    assert json.dumps(server.nodes[NODE], sort_keys=True) == before
    assert [r for r in server.requests if r[0] == "PATCH"] == [] and server.node_events == []


def test_a_failed_node_is_terminated_through_its_auto_scaling_group_when_the_config_says_so(server, tmp_path):
    from moto.server import ThreadedMotoServer
    import boto3

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    try:
        endpoint = f"http://127.0.0.1:{moto._server.server_port}"
        aws = dict(region_name="us-west-2", endpoint_url=endpoint, aws_access_key_id="test",
                   aws_secret_access_key="test")
        ec2 = boto3.client("ec2", **aws)
        subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
        template = ec2.create_launch_template(LaunchTemplateName="p4d", LaunchTemplateData={
            "ImageId": "ami-12c6146b", "InstanceType": "p4d.24xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
        autoscaling = boto3.client("autoscaling", **aws)
        autoscaling.create_auto_scaling_group(AutoScalingGroupName="eks-p4d", MinSize=0, MaxSize=2, DesiredCapacity=1,
                                              LaunchTemplate={"LaunchTemplateId": template}, VPCZoneIdentifier=subnet)
        (instance,) = autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"][0]["Instances"]
        node = gpu_node()
        node["spec"]["providerID"] = f"aws:///us-west-2a/{instance['InstanceId']}"
        server.nodes[NODE] = node
        code, line, stderr = run_check(
            server, tmp_path, tools(tmp_path / "bin", **GOOD), kernel_log="kmsg-xid79.txt", on_failure="terminate",
            extra_env={"AWS_ENDPOINT_URL_AUTO_SCALING": endpoint, "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test"})
        assert code == 1, stderr
        assert line["on_failure"] == "terminate"
        assert SCALE_DOWN_DISABLED_ANNOTATION not in server.nodes[NODE]["metadata"]["annotations"]
        state = ec2.describe_instances(InstanceIds=[instance["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]
        assert state["Name"] in ("shutting-down", "terminated")
        # The group keeps its size and starts a replacement.
        group = autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"][0]
        assert group["DesiredCapacity"] == 1
        assert [i["InstanceId"] for i in group["Instances"]] != [instance["InstanceId"]]
    finally:
        moto.stop()


def test_a_verdict_is_not_patched_onto_a_node_whose_taints_changed_since_it_was_read():
    read = gpu_node()
    changed = gpu_node()
    changed["spec"]["taints"].append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    patch = verdict_patch(read, passed=True, failed_check=None, keep=True)
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(changed, patch)
    assert check_taint(jsonpatch.apply_patch(read, patch)) == []


def test_the_instance_comes_from_the_nodes_provider_id():
    assert instance_id(gpu_node()) == "i-0a1b2c3d4e5f60718"
    assert instance_id({"spec": {"providerID": "kind://docker/kind/kind-worker"}}) is None


# --- the admission policy: what the check's account may change ----------------------------------


POLICY, BINDING = admission_policy()
ACCOUNT = f"system:serviceaccount:{NODE_CHECK_NAMESPACE}:{NODE_CHECK_SERVICE_ACCOUNT}"


def admitted(old: dict | None, new: dict | None, *, operation: str = "UPDATE", user: str = ACCOUNT,
             token_node: str | None = NODE, sub_resource: str | None = None) -> bool | None:
    """The policy's answer, as kube-apiserver evaluates it (matchConditions, variables, validations), with
    a CEL interpreter: None when it does not apply (another user), else whether every validation held."""
    request: dict = {"operation": operation, "name": (new or old)["metadata"]["name"], "userInfo": {"username": user}}
    if token_node is not None:
        request["userInfo"]["extra"] = {"authentication.kubernetes.io/node-name": [token_node]}
    if sub_resource:
        request["subResource"] = sub_resource
    env = celpy.Environment()
    activation = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(new),
                  "oldObject": celpy.json_to_cel(old)}

    def evaluate(expression: str, names: dict):
        return env.program(env.compile(expression)).evaluate(names)

    if not all(evaluate(c["expression"], activation) for c in POLICY["matchConditions"]):
        return None
    variables = celpy.celtypes.MapType({})
    for variable in POLICY["variables"]:  # each may read the ones before it
        variables[celpy.celtypes.StringType(variable["name"])] = evaluate(
            variable["expression"], {**activation, "variables": variables})
    names = {**activation, "variables": variables}
    for validation in POLICY["validations"]:
        result = evaluate(validation["expression"], names)
        if isinstance(result, celpy.CELEvalError) or not bool(result):
            return False
    return True


def changed(node: dict, patch: list[dict]) -> dict:
    return jsonpatch.apply_patch(node, patch)


def test_the_policy_admits_the_checks_own_verdicts_on_its_own_node():
    node = gpu_node()
    assert admitted(node, changed(node, verdict_patch(node, passed=True, failed_check=None, keep=True))) is True
    assert admitted(node, changed(node, verdict_patch(node, passed=False, failed_check="xid", keep=True))) is True
    failed = changed(node, verdict_patch(node, passed=False, failed_check="xid", keep=True))
    assert admitted(failed, changed(failed, verdict_patch(failed, passed=True, failed_check=None, keep=True))) is True


@pytest.mark.parametrize("why", [
    "another node", "no node in the token", "another taint removed", "a taint added", "another label",
    "a label removed", "cordoned", "another annotation", "the status subresource", "a delete",
])
def test_the_policy_denies_anything_else(why):
    node = gpu_node()
    new = changed(node, verdict_patch(node, passed=True, failed_check=None, keep=True))
    kwargs: dict = {}
    if why == "another node":
        kwargs["token_node"] = "ip-10-0-9-9.us-west-2.compute.internal"
    elif why == "no node in the token":
        kwargs["token_node"] = None
    elif why == "another taint removed":
        new["spec"]["taints"] = []
    elif why == "a taint added":
        new["spec"]["taints"].append({"key": "evil", "effect": "NoExecute"})
    elif why == "another label":
        new["metadata"]["labels"][NODE_GROUP_LABEL] = "other"
    elif why == "a label removed":
        del new["metadata"]["labels"][ACCELERATOR_LABEL]
    elif why == "cordoned":
        new["spec"]["unschedulable"] = True
    elif why == "another annotation":
        new["metadata"]["annotations"]["evil"] = "1"
    elif why == "the status subresource":
        kwargs["sub_resource"] = "status"
    elif why == "a delete":
        kwargs["operation"] = "DELETE"
    assert admitted(node, new, **kwargs) is False


def test_the_policy_leaves_everyone_else_alone():
    node = gpu_node()
    new = dict(node, spec={**node["spec"], "unschedulable": True})
    assert admitted(node, new, user="system:node:" + NODE) is None
    assert BINDING == {"policyName": "training-platform-node-check", "validationActions": ["Deny"]}


def test_the_rbac_gives_the_check_no_more_than_get_and_patch_on_nodes_and_events_in_default():
    from tests.unit.test_charts import RENDERED

    objects = {(o["kind"], o["metadata"]["name"]): o for o in RENDERED["node-check"]}
    assert objects[("ClusterRole", "training-platform-node-check")]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    role = objects[("Role", "training-platform-node-check")]
    assert role["metadata"]["namespace"] == "default"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    for accelerator in ("nvidia", "neuron"):
        pod = objects[("DaemonSet", f"node-check-{accelerator}")]["spec"]["template"]["spec"]
        assert {"key": NODE_CHECK_TAINT, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"][ACCELERATOR_LABEL] == accelerator
        assert pod["containers"][0]["command"] == ["python", "-m", "training.node_check"]


# --- trainctl nodes: what an operator sees ------------------------------------------------------

cli = trainctl_fixtures.cli


def named(name: str, **changes) -> dict:
    node = gpu_node(taints=changes.pop("taints", True))
    node["metadata"]["name"] = name
    node["metadata"]["creationTimestamp"] = "2026-11-28T00:00:00Z"
    node["metadata"]["labels"].update(changes.pop("labels", {}))
    node["status"]["conditions"] = changes.pop("conditions", [{"type": "Ready", "status": "True"}])
    return node


def test_trainctl_nodes_lists_each_accelerated_nodes_check_verdict_and_health(server, cli):
    server.nodes = {n["metadata"]["name"]: n for n in [
        named("ip-10-0-1-1", taints=False, labels={NODE_HEALTH_LABEL: "passed"}),
        named("ip-10-0-1-2", labels={NODE_HEALTH_LABEL: "failed", NODE_FAILED_CHECK_LABEL: "xid"}),
        named("ip-10-0-1-3", conditions=[{"type": "Ready", "status": "False"}]),
        named("ip-10-0-1-4", taints=False, labels={NODE_HEALTH_LABEL: "passed"}, conditions=[
            {"type": "Ready", "status": "True"},
            {"type": "AcceleratedHardwareReady", "status": "False", "reason": "NvidiaXID79Error"}]),
    ]}
    code, out, err = cli("nodes", "--config", str(REPO / "config" / "example.yaml"), "--context", "lab")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "passed" in rows["ip-10-0-1-1"] and "failed: xid" in rows["ip-10-0-1-2"]
    assert "checking" in rows["ip-10-0-1-3"] and " no " in rows["ip-10-0-1-3"]
    assert "AcceleratedHardwareReady: NvidiaXID79Error" in rows["ip-10-0-1-4"]
    # Only accelerated nodes are asked for.
    assert any(r[0] == "GET" and "labelSelector=training-platform%2Fnode-role%3Daccelerated" in r[1]
               for r in server.requests)
    code, out, err = cli("nodes", "-o", "json", "--config", str(REPO / "config" / "example.yaml"), "--context", "lab")
    listed = {row["name"]: row for row in json.loads(out)}
    assert listed["ip-10-0-1-2"]["health"] == "failed: xid" and listed["ip-10-0-1-2"]["failed_check"] == "xid"


# --- the trainer's own right: taint its own node when its job replaces a straggler --------------


def straggler_policy():
    from tests.unit.test_charts import RENDERED

    objects = {(o["kind"], o["metadata"]["name"]): o for o in RENDERED["namespaces"]}
    policy = objects[("ValidatingAdmissionPolicy", "training-platform-straggler-taint")]["spec"]
    binding = objects[("ValidatingAdmissionPolicyBinding", "training-platform-straggler-taint")]["spec"]
    role = objects[("ClusterRole", "training-platform-straggler-taint")]
    return policy, binding, role


TRAINER = "system:serviceaccount:training:trainer"


def test_a_training_pod_may_add_the_straggler_taint_to_its_own_node_and_nothing_else(monkeypatch):
    policy, binding, role = straggler_policy()
    monkeypatch.setitem(globals(), "POLICY", policy)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert binding == {"policyName": "training-platform-straggler-taint", "validationActions": ["Deny"]}
    node = gpu_node()
    tainted = jsonpatch.apply_patch(node, [{"op": "add", "path": "/spec/taints/-", "value": {
        "key": "training-platform/straggler", "value": "true", "effect": "NoSchedule"}}])
    assert admitted(node, tainted, user=TRAINER) is True
    assert admitted(node, tainted, user=TRAINER, token_node="ip-10-0-9-9.us-west-2.compute.internal") is False
    assert admitted(node, tainted, user=TRAINER, token_node=None) is False
    evict = jsonpatch.apply_patch(node, [{"op": "add", "path": "/spec/taints/-", "value": {
        "key": "training-platform/straggler", "value": "true", "effect": "NoExecute"}}])
    assert admitted(node, evict, user=TRAINER) is False  # would evict every pod of the node
    untainted = dict(node, spec={**node["spec"], "taints": []})
    assert admitted(node, untainted, user=TRAINER) is False
    passed = jsonpatch.apply_patch(node, verdict_patch(node, passed=True, failed_check=None, keep=True))
    assert admitted(node, passed, user=TRAINER) is False  # the node check's verdict is not the trainer's
    cordoned = dict(node, spec={**node["spec"], "unschedulable": True})
    assert admitted(node, cordoned, user=TRAINER) is False
    # The node check's account is not this policy's.
    assert admitted(node, tainted, user=ACCOUNT) is None

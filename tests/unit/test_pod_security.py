"""Who reaches the rendezvous, and what the pods may do: the rendered manifests against the
Kubernetes NetworkPolicy semantics and the Pod Security Standards.

No CNI runs here. The policies are evaluated by their own semantics (networking.k8s.io/v1,
as the VPC CNI's network policy agent implements them): a pod selected by an Ingress policy
admits only what one of its rules admits; a peer with a podSelector alone means pods of the
policy's namespace; with a namespaceSelector alone, every pod of the matching namespaces.
"""

from __future__ import annotations

import pytest

from k8s_charts.job_charts import TRAINER_UID
from k8s_charts.node_check import NODE_CHECK_NAMESPACE
from tests.unit.test_charts import RENDERED, container, the_job
from training.contract import ETCD_CLIENT_PORT, ETCD_PEER_PORT

PLATFORM, JOBS = "training-platform", "training"
ETCD_POD = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/part-of": "training-platform"}
TRAINER_POD = {"app.kubernetes.io/name": "resnet50-imagenet", "app.kubernetes.io/part-of": "training-platform"}


def _matches(selector: dict, labels: dict) -> bool:
    expressions_hold = all(
        (e["operator"] == "In" and labels.get(e["key"]) in e["values"])
        or (e["operator"] == "NotIn" and labels.get(e["key"]) not in e["values"])
        or (e["operator"] == "Exists" and e["key"] in labels)
        or (e["operator"] == "DoesNotExist" and e["key"] not in labels)
        for e in selector.get("matchExpressions", []))
    return expressions_hold and all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}  # set by the API server on every namespace


def admitted(source_namespace: str, source_labels: dict, target_namespace: str, target_labels: dict,
             port: int) -> bool:
    """Whether the rendered NetworkPolicies let a TCP connection from the source pod reach ``port`` of the target."""
    policies = [o for objects in RENDERED.values() for o in objects if o["kind"] == "NetworkPolicy"
                and o["metadata"]["namespace"] == target_namespace
                and _matches(o["spec"]["podSelector"], target_labels) and "Ingress" in o["spec"]["policyTypes"]]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                in_namespace = (_matches(peer["namespaceSelector"], _namespace_labels(source_namespace))
                                if "namespaceSelector" in peer else source_namespace == target_namespace)
                if in_namespace and _matches(peer.get("podSelector", {}), source_labels):
                    return True
    return False


def test_training_pods_reach_etcds_client_port_and_nothing_else_of_it():
    assert admitted(JOBS, TRAINER_POD, PLATFORM, ETCD_POD, ETCD_CLIENT_PORT)
    assert not admitted(JOBS, TRAINER_POD, PLATFORM, ETCD_POD, ETCD_PEER_PORT)
    assert not admitted(JOBS, TRAINER_POD, PLATFORM, ETCD_POD, 2381)


@pytest.mark.parametrize("namespace", ["default", "kube-system", "volcano-system", "team-b"])
def test_a_pod_outside_the_training_namespace_is_refused(namespace):
    for port in (ETCD_CLIENT_PORT, ETCD_PEER_PORT, 2381):
        assert not admitted(namespace, TRAINER_POD, PLATFORM, ETCD_POD, port)
    assert not admitted(namespace, {}, JOBS, TRAINER_POD, 29500)


def test_members_reach_each_other_and_other_pods_of_the_platform_namespace_reach_nothing():
    assert admitted(PLATFORM, ETCD_POD, PLATFORM, ETCD_POD, ETCD_PEER_PORT)
    assert not admitted(PLATFORM, {"app": "debug"}, PLATFORM, ETCD_POD, ETCD_CLIENT_PORT)
    assert not admitted(PLATFORM, ETCD_POD, PLATFORM, {"app": "anything-else"}, 8080)


def test_training_pods_reach_each_other():
    assert admitted(JOBS, TRAINER_POD, JOBS, TRAINER_POD, 29500)


def test_the_evaluator_can_admit_and_refuse():
    """A policy-free namespace admits everything (the semantics' default), so the refusals above are the policies'."""
    assert admitted("default", {}, "default", {}, 80)


# --- Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards) ------------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def pod_templates() -> dict[str, tuple[str, dict]]:
    """name -> (namespace, pod spec) of every pod the rendered manifests create."""
    found = {}
    for objects in RENDERED.values():
        for o in objects:
            spec = o.get("spec", {})
            if o["kind"] == "Job" and "tasks" in spec:
                found[o["metadata"]["name"]] = (o["metadata"]["namespace"], spec["tasks"][0]["template"]["spec"])
            elif o["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet"):
                found[o["metadata"]["name"]] = (o["metadata"].get("namespace", PLATFORM), spec["template"]["spec"])
    return found


def level_violations(pod: dict, level: str) -> list[str]:
    problems = []
    if level == "privileged":  # Pod Security's privileged level restricts nothing
        return problems
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        problems.append("host namespaces")
    if any("hostPath" in v for v in pod.get("volumes", [])):
        problems.append("hostPath volume")
    for c in pod.get("initContainers", []) + pod["containers"]:
        context = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        added = set(context.get("capabilities", {}).get("add", []))
        if context.get("privileged"):
            problems.append(f"{c['name']}: privileged")
        if not added <= BASELINE_CAPABILITIES:
            problems.append(f"{c['name']}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if level == "restricted":
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{c['name']}: privilege escalation not disallowed")
            if not context.get("runAsNonRoot") or context.get("runAsUser") == 0:
                problems.append(f"{c['name']}: may run as root")
            if "ALL" not in context.get("capabilities", {}).get("drop", []) or added - {"NET_BIND_SERVICE"}:
                problems.append(f"{c['name']}: capabilities not dropped")
            if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{c['name']}: no seccomp profile")
    return problems


def test_the_levels_checker_refuses_what_the_standards_refuse():
    root = {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}
    assert level_violations(root, "baseline") == ["c: adds ['IPC_LOCK']"]
    assert len(level_violations(root, "restricted")) == 5


def test_every_pod_meets_its_namespaces_enforced_level_and_only_the_node_check_mounts_a_token():
    levels = {o["metadata"]["name"]: o["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for objects in RENDERED.values() for o in objects if o["kind"] == "Namespace"}
    # The node check's pods are privileged (the GPUs, DCGM, the kernel log), alone in a namespace of their own.
    assert levels == {PLATFORM: "restricted", JOBS: "baseline", NODE_CHECK_NAMESPACE: "privileged"}
    with_token = []
    for name, (namespace, pod) in pod_templates().items():
        assert level_violations(pod, levels[namespace]) == [], name
        if pod["automountServiceAccountToken"]:
            with_token.append(name)
    # It patches its own node (k8s_charts/own_node.py); no other pod of these manifests calls the API
    # from its main container (the training pods' node-labels init container reads its Node: below).
    assert sorted(with_token) == ["node-check-neuron", "node-check-nvidia"]


def test_in_a_training_pod_only_the_node_labels_init_container_mounts_a_token():
    jobs = [o for objects in RENDERED.values() for o in objects if o["kind"] == "Job" and "tasks" in o["spec"]]
    assert len(jobs) >= 6
    for job in jobs:
        pod = job["spec"]["tasks"][0]["template"]["spec"]
        tokens = {v["name"] for v in pod["volumes"]
                  if any("serviceAccountToken" in source for source in v.get("projected", {}).get("sources", []))}
        mounting = [c["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]
                    if any(m["name"] in tokens for m in c.get("volumeMounts", []))]
        assert mounting == ["node-labels"], job["metadata"]["name"]  # every example's type has a topology
        assert pod["automountServiceAccountToken"] is False, job["metadata"]["name"]


@pytest.mark.parametrize("name", ["resnet50-imagenet", "resnet50-imagenet-nccl-check", "bert-large-mlm",
                                  "own-program", "own-program-nccl-check"])
def test_training_containers_are_restricted_and_only_the_directory_setup_runs_as_root(name):
    pod = the_job(RENDERED, name)["spec"]["tasks"][0]["template"]["spec"]
    setup = [init for init in pod.get("initContainers", []) if init["name"] == "writable-dirs"]
    # Everything but the directory setup meets the restricted level: the trainer, and the launcher's copy.
    assert level_violations({**pod, "initContainers": [i for i in pod.get("initContainers", []) if i not in setup]},
                            "restricted") == []
    assert pod["securityContext"]["runAsUser"] == TRAINER_UID  # the images' trainer user
    for init in setup:
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                          "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}


def test_the_launcher_copy_runs_as_the_trainer_user_without_capabilities_and_is_mounted_read_only():
    pod = the_job(RENDERED, "own-program")["spec"]["tasks"][0]["template"]["spec"]
    (launcher,) = [i for i in pod["initContainers"] if i["name"] == "platform-launcher"]
    assert launcher["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert level_violations({**pod, "initContainers": [launcher]}, "restricted") == []
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "platform-launcher"]
    assert mounts == [{"name": "platform-launcher", "mountPath": "/platform-launcher", "readOnly": True}]


def test_the_job_setup_hands_the_jobs_own_directories_to_the_trainer_user():
    pod = the_job(RENDERED, "resnet50-imagenet")["spec"]["tasks"][0]["template"]["spec"]
    init, _node_labels = pod["initContainers"]
    assert init["image"] == container(the_job(RENDERED, "resnet50-imagenet"))["image"]
    assert init["command"][:7] == ["install", "-d", "-o", str(TRAINER_UID), "-g", str(TRAINER_UID), "-m"]
    assert set(init["command"][8:]) == {"/fsx/checkpoints/resnet50-imagenet", "/fsx/staging/resnet50-imagenet",
                                        "/fsx/cache/resnet50-imagenet"}


def test_the_data_preparation_keeps_no_raw_sockets_or_other_capabilities():
    pod = next(o for o in RENDERED["prepare-imagenet"] if o["kind"] == "Job")["spec"]["template"]["spec"]
    assert pod["containers"][0]["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert level_violations(pod, "baseline") == []

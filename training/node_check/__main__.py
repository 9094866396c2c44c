"""``python -m training.node_check``: check this pod's node once, record the verdict, then idle.

A node that no longer carries ``NODE_CHECK_TAINT`` passed before (this pod restarted, or its
DaemonSet was updated): it is not checked again, so a running job never shares its GPUs with
DCGM's diagnostic. To check a failed node again, delete its node-check pod.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from training.contract import (
    NODE_CHECK_DCGM_LEVEL_ENV, NODE_CHECK_EVENT, NODE_CHECK_EXPECTED_ENV, NODE_CHECK_ON_FAILURE_ENV,
    NODE_CHECK_TAINT, NODE_FAILURE_ACTIONS, NODE_GROUP_LABEL, NODE_NAME_ENV,
)
from training.node_check import checks, probes
from training.node_check.checks import Finding
from training.node_check.node_api import NodeApi, check_taint_index, instance_id, terminate_instance

REGION_LABEL = "topology.kubernetes.io/region"
# The device plugins advertise a new node's devices within a minute or two of its start; cluster-autoscaler
# counts a node that still carries the taint as starting for 15 minutes (contract.NODE_CHECK_TAINT).
DEVICE_PLUGIN_WAIT_S = 300.0


def expected_for(node: dict, expected: dict[str, dict]) -> dict | Finding:
    """What this node's group must show, from the platform's instance catalog (the DaemonSet's environment)."""
    labels = node.get("metadata", {}).get("labels") or {}
    group = labels.get(NODE_GROUP_LABEL)
    if group not in expected:
        return Finding(checks.INSTANCE, False, f"node group {group!r} is not one the check knows ({', '.join(expected)})")
    return expected[group]


def run_checks(facts: dict, node_reader: Callable[[], dict], dcgm_level: int, kernel_log: str,
               device_plugin_wait_s: float = DEVICE_PLUGIN_WAIT_S) -> list[Finding]:
    """Every check for a node of ``facts``, cheapest first; stops at the first failure."""
    findings: list[Finding] = []

    def passed(finding: Finding) -> bool:
        findings.append(finding)
        return finding.passed

    try:
        if facts["accelerator"] == "nvidia":
            out = probes.nvidia_smi()
            if not passed(checks.nvidia_gpus(out.text, out.returncode, facts["devices"])):
                return findings
            if not passed(checks.kernel_xids(probes.kernel_log(kernel_log))):
                return findings
        else:
            out = probes.neuron_ls()
            if not passed(checks.neuron_devices(out.text, out.returncode, facts["devices"])):
                return findings
        if facts["efa"]:
            out = probes.fi_info()
            if not passed(checks.efa_devices(out.text, out.returncode, facts["efa"])):
                return findings
        if facts["accelerator"] == "nvidia" and dcgm_level:
            # DCGM's tests take the GPUs: never beside a job (a node that got the taint while it ran one).
            busy = checks.gpu_processes(probes.nvidia_compute_apps().text)
            if busy:
                findings.append(Finding(checks.DCGM, True, f"dcgmi diag not run: {len(busy)} process(es) use the "
                                                           f"GPUs ({busy[0][:80]})"))
            else:
                out = probes.dcgm_diag(dcgm_level)
                if not passed(checks.dcgm_diag(out.text, out.returncode, dcgm_level)):
                    return findings
    except probes.ToolMissing as missing:
        findings.append(Finding(checks.CHECK_TOOLS, False, str(missing)))
        return findings
    resources = [(facts["device_resource"], facts["devices"])]
    if facts["efa"]:
        resources.append((facts["efa_resource"], facts["efa"]))
    deadline = time.monotonic() + device_plugin_wait_s
    while True:  # the device plugins register after the node starts: wait for them, within the deadline
        node = node_reader()
        offered = [checks.allocatable(node, resource, count) for resource, count in resources]
        failed = [finding for finding in offered if not finding.passed]
        if not failed or time.monotonic() >= deadline:
            findings.extend(failed or offered)
            return findings
        time.sleep(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.node_check", description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="exit after the verdict (0 passed, 1 failed) "
                                                            "instead of idling as a DaemonSet's pod does")
    parser.add_argument("--kernel-log", default=probes.KERNEL_LOG, help="where the kernel's messages are read")
    parser.add_argument("--device-plugin-wait", type=float, default=DEVICE_PLUGIN_WAIT_S,
                        help="seconds to wait for the device plugins to advertise the node's devices")
    args = parser.parse_args(argv)
    name = os.environ[NODE_NAME_ENV]
    expected = json.loads(os.environ[NODE_CHECK_EXPECTED_ENV])
    dcgm_level = int(os.environ.get(NODE_CHECK_DCGM_LEVEL_ENV, "0"))
    on_failure = os.environ.get(NODE_CHECK_ON_FAILURE_ENV, NODE_FAILURE_ACTIONS[0])
    if on_failure not in NODE_FAILURE_ACTIONS:
        print(f"{NODE_CHECK_ON_FAILURE_ENV}: got {on_failure!r}; allowed: {', '.join(NODE_FAILURE_ACTIONS)}",
              file=sys.stderr)
        return 2
    api = NodeApi.connect()
    node = api.node(name)
    if check_taint_index(node) is None:
        print(json.dumps({"event": NODE_CHECK_EVENT, "time": time.time(), "node": name, "skipped": True,
                          "why": "the node passed before (it has no node-check taint)"}), flush=True)
        return 0 if args.once else _idle()
    started = time.monotonic()
    facts = expected_for(node, expected)
    findings = [facts] if isinstance(facts, Finding) else run_checks(
        facts, lambda: api.node(name), dcgm_level, args.kernel_log, args.device_plugin_wait)
    failure = next((finding for finding in findings if not finding.passed), None)
    labels = node.get("metadata", {}).get("labels") or {}
    keep = on_failure == "keep"
    api.record(name, failure is None, failure.check if failure else None, keep)
    print(json.dumps({
        "event": NODE_CHECK_EVENT, "time": time.time(), "node": name, "passed": failure is None,
        "failed_check": failure.check if failure else None, "detail": failure.detail if failure else None,
        "node_group": labels.get(NODE_GROUP_LABEL), "on_failure": None if failure is None else on_failure,
        "seconds": round(time.monotonic() - started, 1),
        "checks": [{"check": f.check, "passed": f.passed, "detail": f.detail} for f in findings],
    }), flush=True)
    if failure is None:
        api.event(node, "NodeCheckPassed", f"every check passed; {NODE_CHECK_TAINT} removed: "
                  + "; ".join(f.detail for f in findings), warning=False)
    else:
        action = ("kept for a look (tainted, out of scale-down)" if keep
                  else "its instance is terminated; its Auto Scaling group replaces it")
        api.event(node, "NodeCheckFailed", f"{failure.check}: {failure.detail}; {action}", warning=True)
        if not keep:
            instance = instance_id(node)
            if instance is None:
                print(f"node {name}: no EC2 instance id in spec.providerID; not terminated", file=sys.stderr)
            else:
                terminate_instance(instance, labels.get(REGION_LABEL))
    if args.once:
        return 0 if failure is None else 1
    return _idle()


def _idle() -> int:
    """A DaemonSet's pod lives on: wait for the kubelet's SIGTERM, then exit 0."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

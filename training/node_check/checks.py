"""What each tool's output says about a node: one :class:`Finding` per check, from the text alone.

The formats, as the tools print them (tests/node_check_outputs holds recorded examples):

- ``nvidia-smi --query-gpu=index,name,pci.bus_id,uuid --format=csv,noheader``: one line per GPU
  whose handle the driver could open; a broken driver exits non-zero (9: no driver loaded, 15: a GPU
  fell off the bus, 255: other) with a message instead (nvidia-smi(1), RETURN VALUE).
- The kernel log: the driver reports ``NVRM: Xid (PCI:0000:10:1c): 79, pid=..., GPU has fallen off
  the bus.`` (NVIDIA open-gpu-kernel-modules, kernel_rc.c ``krcReportXid``; older drivers leave out
  ``PCI:``). Which Xids mean the hardware: the ones EKS's node monitoring agent raises a node
  condition for (aws/eks-node-monitoring-agent, monitors/nvidia/dcgm/dcgm_policies.go,
  ``WellKnownXidCodes``); the others (13, 31, 43, 45, 68 ...) are a program's own faults.
- ``dcgmi diag -r N -j``: ``{"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name",
  "results": [{"status", "warnings": [...]}], "test_summary": {"status"}}]}]}}`` (DCGM 4.x; 3.x names
  the top key "DCGM GPU Diagnostic"), statuses Pass, Skip, Fail (a warning shows as Fail), and
  ``runtime_error`` when the diagnostic could not run (NVIDIA/DCGM nvvs/include/NvvsJsonStrings.h,
  dcgmi/Diag.cpp).
- ``fi_info -p efa -t FI_EP_RDM``: one entry per EFA device (libfabric 1.x), two from libfabric
  2.1 (``fabric: efa-direct`` and ``fabric: efa``, prov/efa/src/efa_prov.c), so devices are counted by
  their distinct ``domain``; no device: ``fi_getinfo: -61 (No data available)`` and exit 61.
- ``neuron-ls --json-output``: a JSON list with one object per Neuron device (aws-neuron-sdk
  tools/neuron-sys-tools/neuron-ls.rst).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Check names: the value of contract.NODE_FAILED_CHECK_LABEL for the first check a node failed.
GPU_DRIVER, GPU_COUNT, XID, DCGM, EFA_COUNT, NEURON_COUNT, DEVICE_PLUGIN, CHECK_TOOLS, INSTANCE = (
    "gpu-driver", "gpu-count", "xid", "dcgm", "efa-count", "neuron-count", "device-plugin", "check-tools",
    "instance-type")

# Xids that mean the GPU, its memory or its links need a reset or a replacement: the node monitoring
# agent's list (see the module docstring).
HARDWARE_XIDS = frozenset({46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151, 155,
                           156, 158})
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})[^)]*\): "
                       r"(?P<xid>\d+),(?P<rest>.*)")
# A newer driver's message for a GPU lost from the bus, over three lines and without an Xid.
_FALLEN_OFF = re.compile(r"NVRM: The NVIDIA GPU (?P<bus>[0-9a-fA-F:.]+)")
_DCGM_TOP_KEYS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")  # DCGM 4.x, 3.x


@dataclass(frozen=True)
class Finding:
    check: str
    passed: bool
    detail: str


def tool_failed(check: str, tool: str, returncode: int, output: str) -> Finding:
    """A tool that exited non-zero, or could not be run (returncode None in the caller: -1 here)."""
    first = next((line.strip() for line in output.splitlines() if line.strip()), "no output")
    return Finding(check, False, f"{tool} exited {returncode}: {first[:200]}")


def nvidia_gpus(output: str, returncode: int, expected: int) -> Finding:
    """The GPUs the driver sees (nvidia-smi's query), against the instance type's count."""
    if returncode != 0:
        return tool_failed(GPU_DRIVER, "nvidia-smi", returncode, output)
    rows = [line.split(",") for line in output.splitlines() if line.strip()]
    gpus = [row for row in rows if len(row) >= 3 and row[0].strip().isdigit()]
    if len(gpus) != len(rows):
        return Finding(GPU_DRIVER, False, f"nvidia-smi printed {len(rows) - len(gpus)} line(s) that are no GPU: "
                                          f"{[','.join(r) for r in rows if r not in gpus][0][:200]}")
    if len(gpus) != expected:
        return Finding(GPU_COUNT, False, f"{len(gpus)} GPU(s) seen by the driver, {expected} expected")
    names = sorted({row[1].strip() for row in gpus})
    return Finding(GPU_COUNT, True, f"{len(gpus)} GPU(s): {', '.join(names)}")


def gpu_processes(output: str) -> list[str]:
    """The processes nvidia-smi's ``--query-compute-apps=pid,process_name`` lists (none on a new node)."""
    return [line.strip() for line in output.splitlines() if line.strip() and line.strip()[0].isdigit()]


def kernel_xids(log: str) -> Finding:
    """Hardware Xids in the kernel log since boot (a node's first minutes: any is too many)."""
    hardware: list[str] = []
    others: set[int] = set()
    for line in log.splitlines():
        found = _XID_LINE.search(line)
        if found:
            xid = int(found["xid"])
            if xid in HARDWARE_XIDS:
                hardware.append(f"Xid {xid} on {found['bus'].lower()}: {found['rest'].strip()[:120]}")
            else:
                others.add(xid)
        elif fallen := _FALLEN_OFF.search(line):
            hardware.append(f"GPU {fallen['bus'].rstrip('.')} fell off the bus")
    if hardware:
        more = f" (and {len(hardware) - 1} more)" if len(hardware) > 1 else ""
        return Finding(XID, False, hardware[0] + more)
    noted = f"; program Xids {sorted(others)} ignored" if others else ""
    return Finding(XID, True, "no hardware Xid in the kernel log" + noted)


def dcgm_diag(output: str, returncode: int, level: int) -> Finding:
    """DCGM's diagnostic at ``level``: every test that ran passed or was skipped."""
    try:
        document = json.loads(output)
    except ValueError:
        return tool_failed(DCGM, f"dcgmi diag -r {level}", returncode, output)
    report = next((document[key] for key in _DCGM_TOP_KEYS if isinstance(document, dict) and key in document), None)
    if not isinstance(report, dict):
        return Finding(DCGM, False, f"dcgmi diag -r {level} printed JSON without a diagnostic: {output[:200]}")
    if report.get("runtime_error"):
        return Finding(DCGM, False, f"dcgmi diag -r {level} could not run: {str(report['runtime_error'])[:200]}")
    ran, failed = 0, []
    for category in report.get("test_categories", []):
        for test in category.get("tests", []):
            statuses = [result.get("status") for result in test.get("results", [])]
            statuses.append(test.get("test_summary", {}).get("status"))
            ran += 1
            if "Fail" in statuses:
                failed.append(f"{test.get('name')}: {_first_warning(test)}")
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return Finding(DCGM, False, f"dcgmi diag -r {level}: {failed[0][:200]}{more}")
    if ran == 0 or returncode != 0:
        return tool_failed(DCGM, f"dcgmi diag -r {level}", returncode, output)
    return Finding(DCGM, True, f"dcgmi diag -r {level}: {ran} test(s) passed or skipped")


def _first_warning(test: dict) -> str:
    for result in test.get("results", []):
        warnings = result.get("warnings")
        if isinstance(warnings, str) and warnings:  # DCGM 3.2
            return warnings
        for warning in warnings or []:
            text = warning.get("warning") or warning.get("warnings")  # 3.3.x deployment results say "warnings"
            if text:
                return str(text)
    info = test.get("test_summary", {}).get("info")
    return str(info[0] if isinstance(info, list) and info else info or "failed")


def efa_devices(output: str, returncode: int, expected: int) -> Finding:
    """The EFA devices libfabric finds, against the interfaces the launch template attached."""
    domains = {match.strip() for match in re.findall(r"^\s*domain:\s*(\S+)", output, flags=re.MULTILINE)}
    if returncode not in (0, 61) and not domains:  # 61: ENODATA, no EFA device at all
        return tool_failed(EFA_COUNT, "fi_info -p efa", returncode, output)
    if len(domains) != expected:
        return Finding(EFA_COUNT, False, f"{len(domains)} EFA device(s) found by libfabric, {expected} expected")
    return Finding(EFA_COUNT, True, f"{len(domains)} EFA device(s)")


def neuron_devices(output: str, returncode: int, expected: int) -> Finding:
    """The Neuron devices the driver shows (neuron-ls), against the instance type's count."""
    try:
        devices = json.loads(output)
    except ValueError:
        return tool_failed(NEURON_COUNT, "neuron-ls", returncode, output)
    if isinstance(devices, dict):  # the format that replaces --json-output names its list
        devices = next((value for value in devices.values() if isinstance(value, list)), [])
    found = [d for d in devices if isinstance(d, dict) and "neuron_device" in d]
    if returncode != 0 or len(found) != expected:
        return Finding(NEURON_COUNT, False, f"{len(found)} Neuron device(s) seen by the driver, {expected} expected")
    cores = sum(int(d.get("nc_count") or 0) for d in found)
    return Finding(NEURON_COUNT, True, f"{len(found)} Neuron device(s), {cores} NeuronCore(s)")


def allocatable(node: dict, resource: str, expected: int) -> Finding:
    """What the device plugin advertises to the scheduler (the node's status.allocatable)."""
    have = (node.get("status", {}).get("allocatable") or {}).get(resource, "0")
    try:
        count = int(have)
    except ValueError:
        count = 0
    if count != expected:
        return Finding(DEVICE_PLUGIN, False, f"the node offers {count} {resource}, {expected} expected")
    return Finding(DEVICE_PLUGIN, True, f"{count} {resource} allocatable")

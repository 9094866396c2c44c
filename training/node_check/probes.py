"""Running the node's tools and reading its kernel log; what they print goes to checks.py.

The check's container is privileged, with the host's /dev (the GPUs, Neuron devices, EFA devices
and /dev/kmsg). On the EKS AL2023 NVIDIA AMI containerd's default runtime is NVIDIA's
(awslabs/amazon-eks-ami nodeadm/internal/containerd/runtime_config_nvidia.go), which puts the driver's
tools and libraries into a container that asks for NVIDIA_VISIBLE_DEVICES=all, without holding a
``nvidia.com/gpu`` a job needs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

KERNEL_LOG = "/dev/kmsg"
DCGM_PORT = 5555  # nv-hostengine's default
# DCGM's own figures for its levels: 1 "normally lasting seconds", 2 "approximately two minutes"
# (docs.nvidia.com/datacenter/dcgm, dcgmi diag reference). The limits leave room for a slow node.
DCGM_TIMEOUT_S = {1: 300, 2: 900}


class ToolMissing(RuntimeError):
    """The check's image lacks a tool it needs: the image is wrong, not the node."""


@dataclass(frozen=True)
class Output:
    returncode: int
    text: str  # stdout, then stderr


def run(argv: list[str], timeout_s: float) -> Output:
    if shutil.which(argv[0]) is None:
        raise ToolMissing(f"{argv[0]} is not on the check image's PATH")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as expired:
        partial = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout or ""
        return Output(-1, f"{' '.join(argv)} did not finish within {timeout_s:.0f} s {partial[:200]}")
    return Output(done.returncode, done.stdout + done.stderr)


def nvidia_smi() -> Output:
    return run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id,uuid", "--format=csv,noheader"], 120)


def nvidia_compute_apps() -> Output:
    """The processes using the GPUs now (a job, on a node that was tainted while it ran one)."""
    return run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"], 120)


def fi_info() -> Output:
    return run(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], 120)


def neuron_ls() -> Output:
    return run(["neuron-ls", "--json-output"], 120)


def dcgm_diag(level: int) -> Output:
    """``dcgmi diag -r level -j`` against a host engine of this container's own, started for it."""
    if shutil.which("nv-hostengine") is None:
        raise ToolMissing("nv-hostengine (DCGM) is not on the check image's PATH")
    engine = subprocess.Popen(["nv-hostengine", "-n"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _listening(DCGM_PORT) and time.monotonic() < deadline and engine.poll() is None:
            time.sleep(0.5)
        return run(["dcgmi", "diag", "-r", str(level), "-j"], DCGM_TIMEOUT_S[level])
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=10)
        except subprocess.TimeoutExpired:
            engine.kill()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def kernel_log(path: str = KERNEL_LOG) -> str:
    """The kernel's log since boot, one message a line. /dev/kmsg gives one record per read,
    ``<priority>,<sequence>,<microseconds>,<flags>;<message>``, and EAGAIN at its end (opened
    non-blocking); a plain file (tests) is read whole."""
    if not path.startswith("/dev/"):
        with open(path, encoding="utf-8", errors="replace") as text:
            return text.read()
    lines = []
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                record = os.read(descriptor, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # EPIPE: a record was overwritten while reading; go on with the next
                continue
            if not record:
                break
            header, _, message = record.decode(errors="replace").partition(";")
            lines.append(message.split("\n", 1)[0] if header else record.decode(errors="replace"))
    finally:
        os.close(descriptor)
    return "\n".join(lines)

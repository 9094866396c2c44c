"""How the platform launches the trainer: one source for the torchrun flags, charts and tests alike.

The settings were measured with torch 2.13 (see DESIGN.md):
- ``etcd-v2`` rendezvous: the store lives in etcd, not inside one agent, so any node may die;
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it a joining node waits forever (scale-up hangs);
- short keep-alives and last call: a lost node is noticed in ~2 s instead of ~15 s, and a
  rendezvous round closes 1 s after the minimum is met instead of 30 s. The first round
  needs only the minimum number of nodes, which the gang scheduler starts together; a pod
  that comes later joins through a scale-up restart, which loses no steps because the
  workers checkpoint on the SIGTERM that torchrun sends them before a restart.
"""

from __future__ import annotations

from dataclasses import dataclass

RDZV_BACKEND = "etcd-v2"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
# Read by every torchrun agent; the chart and the local cluster both set it.
LAUNCH_ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TRAINER_MODULE = "training"


@dataclass(frozen=True)
class RendezvousTuning:
    """torchrun's ``--rdzv-conf``. Recovery ~ keep-alive detection + last call + worker start."""

    last_call_timeout: int = 1
    keep_alive_interval: int = 1
    # Two missed heartbeats: a node is declared lost ~2 s after it stops. Raise it for jobs
    # of many nodes, whose agents all write their heartbeats to one etcd key.
    keep_alive_max_attempt: int = 3
    join_timeout: int = 900  # a pod may wait this long for the minimum number of nodes

    def conf(self) -> str:
        return ",".join(f"{key}={value}" for key, value in vars(self).items())


PLATFORM_TUNING = RendezvousTuning()


def torchrun_arguments(
    *,
    min_nodes: int,
    max_nodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    max_restarts: int,
    tuning: RendezvousTuning | None = PLATFORM_TUNING,
    local_addr: str | None = None,
    backend: str = RDZV_BACKEND,
) -> list[str]:
    """The torchrun flags (without ``torchrun`` and the module) for one elastic job.

    ``tuning=None`` leaves torch's defaults, for comparisons.
    """
    args = [
        f"--nnodes={min_nodes}:{max_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
    ]
    if tuning is not None:
        args.append(f"--rdzv-conf={tuning.conf()}")
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    return args

"""Which torch the launcher runs on, checked before anything else: one line and a final exit, never a traceback.

The launcher is torchrun with a rendezvous handler of its own (a public interface) and an agent that
subclasses torch's ``LocalElasticAgent``. The agent's hooks are underscore members: torch's agent calls
them (``SimpleElasticAgent._invoke_run`` and ``run``) and they change between releases. torch 2.13 gave
``_shutdown`` and ``_stop_workers`` new signatures and ``LaunchConfig`` a ``shutdown_timeout``
(pytorch/pytorch#172596); a launcher that assumed them stopped at start on torch 2.8 and 2.11, and
every pod of the job with it. So the launcher uses only what every supported release has, with the
signatures they share, and :func:`problem` names anything missing before the agent starts.

Read at each supported release (torch 2.8.0, 2.13.0, 2.14.1; docs/DESIGN.md, "The launcher and torch"):
:data:`SURFACES` is the list. tests/drills/test_launcher_torches.py runs the launcher's drills under each
release that the test environments install, and checks this list against the launcher's code.
"""

from __future__ import annotations

import importlib
import inspect

# The oldest torch a job's image may have: the oldest the drills run under (the Trainium image's).
OLDEST_TORCH = (2, 8)
NEWEST_TESTED_TORCH = (2, 14)

# (module, attribute path, what the launcher does with it). A method's parameters, where the launcher
# calls it with arguments, are checked by :data:`PARAMETERS`.
SURFACES: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.run", "parse_args", "parses torchrun's flags"),
    ("torch.distributed.run", "get_args_parser", "tells the launcher's flags from torchrun's"),
    ("torch.distributed.run", "config_from_args", "builds the LaunchConfig from them"),
    ("torch.distributed.run", "parse_min_max_nnodes", "reads --nnodes for the one-node defaults"),
    ("torch.distributed.launcher.api", "elastic_launch", "runs the agent"),
    ("torch.distributed.launcher.api", "LocalElasticAgent", "the name launch_agent builds its agent by"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._start_workers",
     "starts the workers (overridden: progress at the start of a round)"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._stop_workers",
     "stops them (overridden: the stop budget)"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._shutdown",
     "closes them (overridden: the stop budget, a second Ctrl-C)"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._monitor_workers",
     "watches them (overridden: restart accounting)"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._rendezvous",
     "joins a round (overridden: the node_ranks line; called for an in-place regroup)"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._restart_workers",
     "restarts them (overridden: the in-place regroup)"),
    ("torch.distributed.elastic.multiprocessing.api", "PContext.close", "stops the workers with a budget"),
    ("torch.distributed.elastic.multiprocessing.api", "PContext.pids", "the workers' pids, for a regroup"),
    ("torch.distributed.elastic.multiprocessing.api", "PContext.wait", "whether the workers are gone"),
    ("torch.distributed.elastic.multiprocessing.api", "SignalException", "the agent's stop by a signal"),
    ("torch.distributed.elastic.multiprocessing.errors", "ChildFailedError", "the workers failed for good"),
    ("torch.distributed.elastic.rendezvous.api", "RendezvousHandler", "the platform-etcd rendezvous"),
    ("torch.distributed.elastic.rendezvous.api", "RendezvousInfo", "a round's result"),
    ("torch.distributed.elastic.rendezvous.api", "RendezvousStoreInfo", "the workers' store address"),
    ("torch.distributed.elastic.rendezvous.api", "RendezvousClosedError", "the job ended before this node"),
    ("torch.distributed.elastic.rendezvous.registry", "handler_registry", "registers platform-etcd"),
)

# Parameters the launcher passes by name or position: (module, method, the parameters, in order, that it relies on).
PARAMETERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._shutdown", ("self", "death_sig")),
    ("torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._stop_workers",
     ("self", "worker_group")),
    ("torch.distributed.elastic.multiprocessing.api", "PContext.close", ("self", "death_sig", "timeout")),
)

# LaunchConfig's fields at the oldest supported torch (torch/distributed/launcher/api.py:77-93 at 2.8.0):
# the launcher reads and sets no other (2.13 added numa_options, signals_to_handle, the stdout and stderr
# filters, virtual_local_rank and shutdown_timeout, at :118-123).
LAUNCH_CONFIG_FIELDS = (
    "min_nodes", "max_nodes", "nproc_per_node", "logs_specs", "run_id", "role", "rdzv_endpoint", "rdzv_backend",
    "rdzv_configs", "rdzv_timeout", "max_restarts", "monitor_interval", "start_method", "log_line_prefix_template",
    "metrics_cfg", "local_addr", "event_log_handler",
)

# Instance attributes of the agent, set by torch's constructors; checked on the built agent (agent.py).
AGENT_ATTRIBUTES = ("_pcontext", "_remaining_restarts")


class TorchIncompatible(RuntimeError):
    """This torch lacks a member of its agent the launcher relies on (found once the agent is built)."""


def torch_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.13.0+cu130`` or ``2.8.0a0+git1234``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _resolve(module: str, path: str):
    target = importlib.import_module(module)
    for part in path.split("."):
        target = getattr(target, part)
    return target


def problem() -> str | None:
    """None when this torch has everything the launcher uses, else one line naming what it lacks."""
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported ({exc}); allowed: an image with torch {supported()}"
    found = torch_version(torch.__version__)
    if found < OLDEST_TORCH:
        return (f"torch {torch.__version__} is older than the platform launcher supports; allowed: torch "
                f"{supported()} in the job's image")
    missing: list[str] = []
    for module, path, _use in SURFACES:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    for module, path, expected in PARAMETERS:
        try:
            names = tuple(inspect.signature(_resolve(module, path)).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # reported above
        if names[:len(expected)] != expected:
            missing.append(f"{module}.{path}({', '.join(expected)}, ...) (found ({', '.join(names)}))")
    if missing:
        return (f"torch {torch.__version__} lacks what the platform launcher uses: {'; '.join(missing)}; allowed: "
                f"torch {supported()} (training/launcher/compat.py)")
    return None


def missing_agent_attributes(agent: object) -> list[str]:
    return [name for name in AGENT_ATTRIBUTES if not hasattr(agent, name)]


def supported() -> str:
    return f"{OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} or newer (tested up to {NEWEST_TESTED_TORCH[0]}.{NEWEST_TESTED_TORCH[1]})"

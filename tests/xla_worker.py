"""One trainer worker on torch-xla's CPU device with the ``xla`` process group, for tests/drills/test_xla_training.py.

torchrun runs this file instead of ``python -m training``; it takes the same arguments. Before the
trainer starts, it makes two changes to torch_xla's ``ProcessGroupXla`` (torch_xla 2.8.0,
torch_xla/distributed/xla_backend.py), the group ``init_process_group("xla")`` creates:

- Every collective call is written down: its name and the device of each tensor it was given,
  one JSON line per call in ``$XLA_TEST_COLLECTIVES/rank<N>.jsonl``. This is the layer
  that DDP's gradient all-reduces also go through. A tensor that is not an XLA tensor fails the
  call at once. ProcessGroupXla would not always fail it: it gives a host tensor's
  ``broadcast`` to XLA's device bridge, which fails, but it goes on with a host tensor's
  ``allreduce`` without communicating at all.
- The collectives travel between the processes. On a Trainium node the Neuron runtime carries
  the XLA collectives between the NeuronCores of all processes. XLA:CPU cannot do that: torch_xla
  2.8 builds its CPU client as ``GetTfrtCpuClient(async, CPU_NUM_DEVICES)``, with no distributed
  key-value store (torch_xla/csrc/runtime/pjrt_registry.cc, v2.8.0; CUDA and plugin clients
  get one), so each process is a world of one replica. An all-reduce then hands every rank
  back its own value. So here the tensor is copied to the host, goes through a gloo group
  built on the same store, and is copied back into the XLA tensor, in place. Only the
  collectives the trainer uses travel (``CARRIED``); the others keep torch_xla's own code: its
  ``barrier`` does nothing and its ``gather`` raises NotImplementedError, as they do on Trainium.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch_xla.distributed.xla_backend as xla_backend

RECORD_ENV = "XLA_TEST_COLLECTIVES"
ProcessGroupXla = xla_backend.ProcessGroupXla
# Every collective ProcessGroupXla defines (xla_backend.py, torch_xla 2.8.0).
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced", "broadcast",
               "reduce", "reduce_scatter", "reduce_scatter_coalesced", "_reduce_scatter_base", "alltoall",
               "alltoall_base", "gather", "scatter", "send", "recv", "recv_anysource", "barrier", "monitored_barrier")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _record(name: str, args: tuple) -> None:
    tensors = _tensors(args)
    line = {"op": name, "devices": [t.device.type for t in tensors]}
    with open(os.path.join(os.environ[RECORD_ENV], f"rank{os.environ['RANK']}.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")
    wrong = sorted({t.device.type for t in tensors} - {"xla"})
    if wrong:
        raise RuntimeError(f"ProcessGroupXla.{name} was given {', '.join(wrong)} tensors; it takes XLA tensors")


def _through_host(carry, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` to the host, let ``carry`` run the gloo collective on the copies, copy them back."""
    host = [t.detach().cpu() for t in tensors]
    carry(host).wait()
    with torch.no_grad():
        for tensor, value in zip(tensors, host, strict=True):
            tensor.copy_(value)


def _allreduce(self, tensors, opts):
    _through_host(lambda host: self._carrier.allreduce(host, opts), tensors)
    return xla_backend._ret_work(tensors)


def _broadcast(self, tensors, opts):
    _through_host(lambda host: self._carrier.broadcast(host, opts), tensors)
    return xla_backend._ret_work(tensors)


def _allgather(self, output_tensors_list, input_tensors, opts=None):
    outputs = [t for group in output_tensors_list for t in group]
    host_in = [t.detach().cpu() for t in input_tensors]
    host_out = [[t.detach().cpu() for t in group] for group in output_tensors_list]
    self._carrier.allgather(host_out, host_in).wait()
    with torch.no_grad():
        for tensor, value in zip(outputs, [t for group in host_out for t in group], strict=True):
            tensor.copy_(value)
    return xla_backend._ret_work(outputs)


def _allgather_base(self, output_tensor, input_tensor, opts):
    host_out, host_in = output_tensor.detach().cpu(), input_tensor.detach().cpu()
    self._carrier._allgather_base(host_out, host_in).wait()
    with torch.no_grad():
        output_tensor.copy_(host_out)
    return xla_backend._ret_work([output_tensor])


CARRIED = {"allreduce": _allreduce, "broadcast": _broadcast, "allgather": _allgather,
           "_allgather_base": _allgather_base}


def _recorded(name: str, method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        _record(name, args)
        return method(self, *args, **kwargs)
    return call


def install() -> None:
    original_init = ProcessGroupXla.__init__

    def __init__(self, prefix_store, rank, size, timeout):
        original_init(self, prefix_store, rank, size, timeout)
        # A gloo group of the same ranks, on this group's store under a prefix of its own.
        self._carrier = dist.ProcessGroupGloo(dist.PrefixStore("xla-carrier/", prefix_store), rank, size, timeout)

    ProcessGroupXla.__init__ = __init__
    for name in COLLECTIVES:
        setattr(ProcessGroupXla, name, _recorded(name, CARRIED.get(name) or getattr(ProcessGroupXla, name)))


if __name__ == "__main__":
    install()
    sys.argv[0] = "training"
    runpy.run_module("training", run_name="__main__", alter_sys=True)

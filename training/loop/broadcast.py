"""Send a state dict from one rank to all, as a few large collectives instead of N file reads.

A checkpoint is read once, by rank 0, and reaches the other ranks over the job's fast network
(NCCL over EFA on GPUs, gloo on CPU). The structure (dicts, lists, numbers, strings) goes as
one small object broadcast; the tensors go packed by dtype into buckets of at most
``bucket_bytes``, so a 4 GB optimizer state is a handful of broadcasts, and no rank holds more
than one bucket beyond the state itself.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the structure: its position in the flat list."""

    index: int


def _strip(state: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return _Slot(len(tensors) - 1)
    if isinstance(state, dict):
        return type(state)((k, _strip(v, tensors)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_strip(v, tensors) for v in state)
    return state


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, _fill(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def _buckets(specs: list[tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices grouped by dtype into buckets of at most ``bucket_bytes`` (a bigger tensor alone)."""
    buckets: list[list[int]] = []
    open_bucket: dict[torch.dtype, tuple[list[int], int]] = {}
    for index, (dtype, shape) in enumerate(specs):
        size = torch.Size(shape).numel() * dtype.itemsize
        members, used = open_bucket.get(dtype, ([], 0))
        if members and used + size > bucket_bytes:
            buckets.append(members)
            members, used = [], 0
        open_bucket[dtype] = (members + [index], used + size)
    buckets += [members for members, _ in open_bucket.values() if members]
    return buckets


def broadcast_state(state: Any, device: torch.device, src: int = 0, bucket_bytes: int = BUCKET_BYTES) -> Any:
    """``state`` as rank ``src`` has it, on every rank (``state`` is ignored elsewhere).

    Received tensors live on ``device`` (the backend's device) as views into the buckets they
    came in (no second copy); ``src`` keeps its own. An API that needs a tensor with storage of
    its own (``torch.set_rng_state``) must be given a clone.
    """
    if not dist.is_initialized():
        return state
    tensors: list[torch.Tensor] = []
    header: list[Any] = [None, None]
    if dist.get_rank() == src:
        skeleton = _strip(state, tensors)
        header = [skeleton, [(t.dtype, tuple(t.shape)) for t in tensors]]
    dist.broadcast_object_list(header, src=src, device=device)
    skeleton, specs = header
    sending = dist.get_rank() == src
    received: list[torch.Tensor | None] = [None] * len(specs)
    for members in _buckets(specs, bucket_bytes):
        dtype = specs[members[0]][0]
        sizes = [torch.Size(specs[i][1]).numel() for i in members]
        if sending:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in members])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        if not sending:
            for i, part in zip(members, torch.split(flat, sizes), strict=True):
                received[i] = part.view(specs[i][1])  # views of the bucket: no second copy
                if device.type == "xla":
                    # An XLA view stays one: every in-place update of it (the optimizer's, of a
                    # state loaded from it) then also updates its bucket, in each step's graph.
                    received[i] = received[i].clone()
        del flat
    return state if sending else _fill(skeleton, received)


def all_gather_objects(obj: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank, through tensors on ``device``.

    For the ``xla`` group, where torch's object collectives fail: ProcessGroupXla has no
    ``gather`` (it raises NotImplementedError, torch_xla 2.8.0 torch_xla/distributed/xla_backend.py),
    and ``all_gather_object`` puts its tensors on the host, which the xla group does not take
    (torch 2.8.0 torch/distributed/distributed_c10d.py, ``_get_object_coll_device``). The same
    steps as torch's ``all_gather_object``, with the device named: the sizes, then the pickles
    padded to the longest.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size()
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(n) for n in torch.cat(sizes).tolist()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [pickle.loads(part.cpu()[:length].numpy().tobytes()) for part, length in zip(gathered, lengths, strict=True)]

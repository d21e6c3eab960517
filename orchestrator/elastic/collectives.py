"""The few collectives the elastic API needs, valid with or without a process group.

Without one (a single process that never called ``init_process_group``) the world is this process alone, and
each collective is what it would return in a world of one: the object itself, the tensor unchanged.

Objects travel as :mod:`orchestrator.checkpoint.wire` bytes (tensors in safetensors, the rest as JSON), never
as pickles: torch's ``all_gather_object`` unpickles whatever arrives over the process group's connections,
which are not authenticated (docs/security.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def grouped() -> bool:
    """Whether a default process group exists (collectives go over it)."""
    return dist.is_available() and dist.is_initialized()


def _device() -> torch.device:
    """Where a collective's tensors must be: NCCL's on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    from orchestrator.checkpoint.wire import encode

    return torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8).to(device)


def _from_tensor(data: torch.Tensor) -> Any:
    from orchestrator.checkpoint.wire import decode

    return decode(data.cpu().numpy().tobytes())


def all_gather_object(obj: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (dicts, lists, tuples, numbers, strings, None and tensors), over
    ``group`` (a gloo group of every rank, e.g. a background checkpoint commit's; None: the default group)."""
    if not grouped():
        return [obj]
    device = _device() if group is None else torch.device("cpu")
    data = _to_tensor(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [_from_tensor(g[:int(s.item())]) for g, s in zip(gathered, sizes)]


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (what :func:`all_gather_object` can carry), over ``group`` as there."""
    if not grouped():
        return obj
    device = _device() if group is None else torch.device("cpu")
    data = _to_tensor(obj, device) if dist.get_rank() == 0 else torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    if dist.get_rank() != 0:
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0, group=group)
    return _from_tensor(data)


def all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    """``tensor`` reduced in place over every rank (default SUM); returns it."""
    if grouped():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor


def barrier() -> None:
    """Wait until every rank got here."""
    if grouped():
        dist.barrier()

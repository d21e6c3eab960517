"""The few collectives the elastic API needs, valid with or without a process group.

Without one (a single process that never called ``init_process_group``) the world is this process alone, and
each collective is what it would return in a world of one: the object itself, the tensor unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def grouped() -> bool:
    """Whether a default process group exists (collectives go over it)."""
    return dist.is_available() and dist.is_initialized()


def all_gather_object(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, indexed by rank."""
    if not grouped():
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not grouped():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    """``tensor`` reduced in place over every rank (default SUM); returns it."""
    if grouped():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor


def barrier() -> None:
    """Wait until every rank got here."""
    if grouped():
        dist.barrier()

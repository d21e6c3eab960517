"""Staging: the synchronous copy of a training state into CPU memory that a checkpoint save starts with.

This copy is the whole training stall of an async save, so it is kept cheap: when ``reuse`` is on, the CPU
buffers of the previous save are kept and refilled with ``copy_`` (a fresh allocation costs several times
the copy itself in page faults). Buffers for CUDA tensors are pinned, which makes the device-to-host copy
faster. The price is one CPU copy of the state held between saves, which an async save needs anyway.
The copy also refuses, with the offending path, any type ``torch.load(weights_only=True)`` cannot read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .errors import CheckpointError

# Exactly what torch.load(weights_only=True) accepts on every supported torch (>=2.4); anything else is
# refused before saving, so a checkpoint never needs unsafe unpickling to be read back.
PLAIN_TYPES = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class StagingArea:
    """Copies states to CPU. Contract: the result of :meth:`stage` stays untouched until the next call to
    :meth:`stage`, which may overwrite its tensors in place (the caller must be done with it by then)."""

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep copy of ``state`` with every tensor in CPU memory; CheckpointError for unsupported types."""
        old, self._buffers = self._buffers, {}
        memo: dict[int, torch.Tensor] = {}  # keeps tensors shared (tied weights) shared in the copy
        return {name: self._copy(obj, f"state[{name!r}]", memo, old) for name, obj in state.items()}

    def _copy(self, obj: Any, where: str, memo: dict[int, torch.Tensor], old: dict[str, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = self._copy_tensor(obj.detach(), where, old)
            return memo[id(obj)]
        if isinstance(obj, PLAIN_TYPES):
            return obj
        if type(obj) in (dict, OrderedDict):
            out = type(obj)()
            for k, v in obj.items():
                if not isinstance(k, PLAIN_TYPES):
                    raise CheckpointError(f"{where} has a key of type {type(k).__name__}; use str or int keys")
                out[k] = self._copy(v, f"{where}[{k!r}]", memo, old)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._copy(v, f"{where}[{i}]", memo, old) for i, v in enumerate(obj))
        raise CheckpointError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True)"
            " cannot read back; store tensors, dicts, lists, tuples and plain values (e.g. convert to a tensor)"
        )

    def _copy_tensor(self, src: torch.Tensor, where: str, old: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.reuse or src.layout != torch.strided:
            return src.to("cpu", copy=True)
        buf = old.get(where)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        buf.copy_(src)  # blocking: the background writer may read it right after stage() returns
        self._buffers[where] = buf
        return buf

"""A training state as bytes without pickle: tensors in a safetensors blob, everything else as JSON.

The one pickle-free codec of orch. Checkpoints in ``checkpoint.format=safetensors`` store each payload as
:func:`split` makes it; a healing replica group receives a peer's state as :func:`encode` bytes
(orchestrator/ft/transport.py: torchft's own HTTP transport sends ``torch.save`` bytes and loads them with
``weights_only=False``, so whoever can reach a recovering worker could run code in it); the elastic API's
object collectives carry them too (orchestrator/elastic/collectives.py). It holds what state dicts are made
of (dicts with any such keys, lists, tuples, None, bool, int, float, str, tensors) and refuses anything else
on both sides, so decoding runs no code whatever the bytes say.

Layout: 8-byte little-endian length of the JSON header, the header, then the safetensors bytes.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_LEN = struct.Struct("<Q")
MAX_HEADER = 256 * 1024 * 1024


class WireError(ValueError):
    """Bytes that are not an orch wire state, or an object it cannot hold."""


def encode(obj: Any) -> bytes:
    skeleton, tensors = split(obj)
    header = json.dumps(skeleton, separators=(",", ":")).encode()
    return _LEN.pack(len(header)) + header + st_save(tensors)


def split(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` as a JSON-able skeleton and the tensors it refers to by name (what safetensors stores);
    :func:`join` puts them back together. WireError for anything it cannot hold."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = str(len(tensors))
            # A private, contiguous CPU copy: safetensors refuses shared or strided storage.
            tensors[name] = value.detach().to("cpu").contiguous().clone()
            return {"t": name}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(value)}
        if isinstance(value, dict):
            return {"d": [[enc(k), enc(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"u": [enc(v) for v in value]}
        if isinstance(value, list):
            return [enc(v) for v in value]
        raise WireError(f"cannot send a {type(value).__name__} in a training state (tensors, numbers, strings, "
                        "None and dicts/lists/tuples of them only)")

    return enc(obj), tensors


def decode(data: bytes) -> Any:
    if len(data) < _LEN.size:
        raise WireError("truncated state: no header length")
    (n,) = _LEN.unpack_from(data)
    if n > MAX_HEADER or _LEN.size + n > len(data):
        raise WireError(f"bad header length {n} for {len(data)} bytes")
    try:
        skeleton = json.loads(data[_LEN.size:_LEN.size + n])
        tensors = st_load(data[_LEN.size + n:])
    except (ValueError, RuntimeError) as exc:
        raise WireError(f"not an orch wire state: {exc}") from None
    return join(skeleton, tensors)


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The object :func:`split` took apart; WireError for a skeleton it did not write."""

    def dec(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [dec(v) for v in value]
        if isinstance(value, dict) and len(value) == 1:
            (kind, body), = value.items()
            if kind == "t" and body in tensors:
                return tensors[body]
            if kind == "f" and body in ("inf", "-inf", "nan"):
                return float(body)
            if kind == "u" and isinstance(body, list):
                return tuple(dec(v) for v in body)
            if kind == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {_key(dec(k)): dec(v) for k, v in body}
        raise WireError(f"unexpected element in state header: {str(value)[:80]}")

    return dec(skeleton)


def _key(key: Any) -> Any:
    if isinstance(key, torch.Tensor) or isinstance(key, list):
        raise WireError("a tensor or list cannot be a dict key")
    return key

"""``orch ckpt export``: a checkpoint's model weights alone, as one safetensors file for serving or the Hugging
Face ecosystem (``safetensors.torch.load_file`` reads it; no optimizer, RNG or trainer state, no pickle).

A ``dcp`` checkpoint's shards (any world size, DDP or FSDP2) are consolidated in this one process: the full tensors
the index describes are allocated and DCP fills them (``no_dist``) through orch's safe reader, never DCP's
pickle-loading one (orchestrator/checkpoint/dcp_metadata.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from orchestrator.errors import UserError

from .locate import checkpoint_url_of
from .manager import CheckpointManager, LoadedCheckpoint
from .manifest import DCP_FORMAT
from .storage import step_dirname

EXPORT_FORMATS = ("safetensors",)


def export_weights(run_or_url: str, out: str, fmt: str = "safetensors", step: Optional[int] = None,
                   payload: str = "model") -> tuple[int, int]:
    """Write the ``payload`` (the model's state dict) of checkpoint ``step`` (None: the newest valid one) of a
    run dir or checkpoint URL to ``out``; returns (step, number of tensors). UserError (exit 2) for a format
    other than safetensors, no valid checkpoint, or a payload that is not a flat dict of tensors."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"--format={fmt!r} is not an export format. Fix: use --format safetensors")
    url = checkpoint_url_of(run_or_url)
    manager = CheckpointManager(url)
    loaded = manager.load(step)
    if loaded is None:
        raise UserError(f"no valid checkpoint under {url}. Fix: `orch ckpt list {url}` shows what is there")
    weights = _dcp_weights(manager, loaded, payload) if loaded.format == DCP_FORMAT else loaded.state.get(payload)
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise UserError(f"checkpoint step {loaded.step} under {url} has no {payload!r} payload of named tensors "
                        f"(payloads: {', '.join(sorted(loaded.state))}). Fix: export a checkpoint orch's trainer or "
                        "an elastic Session saved")
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"-o {out!r}: the directory {parent} does not exist. Fix: create it or write elsewhere")
    # safetensors refuses tensors sharing memory (tied weights): every tensor gets its own contiguous copy.
    tensors = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    save_file(tensors, out, metadata={"orch_step": str(loaded.step), "orch_source": url})
    return loaded.step, len(tensors)


def _dcp_weights(manager: CheckpointManager, loaded: LoadedCheckpoint, payload: str) -> Optional[dict]:
    """The full tensors of ``payload`` in a ``dcp`` checkpoint (None when it has none), read in this process."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_engine  # noqa: F401 - its filter of DCP's one-process warning
    from .dcp_metadata import METADATA_NAME, SafeReader, parse_metadata

    stepdir = step_dirname(loaded.step)
    sha = loaded.files[METADATA_NAME].sha256
    index = parse_metadata(manager.storage.read_bytes(f"{stepdir}/{METADATA_NAME}"), sha)
    head = f"{payload}."
    target = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in index.state_dict_metadata.items()
              if k.startswith(head)}
    if not target:
        return None
    dcp.load(target, storage_reader=SafeReader(manager.storage.url_for(stepdir), sha), no_dist=True)
    return {k[len(head):]: v for k, v in target.items()}

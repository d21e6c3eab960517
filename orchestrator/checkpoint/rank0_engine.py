"""The ``rank0`` engine: rank 0 writes the whole state (under DDP every rank holds the same), every rank reads.

Rank 0 picks the checkpoint and broadcasts its step, so every rank loads the same one even while newer
directories appear or are found corrupt; each payload is one file in ``checkpoint.format``.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

from orchestrator.errors import CheckpointError
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import TrainingState

from .engine_api import Collectives, Restored
from .manager import CheckpointManager
from .manifest import DCP_FORMAT


class Rank0Engine:
    """See the module docstring; :class:`~.engines.CheckpointEngine`'s contract."""

    name = "rank0"

    def __init__(self, manager: CheckpointManager, state: TrainingState, ctx: DistContext, comm: Collectives):
        self.manager, self.state, self.ctx, self.comm = manager, state, ctx, comm

    def save(self, step: int, metadata: Optional[dict[str, Any]], records: Mapping[str, Any], *,
             sync: bool = False) -> float:
        if not self.ctx.is_main:
            return 0.0
        payloads = self.state.state_dict(self.ctx.world_size, records)
        stall_s = self.manager.save(step, payloads, metadata)
        if sync:
            self.manager.wait()
        return stall_s

    def restore(self, wanted: Optional[int], records: Mapping[str, Any]) -> Optional[Restored]:
        loaded = None
        if self.ctx.is_main:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                loaded = self.manager.load(wanted)
        step = self.comm.broadcast_object(loaded.step if loaded else None)
        if step is None:
            return None
        loaded = loaded if self.ctx.is_main else self.manager.load(step)
        if loaded.format == DCP_FORMAT:
            raise CheckpointError(f"checkpoint step {step} under {self.manager.url} holds DCP shards (written with "
                                  "checkpoint.engine=dcp). Fix: resume it with checkpoint.engine=dcp")
        self.state.check(loaded.state, step)
        self.state.load_state_dict(loaded.state, records)
        return Restored(step, loaded.metadata, loaded.format)

    def wait(self) -> None:
        if self.ctx.is_main:
            self.manager.wait()

"""Checkpoint engines by name (``checkpoint.engine``): ``rank0`` or ``dcp``; their contract is
orchestrator/checkpoint/engine_api.py."""

from __future__ import annotations

from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import TrainingState

from .engine_api import CheckpointEngine, Collectives
from .manager import CheckpointManager
from .rank0_engine import Rank0Engine

ENGINES = ("rank0", "dcp")


def make_engine(name: str, manager: CheckpointManager, state: TrainingState, ctx: DistContext,
                comm: Collectives, async_save: bool) -> CheckpointEngine:
    """The engine ``name`` (one of :data:`ENGINES`) over ``manager``."""
    if name == "dcp":
        from .dcp_engine import DcpEngine  # torch DCP (~1 s of imports) only for the engine that uses it

        return DcpEngine(manager, state, ctx, comm, async_save)
    return Rank0Engine(manager, state, ctx, comm)

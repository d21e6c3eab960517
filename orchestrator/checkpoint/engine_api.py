"""What a checkpoint engine is (orchestrator/checkpoint/engines.py picks one by name): who writes a session's
state and how it is read back (``checkpoint.engine``).

``rank0`` (orchestrator/checkpoint/rank0_engine.py): rank 0 writes the whole state, one payload per component,
what every rank holds under DDP. ``dcp`` (orchestrator/checkpoint/dcp_engine.py): every rank writes its own
shards of the modules and optimizers through torch DCP, the rest is rank 0's (safetensors + JSON); it reshards on
load at any world size. Both commit through :class:`~orchestrator.checkpoint.CheckpointManager` (manifest last,
fence, retention, lineage), so ``orch ckpt`` reads either. The session calls only this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

from .manager import CheckpointManager


class Collectives(Protocol):
    """The object collectives an engine needs (orchestrator/elastic/collectives.py: pickle-free)."""

    def all_gather_object(self, obj: Any, world_size: int, group: Any = None) -> list[Any]: ...

    def broadcast_object(self, obj: Any, group: Any = None) -> Any: ...


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: its step, its manifest's metadata and the format it was written in."""

    step: int
    metadata: dict[str, Any]
    format: str


class CheckpointEngine(Protocol):
    """Saves and restores a :class:`TrainingState`; every rank calls every method, in the same order."""

    manager: CheckpointManager

    def save(self, step: int, metadata: Optional[dict[str, Any]], records: Mapping[str, Any], *,
             sync: bool = False) -> float:
        """Checkpoint the state plus ``records`` (name -> Stateful, e.g. the RNG states) as ``step`` with the
        manifest ``metadata`` (rank 0's; None elsewhere); ``sync``: committed before it returns (an emergency
        save). Returns the seconds the loop was blocked."""
        ...

    def restore(self, wanted: Optional[int], records: Mapping[str, Any]) -> Optional[Restored]:
        """Load step ``wanted`` (None: the newest valid one) into the state and ``records``; None when there is
        none. Every rank loads the same step."""
        ...

    def wait(self) -> None:
        """Block until no save of this rank is in flight; CheckpointError if the last one failed."""
        ...

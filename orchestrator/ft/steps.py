"""The worker side of a fault-tolerance mode: one step protocol, which the session calls at fixed points
whatever the mode (``fault_tolerance.mode``); :func:`orchestrator.ft.worker.step_protocol` picks the
implementation.

The session (orchestrator/elastic/session.py) calls, in this order:

- :meth:`~StepProtocol.gradient_handoff` when the model is spread over the ranks (the strategy's ``handoff``);
- :meth:`~StepProtocol.record_start` once the worker joined its process group (the round it joined);
- :meth:`~StepProtocol.attach` when the training state is registered: it returns what the session calls from
  then on;
- at restore, :meth:`~StepProtocol.heal` before storage is read (a live peer may hand over the state: then
  storage is not read), else :meth:`~StepProtocol.restored` after the restore from storage;
- :meth:`~StepProtocol.membership` for the global batch sampler;
- each step: :meth:`~StepProtocol.begin_step`, the step (the registered optimizer's ``step()`` may ask
  :meth:`~StepProtocol.commit`, ``sync_gradients`` :meth:`~StepProtocol.sync_gradients`), then
  :meth:`~StepProtocol.end_step` at the boundary (commit or discard), :meth:`~StepProtocol.window_rolled`
  when a metrics window closes, :meth:`~StepProtocol.mean_across_groups` on a logged record's values;
- :meth:`~StepProtocol.notices` once, when the session starts watching for preemption notices; on an agreed
  notice, :meth:`~StepProtocol.peers_hold_state` (then :meth:`~StepProtocol.left`);
- :meth:`~StepProtocol.shutdown` at the end.

Restart mode's implementation, :class:`RestartSteps`, does nothing: torchrun restarts every worker on a
membership change and the session restores from storage. per_step's is the replica group of
orchestrator/ft/replica.py (torchft, under orch's launcher only). The driver side of a mode is
orchestrator/ft/driver.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from orchestrator.events import Event, RendezvousComplete, Restart
from orchestrator.parallel.base import GradientHandoff
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Stateful, TrainingState

Emit = Callable[..., Any]
"""``emit(event, **fields)``: writes this worker's event to the run's events (a no-op outside a run); a mode
calls it through :func:`send`, with one of orchestrator/events.py's events."""
Membership = Callable[[], tuple[int, int, int]]
"""Per step: (world size, rank, global sample position) of the step about to be drawn."""


def send(emit: Emit, event: Event) -> None:
    """Hand ``event`` to ``emit`` as the protocol's ``emit`` takes it: its name, then its JSON fields."""
    emit(event.event, **event.fields())


class StepProtocol(Protocol):
    """What a fault-tolerance mode does inside a worker. Every rank calls the same methods in the same order."""

    def record_start(self, emit: Emit, ctx: DistContext) -> None:
        """The round this worker joined, in the run's events (the ranks that write it are the mode's choice)."""

    def attach(self, state: TrainingState, emit: Emit, window: Stateful) -> "StepProtocol":
        """The registered ``state`` (the process group exists by now); returns the protocol to call from now
        on. ``window``: the metrics log's open window, a record that a peer may hand over with the state."""

    def heal(self) -> bool:
        """At restore, before storage is read: whether a live peer's state was loaded (storage is not read)."""

    def restored(self, step: int) -> None:
        """After a restore from storage, at ``step`` (0: nothing was restored)."""

    def membership(self) -> Optional[Membership]:
        """The sampler's per-step world, rank and data position; None: the process group's, fixed."""

    def begin_step(self) -> None:
        """Before each step; may load a peer's state (the step to train is known after it)."""

    def commit(self) -> bool:
        """Whether the step being trained counts (decided once per step; the optimizer steps only then)."""

    def end_step(self) -> bool:
        """At the step boundary: commit, or discard the step and put the state back as it was when the step
        began (the session trains it again). Returns whether the step committed."""

    def window_rolled(self) -> Optional[dict[str, float]]:
        """A metrics window closes: this mode's seconds within it (the record's ``ft``; None: nothing to say);
        the next window starts at zero."""

    def sync_gradients(self) -> None:
        """Average the gradients over whatever the process group does not span (once per step)."""

    def gradient_handoff(self) -> Optional[GradientHandoff]:
        """Where the parallelism strategy hands each gradient once it is final within the process group, so that
        averaging it over what the process group does not span overlaps the backward pass (:meth:`sync_gradients`
        then waits for it); None: there is nothing to average (the process group is the job)."""

    def mean_across_groups(self, means: torch.Tensor) -> torch.Tensor:
        """A logged record's values, means over the process group, as means over the job (whatever the process
        group does not span), so the record reads the global batch's loss in every mode."""

    def notices(self, pending: Callable[[], bool]) -> None:
        """``pending()``: whether this worker holds a preemption notice that the next step boundary will act on.
        A mode that starts the next step's work before the boundary (per_step's quorum) holds it back then."""

    def peers_hold_state(self) -> bool:
        """Whether workers outside this node go on with the state, so a noticed node may leave unsaved."""

    def left(self, step: int, notice_t: float) -> None:
        """This node left at the boundary after ``step`` with nothing saved, its peers holding the state."""

    def sample_record(self, ctx: DistContext, start_sample: int, world_size: int, rank: int) -> tuple[str, dict]:
        """Where the built-in trainer records a step's sample ids (a file name under ``samples/``, without
        ``.jsonl``) and what each record adds: the step's data position, world and rank where they vary."""

    def shutdown(self) -> None:
        """After the last step."""


class RestartSteps:
    """``fault_tolerance.mode=restart``: nothing happens inside a step. A membership change restarts every
    worker (torchrun), which then restores from storage; the rank's round is torchrun's rendezvous."""

    def record_start(self, emit: Emit, ctx: DistContext) -> None:
        if ctx.is_main:
            send(emit, RendezvousComplete(world_size=ctx.world_size, restart_count=ctx.restart_count,
                                          nnodes=ctx.world_size // ctx.local_world_size))
            if ctx.restart_count:
                send(emit, Restart(restart_count=ctx.restart_count, world_size=ctx.world_size,
                                   reason="workers restarted by the torchrun agent"))

    def attach(self, state: TrainingState, emit: Emit, window: Stateful) -> StepProtocol:
        return self

    def heal(self) -> bool:
        return False

    def restored(self, step: int) -> None:
        pass

    def membership(self) -> Optional[Membership]:
        return None

    def begin_step(self) -> None:
        pass

    def commit(self) -> bool:
        return True

    def end_step(self) -> bool:
        return True

    def window_rolled(self) -> Optional[dict[str, float]]:
        return None

    def sync_gradients(self) -> None:
        pass  # DDP averaged the gradients in the backward pass

    def gradient_handoff(self) -> Optional[GradientHandoff]:
        return None

    def mean_across_groups(self, means: torch.Tensor) -> torch.Tensor:
        return means  # the process group is the job

    def notices(self, pending: Callable[[], bool]) -> None:
        pass

    def peers_hold_state(self) -> bool:
        return False

    def left(self, step: int, notice_t: float) -> None:
        pass

    def sample_record(self, ctx: DistContext, start_sample: int, world_size: int, rank: int) -> tuple[str, dict]:
        return f"rank{ctx.rank}", {}

    def shutdown(self) -> None:
        pass


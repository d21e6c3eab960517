"""What the run's workers (and drills) told the controller through the run dir, as typed facts.

Workers write events (``training_finished``, ``first_step``, ``preemption_notice``, ``worker_failed``, ...);
the controller reads them here, through :meth:`WorkerView.update`, as the typed events of orchestrator/events.py
(:func:`~orchestrator.events.parse`), and never handles a raw record itself. Their heartbeats (each worker's
latest completed step and its time) say the job trains when no event does: see :meth:`first_step_since`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.events import FirstStep as FirstStepEvent
from orchestrator.events import (ChaosKill, LeaseLost, PreemptionNotice, QuorumChanged, TrainingFinished, WorkerFailed,
                                 parse)
from orchestrator.controller.hang_policy import read_beats
from orchestrator.rundir import HEARTBEATS_DIR, EventLog

KEEP_STEPS = 10
KEEP_FAILURES = 64
BEATS_EVERY_S = 0.5  # how often first_step_since reads the heartbeats while no event answers it


@dataclass(frozen=True)
class Notice:
    """A preemption notice a node's workers received (``source``: chaos, a cloud's, ``sigterm``...)."""

    node: Optional[int]
    t: float
    source: str


@dataclass(frozen=True)
class FirstStep:
    """The first step of an attempt (or of a fault-tolerance mode's new quorum): what a recovery ends on."""

    t: float
    step: Optional[int]
    world_size: Optional[int]


class WorkerView:
    """The facts in ``events`` (tailed from the end: this launch's), refreshed by :meth:`update`."""

    def __init__(self, events: EventLog, monotonic: Callable[[], float]):
        self._tail, self._monotonic = events.tail(), monotonic
        self._beats_dir = Path(events.path).parent / HEARTBEATS_DIR
        self._beats_read_at = -1e9
        self.training_finished: Optional[float] = None
        """Monotonic time ``training_finished`` was first seen."""
        self.lease_lost: Optional[str] = None
        """Why the run's lease is gone (its writes are fenced: the run must stop)."""
        self.notices: list[Notice] = []
        self.first_steps: list[FirstStep] = []
        self.failures: list[dict[str, Any]] = []
        """``worker_failed`` records (what failure signatures are computed from)."""
        self._losses: list[float] = []

    def update(self) -> None:
        for record in self._tail.read_new():
            event = parse(record)
            if event is None:
                continue
            t = record.get("t")
            if isinstance(event, ChaosKill):
                self._losses.append(t)
            elif isinstance(event, TrainingFinished) and self.training_finished is None:
                self.training_finished = self._monotonic()
            elif isinstance(event, PreemptionNotice):
                self.notices.append(Notice(event.node, t, str(event.source or "")))
            elif isinstance(event, (FirstStepEvent, QuorumChanged)):
                self.first_steps = [*self.first_steps[-(KEEP_STEPS - 1):], FirstStep(t, event.step, event.world_size)]
            elif isinstance(event, WorkerFailed):
                self.failures = [*self.failures[-(KEEP_FAILURES - 1):], record]  # failure signatures read the record
            elif isinstance(event, LeaseLost) and self.lease_lost is None:
                self.lease_lost = event.reason or f"lease on {event.url} lost"

    def take_losses(self) -> list[float]:
        """Wall times of nodes a drill killed since the last call."""
        losses, self._losses = self._losses, []
        return losses

    def first_step_since(self, t: float) -> Optional[FirstStep]:
        """The first step completed at or after ``t``: an attempt's ``first_step`` or a new quorum's, else (read
        at most every BEATS_EVERY_S) the earliest step completion at or after ``t`` that a worker's heartbeat
        shows, to within a heartbeat. The job may go on without either event: a mode's survivors may commit
        their first step without the lost group before the controller sees its agent go (a Ray node's death is
        known a second or two late), and a node lost before it joined any round (a restart mode scale-up) cut
        no survivor's training short. A step needs every rank of its round, so none completes after a loss
        in a round the lost node was in: a step completed after it is the job training again."""
        event = next((s for s in self.first_steps if s.t >= t), None)
        if event is not None or self._monotonic() - self._beats_read_at < BEATS_EVERY_S:
            return event
        self._beats_read_at = self._monotonic()
        after = [b for b in read_beats(self._beats_dir) if b.step_t is not None and b.step_t >= t]
        first = min(after, key=lambda b: b.step_t, default=None)
        return FirstStep(first.step_t, first.step, None) if first is not None else None

    def failures_since(self, t: float) -> list[dict[str, Any]]:
        return [e for e in self.failures if e["t"] >= t]

    def noticed(self, node: int, since: float) -> bool:
        """A preemption notice for ``node`` at or after ``since``."""
        return any(n.node == node and n.t >= since for n in self.notices)

"""What the run's workers (and drills) told the controller through the run dir, as typed facts.

Workers write events (``training_finished``, ``first_step``, ``preemption_notice``, ``worker_failed``, ...);
the controller reads them here, through :meth:`WorkerView.update`, as the typed events of orchestrator/events.py
(:func:`~orchestrator.events.parse`), and never handles a raw record itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from orchestrator.events import FirstStep as FirstStepEvent
from orchestrator.events import (ChaosKill, LeaseLost, PreemptionNotice, QuorumChanged, TrainingFinished, WorkerFailed,
                                 parse)
from orchestrator.rundir import EventLog

KEEP_STEPS = 10
KEEP_FAILURES = 64


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
        return next((s for s in self.first_steps if s.t >= t), None)

    def failures_since(self, t: float) -> list[dict[str, Any]]:
        return [e for e in self.failures if e["t"] >= t]

    def noticed(self, node: int, since: float) -> bool:
        """A preemption notice for ``node`` at or after ``since``."""
        return any(n.node == node and n.t >= since for n in self.notices)

"""The controller's states, as data. The controller's ``_step`` dispatches on ``state.name``; a state never
reaches back into the controller. Every transition is recorded as a ``controller_state`` event.

    scheduling -> running <-> recovering -> finished | failed
         ^            |            |
         +-- stopping (restart every node after a failure; also the way out on a signal or a failure)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from orchestrator.controller.api import RunStatus


class StateName(StrEnum):
    SCHEDULING = "scheduling"  # placing agents until MIN are running (at launch, or after a full restart)
    RUNNING = "running"  # training; a machine that becomes available gets an agent: the job grows to MAX
    RECOVERING = "recovering"  # a node was lost; the survivors re-rendezvous; growth waits for their first step
    STOPPING = "stopping"  # every agent was told to stop; once all are gone, go on to ``then``
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (StateName.FINISHED, StateName.FAILED)


@dataclass(frozen=True)
class State:
    """One state. ``then``: where stopping goes next; ``status``/``reason``: how a terminal state ended."""

    name: StateName
    then: Optional["State"] = None
    status: Optional[RunStatus] = None
    reason: Optional[str] = None

    @property
    def is_terminal(self) -> bool:
        return self.name.is_terminal


SCHEDULING = State(StateName.SCHEDULING)
RUNNING = State(StateName.RUNNING)
RECOVERING = State(StateName.RECOVERING)


def stopping(then: State) -> State:
    return State(StateName.STOPPING, then=then)


def finished(status: RunStatus) -> State:
    return State(StateName.FINISHED, status=status)


def failed(reason: str) -> State:
    return State(StateName.FAILED, status=RunStatus.FAILED, reason=reason)

"""The controller's states, one class each. ``step(controller)`` does one round of work and returns the next
state (itself to stay); the controller records every transition as a ``controller_state`` event.

    scheduling -> running <-> recovering -> finished | failed
         ^            |            |
         +-- stopping (restart every node after a failure; also the way out on a signal or a failure)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from orchestrator.controller.controller import Controller


class State:
    name = "state"
    terminal = False
    status: Optional[str] = None

    def step(self, c: "Controller") -> "State":
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Scheduling(State):
    """Place node agents on free slots (at launch, or after every node was restarted) until MIN are running."""

    name = "scheduling"

    def step(self, c: "Controller") -> State:
        nxt = c.handle_signal() or c.handle_updates()
        if nxt:
            return nxt
        decision = c.scale(grow=True)
        if decision.fail_reason:
            return c.stop_all_then(Failed(decision.fail_reason))
        return Running() if c.started_agents() >= c.min_nodes else self


class _Active(State):
    """Shared by running and recovering: record agent exits, finish when training has, keep nodes coming
    (growth toward MAX waits while a loss is not recovered from; getting back to MIN never waits)."""

    def step(self, c: "Controller") -> State:
        nxt = c.handle_signal() or c.handle_updates()
        if nxt:
            return nxt
        if c.all_done():
            return c.conclude()
        if c.training_finished:
            c.stop_lingering_agents()
            return self
        decision = c.scale(grow=c.loss_t is None)
        if decision.fail_reason:
            return c.stop_all_then(Failed(decision.fail_reason))
        return self.after(c)

    def after(self, c: "Controller") -> State:
        return self


class Running(_Active):
    """Training. A node that becomes available gets an agent at once: the job grows toward MAX."""

    name = "running"

    def after(self, c: "Controller") -> State:
        return Recovering() if c.loss_t is not None else self


class Recovering(_Active):
    """A node was lost; the survivors re-rendezvous by themselves against the store the driver keeps. Growth
    waits (unless below MIN) until a training step completes after the loss, then the run is recovered."""

    name = "recovering"

    def after(self, c: "Controller") -> State:
        return Running() if c.check_recovered() else self


class Stopping(State):
    """Every agent was told to stop; once all are gone, go on to ``then`` (fresh scheduling, or an end)."""

    name = "stopping"

    def __init__(self, then: State):
        self.then = then

    def step(self, c: "Controller") -> State:
        c.handle_updates()
        return self.then if c.stopped_or_timed_out() else self


class Finished(State):
    """The run ended: ``status`` is succeeded, interrupted (SIGINT) or preempted (SIGTERM to orch)."""

    name = "finished"
    terminal = True

    def __init__(self, status: str):
        self.status = status


class Failed(State):
    """The run failed; ``reason`` is the controller's account (budgets spent, too few nodes, ...)."""

    name = "failed"
    terminal = True
    status = "failed"

    def __init__(self, reason: str):
        self.reason = reason

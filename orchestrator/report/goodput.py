"""Goodput: the share of wall time spent on training steps that count, and where every other second went.

Derived from events.jsonl and metrics.jsonl alone. An *attempt* is the stretch of training after one
``rendezvous_complete``; its logged step windows (metrics.jsonl: ``step_time_s`` x steps since the previous
line) cover it from its first step to its last logged one. A step trained by an attempt and then trained
again by a later attempt (which resumed from an earlier checkpoint) is *lost*. Wall time (``launch_started``
to ``run_finished``) is then productive step time plus these badput categories, which partition the rest:

- ``launch_s``: at launch, until the last node agent of the first round was running (Ray placement, pods
  being scheduled, agent processes spawned).
- ``waiting_for_nodes_s``: the same after an interruption: until a replacement node's agent was running.
- ``rendezvous_s``: node agents running -> worker processes started (torchrun's own start-up, failure
  detection by the survivors, the rendezvous round), plus the workers' process-group initialization.
- ``worker_start_s``: worker processes started -> first step: interpreter, imports, config, model build
  (model, DDP, optimizer, dataset), data loader.
- ``restore_s``: loading the checkpoint to resume from.
- ``checkpoint_stall_s``: the loop blocked by saves: periodic (the part before an async write) and emergency.
- ``lost_s``: steps trained twice, plus the work in flight when an attempt failed (from its last logged step
  to the first sign of the failure: a partial step, steps not yet logged).
- ``shutdown_s``: after the last logged step until the run finished (final checkpoint wait, processes
  exiting, agents collected).
- a fault-tolerance mode's own categories, inside the step windows, which its workers log per metrics window
  (a record's ``ft``: ``{"<category>_s": seconds}``); a mode with quorums logs ``quorum_wait_s``,
  ``healing_s``, ``discarded_s``: the leading group's time forming each step's quorum, in quorums where a group
  healed (a new or returning one loading a peer's state), and in steps that did not commit (redone by the
  next quorum).
- ``other_s``: the remainder (what no event bounds, e.g. the preemption agreement before an emergency save).

Each gap between two attempts (and the launch before the first) is cut at the next attempt's start-up
milestones: the ``worker_started`` event rank 0 of the built-in trainer writes (each milestone's latest time
over ranks, see ``orchestrator/runtime/timing.py``). Without it (a user entrypoint, an older run dir) the
launcher's node events, ``rendezvous_complete`` and ``checkpoint_loaded`` stand in, and worker imports count
as rendezvous. ``attempts`` lists each gap's split, so a recovery can be read second by second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from orchestrator.rundir import EventName

CATEGORIES = ("launch", "waiting_for_nodes", "rendezvous", "worker_start", "restore", "checkpoint_stall", "lost",
              "shutdown", "other")
# The segment of a recovery that ends at each start-up milestone, in order (the first one's label is launch or
# waiting_for_nodes); the segment after the last known milestone, up to the first step, is worker_start.
MILESTONE_SEGMENTS = (("agent_start_t", None), ("process_start_t", "rendezvous"), ("entry_t", "worker_start"),
                      ("imports_t", "worker_start"), ("config_t", "worker_start"), ("process_group_t", "rendezvous"),
                      ("model_t", "worker_start"), ("restore_t", "restore"), ("ready_t", "worker_start"))
FAILURE_EVENTS = (EventName.CHAOS_KILL, EventName.NODE_LOST, EventName.NODE_FAILED, EventName.WORKER_FAILED, EventName.CHAOS_PARTITION)
NODE_UP_EVENTS = (EventName.NODE_STARTED, EventName.NODE_JOINED, EventName.NODE_STANDBY_STARTED)


@dataclass
class Attempt:
    """The logged training of one rendezvous round: its step windows span ``[first_t, last_t]``."""

    index: int
    first_t: float
    last_t: float
    first_step: int
    last_step: int
    first_metric_t: float


@dataclass
class Steps:
    """Every logged step, kept (final lineage) or lost (trained again later), with its seconds."""

    kept: dict[int, tuple[int, float]] = field(default_factory=dict)  # step -> (attempt, seconds)
    lost: dict[tuple[int, int], float] = field(default_factory=dict)  # (attempt, step) -> seconds
    attempts: dict[int, Attempt] = field(default_factory=dict)


def _attempt_of(t: float, starts: list[float]) -> int:
    return sum(1 for s in starts if s <= t) - 1


def _steps(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> Steps:
    starts = [e["t"] for e in events if e["event"] == EventName.RENDEZVOUS_COMPLETE]
    first_steps = sorted((e["t"], e["step"]) for e in events if e["event"] == EventName.FIRST_STEP)
    out, prev = Steps(), {}
    for m in sorted(metrics, key=lambda m: m["t"]):
        attempt = _attempt_of(m["t"], starts)
        if attempt not in prev:  # first record of an attempt: it resumed right before its first step
            begun = [s for t, s in first_steps if _attempt_of(t, starts) == attempt]
            first = begun[0] if begun else m["step"]
            for step in [s for s in out.kept if s >= first]:  # trained before, now trained again
                was, seconds = out.kept.pop(step)
                out.lost[(was, step)] = seconds
            prev[attempt] = first - 1
        window = range(prev[attempt] + 1, m["step"] + 1)
        for step in window:
            out.kept[step] = (attempt, m["step_time_s"])
        span = out.attempts.get(attempt)
        if span is None:
            out.attempts[attempt] = Attempt(attempt, m["t"] - len(window) * m["step_time_s"], m["t"], prev[attempt] + 1,
                                            m["step"], m["t"])
        else:
            span.last_t, span.last_step = m["t"], m["step"]
        prev[attempt] = m["step"]
    return out


def step_durations(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> tuple[dict[int, float], float, int]:
    """(seconds per step of the final lineage, seconds of lost steps, number of lost steps)."""
    steps = _steps(events, metrics)
    return {s: seconds for s, (_, seconds) in steps.kept.items()}, sum(steps.lost.values()), len(steps.lost)


class Timeline:
    """Cuts one gap ``[cursor, end]`` into labelled consecutive segments; unlabelled time is ``other``."""

    def __init__(self, start: float, end: float, totals: dict[str, float]):
        self.cursor, self.end, self.totals = start, end, totals
        self.split: dict[str, float] = {}

    def to(self, t: Optional[float], label: Optional[str]) -> None:
        """Label the time from the cursor to ``t`` (clamped into the gap); None labels nothing."""
        if t is None:
            return
        t = min(max(t, self.cursor), self.end)
        if label is not None and t > self.cursor:
            self.split[label] = self.split.get(label, 0.0) + (t - self.cursor)
            self.totals[label] = self.totals.get(label, 0.0) + (t - self.cursor)
        self.cursor = t


def _between(events: list[dict[str, Any]], start: float, end: float, names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] in names and start < e["t"] <= end]


def _milestones(events: list[dict[str, Any]], gap_start: float, attempt: Attempt,
                rendezvous_t: Optional[float]) -> dict[str, float]:
    """The start-up milestones of ``attempt``: its ``worker_started``, else what launcher and rank 0 events say."""
    lo = rendezvous_t if rendezvous_t is not None else gap_start
    reported = [e for e in events if e["event"] == EventName.WORKER_STARTED and lo <= e["t"] <= attempt.first_metric_t]
    if reported:
        return {k: v for k, v in reported[-1].items() if k.endswith("_t") and isinstance(v, (int, float))}
    found: dict[str, float] = {}
    # A standby replacement's node_started only hands over an agent booted at node_standby_started.
    ups = [e["t"] for e in _between(events, gap_start, attempt.first_t, NODE_UP_EVENTS) if not e.get("standby")]
    if ups:
        found["agent_start_t"] = max(ups)
    if rendezvous_t is not None:
        found["process_group_t"] = rendezvous_t
    loaded = _between(events, lo, attempt.first_metric_t, (EventName.CHECKPOINT_LOADED,))
    if loaded:
        found["model_t"] = loaded[-1]["t"] - loaded[-1].get("restore_s", 0.0)
        found["restore_t"] = loaded[-1]["t"]
    return found


def _end_of_attempt(tl: Timeline, events: list[dict[str, Any]], ended: Attempt, stall_s: float,
                    next_start: float) -> str:
    """Label a gap from the previous attempt's last logged step to where that attempt ended; returns the cause.

    A pending periodic save's stall comes first; then an emergency checkpoint (steps after the last logged
    one that it kept are productive, its save a stall), else the work in flight up to the first sign of a
    failure is lost (unless training had finished: then what follows is shutdown)."""
    start = tl.cursor
    tl.to(start + stall_s, "checkpoint_stall")
    emergency = _between(events, start, next_start, (EventName.EMERGENCY_CHECKPOINT,))
    if emergency:
        e = emergency[-1]
        tl.to(e["t"] - e.get("save_s", 0.0), "productive" if e.get("step", 0) > ended.last_step else None)
        tl.to(e["t"], "checkpoint_stall")
        return "preemption"
    failed = _between(events, start, next_start, FAILURE_EVENTS)
    if failed and not _between(events, start, next_start, (EventName.TRAINING_FINISHED,)):
        tl.to(min(e["t"] for e in failed), "lost")
        return "failure"
    return "preemption" if _between(events, start, next_start, (EventName.NODE_PREEMPTED,)) else "restart"


def _move_save_stalls(events: list[dict[str, Any]], steps: Steps, starts: list[float],
                      totals: dict[str, float]) -> dict[int, float]:
    """Periodic saves block the loop inside the window of the step after the save: move that time from the
    step (productive or lost) to ``checkpoint_stall``. Returns, per attempt, the stall of a save after its
    last logged step, which blocks in the gap that follows instead."""
    emergency_steps = {e["step"] for e in events if e["event"] == EventName.EMERGENCY_CHECKPOINT}
    pending: dict[int, float] = {}
    for e in events:
        if e["event"] != EventName.CHECKPOINT_SAVED or e.get("step") in emergency_steps or not e.get("stall_s"):
            continue
        attempt, after = _attempt_of(e["t"], starts), e["step"] + 1
        if steps.kept.get(after, (None,))[0] == attempt:
            where = "productive"
        elif (attempt, after) in steps.lost:
            where = "lost"
        else:
            pending[attempt] = pending.get(attempt, 0.0) + e["stall_s"]
            continue
        moved = min(e["stall_s"], totals[where])
        totals[where] -= moved
        totals["checkpoint_stall"] = totals.get("checkpoint_stall", 0.0) + moved
    return pending


def _move_mode_seconds(metrics: list[dict[str, Any]], totals: dict[str, float]) -> list[str]:
    """A fault-tolerance mode's workers log, per metrics window, the seconds their step windows spent in the
    mode's own categories (``ft``): move them from productive time to those badput categories. Returns the
    categories, in the order logged."""
    windows = [m["ft"] for m in metrics if isinstance(m.get("ft"), dict)]
    categories = list(dict.fromkeys(k[:-2] for w in windows for k in w if k.endswith("_s")))
    for key in categories:
        seconds = min(sum(float(w.get(f"{key}_s", 0.0)) for w in windows), totals["productive"])
        totals["productive"] -= seconds
        totals[key] = totals.get(key, 0.0) + seconds
    return categories


def script_run(events: list[dict[str, Any]]) -> Optional[tuple[float, float]]:
    """A plain script's training, seen from outside (it reports no steps): from the rendezvous round its workers
    ran in (without one recorded: its last node agent up) to the first node that finished (exit 0) after it; None
    when no node finished."""
    done = [e["t"] for e in events if e["event"] == EventName.NODE_FINISHED]
    if not done:
        return None
    for names in ((EventName.RENDEZVOUS_COMPLETE,), NODE_UP_EVENTS):
        rounds = [e["t"] for e in events if e["event"] in names and e["t"] <= min(done)]
        if rounds:
            break
    else:
        return None
    end = min(t for t in done if t >= rounds[-1])
    return (rounds[-1], end) if end > rounds[-1] else None


def launch_start(events: list[dict[str, Any]]) -> float | None:
    """When the launch began: its command's start (``launch_started.command_t``: composing, checks and starting
    Ray count, as goodput's ``launch``), else ``launch_started``'s own time; None without one."""
    started = next((e for e in events if e["event"] == EventName.LAUNCH_STARTED), None)
    if started is None:
        return None
    return min(started.get("command_t") or started["t"], started["t"])


def compute_goodput(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Goodput and its badput breakdown for one launch's events and metrics (None without a finished run)."""
    start = launch_start(events)
    end = next((e["t"] for e in reversed(events) if e["event"] == EventName.RUN_FINISHED), None)
    if start is None or end is None or end <= start:
        return None
    wall = end - start
    steps = _steps(events, metrics)
    starts = [e["t"] for e in events if e["event"] == EventName.RENDEZVOUS_COMPLETE]
    totals: dict[str, float] = {"productive": sum(s for _, s in steps.kept.values()), "lost": sum(steps.lost.values())}
    if not metrics:
        ran = script_run(events)
        if ran is not None:  # a script that reports no steps: its run time is its training
            steps.attempts[0] = Attempt(0, ran[0], ran[1], 1, 0, ran[0])
            totals["productive"] = ran[1] - ran[0]

    pending_stall = _move_save_stalls(events, steps, starts, totals)
    mode_categories = _move_mode_seconds(metrics, totals)
    attempts = sorted(steps.attempts.values(), key=lambda a: a.first_t)
    recoveries: list[dict[str, Any]] = []
    gap_start, previous = start, None
    for attempt in attempts:
        tl = Timeline(gap_start, max(gap_start, attempt.first_t), totals)
        cause = "launch"
        if previous is not None:
            cause = _end_of_attempt(tl, events, previous, pending_stall.get(previous.index, 0.0), attempt.first_t)
        recovery_start = tl.cursor
        rendezvous_t = next((t for t in reversed(starts) if t <= attempt.first_t), None)
        found = _milestones(events, recovery_start, attempt, rendezvous_t)
        for key, label in MILESTONE_SEGMENTS:
            tl.to(found.get(key), label or ("launch" if previous is None else "waiting_for_nodes"))
        tl.to(tl.end, "worker_start")
        recoveries.append({"cause": cause, "at_s": round(gap_start - start, 3), "step": attempt.first_step,
                           "gap_s": round(tl.end - gap_start, 4), **{f"{k}_s": round(v, 4) for k, v in tl.split.items()}})
        gap_start, previous = attempt.last_t, attempt

    tl = Timeline(gap_start, max(gap_start, end), totals)  # after the last logged step: shutdown
    if previous is not None:
        _end_of_attempt(tl, events, previous, pending_stall.get(previous.index, 0.0), end)
    tl.to(end, "shutdown")

    productive = totals.pop("productive")
    badput = {f"{k}_s": totals.get(k, 0.0) for k in (*CATEGORIES, *mode_categories) if k != "other"}
    badput["other_s"] = max(0.0, wall - productive - sum(badput.values()))
    return {"goodput": productive / wall, "productive_s": productive, "wall_s": wall, "lost_steps": len(steps.lost),
            "badput": {k: round(v, 4) for k, v in badput.items()}, "attempts": recoveries}

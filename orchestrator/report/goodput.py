"""Goodput: the share of wall time spent on training steps that count, and where the rest went.

Derived from events.jsonl and metrics.jsonl alone. An *attempt* is the stretch of training after one
``rendezvous_complete``; a step trained by an attempt and then trained again by a later attempt (which
resumed from an earlier checkpoint) is *lost*: its time is badput. Categories of badput:

- ``launch_s``: launch start to the first rendezvous (process start, imports, rendezvous).
- ``rendezvous_s``: after an interruption, from the last training activity of the previous attempt to the
  next rendezvous (failure detection, replacement start-up, re-rendezvous).
- ``restore_s``: loading checkpoints on resume.
- ``checkpoint_stall_s``: time the loop was blocked by saves (async stalls and emergency saves).
- ``lost_s``: steps trained twice.
- ``other_s``: the remainder (start-up inside an attempt, first-step warm-up, shutdown).
"""

from __future__ import annotations

from typing import Any


def _attempt_of(t: float, starts: list[float]) -> int:
    return sum(1 for s in starts if s <= t) - 1


def step_durations(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> tuple[dict[int, float], float, int]:
    """(seconds per step of the final lineage, seconds of lost steps, number of lost steps)."""
    starts = [e["t"] for e in events if e["event"] == "rendezvous_complete"]
    first_steps = sorted((e["t"], e["step"]) for e in events if e["event"] == "first_step")
    lineage: dict[int, float] = {}
    lost_s, lost_steps, prev = 0.0, 0, {}
    for m in sorted(metrics, key=lambda m: m["t"]):
        attempt = _attempt_of(m["t"], starts)
        if attempt not in prev:  # first record of an attempt: it resumed right before its first step
            begun = [s for t, s in first_steps if _attempt_of(t, starts) == attempt]
            first = begun[0] if begun else m["step"]
            for step in [s for s in lineage if s >= first]:  # trained before, now trained again
                lost_s += lineage.pop(step)
                lost_steps += 1
            prev[attempt] = first - 1
        window = range(prev[attempt] + 1, m["step"] + 1)
        for step in window:
            lineage[step] = m["step_time_s"]
        prev[attempt] = m["step"]
    return lineage, lost_s, lost_steps


def compute_goodput(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Goodput and its badput breakdown for one launch's events and metrics (None without a finished run)."""
    start = next((e["t"] for e in events if e["event"] == "launch_started"), None)
    end = next((e["t"] for e in reversed(events) if e["event"] == "run_finished"), None)
    if start is None or end is None or end <= start:
        return None
    wall = end - start
    lineage, lost_s, lost_steps = step_durations(events, metrics)
    rendezvous = [e["t"] for e in events if e["event"] == "rendezvous_complete"]
    launch_s = (rendezvous[0] - start) if rendezvous else wall
    rendezvous_s = 0.0
    for t in rendezvous[1:]:
        before = [x["t"] for x in [*metrics, *events]
                  if x["t"] < t and (x.get("event") in (None, "emergency_checkpoint", "node_lost", "node_preempted",
                                                        "chaos_kill", "worker_failed"))]
        rendezvous_s += t - max(before) if before else 0.0
    restore_s = sum(e.get("restore_s", 0.0) for e in events if e["event"] == "checkpoint_loaded")
    emergency = {e["step"]: e.get("save_s", 0.0) for e in events if e["event"] == "emergency_checkpoint"}
    stall_s = sum(emergency.values()) + sum(e.get("stall_s", 0.0) for e in events
                                            if e["event"] == "checkpoint_saved" and e.get("step") not in emergency)
    productive = sum(lineage.values())
    badput = {"launch_s": launch_s, "rendezvous_s": rendezvous_s, "restore_s": restore_s,
              "checkpoint_stall_s": stall_s, "lost_s": lost_s}
    badput["other_s"] = max(0.0, wall - productive - sum(badput.values()))
    return {"goodput": productive / wall, "productive_s": productive, "wall_s": wall, "lost_steps": lost_steps,
            "badput": {k: round(v, 4) for k, v in badput.items()}}

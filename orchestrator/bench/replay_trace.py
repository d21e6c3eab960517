"""The failure trace ``orch bench replay`` plays against every system: what happens to which simulated node when.

A trace is a JSON list of ``{"t": seconds, "kind": "kill" | "preempt" | "return", "node": index}`` (a
``preempt`` may add ``"grace_s"``, default ``DEFAULT_GRACE_S``), ``t`` counted from the system's first completed
training step. ``kill``: the node's machine is gone at once (SIGKILL to everything on it). ``preempt``: the node
gets a preemption notice and its machine is gone ``grace_s`` later. ``return``: a machine takes the node's place
again. A node is down from its kill or notice until its return; a trace never takes down a node that is down,
never returns one that is up (or a preempted one before its deadline), and keeps at least one node up.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from orchestrator.errors import UserError

KINDS = ("kill", "preempt", "return")
DEFAULT_GRACE_S = 10.0
TRACE_FORMAT = 'a JSON list of {"t": seconds, "kind": "kill"|"preempt"|"return", "node": index}'


@dataclass(frozen=True)
class TraceEvent:
    """One event; ``grace_s`` only for ``preempt``."""

    t: float
    kind: str
    node: int
    grace_s: Optional[float] = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def default_trace(seed: int = 0, nodes: int = 2, duration_s: float = 180.0,
                  grace_s: float = DEFAULT_GRACE_S) -> list[TraceEvent]:
    """A seeded trace over ``duration_s`` seconds: cycles of one node taken down (a SIGKILL first, a noticed
    preemption second, then either at random) and returned 6-12 s after its machine went, 4-10 s apart. The
    first cycles come within the first half minute, so that even a system that trains through them quickly
    meets a kill, a preemption and returns; a slower one meets the rest."""
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    t, cycle = 5.0, 0
    while True:
        kind = ("kill", "preempt")[cycle] if cycle < 2 else rng.choice(("kill", "preempt"))
        node = rng.randrange(nodes)
        gone = t + (grace_s if kind == "preempt" else 0.0)
        back = round(gone + rng.uniform(6, 12), 1)
        if back > duration_s:
            return events
        events.append(TraceEvent(round(t, 1), kind, node, grace_s if kind == "preempt" else None))
        events.append(TraceEvent(back, "return", node))
        t, cycle = back + rng.uniform(4, 10), cycle + 1


def load_trace(path: str, nodes: int) -> list[TraceEvent]:
    """Read and check ``--trace PATH``; a bad file, kind, node or order exits 2 with one line naming it and the fix."""
    where = f"--trace {path}"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror or exc}). Fix: pass an existing file holding "
                        f"{TRACE_FORMAT}") from None
    except ValueError as exc:
        raise UserError(f"{where}: not JSON ({exc}). Fix: write {TRACE_FORMAT}") from None
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{where}: expected a non-empty list, got {type(raw).__name__}. Fix: write {TRACE_FORMAT}")
    events = [_event(item, i, where, nodes) for i, item in enumerate(raw)]
    check_trace(events, nodes, where)
    return events


def _event(item, i: int, where: str, nodes: int) -> TraceEvent:
    at = f"{where}: event {i}"
    if not isinstance(item, dict):
        raise UserError(f"{at} is {item!r}, not an object. Fix: write {TRACE_FORMAT}")
    extra = set(item) - {"t", "kind", "node", "grace_s"}
    if extra:
        raise UserError(f"{at} has unknown key(s) {sorted(extra)}. Fix: use only t, kind, node (and grace_s for "
                        "preempt)")
    t, kind, node, grace = item.get("t"), item.get("kind"), item.get("node"), item.get("grace_s")
    if not _number(t) or t < 0:
        raise UserError(f"{at}: t={t!r} is not a number of seconds >= 0. Fix: give t as seconds after the first "
                        "training step, e.g. 12.5")
    if kind not in KINDS:
        raise UserError(f"{at}: kind={kind!r} is not one of {', '.join(KINDS)}. Fix: use kill (SIGKILL now), "
                        "preempt (a notice, gone after grace_s) or return (the node's machine is back)")
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
        raise UserError(f"{at}: node={node!r} is not a node of this bench (0..{nodes - 1}). Fix: use a node index "
                        f"from 0 to {nodes - 1}")
    if grace is not None and (kind != "preempt" or not _number(grace) or grace < 0):
        raise UserError(f"{at}: grace_s={grace!r} is only for preempt, as seconds >= 0. Fix: drop it or give "
                        "it a preempt event")
    return TraceEvent(float(t), kind, node, (float(grace) if grace is not None else DEFAULT_GRACE_S)
                      if kind == "preempt" else None)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_trace(events: list[TraceEvent], nodes: int, where: str = "trace") -> None:
    """Events in time order, each on a node in the right state, at least one node always up."""
    down: dict[int, float] = {}  # node -> when its machine is gone (a notice's deadline)
    last = 0.0
    for i, e in enumerate(events):
        at = f"{where}: event {i} ({e.kind} node {e.node} at t={e.t:g})"
        if e.t < last:
            raise UserError(f"{at} comes before the event above it (t={last:g}). Fix: list the events in time order")
        last = e.t
        if e.kind == "return":
            if e.node not in down:
                raise UserError(f"{at}: the node is up. Fix: return a node only after a kill or preempt of it")
            if e.t < down[e.node]:
                raise UserError(f"{at}: its preemption's deadline is t={down[e.node]:g}. Fix: return it at or "
                                "after the deadline (t + grace_s of its preempt)")
            del down[e.node]
            continue
        if e.node in down:
            raise UserError(f"{at}: the node is already down. Fix: return it first")
        if len(down) + 1 >= nodes:
            raise UserError(f"{at} would leave no node up. Fix: return a node before taking down the last one")
        down[e.node] = e.t + (e.grace_s or 0.0)


def trace_json(events: list[TraceEvent]) -> list[dict]:
    return [e.to_json() for e in events]

"""``orch simulate --calibrate RUN_DIR...``: the simulator's costs as real runs measured them.

From each run dir's latest launch (its events and metrics, through the same goodput accounting as
``summary.json``): the seconds per productive step, the periodic save stall and the emergency save
(``checkpoint_saved``, ``emergency_checkpoint``), the launch's split by category, each recovery's split by
category (per cause: failure, or preemption / membership restart), the shutdown, and ``other_s`` spread over
the recoveries. Several run dirs are pooled (means over their events). The first run dir also gives what a
prediction of that very run needs: its interruptions as a trace, its length in steps, its interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.config.compose import load_run_config
from orchestrator.errors import ConfigError
from orchestrator.report.summary import build_summary
from orchestrator.rundir import CONFIG_FILE, EVENTS_FILE, EventName, latest_launch, read_jsonl
from orchestrator.simulate.model import JobCosts, LAUNCH_ORDER, RECOVERY_ORDER
from orchestrator.simulate.trace import Interruptions

# Per-attempt keys the simulator computes itself (stalls, lost work) or that are not costs.
NOT_COSTS = ("cause", "at_s", "step", "gap_s", "checkpoint_stall_s", "lost_s", "productive_s")


@dataclass
class RunMeasure:
    """One run dir's measurements."""

    run_dir: str
    goodput: float
    wall_s: float
    steps: int
    productive_s: float
    stalls: list[float]
    emergency_saves: list[float]
    checkpoint_bytes: list[int]
    launch: dict[str, float]
    recoveries: list[tuple[str, dict[str, float]]]
    shutdown_s: float
    other_s: float
    trace: Interruptions
    every_n_steps: Any
    prior_mtbf_s: float
    prior_weight: float
    notice_s: float
    nodes: int
    interval_events: list[int] = field(default_factory=list)


def _kind(cause: str) -> str:
    return "failure" if cause == "failure" else "preemption"


def measure_run(run_dir: str) -> RunMeasure:
    """Read one finished launch; a run dir without one is a one-line error."""
    path = Path(run_dir)
    if not (path / EVENTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise ConfigError("--calibrate", run_dir, "give the run dir of an orch launch (it has events.jsonl and config.yaml)",
                          "is not a run dir")
    summary = build_summary(path)
    g = summary["goodput"]
    if not g or not g["attempts"]:
        raise ConfigError("--calibrate", run_dir, "give a run dir whose launch finished after training some steps",
                          "has no finished launch with training")
    events = latest_launch(read_jsonl(path / EVENTS_FILE))
    cfg = load_run_config(str(path / CONFIG_FILE))
    attempts = g["attempts"]
    steps = max(1, summary["steps_completed"] - attempts[0]["step"] + 1)  # trained by this launch
    emergency = {e["step"]: e.get("save_s", 0.0) for e in events if e["event"] == EventName.EMERGENCY_CHECKPOINT}
    saves = [e for e in events if e["event"] == EventName.CHECKPOINT_SAVED]
    final_step = summary["steps_completed"]
    stalls = [e["stall_s"] for e in saves if e.get("stall_s") is not None and e["step"] not in emergency
              and e["step"] != final_step]
    costs_of = lambda a: {k: v for k, v in a.items() if k not in NOT_COSTS}  # noqa: E731
    recoveries = [(_kind(a["cause"]), costs_of(a)) for a in attempts[1:]]
    times = [a["at_s"] + a.get("productive_s", 0.0) + a.get("lost_s", 0.0) for a in attempts[1:]]
    trace = Interruptions(np.asarray(times, dtype=float), np.asarray([k == "preemption" for k, _ in recoveries], dtype=bool))
    return RunMeasure(
        run_dir=str(path), goodput=g["goodput"], wall_s=g["wall_s"], steps=steps, productive_s=g["productive_s"],
        stalls=stalls, emergency_saves=list(emergency.values()),
        checkpoint_bytes=[e["bytes"] for e in saves if e.get("bytes")], launch=costs_of(attempts[0]),
        recoveries=recoveries, shutdown_s=g["badput"]["shutdown_s"], other_s=g["badput"]["other_s"], trace=trace,
        every_n_steps=cfg.checkpoint.every_n_steps, prior_mtbf_s=cfg.checkpoint.auto_prior_mtbf_s,
        prior_weight=cfg.checkpoint.auto_prior_weight, notice_s=cfg.preemption.grace_period_s,
        nodes=cfg.cluster.max_nodes,
        interval_events=[e["every_n_steps"] for e in events if e["event"] == EventName.CHECKPOINT_INTERVAL])


def _mean(values: list[float], default: float = 0.0) -> float:
    return float(np.mean(values)) if values else default


def _mean_split(splits: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: _mean([s.get(k, 0.0) for s in splits]) for k in keys}


def pooled_costs(runs: list[RunMeasure]) -> JobCosts:
    """The runs' costs pooled: per-step and per-event means over every run's events."""
    step_s = sum(r.productive_s for r in runs) / sum(r.steps for r in runs)
    stall_s = _mean([s for r in runs for s in r.stalls])
    recoveries = [rec for r in runs for rec in r.recoveries]
    other_each = sum(r.other_s for r in runs) / max(1, len(recoveries))  # what no event bounds, per recovery
    launch = _mean_split([r.launch for r in runs], LAUNCH_ORDER)
    by_kind = {kind: [s for k, s in recoveries if k == kind] for kind in ("failure", "preemption")}
    # A kind never seen costs what the other cost; with no recovery at all, a restart costs what the launch did.
    fallback = ([s for _, s in recoveries] or
                [{("waiting_for_nodes_s" if k == "launch_s" else k): v for k, v in launch.items()}])
    recovery = {kind: _mean_split(splits or fallback, RECOVERY_ORDER) for kind, splits in by_kind.items()}
    for split in recovery.values():
        split["other_s"] = split.get("other_s", 0.0) + (other_each if recoveries else 0.0)
    shutdown_s = _mean([r.shutdown_s + (0.0 if r.recoveries else r.other_s) for r in runs])
    return JobCosts(step_s=step_s, stall_s=stall_s,
                    emergency_save_s=_mean([s for r in runs for s in r.emergency_saves], stall_s),
                    launch=launch, recovery=recovery, shutdown_s=shutdown_s)


def calibrate(run_dirs: list[str]) -> tuple[JobCosts, list[RunMeasure]]:
    """The pooled costs of ``run_dirs`` and each run's own measurements."""
    runs = [measure_run(d) for d in run_dirs]
    return pooled_costs(runs), runs

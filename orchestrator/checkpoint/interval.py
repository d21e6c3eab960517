"""``checkpoint.every_n_steps=auto``: the checkpoint interval from the measured save stall, step time and rate of
interruptions that lose work.

The interval is Young/Daly's: for Poisson failures of mean ``M`` and a save that blocks the loop ``C`` seconds,
the compute between two saves that minimises the expected wall time per unit of work is about ``sqrt(2 C M)``
(Young), refined by Daly's higher-order terms. Only interruptions that lose work count towards ``M``: a
preemption whose notice left time for the emergency checkpoint keeps everything, whatever the interval.

``M`` is a Gamma-Poisson posterior mean: a prior of ``prior_weight`` interruptions over ``prior_weight x
prior_mtbf_s`` seconds, plus what the run saw. A small weight lets the run's own rate take over after a few
interruptions; the prior matters only for a new run. The same functions drive the simulator's ``auto``
(orchestrator/simulate/) and the running job (:class:`IntervalPolicy`), so the sweep of ``orch bench
ckpt-interval`` tests the policy the runs use. The math works elementwise on numpy arrays as well as on floats.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from orchestrator.rundir import EVENTS_FILE, EventName, read_jsonl

# Steps an attempt trains before its first decision: enough to time a step. Without a measured save stall
# (a new run) the first decision is a save, which measures one.
PROBE_STEPS = 5
HYSTERESIS = 0.1  # a new interval within 10% of the current one keeps the current one
# What ends an attempt without saving its work (as orchestrator/report/goodput.py reads a run).
LOSS_EVENTS = (EventName.CHAOS_KILL, EventName.NODE_LOST, EventName.NODE_FAILED, EventName.WORKER_FAILED,
               EventName.CHAOS_PARTITION)


def young_daly_interval_s(stall_s: Any, mtbf_s: Any) -> Any:
    """Seconds of training between saves: Daly's higher-order form of Young's ``sqrt(2 C M)``
    (``M`` when the save costs as much as ``2 M``)."""
    c, m = np.asarray(stall_s, dtype=float), np.asarray(mtbf_s, dtype=float)
    ratio = c / (2 * m)
    daly = np.sqrt(2 * c * m) * (1 + np.sqrt(ratio) / 3 + ratio / 9) - c
    out = np.where(ratio < 1, np.maximum(daly, 0.0), m)
    return float(out) if out.ndim == 0 else out


def expected_mtbf_s(prior_mtbf_s: float, prior_weight: float, elapsed_s: Any, interruptions: Any) -> Any:
    """The mean time between interruptions that lose work, after ``interruptions`` of them in ``elapsed_s``
    seconds, under a prior of ``prior_weight`` interruptions per ``prior_weight x prior_mtbf_s`` seconds."""
    out = (prior_weight * prior_mtbf_s + np.asarray(elapsed_s, dtype=float)) / (prior_weight + np.asarray(interruptions))
    return float(out) if out.ndim == 0 else out


def interval_steps(step_s: Any, stall_s: Any, mtbf_s: Any) -> Any:
    """The Young/Daly interval in whole steps (at least 1)."""
    steps = np.maximum(1, np.rint(np.asarray(young_daly_interval_s(stall_s, mtbf_s)) / np.asarray(step_s)))
    return int(steps) if steps.ndim == 0 else steps.astype(np.int64)


def lossy_interruptions(events: list[dict[str, Any]]) -> int:
    """Attempts of a run that ended by losing work: a restart (or a new launch) after a failure event with no
    emergency checkpoint since the previous attempt began."""
    count, failed, saved, started = 0, False, False, False
    for e in events:
        name = e.get("event")
        if name in (EventName.RESTART, EventName.LAUNCH_STARTED):
            count += started and failed and not saved
            failed = saved = False
            started = True
        elif name in LOSS_EVENTS:
            failed = True
        elif name == EventName.EMERGENCY_CHECKPOINT:
            saved = True
    return count


class IntervalPolicy:
    """Rank 0's running estimate: step time and save stall as measured (exponential moving averages), the
    interruption rate from the run dir's history and the prior. :meth:`decide` gives the interval in steps, or
    None while the stall is unknown (then save, which measures it)."""

    def __init__(self, prior_mtbf_s: float, prior_weight: float, run_dir: Optional[str] = None,
                 clock=time.time):
        self.prior_mtbf_s, self.prior_weight, self.clock = prior_mtbf_s, prior_weight, clock
        self.step_s: Optional[float] = None
        self.stall_s: Optional[float] = None
        self.started_t, self.interruptions = clock(), 0
        if run_dir is not None:
            self._read_history(Path(run_dir) / EVENTS_FILE)

    def _read_history(self, path: Path) -> None:
        """The run so far: since its first launch, its lossy interruptions and the stall of its latest saves."""
        events = read_jsonl(path) if path.exists() else []
        launches = [e["t"] for e in events if e.get("event") == EventName.LAUNCH_STARTED]
        if launches:
            self.started_t = min(launches)
        self.interruptions = lossy_interruptions(events)
        emergency = {e.get("step") for e in events if e.get("event") == EventName.EMERGENCY_CHECKPOINT}
        for e in events:  # periodic saves only: an emergency save is synchronous, not what the interval pays
            if (e.get("event") == EventName.CHECKPOINT_SAVED and e.get("stall_s") is not None
                    and e.get("step") not in emergency):
                self.observe_save(float(e["stall_s"]))

    @staticmethod
    def _average(old: Optional[float], new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def observe_step(self, seconds: float) -> None:
        self.step_s = self._average(self.step_s, seconds)

    def observe_save(self, stall_s: float) -> None:
        self.stall_s = self._average(self.stall_s, stall_s)

    def mtbf_s(self) -> float:
        return expected_mtbf_s(self.prior_mtbf_s, self.prior_weight, self.clock() - self.started_t, self.interruptions)

    def decide(self, current: Optional[int] = None) -> Optional[int]:
        """The interval in steps; ``current`` is kept while the new one is within 10% of it (the optimum is
        flat there, and a steady interval keeps the event log and the storage pattern quiet)."""
        if self.stall_s is None or not self.step_s:
            return None
        steps = interval_steps(self.step_s, self.stall_s, self.mtbf_s())
        return current if current and abs(steps - current) <= HYSTERESIS * current else steps

    def fields(self) -> dict[str, Any]:
        """What the latest decision was made from (the ``checkpoint_interval`` event's fields)."""
        return {"step_s": round(self.step_s or 0.0, 6), "stall_s": round(self.stall_s or 0.0, 6),
                "mtbf_s": round(self.mtbf_s(), 1), "interruptions": self.interruptions,
                "elapsed_s": round(self.clock() - self.started_t, 1)}

"""The job-level discrete-event model behind ``orch simulate``: one training job under interruptions.

Time is wall-clock seconds from the launch. The job starts (the launch's costs), then alternates *windows*
of training with *downtime*. Interruption times are exogenous (drawn or replayed, see :mod:`.trace`), so
the windows do not depend on the checkpoint interval: they are cut once per trace and every interval
(fixed or auto) is evaluated on the same windows, vectorized, which makes a sweep cheap and its comparison
paired (common random numbers).

Inside a window the job repeats ``k`` steps of ``step_s`` then a save that blocks ``stall_s`` (the
checkpoint counts once the stall is over). An interruption ends the window:

- ``failure`` (no notice), or a ``preemption`` whose notice is shorter than the emergency save: the work
  since the last save is lost (``lost_s``; a save cut short is stall, and its steps are lost too);
- a ``preemption`` with a long enough notice: the emergency save (``checkpoint_stall_s``) keeps everything.

Then the recovery's costs follow, in order (``waiting_for_nodes``, ``rendezvous``, ``worker_start``,
``restore``, ``other``); an interruption during them starts a new recovery. ``per_step`` mode (torchft-style:
replica groups carry on, no restart) replaces the recovery with its own costs and loses only the step in
flight. The badput categories are those of ``summary.json`` (orchestrator/report/goodput.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from orchestrator.checkpoint.interval import expected_mtbf_s, interval_steps
from orchestrator.report.goodput import CATEGORIES
from orchestrator.simulate.trace import Interruptions, draw

BADPUT = tuple(f"{c}_s" for c in CATEGORIES)
COL = {name: i for i, name in enumerate(BADPUT)}
LAUNCH_ORDER = ("launch_s", "rendezvous_s", "worker_start_s", "restore_s", "other_s")
RECOVERY_ORDER = ("waiting_for_nodes_s", "rendezvous_s", "worker_start_s", "restore_s", "other_s")
MODES = ("restart", "per_step")
# Student's t, 97.5% quantile, for 1..30 degrees of freedom (a 95% interval over seeds); 1.96 beyond.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class JobCosts:
    """What each event costs the job, in seconds. ``launch`` and ``recovery[kind]`` split a (re)start by badput
    category (``launch_s``, ``waiting_for_nodes_s``, ``rendezvous_s``, ``worker_start_s``, ``restore_s``,
    ``other_s``); ``kind`` is ``failure`` or ``preemption``."""

    step_s: float = 1.0
    stall_s: float = 0.0
    emergency_save_s: float = 0.0
    launch: Mapping[str, float] = field(default_factory=dict)
    recovery: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: {"failure": {}, "preemption": {}})
    shutdown_s: float = 0.0
    mode: str = "restart"

    def recovery_s(self, kind: str) -> float:
        return sum(self.recovery.get(kind, {}).values())


@dataclass(frozen=True)
class Scenario:
    """One simulated job: its costs, the checkpoint interval (steps, 0 = never, or ``auto`` with its prior),
    its length (``days`` of wall time or ``steps`` of work) and its interruptions (job-level ``failure_rate``
    and ``preemption_rate`` per second with ``notice_s``, or a fixed ``trace``)."""

    costs: JobCosts
    every_n_steps: Any = "auto"
    prior_mtbf_s: float = 14400.0
    prior_weight: float = 0.25
    days: Optional[float] = None
    steps: Optional[int] = None
    failure_rate: float = 0.0
    preemption_rate: float = 0.0
    notice_s: float = 30.0
    trace: Optional[Interruptions] = None


@dataclass
class Windows:
    """A trace cut into training windows: window ``i`` starts at ``start[i]``, lasts ``length[i]`` (inf: the
    last one of a job that runs until its work is done) and ends by an interruption unless it is the last;
    ``lossy[i]``: that interruption loses the unsaved work. ``down[i]``: the downtime before it, by category."""

    start: np.ndarray
    length: np.ndarray
    lossy: np.ndarray
    down: np.ndarray


def cut_windows(costs: JobCosts, interruptions: Interruptions, notice_s: float,
                horizon_s: float = math.inf) -> Windows:
    """Lay the launch, the interruptions and their recoveries on the time line up to ``horizon_s``."""
    a = interruptions.until(horizon_s)
    saves = a.preemption & (notice_s >= costs.emergency_save_s)
    n = len(a)
    start, length, down = np.zeros(n + 1), np.zeros(n + 1), np.zeros((n + 1, len(BADPUT)))
    pending = [(COL[k], costs.launch.get(k, 0.0)) for k in LAUNCH_ORDER]
    per_kind = {kind: [(COL[k], costs.recovery.get(kind, {}).get(k, 0.0)) for k in RECOVERY_ORDER]
                for kind in ("failure", "preemption")}
    emergency = (COL["checkpoint_stall_s"], costs.emergency_save_s)
    t_prev, times = 0.0, a.t.tolist()
    for i in range(n + 1):
        end = times[i] if i < n else horizon_s
        t = t_prev
        for col, seconds in pending:  # cut short by the next interruption, which starts its own recovery
            take = max(0.0, min(seconds, end - t))
            down[i, col] += take
            t += take
        start[i], length[i] = t, max(0.0, end - t)
        if i < n:
            kind = "preemption" if a.preemption[i] else "failure"
            pending = ([emergency] if saves[i] and length[i] > 0 else []) + per_kind[kind]
            t_prev = end
    lossy = np.append(~saves, False)
    return Windows(start, length, lossy, down)


def auto_intervals(scenario: Scenario, windows: Windows) -> np.ndarray:
    """``every_n_steps=auto`` in each window: the policy of orchestrator/checkpoint/interval.py, as it stands
    when the window starts (elapsed time, lossy interruptions so far)."""
    seen = np.concatenate(([0], np.cumsum(windows.lossy[:-1])))
    mtbf = expected_mtbf_s(scenario.prior_mtbf_s, scenario.prior_weight, windows.start, seen)
    return interval_steps(scenario.costs.step_s, scenario.costs.stall_s, mtbf)


def evaluate(scenario: Scenario, windows: Windows, every: Any) -> dict[str, Any]:
    """Goodput and badput of one trace's windows under checkpoint interval ``every`` (steps, or an array of
    steps per window; 0: never)."""
    c = scenario.costs
    k = np.broadcast_to(np.asarray(every, dtype=float), windows.length.shape)
    train_s = np.where(k > 0, k * c.step_s, np.inf)  # 0 = no periodic saves
    seg = train_s + c.stall_s
    finite = np.isfinite(windows.length)
    w = np.where(finite, windows.length, 0.0)
    periodic = k > 0
    nseg = np.where(periodic, np.floor(w / seg), 0.0)
    rem = w - nseg * np.where(periodic, seg, 0.0)
    trained = np.minimum(rem, train_s)
    stall = nseg * c.stall_s + (rem - trained)
    if c.mode == "per_step":  # only the step in flight is lost
        lost = np.where(windows.lossy, np.mod(trained, c.step_s), 0.0)
        lost_steps = np.zeros_like(lost)
    else:
        lost = np.where(windows.lossy, trained, 0.0)
        lost_steps = np.where(windows.lossy, np.floor(trained / c.step_s + 1e-9), 0.0)
    productive = nseg * np.where(periodic, train_s, 0.0) + trained - lost
    down = windows.down.copy()
    last, wall = len(w) - 1, None
    if scenario.steps is not None:  # the job ends when its work is done, inside window `last`
        target = scenario.steps * c.step_s
        before = np.concatenate(([0.0], np.cumsum(productive)[:-1]))
        capacity = np.where(finite, productive + lost, np.inf)  # what the window trains if the job ends in it
        last = int(np.argmax(before + capacity >= target - 1e-9))
        r = target - before[last]
        m = max(0.0, math.ceil(r / train_s[last] - 1e-9) - 1) if np.isfinite(train_s[last]) else 0.0
        productive[last], lost[last], lost_steps[last] = r, 0.0, 0.0
        stall[last] = m * c.stall_s
        wall = windows.start[last] + m * c.stall_s + r + c.shutdown_s
        down[last + 1:] = 0.0
        down[last, COL["shutdown_s"]] += c.shutdown_s
    badput = down[: last + 1].sum(axis=0)
    badput[COL["checkpoint_stall_s"]] += stall[: last + 1].sum()
    badput[COL["lost_s"]] += lost[: last + 1].sum()
    productive_s = float(productive[: last + 1].sum())
    wall = float(wall if wall is not None else windows.start[-1] + windows.length[-1])
    return {"goodput": productive_s / wall, "productive_s": productive_s, "wall_s": wall,
            "badput": dict(zip(BADPUT, badput.tolist())), "lost_steps": float(lost_steps[: last + 1].sum()),
            "interruptions": last,
            "effective_training_time": (productive_s + float(stall[: last + 1].sum())) / wall}


def traces(scenario: Scenario, seed: int) -> tuple[Windows, Interruptions]:
    """One seed's windows: the scenario's trace, or Poisson interruptions drawn over long enough a horizon."""
    c = scenario.costs
    if scenario.trace is not None:
        return cut_windows(c, scenario.trace, scenario.notice_s, _horizon(scenario)), scenario.trace
    rng = np.random.default_rng(seed)
    horizon = _horizon(scenario)
    if math.isfinite(horizon):
        drawn = draw(rng, horizon, scenario.failure_rate, scenario.preemption_rate)
        return cut_windows(c, drawn, scenario.notice_s, horizon), drawn
    # A job of fixed work: draw over a guess of its length, and longer until it finishes inside it.
    rate = scenario.failure_rate + scenario.preemption_rate
    per_event = c.recovery_s("failure") + c.emergency_save_s + c.stall_s
    guess = 2 * (scenario.steps * c.step_s * (1 + rate * per_event) + sum(c.launch.values()) + 60)
    while True:
        drawn = draw(rng, guess, scenario.failure_rate, scenario.preemption_rate)
        windows = cut_windows(c, drawn, scenario.notice_s)
        result = evaluate(scenario, windows, _every(scenario, windows))
        if result["wall_s"] <= guess or rate == 0:
            return windows, drawn
        guess *= 2


def _horizon(scenario: Scenario) -> float:
    return scenario.days * 86400.0 if scenario.days is not None else math.inf


def _every(scenario: Scenario, windows: Windows) -> Any:
    return auto_intervals(scenario, windows) if scenario.every_n_steps == "auto" else scenario.every_n_steps


def run_seed(scenario: Scenario, seed: int) -> dict[str, Any]:
    windows, _ = traces(scenario, seed)
    return evaluate(scenario, windows, _every(scenario, windows))


def mean_ci(values: list[float]) -> tuple[float, list[float]]:
    """The mean and its 95% confidence interval (Student's t over the seeds)."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, [mean, mean]
    half = (T975[len(x) - 2] if len(x) - 1 <= len(T975) else 1.96) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, [mean - half, mean + half]


def simulate(scenario: Scenario, seeds: int = 20, seed: int = 0) -> dict[str, Any]:
    """Goodput, badput by cause (mean seconds), lost steps and effective training time over ``seeds`` seeds
    (one run for a trace, which has no randomness), each with its 95% confidence interval."""
    runs = [run_seed(scenario, seed + i) for i in range(1 if scenario.trace is not None else seeds)]
    out: dict[str, Any] = {"seeds": len(runs)}
    for key in ("goodput", "effective_training_time", "lost_steps", "interruptions", "productive_s", "wall_s"):
        out[key], out[f"{key}_ci95"] = mean_ci([r[key] for r in runs])
    out["badput"] = {k: float(np.mean([r["badput"][k] for r in runs])) for k in BADPUT}
    return out

"""``orch bench replay``: one failure trace replayed against every system a user could pick, side by side.

The same job (``conf=cpu_elastic``'s model, data and global batch, at 1..2 simulated nodes, a checkpoint every
``SAVE_EVERY`` steps) runs under each system twice, one system after another in one invocation: without faults,
then under the trace (``replay_trace.py``; the default is seeded, or ``--trace F``). The systems and how each is
set up and faulted: ``replay_legs.py``. Every number comes from rank 0's timeline of completed steps (``(t,
step)``, every step): orch's metrics.jsonl, the plain script's steps file under bare torchrun and Ray Train.

A row per system:

- ``wall_s``: from starting the system (``orch launch``, the torchrun agents, the Ray Train driver; a Ray
  cluster's own start is the machines', not counted) to the completion of the last step, under the trace;
  ``wall_s_fault_free`` the same without faults; ``time_to_train_ratio`` = fault-free / traced (1.0: the trace
  cost nothing).
- ``lost_steps``: steps trained and then thrown away: at each restart that went back to a saved step, the
  last step reached minus the step it went on from.
- ``mttr_s``: per trace event that reached the system (events due after it finished do not), the longest time
  without a completed step between that event and the next one, the first stretch counted from the event itself:
  a kill's pause until training goes on, a notice's until its node's departure has been absorbed, a return's
  restart (restart-based systems) or heal (per_step).
- ``steps_completed``: the highest step completed (``max_steps`` unless the run timed out).
- ``train_s`` / ``train_s_fault_free``: like ``wall_s`` but from the first completed step: the start-up (an orch
  launch joining a Ray cluster, a Ray Train worker group) left out.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Optional

from orchestrator.bench.replay_legs import PRESET, RunResult
from orchestrator.bench.replay_trace import TraceEvent, default_trace, load_trace, trace_json
from orchestrator.errors import EnvironmentMismatch, UserError

SYSTEMS = ("torchrun", "orch-restart", "orch-per_step", "ray-train")
NODES = 2
MAX_STEPS = 300
SAVE_EVERY = 20
RUN_TIMEOUT_S = 600.0

Leg = Callable[[Path, list[TraceEvent]], tuple[RunResult, RunResult]]  # (fault-free, traced) of one system


def parse_systems(text: Optional[str]) -> list[str]:
    """``--systems a,b`` (default: all, in ``SYSTEMS`` order); an unknown name exits 2."""
    if not text:
        return list(SYSTEMS)
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in SYSTEMS:
            raise UserError(f"--systems: {name!r} is not a system of this bench. Fix: pick from {','.join(SYSTEMS)}")
    if not names or len(set(names)) != len(names):
        raise UserError(f"--systems={text!r} names no system or one twice. Fix: e.g. --systems torchrun,orch-restart")
    return [s for s in SYSTEMS if s in names]


def job_overrides(max_steps: int) -> list[str]:
    return ["cluster.nnodes=1:2", f"trainer.max_steps={max_steps}", "trainer.log_every=1",
            f"checkpoint.every_n_steps={SAVE_EVERY}"]


def real_legs(max_steps: int, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Leg]:
    """The four systems, run for real on this machine."""
    from orchestrator.bench import replay_legs as legs
    from orchestrator.bench.replay_job import job_from_config
    from orchestrator.config.compose import compose_config

    overrides = job_overrides(max_steps)
    cfg = compose_config(PRESET, overrides)
    job = job_from_config(cfg)

    def orch(mode: str) -> Leg:
        return lambda workdir, trace: legs.run_on_ray(
            lambda d, address: legs.OrchRun(mode, address, overrides, d), NODES, workdir, trace, timeout_s)

    return {
        "torchrun": lambda workdir, trace: legs.run_torchrun(job, NODES, cfg.cluster.max_restarts, workdir, trace,
                                                             timeout_s),
        "orch-restart": orch("restart"),
        "orch-per_step": orch("per_step"),
        "ray-train": lambda workdir, trace: legs.run_on_ray(
            lambda d, address: legs.RayTrainRun(job, address, NODES, d), NODES, workdir, trace, timeout_s),
    }


def lost_steps(steps: list[tuple[float, int]]) -> int:
    """Steps thrown away: at each step lower than the one before it, the one before minus (it - 1)."""
    lost = 0
    for (_, before), (_, after) in zip(steps, steps[1:]):
        if after < before:
            lost += before - (after - 1)
    return lost


def stalls(steps: list[tuple[float, int]], events: list[dict], end_t: float, completed: bool) -> list[float]:
    """Per event, the longest time without a completed step from it to the next event (see the module doc);
    ``completed``: the run reached its last step (else a stretch still open when it was stopped counts too)."""
    times = sorted(t for t, _ in steps)
    out = []
    for i, event in enumerate(events):
        until = events[i + 1]["t"] if i + 1 < len(events) else math.inf
        last, worst = event["t"], 0.0
        for t in (t for t in times if t > event["t"]):
            if last >= until:
                break
            worst, last = max(worst, t - last), t
        else:
            if not completed and last < until:  # it never went on before the run ended
                worst = max(worst, end_t - last)
        out.append(round(worst, 2))
    return out


def _wall(run: RunResult, max_steps: int) -> tuple[float, int]:
    """Seconds from the start to the first completion of ``max_steps`` (or to the run's end, if it never got
    there), and the highest step completed."""
    top = max((s for _, s in run.steps), default=0)
    done_t = next(t for t, s in run.steps if s == top) if top >= max_steps else run.end_t
    return round(done_t - run.start_t, 2), top


def _train_s(run: RunResult, wall: float) -> Optional[float]:
    """Seconds from the first completed step to the end ``wall`` counts to: the training alone, without the
    start-up, whose noise on a shared machine can outweigh what the trace cost."""
    return round(run.start_t + wall - run.steps[0][0], 2) if run.steps else None


def row(system: str, fault_free: RunResult, traced: RunResult, max_steps: int) -> dict:
    """One row of the result (see the module doc for each field). Events applied after the last step was
    done (while the system was shutting down) did not reach its training and are left out. ``events``: those
    that did, ``t`` in seconds since the run's first completed step."""
    wall, top = _wall(traced, max_steps)
    wall_ff, _ = _wall(fault_free, max_steps)
    events = [e for e in traced.events if e["t"] < traced.start_t + wall]
    t0 = traced.steps[0][0] if traced.steps else traced.start_t
    return {"system": system, "wall_s": wall, "wall_s_fault_free": wall_ff,
            "time_to_train_ratio": round(wall_ff / wall, 3) if wall > 0 else None,
            "train_s": _train_s(traced, wall), "train_s_fault_free": _train_s(fault_free, wall_ff),
            "lost_steps": lost_steps(traced.steps),
            "mttr_s": stalls(traced.steps, events, traced.end_t, top >= max_steps),
            "steps_completed": top, "events_applied": len(events),
            "events": [{"t": round(e["t"] - t0, 2), "kind": e["kind"], "node": e["node"]} for e in events]}


def format_table(rows: list[dict], max_steps: int) -> str:
    head = (f"{'system':<15}{'wall s':>9}{'fault-free s':>14}{'time-to-train':>15}{'lost steps':>12}"
            f"{'steps':>8}{'events':>8}  MTTR s per event (median)")
    lines = [head]
    for r in rows:
        mttr = r["mttr_s"]
        shown = ", ".join(f"{m:g}" for m in mttr) + (f" ({statistics.median(mttr):g})" if mttr else "")
        steps = f"{r['steps_completed']}" + ("" if r["steps_completed"] >= max_steps else "!")
        ratio = f"{r['time_to_train_ratio']:.3f}" if r["time_to_train_ratio"] is not None else "-"
        lines.append(f"{r['system']:<15}{r['wall_s']:>9.1f}{r['wall_s_fault_free']:>14.1f}{ratio:>15}"
                     f"{r['lost_steps']:>12}{steps:>8}{r['events_applied']:>8}  {shown or '-'}")
    return "\n".join(lines)


def _segments(steps: list[tuple[float, int]], stall_s: float = 2.0) -> tuple[list[float], list[float]]:
    """x (seconds since the first step) and y (step), broken (NaN) where a run went back to a saved step or
    completed nothing for ``stall_s``: a pause shows as a gap, not as a slope."""
    t0 = steps[0][0]
    xs, ys = [], []
    for i, (t, step) in enumerate(steps):
        if i and (step <= steps[i - 1][1] or t - steps[i - 1][0] > stall_s):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(t - t0)
        ys.append(step)
    return xs, ys


def plot(results: dict[str, tuple[RunResult, RunResult]], trace: list[TraceEvent], path: Path) -> None:
    """Steps over time, one colour per system (solid: under the trace, dashed: fault-free), x counted from each
    run's first completed step (the trace's clock); the trace's events as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 5.5))
    for i, (system, (fault_free, traced)) in enumerate(results.items()):
        colour = f"C{i}"
        for run, style, label in ((traced, "-", system), (fault_free, "--", f"{system}, fault-free")):
            if run.steps:
                xs, ys = _segments(run.steps)
                ax.plot(xs, ys, style, color=colour, linewidth=1.6 if style == "-" else 0.9, label=label)
    marks = {"kill": ("red", "SIGKILL"), "preempt": ("orange", "notice"), "return": ("green", "return")}
    seen = set()
    for e in trace:
        colour, name = marks[e.kind]
        ax.axvline(e.t, color=colour, linestyle=":", linewidth=1, label=None if name in seen else name)
        seen.add(name)
        if e.kind == "preempt":
            ax.axvline(e.t + (e.grace_s or 0.0), color="orange", linewidth=1,
                       label=None if "deadline" in seen else "notice deadline")
            seen.add("deadline")
    ax.set_xlabel("seconds since the run's first completed step")
    ax.set_ylabel("step")
    ax.set_title("orch bench replay: the same failure trace against each system")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_replay_bench(trace: list[TraceEvent], systems: list[str], legs: dict[str, Leg], max_steps: int,
                     workdir: Optional[str] = None, plot_path: Optional[Path] = None) -> dict:
    """Every system in ``systems`` through its leg, one after another; the result object ``--out`` writes."""
    load_before = os.getloadavg()[0]
    results: dict[str, tuple[RunResult, RunResult]] = {}
    with tempfile.TemporaryDirectory(prefix="orch-bench-replay-") as tmp:
        base = Path(workdir or tmp)
        for system in systems:
            print(f"replay: {system} ...", flush=True)
            results[system] = legs[system](base / system, trace)
    rows = [row(s, *results[s], max_steps) for s in systems]
    if plot_path is not None:
        plot(results, trace, plot_path)
    return {"rows": rows, "trace": trace_json(trace), "nodes": NODES, "max_steps": max_steps,
            "save_every": SAVE_EVERY, "date": datetime.date.today().isoformat(),
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _require_ray_train() -> None:
    """The ray-train leg needs Ray Train v2 with preemption info (Ray 2.60 here); exit 2 before anything starts."""
    try:
        import ray.train
    except ImportError as exc:
        raise EnvironmentMismatch(f"--systems ray-train needs Ray Train ({exc}). Fix: pip install 'orch[bench]' "
                                  "(ray[train]), or leave ray-train out of --systems") from None
    if not hasattr(ray.train, "get_preemption_info"):
        raise EnvironmentMismatch(f"--systems ray-train needs ray.train.get_preemption_info (Ray {ray.__version__} "
                                  "has none). Fix: pip install 'orch[bench]' (ray[train]>=2.60), or leave ray-train "
                                  "out of --systems")


def main_replay_bench(out: Optional[str], trace_path: Optional[str], systems: Optional[str], seed: int = 0,
                      max_steps: int = MAX_STEPS, plot_path: Optional[str] = None, workdir: Optional[str] = None,
                      legs: Optional[dict[str, Leg]] = None) -> dict:
    """Check the arguments (exit 2 before anything starts), run, print the table, write ``out`` and the plot
    (``plot_path``, else beside ``out`` as .png)."""
    names = parse_systems(systems)
    trace = load_trace(trace_path, NODES) if trace_path else default_trace(seed, NODES)
    if max_steps < 1:
        raise UserError(f"--max-steps={max_steps} is not a step count. Fix: give 1 or more (default {MAX_STEPS})")
    if legs is None and "ray-train" in names:
        _require_ray_train()
    picture = Path(plot_path) if plot_path else Path(out).with_suffix(".png") if out else None
    result = run_replay_bench(trace, names, legs or real_legs(max_steps), max_steps, workdir, picture)
    kinds = {k: sum(e.kind == k for e in trace) for k in ("kill", "preempt", "return")}
    print(f"replay: {len(trace)} events over {trace[-1].t:g} s ({kinds['kill']} SIGKILL, {kinds['preempt']} "
          f"preempt, {kinds['return']} return), {NODES} nodes, {max_steps} steps, a checkpoint every {SAVE_EVERY}")
    print(format_table(result["rows"], max_steps))
    print(f"  load average (1 min) before/after: {result['load_avg_1m'][0]:.1f}/{result['load_avg_1m'][1]:.1f}")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if picture is not None:
        print(f"  steps over time: {picture}")
    return result

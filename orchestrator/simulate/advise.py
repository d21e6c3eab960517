"""``orch advise checkpoint RUN_DIR --mtbf-h H``: the checkpoint interval a run should use at a failure rate.

From the run dir (its measured step time, save stall, checkpoint size and restart costs) and the expected mean
time between interruptions that lose work: the Young/Daly interval, the simulated goodput at it and at the
run's current interval, and the storage each writes per hour of training.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from orchestrator.checkpoint.interval import interval_steps, young_daly_interval_s
from orchestrator.errors import ConfigError
from orchestrator.simulate.calibrate import calibrate
from orchestrator.simulate.model import Scenario, simulate


def advise_checkpoint(run_dir: str, mtbf_h: float, days: float = 30.0, seeds: int = 20) -> dict[str, Any]:
    """The advice as data (what ``orch advise checkpoint`` prints)."""
    if not mtbf_h > 0:
        raise ConfigError("--mtbf-h", mtbf_h, "use a positive number of hours")
    if not days > 0:
        raise ConfigError("--days", days, "use a positive number of days")
    costs, (run,) = calibrate([run_dir])
    mtbf_s = mtbf_h * 3600.0
    current = run.every_n_steps
    if current == "auto":  # the interval the run settled on
        current = run.interval_events[-1] if run.interval_events else 0
    best = interval_steps(costs.step_s, costs.stall_s, mtbf_s)
    scenario = Scenario(costs, days=days, failure_rate=1.0 / mtbf_s)
    bytes_per_save = float(np.mean(run.checkpoint_bytes)) if run.checkpoint_bytes else 0.0

    def at(steps: int) -> dict[str, Any]:
        sim = simulate(replace(scenario, every_n_steps=steps), seeds=seeds)
        per_hour = 3600.0 / (steps * costs.step_s + costs.stall_s) * bytes_per_save if steps else 0.0
        return {"every_n_steps": steps, "interval_s": steps * costs.step_s, "goodput": sim["goodput"],
                "goodput_ci95": sim["goodput_ci95"], "storage_bytes_per_h": per_hour}

    return {"run_dir": run.run_dir, "mtbf_s": mtbf_s, "step_s": costs.step_s, "stall_s": costs.stall_s,
            "checkpoint_bytes": bytes_per_save, "young_daly_s": young_daly_interval_s(costs.stall_s, mtbf_s),
            "recovery_s": costs.recovery_s("failure"), "days": days, "seeds": seeds,
            "young_daly": at(best), "current": at(int(current))}


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000.0
    return ""


def format_advice(a: dict[str, Any]) -> str:
    yd, cur = a["young_daly"], a["current"]

    def line(name: str, r: dict[str, Any]) -> str:
        lo, hi = r["goodput_ci95"]
        every = f"every {r['every_n_steps']} steps ({r['interval_s']:.1f} s)" if r["every_n_steps"] else "final save only"
        return (f"  {name:<11} {every:<30} goodput {r['goodput']:.4f} [{lo:.4f}, {hi:.4f}]   "
                f"writes {_bytes(r['storage_bytes_per_h'])}/h")

    return "\n".join([
        f"checkpoint interval for {a['run_dir']} at one interruption that loses work every {a['mtbf_s'] / 3600:g} h",
        f"  measured: step {a['step_s'] * 1000:.1f} ms, save stall {a['stall_s'] * 1000:.1f} ms, "
        f"{_bytes(a['checkpoint_bytes'])} per checkpoint, restart {a['recovery_s']:.1f} s",
        f"  Young/Daly interval: {yd['every_n_steps']} steps = {a['young_daly_s']:.1f} s of training between saves",
        f"  simulated goodput over {a['days']:g} days, {a['seeds']} seeds (95% interval):",
        line("Young/Daly", yd), line("current", cur)])

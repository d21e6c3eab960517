"""``orch bench scaling conf=NAME world_sizes=[1,2,...] [--out FILE.json] [overrides]``.

Runs the same config as short real launches at each world size (world size 1 always, as the baseline),
one after the other (with ``--repeats``: several times each, in alternating order, rows holding medians),
and reports per size: steady-state samples/s (warm-up left out, see report/efficiency.py), scaling
efficiency = throughput(N) / (N x throughput(1)), and comm_fraction (the share of step time spent waiting
for gradient all-reduce). Rows go to stdout, ``--out`` and ``<run root>/scaling.json`` (``orch report
<run root>`` plots them).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import UserError
from orchestrator.report import efficiency as eff
from orchestrator.rundir import METRICS_FILE, read_jsonl

# Short runs without periodic checkpoints; the user's overrides come after these, so they win.
# The local launcher: simulated nodes on this machine, no Ray start-up in every short run (overridable).
BENCH_OVERRIDES = ("launcher=local", "trainer.max_steps=60", "trainer.log_every=5", "checkpoint.every_n_steps=0")
WARMUP_STEPS = 5


def parse_world_sizes(text: str) -> list[int]:
    """``[1,2,4]`` or ``1,2,4`` -> ``[1, 2, 4]``."""
    try:
        sizes = [int(p) for p in text.strip().strip("[]").split(",") if p.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(f"world_sizes={text}: give positive integers. Fix: world_sizes=[1,2]")
    return sorted(set(sizes))


def split_bench_args(tokens: list[str]) -> tuple[str, list[int], list[str]]:
    """``conf=NAME``, ``world_sizes=[...]`` and the remaining Hydra overrides."""
    from orchestrator.config.compose import split_preset

    sizes = [t.split("=", 1)[1] for t in tokens if t.startswith("world_sizes=")]
    if len(sizes) != 1:
        raise UserError("world_sizes: give it once, e.g. world_sizes=[1,2]. Fix: orch bench scaling conf=cpu_gloo "
                        "world_sizes=[1,2]")
    preset, overrides = split_preset([t for t in tokens if not t.startswith("world_sizes=")])
    return preset, parse_world_sizes(sizes[0]), overrides


def shape_overrides(world_size: int, nproc_per_node: int) -> list[str]:
    """Cluster overrides for a fixed world size: the preset's processes per node where they divide it."""
    nproc = nproc_per_node if world_size % nproc_per_node == 0 else 1
    return [f"cluster.nnodes={world_size // nproc}", f"cluster.nproc_per_node={nproc}"]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def core_warning(world_sizes: list[int], device: str, cores: int) -> Optional[str]:
    """Why the numbers may measure CPU contention rather than scaling, or None."""
    if device != "cpu" or max(world_sizes) <= cores:
        return None
    return (f"this machine has {cores} CPU core(s) but world size {max(world_sizes)} runs {max(world_sizes)} worker "
            f"processes: workers share cores, so efficiency above {cores} workers measures CPU contention, not "
            "communication")


def measure_run(run_dir: Path, warmup_steps: int) -> dict[str, Any]:
    """Steady samples/s, comm fraction and step time of a finished run dir."""
    metrics = read_jsonl(run_dir / METRICS_FILE)
    windows = eff.steady_windows(metrics, warmup_steps)
    breakdown = eff.step_time_breakdown(metrics, warmup_steps) or {}
    return {"samples_per_s": eff.throughput(windows), "comm_fraction": breakdown.get("comm_fraction"),
            "step_time_s": breakdown.get("step_time_s"), "steps_measured": sum(w.steps for w in windows)}


def run_scaling(preset: str, world_sizes: list[int], overrides: list[str], run_root: Path,
                warmup_steps: int = WARMUP_STEPS, repeats: int = 1, echo=print) -> dict[str, Any]:
    """Launch ``preset`` at world size 1 and each of ``world_sizes``, ``repeats`` times in alternating order
    (1, 2, 2, 1, ...: machine noise hits every size alike); a row holds the medians of its runs."""
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import launch

    sizes = sorted(set(world_sizes) | {1})
    probe = compose_config(preset, [*BENCH_OVERRIDES, *overrides])
    cores = usable_cores()
    warning = core_warning(sizes, probe.cluster.device, cores)
    if warning:
        echo(f"warning: {warning}")
    runs: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
    for r in range(repeats):
        for size in (sizes if r % 2 == 0 else sizes[::-1]):
            run_dir = run_root / (f"ws{size}" if repeats == 1 else f"ws{size}-run{r + 1}")
            cfg = compose_config(preset, [*BENCH_OVERRIDES, *overrides,
                                          *shape_overrides(size, probe.cluster.nproc_per_node), f"run.dir={run_dir}"])
            launch(cfg, echo=None)
            run = {**measure_run(run_dir, warmup_steps), "run_dir": str(run_dir)}
            if run["samples_per_s"] is None:
                raise UserError(f"world size {size}: too few logged steps after warm-up to measure throughput. Fix: "
                                f"raise trainer.max_steps or lower trainer.log_every (run dir: {run_dir})")
            runs[size].append(run)
            if repeats > 1:
                echo(f"  run {r + 1}/{repeats} world size {size}: {run['samples_per_s']:.1f} samples/s")
    echo(HEADER)
    rows = [median_row(size, runs[size], size in world_sizes) for size in sizes]
    for row in rows:
        row["efficiency"] = eff.scaling_efficiency(row["samples_per_s"], row["world_size"], rows[0]["samples_per_s"])
        echo(format_row(row))
    return {"preset": preset, "overrides": [*BENCH_OVERRIDES, *overrides], "warmup_steps": warmup_steps,
            "repeats": repeats, "cores": cores, "device": probe.cluster.device, "warning": warning, "rows": rows}


def median_row(size: int, runs: list[dict[str, Any]], requested: bool) -> dict[str, Any]:
    """One world size's row: the median of each measure over its runs (and every run's throughput)."""
    def median(key: str) -> Optional[float]:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {"world_size": size, "samples_per_s": median("samples_per_s"), "comm_fraction": median("comm_fraction"),
            "step_time_s": median("step_time_s"), "steps_measured": runs[0]["steps_measured"],
            "samples_per_s_runs": [r["samples_per_s"] for r in runs], "run_dirs": [r["run_dir"] for r in runs],
            "requested": requested}


HEADER = f"{'world_size':>10} {'samples_per_s':>14} {'efficiency':>10} {'comm_fraction':>13} {'step_ms':>8}"


def format_row(row: dict[str, Any]) -> str:
    comm = "n/a" if row["comm_fraction"] is None else f"{row['comm_fraction']:.3f}"
    step = "n/a" if row["step_time_s"] is None else f"{1e3 * row['step_time_s']:.1f}"
    return f"{row['world_size']:>10} {row['samples_per_s']:>14.1f} {row['efficiency']:>10.3f} {comm:>13} {step:>8}"


def main_scaling_bench(tokens: list[str], out: Optional[str], run_root: Optional[str],
                       warmup_steps: int = WARMUP_STEPS, repeats: int = 1) -> dict[str, Any]:
    """The ``orch bench scaling`` command: run, print the table, write the JSON."""
    preset, sizes, overrides = split_bench_args(tokens)
    root = Path(run_root or f"runs/bench-scaling/{preset}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"scaling of {preset} at world sizes {sizes} (baseline: world size 1), {repeats} run(s) each, under {root}")
    result = run_scaling(preset, sizes, overrides, root, warmup_steps, repeats)
    text = json.dumps(result, indent=2) + "\n"
    (root / "scaling.json").write_text(text)
    if out:
        Path(out).write_text(text)
    print("efficiency = samples_per_s(N) / (N x samples_per_s(1)); comm_fraction = exposed all-reduce / step time")
    print(f"written: {root / 'scaling.json'}{f' and {out}' if out else ''}; plots: orch report {root}")
    return result

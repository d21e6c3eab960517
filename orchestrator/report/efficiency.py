"""Throughput, scaling efficiency and the step-time breakdown, from metrics.jsonl records alone.

A metrics record covers a *window*: the steps since the previous record of the same attempt. Its
``samples_per_s`` and ``step_time_s`` are means over that window, so totals are rebuilt exactly:
window seconds = steps x ``step_time_s``, samples = ``samples_per_s`` x window seconds.

Warm-up is left out: the first record of each *segment* (a stretch of one attempt at one world size),
whose window holds start-up, first-step allocation and restore, is never counted, nor are windows that
start within ``warmup_steps`` steps after that first record.

Scaling efficiency at world size N = throughput(N) / (N / B x throughput(B)), B the baseline world size
(normally 1: throughput(N) / (N x throughput(1))). 1.0 is linear scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from orchestrator.runtime.timing import PHASES

Record = dict[str, Any]
BREAKDOWN = (*PHASES, "other")


@dataclass(frozen=True)
class Window:
    """One metrics record with the number of steps its means cover."""

    record: Record
    steps: int

    @property
    def seconds(self) -> float:
        return self.steps * self.record["step_time_s"]

    @property
    def samples(self) -> float:
        return self.record["samples_per_s"] * self.seconds


def segments(metrics: Iterable[Record]) -> list[list[Record]]:
    """Records split where the attempt (``restart_count``) or world size changes or the step goes back."""
    out: list[list[Record]] = []
    for m in sorted(metrics, key=lambda m: m["t"]):
        last = out[-1][-1] if out else None
        if (last is None or m.get("restart_count") != last.get("restart_count")
                or m.get("world_size") != last.get("world_size") or m["step"] <= last["step"]):
            out.append([])
        out[-1].append(m)
    return out


def steady_windows(metrics: Iterable[Record], warmup_steps: int = 0) -> list[Window]:
    """The windows that count for throughput: see the module docstring for what warm-up leaves out."""
    kept: list[Window] = []
    metrics = [m for m in metrics if m.get("samples_per_s") is not None]  # a script that reported no samples
    for seg in segments(metrics):
        first = seg[0]["step"]
        for prev, m in zip(seg, seg[1:]):
            if prev["step"] >= first + warmup_steps:
                kept.append(Window(m, m["step"] - prev["step"]))
    return kept


def throughput(windows: list[Window]) -> Optional[float]:
    """Samples per second over ``windows``: total samples / total seconds (None without any)."""
    seconds = sum(w.seconds for w in windows)
    return sum(w.samples for w in windows) / seconds if seconds > 0 else None


def throughput_by_world_size(metrics: Iterable[Record], warmup_steps: int = 0) -> dict[int, float]:
    """Steady-state samples/s at each world size the run trained at."""
    by_size: dict[int, list[Window]] = {}
    for w in steady_windows(metrics, warmup_steps):
        by_size.setdefault(w.record["world_size"], []).append(w)
    return {size: value for size, ws in sorted(by_size.items()) if (value := throughput(ws)) is not None}


def scaling_efficiency(samples_per_s: float, world_size: int, baseline_samples_per_s: float,
                       baseline_world_size: int = 1) -> float:
    """throughput(N) / (N / B x throughput(B)); B = 1 gives the textbook throughput(N) / (N x throughput(1))."""
    return samples_per_s / (world_size / baseline_world_size * baseline_samples_per_s)


def efficiency_by_world_size(by_size: dict[int, float], baseline_world_size: Optional[int] = None,
                             baseline_samples_per_s: Optional[float] = None) -> dict[int, float]:
    """Efficiency of every world size in ``by_size`` against a baseline (default: the smallest size in it)."""
    if baseline_world_size is None:
        if not by_size:
            return {}
        baseline_world_size = min(by_size)
    base = baseline_samples_per_s if baseline_samples_per_s is not None else by_size.get(baseline_world_size)
    if not base:
        return {}
    return {size: scaling_efficiency(value, size, base, baseline_world_size) for size, value in by_size.items()}


def step_time_breakdown(metrics: Iterable[Record], warmup_steps: int = 0) -> Optional[dict[str, float]]:
    """Mean seconds per step of each phase (``data_s`` ... ``other_s``, ``comm_inflight_s``), ``step_time_s``
    and ``comm_fraction`` (``comm_s / step_time_s``), over the steady windows that carry a ``timing`` record
    (None if none do: a user entrypoint, or metrics from before per-step timing)."""
    windows = [w for w in steady_windows(metrics, warmup_steps) if "timing" in w.record]
    steps = sum(w.steps for w in windows)
    if not steps:
        return None
    mean = {"step_time_s": sum(w.seconds for w in windows) / steps}
    for phase in (*BREAKDOWN, "comm_inflight"):
        key = f"{phase}_s"
        if all(key in w.record["timing"] for w in windows):
            mean[key] = sum(w.steps * w.record["timing"][key] for w in windows) / steps
    if "comm_s" in mean and mean["step_time_s"] > 0:
        mean["comm_fraction"] = mean["comm_s"] / mean["step_time_s"]
    return mean


def run_efficiency(metrics: list[Record], warmup_steps: int = 0) -> dict[str, Any]:
    """What a run says about itself: steady samples/s per world size, efficiency against its smallest
    world size (only when it trained at more than one), and the step-time breakdown."""
    by_size = throughput_by_world_size(metrics, warmup_steps)
    efficiency = efficiency_by_world_size(by_size) if len(by_size) > 1 else {}
    return {
        "throughput_by_world_size": {str(k): v for k, v in by_size.items()},
        "scaling_efficiency": ({"baseline_world_size": min(by_size), "by_world_size": {str(k): v for k, v in efficiency.items()}}
                               if efficiency else None),
        "step_time": step_time_breakdown(metrics, warmup_steps),
    }

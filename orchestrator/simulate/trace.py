"""Interruptions of one simulated job: drawn from failure and preemption rates, or read from a trace file.

The job's interruptions are the superposition of its nodes' processes: N nodes that each fail as a Poisson
process of mean ``mtbf_s`` interrupt the job as one Poisson process of mean ``mtbf_s / N`` (and the
superposition of many independent renewal processes tends to Poisson whatever each node's law). So the
simulator draws job-level inter-arrival times and never steps node by node.

Trace format (CSV, a header line, ``#`` comments allowed)::

    time,node,kind
    3600.5,17,failure
    7200,3,preemption

``time``: seconds since the job started; ``node``: the node index (several nodes at one time are one
interruption in effect: the job restarts once); ``kind``: ``failure`` (no notice: the work since the last
checkpoint is lost) or ``preemption`` (a notice of ``--notice-s`` seconds: the emergency checkpoint keeps the
work when it fits).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.errors import ConfigError

KINDS = ("failure", "preemption")


@dataclass(frozen=True)
class Interruptions:
    """Sorted interruption times (seconds since the job started), each a failure or a preemption."""

    t: np.ndarray
    preemption: np.ndarray  # bool: came with a notice

    def __len__(self) -> int:
        return len(self.t)

    def until(self, horizon_s: float) -> "Interruptions":
        keep = self.t < horizon_s
        return Interruptions(self.t[keep], self.preemption[keep])


def draw(rng: np.random.Generator, horizon_s: float, failure_rate: float, preemption_rate: float) -> Interruptions:
    """Poisson failures and preemptions (job-level rates per second) up to ``horizon_s``."""
    times, kinds = [], []
    for rate, kind in ((failure_rate, False), (preemption_rate, True)):
        if rate > 0:
            n = rng.poisson(rate * horizon_s)  # given the count, Poisson arrival times are uniform
            times.append(rng.uniform(0.0, horizon_s, n))
            kinds.append(np.full(n, kind))
    if not times:
        return Interruptions(np.zeros(0), np.zeros(0, dtype=bool))
    t, k = np.concatenate(times), np.concatenate(kinds)
    order = np.argsort(t, kind="stable")
    return Interruptions(t[order], k[order])


def read_trace(path: str, nodes: int | None = None) -> Interruptions:
    """The interruptions of a trace file (format above); a bad line is a one-line error naming it."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--trace", path, "give a CSV file with the header time,node,kind", "is not a file")
    times, kinds = [], []
    with file.open(newline="") as f:
        rows = csv.reader(line for line in f if line.strip() and not line.lstrip().startswith("#"))
        header = [h.strip() for h in next(rows, [])]
        if header != ["time", "node", "kind"]:
            raise ConfigError("--trace", path, "start the file with the line time,node,kind",
                              f"has the header {','.join(header)!r}")
        for number, row in enumerate(rows, start=2):
            where = f"{path} (row {number})"
            try:
                t, node, kind = float(row[0]), int(row[1]), row[2].strip()
            except (ValueError, IndexError):
                raise ConfigError("--trace", where, "write time (seconds),node (an integer),kind", f"has {row}") from None
            if t < 0 or node < 0 or (nodes is not None and node >= nodes):
                raise ConfigError("--trace", where, f"use time >= 0 and a node in 0..{(nodes or 1) - 1}",
                                  f"has time {t} and node {node}")
            if kind not in KINDS:
                raise ConfigError("--trace", where, f"use a kind among {', '.join(KINDS)}", f"has kind {kind!r}")
            times.append(t)
            kinds.append(kind == "preemption")
    t, k = np.asarray(times, dtype=float), np.asarray(kinds, dtype=bool)
    order = np.argsort(t, kind="stable")
    return Interruptions(t[order], k[order])


def write_trace(path: str, interruptions: Interruptions, nodes: list[int] | None = None) -> None:
    """Write ``interruptions`` in the trace format (``nodes``: the node of each, default 0)."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["time", "node", "kind"])
        for i, (t, pre) in enumerate(zip(interruptions.t, interruptions.preemption)):
            out.writerow([round(float(t), 3), nodes[i] if nodes else 0, KINDS[int(pre)]])

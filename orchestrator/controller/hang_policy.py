"""Which ranks hang and which straggle, from the workers' heartbeats (orchestrator/elastic/heartbeat.py).

Pure decisions on :class:`Beat` records, so every rule is tested in milliseconds; the controller reads the
files, asks for stacks and ends nodes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orchestrator.config.schema import HangConfig

STRAGGLER_CHECKS = 3  # a ratio over the factor at this many checks in a row is a straggler, not a hiccup


@dataclass(frozen=True)
class Beat:
    """One worker's latest heartbeat."""

    node: int
    rank: int
    pid: int
    t: float
    step: Optional[int] = None
    step_t: Optional[float] = None
    step_time_s: Optional[float] = None
    busy_s: Optional[float] = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> "Beat":
        return cls(**{k: record.get(k) for k in cls.__dataclass_fields__})


def read_beats(directory: Path) -> list[Beat]:
    """Every heartbeat file in ``directory`` that parses (one being replaced is skipped until the next tick)."""
    beats = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            beats.append(Beat.of(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return beats


def hang_threshold(beats: list[Beat], cfg: HangConfig) -> float:
    """``max(step_time_factor x median step time, floor_s)``: seconds a heartbeat may be old."""
    times = [b.step_time_s for b in beats if b.step_time_s]
    median = statistics.median(times) if times else 0.0
    return max(cfg.step_time_factor * median, cfg.floor_s)


def hung(beats: list[Beat], now: float, cfg: HangConfig) -> list[tuple[Beat, float]]:
    """(beat, seconds since it) of each rank whose heartbeat thread went silent for longer than the threshold:
    the process is stopped or stuck holding the interpreter. Ranks merely blocked in a collective on it keep
    beating, so they are not named."""
    limit = hang_threshold(beats, cfg)
    return [(b, now - b.t) for b in beats if now - b.t > limit]


class StragglerWatch:
    """Names a rank whose busy time per step exceeds ``straggler_factor`` x its peers' median at
    :data:`STRAGGLER_CHECKS` checks in a row; once per rank until it recovers."""

    def __init__(self, cfg: HangConfig):
        self.cfg = cfg
        self._streak: dict[tuple[int, int], int] = {}
        self._reported: set[tuple[int, int]] = set()

    def check(self, beats: list[Beat]) -> list[tuple[Beat, float]]:
        if not self.cfg.straggler_factor:
            return []
        busy = [b for b in beats if b.busy_s]
        found = []
        for b in busy:
            peers = [o.busy_s for o in busy if (o.node, o.rank) != (b.node, b.rank)]
            if not peers:
                continue
            ratio = b.busy_s / statistics.median(peers)
            key = (b.node, b.rank)
            if ratio > self.cfg.straggler_factor:
                self._streak[key] = self._streak.get(key, 0) + 1
                if self._streak[key] >= STRAGGLER_CHECKS and key not in self._reported:
                    self._reported.add(key)
                    found.append((b, ratio))
            else:
                self._streak.pop(key, None)
                self._reported.discard(key)
        return found

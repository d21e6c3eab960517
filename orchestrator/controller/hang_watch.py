"""The controller's hang and straggler watch: reads the heartbeats of the running agents' workers once a
second, and for a hung rank records its Python stack (``hang_detected``) and names its node to end; a
straggler gets a ``straggler`` event (and its node ended with ``hang.evict_stragglers``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

import psutil

from orchestrator.config.schema import HangConfig
from orchestrator.controller.hang_policy import Beat, StragglerWatch, hang_threshold, hung, read_beats
from orchestrator.events import HangDetected, Straggler
from orchestrator.rundir import HEARTBEATS_DIR, STACK_SIGNAL, STACKS_DIR, EventLog, heartbeat_name

CHECK_INTERVAL_S = 1.0
STACK_WAIT_S = 3.0
STACK_MAX_CHARS = 8000


def dump_stack(run_dir: Path, beat: Beat, wait_s: float = STACK_WAIT_S) -> str:
    """Every thread's Python stack of the worker ``beat`` names, by its faulthandler (SIGUSR2). A stopped
    process is continued for it (its node is ended right after)."""
    path = run_dir / STACKS_DIR / f"{heartbeat_name(beat.node, beat.rank)}.txt"
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(beat.pid, STACK_SIGNAL)
        if psutil.Process(beat.pid).status() == psutil.STATUS_STOPPED:
            os.kill(beat.pid, signal.SIGCONT)
    except (OSError, psutil.Error):
        return "(the process is gone)"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > before:
            time.sleep(0.2)  # let faulthandler finish writing every thread
            with path.open() as f:
                f.seek(before)
                return f.read()[:STACK_MAX_CHARS]
        time.sleep(0.05)
    return "(no stack within %.0f s: the worker did not answer SIGUSR2)" % wait_s


class HangWatch:
    """``tick(agents, now)``: ``agents`` maps node -> (agent PID, wall time it started); returns the nodes to
    end now."""

    def __init__(self, run_dir: Path, cfg: HangConfig, events: EventLog,
                 stack: Callable[[Path, Beat], str] = dump_stack):
        self.run_dir, self.cfg, self.events, self.stack = run_dir, cfg, events, stack
        self.stragglers = StragglerWatch(cfg)
        self._next = 0.0
        self._ended: set[tuple[int, int]] = set()  # (node, pid) of workers already acted on

    def tick(self, agents: dict[int, tuple[int, float]], now: float) -> list[int]:
        if not self.cfg.enabled or now < self._next:
            return []
        self._next = now + CHECK_INTERVAL_S
        beats = [b for b in read_beats(self.run_dir / HEARTBEATS_DIR) if self._current(b, agents)]
        end: list[int] = []
        for beat, silent_s in hung(beats, now, self.cfg):
            if (beat.node, beat.pid) in self._ended or beat.node in end:
                continue
            self._ended.add((beat.node, beat.pid))
            self.events.write(HangDetected(node=beat.node, rank=beat.rank, pid=beat.pid, step=beat.step,
                                           silent_s=round(silent_s, 2),
                                           threshold_s=round(hang_threshold(beats, self.cfg), 2),
                                           stack=self.stack(self.run_dir, beat)))
            end.append(beat.node)
        for beat, ratio in self.stragglers.check(beats):
            peers = [b.busy_s for b in beats if b.busy_s and (b.node, b.rank) != (beat.node, beat.rank)]
            self.events.write(Straggler(node=beat.node, rank=beat.rank, ratio=round(ratio, 2),
                                        busy_s=round(beat.busy_s, 4), peers_busy_s=[round(p, 4) for p in peers],
                                        evicted=self.cfg.evict_stragglers))
            if self.cfg.evict_stragglers and beat.node not in end:
                end.append(beat.node)
        return end

    @staticmethod
    def _current(beat: Beat, agents: dict[int, tuple[int, float]]) -> bool:
        """A heartbeat of a live worker of a running agent, written since that agent started (files left by
        earlier workers, or by workers that exited, are not hangs)."""
        agent = agents.get(beat.node)
        if agent is None or beat.t < agent[1]:
            return False
        try:
            proc = psutil.Process(beat.pid)
            return proc.status() != psutil.STATUS_ZOMBIE and agent[0] in [p.pid for p in proc.parents()]
        except psutil.Error:
            return False

"""A worker's heartbeat: how orch's controller tells a hung rank from a slow job (``hang`` config group).

A thread writes ``<run dir>/heartbeats/node<N>-rank<R>.json`` every ``hang.heartbeat_interval_s``: this
worker's PID, the wall time, its last completed step and when, and moving averages of its step time and of its
*busy* time (the step minus time waiting for communication: under DDP every rank's step takes as long as the
slowest's, so only the busy time tells a straggler). A worker that is stopped (SIGSTOP, a frozen VM) or stuck
holding the interpreter stops writing; ranks blocked in a collective keep writing, with a stale step.

``faulthandler`` is registered on SIGUSR2 to write every thread's Python stack to
``<run dir>/stacks/node<N>-rank<R>.txt``: the controller asks for it when it finds this rank hung. It runs in C
without the interpreter lock, so a deadlocked worker still answers.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path
from typing import Optional

from orchestrator.rundir import HEARTBEATS_DIR, STACK_SIGNAL, STACKS_DIR, heartbeat_name  # noqa: F401 (the files' contract)
from orchestrator.runtime.distributed import DistContext

EMA = 0.2  # weight of the newest step in the moving averages


class Heartbeat:
    """Started once per worker (the session does it); :meth:`step_done` feeds it, :meth:`stop` ends it."""

    def __init__(self, run_dir: str, ctx: DistContext, interval_s: float):
        name = heartbeat_name(ctx.node, ctx.rank)
        self.path = Path(run_dir) / HEARTBEATS_DIR / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stacks = Path(run_dir) / STACKS_DIR
        stacks.mkdir(exist_ok=True)
        self._stack_file = open(stacks / f"{name}.txt", "a")  # kept open: faulthandler writes to its descriptor
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        self.ctx, self.interval_s = ctx, interval_s
        self.step: Optional[int] = None
        self.step_t: Optional[float] = None
        self.step_time_s: Optional[float] = None
        self.busy_s: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orch-heartbeat", daemon=True)
        self._thread.start()

    def step_done(self, step: int, step_time_s: float, busy_s: float) -> None:
        self.step, self.step_t = step, time.time()
        self.step_time_s = step_time_s if self.step_time_s is None else (1 - EMA) * self.step_time_s + EMA * step_time_s
        self.busy_s = busy_s if self.busy_s is None else (1 - EMA) * self.busy_s + EMA * busy_s

    def _loop(self) -> None:
        while True:
            self._write()
            if self._stop.wait(self.interval_s):
                return

    def _write(self) -> None:
        record = {"t": time.time(), "pid": os.getpid(), "node": self.ctx.node, "rank": self.ctx.rank,
                  "step": self.step, "step_t": self.step_t, "step_time_s": self.step_time_s, "busy_s": self.busy_s}
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full disk must not end training; the controller sees the heartbeat age

    def stop(self) -> None:
        """The worker is leaving on purpose: no more heartbeats, and the file goes (no false alarm)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.path.unlink()
        except OSError:
            pass
        faulthandler.unregister(STACK_SIGNAL)
        self._stack_file.close()

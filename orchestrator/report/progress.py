"""Live progress of a running launch: step / max_steps, loss, samples/s, world size, ETA, last event.

The launcher process tails the run dir's metrics.jsonl and events.jsonl (only the bytes appended since
the last poll, twice a second, on a daemon thread), so the workers pay nothing for it. On a terminal it is
a rich live progress bar (once the total is known) and line under the streamed node output; when the output
is not a terminal, or under CI (``$CI`` set), it is a plain line at most every ``interval_s`` seconds, so
captured output stays short. The ETA comes from the current attempt's and world size's step time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from orchestrator.rundir import EVENTS_FILE, EventName, JsonlTail, METRICS_FILE

PLAIN_INTERVAL_S = 10.0
POLL_S = 0.5
EVENT_DETAILS = ("node", "world_size", "step", "status")


def describe_event(event: dict[str, Any]) -> str:
    """``node_lost (node 1)``: the event's name and its identifying fields."""
    details = ", ".join(f"{k} {event[k]}" for k in EVENT_DETAILS if k in event)
    return f"{event['event']} ({details})" if details else event["event"]


@dataclass
class ProgressState:
    """Where a run stands, from the records seen so far."""

    max_steps: Optional[int] = None
    started_t: float = field(default_factory=time.time)
    step: Optional[int] = None
    loss: Optional[float] = None
    samples_per_s: Optional[float] = None
    world_size: Optional[int] = None
    steps_per_s: Optional[float] = None
    last_event: Optional[dict[str, Any]] = None
    _prev: Optional[dict[str, Any]] = field(default=None, repr=False)

    def update(self, metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
        """Take new records in; returns whether anything changed."""
        for m in metrics:
            prev = self._prev
            same_attempt = prev is not None and all(m.get(k) == prev.get(k) for k in ("restart_count", "world_size"))
            if same_attempt and m["step"] > prev["step"] and m["t"] > prev["t"]:
                self.steps_per_s = (m["step"] - prev["step"]) / (m["t"] - prev["t"])
            elif m.get("step_time_s"):
                # A new attempt or world size: its own step time, not the gap of the restart between the records
                self.steps_per_s = 1.0 / m["step_time_s"]
            self._prev = m
            self.step, self.loss = m["step"], m.get("loss")
            self.samples_per_s, self.world_size = m.get("samples_per_s"), m.get("world_size", self.world_size)
        for e in events:
            self.last_event = e
            if e["event"] == EventName.RENDEZVOUS_COMPLETE:
                self.world_size = e.get("world_size", self.world_size)
            elif e["event"] == EventName.WORKER_STARTED and e.get("max_steps") and self.max_steps is None:
                self.max_steps = e["max_steps"]  # a user script's total, from its session or HF callback
        return bool(metrics or events)

    @property
    def eta_s(self) -> Optional[float]:
        if self.max_steps is None or self.step is None or not self.steps_per_s:
            return None
        return max(0.0, (self.max_steps - self.step) / self.steps_per_s)

    def line(self, now: Optional[float] = None) -> str:
        """``step 120/400 (30%), loss 4.8100, 520.3 samples/s, world 2, ETA 12 s, last: node_lost (node 1) 3 s ago``"""
        now = time.time() if now is None else now
        parts = []
        if self.step is None:
            parts.append(f"starting ({now - self.started_t:.0f} s)")
        else:
            total = f"/{self.max_steps} ({100 * self.step / self.max_steps:.0f}%)" if self.max_steps else ""
            parts.append(f"step {self.step}{total}")
            if self.loss is not None:
                parts.append(f"loss {self.loss:.4f}")
            if self.samples_per_s is not None:
                parts.append(f"{self.samples_per_s:.1f} samples/s")
        if self.world_size is not None:
            parts.append(f"world {self.world_size}")
        if self.eta_s is not None:
            parts.append(f"ETA {format_seconds(self.eta_s)}")
        if self.last_event is not None:
            parts.append(f"last: {describe_event(self.last_event)} {now - self.last_event['t']:.0f} s ago")
        return ", ".join(parts)


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60}:{seconds % 60:02d} min"


def use_live_display(stream: Optional[TextIO]) -> bool:
    """A rich live display only on an interactive terminal outside CI."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("CI") and os.environ.get("TERM") != "dumb"


class _ConsoleEcho:
    """A text stream that prints whole lines above the live display (node output, from several threads)."""

    def __init__(self, console):
        self.console, self._lock = console, threading.Lock()

    def write(self, text: str) -> int:
        from rich.text import Text

        with self._lock:
            self.console.print(Text(text.rstrip("\n")), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def render_live(state: ProgressState):
    """The live display of a terminal: a progress bar of step / max_steps (once both are known) before the line."""
    from rich.table import Table
    from rich.text import Text

    line = Text(state.line(), style="bold")
    if not state.max_steps or state.step is None:
        return line
    from rich.progress_bar import ProgressBar

    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=state.max_steps, completed=min(state.step, state.max_steps), width=30), line)
    return grid


class RunProgress:
    """Shows a launch's progress on ``stream`` while used as a context manager.

    Launchers write node output to :attr:`echo`: the stream itself, or (live display) a writer that keeps
    that output above the live line.
    """

    def __init__(self, run_dir: str, max_steps: Optional[int], stream: TextIO, live: Optional[bool] = None,
                 interval_s: float = PLAIN_INTERVAL_S, poll_s: float = POLL_S):
        self.run_dir, self.stream = Path(run_dir), stream
        self.live = use_live_display(stream) if live is None else live
        self.interval_s, self.poll_s = interval_s, poll_s
        self.state = ProgressState(max_steps=max_steps)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._display = None
        self.echo: TextIO = stream
        if self.live:
            from rich.console import Console

            self._console = Console(file=stream)
            self.echo = _ConsoleEcho(self._console)

    def __enter__(self) -> "RunProgress":
        self._metrics = JsonlTail(self.run_dir / METRICS_FILE)
        self._events = JsonlTail(self.run_dir / EVENTS_FILE)
        if self.live:
            from rich.live import Live

            self._display = Live(console=self._console, get_renderable=self._render, refresh_per_second=2,
                                 redirect_stdout=False, redirect_stderr=False)
            self._display.start()
        self._thread = threading.Thread(target=self._run, name="orch-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._poll()
        if self._display is not None:
            self._display.stop()

    def _poll(self) -> bool:
        return self.state.update(self._metrics.read_new(), self._events.read_new())

    def _render(self):
        return render_live(self.state)

    def _run(self) -> None:
        last_print, changed = time.monotonic(), False
        while not self._stop.wait(self.poll_s):
            changed = self._poll() or changed
            if not self.live and changed and time.monotonic() - last_print >= self.interval_s:
                self.stream.write(f"[orch] {self.state.line()}\n")
                self.stream.flush()
                last_print, changed = time.monotonic(), False

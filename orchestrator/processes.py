"""Node agent processes on this machine: start, stream output, and kill whole process trees by PID.

torchrun starts its workers in their own sessions, so killing a simulated node means killing the agent
and every descendant, found through the process table (psutil), never by name.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

import psutil

_WORKER_LINE = re.compile(r"^\[node\d+-local(\d+)\]:(?:\[rank(\d+)\] )?")


def echo_line(node: int | str, line: str) -> str:
    """A node's log line as the terminal shows it, with one short prefix: ``[node1 rank0] step 5/40 ...`` for a
    worker's line (torchrun's ``[node1-local0]:`` and the worker's own ``[rank0]`` folded in; ``[node1 local0]``
    where the worker did not say its rank), ``[node1] ...`` for the agent's own. The node log keeps the line as
    written."""
    match = _WORKER_LINE.match(line)
    if match is None:
        return f"[node{node}] {line}"
    who = f"rank{match.group(2)}" if match.group(2) is not None else f"local{match.group(1)}"
    return f"[node{node} {who}] {line[match.end():]}"


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid`` and every descendant; returns the PIDs signalled."""
    procs = process_tree(pid)
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def terminate_tree(pid: int, grace_s: float = 10.0, sig: int = signal.SIGTERM, tree: bool = True) -> None:
    """Send ``sig`` to the tree (or, with ``tree=False``, to ``pid`` alone, letting it stop its children),
    then SIGKILL whatever of the tree is still alive after ``grace_s``."""
    procs = process_tree(pid)
    if tree:
        kill_tree(pid, sig)
    elif procs:
        procs[0].send_signal(sig)
    for p in _wait_gone(procs, grace_s):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to exit; returns those still running."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return alive


def _running(proc: psutil.Process) -> bool:
    try:
        if proc.ppid() == os.getpid():
            # Our own child: look without reaping it (psutil.wait_procs would), so that its Popen still
            # reads the true exit code; a reaped child reads as exit 0 and a killed node as "finished".
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ChildProcessError):
        return False


class NodeProcess:
    """One torchrun agent: output goes, line by line, to ``log_path`` and to ``echo`` with a node prefix."""

    def __init__(self, node: int, argv: tuple[str, ...], env: dict[str, str], log_path: Path,
                 echo: Optional[TextIO] = sys.stdout, on_line: Optional[Callable[[int, str], None]] = None):
        self.node, self.log_path = node, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            list(argv), env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
        )
        self._pump = threading.Thread(target=self._stream, args=(echo, on_line), daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _stream(self, echo: Optional[TextIO], on_line) -> None:
        with self.log_path.open("a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if echo is not None:
                    echo.write(echo_line(self.node, line))
                    echo.flush()
                if on_line is not None:
                    on_line(self.node, line)

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        rc = self.proc.wait(timeout)
        self._pump.join(timeout=5)
        return rc

"""Node agent processes on this machine: start, stream output, and kill whole process trees by PID.

torchrun starts its workers in their own sessions, so killing a simulated node means killing the agent
and every descendant, found through the process table (psutil), never by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

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


class WarmInterpreter:
    """``python -m <warm_module>``, started before the command it will run is known: it imports what that
    command needs meanwhile (see orchestrator/rendezvous/warm.py), then becomes ``python -m <module> ARGS``
    once :meth:`become` writes the arguments and the environment to its stdin (a pipe only this process
    holds). Closed unused, it exits quietly.

    What a Python interpreter reads at its start cannot be handed over: the executable and ``PYTHON*``
    variables (it starts with ``PYTHONUNBUFFERED=1``, as orch's agents do) and the loader's ``LD_*``. A command
    that differs there does not :meth:`fit`. ``PYTHONPATH`` is the exception: the warm module has imported what
    the command itself imports, and the processes it starts (torchrun's workers) get the command's value.
    What it became is not in its command line (``orch chaos`` knows it as a run's agent by its parent, the
    run's supervisor)."""

    def __init__(self, warm_module: str, module: str):
        self.module = module
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", warm_module], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, text=True, bufsize=1,
        )

    def fits(self, argv: Sequence[str], env: dict[str, str]) -> bool:
        """Whether ``argv`` run with ``env`` (the full environment) is what this interpreter can become."""
        if self.proc.poll() is not None or list(argv[:3]) != [sys.executable, "-m", self.module]:
            return False
        startup = {k for k in (*self.env, *env) if k.startswith(("PYTHON", "LD_")) and k != "PYTHONPATH"}
        return all(self.env.get(k) == env.get(k) for k in startup)

    def become(self, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        """Run ``argv`` (which :meth:`fits`) with ``env`` in this interpreter; returns its process."""
        self.proc.stdin.write(json.dumps({"args": list(argv[3:]), "env": env}) + "\n")
        self.proc.stdin.close()
        return self.proc

    def close(self) -> None:
        """End it if it was never used (it may be importing still)."""
        if self.proc.stdin.closed:
            return
        self.proc.stdin.close()
        kill_tree(self.proc.pid)
        self.proc.wait()


class NodeProcess:
    """One torchrun agent: output goes, line by line, to ``log_path`` and to ``echo`` with a node prefix.
    ``warm``: interpreters started ahead; one that fits the command becomes it (taken from the list)."""

    def __init__(self, node: int, argv: tuple[str, ...], env: dict[str, str], log_path: Path,
                 echo: Optional[TextIO] = sys.stdout, on_line: Optional[Callable[[int, str], None]] = None,
                 warm: Optional[list[WarmInterpreter]] = None):
        self.node, self.log_path = node, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **env}
        self.proc = _from_warm(warm or [], argv, full_env) or subprocess.Popen(
            list(argv), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def _from_warm(warm: list[WarmInterpreter], argv: Sequence[str], env: dict[str, str]) -> Optional[subprocess.Popen]:
    """The first of ``warm`` that fits ``argv``, become it (and taken from the list); None if none can."""
    for candidate in list(warm):
        if candidate.fits(argv, env):
            warm.remove(candidate)
            try:
                return candidate.become(argv, env)
            except OSError:  # it died meanwhile: a fresh interpreter instead
                candidate.close()
                return None
    return None


def close_warm(warm: list[WarmInterpreter]) -> None:
    """End the interpreters of ``warm`` that were not used (and empty it)."""
    while warm:
        warm.pop().close()


_ahead: list[WarmInterpreter] = []


def start_ahead(warm_module: str, module: str) -> None:
    """Start an interpreter for ``module`` now, before anything says it will be used (``orch launch``'s first
    moment: its imports then overlap the driver's composing, checking and planning). :func:`take_ahead` hands
    it to what runs ``module``; one nobody took is ended when this process exits."""
    if not _ahead:
        import atexit

        atexit.register(close_warm, _ahead)
    _ahead.append(WarmInterpreter(warm_module, module))


def take_ahead(module: str) -> list[WarmInterpreter]:
    """The interpreters started ahead for ``module`` (each is handed out once)."""
    taken = [w for w in _ahead if w.module == module]
    _ahead[:] = [w for w in _ahead if w.module != module]
    return taken

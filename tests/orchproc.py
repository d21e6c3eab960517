"""Helpers for tests that run orch as users do: the real CLI in a subprocess, ended by PID (the slow tier), or
the CLI's own main in this process where a test needs only the command's exit code and output (orch_here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
ORCH = [sys.executable, "-m", "orchestrator.cli"]


def orch_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment for orch subprocesses: tests/ importable (test-only models and scripts)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "PYTHONUNBUFFERED": "1"}
    return {**env, **(extra or {})}


def run_orch(*args: str, timeout: float = 240, env: Optional[dict[str, str]] = None,
             cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``orch ARGS`` to completion and return its exit code and output."""
    return subprocess.run([*ORCH, *args], capture_output=True, text=True, timeout=timeout, env=orch_env(env),
                          cwd=cwd or REPO)


def orch_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``orch ARGS`` through the CLI's own ``main`` (what the console script calls) in this process, for a test
    that needs the command's exit code and output but not a process of its own: returned as ``run_orch`` returns
    them, in milliseconds instead of a fresh interpreter's seconds. A bug raises here instead of printing a
    traceback. Output captured before the call is dropped."""
    from orchestrator.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["orch", *args], code, out.out, out.err)


def unused_pid() -> int:
    """A PID no process of this PID namespace has now: what a process that exited leaves in a record, found
    without starting (and waiting out) one. Searched downward from the top of the PID range."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    for pid in range(top, top - 10_000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no unused PID near the top of the PID range")


def start_orch(*args: str, log: Path, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> subprocess.Popen:
    """Start ``orch ARGS`` in the background, output to ``log``; end it with ``stop_tree(proc.pid)``."""
    return subprocess.Popen([*ORCH, *args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=orch_env(env),
                            cwd=cwd or REPO, start_new_session=True)


def stop_tree(pid: int) -> None:
    """End ``pid`` and every descendant (agents, workers), by PID."""
    from orchestrator.processes import terminate_tree

    terminate_tree(pid, grace_s=5)


def stop_launch(proc: subprocess.Popen, timeout: float = 120) -> int:
    """What ``orch stop`` does to a foreground launch (its STOP_SIGNAL): every node saves and leaves, and the run
    ends ``stopped``. For a test whose point is reached before the run's last step: the steps left would only
    add time. Returns the launch's exit code."""
    from orchestrator.controller.controller import STOP_SIGNAL

    os.kill(proc.pid, STOP_SIGNAL)
    return proc.wait(timeout=timeout)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def preempt_midrun(tmp_path: Path, args: list[str], deliver: Callable[[Path], Any], min_step: int = 15) -> Path:
    """``orch launch ARGS`` into ``tmp_path/run``; once a metrics record reaches ``min_step``, ``deliver(run_dir)``
    (a notice, a kill); wait for the launch to succeed; returns the run dir."""
    run_dir = tmp_path / "run"
    proc = start_orch("launch", *args, f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        def training() -> bool:
            assert proc.poll() is None, (tmp_path / "orch.log").read_text()[-3000:]
            return any(m["step"] >= min_step for m in read_jsonl(run_dir / "metrics.jsonl"))

        wait_for(training, 120, "training")
        deliver(run_dir)
        assert proc.wait(timeout=200) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    return run_dir


def launch_and_preempt(tmp_path: Path, script: str, max_steps: int, every_n_steps: int, preempt_at_step: int,
                       start_timeout_s: float = 150) -> Path:
    """``orch launch`` a user ``script`` on two simulated nodes, ``orch chaos preempt`` node 1 once a metrics
    record reaches ``preempt_at_step``, and wait for the launch to succeed; returns the run dir."""
    run_dir, log = tmp_path / "run", tmp_path / "orch.log"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=2", f"entrypoint.script={script}",
                      f"trainer.max_steps={max_steps}", "trainer.log_every=1", f"checkpoint.every_n_steps={every_n_steps}",
                      f"run.dir={run_dir}", log=log)
    try:
        def training() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return any(m["step"] >= preempt_at_step for m in read_jsonl(run_dir / "metrics.jsonl"))

        wait_for(training, start_timeout_s, "training")
        preempted = run_orch("chaos", "preempt", str(run_dir), "--node", "1", timeout=60)
        assert preempted.returncode == 0, preempted.stderr
        assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    return run_dir

"""Helpers for tests that run orch as users do: the real CLI in a subprocess, ended by PID."""

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


def start_orch(*args: str, log: Path, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> subprocess.Popen:
    """Start ``orch ARGS`` in the background, output to ``log``; end it with ``stop_tree(proc.pid)``."""
    return subprocess.Popen([*ORCH, *args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=orch_env(env),
                            cwd=cwd or REPO, start_new_session=True)


def stop_tree(pid: int) -> None:
    """End ``pid`` and every descendant (agents, workers), by PID."""
    from orchestrator.processes import terminate_tree

    terminate_tree(pid, grace_s=5)


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

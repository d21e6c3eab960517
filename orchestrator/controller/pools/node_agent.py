"""A node agent: the Ray actor on one node that runs that node's torchrun agent as a subprocess.

The torchrun process is bound to the actor's life: a two-line shim sets PR_SET_PDEATHSIG (SIGTERM) and then
execs torchrun in place (same PID), so when the actor dies (its Ray node left the cluster, or the driver
ended) torchrun gets SIGTERM, stops its workers, and leaves the rendezvous open for the survivors (torchrun
closes it only on a failure, never on a signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

from orchestrator.processes import NodeProcess, kill_tree, terminate_tree
from orchestrator.controller.api import NODE_ADDRESS, AgentSpec
from orchestrator.controller.pools import DEATH_SIGNAL

PARENT_ENV = "ORCH_AGENT_PARENT_PID"
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, set())\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    f"if os.getppid() != int(os.environ.pop({PARENT_ENV!r})):\n"
    "    sys.exit(143)  # the agent died before the prctl took effect\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


class NodeAgent:
    """Runs one torchrun agent at a time on this node; ``start`` may be called again after it exited."""

    def __init__(self) -> None:
        self._proc: Optional[NodeProcess] = None
        self._done = threading.Event()
        self._done.set()
        self._exit_code: Optional[int] = None
        self._death_signal: Optional[str] = None

    def start(self, spec: AgentSpec) -> dict:
        """Start ``spec``'s torchrun; returns its PID and where it runs (``ip``, Ray ``node_id``)."""
        import ray

        if not self._done.is_set():
            raise RuntimeError(f"node {spec.node}: this agent's torchrun (pid {self._proc.pid}) is still running")
        self._done.clear()
        self._exit_code, self._death_signal = None, None
        started, failure = threading.Event(), []
        threading.Thread(target=self._own, args=(spec, started, failure), name=f"node{spec.node}-torchrun",
                         daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        return {"pid": self._proc.pid, "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def _own(self, spec: AgentSpec, started: threading.Event, failure: list) -> None:
        # Start torchrun from this thread and wait here: PR_SET_PDEATHSIG fires when the thread that forked
        # the child ends, so that thread must live exactly as long as torchrun does.
        try:
            if spec.cwd and os.path.isdir(spec.cwd):
                os.chdir(spec.cwd)
            argv = (sys.executable, "-c", DIE_WITH_PARENT, *spec.argv[1:])
            env = {**spec.env, PARENT_ENV: str(os.getpid())}
            if NODE_ADDRESS in env.values():  # what the plan could not know: the machine this agent landed on
                import ray

                ip = ray.util.get_node_ip_address()
                env = {k: ip if v == NODE_ADDRESS else v for k, v in env.items()}
            self._proc = NodeProcess(spec.node, argv, env, Path(spec.log_path), echo=None, on_line=self._watch)
        except BaseException as exc:
            failure.append(exc)
            self._done.set()
            started.set()
            return
        started.set()
        self._exit_code = self._proc.wait()
        self._done.set()

    def _watch(self, node: int, line: str) -> None:
        match = DEATH_SIGNAL.search(line)
        if match:
            self._death_signal = match.group(1)

    def wait_exit(self) -> dict:
        """Block until torchrun exits: its exit code, and the signal it logged being stopped by, if any."""
        self._done.wait()
        return {"exit_code": self._exit_code, "death_signal": self._death_signal}

    def stop(self, grace_s: float, agent_only: bool = False) -> None:
        """SIGTERM the torchrun tree (``agent_only``: torchrun alone, which forwards it to its workers, as a
        preemption notice would), then SIGKILL what is left after ``grace_s``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if not agent_only:
            terminate_tree(proc.pid, grace_s)
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)

"""The NodePool of processes on this machine: every agent is a torchrun process started here.

Used by ``launcher=local`` (simulated nodes on one machine, or the one node of a Kubernetes pod) and, with
its argv wrapped into a network namespace, by test clusters. One machine, ``slots`` agents at most.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.controller.api import AgentExit, AgentSpec, AgentStarted, AgentUpdate, ClusterNode
from orchestrator.controller.pools import DEATH_SIGNAL
from orchestrator.processes import NodeProcess, WarmInterpreter, close_warm, terminate_tree


class LocalNodePool:
    """Agents as child processes; their output goes to their log and, prefixed, to ``echo``."""

    def __init__(self, slots: int, echo: Optional[TextIO], ip: str = "127.0.0.1",
                 warm: Optional[list[WarmInterpreter]] = None):
        self.slots, self.echo, self.ip = slots, echo, ip
        self.warm = warm if warm is not None else []  # agent interpreters started ahead, used first
        self._procs: dict[int, NodeProcess] = {}
        self._death_signals: dict[int, str] = {}
        self._updates: list[AgentUpdate] = []

    def nodes(self) -> list[ClusterNode]:
        return [ClusterNode("local", self.ip, self.slots)]

    def argv(self, spec: AgentSpec, node_id: str) -> tuple[str, ...]:
        """The command line that runs ``spec`` on ``node_id`` (test clusters enter the host's namespace)."""
        return spec.argv

    def start(self, spec: AgentSpec, node_id: str) -> None:
        def on_line(_node: int, line: str, agent_id: int = spec.agent_id) -> None:
            match = DEATH_SIGNAL.search(line)
            if match:
                self._death_signals[agent_id] = match.group(1)

        try:
            proc = NodeProcess(spec.node, self.argv(spec, node_id), spec.env, Path(spec.log_path), echo=self.echo,
                               on_line=on_line, warm=self.warm)
        except OSError as exc:
            self._updates.append(AgentExit(spec.agent_id, spec.node, detail=f"{type(exc).__name__}: {exc}"))
            return
        self._procs[spec.agent_id] = proc
        self._updates.append(AgentStarted(spec.agent_id, spec.node, node_id, self.ip_of(node_id), proc.pid))

    def ip_of(self, node_id: str) -> str:
        return self.ip

    def poll(self, timeout_s: float) -> list[AgentUpdate]:
        deadline = time.monotonic() + timeout_s
        while True:
            for agent_id, proc in list(self._procs.items()):
                if proc.poll() is not None:
                    rc = proc.wait()  # joins the output pump: the log is complete when the exit is reported
                    del self._procs[agent_id]
                    self._updates.append(AgentExit(agent_id, proc.node, exit_code=rc,
                                                   death_signal=self._death_signals.pop(agent_id, None)))
            if self._updates or time.monotonic() >= deadline:
                out, self._updates = self._updates, []
                return out
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def stop(self, agent_id: int, grace_s: float, agent_only: bool = False) -> None:
        proc = self._procs.get(agent_id)
        if proc is not None and proc.poll() is None:
            # In a thread: the controller keeps polling while the tree gets its grace period.
            threading.Thread(target=terminate_tree, args=(proc.pid, grace_s, signal.SIGTERM, not agent_only),
                             daemon=True).start()

    def pids(self) -> dict[int, int]:
        """agent id -> torchrun PID of the agents still running."""
        return {agent_id: p.pid for agent_id, p in self._procs.items() if p.poll() is None}

    def close(self) -> None:
        close_warm(self.warm)
        for proc in self._procs.values():
            if proc.poll() is None:
                terminate_tree(proc.pid, grace_s=5.0)

"""The local launcher: every node of the plan as a torchrun agent process on this machine.

It hosts the rendezvous store itself (agents use ``is_host=false``), so killing any simulated node never
takes rendezvous down; with an elastic ``cluster.nnodes=MIN:MAX`` the survivors re-rendezvous and go on.
Inside a Kubernetes pod it runs the one node of that pod. No Ray.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

from launchers.processes import NodeProcess, terminate_tree
from orchestrator.config.schema import OrchConfig
from orchestrator.plan.plan import PLAN_FILE, build_plan
from orchestrator.rendezvous import RendezvousStore
from orchestrator.report.runlog import EventLog

from orchestrator.chaos import NODES_FILE  # node -> agent PID, read by `orch chaos kill-node`
EXIT_BARRIER_GRACE_S = 10.0


class LocalLauncher:
    """Runs ``cfg`` as ``cluster.max_nodes`` simulated nodes; ``run()`` returns the run's status string."""

    def __init__(self, cfg: OrchConfig, run_dir: str, run_id: str, echo: Optional[TextIO] = sys.stdout,
                 nodes: Optional[list[int]] = None):
        self.cfg, self.run_dir, self.run_id, self.echo = cfg, Path(run_dir), run_id, echo
        self.node_ids = nodes if nodes is not None else list(range(cfg.cluster.max_nodes))
        self.events = EventLog(run_dir)
        self._stop = threading.Event()

    def run(self) -> str:
        store = RendezvousStore(self.cfg.rendezvous.host, self.cfg.rendezvous.port)
        plan = build_plan(self.cfg, str(self.run_dir), self.run_id, store_port=store.port)
        (self.run_dir / PLAN_FILE).write_text(plan.to_json() + "\n")
        self.events.emit("launch_started", preset=plan.preset, run_id=self.run_id, launcher="local",
                         nodes=len(self.node_ids), rendezvous_endpoint=plan.rendezvous_endpoint)
        agents: dict[int, NodeProcess] = {}
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for node in self.node_ids:
                spec = plan.nodes[node]
                agents[node] = NodeProcess(node, spec.argv, spec.env, self.run_dir / "logs" / f"node{node}.log",
                                           echo=self.echo)
                self.events.emit("node_started", node=node, pid=agents[node].pid)
            self._write_nodes(agents)
            exits = self._monitor(agents)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for agent in agents.values():
                if agent.poll() is None:
                    terminate_tree(agent.pid)
            store.close()
        status = self._status(exits)
        self.events.emit("run_finished", status=status, node_exit_codes=exits)
        return status

    def _request_stop(self, signum, frame) -> None:
        self._stop.set()

    def _write_nodes(self, agents: dict[int, NodeProcess]) -> None:
        (self.run_dir / NODES_FILE).write_text(json.dumps({str(n): a.pid for n, a in agents.items()}) + "\n")

    def _monitor(self, agents: dict[int, NodeProcess]) -> dict[int, int]:
        """Wait for every agent; log each exit as node_finished, node_lost (signal) or node_failed."""
        exits: dict[int, int] = {}
        stopping = False
        finished_at: Optional[float] = None
        next_check = 0.0
        while len(exits) < len(agents):
            if self._stop.is_set() and not stopping:
                stopping = True
                self.events.emit("interrupted", reason="the launcher got SIGINT/SIGTERM")
                self._stop_agents(agents, exits)
            now = time.monotonic()
            if finished_at is None and now >= next_check and self.cfg.entrypoint.builtin:
                next_check = now + 1.0
                if any(e["event"] == "training_finished" for e in self._launch_events()):
                    finished_at = now
            if finished_at is not None and exits and now - finished_at > EXIT_BARRIER_GRACE_S and not stopping:
                # Training is done but an agent waits in torchrun's exit barrier (300 s, not configurable)
                # for a peer that was lost after the last step: nothing is left to wait for.
                stopping = True
                self.events.emit("agents_stopped", reason="training finished; agents still waiting on lost peers")
                self._stop_agents(agents, exits)
            for node, agent in agents.items():
                rc = agent.poll()
                if node in exits or rc is None:
                    continue
                agent.wait()
                exits[node] = rc
                self._record_exit(node, rc, stopping)
            time.sleep(0.1)
        return exits

    def _stop_agents(self, agents: dict[int, NodeProcess], exits: dict[int, int]) -> None:
        for node, agent in agents.items():
            if node not in exits:
                threading.Thread(target=terminate_tree, args=(agent.pid,), daemon=True).start()

    def _record_exit(self, node: int, rc: int, stopping: bool) -> None:
        if rc == 0:
            self.events.emit("node_finished", node=node)
        elif stopping:
            self.events.emit("node_stopped", node=node, exit_code=rc)
        elif rc < 0:
            self.events.emit("node_lost", node=node, reason=f"agent killed by {signal.Signals(-rc).name}")
        else:
            self.events.emit("node_failed", node=node, exit_code=rc,
                             reason=f"agent on node {node} exited with code {rc} (see logs/node{node}.log)")

    def _launch_events(self) -> list[dict]:
        events = self.events.read()
        start = max(i for i, e in enumerate(events) if e["event"] == "launch_started")
        return events[start:]

    def _status(self, exits: dict[int, int]) -> str:
        launch = self._launch_events()
        if any(e["event"] == "interrupted" for e in launch):
            return "interrupted"
        # A lost node is not a failure (the elastic job goes on without it); a node that failed is.
        stopped = any(e["event"] == "agents_stopped" for e in launch)
        completed = stopped or any(rc == 0 for rc in exits.values())
        if self.cfg.entrypoint.builtin:
            completed = completed and any(e["event"] == "training_finished" for e in launch)
        else:
            completed = completed and all(rc <= 0 for rc in exits.values())
        return "succeeded" if completed else "failed"

"""The local launcher: every node of the plan as a torchrun agent process on this machine.

It hosts the rendezvous store itself (agents use ``is_host=false``), so killing any simulated node never
takes rendezvous down; with an elastic ``cluster.nnodes=MIN:MAX`` the survivors re-rendezvous and go on.
A preempted simulated node (one that got a notice and left after the emergency checkpoint) is replaced by
a fresh agent when ``preemption.replace_nodes``, as spot capacity coming back would be. Inside a Kubernetes
pod it runs the one node of that pod (``cluster.node_index``) against the job's store
(``rendezvous.external``: ``orch rendezvous-store`` behind a Service), hosting none itself. No Ray.
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
from orchestrator.chaos import NODES_FILE, PreemptionDrill
from orchestrator.config.schema import OrchConfig
from orchestrator.plan.plan import PLAN_FILE, LaunchPlan, build_plan
from orchestrator.rendezvous import RendezvousStore
from orchestrator.report.runlog import EventLog
from orchestrator.report.summary import latest_launch
from orchestrator.testcluster.state import state_for_launch

EXIT_BARRIER_GRACE_S = 10.0


class LocalLauncher:
    """Runs ``cfg`` as simulated nodes ``nodes`` (default: all of ``cluster.max_nodes``); ``run()`` returns the
    run's status: succeeded, failed, interrupted (SIGINT) or preempted (SIGTERM to the launcher itself)."""

    def __init__(self, cfg: OrchConfig, run_dir: str, run_id: str, echo: Optional[TextIO] = sys.stdout,
                 nodes: Optional[list[int]] = None):
        self.cfg, self.run_dir, self.run_id, self.echo = cfg, Path(run_dir), run_id, echo
        if nodes is None:
            index = cfg.cluster.node_index
            nodes = [index] if index is not None else list(range(cfg.cluster.max_nodes))
        self.node_ids = nodes
        self.events = EventLog(run_dir)
        self.agents: dict[int, NodeProcess] = {}
        self.started_at: dict[int, float] = {}
        self.standby: dict[int, tuple[NodeProcess, float]] = {}  # node -> (booted replacement, start time)
        self._signal: Optional[int] = None
        self._plan: Optional[LaunchPlan] = None
        # cluster.testcluster: each node's agent runs on its test host (a network namespace); read before planning.
        self.testcluster = state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes)
        self._watch = None
        self._store: Optional[RendezvousStore] = None
        if self.testcluster:
            from orchestrator.testcluster.netns import require_root

            require_root(f"cluster.testcluster={cfg.cluster.testcluster}")

    def run(self) -> str:
        tc, r = self.testcluster, self.cfg.rendezvous
        store = self._store = None if r.external else RendezvousStore(tc.bridge_address if tc else r.host, r.port)
        port = store.port if store else r.port
        self._plan = build_plan(self.cfg, str(self.run_dir), self.run_id, store_port=port, testcluster=tc)
        (self.run_dir / PLAN_FILE).write_text(self._plan.to_json() + "\n")
        started = self.events.emit("launch_started", preset=self._plan.preset, run_id=self.run_id, launcher="local",
                                   nodes=len(self.node_ids), rendezvous_endpoint=self._plan.rendezvous_endpoint,
                                   **({"testcluster": tc.name} if tc else {}))
        if tc:
            from orchestrator.testcluster.watch import ClusterWatch

            self._watch = ClusterWatch(tc, str(self.run_dir), self.run_id, self.events, self.cfg.rendezvous,
                                       since=started["t"], store_port=port)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        drill = PreemptionDrill(str(self.run_dir), self.cfg.preemption.schedule)
        try:
            for node in self.node_ids:
                self._start_agent(node)
            drill.start()
            exits = self._monitor()
        finally:
            drill.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            for agent in [*self.agents.values(), *(p for p, _ in self.standby.values())]:
                if agent.poll() is None:
                    terminate_tree(agent.pid)
            if self._watch:
                self._watch.close()
            if store is not None:
                store.close()
        status = self._status(exits)
        self.events.emit("run_finished", status=status, node_exit_codes=exits)
        return status

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def _start_agent(self, node: int, replacement: bool = False) -> None:
        standby = self.standby.pop(node, None)
        if standby is not None:  # started when the notice came: already booted, maybe already waiting
            self.agents[node], self.started_at[node] = standby
            self.events.emit("node_started", node=node, pid=standby[0].pid, replacement=True, standby=True)
        else:
            self.agents[node], self.started_at[node] = self._spawn(node), time.time()
            self.events.emit("node_started", node=node, pid=self.agents[node].pid, replacement=replacement)
        (self.run_dir / NODES_FILE).write_text(json.dumps({str(n): a.pid for n, a in self.agents.items()}) + "\n")

    def _spawn(self, node: int) -> NodeProcess:
        spec = self._plan.nodes[node]
        return NodeProcess(node, spec.launch_argv(), spec.env, self.run_dir / "logs" / f"node{node}.log", echo=self.echo)

    def _start_standbys(self) -> None:
        """On a preemption notice, boot the replacement at once: it starts while the noticed node saves and
        leaves, and joins the next rendezvous round as soon as there is room (spot capacity requested early).
        Not for a SIGTERM notice: torchrun also SIGTERMs the workers it restarts on every membership change,
        and a node whose agent stays needs no replacement; a SIGTERMed node is replaced when its agent exits."""
        if not self.cfg.preemption.replace_nodes:
            return
        for e in self._launch_events():
            node = e.get("node")
            if e["event"] == "preemption_notice" and e.get("source") != "sigterm" and node in self.agents \
                    and node not in self.standby and e["t"] >= self.started_at[node]:
                self.standby[node] = (self._spawn(node), time.time())
                self.events.emit("node_standby_started", node=node, pid=self.standby[node][0].pid)

    def _monitor(self) -> dict[int, int]:
        """Wait until every node is done; classify each agent exit, replacing preempted nodes."""
        exits: dict[int, int] = {}
        stopping: Optional[str] = None
        finished_at: Optional[float] = None
        next_check = 0.0
        while len(exits) < len(self.agents):
            if self._signal is not None and stopping is None:
                stopping = self._stop_on_signal(exits)
            now = time.monotonic()
            if finished_at is None and now >= next_check:
                next_check = now + 0.5
                if self._training_finished():
                    finished_at = now
                elif not stopping:
                    self._start_standbys()
            if finished_at is not None and exits and now - finished_at > EXIT_BARRIER_GRACE_S and not stopping:
                # Training is done but an agent waits in torchrun's exit barrier (300 s, not configurable)
                # for a peer that left after the last step: nothing is left to wait for.
                stopping = "agents_stopped"
                self.events.emit("agents_stopped", reason="training finished; agents still waiting on departed peers")
                self._stop_agents(exits, grace_s=5.0)
            if self._watch and finished_at is None and not stopping:
                # Test cluster: fault events, partitioned rounds, and a fresh agent for a healed cut-off node.
                for node in self._watch.poll({n: a.pid for n, a in self.agents.items()}, lambda n: n not in exits):
                    exits.pop(node, None)
                    self._start_agent(node, replacement=True)
            for node, agent in list(self.agents.items()):
                rc = agent.poll()
                if node in exits or rc is None:
                    continue
                agent.wait()
                kind = self._record_exit(node, rc, stopping)
                if kind in ("preempted", "lost"):
                    self._evict(node, agent.pid)
                if kind == "preempted" and self.cfg.preemption.replace_nodes and not stopping and finished_at is None:
                    self._start_agent(node, replacement=True)
                else:
                    exits[node] = rc
            time.sleep(0.1)
        return exits

    def _evict(self, node: int, agent_pid: int) -> None:
        """The survivors' next round need not wait for the departed agent's keep-alive to expire."""
        if self._store is not None and self._store.evict(self.run_id, agent_pid):
            self.events.emit("rendezvous_evicted", node=node, agent_pid=agent_pid)

    def _stop_on_signal(self, exits: dict[int, int]) -> str:
        if self._signal == signal.SIGTERM:
            # Being evicted (a pod's SIGTERM): every node gets the notice, saves, and leaves within the grace.
            self.events.emit("preemption_notice_forwarded", reason="the launcher got SIGTERM",
                             grace_period_s=self.cfg.preemption.grace_period_s)
            self._stop_agents(exits, grace_s=self.cfg.preemption.grace_period_s, sig=signal.SIGTERM, tree=False)
            return "preempted"
        self.events.emit("interrupted", reason="the launcher got SIGINT")
        self._stop_agents(exits, grace_s=10.0)
        return "interrupted"

    def _stop_agents(self, exits: dict[int, int], grace_s: float, sig: int = signal.SIGTERM, tree: bool = True) -> None:
        for node, agent in self.agents.items():
            if node not in exits:
                threading.Thread(target=terminate_tree, args=(agent.pid, grace_s, sig, tree), daemon=True).start()

    def _record_exit(self, node: int, rc: int, stopping: Optional[str]) -> str:
        """Log why ``node``'s agent ended; returns finished | stopped | preempted | lost | failed."""
        # A noticed node's agent may exit 0 (torchrun's SIGTERM path): the notice, not the code, says why.
        if self._was_noticed(node) and not self._training_finished():
            self.events.emit("node_preempted", node=node, exit_code=rc)
            return "preempted"
        if rc == 0:
            self.events.emit("node_finished", node=node)
            return "finished"
        if stopping:
            self.events.emit("node_stopped", node=node, exit_code=rc)
            return "stopped"
        if rc < 0:
            self.events.emit("node_lost", node=node, reason=f"agent killed by {signal.Signals(-rc).name}")
            return "lost"
        cut_off = self._watch and self._watch.exit_reason(node, rc, self.started_at[node])
        if cut_off:
            self.events.emit("node_lost", node=node, reason=cut_off)
            return "lost"
        self.events.emit("node_failed", node=node, exit_code=rc,
                         reason=f"agent on node {node} exited with code {rc} (see logs/node{node}.log)")
        return "failed"

    def _launch_events(self) -> list[dict]:
        return latest_launch(self.events.read())

    def _was_noticed(self, node: int) -> bool:
        """A preemption notice for ``node`` since its agent started and within the grace period: torchrun's own
        SIGTERM to workers it restarts reads as a notice too, and must not excuse a failure much later."""
        since = max(self.started_at[node], time.time() - self.cfg.preemption.grace_period_s - EXIT_BARRIER_GRACE_S)
        return any(e["event"] == "preemption_notice" and e.get("node") == node and e["t"] >= since
                   for e in self._launch_events())

    def _training_finished(self) -> bool:
        return self.cfg.entrypoint.builtin and any(e["event"] == "training_finished" for e in self._launch_events())

    def _pod_finished(self, exits: dict[int, int]) -> bool:
        """One node of a pod job (``cluster.node_index``): rank 0 may train in another pod, so this run dir need
        not hold ``training_finished``; the agent's exit 0 is the evidence (torchrun exits 0 only when every
        worker of the node returned 0, which the built-in trainer does after the last step)."""
        return self.cfg.cluster.node_index is not None and bool(exits) and all(rc == 0 for rc in exits.values())

    def _status(self, exits: dict[int, int]) -> str:
        launch = self._launch_events()
        if any(e["event"] == "interrupted" for e in launch):
            return "interrupted"
        if any(e["event"] == "preemption_notice_forwarded" for e in launch) and not self._training_finished():
            return "preempted"
        # A lost or preempted node is not a failure (the elastic job goes on without it); a failed node is.
        stopped = any(e["event"] == "agents_stopped" for e in launch)
        completed = stopped or any(rc == 0 for rc in exits.values())
        if self.cfg.entrypoint.builtin:
            completed = completed and (self._training_finished() or self._pod_finished(exits))
        else:
            completed = completed and all(rc <= 0 for rc in exits.values())
        return "succeeded" if completed else "failed"

"""The local launcher: every node of the plan as a torchrun agent process on this machine, run by the one
controller (orchestrator/controller/) through a local node pool.

It hosts the rendezvous store itself (agents use ``is_host=false``), so killing any simulated node never
takes rendezvous down; with an elastic ``cluster.nnodes=MIN:MAX`` the survivors re-rendezvous and go on, and
a lost or preempted node's slot is filled again, as the Ray launcher does. Inside a Kubernetes pod it runs the
one node of that pod (``cluster.node_index``) against the job's store (``rendezvous.external``: ``orch
rendezvous-store`` behind a Service; through orch's tunnel when ``ORCH_RUN_SECRET`` is set), hosting none
itself. On a test cluster (``cluster.testcluster``) each node's agent runs on its own host. No Ray.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import RunHooks
from orchestrator.controller.controller import Controller, notice_sender, run_with_signals
from orchestrator.controller.pools.local import LocalNodePool
from orchestrator.plan.plan import PLAN_FILE, build_plan
from orchestrator.ft.quorum import ROUTE as QUORUM_ROUTE, QuorumService
from orchestrator.rendezvous import RendezvousStore
from orchestrator.trust.recorder import refusal_recorder, value_refusal_recorder
from orchestrator.trust.secret import RUN_SECRET_ENV, new_run_secret
from orchestrator.rundir import EventLog, EventName
from orchestrator.testcluster.state import state_for_launch


class LocalLauncher:
    """Runs ``cfg`` as simulated nodes ``nodes`` (default: all of ``cluster.max_nodes``; a pod: its own);
    ``run()`` returns the run's status: succeeded, failed, interrupted (SIGINT) or preempted (SIGTERM)."""

    def __init__(self, cfg: OrchConfig, run_dir: str, run_id: str, echo: Optional[TextIO] = None,
                 nodes: Optional[list[int]] = None):
        self.cfg, self.run_dir, self.run_id, self.echo = cfg, Path(run_dir), run_id, echo
        self.pod = cfg.cluster.node_index is not None
        if nodes is None:
            nodes = [cfg.cluster.node_index] if self.pod else list(range(cfg.cluster.max_nodes))
        self.node_ids = nodes
        self.testcluster = state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes)
        if self.testcluster:
            from orchestrator.testcluster.netns import require_root

            require_root(f"cluster.testcluster={cfg.cluster.testcluster}")

    def run(self) -> str:
        tc, r = self.testcluster, self.cfg.rendezvous
        events = EventLog(self.run_dir)
        secret = new_run_secret()  # for this launch's processes only: never the plan, events or logs
        store = None if r.external else RendezvousStore(tc.bridge_address if tc else r.host, r.port, secret=secret,
                                                        on_refused=refusal_recorder(events),
                                                        on_value_refused=value_refusal_recorder(events))
        port = store.port if store else r.port
        # An external store is gated when the driver was given the run's secret (k8s.run_secret in a pod): the
        # store pod holds the same one, so agents dial it through their relays as they would a hosted store.
        gated = store is not None or bool(r.external and os.environ.get(RUN_SECRET_ENV))
        quorum = QuorumService.for_run(self.cfg)  # per_step: behind the store's gate
        if quorum is not None and store is not None:
            store.add_route(QUORUM_ROUTE, quorum.handler)
        plan = build_plan(self.cfg, str(self.run_dir), self.run_id, store_port=port, testcluster=tc)
        (self.run_dir / PLAN_FILE).write_text(plan.to_json() + "\n")
        started = events.emit(EventName.LAUNCH_STARTED, preset=plan.preset, run_id=self.run_id, launcher="local",
                              nodes=len(self.node_ids), rendezvous_endpoint=plan.rendezvous_endpoint,
                              **({"testcluster": tc.name} if tc else {}))
        hooks: RunHooks = RunHooks()
        if tc:
            from orchestrator.testcluster.pool import TestClusterHooks, TestClusterPool
            from orchestrator.testcluster.watch import ClusterWatch

            pool = TestClusterPool(tc, self.cfg.cluster.max_nodes, self.echo)
            hooks = TestClusterHooks(ClusterWatch(tc, str(self.run_dir), self.run_id, events, r, since=started["t"],
                                                  store=store))
        else:
            # Room for every node and, on a notice, its standby: simulated nodes share this machine.
            pool = LocalNodePool(slots=2 * len(self.node_ids), echo=self.echo)
        controller = Controller(self.cfg, plan, pool, events, nodes=self.node_ids,
                                evict=store.evict if store else None, notify=notice_sender(str(self.run_dir)),
                                hooks=hooks, pod=self.pod, agent_env={RUN_SECRET_ENV: secret}, gated=gated)
        try:
            return run_with_signals(controller, str(self.run_dir), self.cfg.preemption.schedule)
        finally:
            pool.close()
            hooks.close()
            if quorum is not None:
                quorum.close()
            if store is not None:
                store.close()

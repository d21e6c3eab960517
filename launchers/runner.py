"""A launch's wiring, once for every site: the run's secret, the site's machines, the store behind the run's
gate, the fault-tolerance mode's services, the plan (built once), the preflight, the run dir, the launch event,
the controller with its pool, hooks and signals, and the orderly close of all of it.

A site (``launchers/local.py``, ``launchers/ray.py``, ``launchers/testcluster.py``) subclasses
:class:`SiteBase` and fills in only what is its own: where the store lives, which hosts nodes run on, the pool
and the hooks (torch elastic's ``SimpleElasticAgent`` shape: one loop; a backend fills in start, stop, poll).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.controller.agents import AgentMaker
from orchestrator.controller.api import NodePool, RunHooks
from orchestrator.controller.controller import Controller, notice_sender, run_with_signals
from orchestrator.events import LaunchStarted
from orchestrator.ft.driver import driver_mode
from orchestrator.newrun import open_run_dir
from orchestrator.plan.hosts import HostRecord
from orchestrator.plan.plan import LaunchPlan, build_plan
from orchestrator.preflight import check
from orchestrator.rendezvous import RendezvousStore
from orchestrator.rundir import PLAN_FILE, EventLog
from orchestrator.trust.recorder import refusal_recorder, value_refusal_recorder
from orchestrator.trust.secret import RUN_SECRET_ENV, new_run_secret


class SiteBase:
    """What every site shares; a site overrides :meth:`start` and whatever else is its own."""

    name = "local"
    hosts: Optional[tuple[HostRecord, ...]] = None

    def __init__(self, cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None):
        self.cfg, self.run_id, self.echo = cfg, run_id, echo
        self.node_indexes = list(range(cfg.cluster.max_nodes))
        self.nodes_here = cfg.cluster.max_nodes
        self.plan: Optional[LaunchPlan] = None
        self.command_t: Optional[float] = None
        """When the launch command started (``orch launch``'s process start); None: when :meth:`run` was called."""

    # -- what a site may override ----------------------------------------------------------------------------
    def store_host(self) -> Optional[str]:
        return self.cfg.rendezvous.host

    def connect(self) -> None:
        pass

    def launch_fields(self) -> dict[str, Any]:
        return {}

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        raise NotImplementedError

    def close(self, pool: Optional[NodePool], hooks: Optional[RunHooks]) -> None:
        if pool is not None:
            pool.close()
        if hooks is not None:
            hooks.close()

    # -- the plan as this site makes it --------------------------------------------------------------------
    node_address: Optional[str] = None
    """A node's own address, where no host pins it (None: ``rendezvous.host``, this machine's)."""

    def make_plan(self, run_dir: str, store_port: Optional[int] = None) -> LaunchPlan:
        """The launch's plan (``store_port``: the bound store's; None for a dry run)."""
        return build_plan(self.cfg, run_dir, self.run_id, store_port=store_port, store_host=self.store_host(),
                          hosts=self.hosts, node_address=self.node_address)

    # -- the launch ----------------------------------------------------------------------------------------
    def run(self, cfg: OrchConfig, run_id: str, overrides: Optional[Sequence[str]], progress: Any) -> str:
        """Connect, host the store, plan, check, open the run dir, run the controller; returns the status."""
        run_dir = cfg.run.dir
        command_t = self.command_t or time.time()  # connecting (starting Ray) counts: goodput's launch
        events = EventLog(run_dir)
        secret = self._secret()
        check(cfg, self)  # everything checkable before anything starts: a problem exits 2, nothing written
        self.connect()  # unreachable machines exit 2 here, before anything is written
        pool = hooks = store = None
        mode = driver_mode(cfg)
        try:
            host = self.store_host()
            if host is not None:  # orch's store, behind the run's gate on the site's address
                store = RendezvousStore(host, cfg.rendezvous.port, secret=secret, on_refused=refusal_recorder(events),
                                        on_value_refused=value_refusal_recorder(events))
            self.plan = plan = self.make_plan(run_dir, store.port if store else None)
            leases = open_run_dir(cfg, run_id, overrides, secret)  # the first write: leases, config, launch record
            try:
                mode.host(store, events)
                (Path(run_dir) / PLAN_FILE).write_text(plan.to_json() + "\n")
                started = events.write(LaunchStarted(preset=plan.preset, run_id=run_id, launcher=self.name,
                                                     nodes=len(self.node_indexes),
                                                     rendezvous_endpoint=plan.rendezvous_endpoint,
                                                     command_t=command_t, site=self.launch_fields()))
                pool, hooks = self.start(events, store, started["t"])
                agents = AgentMaker(plan, mode, {RUN_SECRET_ENV: secret} if secret else {}, gated=bool(secret))
                controller = Controller(cfg, plan, pool, events, agents, nodes=self.node_indexes,
                                        notify=notice_sender(run_dir), hooks=hooks)
                with progress or contextlib.nullcontext():
                    return run_with_signals(controller, run_dir, cfg.preemption.schedule)
            finally:
                leases.release()
        finally:
            self.close(pool, hooks)
            mode.close()
            if store is not None:
                store.close()

    def _secret(self) -> Optional[str]:
        """The run's secret: the environment's (a Kubernetes Secret's, or the launch's, put there for its
        leases), else a fresh one when this launch hosts the store; None for a pod without one."""
        given = os.environ.get(RUN_SECRET_ENV)
        if given or self.store_host() is None:
            return given or None
        return new_run_secret()

"""A site: where a launch's nodes run and where its store lives. Each launcher name (``launcher=local``,
``launcher=ray``) names a factory of sites in the top-level ``launchers`` package, found by name through
:data:`SITES` (torchx's scheduler registry shape), or through the ``orch.sites`` entry point group for a site
of one's own. Nothing under ``orchestrator/`` imports ``launchers``: the launch asks the registry.

A site decides what the rest of orch must not know: test-cluster hosts, Kubernetes pods, Ray. The launch's
wiring (:mod:`launchers.runner`) drives every site the same way: :meth:`Site.connect`, then the store on
:meth:`Site.store_host`, the plan (on :attr:`Site.hosts`), the preflight, the run dir, then
:meth:`Site.start` for the node pool and the site's run hooks, the controller, and :meth:`Site.close`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import NodePool, RunHooks
from orchestrator.plan.hosts import HostRecord
from orchestrator.plugins import load_named
from orchestrator.rundir import EventLog

SITES = {"local": "launchers.local:make_site", "ray": "launchers.ray:make_site"}
"""``launcher`` name -> ``module:factory``; a factory takes (cfg, run_id, echo) and returns a :class:`Site`."""
ENTRY_POINT_GROUP = "orch.sites"


class Site(Protocol):
    """One launch's site."""

    name: str
    """The launcher's name (``launch_started.launcher``)."""
    hosts: Optional[tuple[HostRecord, ...]]
    """Node i's host, when the site pins nodes to hosts (a test cluster); None: the pool places them."""
    node_indexes: list[int]
    """The nodes this launch plays: all of the plan's, or a Kubernetes pod's own."""
    nodes_here: int
    """How many of them run on this machine (what the machine's GPUs must cover)."""

    def store_host(self) -> Optional[str]:
        """Where this launch's store listens and agents dial it; None when the store is elsewhere (a pod's job
        has ``orch rendezvous-store``). Before :meth:`connect`, the best guess (what ``--dry-run`` shows)."""

    def connect(self) -> None:
        """Reach the machines (start or join Ray); before anything is written. A problem: exit 2."""

    def launch_fields(self) -> dict[str, Any]:
        """What ``launch_started`` records of the site."""

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        """The node pool and the site's run hooks, once the run dir exists (``since``: the launch's start)."""

    def close(self, pool: Optional[NodePool], hooks: Optional[RunHooks]) -> None:
        """Stop the pool's agents and release the site (Ray's connection, a test cluster's Ray nodes)."""

    def run(self, cfg: OrchConfig, run_id: str, overrides: Any, progress: Any) -> str:
        """Run the launch to its end (:mod:`launchers.runner`); returns the run's status."""


SiteFactory = Callable[[OrchConfig, str, Optional[TextIO]], Site]


def site_factory(name: str) -> SiteFactory:
    """The factory of ``launcher=name``'s sites: orch's own (:data:`SITES`) or an installed plug-in's."""
    return load_named("launcher", name, SITES, ENTRY_POINT_GROUP, "launcher")


def make_site(cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None) -> Site:
    """``cfg.launcher``'s site for this launch (reads what the site needs of this machine, connects nothing)."""
    return site_factory(cfg.launcher)(cfg, run_id, echo)

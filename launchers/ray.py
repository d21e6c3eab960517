"""``launcher=ray``, orch's default: the controller (orchestrator/controller/) runs in this process, next to
the rendezvous store, and places one node agent per node on a Ray cluster.

With no ``cluster.address`` it starts an embedded single-node Ray (nothing to set up; agents pack on this
machine). With ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT`` it joins an existing cluster (agents spread, one
per Ray node) and ships the working directory to its nodes (``shipped_runtime_env``); an address that does not
answer within seconds exits 2 before anything is written. The run dir must be on storage every node sees (as on
one machine, or NFS), since agents and workers write into it.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Optional, TextIO

from launchers.runner import SiteBase
from orchestrator.lifecycle.rayjobs import shipped_runtime_env
from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import NODE_ADDRESS, NodePool, RunHooks
from orchestrator.errors import EnvironmentMismatch
from orchestrator.rundir import EventLog

CONNECT_TIMEOUT_S = 5.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EMBEDDED_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # orch passes no large objects; keep /dev/shm free for workers
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
ABANDONED = False  # set by abandon_ray: the CLI then leaves with os._exit (see orchestrator/cli.py)
DASHBOARD_URL: Optional[str] = None  # the embedded Ray's dashboard (cluster.dashboard=true), once started


def connect(cfg: OrchConfig) -> str:
    """Start the embedded Ray or join ``cluster.address``; returns ``embedded`` or the address joined.
    Raises EnvironmentMismatch (exit 2) with the fix when the cluster cannot be reached."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.address
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "orch"}
    if not address:
        c = cfg.cluster
        logging.getLogger(RAY_AUTH_LOGGER).addFilter(_no_auth_enabled_notice)
        global DASHBOARD_URL
        try:
            context = ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(c.max_nodes * c.cpus_per_node)),
                               include_dashboard=c.dashboard, object_store_memory=EMBEDDED_OBJECT_STORE_BYTES, **quiet)
            DASHBOARD_URL = f"http://{context.dashboard_url}" if c.dashboard and context.dashboard_url else None
        except Exception as exc:
            raise EnvironmentMismatch(f"launcher=ray: the embedded Ray did not start ({type(exc).__name__}: {exc}). "
                                      "Fix: launcher=local runs without Ray; `orch doctor` checks the machine") from None
        return "embedded"
    host, port = _endpoint(address)
    _probe(address, host, port)
    runtime_env = shipped_runtime_env(cfg, os.getcwd())
    try:
        ray.init(address=address, runtime_env=runtime_env, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError, SystemExit) as exc:
        if isinstance(exc, ValueError) and "exceeds the maximum size" in str(exc):
            raise EnvironmentMismatch(f"cluster.address={address!r}: the working directory {os.getcwd()} is too big "
                                      f"to ship to the cluster ({str(exc).splitlines()[0]}). Fix: run orch from your "
                                      "project's directory, or list large folders in its .rayignore") from None
        raise EnvironmentMismatch(f"cluster.address={address!r}: could not join the Ray cluster ({exc}). "
                                  "Fix: check the address (`ray status` on the head node), or drop cluster.address "
                                  "to use the embedded Ray") from None
    return address


def _no_auth_enabled_notice(record: logging.LogRecord) -> bool:
    """The embedded Ray is orch's own, started and stopped with the run: its notice that token authentication
    is on (Ray's default) asks nothing of the user, so it is not shown. Every other Ray warning still is."""
    return "Token authentication is enabled" not in record.getMessage()


def _endpoint(address: str) -> tuple[str, int]:
    """The TCP endpoint behind ``address``: the head's GCS (HOST:PORT, auto) or its Ray Client server."""
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            found = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            found = None
        if not found:
            raise EnvironmentMismatch("cluster.address='auto' found no running Ray cluster on this machine. Fix: "
                                      "`ray start --head` first, give the head's HOST:PORT, or drop cluster.address "
                                      "to use the embedded Ray")
        address = found
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not host or (port and not port.isdigit()):
        raise EnvironmentMismatch(f"cluster.address={address!r} is not an address. Fix: use auto, HOST:PORT or "
                                  "ray://HOST:PORT")
    return host.strip("[]"), int(port) if port else (10001 if client else 6379)


def _probe(address: str, host: str, port: int) -> None:
    """Fail in seconds, not minutes (ray.init retries an unreachable head for minutes): one Ray RPC with a
    short deadline. A TCP connect proves little: proxies and firewalls accept connections and stay silent or
    answer with HTTP errors. Any answer from Ray itself, even "unauthenticated", proves a Ray head is there."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # a TLS cluster needs Ray's own credentials; ray.init checks it
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        if address.startswith("ray://"):
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING), timeout=CONNECT_TIMEOUT_S)
        else:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT_S)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED):
            detail = (exc.details() or exc.code().name).splitlines()[0][:160]
            raise EnvironmentMismatch(
                f"cluster.address={address!r}: no Ray cluster answers at {host}:{port} within {CONNECT_TIMEOUT_S:g} s "
                f"({detail}). Fix: check the head node's address and that its port is open from here, or drop "
                "cluster.address to use the embedded Ray") from None
    finally:
        channel.close()


def abandon_ray() -> None:
    """The head's address vanished (its test cluster was taken down under it): ``ray.shutdown`` would wait
    forever on threads reading from it. End the head's processes (this process's children) by PID instead,
    and keep Ray's exit hook from trying again."""
    import atexit

    import psutil
    from ray._private import worker

    from orchestrator.processes import terminate_tree

    global ABANDONED
    ABANDONED = True
    atexit.unregister(worker.shutdown)
    for child in psutil.Process().children():
        terminate_tree(child.pid, grace_s=5.0)


class RaySite(SiteBase):
    """Node agents as Ray actors, one per node, placed by the controller on Ray nodes. Connecting (starting the
    embedded Ray or joining ``cluster.address``) happens in :meth:`connect`, before the run dir exists, so an
    unreachable cluster leaves nothing behind."""

    name = "ray"
    node_address = NODE_ADDRESS  # the Ray node an agent lands on: known when it starts there

    def __init__(self, cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None):
        super().__init__(cfg, run_id, echo)
        self.ray_address: Optional[str] = None
        self.embedded = not cfg.cluster.address
        self.nodes_here = 0 if cfg.cluster.address else cfg.cluster.max_nodes  # a joined cluster's nodes bring GPUs
        c = cfg.cluster
        self.spread = c.placement == "spread" or (c.placement == "auto" and not self.embedded)
        self._driver_ip: Optional[str] = None
        self._echo: Any = None

    def connect(self) -> None:
        self.ray_address = connect(self.cfg)
        self.embedded = self.ray_address == "embedded"

    def store_host(self) -> Optional[str]:
        """The store lives on the driver's node, never on a worker node; agents dial this node's IP."""
        host = self.cfg.rendezvous.host
        if host not in LOOPBACK or self.ray_address is None:
            return host
        if self._driver_ip is None:
            import ray

            self._driver_ip = ray.util.get_node_ip_address()
        return self._driver_ip

    def launch_fields(self) -> dict[str, Any]:
        fields = {"ray": self.ray_address, "driver_ip": self.store_host(), "placement": "spread" if self.spread else "pack"}
        if self.embedded and DASHBOARD_URL:
            fields["dashboard"] = DASHBOARD_URL
            if self.echo is not None:
                print(f"[orch] Ray dashboard: {DASHBOARD_URL}", file=self.echo, flush=True)
        return fields

    def start(self, events: EventLog, store: Any, since: float) -> tuple[NodePool, RunHooks]:
        from orchestrator.controller.pools.log_echo import LogEcho
        from orchestrator.controller.pools.ray import RayNodePool

        c = self.cfg.cluster
        self._echo = LogEcho(Path(self.cfg.run.dir) / "logs", self.echo)
        pool = RayNodePool(c.cpus_per_node, c.gpus_per_agent, self.spread, c.max_nodes)
        self._echo.start()
        return pool, RunHooks()

    def _stop_echo(self) -> None:
        if self._echo is not None:
            self._echo.stop()

    def close(self, pool: Optional[NodePool], hooks: Optional[RunHooks]) -> None:
        import ray

        try:
            super().close(pool, hooks)
            self._stop_echo()
        finally:
            if ray.is_initialized():
                ray.shutdown()


def make_site(cfg: OrchConfig, run_id: str, echo: Optional[TextIO] = None) -> SiteBase:
    """``launcher=ray``'s site: on a test cluster's hosts, or on the embedded or joined Ray."""
    if cfg.cluster.testcluster:
        from launchers.testcluster import RayTestClusterSite

        return RayTestClusterSite(cfg, run_id, echo)
    return RaySite(cfg, run_id, echo)

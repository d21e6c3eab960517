"""The Ray launcher, orch's default: the controller (orchestrator/controller/) runs in this process, next to
the rendezvous store, and places one node agent per node on a Ray cluster.

With no ``cluster.address`` it starts an embedded single-node Ray (nothing to set up; agents pack on this
machine). With ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT`` it joins an existing cluster (agents spread, one
per Ray node) and ships the working directory to its nodes (``shipped_runtime_env``); an address that does not
answer within seconds exits 2 before anything is written. The run dir must be on storage every node sees (as on
one machine, or NFS), since agents and workers write into it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import EnvironmentMismatch
from orchestrator.ft.quorum import ROUTE as QUORUM_ROUTE, QuorumService
from orchestrator.trust.recorder import refusal_recorder, value_refusal_recorder
from orchestrator.trust.secret import RUN_SECRET_ENV, new_run_secret
from orchestrator.plan.plan import PLAN_FILE, build_plan
from orchestrator.rendezvous import RendezvousStore
from orchestrator.controller.api import RunHooks
from orchestrator.rundir import EventLog, EventName

CONNECT_TIMEOUT_S = 5.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EMBEDDED_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # orch passes no large objects; keep /dev/shm free for workers
WORKING_DIR_EXCLUDES = (".git", ".hg", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", "/runs")
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for a job's driver (orchestrator/lifecycle/rayjobs.py)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
ABANDONED = False  # set by _abandon_ray: the CLI then leaves with os._exit (see orchestrator/cli.py)
DASHBOARD_URL: Optional[str] = None  # the embedded Ray's dashboard (cluster.dashboard=true), once started


def connect(cfg: OrchConfig) -> str:
    """Start the embedded Ray or join ``cluster.address``; returns ``embedded`` or the address joined.
    Raises EnvironmentMismatch (exit 2) with the fix when the cluster cannot be reached."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.address
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "orch"}
    if cfg.cluster.testcluster:
        from orchestrator.testcluster.ray_hosts import start_head
        from orchestrator.testcluster.state import state_for_launch

        return start_head(state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes))
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


def shipped_runtime_env(cfg: OrchConfig, cwd: str) -> Optional[dict]:
    """Ray's job ``runtime_env`` when joining a cluster (``cluster.address``): this working directory, shipped
    to every node, so that the entrypoint (a relative script path, a module, ``PYTHONPATH`` entries under it)
    imports there as it does here. Node agents start in the copy unless the same path exists on their machine
    (shared storage). None for the embedded Ray and test clusters: their nodes are this machine.

    Left out of the copy: version control, virtual environments, caches, ``runs/`` and the run dir and local
    checkpoint dir when under ``cwd`` (they are written, not read), plus whatever ``.gitignore`` and
    ``.rayignore`` list (Ray reads them)."""
    if not cfg.cluster.address or cfg.cluster.testcluster:
        return None
    if os.environ.get(RAY_JOB_ENV):  # a Ray job's driver: the job shipped it already; Ray refuses a second one
        return None
    excludes = list(WORKING_DIR_EXCLUDES)
    for path in (cfg.run.dir, cfg.checkpoint.url):
        if path and "://" not in path:
            rel = os.path.relpath(os.path.abspath(path), cwd)
            if rel != "." and not rel.startswith(".."):
                excludes.append(f"/{rel}")
    return {"working_dir": cwd, "excludes": excludes}


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


def _abandon_ray() -> None:
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


class RayLauncher:
    """Runs ``cfg`` through the controller on Ray; ``run()`` returns the run's status. Connecting happens in
    the constructor, before the run dir exists, so an unreachable cluster leaves nothing behind."""

    def __init__(self, cfg: OrchConfig, run_dir: str, run_id: str, echo: Optional[TextIO] = None):
        self.cfg, self.run_dir, self.run_id, self.echo = cfg, Path(run_dir), run_id, echo
        self.testcluster = None
        if cfg.cluster.testcluster:
            from orchestrator.testcluster.netns import require_root
            from orchestrator.testcluster.state import state_for_launch

            require_root(f"cluster.testcluster={cfg.cluster.testcluster}")
            self.testcluster = state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes)
        self.ray_address = connect(cfg)
        self.embedded = self.ray_address == "embedded"

    def run(self) -> str:
        import ray

        from orchestrator.controller.controller import Controller, notice_sender, run_with_signals
        from orchestrator.controller.pools.log_echo import LogEcho
        from orchestrator.controller.pools.ray import RayNodePool

        c, tc = self.cfg.cluster, self.testcluster
        driver_ip = ray.util.get_node_ip_address()
        # The store lives here, on the driver's node, never on a worker node; agents dial this node's IP.
        host = driver_ip if self.cfg.rendezvous.host in LOOPBACK else self.cfg.rendezvous.host
        cfg = dataclasses.replace(self.cfg, rendezvous=dataclasses.replace(self.cfg.rendezvous, host=host))
        spread = c.placement == "spread" or (c.placement == "auto" and not self.embedded) or tc is not None
        events = EventLog(self.run_dir)
        secret = new_run_secret()  # for this launch's processes only: never the plan, events or logs
        store = RendezvousStore(host, cfg.rendezvous.port, secret=secret, on_refused=refusal_recorder(events),
                                on_value_refused=value_refusal_recorder(events))
        quorum = QuorumService.for_run(cfg)  # per_step: behind the store's gate, on the driver's node
        if quorum is not None:
            store.add_route(QUORUM_ROUTE, quorum.handler)
        echo = LogEcho(self.run_dir / "logs", self.echo)
        pool = RayNodePool(c.cpus_per_node, c.gpus_per_agent, spread, c.max_nodes)
        hooks: RunHooks = RunHooks()
        try:
            plan = build_plan(cfg, str(self.run_dir), self.run_id, store_port=store.port, testcluster=tc)
            (self.run_dir / PLAN_FILE).write_text(plan.to_json() + "\n")
            started = events.emit(EventName.LAUNCH_STARTED, preset=plan.preset, run_id=self.run_id, launcher="ray",
                                  nodes=c.max_nodes, rendezvous_endpoint=plan.rendezvous_endpoint, ray=self.ray_address,
                                  driver_ip=driver_ip, placement="spread" if spread else "pack",
                                  **({"testcluster": tc.name} if tc else {}),
                                  **({"dashboard": DASHBOARD_URL} if self.embedded and DASHBOARD_URL else {}))
            if self.embedded and DASHBOARD_URL and self.echo is not None:
                print(f"[orch] Ray dashboard: {DASHBOARD_URL}", file=self.echo, flush=True)
            if tc:
                hooks = self._testcluster_hooks(tc, events, started["t"], store)
            controller = Controller(cfg, plan, pool, events, evict=store.evict, notify=notice_sender(str(self.run_dir)),
                                    hooks=hooks, agent_env={RUN_SECRET_ENV: secret}, gated=True)
            echo.start()
            return run_with_signals(controller, str(self.run_dir), self.cfg.preemption.schedule)
        finally:
            gone = getattr(hooks, "hosts", None) is not None and hooks.hosts.gone()
            if not gone:  # else the head's address is gone too: a Ray call would hang
                pool.close()
            hooks.close()
            echo.stop()
            if quorum is not None:
                quorum.close()
            store.close()
            if gone:
                _abandon_ray()
            else:
                ray.shutdown()

    def _testcluster_hooks(self, tc, events: EventLog, since: float, store) -> RunHooks:
        """A Ray node on every test host, and the controller's duties there on every tick (see TestClusterHooks)."""
        from orchestrator.testcluster.pool import TestClusterHooks
        from orchestrator.testcluster.ray_hosts import RayHosts
        from orchestrator.testcluster.watch import ClusterWatch

        hosts = RayHosts(tc, self.ray_address, self.cfg.cluster.cpus_per_node, str(self.run_dir), events)
        try:
            hosts.start_all()
        except BaseException:
            hosts.close()
            raise
        watch = ClusterWatch(tc, str(self.run_dir), self.run_id, events, self.cfg.rendezvous, since=since,
                             store=store)
        return TestClusterHooks(watch, hosts)

"""The Ray launcher, orch's default: the controller (orchestrator/controller/) runs in this process, next to
the rendezvous store, and places one node agent per node on a Ray cluster.

With no ``cluster.address`` it starts an embedded single-node Ray (nothing to set up; agents pack on this
machine). With ``auto``, ``HOST:PORT`` or ``ray://HOST:PORT`` it joins an existing cluster (agents spread, one
per Ray node); an address that does not answer within seconds exits 2 before anything is written. The run dir
must be on storage every node sees (as on one machine, or NFS), since agents and workers write into it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import EnvironmentMismatch
from orchestrator.plan.plan import PLAN_FILE, build_plan
from orchestrator.rendezvous import RendezvousStore
from orchestrator.report.runlog import EventLog

CONNECT_TIMEOUT_S = 5.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EMBEDDED_OBJECT_STORE_BYTES = 128 * 1024 * 1024  # orch passes no large objects; keep /dev/shm free for workers


def connect(cfg: OrchConfig) -> str:
    """Start the embedded Ray or join ``cluster.address``; returns ``embedded`` or the address joined.
    Raises EnvironmentMismatch (exit 2) with the fix when the cluster cannot be reached."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.address
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "orch"}
    if not address:
        c = cfg.cluster
        try:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(c.max_nodes * c.cpus_per_node)),
                     include_dashboard=False, object_store_memory=EMBEDDED_OBJECT_STORE_BYTES, **quiet)
        except Exception as exc:
            raise EnvironmentMismatch(f"launcher=ray: the embedded Ray did not start ({type(exc).__name__}: {exc}). "
                                      "Fix: launcher=local runs without Ray; `orch doctor` checks the machine") from None
        return "embedded"
    host, port = _endpoint(address)
    _probe(address, host, port)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError, SystemExit) as exc:
        raise EnvironmentMismatch(f"cluster.address={address!r}: could not join the Ray cluster ({exc}). "
                                  "Fix: check the address (`ray status` on the head node), or drop cluster.address "
                                  "to use the embedded Ray") from None
    return address


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


class RayLauncher:
    """Runs ``cfg`` through the controller on Ray; ``run()`` returns the run's status. Connecting happens in
    the constructor, before the run dir exists, so an unreachable cluster leaves nothing behind."""

    def __init__(self, cfg: OrchConfig, run_dir: str, run_id: str, echo: Optional[TextIO] = sys.stdout):
        self.cfg, self.run_dir, self.run_id, self.echo = cfg, Path(run_dir), run_id, echo
        self.ray_address = connect(cfg)
        self.embedded = self.ray_address == "embedded"

    def run(self) -> str:
        import ray

        from orchestrator.chaos import PreemptionDrill
        from orchestrator.controller.controller import Controller
        from orchestrator.controller.log_echo import LogEcho
        from orchestrator.controller.ray_pool import RayNodePool

        c = self.cfg.cluster
        driver_ip = ray.util.get_node_ip_address()
        # The store lives here, on the driver's node, never on a worker node; agents dial this node's IP.
        host = driver_ip if self.cfg.rendezvous.host in LOOPBACK else self.cfg.rendezvous.host
        cfg = dataclasses.replace(self.cfg, rendezvous=dataclasses.replace(self.cfg.rendezvous, host=host))
        spread = c.placement == "spread" or (c.placement == "auto" and not self.embedded)
        store = RendezvousStore(host, cfg.rendezvous.port)
        events = EventLog(self.run_dir)
        echo = LogEcho(self.run_dir / "logs", self.echo)
        pool = RayNodePool(c.cpus_per_node, c.gpus_per_agent, spread, c.max_nodes)
        drill = PreemptionDrill(str(self.run_dir), self.cfg.preemption.schedule)  # preemption.schedule, if set
        try:
            plan = build_plan(cfg, str(self.run_dir), self.run_id, store_port=store.port)
            (self.run_dir / PLAN_FILE).write_text(plan.to_json() + "\n")
            events.emit("launch_started", preset=plan.preset, run_id=self.run_id, launcher="ray", nodes=c.max_nodes,
                        rendezvous_endpoint=plan.rendezvous_endpoint, ray=self.ray_address, driver_ip=driver_ip,
                        placement="spread" if spread else "pack")
            controller = Controller(cfg, plan, pool, events, evict=store.evict)
            previous = {s: signal.signal(s, lambda signum, _: controller.request_stop(signum))
                        for s in (signal.SIGINT, signal.SIGTERM)}
            echo.start()
            drill.start()
            try:
                return controller.run()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        finally:
            drill.stop()
            pool.close()
            echo.stop()
            store.close()
            ray.shutdown()

"""The standalone rendezvous store: ``orch rendezvous-store``, and the Deployment + Service that run it.

It is the same :class:`~orchestrator.rendezvous.RendezvousStore` the launchers host, in a process of its own,
so that in a Kubernetes job no training pod hosts rendezvous: losing any pod, the one with rank 0 included,
leaves the store (and the other pods' membership) intact, as losing a simulated node does under
``orch launch``. It keeps its state in memory: it belongs on a regular node, never in a spot pool.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.pods import (base_pod_spec, metadata, run_secret_env, selector, store_port, store_service,
                                   template_metadata)
from orchestrator.k8s.security import container_security_context, scratch_mounts, store_network_policy
from orchestrator.trust.secret import RUN_SECRET_ENV

COMPONENT = "rendezvous-store"


def serve_store(port: int, say: Callable[[str], None] = print, host: str = "0.0.0.0") -> int:
    """Host a store on ``host``:``port`` (0: a free port) until SIGTERM or SIGINT; returns 0, the exit status of
    a store that was asked to stop. The default listens on every IPv4 interface of the store pod, deliberately:
    a pod's network namespace has only loopback and the pod's own interface, which the Service routes to
    (``--host ::`` for an IPv6 cluster); outside a pod, name the one address agents dial.

    With ``ORCH_RUN_SECRET`` in the environment (``k8s.run_secret``) the store is orch's own behind the run's
    gate, as a launcher's is: only clients that prove the secret get in, and agents dial through their relays.
    Without it (a job rendered with ``k8s.run_secret=''``) it is torch's plain TCPStore, as the opt-out says.
    Refused clients are not recorded: this process has no run dir, and a log line per port scan would bury the
    one that matters."""
    secret = os.environ.get(RUN_SECRET_ENV, "")
    store = _gated_store(host, port, secret) if secret else _PlainStore(host, port)
    gated = (f", gated: clients must prove the run's secret ({RUN_SECRET_ENV})" if secret
             else f", open to anyone who reaches this port: set {RUN_SECRET_ENV} to admit only the run")
    say(f"rendezvous store listening on {host} port {store.port}{gated}")
    try:
        wait_for_stop_signal()
    finally:
        store.close()
    say("rendezvous store stopped")
    return 0


def wait_for_stop_signal() -> None:
    """Block until SIGTERM (the kubelet stopping the pod) or SIGINT; the previous handlers are restored."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _gated_store(host: str, port: int, secret: str):
    from orchestrator.rendezvous import RendezvousStore

    return RendezvousStore("127.0.0.1" if host in ("0.0.0.0", "::") else host, port, listen=host, secret=secret)


class _PlainStore:
    """torch's TCPStore on ``host``:``port`` (bound there, not on every interface unless asked)."""

    def __init__(self, host: str, port: int):
        from datetime import timedelta

        from torch.distributed import TCPStore

        from orchestrator.trust.acceptor import listening_socket

        sock = listening_socket(host, port)
        self.port = sock.getsockname()[1]
        self._store = TCPStore(host, self.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                               timeout=timedelta(seconds=300), master_listen_fd=sock.detach(), use_libuv=True)

    def close(self) -> None:
        self._store = None


def store_pod_template(cfg: OrchConfig, restart_policy: str | None = None) -> dict[str, Any]:
    """The store's pod: ``orch rendezvous-store`` on the job's store port, ready once it accepts connections.
    Not spot-placed: it keeps the rendezvous in memory."""
    port = store_port(cfg)
    container = {
        "name": "store", "image": cfg.k8s.image, "imagePullPolicy": cfg.k8s.image_pull_policy,
        "command": ["orch"], "args": ["rendezvous-store", "--port", str(port)],
        "ports": [{"name": "c10d", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security_context(),
        "volumeMounts": scratch_mounts(),
    }
    if run_secret_env(cfg):  # the default; k8s.run_secret='' is the one way to an ungated store
        container["env"] = run_secret_env(cfg)
    return {"metadata": template_metadata(cfg, COMPONENT), "spec": base_pod_spec(cfg, [container], restart_policy)}


def store_policy(cfg: OrchConfig) -> dict[str, Any]:
    """The NetworkPolicy that admits only the run's own pods to its store."""
    return store_network_policy(cfg, selector(cfg, COMPONENT), store_port(cfg), metadata(cfg, store_service(cfg), COMPONENT))


def store_objects(cfg: OrchConfig) -> list[dict[str, Any]]:
    """A Service, a one-replica Deployment running the store, and its NetworkPolicy. The Deployment is not
    owned by the job (its uid is unknown when rendering): ``kubectl delete -f`` the file to remove both."""
    return singleton_objects(cfg, store_service(cfg), COMPONENT, store_port(cfg), "c10d", store_pod_template(cfg))


def singleton_objects(cfg: OrchConfig, name: str, component: str, port: int, port_name: str,
                      template: dict[str, Any]) -> list[dict[str, Any]]:
    """A service of the job that runs as one pod: the NetworkPolicy admitting only the run's pods on ``port``,
    a Service ``name`` there, and a one-replica Deployment of ``template`` (the store, per_step's quorum service)."""
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(cfg, name, component),
        "spec": {"selector": selector(cfg, component),
                 "ports": [{"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}]},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(cfg, name, component),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two: every node must meet in the same one
            "selector": {"matchLabels": selector(cfg, component)},
            "template": template,
        },
    }
    policy = store_network_policy(cfg, selector(cfg, component), port, metadata(cfg, name, component))
    return [policy, service, deployment]

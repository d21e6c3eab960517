"""The standalone quorum service of ``fault_tolerance.mode=per_step``: ``orch quorum-service``, and the
Deployment + Service + NetworkPolicy that run it in a Kubernetes job (the job's "Lighthouse").

It is the same :class:`~orchestrator.ft.quorum.QuorumService` that ``orch launch`` hosts in its driver (torchft's
Lighthouse rules), in a process of its own behind a gate of its own, so that in a Kubernetes job no training pod
hosts the quorum: losing any pod costs the job one replica group, whose heartbeats stop, never the quorum the
survivors train on. Unlike the store it is never ungated: every group proves the run's secret to join the
quorum and to heal from a peer, so it refuses to start without one. It keeps its state in memory and belongs on
a regular node, never in a spot pool.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError
from orchestrator.k8s.names import check_names
from orchestrator.k8s.pods import base_pod_spec, quorum_service, run_secret_env, template_metadata
from orchestrator.k8s.security import container_security_context, scratch_mounts
from orchestrator.k8s.store import singleton_objects, wait_for_stop_signal
from orchestrator.trust.secret import RUN_SECRET_ENV

COMPONENT = "quorum-service"


def serve_quorum(port: int, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int,
                 say: Callable[[str], None] = print, host: str = "0.0.0.0") -> int:
    """Host the quorum service on ``host``:``port`` (0: a free port) behind the run's gate (``ORCH_RUN_SECRET``)
    until SIGTERM or SIGINT; returns 0, the exit status of a service that was asked to stop. Every interface by
    default, as the store pod's (``serve_store``): a pod has only loopback and its own. Each group it drops is
    a log line (``replica ... dropped``): this process has no run dir. It sees no agent exit, so a group whose
    heartbeat connection closes (its pod killed whole: the kernel closes the dead processes' sockets) is out of the
    next quorum at once, not after ``heartbeat_timeout_ms`` (``disconnect_is_silence``)."""
    from orchestrator.ft.quorum import ROUTE, QuorumService
    from orchestrator.trust.acceptor import listening_socket
    from orchestrator.trust.gate import Gate

    secret = os.environ.get(RUN_SECRET_ENV, "")
    if not secret:
        raise ConfigError(RUN_SECRET_ENV, None, "give the quorum service the run's secret (orch k8s render takes it "
                          "from the run's Secret, k8s.run_secret), as every node of the job has it",
                          "is not set, and the quorum service admits only holders of the run's secret")
    service = QuorumService(min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms,
                            on_drop=lambda rid, cause: say(f"replica {rid} dropped ({cause})"),
                            disconnect_is_silence=True)
    try:
        gate = Gate(listening_socket(host, port), secret, {ROUTE: service.handler}.get, name="orch-quorum-gate")
    except BaseException:
        service.close()
        raise
    say(f"quorum service listening on {host} port {gate.port}, gated: clients must prove the run's secret "
        f"({RUN_SECRET_ENV}); min_replicas={min_replicas} heartbeat_timeout_ms={heartbeat_timeout_ms}")
    try:
        wait_for_stop_signal()
    finally:
        gate.close()
        service.close()
    say("quorum service stopped")
    return 0


def quorum_args(cfg: OrchConfig) -> list[str]:
    """``orch quorum-service`` with the quorum rules of the config (the same the launch's own service uses)."""
    ft = cfg.fault_tolerance
    return ["quorum-service", "--port", str(cfg.k8s.quorum_port), "--min-replicas", str(cfg.cluster.min_nodes),
            "--join-timeout-ms", str(ft.join_timeout_ms), "--quorum-tick-ms", str(ft.quorum_tick_ms),
            "--heartbeat-timeout-ms", str(ft.heartbeat_timeout_ms)]


def require_gated(cfg: OrchConfig) -> None:
    """per_step's groups prove the run's secret to the quorum service and to each other: no secret, no quorum."""
    if not run_secret_env(cfg):
        raise ConfigError("k8s.run_secret", "", "drop k8s.run_secret='' (a Secret named after the job) or name one "
                          "you created, or use fault_tolerance.mode=restart",
                          "leaves the run without a secret, but under fault_tolerance.mode=per_step the quorum "
                          "service and the peers that heal a returning node admit only holders of it")


def quorum_pod_template(cfg: OrchConfig) -> dict[str, Any]:
    """The quorum service's pod: ``orch quorum-service`` with the run's secret from its Secret (a reference),
    ready once it accepts connections; the security defaults of every pod, not spot-placed."""
    port = cfg.k8s.quorum_port
    container = {
        "name": "quorum", "image": cfg.k8s.image, "imagePullPolicy": cfg.k8s.image_pull_policy,
        "command": ["orch"], "args": quorum_args(cfg),
        "env": run_secret_env(cfg),
        "ports": [{"name": "quorum", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security_context(),
        "volumeMounts": scratch_mounts(),
    }
    return {"metadata": template_metadata(cfg, COMPONENT), "spec": base_pod_spec(cfg, [container], None)}


def quorum_objects(cfg: OrchConfig) -> list[dict[str, Any]]:
    """Its NetworkPolicy (the run's pods only, on the quorum port), Service, and one-replica Deployment. Like
    the job format's store Deployment, it is not owned by the job: ``kubectl delete -f`` the file removes it."""
    require_gated(cfg)
    name = quorum_service(cfg)
    check_names(cfg, [name])
    return singleton_objects(cfg, name, COMPONENT, cfg.k8s.quorum_port, "quorum", quorum_pod_template(cfg))


def per_step_objects(cfg: OrchConfig) -> list[dict[str, Any]]:
    """The quorum service's objects when the config runs per_step, none otherwise (every format with one pod
    per node renders them beside its store)."""
    return quorum_objects(cfg) if cfg.fault_tolerance.mode == "per_step" else []

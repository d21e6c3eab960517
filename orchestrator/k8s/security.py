"""Security defaults of every pod: a non-root user, no privilege escalation, no capabilities, no Kubernetes API
token (unless ``k8s.automount_service_account_token``), a read-only root filesystem with memory-light emptyDirs
where orch and torch write (/tmp, the working directory), and NetworkPolicies that let only the job's own pods
reach its pods: the rendezvous store (and per_step's quorum service) on its port, the training pods on any port
(torch's rank-0 store, gloo and NCCL listen on ports picked at run time)."""

from __future__ import annotations

from typing import Any

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.names import object_name

USER_ID = 1000  # the `orch` user of deploy/k8s/Dockerfile; runAsNonRoot needs a numeric id to check
WORKDIR = "/workspace"  # each pod's run dir (logs, events) is written here
SCRATCH = {"tmp": "/tmp", "workspace": WORKDIR}  # volume name -> mount path
HOME = "/tmp"  # caches under ~ (torch, Hugging Face) need a writable home on a read-only root filesystem


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(read_only_root: bool = True) -> dict[str, Any]:
    """``read_only_root=False`` for Ray's processes, which write outside /tmp (session and runtime-env files)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": read_only_root, "runAsNonRoot": True}


def scratch_volumes() -> list[dict[str, Any]]:
    return [{"name": name, "emptyDir": {}} for name in SCRATCH]


def scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": path} for name, path in SCRATCH.items()]


def ingress_policy(meta: dict[str, Any], pods: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, Any]:
    """A NetworkPolicy admitting to the pods labelled ``pods`` only what ``rules`` (ingress rules) allow."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": rules}}


def run_pods(cfg: OrchConfig) -> dict[str, Any]:
    """The peer that is every pod of this run (the instance label every pod template carries)."""
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": object_name(cfg)}}}


def tcp_ports(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def store_network_policy(cfg: OrchConfig, store_selector: dict[str, str], port: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Ingress to a service's pods (the store's, per_step's quorum service's) only from pods of the same run, on
    its port: the outer wall, with the run's secret the inner one (``k8s.run_secret=''`` leaves this the only one,
    for the store)."""
    return ingress_policy(meta, store_selector, [{"from": [run_pods(cfg)], "ports": tcp_ports(port)}])


def run_network_policy(cfg: OrchConfig, pods: dict[str, str], meta: dict[str, Any],
                       extra_rules: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """Ingress to the run's pods selected by ``pods`` from the run's own pods, on any port (the ports torch
    and Ray listen on are picked at run time), and whatever ``extra_rules`` admit (KubeRay's, for rayjob)."""
    return ingress_policy(meta, pods, [{"from": [run_pods(cfg)]}, *extra_rules])

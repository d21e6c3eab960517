"""Security defaults of every pod: a non-root user, no privilege escalation, no capabilities, a read-only root
filesystem with memory-light emptyDirs where orch and torch write (/tmp, the working directory), and a
NetworkPolicy that lets only the job's own pods reach its rendezvous store."""

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


def store_network_policy(cfg: OrchConfig, store_selector: dict[str, str], port: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Ingress to the store's pods only from pods of the same run, on the store port. Without
    ``k8s.run_secret`` the store runs no authentication, so who can reach it is who can join (or disturb) the
    job's rendezvous; with it, this is the outer wall and the gate the inner one."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": store_selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": object_name(cfg)}}}],
                         "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }

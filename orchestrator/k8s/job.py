"""``--format job``: plain Kubernetes, no operator.

- the rendezvous store: a Deployment + Service running ``orch rendezvous-store`` (store.py);
- a headless Service giving each training pod a stable DNS name (``<name>-<index>.<name>-nodes``);
- an Indexed Job, one pod per node (parallelism = completions = MAX nodes). Each pod runs
  ``orch launch ... launcher=local cluster.node_index=$(JOB_COMPLETION_INDEX) rendezvous.external=true`` against
  the store, so no training pod hosts rendezvous.

Preemption: the pod's SIGTERM makes orch save an emergency checkpoint and exit 75; the podFailurePolicy
ignores exit 75 (and disrupted pods), so the Job recreates the pod without counting it against backoffLimit,
and the new pod resumes from the checkpoint. A config error (exit 2) fails the Job at once: retrying cannot help.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.pods import (PREEMPTED_EXIT, USER_ERROR_EXIT, labels, metadata, node_launch_args, object_name,
                                   pod_spec, require_gpu_resource, require_shared_checkpoints, selector,
                                   training_container, training_env)
from orchestrator.k8s.store import store_objects

COMPONENT = "trainer"
CONTAINER = "trainer"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def render_job(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """Store Service + Deployment, the headless Service, and the Indexed Job, in the order to apply them."""
    nodes = cfg.cluster.max_nodes
    require_gpu_resource(cfg)
    require_shared_checkpoints(cfg, nodes, f"cluster.nnodes={cfg.cluster.nnodes}")
    name, headless = object_name(cfg), f"{object_name(cfg)}-nodes"
    # Declared (the Job controller would add it too) so that $(JOB_COMPLETION_INDEX) in args expands.
    index_env = {"name": "JOB_COMPLETION_INDEX",
                 "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
    container = training_container(cfg, CONTAINER, node_launch_args(cfg, overrides, "$(JOB_COMPLETION_INDEX)"),
                                   training_env(cfg, [index_env]), command=["orch"])
    spec = pod_spec(cfg, [container], "Never")  # podFailurePolicy needs Never: the Job, not the kubelet, retries
    spec["subdomain"] = headless
    on_exit = lambda codes: {"containerName": CONTAINER, "operator": "In", "values": codes}  # noqa: E731
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(cfg, name, COMPONENT),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": cfg.k8s.backoff_limit,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onExitCodes": on_exit([PREEMPTED_EXIT])},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob", "onExitCodes": on_exit([USER_ERROR_EXIT])},
            ]},
            "template": {"metadata": {"labels": labels(cfg, COMPONENT)}, "spec": spec},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(cfg, headless, COMPONENT),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(cfg, COMPONENT)},
    }
    return [*store_objects(cfg), service, job]

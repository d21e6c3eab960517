"""``--format job``: plain Kubernetes, no operator.

- the rendezvous store: a Deployment + Service running ``orch rendezvous-store`` (store.py), and the
  NetworkPolicy that admits only the run's pods to it;
- a NetworkPolicy that admits only the run's pods to the training pods (``trainer_policy``);
- a headless Service giving each training pod a stable DNS name (``<name>-<index>.<name>-nodes``);
- an Indexed Job, one pod per node (parallelism = completions = MAX nodes). Each pod runs
  ``orch launch ... launcher=local cluster.node_index=$(JOB_COMPLETION_INDEX) rendezvous.external=true`` against
  the store, so no training pod hosts rendezvous.

Preemption: the pod's SIGTERM makes orch save an emergency checkpoint and exit 75; the podFailurePolicy
ignores exit 75 (and disrupted pods), so the Job recreates the pod without counting it against backoffLimit,
and the new pod resumes from the checkpoint. A config error (exit 2) fails the Job at once: retrying cannot help.
The same node Job is the ``node`` replicated job of the jobset and trainjob formats.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.names import check_names, object_name
from orchestrator.k8s.pods import (PREEMPTED_EXIT, USER_ERROR_EXIT, metadata, node_launch_args, pod_spec,
                                   require_gpu_resource, require_shared_checkpoints, selector, store_service,
                                   template_metadata, training_container, training_env)
from orchestrator.k8s.quorum import per_step_objects
from orchestrator.k8s.security import run_network_policy
from orchestrator.k8s.store import store_objects

COMPONENT = "trainer"
CONTAINER = "trainer"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
DISRUPTED = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def require_runnable(cfg: OrchConfig) -> None:
    """The checks every format of one pod per node makes before rendering."""
    require_gpu_resource(cfg)
    require_shared_checkpoints(cfg, cfg.cluster.max_nodes, f"cluster.nnodes={cfg.cluster.nnodes}")


def trainer_policy(cfg: OrchConfig) -> dict[str, Any]:
    """Ingress to the training pods only from the run's own pods: torchrun's rank-0 store, gloo and NCCL
    listen on them, on ports picked at run time. Every format with one pod per node renders it."""
    return run_network_policy(cfg, selector(cfg, COMPONENT), metadata(cfg, object_name(cfg), COMPONENT))


def node_job_spec(cfg: OrchConfig, overrides: Sequence[str], container_name: str = CONTAINER,
                  store_host: Optional[str] = None) -> dict[str, Any]:
    """The spec of an Indexed Job of MAX pods, one orch node each, with the podFailurePolicy that tells a
    preemption (exit 75, a disruption: ignored) from a user error (exit 2: fail at once)."""
    nodes = cfg.cluster.max_nodes
    # Declared (the Job controller would add it too) so that $(JOB_COMPLETION_INDEX) in args expands.
    index_env = {"name": "JOB_COMPLETION_INDEX",
                 "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
    args = node_launch_args(cfg, overrides, "$(JOB_COMPLETION_INDEX)", store_host)
    container = training_container(cfg, container_name, args, training_env(cfg, [index_env]), command=["orch"])
    on_exit = lambda codes: {"containerName": container_name, "operator": "In", "values": codes}  # noqa: E731
    return {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "backoffLimit": cfg.k8s.backoff_limit,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": on_exit([PREEMPTED_EXIT])},
            DISRUPTED,
            {"action": "FailJob", "onExitCodes": on_exit([USER_ERROR_EXIT])},
        ]},
        # podFailurePolicy needs restartPolicy Never: the Job, not the kubelet, retries
        "template": {"metadata": template_metadata(cfg, COMPONENT), "spec": pod_spec(cfg, [container], "Never")},
    }


def render_job(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """Store NetworkPolicy, Service and Deployment, the training pods' NetworkPolicy, the headless Service, and
    the Indexed Job, in apply order."""
    require_runnable(cfg)
    name, headless = object_name(cfg), f"{object_name(cfg)}-nodes"
    check_names(cfg, [name, headless, store_service(cfg), f"{name}-{cfg.cluster.max_nodes - 1}"])
    spec = node_job_spec(cfg, overrides)
    spec["template"]["spec"]["subdomain"] = headless
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(cfg, name, COMPONENT, workload=True),
           "spec": spec}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(cfg, headless, COMPONENT),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(cfg, COMPONENT)},
    }
    return [*store_objects(cfg), *per_step_objects(cfg), trainer_policy(cfg), service, job]

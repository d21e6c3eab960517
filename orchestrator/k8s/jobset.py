"""``--format jobset``: a JobSet (jobset.x-k8s.io/v1alpha2) of two replicated jobs, so the store lives and dies
with the job:

- ``rdzv``: one pod running ``orch rendezvous-store``; the JobSet's headless Service gives it the stable name
  ``<name>-rdzv-0-0.<name>``, which the nodes dial (no Service of its own to outlive the job);
- ``node``: the Indexed Job of the job format (MAX pods, one orch node each, its podFailurePolicy), started
  once the store is Ready (``dependsOn``).

The JobSet succeeds when ``node`` completes (``successPolicy``), and then deletes the store's Job. Exit 75 and
disruptions are absorbed inside the node Job (the pod is recreated, nothing else restarts); exit 2 fails the
node Job (reason ``PodFailurePolicy``), which a failurePolicy rule turns into failing the JobSet; any other
Job failure restarts the JobSet, at most ``k8s.backoff_limit`` times. The trainjob format reuses this spec as
its runtime's template.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.job import COMPONENT, CONTAINER, DISRUPTED, node_job_spec, require_runnable, trainer_policy
from orchestrator.k8s.names import check_names, object_name
from orchestrator.k8s.pods import metadata, template_metadata
from orchestrator.k8s.quorum import per_step_objects
from orchestrator.k8s.store import COMPONENT as STORE_COMPONENT
from orchestrator.k8s.store import store_pod_template, store_policy

API_VERSION = "jobset.x-k8s.io/v1alpha2"
STORE_JOB, NODE_JOB = "rdzv", "node"


def store_host(name: str) -> str:
    """The store pod's DNS name: JobSet names pods ``<jobset>-<replicated job>-<job index>-<pod index>`` in a
    headless Service named after the JobSet."""
    return f"{name}-{STORE_JOB}-0-0.{name}"


def jobset_spec(cfg: OrchConfig, overrides: Sequence[str], name: str, node_container: str = CONTAINER,
                node_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The JobSet spec (see the module docstring); ``name`` is the JobSet's (TrainJob's) name."""
    k = cfg.k8s
    check_names(cfg, [name, store_host(name).split(".")[0], f"{name}-{NODE_JOB}-0-{cfg.cluster.max_nodes - 1}"])
    store_job = {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "backoffLimit": k.backoff_limit,
                 "podFailurePolicy": {"rules": [DISRUPTED]}, "template": store_pod_template(cfg, "Never")}
    node_meta = template_metadata(cfg, COMPONENT)
    node_meta["labels"].update(node_labels or {})
    return {
        "replicatedJobs": [
            {"name": STORE_JOB, "replicas": 1,
             "template": {"metadata": template_metadata(cfg, STORE_COMPONENT), "spec": store_job}},
            {"name": NODE_JOB, "replicas": 1, "dependsOn": [{"name": STORE_JOB, "status": "Ready"}],
             "template": {"metadata": node_meta,
                          "spec": node_job_spec(cfg, overrides, node_container, store_host(name))}},
        ],
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [NODE_JOB]},
        "failurePolicy": {"maxRestarts": k.backoff_limit, "rules": [
            {"name": "user-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
             "targetReplicatedJobs": [NODE_JOB]}]},
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
    }


def render_jobset(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """The store's and the training pods' NetworkPolicies, and the JobSet."""
    require_runnable(cfg)
    name = object_name(cfg)
    jobset = {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata(cfg, name, COMPONENT, workload=True),
              "spec": jobset_spec(cfg, overrides, name)}
    return [store_policy(cfg), *per_step_objects(cfg), trainer_policy(cfg), jobset]

"""``--format trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1) and the
``ClusterTrainingRuntime`` it refers to, rendered for this run (same name).

The Trainer turns the runtime's JobSet template into a JobSet named after the TrainJob, so the runtime's
template is the jobset format's spec: the store as a replicated job of its own (its lifetime is the job's) and
the ``node`` job, whose container is named ``node`` (the Trainer's torch plugin sets its PET_* variables
there; orch passes torchrun's arguments itself, so they change nothing). The TrainJob carries what Trainer
users expect to set per job: the node count, and the Kueue queue label. Gang scheduling: with
``k8s.scheduler_name=volcano``, the runtime's ``podGroupPolicy.volcano``.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.job import COMPONENT, require_runnable, trainer_policy
from orchestrator.k8s.jobset import NODE_JOB, jobset_spec
from orchestrator.k8s.names import object_name
from orchestrator.k8s.pods import metadata
from orchestrator.k8s.quorum import per_step_objects
from orchestrator.k8s.store import store_policy

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
RUNTIME_KIND = "ClusterTrainingRuntime"
ANCESTOR_LABEL = f"{API_GROUP}/trainjob-ancestor-step"  # marks the replicated job the Trainer sizes and configures


def render_trainjob(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """The store's and the training pods' NetworkPolicies, the ClusterTrainingRuntime (cluster-scoped) and the
    TrainJob."""
    require_runnable(cfg)
    name, nodes = object_name(cfg), cfg.cluster.max_nodes
    runtime_meta = metadata(cfg, name, COMPONENT, namespaced=False)
    runtime_meta["labels"][f"{API_GROUP}/framework"] = "torch"
    runtime: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": RUNTIME_KIND, "metadata": runtime_meta,
        "spec": {"mlPolicy": {"numNodes": nodes, "torch": {}},
                 "template": {"spec": jobset_spec(cfg, overrides, name, node_container=NODE_JOB,
                                                  node_labels={ANCESTOR_LABEL: "trainer"})}},
    }
    if cfg.k8s.scheduler_name == "volcano":
        runtime["spec"]["podGroupPolicy"] = {"volcano": {}}
    trainjob = {
        "apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata(cfg, name, COMPONENT, workload=True),
        "spec": {"runtimeRef": {"apiGroup": API_GROUP, "kind": RUNTIME_KIND, "name": name},
                 "trainer": {"numNodes": nodes}},
    }
    return [store_policy(cfg), *per_step_objects(cfg), trainer_policy(cfg), runtime, trainjob]

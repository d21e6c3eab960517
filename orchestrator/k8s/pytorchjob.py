"""``--format pytorchjob``: a Kubeflow PyTorchJob (kubeflow.org/v1, training-operator) with an elasticPolicy.

The operator creates the worker pods and restarts failed ones; ``elasticPolicy`` carries the job's shape
(minReplicas/maxReplicas from ``cluster.nnodes``, maxRestarts from ``cluster.max_restarts``, c10d rendezvous).
Its rendezvous endpoint is orch's store Service, not worker 0 (the operator's default, which would make
worker 0 the one pod the job cannot lose); each worker runs the same ``orch launch`` for its one node as the
job format does, with the node index from the operator's replica-index label. With ``k8s.scheduler_name``
set (e.g. volcano, with the operator's gang scheduling on), ``runPolicy.schedulingPolicy`` asks for MIN pods
at once.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.job import require_runnable, trainer_policy
from orchestrator.k8s.names import check_names, object_name
from orchestrator.k8s.pods import (metadata, node_launch_args, pod_spec, store_port, store_service,
                                   template_metadata, training_container, training_env)
from orchestrator.k8s.quorum import per_step_objects
from orchestrator.k8s.store import store_objects
from orchestrator.rendezvous.args import rendezvous_conf

COMPONENT = "trainer"
CONTAINER = "pytorch"  # the operator sets its PET_* variables on the container of this name
INDEX_LABEL = "training.kubeflow.org/replica-index"


def render_pytorchjob(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """The store's NetworkPolicy, Service and Deployment, the workers' NetworkPolicy, and the PyTorchJob."""
    c, k = cfg.cluster, cfg.k8s
    require_runnable(cfg)
    check_names(cfg, [object_name(cfg), store_service(cfg), f"{object_name(cfg)}-worker-{c.max_nodes - 1}"])
    index_env = {"name": "ORCH_NODE_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{INDEX_LABEL}']"}}}
    container = training_container(cfg, CONTAINER, node_launch_args(cfg, overrides, "$(ORCH_NODE_INDEX)"),
                                   training_env(cfg, [index_env]), command=["orch"])
    conf = [dict(zip(("key", "value"), item.split("=", 1))) for item in rendezvous_conf(cfg).split(",")]
    run_policy: dict[str, Any] = {"backoffLimit": k.backoff_limit, "cleanPodPolicy": "Running"}
    if k.scheduler_name:
        run_policy["schedulingPolicy"] = {"minAvailable": c.min_nodes,
                                          **({"priorityClass": k.priority_class} if k.priority_class else {})}
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": metadata(cfg, object_name(cfg), COMPONENT, workload=True),
        "spec": {
            "elasticPolicy": {"minReplicas": c.min_nodes, "maxReplicas": c.max_nodes, "maxRestarts": c.max_restarts,
                              "rdzvBackend": "c10d", "rdzvHost": store_service(cfg), "rdzvPort": store_port(cfg),
                              "rdzvId": cfg.run.id, "rdzvConf": conf},
            "nprocPerNode": str(c.nproc_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": c.max_nodes,
                "restartPolicy": "OnFailure",
                "template": {"metadata": template_metadata(cfg, COMPONENT), "spec": pod_spec(cfg, [container], None)},
            }},
        },
    }
    return [*store_objects(cfg), *per_step_objects(cfg), trainer_policy(cfg), job]

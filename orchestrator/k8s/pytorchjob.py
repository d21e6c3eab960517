"""``--format pytorchjob``: a Kubeflow PyTorchJob (kubeflow.org/v1, training-operator) with an elasticPolicy.

The operator creates the worker pods and restarts failed ones; ``elasticPolicy`` carries the job's shape
(minReplicas/maxReplicas from ``cluster.nnodes``, maxRestarts from ``cluster.max_restarts``, c10d rendezvous).
Its rendezvous endpoint is orch's store Service, not worker 0 (the operator's default, which would make
worker 0 the one pod the job cannot lose); each worker runs the same ``orch launch`` for its one node as the
job format does, with the node index from the operator's replica-index label.
"""

from __future__ import annotations

from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.k8s.pods import (labels, metadata, node_launch_args, object_name, pod_spec, require_gpu_resource,
                                   require_shared_checkpoints, store_port, store_service, training_container,
                                   training_env)
from orchestrator.k8s.store import store_objects
from orchestrator.rendezvous.args import rendezvous_conf

COMPONENT = "trainer"
CONTAINER = "pytorch"  # the operator sets its PET_* variables on the container of this name
INDEX_LABEL = "training.kubeflow.org/replica-index"


def render_pytorchjob(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """Store Service + Deployment and the PyTorchJob."""
    c = cfg.cluster
    require_gpu_resource(cfg)
    require_shared_checkpoints(cfg, c.max_nodes, f"cluster.nnodes={c.nnodes}")
    index_env = {"name": "ORCH_NODE_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{INDEX_LABEL}']"}}}
    container = training_container(cfg, CONTAINER, node_launch_args(cfg, overrides, "$(ORCH_NODE_INDEX)"),
                                   training_env(cfg, [index_env]), command=["orch"])
    conf = [dict(zip(("key", "value"), item.split("=", 1))) for item in rendezvous_conf(cfg).split(",")]
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata(cfg, object_name(cfg), COMPONENT),
        "spec": {
            "elasticPolicy": {"minReplicas": c.min_nodes, "maxReplicas": c.max_nodes, "maxRestarts": c.max_restarts,
                              "rdzvBackend": "c10d", "rdzvHost": store_service(cfg), "rdzvPort": store_port(cfg),
                              "rdzvId": object_name(cfg), "rdzvConf": conf},
            "nprocPerNode": str(c.nproc_per_node),
            "runPolicy": {"backoffLimit": cfg.k8s.backoff_limit, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": c.max_nodes,
                "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": labels(cfg, COMPONENT)}, "spec": pod_spec(cfg, [container], None)},
            }},
        },
    }
    return [*store_objects(cfg), job]

"""``--format rayjob``: a KubeRay RayJob (ray.io/v1): a RayCluster sized from the config, and an entrypoint
``orch launch conf=NAME launcher=ray cluster.address=auto ...`` that runs orch's Ray launcher on the head.

The head hosts the controller and the rendezvous store (``num-cpus: 0``, so no node agent lands there, and no
spot placement: losing it ends the job). The worker group has one Ray node per orch node (replicas = MAX,
minReplicas = MIN), spot-placed when configured; the controller places one node agent on each. The Ray
launcher's run dir must be on storage every Ray pod sees: a ReadWriteMany claim mounted at /runs. Ray's
processes write outside /tmp, so its pods keep a writable root filesystem (the other defaults of
security.py apply). No NetworkPolicy: the store lives on the head, which KubeRay's job submitter must reach.
"""

from __future__ import annotations

import shlex
from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError
from orchestrator.k8s.names import check_names, object_name
from orchestrator.k8s.pods import (gpus_per_pod, metadata, passthrough, pod_spec, refuse_run_secret,
                                   require_gpu_resource, require_shared_checkpoints, template_metadata,
                                   training_container, training_env, user_env)

RUNS_MOUNT = "/runs"
RUNS_VOLUME = "runs"
HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
HEAD_PORTS = [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
              {"name": "client", "containerPort": 10001}]


def entrypoint(cfg: OrchConfig, overrides: Sequence[str]) -> str:
    """The command the RayJob runs on the head: the same preset and overrides, through the Ray launcher."""
    own = {"launcher": "ray", "cluster.address": "auto", "run.id": cfg.run.id,
           "run.dir": f"{RUNS_MOUNT}/{object_name(cfg)}"}
    return shlex.join(["orch", "launch", f"conf={cfg.preset}", *passthrough(overrides, own),
                       *(f"{k}={v}" for k, v in own.items())])


def worker_start_params(cpu: str, gpus: int) -> dict[str, str]:
    """``ray start`` resources of a worker pod, stated rather than left to KubeRay's detection."""
    params = {"num-cpus": cpu} if cpu.isdigit() else {}
    return {**params, **({"num-gpus": str(gpus)} if gpus else {})}


def render_rayjob(cfg: OrchConfig, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """The RayJob, with its rayClusterSpec inline."""
    c, k = cfg.cluster, cfg.k8s
    require_gpu_resource(cfg)
    refuse_run_secret(cfg, "rayjob", "orch's Ray launcher hosts the store on the head and gates it with a fresh "
                      "secret per launch")
    # KubeRay names the cluster <rayjob>-<5 chars> and its head Service <cluster>-head-svc.
    check_names(cfg, [object_name(cfg), f"{object_name(cfg)}-xxxxx-head-svc"])
    if not k.run_dir_claim:
        raise ConfigError("k8s.run_dir_claim", k.run_dir_claim, "name a ReadWriteMany PersistentVolumeClaim, e.g. "
                          "k8s.run_dir_claim=orch-runs", "is unset, but the Ray launcher's run dir must be on storage "
                          "every Ray pod sees")
    if cfg.checkpoint.url is not None:  # unset: <run dir>/checkpoints, on the shared claim
        require_shared_checkpoints(cfg, 1 + c.max_nodes, "a Ray head and its workers")
    runs = {"name": RUNS_VOLUME, "persistentVolumeClaim": {"claimName": k.run_dir_claim}}
    mount = [{"name": RUNS_VOLUME, "mountPath": RUNS_MOUNT}]
    head = training_container(cfg, "ray-head", [], user_env(cfg), extra_mounts=mount, res=HEAD_RESOURCES,
                              ports=HEAD_PORTS, read_only_root=False)
    worker = training_container(cfg, "ray-worker", [], training_env(cfg), extra_mounts=mount, read_only_root=False)
    gpus = gpus_per_pod(cfg)
    template = lambda component, spec: {"metadata": template_metadata(cfg, component), "spec": spec}  # noqa: E731
    cluster = {
        "rayVersion": k.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": template("ray-head", pod_spec(cfg, [head], None, spot=False, extra_volumes=[runs])),
        },
        "workerGroupSpecs": [{
            "groupName": "nodes",
            "replicas": c.max_nodes, "minReplicas": c.min_nodes, "maxReplicas": c.max_nodes,
            "rayStartParams": worker_start_params(worker["resources"]["requests"]["cpu"], gpus),
            "template": template("ray-worker", pod_spec(cfg, [worker], None, extra_volumes=[runs])),
        }],
    }
    meta = metadata(cfg, object_name(cfg), "trainer", workload=True)
    if k.scheduler_name:  # KubeRay's batch-scheduler integration (gang scheduling of head and workers)
        meta["labels"]["ray.io/scheduler-name"] = k.scheduler_name
    job = {
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta,
        "spec": {
            "entrypoint": entrypoint(cfg, overrides),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "backoffLimit": k.backoff_limit,
            "rayClusterSpec": cluster,
        },
    }
    return [job]

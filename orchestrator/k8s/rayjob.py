"""``--format rayjob``: a KubeRay RayJob (ray.io/v1): a RayCluster sized from the config, and an entrypoint
``orch launch conf=NAME launcher=ray cluster.address=auto ...`` that runs orch's Ray launcher on the head.

The head hosts the controller and the rendezvous store (``num-cpus: 0``, so no node agent lands there, and no
spot placement: losing it ends the job). The worker group has one Ray node per orch node (replicas = MAX,
minReplicas = MIN), spot-placed when configured; the controller places one node agent on each. The Ray
launcher's run dir must be on storage every Ray pod sees: a ReadWriteMany claim mounted at /runs. Ray's
processes write outside /tmp, so its pods keep a writable root filesystem (the other defaults of
security.py apply).

The dashboard (the Jobs API: whoever reaches it runs code on the cluster) listens on the head pod's IP, not on
every interface, and a NetworkPolicy admits to the Ray pods only the run's own pods (any port: Ray's and
torch's are picked at run time), KubeRay's job submitter (the Job KubeRay names after the RayJob) and the
KubeRay operator (which polls the job's status), those two on the dashboard's port only. The store on the head
is gated by the Ray launcher with a fresh secret per launch.
"""

from __future__ import annotations

import shlex
from typing import Any, Sequence

from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError
from orchestrator.k8s.names import check_names, object_name
from orchestrator.k8s.pods import (POD_IP_ENV, gpus_per_pod, metadata, passthrough, pod_spec, refuse_run_secret,
                                   require_gpu_resource, require_shared_checkpoints, template_metadata,
                                   training_container, training_env, user_env)
from orchestrator.k8s.security import run_network_policy, tcp_ports

RUNS_MOUNT = "/runs"
RUNS_VOLUME = "runs"
HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
DASHBOARD_PORT = 8265
HEAD_PORTS = [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": DASHBOARD_PORT},
              {"name": "client", "containerPort": 10001}]
OPERATOR_PODS = {"app.kubernetes.io/component": "kuberay-operator"}  # the operator's label in Helm and kustomize installs
SUBMITTER_LABEL = "batch.kubernetes.io/job-name"  # set by Kubernetes on a Job's pods; KubeRay's submitter Job = RayJob's name
# KubeRay probes the head's dashboard on localhost when it writes the probes itself; it listens on the pod IP,
# which is where a kubelet's httpGet goes. KubeRay's own timings.
HEAD_READINESS = {"httpGet": {"path": "/api/gcs_healthz", "port": DASHBOARD_PORT}, "initialDelaySeconds": 10,
                  "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 10}
HEAD_LIVENESS = {**HEAD_READINESS, "initialDelaySeconds": 30, "failureThreshold": 120}


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
    """The Ray pods' NetworkPolicy and the RayJob, with its rayClusterSpec inline."""
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
    head = training_container(cfg, "ray-head", [], [POD_IP_ENV, *user_env(cfg)], extra_mounts=mount,
                              res=HEAD_RESOURCES, ports=HEAD_PORTS, read_only_root=False)
    head.update(readinessProbe=HEAD_READINESS, livenessProbe=HEAD_LIVENESS)
    # Ray's workers dial the head's store, gated by the Ray launcher itself: no Secret of the run's secret here.
    worker = training_container(cfg, "ray-worker", [], training_env(cfg, dials_store=False), extra_mounts=mount,
                                read_only_root=False)
    gpus = gpus_per_pod(cfg)
    template = lambda component, spec: {"metadata": template_metadata(cfg, component), "spec": spec}  # noqa: E731
    cluster = {
        "rayVersion": k.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            # the kubelet expands $(POD_IP) in the `ray start` args KubeRay writes from these
            "rayStartParams": {"dashboard-host": "$(POD_IP)", "num-cpus": "0"},
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
    return [ray_policy(cfg), job]


def ray_policy(cfg: OrchConfig) -> dict[str, Any]:
    """Ingress to the head and workers from the run's own pods (any port), and to the dashboard's port from
    KubeRay's submitter and operator (see the module docstring)."""
    namespace = cfg.k8s.ray_operator_namespace
    operator = {"podSelector": {"matchLabels": OPERATOR_PODS},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}} if namespace else {}}
    submitter = {"podSelector": {"matchLabels": {SUBMITTER_LABEL: object_name(cfg)}}}
    rule = {"from": [submitter, operator], "ports": tcp_ports(DASHBOARD_PORT)}
    pods = {"app.kubernetes.io/instance": object_name(cfg)}
    return run_network_policy(cfg, pods, metadata(cfg, object_name(cfg), "ray"), (rule,))

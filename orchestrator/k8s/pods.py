"""Pod pieces every format shares: labels, the training container, resources, /dev/shm, user volumes and
secrets, placement and scheduling, and the checks that refuse a config no cluster could run well.

Everything here is a pure function of the composed config: no cluster, no network, no clock, so the rendered
manifests are byte-for-byte reproducible.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from orchestrator.checkpoint.storage import url_scheme
from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError, Preempted, UserError
from orchestrator.k8s.names import object_name
from orchestrator.k8s.security import (HOME, WORKDIR, container_security_context, pod_security_context,
                                       scratch_mounts, scratch_volumes)
from orchestrator.trust.secret import RUN_SECRET_ENV

DEFAULT_STORE_PORT = 29400  # torchrun's customary c10d port
POD_LOCAL_SCHEMES = ("file", "local", "memory")
SHM_VOLUME = "dshm"
PREEMPTED_EXIT = Preempted.exit_code  # 75: orch saved an emergency checkpoint and left; run it again
USER_ERROR_EXIT = UserError.exit_code  # 2: a bad config or image fails the same way on every retry
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUN_SECRET_KEY = "secret"  # k8s.run_secret=NAME: the key of `kubectl create secret generic NAME --from-literal=secret=...`
RUN_SECRET_SUFFIX = "-run-secret"  # k8s.run_secret=null: the Secret <job name>-run-secret
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}  # $(POD_IP) in args


def store_service(cfg: OrchConfig) -> str:
    """The Service (and Deployment) name of the job's rendezvous store; also its DNS name in the namespace."""
    return f"{object_name(cfg)}-rdzv"


def store_port(cfg: OrchConfig) -> int:
    return cfg.rendezvous.port or DEFAULT_STORE_PORT


def quorum_service(cfg: OrchConfig) -> str:
    """per_step: the Service (and Deployment) name of the job's quorum service; also its DNS name."""
    return f"{object_name(cfg)}-quorum"


def quorum_endpoint(cfg: OrchConfig) -> str:
    """per_step: what every node pod dials for the quorum (``fault_tolerance.quorum_endpoint``)."""
    return f"{quorum_service(cfg)}:{cfg.k8s.quorum_port}"


def labels(cfg: OrchConfig, component: str) -> dict[str, str]:
    """Labels naming the run: every object and pod of one render carries the same instance label, and
    ``k8s.labels`` (orch's own keys win: selectors and the NetworkPolicy depend on them)."""
    return {**{str(k): k8s_str(v) for k, v in cfg.k8s.labels.items()},
            "app.kubernetes.io/name": "orch", "app.kubernetes.io/instance": object_name(cfg),
            "app.kubernetes.io/component": component, "orch/preset": cfg.preset}


def annotations(cfg: OrchConfig) -> dict[str, str]:
    return {str(k): k8s_str(v) for k, v in cfg.k8s.annotations.items()}


def template_metadata(cfg: OrchConfig, component: str) -> dict[str, Any]:
    """Metadata of a pod template: the run's labels, and ``k8s.annotations`` when there are any."""
    meta: dict[str, Any] = {"labels": labels(cfg, component)}
    if cfg.k8s.annotations:
        meta["annotations"] = annotations(cfg)
    return meta


def selector(cfg: OrchConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": object_name(cfg), "app.kubernetes.io/component": component}


def metadata(cfg: OrchConfig, name: str, component: str, workload: bool = False,
             namespaced: bool = True) -> dict[str, Any]:
    """Object metadata. The ``workload`` (the object a queue admits: Job, JobSet, TrainJob, ...) carries the
    Kueue queue label."""
    meta: dict[str, Any] = {"name": name, **template_metadata(cfg, component)}
    if workload and cfg.k8s.queue:
        meta["labels"][QUEUE_LABEL] = cfg.k8s.queue
    if cfg.k8s.namespace and namespaced:
        meta["namespace"] = cfg.k8s.namespace
    return meta


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def passthrough(overrides: Iterable[str], set_here: Iterable[str]) -> list[str]:
    """The user's overrides as the pods must see them: ``k8s.*`` shapes only the manifests, and the keys the
    format sets itself (``set_here``) are left out so that each appears once."""
    own = set(set_here)
    return [o for o in overrides if override_key(o) not in own and override_key(o).split(".")[0] != "k8s"]


def node_launch_args(cfg: OrchConfig, overrides: Iterable[str], node_index: str,
                     store_host: Optional[str] = None) -> list[str]:
    """``orch launch`` for the one node of a pod: the local launcher, dialing the job's store (never hosting
    one) and, under per_step, the job's quorum service, under the run id every pod shares. ``node_index`` is the
    pod's index, e.g. ``$(JOB_COMPLETION_INDEX)``; ``store_host`` the store's DNS name when it is not the store
    Service's."""
    own = {"launcher": "local", "cluster.node_index": node_index, "rendezvous.external": "true",
           "rendezvous.host": store_host or store_service(cfg), "rendezvous.port": str(store_port(cfg)),
           **({"fault_tolerance.quorum_endpoint": quorum_endpoint(cfg)}
              if cfg.fault_tolerance.mode == "per_step" else {}),
           "run.id": cfg.run.id}
    return ["launch", f"conf={cfg.preset}", *passthrough(overrides, own), *(f"{k}={v}" for k, v in own.items())]


def termination_grace_s(cfg: OrchConfig) -> int:
    """The preemption grace orch plans its emergency checkpoint for, plus time for orch to collect the exits."""
    return math.ceil(cfg.preemption.grace_period_s) + cfg.k8s.termination_grace_margin_s


def gpus_per_pod(cfg: OrchConfig) -> int:
    return cfg.cluster.nproc_per_node if cfg.cluster.device == "cuda" else 0


def k8s_str(value: Any) -> str:
    """YAML/Hydra give ``true`` as a bool; Kubernetes label values and env values are strings."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def resources(cfg: OrchConfig) -> dict[str, Any]:
    """Requests and limits of a training pod: memory limited at its request (no surprise OOM kills of a
    neighbour), CPU unlimited (no throttling of the data loaders), GPUs as the extended resource."""
    k, c = cfg.k8s, cfg.cluster
    per_process = 16 if c.device == "cuda" else 4
    cpu = k.cpu or str(c.nproc_per_node * (1 + cfg.data.num_workers))
    memory = k.memory or f"{c.nproc_per_node * per_process}Gi"
    result: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    gpus = gpus_per_pod(cfg)
    if gpus:
        result["requests"][k.gpu_resource_name] = str(gpus)
        result["limits"][k.gpu_resource_name] = str(gpus)
    return result


def training_env(cfg: OrchConfig, extra: Optional[list[dict[str, Any]]] = None,
                 dials_store: bool = True) -> list[dict[str, Any]]:
    """Environment of a training container. torchrun publishes the pod IP (``PET_LOCAL_ADDR``, its
    ``--local-addr``) as the address other pods dial for rank 0, so no pod needs a resolvable hostname. With
    ``dials_store`` (its agents dial ``orch rendezvous-store``), the run's secret, for the gated store."""
    return [
        *(extra or []),
        POD_IP_ENV,
        {"name": "PET_LOCAL_ADDR", "value": "$(POD_IP)"},
        *user_env(cfg),
        *(run_secret_env(cfg) if dials_store else []),
    ]


def run_secret_ref(cfg: OrchConfig) -> str:
    """The Secret reference (``NAME`` or ``NAME/KEY``) that gates the run's store: ``k8s.run_secret``, or for
    ``null`` one named after the job, so that no render is ungated unless ``k8s.run_secret=''`` says so."""
    if cfg.k8s.run_secret is None:
        return object_name(cfg) + RUN_SECRET_SUFFIX
    return cfg.k8s.run_secret


def create_secret_command(cfg: OrchConfig) -> str:
    """The ``kubectl`` command that creates the run's Secret with a fresh random value (never in a manifest);
    empty when the store is ungated."""
    ref = run_secret_ref(cfg)
    if not ref:
        return ""
    name, _, key = ref.partition("/")
    namespace = f" -n {cfg.k8s.namespace}" if cfg.k8s.namespace else ""
    return (f'kubectl create secret generic {name}{namespace} --from-literal={key or RUN_SECRET_KEY}='
            f'"$(openssl rand -hex 32)"')


def run_secret_env(cfg: OrchConfig) -> list[dict[str, Any]]:
    """The run's secret as ``ORCH_RUN_SECRET`` from its Secret (``run_secret_ref``; key ``secret`` unless named):
    the store pod gates the store with it and each node's agents answer the gate. A reference only, so the
    secret is in no manifest. Empty when ``k8s.run_secret=''``."""
    ref = run_secret_ref(cfg)
    return [secret_env(RUN_SECRET_ENV, ref, RUN_SECRET_KEY)] if ref else []


def refuse_run_secret(cfg: OrchConfig, fmt: str, why: str) -> None:
    """For a format whose pods never dial ``orch rendezvous-store``: a named ``k8s.run_secret`` would gate
    nothing (``null``, the default, and ``''`` ask for nothing there)."""
    if cfg.k8s.run_secret:
        raise ConfigError("k8s.run_secret", cfg.k8s.run_secret,
                          "drop k8s.run_secret, or render --format job, jobset, trainjob or pytorchjob (orch's own store)",
                          f"has no store to gate in --format {fmt}: {why}")


def user_env(cfg: OrchConfig) -> list[dict[str, Any]]:
    """What every container running orch gets: a writable HOME, ``k8s.env`` as values, and ``k8s.secrets`` as
    references to Secrets (the cluster fills them in; their values never appear in the manifest)."""
    env: list[dict[str, Any]] = [{"name": "HOME", "value": HOME}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    env += [{"name": str(name), "value": k8s_str(value)} for name, value in sorted(cfg.k8s.env.items())]
    env += [secret_env(str(name), str(ref), str(name)) for name, ref in sorted(cfg.k8s.secrets.items())]
    return env


def secret_env(name: str, ref: str, default_key: str) -> dict[str, Any]:
    """The variable ``name`` from a Secret reference, ``SECRET`` (key ``default_key``) or ``SECRET/KEY``."""
    secret, _, key = ref.partition("/")
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key or default_key}}}


def training_container(cfg: OrchConfig, name: str, args: list[str], env: list[dict[str, Any]],
                       command: Optional[list[str]] = None, extra_mounts: Optional[list[dict]] = None,
                       res: Optional[dict[str, Any]] = None, ports: Optional[list[dict]] = None,
                       read_only_root: bool = True) -> dict[str, Any]:
    """A container running orch: the image, env, resources, /dev/shm, scratch space, the user's volumes and
    the security defaults (security.py)."""
    container: dict[str, Any] = {
        "name": name, "image": cfg.k8s.image, "imagePullPolicy": cfg.k8s.image_pull_policy,
        "env": env, "resources": res if res is not None else resources(cfg),
        "securityContext": container_security_context(read_only_root),
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, *scratch_mounts(), *user_mounts(cfg),
                         *(extra_mounts or [])],
        "workingDir": WORKDIR,
    }
    if command is not None:
        container["command"] = command
    if args:
        container["args"] = args
    if cfg.k8s.checkpoint_secret:
        container["envFrom"] = [{"secretRef": {"name": cfg.k8s.checkpoint_secret}}]
    if ports:
        container["ports"] = ports
    return container


def shm_volume(cfg: OrchConfig) -> dict[str, Any]:
    """/dev/shm backed by memory: DataLoader workers and NCCL need more than the container runtime's 64 MB."""
    size = cfg.k8s.shm_size or f"{cfg.cluster.nproc_per_node}Gi"
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def pod_spec(cfg: OrchConfig, containers: list[dict[str, Any]], restart_policy: Optional[str],
             spot: bool = True, extra_volumes: Optional[list[dict]] = None) -> dict[str, Any]:
    """A pod spec for training containers: the grace period, /dev/shm, the user's volumes, and (``spot``) the
    spot placement, on top of what every pod gets (``base_pod_spec``)."""
    k = cfg.k8s
    spec = base_pod_spec(cfg, containers, restart_policy, spot=spot)
    spec["terminationGracePeriodSeconds"] = termination_grace_s(cfg)
    spec["volumes"] = [shm_volume(cfg), *spec["volumes"], *user_volumes(cfg), *(extra_volumes or [])]
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    return spec


def base_pod_spec(cfg: OrchConfig, containers: list[dict[str, Any]], restart_policy: Optional[str],
                  spot: bool = False) -> dict[str, Any]:
    """What every pod of a run gets, the store's included: the security defaults and scratch volumes, and the
    scheduling and placement keys (``spot``: the spot pool's too, for training pods only)."""
    k = cfg.k8s
    spec: dict[str, Any] = {
        "containers": containers,
        "enableServiceLinks": False,  # no <SERVICE>_PORT variables: Services named orch-* would add ORCH_* ones
        # orch never calls the Kubernetes API: a token for it would only be something for an intruder to use
        "automountServiceAccountToken": k.automount_service_account_token,
        "securityContext": pod_security_context(),
        "volumes": scratch_volumes(),
    }
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    node_selector = {**k.node_selector, **(k.spot_node_selector if spot else {})}
    if node_selector:
        spec["nodeSelector"] = {str(key): k8s_str(v) for key, v in node_selector.items()}
    tolerations = [_toleration("k8s.tolerations", t) for t in k.tolerations]
    tolerations += [_toleration("k8s.spot_tolerations", t) for t in (k.spot_tolerations if spot else [])]
    if tolerations:
        spec["tolerations"] = tolerations
    if k.priority_class:
        spec["priorityClassName"] = k.priority_class
    if k.scheduler_name:
        spec["schedulerName"] = k.scheduler_name
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": str(name)} for name in k.image_pull_secrets]
    return spec


def _toleration(key: str, t: Any) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise ConfigError(key, t, "give each toleration as {key: ..., operator: Equal|Exists, "
                          "value: ..., effect: NoSchedule}", "holds an item that is not a mapping")
    return {str(name): v if name == "tolerationSeconds" else k8s_str(v) for name, v in t.items()}


def user_volumes(cfg: OrchConfig) -> list[dict[str, Any]]:
    """``k8s.volumes``: a PersistentVolumeClaim, or an emptyDir when no claim is named."""
    volumes = []
    for v in cfg.k8s.volumes:
        if v.get("claim"):
            source = {"persistentVolumeClaim": {"claimName": v["claim"], **({"readOnly": True} if v.get("read_only") else {})}}
        else:
            source = {"emptyDir": {"sizeLimit": str(v["size"])} if v.get("size") else {}}
        volumes.append({"name": v["name"], **source})
    return volumes


def user_mounts(cfg: OrchConfig) -> list[dict[str, Any]]:
    return [{"name": v["name"], "mountPath": v["mount_path"], **({"readOnly": True} if v.get("read_only") else {})}
            for v in cfg.k8s.volumes]


def require_gpu_resource(cfg: OrchConfig) -> None:
    """A cuda preset rendered without a GPU resource name would be scheduled on nodes without GPUs."""
    gpus = gpus_per_pod(cfg)
    if gpus and not cfg.k8s.gpu_resource_name:
        raise ConfigError("k8s.gpu_resource_name", cfg.k8s.gpu_resource_name,
                          "set k8s.gpu_resource_name=nvidia.com/gpu (or your cluster's GPU resource, e.g. amd.com/gpu), "
                          "or render a CPU preset (cluster.device=cpu)",
                          f"is unset, but preset {cfg.preset!r} needs {gpus} GPU(s) per pod (cluster.device=cuda)")


def is_pod_local(url: Optional[str], cfg: Optional[OrchConfig] = None) -> bool:
    """Whether checkpoints at ``url`` stay on one pod's disk (unset means ``<run dir>/checkpoints``); a path on
    a claim of ``k8s.volumes`` is shared (the claim must be ReadWriteMany for several pods)."""
    if url is None or url_scheme(url) not in POD_LOCAL_SCHEMES:
        return url is None
    path = url.split("://", 1)[-1] if "://" in url else url
    claims = [v["mount_path"].rstrip("/") for v in (cfg.k8s.volumes if cfg else []) if v.get("claim") and not v.get("read_only")]
    return not any(path == m or path.startswith(m + "/") for m in claims)


def require_shared_checkpoints(cfg: OrchConfig, pods: int, why: str) -> None:
    """Pods of one job must all reach the checkpoints: a replaced pod resumes from them."""
    url = cfg.checkpoint.url
    if pods > 1 and is_pod_local(url, cfg):
        fix = (f"put checkpoints on storage every pod reaches, e.g. checkpoint.url=s3://BUCKET/orch/{cfg.preset} "
               f"(credentials from the Secret named by k8s.checkpoint_secret), or on a ReadWriteMany claim of "
               f"k8s.volumes (checkpoint.url=<its mount_path>/...)")
        if url is None:  # no value to quote: say what the default is
            raise UserError(f"checkpoint.url is not set, so checkpoints would go to each pod's own run dir, which "
                            f"the {pods} pods of this job ({why}) do not share: a pod that replaces a preempted one "
                            f"would not find them. Fix: {fix}")
        raise ConfigError("checkpoint.url", url, fix, f"is on local disk, which the {pods} pods of this job "
                                                      f"({why}) do not share: a pod that replaces a preempted one "
                                                      "would not find them")

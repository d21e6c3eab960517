"""Typed configuration: one small dataclass per Hydra group, validated in ``__post_init__``.

Hydra composes YAML from ``conf/`` onto these schemas (registered in the ConfigStore by ``store.py``);
``compose.py`` converts the result with ``OmegaConf.to_object`` so that every ``__post_init__`` below runs
exactly once, where the config is composed. Checks that span groups live in ``validate.py``.

``model``, ``data.dataset``, ``optim`` and ``scheduler`` are ``_target_``-instantiable nodes (see
``hydra.utils.instantiate``): built-in options are in ``conf/<group>/``, and any importable class works.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from orchestrator.config import k8s_checks
from orchestrator.config.k8s_checks import DNS_LABEL, LABEL_VALUE, QUANTITY
from orchestrator.config.values import check_endpoint, check_host, check_ray_address, check_run_id, check_url_host
from orchestrator.errors import ConfigError

BACKENDS = ("nccl", "gloo")
DEVICES = ("cpu", "cuda")
AMP_DTYPES = ("bf16", "fp16")
LAUNCHERS = ("local", "ray")
PLACEMENTS = ("auto", "spread", "pack")
RESUME_MODES = ("auto", "never")
CHECKPOINT_FORMATS = ("torch", "safetensors")
CHECKPOINT_ENGINES = ("auto", "rank0", "dcp")
MAX_NODES = 1024  # beyond any job orch is meant for; also keeps per-world-size checks finite


def _require(key: str, value: Any, ok: bool, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(key, value, fix, problem)


def _one_of(key: str, value: Any, choices: tuple) -> None:
    _require(key, value, value in choices, f"use one of {', '.join(choices)}", "is not a known choice")


@dataclass
class BackendConfig:
    """The torch.distributed process-group backend."""

    name: str = "gloo"
    """``nccl`` (CUDA GPUs) or ``gloo`` (CPU, or GPUs without NCCL)."""
    timeout_s: float = 1800.0
    """Process-group timeout: how long a collective may wait for a peer before failing."""

    def __post_init__(self) -> None:
        _one_of("backend.name", self.name, BACKENDS)
        _require("backend.timeout_s", self.timeout_s, 0 < self.timeout_s < math.inf,
                 "use a positive, finite number of seconds (e.g. 600)")


@dataclass
class DDPConfig:
    """Flags passed verbatim to ``torch.nn.parallel.DistributedDataParallel``."""

    static_graph: bool = False
    """The set of used parameters never changes between steps (lets DDP skip per-step graph analysis)."""
    find_unused_parameters: bool = False
    """Search the autograd graph for parameters that got no gradient (needed for models with unused branches)."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the all-reduce buckets: saves one copy of the gradients in memory."""
    bucket_cap_mb: float = 25.0
    """Size of each gradient all-reduce bucket."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (e.g. BatchNorm statistics) from rank 0 at every forward."""

    def __post_init__(self) -> None:
        _require("ddp.bucket_cap_mb", self.bucket_cap_mb, self.bucket_cap_mb > 0, "use a positive size in MB")


@dataclass
class AMPConfig:
    """Automatic mixed precision."""

    enabled: bool = False
    """Run forward and loss under ``torch.autocast``."""
    dtype: str = "bf16"
    """``bf16`` (CPU and CUDA) or ``fp16`` (with a GradScaler against underflow)."""

    def __post_init__(self) -> None:
        _one_of("amp.dtype", self.dtype, AMP_DTYPES)


PARALLELISMS = ("ddp", "fsdp2", "hsdp")
SHARDED_STRATEGIES = ("fsdp2", "hsdp")
PARALLELISM_ENTRY_POINTS = "orch.parallelism"  # strategies of one's own: name -> factory (orchestrator/parallel/)


@dataclass
class ParallelismConfig:
    """How the model is spread over the ranks (orchestrator/parallel/, docs/sharded.md): every rank holds the
    whole model (``ddp``), or each holds a shard of parameters, gradients and optimizer state (``fsdp2``:
    ``fully_shard`` over all ranks; ``hsdp``: sharded within a node, replicated across nodes)."""

    strategy: str = "ddp"
    """``ddp`` (the ``ddp`` group's flags apply), ``fsdp2``, ``hsdp``, or the name of an installed
    ``orch.parallelism`` entry point."""
    reshard_after_forward: bool = True
    """fsdp2/hsdp: free each unit's gathered parameters after its forward and gather them again for the backward
    (less memory, one more all-gather per unit); ``false`` keeps them until the backward."""
    shard_modules: list = field(default_factory=list)
    """fsdp2/hsdp: class names of the modules that are each one unit of sharding (their parameters are gathered
    together, one unit at a time); empty: each transformer block of the built-in models."""
    activation_checkpointing: bool = False
    """fsdp2/hsdp: recompute each unit's activations in the backward instead of keeping them (less memory,
    about one more forward of compute)."""

    def __post_init__(self) -> None:
        if self.strategy not in PARALLELISMS:
            from importlib.metadata import entry_points

            plugins = tuple(ep.name for ep in entry_points(group=PARALLELISM_ENTRY_POINTS))
            _one_of("parallelism.strategy", self.strategy, PARALLELISMS + plugins)
        self.shard_modules = [str(name) for name in self.shard_modules]
        for name in self.shard_modules:
            _require("parallelism.shard_modules", name, name.isidentifier(),
                     "give module class names, e.g. parallelism.shard_modules=[TransformerEncoderLayer]")

    @property
    def sharded(self) -> bool:
        """Whether each rank holds only a shard of the model's state (fsdp2, hsdp)."""
        return self.strategy in SHARDED_STRATEGIES


@dataclass
class CheckpointConfig:
    """Checkpoints through fsspec: any URL fsspec understands (path, file://, s3://, gs://, memory://)."""

    url: Optional[str] = None
    """Where checkpoints go; ``null`` means ``<run.dir>/checkpoints``."""
    every_n_steps: Any = 0
    """Save every N optimizer steps; 0 saves only at the end of the run. ``auto``: orch sets the interval from
    the measured save stall, step time and rate of interruptions that lose work (Young/Daly; each change is a
    ``checkpoint_interval`` event; see docs/simulate.md)."""
    auto_prior_mtbf_s: float = 14400.0
    """``every_n_steps=auto``: the mean seconds between interruptions that lose work, assumed for a new run."""
    auto_prior_weight: float = 0.25
    """``every_n_steps=auto``: how many observed interruptions the prior counts as; the run's own rate takes
    over once it has seen a few."""
    keep_last: int = 3
    """How many checkpoints to keep; older ones are deleted after a newer one is committed."""
    async_save: bool = True
    """Write in the background after copying state to CPU memory (``false``: the loop waits for the write)."""
    resume: str = "auto"
    """``auto`` (newest valid checkpoint, if any), ``never``, or a step number."""
    format: str = "torch"
    """Payload files: ``torch`` (``torch.save``, read with ``weights_only=True``) or ``safetensors`` (every
    tensor in safetensors files, the rest as JSON: read back with no unpickling at all). Loading reads either."""
    engine: str = "auto"
    """Who writes: ``rank0`` (rank 0 writes the whole state, one file per payload, in ``format``), ``dcp`` (every
    rank writes its own shards of the model and optimizer through torch DCP, in parallel; the rest as safetensors +
    JSON; resumes at any world size and strategy), or ``auto``: ``dcp`` when ``parallelism.strategy`` is sharded
    (fsdp2, hsdp), else ``rank0``. See docs/checkpointing.md."""

    def __post_init__(self) -> None:
        if str(self.every_n_steps).isdigit():
            self.every_n_steps = int(self.every_n_steps)
        _require("checkpoint.every_n_steps", self.every_n_steps,
                 self.every_n_steps == "auto" or (isinstance(self.every_n_steps, int) and self.every_n_steps >= 0),
                 "use 0 or more, or auto")
        _require("checkpoint.auto_prior_mtbf_s", self.auto_prior_mtbf_s, self.auto_prior_mtbf_s > 0,
                 "use a positive number of seconds")
        _require("checkpoint.auto_prior_weight", self.auto_prior_weight, self.auto_prior_weight > 0,
                 "use a positive weight")
        _require("checkpoint.keep_last", self.keep_last, self.keep_last >= 1, "keep at least 1 checkpoint")
        _one_of("checkpoint.format", self.format, CHECKPOINT_FORMATS)
        _one_of("checkpoint.engine", self.engine, CHECKPOINT_ENGINES)
        self.resume = str(self.resume)
        _require(
            "checkpoint.resume", self.resume, self.resume in RESUME_MODES or self.resume.isdigit(),
            "use auto, never, or a step number",
        )


def checkpoint_engine(checkpoint: CheckpointConfig, parallelism: Any = None) -> str:
    """The engine ``checkpoint.engine`` resolves to: ``auto`` is ``dcp`` for a sharded strategy, else ``rank0``."""
    if checkpoint.engine != "auto":
        return checkpoint.engine
    return "dcp" if getattr(parallelism, "sharded", False) else "rank0"


@dataclass
class ClusterConfig:
    """The shape of the job: how many nodes, how many processes on each, on which device."""

    nnodes: str = "1"
    """``N`` for a fixed size, or ``MIN:MAX`` for an elastic job that survives losing nodes down to MIN."""
    nproc_per_node: int = 1
    """Worker processes per node (one per GPU on CUDA)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    max_restarts: int = 3
    """How many times torchrun may restart a node's workers after a failure or a membership change."""
    address: Optional[str] = None
    """Ray cluster to join (``auto``, ``HOST:PORT`` or ``ray://...``), or a Ray dashboard (``http://HOST:8265``)
    to submit the launch to as a Ray job; ``null`` starts an embedded local Ray."""
    dashboard: bool = False
    """Embedded Ray: start its dashboard too; its address is printed and recorded (``launch_started.dashboard``)."""
    cpus_per_node: float = 1.0
    """Ray launcher: CPUs each node agent reserves on its Ray node (placement only; workers are not pinned)."""
    gpus_per_node: Optional[int] = None
    """Ray launcher: GPUs each node agent reserves; ``null`` means nproc_per_node on cuda, 0 on cpu."""
    placement: str = "auto"
    """Ray launcher: ``spread`` (at most one node agent per Ray node), ``pack`` (agents may share a Ray node),
    or ``auto``: pack on the embedded single-node Ray, spread on a joined cluster."""
    testcluster: Optional[str] = None
    """Run on the test cluster of this name (``orch testcluster up --name NAME``): each simulated node's agent
    runs inside its own network namespace, with its own address and hostname (with launcher=ray, on a Ray node
    orch starts inside it). ``null``: this host's network."""
    node_index: Optional[int] = None
    """Local launcher: run only this node (0..MAX-1) of the job here, as each pod of a Kubernetes job does with
    ``$(JOB_COMPLETION_INDEX)``; ``null`` runs all MAX nodes on this machine."""

    def __post_init__(self) -> None:
        self.nnodes = str(self.nnodes)
        fix = "use N or MIN:MAX with 1 <= MIN <= MAX, e.g. cluster.nnodes=2 or cluster.nnodes=1:3"
        parts = self.nnodes.split(":")
        _require("cluster.nnodes", self.nnodes, len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts), fix)
        _require("cluster.nnodes", self.nnodes, self.min_nodes >= 1, fix, "needs at least 1 node")
        _require("cluster.nnodes", self.nnodes, self.min_nodes <= self.max_nodes, fix, "has MIN greater than MAX")
        _require("cluster.nnodes", self.nnodes, self.max_nodes <= MAX_NODES, f"use at most {MAX_NODES} nodes",
                 f"has more than {MAX_NODES} nodes")
        _require("cluster.nproc_per_node", self.nproc_per_node, self.nproc_per_node >= 1,
                 "use 1 or more processes per node")
        _one_of("cluster.device", self.device, DEVICES)
        _require("cluster.max_restarts", self.max_restarts, self.max_restarts >= 0, "use 0 or more")
        _require("cluster.cpus_per_node", self.cpus_per_node, self.cpus_per_node >= 0, "use 0 or more CPUs")
        if self.gpus_per_node is not None:
            _require("cluster.gpus_per_node", self.gpus_per_node, self.gpus_per_node >= 0, "use 0 or more GPUs, or null")
        _one_of("cluster.placement", self.placement, PLACEMENTS)
        check_ray_address(self.address)
        if self.testcluster is not None:
            _require("cluster.testcluster", self.testcluster, bool(re.fullmatch(r"[a-z][a-z0-9-]{0,23}", self.testcluster)),
                     "use the NAME given to `orch testcluster up --name NAME` (a-z, 0-9, '-'), or null")
        if self.node_index is not None:
            _require("cluster.node_index", self.node_index, 0 <= self.node_index < self.max_nodes,
                     f"use 0..{self.max_nodes - 1} (the job has cluster.nnodes={self.nnodes}), or null to run every node")

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def gpus_per_agent(self) -> int:
        """GPUs a node agent reserves: ``gpus_per_node``, else one per process on cuda."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return self.nproc_per_node if self.device == "cuda" else 0


@dataclass
class RendezvousConfig:
    """c10d rendezvous timeouts (whole seconds, as torchrun's ``--rdzv-conf`` takes them). The defaults are
    tuned for recovery in seconds, where torchrun's own take ~44 s to notice a lost node and resume."""

    join_timeout_s: int = 120
    """How long an agent waits for the rendezvous to reach MIN nodes before giving up."""
    last_call_timeout_s: int = 1
    """After MIN nodes joined, how long to wait for more before closing the round."""
    keep_alive_interval_s: int = 1
    """How often each agent proves it is alive to the store."""
    keep_alive_max_attempt: int = 3
    """Missed keep-alives after which a node is declared dead (detection takes interval x attempts). At least
    3: torch's c10d handler sends its first keep-alive one interval after a round completes, so with 2 a node
    that waited through the last call is already "dead" then, drops out of the rendezvous unnoticed, and the
    next node to join forms a second job of its own."""
    host: str = "127.0.0.1"
    """Address the rendezvous store listens on and agents connect to."""
    port: int = 0
    """Store port; 0 picks a free port at launch."""
    external: bool = False
    """Dial a store hosted elsewhere (``orch rendezvous-store`` behind a Kubernetes Service) at host:port instead
    of hosting one in this launcher; needs a port."""

    def __post_init__(self) -> None:
        for key in ("join_timeout_s", "last_call_timeout_s", "keep_alive_interval_s"):
            value = getattr(self, key)
            _require(f"rendezvous.{key}", value, value > 0, "use a positive number of seconds")
        _require("rendezvous.keep_alive_max_attempt", self.keep_alive_max_attempt, self.keep_alive_max_attempt >= 3,
                 "use 3 or more (with fewer, a node drops out of the rendezvous after a shrink)", "is too low")
        check_host("rendezvous.host", self.host, "use an IP address or host name, e.g. rendezvous.host=127.0.0.1 "
                   "(with rendezvous.external=true: the address of the store to dial)")
        _require("rendezvous.port", self.port, 0 <= self.port < 65536, "use 0 (auto) or a TCP port")
        _require("rendezvous.port", self.port, self.port > 0 or not self.external,
                 "give the external store's port (rendezvous.external=true dials host:port)", "cannot be 0 (auto)")


@dataclass
class DataConfig:
    """The dataset (``_target_``-instantiable) and the DataLoader settings users tune."""

    dataset: Any = MISSING
    """An instantiable node: ``_target_`` plus keyword arguments (see conf/data/)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 loads in the training process)."""
    pin_memory: bool = False
    """Page-locked host memory for faster host-to-GPU copies (CUDA only)."""
    persistent_workers: bool = False
    """Keep DataLoader workers alive between epochs (needs num_workers > 0)."""
    prefetch_factor: Optional[int] = None
    """Batches each DataLoader worker loads ahead (needs num_workers > 0)."""
    drop_last: bool = True
    """Drop the last incomplete global batch of an epoch, so every step sees a full global batch."""

    def __post_init__(self) -> None:
        _require("data.num_workers", self.num_workers, self.num_workers >= 0, "use 0 or more")
        if self.num_workers == 0:
            _require("data.persistent_workers", self.persistent_workers, not self.persistent_workers,
                     "set data.num_workers > 0 or data.persistent_workers=false")
            _require("data.prefetch_factor", self.prefetch_factor, self.prefetch_factor is None,
                     "set data.num_workers > 0 or data.prefetch_factor=null")


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 100
    """Optimizer steps to train for."""
    global_batch_size: int = 8
    """Samples per optimizer step across all ranks; kept constant when the world size changes."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank; accumulation steps = global / (micro x world)."""
    grad_clip_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value; ``null`` disables clipping."""
    seed: int = 0
    """Seeds model init, data order and every RNG, so runs are reproducible bit for bit on CPU."""
    log_every: int = 1
    """Write a metrics.jsonl line every N steps."""
    compile: bool = False
    """Compile the DDP-wrapped model with ``torch.compile`` (DDP first, as torch documents: graphs split at
    DDP's bucket boundaries so communication overlaps the backward pass)."""
    compile_mode: Optional[str] = None
    """``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``)."""
    detect_anomaly: bool = False
    """``torch.autograd.set_detect_anomaly`` (slow; for debugging NaNs)."""
    record_sample_ids: bool = False
    """Each rank logs the sample ids of every step to ``<run.dir>/samples/rank<R>.jsonl`` (data audits)."""

    def __post_init__(self) -> None:
        for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_every"):
            value = getattr(self, key)
            _require(f"trainer.{key}", value, value >= 1, "use 1 or more")
        if self.grad_clip_norm is not None:
            _require("trainer.grad_clip_norm", self.grad_clip_norm, self.grad_clip_norm > 0, "use a positive norm or null")


@dataclass
class EntrypointConfig:
    """What each worker runs. Neither script nor module: orch's built-in trainer."""

    script: Optional[str] = None
    """A torchrun-compatible Python script (gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)."""
    module: Optional[str] = None
    """A torchrun-compatible module, run like ``python -m``."""
    args: list = field(default_factory=list)
    """Arguments passed to the script or module."""

    def __post_init__(self) -> None:
        for key, value in (("entrypoint.script", self.script), ("entrypoint.module", self.module)):
            _require(key, value, value is None or bool(str(value).strip()),
                     f"give a {key.split('.')[1]}, or drop {key} (null) to run the built-in trainer", "is empty")
        _require("entrypoint.module", self.module, not (self.script and self.module),
                 "set only one of entrypoint.script and entrypoint.module")

    @property
    def builtin(self) -> bool:
        return not (self.script or self.module)


@dataclass
class RunConfig:
    """Where a run writes everything it did."""

    dir: Optional[str] = None
    """The run dir; ``null`` means ``runs/<preset>/<timestamp>-<4 hex>/`` under the current directory."""
    id: Optional[str] = None
    """The run id, which is also torchrun's rendezvous id; ``null``: ``<preset>-<timestamp>-<hex>`` (the preset's
    name in lower case with '-' for other characters: ``cpu-elastic-...``). Every pod of one Kubernetes job sets
    the same id, so that their nodes meet in one rendezvous. It names files and Kubernetes objects, so it is a
    DNS-1123 label: at most 63 of a-z, 0-9 and '-', alphanumeric at both ends."""
    lease_timeout_s: float = 60.0
    """The launcher holds a lease on the run dir and on ``checkpoint.url``, renewed every quarter of this: another
    launch there is refused while it is live, and takes it over once not renewed for this long (at once when its
    holder on this host is gone). See docs/checkpointing.md#fencing."""

    def __post_init__(self) -> None:
        _require("run.lease_timeout_s", self.lease_timeout_s, 1 <= self.lease_timeout_s < math.inf,
                 "use a finite number of seconds >= 1 (e.g. 60)")
        check_run_id(self.id)


PREEMPTION_SOURCES = ("sigterm", "aws", "gcp", "azure", "chaos")


@dataclass
class PreemptionScheduleConfig:
    """Drills: deliver a preemption notice to a node on a fixed period (benchmarks, fire drills)."""

    every_s: Optional[float] = None
    """Seconds between scheduled preemptions; ``null`` disables the schedule."""
    node: Optional[int] = None
    """The node to preempt; ``null`` picks a random live node each time."""
    grace_s: float = 30.0
    """Seconds between the notice and the hard kill of the node, if it is still alive."""
    max_count: Optional[int] = None
    """Stop after this many scheduled preemptions; ``null``: no limit."""

    def __post_init__(self) -> None:
        if self.every_s is not None:
            _require("preemption.schedule.every_s", self.every_s, self.every_s > 0, "use a positive period or null")
        _require("preemption.schedule.grace_s", self.grace_s, self.grace_s >= 0, "use 0 or more seconds")


@dataclass
class HangConfig:
    """Hang and straggler detection (docs/fault-tolerance.md#hangs-and-stragglers). Every worker of a script on
    orchestrator.elastic (the built-in trainer included) writes a heartbeat with its step each
    ``heartbeat_interval_s``; the controller reads them. A rank whose heartbeat is older than
    ``max(step_time_factor x median step time, floor_s)`` is hung (stopped, or stuck holding the interpreter):
    its Python stack is dumped (faulthandler) into the ``hang_detected`` event and its node is ended, so the
    others recover as from a lost node, instead of waiting ``backend.timeout_s`` in a collective."""

    enabled: bool = True
    """Watch heartbeats at all."""
    heartbeat_interval_s: float = 1.0
    """How often each worker writes its heartbeat."""
    step_time_factor: float = 10.0
    """A heartbeat older than this many median step times is a hang (if also older than ``floor_s``)."""
    floor_s: float = 6.0
    """Never call a hang sooner than this: a loaded machine delays a heartbeat thread by seconds."""
    straggler_factor: float = 2.0
    """A rank whose busy time per step (its step minus time waiting in communication) is this many times its
    peers' median, at three checks in a row, is reported as a ``straggler`` with the ratio; 0 turns it off."""
    evict_stragglers: bool = False
    """End a straggler's node (the others go on without it, as from a lost node)."""

    def __post_init__(self) -> None:
        for key in ("heartbeat_interval_s", "step_time_factor", "floor_s"):
            value = getattr(self, key)
            _require(f"hang.{key}", value, 0 < value < float("inf"), "use a positive number")
        _require("hang.straggler_factor", self.straggler_factor,
                 self.straggler_factor == 0 or 1 < self.straggler_factor < float("inf"),
                 "use a factor above 1, or 0 to turn straggler reports off")
        _require("hang.floor_s", self.floor_s, self.floor_s >= 2 * self.heartbeat_interval_s,
                 "use at least twice hang.heartbeat_interval_s", "is shorter than two heartbeats")


@dataclass
class PreemptionConfig:
    """Spot/preemption notices: where they come from, and the grace period the save must fit in."""

    sources: list = field(default_factory=lambda: ["sigterm", "chaos"])
    """Notice sources, several at once: sigterm (Kubernetes, generic), aws (EC2 spot instance-action via
    IMDSv2), gcp (metadata instance/preempted), azure (Scheduled Events Preempt), chaos (`orch chaos preempt`)."""
    grace_period_s: float = 30.0
    """Expected time from notice to hard kill (Kubernetes terminationGracePeriodSeconds, ~30 s on GCP, ~120 s
    on AWS). A save that looks longer than what is left is still attempted, with a warning event."""
    poll_interval_s: float = 1.0
    """How often the cloud metadata sources are polled."""
    aws_endpoint: str = "http://169.254.169.254"
    """EC2 instance metadata service (IMDSv2)."""
    gcp_endpoint: str = "http://metadata.google.internal"
    """GCE metadata server."""
    azure_endpoint: str = "http://169.254.169.254"
    """Azure instance metadata service (Scheduled Events)."""
    replace_nodes: bool = True
    """Replace a preempted node at once, without waiting for the survivors to recover (spot capacity coming
    back); where a machine has a free slot, boot the replacement as a standby as soon as the notice comes."""
    schedule: PreemptionScheduleConfig = field(default_factory=PreemptionScheduleConfig)

    def __post_init__(self) -> None:
        for source in self.sources:
            _one_of("preemption.sources", source, PREEMPTION_SOURCES)
        _require("preemption.grace_period_s", self.grace_period_s, 0 < self.grace_period_s < math.inf,
                 "use a positive, finite number of seconds (e.g. 30)")
        _require("preemption.poll_interval_s", self.poll_interval_s, self.poll_interval_s > 0, "use a positive number")
        for key in ("aws_endpoint", "gcp_endpoint", "azure_endpoint"):
            check_url_host(f"preemption.{key}", getattr(self, key), ("http", "https"),
                           f"use http://HOST[:PORT], e.g. the default {self.__dataclass_fields__[key].default}")


PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass
class K8sConfig:
    """Kubernetes objects rendered by ``orch k8s render`` (``orch launch`` ignores this group)."""

    image: str = "orch:latest"
    """Container image with orch installed (deploy/k8s/Dockerfile builds one)."""
    image_pull_policy: str = "IfNotPresent"
    """``Always``, ``IfNotPresent`` or ``Never``."""
    name: Optional[str] = None
    """Prefix of the rendered objects' names, ``<name>-<run id>``; ``null``: ``orch``. The run id is ``run.id``, or a
    fresh ``<preset>-<6 hex>`` per render, so two renders of one preset never collide."""
    namespace: Optional[str] = None
    """``metadata.namespace`` of every object; ``null``: the namespace they are applied to."""
    service_account: Optional[str] = None
    """Service account of the training pods (e.g. one bound to a cloud IAM role for the checkpoint bucket)."""
    cpu: Optional[str] = None
    """CPU request of a training pod; ``null``: one CPU per worker process and per DataLoader worker."""
    memory: Optional[str] = None
    """Memory request and limit of a training pod; ``null``: 4Gi per worker process on cpu, 16Gi on cuda."""
    shm_size: Optional[str] = None
    """Size of the memory-backed /dev/shm (it counts against the memory limit); ``null``: 1Gi per worker process."""
    gpu_resource_name: Optional[str] = "nvidia.com/gpu"
    """Extended resource a cuda pod requests, nproc_per_node of them (``amd.com/gpu``, ...)."""
    checkpoint_secret: Optional[str] = "orch-checkpoint-credentials"
    """Secret whose keys become environment variables of every training pod (``envFrom``), e.g.
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; ``null``: none (e.g. workload identity)."""
    env: dict = field(default_factory=dict)
    """Extra environment variables of the training pods (``{NAME: value}``)."""
    spot_node_selector: dict = field(default_factory=dict)
    """Node labels the training pods require, e.g. ``{cloud.google.com/gke-spot: "true"}``; the rendezvous store
    never gets them (keep it off spot nodes)."""
    spot_tolerations: list = field(default_factory=list)
    """Tolerations of the training pods, for the taint of a spot node pool (``{key, operator, value, effect}``)."""
    backoff_limit: int = 3
    """Pod failures the job retries before it fails (job: backoffLimit, pytorchjob: runPolicy.backoffLimit,
    rayjob: backoffLimit). A pod that exits 75 (preempted, after its emergency checkpoint) or is disrupted never
    counts in the job format."""
    termination_grace_margin_s: int = 15
    """Added to preemption.grace_period_s for ``terminationGracePeriodSeconds``: time for orch itself to collect
    its nodes' exits after their emergency checkpoint."""
    ray_version: str = "2.40.0"
    """rayjob: ``rayClusterSpec.rayVersion`` (the Ray in the image)."""
    run_dir_claim: Optional[str] = "orch-runs"
    """rayjob: a ReadWriteMany PersistentVolumeClaim mounted at /runs on every Ray pod: the Ray launcher's run
    dir must be on storage every node sees."""
    queue: Optional[str] = None
    """Kueue LocalQueue: the ``kueue.x-k8s.io/queue-name`` label of the job object (Kueue admits it all at once)."""
    scheduler_name: Optional[str] = None
    """``schedulerName`` of every pod, e.g. ``volcano``; gang scheduling where the format has it (pytorchjob:
    schedulingPolicy.minAvailable, trainjob: podGroupPolicy.volcano, rayjob: the ``ray.io/scheduler-name`` label)."""
    priority_class: Optional[str] = None
    """``priorityClassName`` of every pod (Kueue takes the workload's priority from it)."""
    labels: dict = field(default_factory=dict)
    """Extra labels of every object and pod (orch's own ``app.kubernetes.io/*`` and ``orch/*`` labels win)."""
    annotations: dict = field(default_factory=dict)
    """Extra annotations of every object and pod."""
    node_selector: dict = field(default_factory=dict)
    """Node labels every pod requires, the store's included (``k8s.spot_node_selector`` adds to the training pods')."""
    tolerations: list = field(default_factory=list)
    """Tolerations of every pod, the store's included (``k8s.spot_tolerations`` adds to the training pods')."""
    image_pull_secrets: list = field(default_factory=list)
    """Secrets (names) of type docker-registry for a private image, on every pod."""
    volumes: list = field(default_factory=list)
    """Volumes of the training pods: ``{name, mount_path, claim}`` mounts a PersistentVolumeClaim, no ``claim`` an
    emptyDir (``size``: its sizeLimit); ``read_only`` optional. A claim can hold checkpoints
    (``checkpoint.url=<mount_path>/...``) when every pod mounts it (ReadWriteMany)."""
    secrets: dict = field(default_factory=dict)
    """Environment variables from Secret references, ``{NAME: SECRET}`` (key NAME) or ``{NAME: SECRET/KEY}``; the
    value never appears in the manifest. ``orch k8s render`` refuses ``k8s.env`` values that look like credentials."""
    run_secret: Optional[str] = None
    """The Secret holding the run's secret, ``NAME`` (key ``secret``) or ``NAME/KEY``: the store pod, per_step's
    quorum service pod and every node pod get it as ``ORCH_RUN_SECRET`` (a reference, never the value), so the
    store admits only clients that prove it, as under ``orch launch``. ``null`` (the default):
    ``<job name>-run-secret``, key ``secret``, which you create before applying (the manifest's header says how).
    ``''``: ungated, only the NetworkPolicy guards the store (said as a warning on every render; refused under
    per_step). Formats whose pods dial ``orch rendezvous-store`` only: rayjob refuses a name (the Ray launcher
    gates its own store per launch)."""
    quorum_port: int = 29401
    """``fault_tolerance.mode=per_step``: the port of the quorum service (``orch quorum-service``, torchft's
    Lighthouse rules behind the run's gate), its Service's and its container's."""
    automount_service_account_token: bool = False
    """``automountServiceAccountToken`` of every pod: orch's pods never call the Kubernetes API, so none gets a
    token to it unless this is ``true`` (for code of yours that does; IRSA, GKE and Azure workload identity do not
    need it)."""
    ray_operator_namespace: Optional[str] = None
    """rayjob: the namespace of the KubeRay operator, which polls the Ray dashboard for the job's status (its
    NetworkPolicy admits the operator's pods, ``app.kubernetes.io/component: kuberay-operator``, from this
    namespace only); ``null``: from any namespace."""

    def __post_init__(self) -> None:
        _require("k8s.image", self.image, bool(self.image), "give the image with orch installed, e.g. k8s.image=orch:latest")
        _one_of("k8s.image_pull_policy", self.image_pull_policy, PULL_POLICIES)
        if self.name is not None:
            _require("k8s.name", self.name, len(self.name) <= 40 and re.fullmatch(DNS_LABEL, self.name) is not None
                     and self.name[0].isalpha(), "use at most 40 lower-case letters, digits and '-', starting with a "
                     "letter and ending alphanumeric")
        for key in ("cpu", "memory", "shm_size"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, str(value))
                _require(f"k8s.{key}", value, re.fullmatch(QUANTITY, str(value)) is not None,
                         "use a Kubernetes quantity, e.g. 4, 500m, 16Gi, or null for the default")
        _require("k8s.backoff_limit", self.backoff_limit, self.backoff_limit >= 0, "use 0 or more")
        _require("k8s.termination_grace_margin_s", self.termination_grace_margin_s,
                 self.termination_grace_margin_s >= 0, "use 0 or more seconds")
        _require("k8s.backoff_limit", self.backoff_limit, self.backoff_limit < 2**31, "use at most 2147483647 "
                 "(Kubernetes' limit, an int32)", "is out of range")
        for key in ("queue", "scheduler_name", "priority_class", "namespace", "service_account", "checkpoint_secret",
                    "run_dir_claim", "ray_operator_namespace"):
            if getattr(self, key) is not None:
                k8s_checks.check_dns_name(f"k8s.{key}", getattr(self, key))
        for i, secret in enumerate(self.image_pull_secrets):
            k8s_checks.check_dns_name(f"k8s.image_pull_secrets[{i}]", secret)
        k8s_checks.check_labels("k8s.labels", self.labels)
        k8s_checks.check_labels("k8s.annotations", self.annotations, values_are_labels=False)
        k8s_checks.check_labels("k8s.node_selector", self.node_selector)
        k8s_checks.check_secrets(self.secrets)
        k8s_checks.check_volumes(self.volumes)
        k8s_checks.check_run_secret(self.run_secret)
        _require("k8s.quorum_port", self.quorum_port, 0 < self.quorum_port < 65536, "use a TCP port, e.g. 29401")
        if self.gpu_resource_name is not None:
            k8s_checks.check_resource_name("k8s.gpu_resource_name", self.gpu_resource_name)


@dataclass
class FailureConfig:
    """How the Ray controller spends its budgets: user-code failures and lost nodes are counted apart, so a
    deterministic bug stops the run while spot preemptions never use up the failure budget."""

    max_failures: int = 1
    """Node agent failures (user code or torchrun giving up, after torchrun's own cluster.max_restarts) that the
    controller answers by restarting every node; one more fails the run, naming the root-cause rank."""
    max_preemptions: int = -1
    """Lost or preempted nodes the run survives (the rest re-rendezvous without them); -1: no limit."""
    wait_for_nodes_s: float = 60.0
    """How long the run may sit below MIN nodes (at start or after losses) before it fails. Keep it under
    rendezvous.join_timeout_s, after which the surviving agents give up on their own."""

    def __post_init__(self) -> None:
        _require("failure.max_failures", self.max_failures, self.max_failures >= 0, "use 0 or more")
        _require("failure.max_preemptions", self.max_preemptions, self.max_preemptions >= -1,
                 "use -1 (no limit) or 0 or more")
        _require("failure.wait_for_nodes_s", self.wait_for_nodes_s, self.wait_for_nodes_s > 0,
                 "use a positive number of seconds")


FT_MODES = ("restart", "per_step")


@dataclass
class FaultToleranceConfig:
    """How the job survives a lost node (docs/fault-tolerance.md#choosing-a-mode).

    ``restart``: every membership change restarts every node's workers (torchrun's elastic restart) and they
    resume from the latest checkpoint. ``per_step`` (torchft, ``pip install 'orch[ft]'``): each node is a
    replica group of its own; a torchft Lighthouse in the driver forms a quorum of the live groups at every
    step, a step commits only if every participant finished it, survivors never restart, and a new or
    returning node copies the live state from a peer."""

    mode: str = "restart"
    """``restart`` (the default) or ``per_step``."""
    heartbeat_timeout_ms: int = 1000
    """per_step: a replica group that misses heartbeats this long drops out of the quorum."""
    join_timeout_ms: int = 1000
    """per_step: how long the Lighthouse waits for more replica groups before forming a quorum with fewer
    than every known one (a returning node joins the quorum after at most this long)."""
    quorum_tick_ms: int = 50
    """per_step: how often the Lighthouse re-evaluates the quorum."""
    collective_timeout_s: float = 3.0
    """per_step: a cross-replica all-reduce that takes longer fails the step (it is redone by the new quorum)
    instead of waiting ``backend.timeout_s``."""
    quorum_timeout_s: float = 60.0
    """per_step: how long a replica group waits for a quorum (fewer than ``cluster`` MIN live groups)."""
    quorum_endpoint: Optional[str] = None
    """per_step: ``HOST:PORT`` of an ``orch quorum-service`` to dial (a Kubernetes job's Lighthouse Service,
    which ``orch k8s render`` sets in every node pod's arguments) instead of the launch hosting the quorum service
    behind its own gate; ``null``: the launch hosts it. A pod of a multi-pod job (``cluster.node_index``) needs
    one."""

    def __post_init__(self) -> None:
        _one_of("fault_tolerance.mode", self.mode, FT_MODES)
        for key in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            value = getattr(self, key)
            _require(f"fault_tolerance.{key}", value, value > 0, "use a positive number of milliseconds")
        for key in ("collective_timeout_s", "quorum_timeout_s"):
            value = getattr(self, key)
            _require(f"fault_tolerance.{key}", value, 0 < value < float("inf"), "use a positive number of seconds")
        if self.quorum_endpoint is not None:
            check_endpoint("fault_tolerance.quorum_endpoint", self.quorum_endpoint,
                           "use HOST:PORT of the job's orch quorum-service, e.g. orch-exp1-quorum:29401, or null "
                           "(the launch hosts the quorum service)")


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TensorBoardConfig:
    """``logger=tensorboard``: TensorBoard event files (``pip install 'orch[tensorboard]'``)."""

    log_dir: Optional[str] = None
    """Where the event files go; ``null`` means ``<run.dir>/tensorboard`` (``tensorboard --logdir`` it)."""


@dataclass
class MLflowConfig:
    """``logger=mlflow``: one MLflow run per orch run (``pip install 'orch[mlflow]'``)."""

    tracking_uri: Optional[str] = None
    """MLflow tracking URI (``http://host:5000``, ``file:///path/mlruns``, ...); ``null`` means a file store in
    ``<run.dir>/mlruns`` (``mlflow ui --backend-store-uri <run.dir>/mlruns`` shows it)."""
    experiment: str = "orch"
    """Experiment the run is filed under; created if missing."""

    def __post_init__(self) -> None:
        _require("logger.mlflow.experiment", self.experiment, bool(self.experiment), "give an experiment name")


@dataclass
class WandbConfig:
    """``logger=wandb``: a Weights & Biases run (``pip install 'orch[wandb]'``)."""

    project: str = "orch"
    """W&B project of the run."""
    mode: str = "offline"
    """``offline`` (write locally; upload later with ``wandb sync``), ``online`` (needs ``WANDB_API_KEY`` or
    ``wandb login``), or ``disabled``."""
    dir: Optional[str] = None
    """Directory wandb writes its ``wandb/`` folder into; ``null`` means the run dir (``<run.dir>/wandb``)."""

    def __post_init__(self) -> None:
        _require("logger.wandb.project", self.project, bool(self.project), "give a project name")
        _one_of("logger.wandb.mode", self.mode, WANDB_MODES)


@dataclass
class LoggerConfig:
    """Experiment trackers fed by rank 0 (``logger=tensorboard``, ``logger=[tensorboard,mlflow]``, ...). A
    tracker is on when its key is set; ``logger=none`` (the default) leaves all three ``null``."""

    tensorboard: Optional[TensorBoardConfig] = None
    """TensorBoard settings; ``null``: off."""
    mlflow: Optional[MLflowConfig] = None
    """MLflow settings; ``null``: off."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases settings; ``null``: off."""

    @property
    def enabled(self) -> list:
        """Names of the trackers that are on, e.g. ``["tensorboard", "mlflow"]``."""
        return [name for name in ("tensorboard", "mlflow", "wandb") if getattr(self, name) is not None]


@dataclass
class OrchConfig:
    """The whole configuration of one launch, as composed from a preset and overrides."""

    preset: str = MISSING
    """The preset's name (set by the preset YAML)."""
    launcher: str = "local"
    """``local`` (simulated nodes on this machine, or inside a pod) or ``ray``."""
    backend: BackendConfig = field(default_factory=BackendConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    amp: AMPConfig = field(default_factory=AMPConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """How the model is spread over the ranks (the ``parallelism`` group: ddp, fsdp2, hsdp)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    model: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    optim: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    entrypoint: EntrypointConfig = field(default_factory=EntrypointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment trackers (the ``logger`` group: none, tensorboard, mlflow, wandb, or a list of them)."""

    def __post_init__(self) -> None:
        # The preset's name is a directory of runs/, the start of generated run ids and a Kubernetes label value.
        _require("preset", self.preset, isinstance(self.preset, str) and re.fullmatch(LABEL_VALUE, self.preset) is not None
                 and 0 < len(self.preset) <= 63, "name the preset with at most 63 letters, digits, '-', '_' and '.', "
                 "starting and ending with a letter or digit (it names the directory runs/<preset>/)")
        _one_of("launcher", self.launcher, LAUNCHERS)
        _require("cluster.testcluster", self.cluster.testcluster,
                 not (self.cluster.testcluster and self.launcher == "ray" and self.cluster.address),
                 "drop cluster.address: on a test cluster orch starts its own Ray head on the cluster's bridge",
                 "cannot join another Ray cluster")

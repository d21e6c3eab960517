"""Checks that span config groups, run once after the per-group ``__post_init__`` checks."""

from __future__ import annotations

import importlib
from typing import Any

from orchestrator.config.checked_targets import remembered
from orchestrator.config.schema import OrchConfig
from orchestrator.config.target_args import (EXECUTION_FLAGS, check_target_args, construct_optimizer, constructs,
                                             facts_valid, target_facts)
from orchestrator.config.values import check_numbers
from orchestrator.errors import ConfigError

# What a per_step replica group may be: every group alike, so rank i of one heals from rank i of another.
PER_STEP_STRATEGIES = ("ddp", "hsdp")
# Arguments the runtime supplies itself when instantiating; they must not be required in config.
RUNTIME_ARGS = {"optim": ("params",), "scheduler": ("optimizer",), "data.dataset": (), "model": ()}


def validate_config(cfg: OrchConfig) -> None:
    """Raise ConfigError for the first cross-group inconsistency in ``cfg``, or number out of bounds."""
    check_numbers(cfg)
    if cfg.backend.name == "nccl" and cfg.cluster.device != "cuda":
        raise ConfigError("backend.name", "nccl", "use backend=gloo for cluster.device=cpu, or cluster.device=cuda",
                          f"needs CUDA devices but cluster.device is {cfg.cluster.device!r}")
    if cfg.entrypoint.builtin:  # only the built-in trainer reads trainer.*; a user script has its own batches
        _check_batch_divides(cfg)
    for key, supplied in RUNTIME_ARGS.items():
        node = cfg.data.dataset if key == "data.dataset" else getattr(cfg, key)
        check_instantiable(key, node, supplied)
    _check_loggers(cfg)
    _check_memory_checkpoint_url(cfg)
    _check_checkpoint_engine(cfg)
    _check_parallelism(cfg)
    _check_per_step(cfg)


def _check_memory_checkpoint_url(cfg: OrchConfig) -> None:
    """memory:// is per process: with more than one rank each would save and resume from its own copy."""
    url, c = cfg.checkpoint.url, cfg.cluster
    ranks = c.max_nodes * c.nproc_per_node
    if isinstance(url, str) and url.startswith("memory://") and ranks > 1:
        raise ConfigError(
            "checkpoint.url", url,
            "use a path on a shared filesystem or an object store URL (e.g. s3://my-bucket/ckpt), or run one "
            "process (cluster.nnodes=1 cluster.nproc_per_node=1)",
            f"is an in-process memory filesystem, but the job runs up to {ranks} processes "
            f"(cluster.nnodes={c.nnodes} x cluster.nproc_per_node={c.nproc_per_node}), each with its own copy",
        )


def _check_checkpoint_engine(cfg: OrchConfig) -> None:
    """rank0 writes what rank 0 holds: under a sharded strategy that is a shard, not the model."""
    if cfg.checkpoint.engine == "rank0" and cfg.parallelism.sharded:
        raise ConfigError("checkpoint.engine", "rank0", "use checkpoint.engine=dcp (or auto)",
                          f"writes rank 0's state alone, but parallelism.strategy={cfg.parallelism.strategy} shards "
                          "it over the ranks")


def _check_parallelism(cfg: OrchConfig) -> None:
    """DDP's graph flags mean nothing to a sharded strategy, which has no DDP: refused rather than ignored."""
    p = cfg.parallelism
    if not p.sharded:
        return
    for key in ("static_graph", "find_unused_parameters"):
        if getattr(cfg.ddp, key):
            raise ConfigError(f"ddp.{key}", True, f"set ddp.{key}=false with parallelism.strategy={p.strategy} (or "
                              "use parallelism.strategy=ddp)", f"is a DistributedDataParallel flag, but "
                              f"parallelism.strategy={p.strategy} shards the model with fully_shard, not DDP")


def _check_per_step(cfg: OrchConfig) -> None:
    """fault_tolerance.mode=per_step needs torchft, a quorum service (the launch's, or the job's
    ``orch quorum-service`` in a pod), and data drawn step by step."""
    if cfg.fault_tolerance.mode != "per_step":
        return
    from orchestrator.config.extras import torchft_problem

    problem = torchft_problem()
    if problem:
        raise ConfigError("fault_tolerance.mode", "per_step", "pip install 'orch[ft]' (torchft-nightly, see "
                          "pyproject.toml), or use fault_tolerance.mode=restart", problem)
    pod = cfg.cluster.node_index is not None or cfg.rendezvous.external
    if pod and not cfg.fault_tolerance.quorum_endpoint:
        raise ConfigError("fault_tolerance.quorum_endpoint", None, "set fault_tolerance.quorum_endpoint=HOST:PORT of "
                          "the job's orch quorum-service (orch k8s render does), or use fault_tolerance.mode=restart",
                          "is unset, but under fault_tolerance.mode=per_step a pod of a multi-pod job "
                          "(cluster.node_index, rendezvous.external) hosts no quorum service of its own")
    if cfg.entrypoint.builtin and cfg.data.num_workers > 0:
        raise ConfigError("data.num_workers", cfg.data.num_workers, "use data.num_workers=0 with "
                          "fault_tolerance.mode=per_step",
                          "prefetches batches before the step's quorum says how many replica groups share it")
    # Each node is a replica group of its own world; rank i heals from rank i of a live group, so a group's
    # layout must be one that every group has alike: whole (ddp) or sharded over its own ranks (hsdp).
    strategy = cfg.parallelism.strategy
    if strategy not in PER_STEP_STRATEGIES:
        raise ConfigError("parallelism.strategy", strategy, "use parallelism.strategy=hsdp (sharded within each "
                          "node, replicated across the quorum's groups) or ddp with fault_tolerance.mode=per_step",
                          "shards over every node's ranks, but under per_step each node is a replica group of its "
                          "own that heals shard by shard from the same rank of a live group"
                          if strategy == "fsdp2" else "lays out the state in a way per_step cannot heal shard by "
                          "shard (it heals ddp and hsdp replica groups)")


def _check_loggers(cfg: OrchConfig) -> None:
    """Every selected tracker's package is installed (``logger=mlflow`` needs ``pip install 'orch[mlflow]'``)."""
    from orchestrator.tracking.api import PACKAGES, missing_package_error, package_installed

    for name in cfg.logger.enabled:
        if not package_installed(PACKAGES[name]):
            raise missing_package_error(name)


def _check_batch_divides(cfg: OrchConfig) -> None:
    """global = micro x world x accumulation must hold at every world size the elastic range allows."""
    t, c = cfg.trainer, cfg.cluster
    for nodes in range(c.min_nodes, c.max_nodes + 1):
        world = nodes * c.nproc_per_node
        if t.global_batch_size % (t.micro_batch_size * world):
            raise ConfigError(
                "trainer.global_batch_size", t.global_batch_size,
                f"use a multiple of micro_batch_size x world = {t.micro_batch_size} x {world} at {nodes} node(s) "
                f"({_batch_example(cfg)}), or change trainer.micro_batch_size",
                f"is not divisible by micro_batch_size x world size ({t.micro_batch_size} x {world})",
            )


def _batch_example(cfg: OrchConfig) -> str:
    lcm = _lcm_batch(cfg)
    # A wide elastic range has an astronomically large common multiple: no use as an example.
    return f"e.g. {lcm}" if lcm < 10**9 else "or narrow the cluster.nnodes MIN:MAX range"


def _lcm_batch(cfg: OrchConfig) -> int:
    from math import lcm

    c = cfg.cluster
    return lcm(*(cfg.trainer.micro_batch_size * n * c.nproc_per_node for n in range(c.min_nodes, c.max_nodes + 1)))


def check_instantiable(key: str, node: Any, supplied: tuple = ()) -> None:
    """``node`` has an importable ``_target_`` whose signature accepts its keys (plus ``supplied`` ones). The
    target is imported only when what it takes is not known already (checked_targets)."""
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError(key, node, f"give {key} a _target_ (see conf/{key.split('.')[0]}/ for built-ins)",
                          "is not instantiable")
    target = str(node["_target_"])
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    facts = remembered(["facts", target], target, lambda: target_facts(_import_target(key, target)), facts_valid)
    check_target_args(key, target, facts, kwargs, supplied)
    if constructs(key, target):
        clean = {k: v for k, v in kwargs.items() if k not in EXECUTION_FLAGS}
        remembered(["constructs", target, clean], target,
                   lambda: construct_optimizer(target, _import_target(key, target), clean) or True)


def _import_target(key: str, target: str) -> Any:
    try:
        return locate(target)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key}._target_", target, "give an importable dotted path (module.Class)",
                          f"cannot be imported ({type(exc).__name__})") from None


def locate(path: str) -> Any:
    """Import ``a.b.C`` (the longest importable module prefix, then attributes), like Hydra's ``_target_``."""
    parts = str(path).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {path!r}")

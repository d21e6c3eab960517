"""``parallelism.strategy=fsdp2`` and ``hsdp``: torch's FSDP2 (``fully_shard``) on a device mesh. Each rank
holds a shard of every parameter, its gradient and its optimizer state (DTensors); a unit's parameters are
all-gathered just before its forward and backward and freed after, and gradients are reduce-scattered.

``fsdp2`` shards over every rank (a 1-D mesh). ``hsdp`` shards within a node and replicates across nodes (a
2-D mesh ``(replicate, shard)`` = (nodes, processes per node)): the all-gathers stay on a node's fast links,
only the gradient all-reduce crosses nodes.

The order is torchtitan's: activation checkpointing wraps each unit, then ``torch.compile`` compiles each
unit, then ``fully_shard`` shards each unit and last the root (whose own parameters, the embeddings and the
head, form one more unit).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.config.schema import ParallelismConfig
from orchestrator.errors import ConfigError
from orchestrator.parallel.base import GradientHandoff, Strategy
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.precision import DTYPES

# Shard units when parallelism.shard_modules is empty: torch's transformer layers (the built-in models' blocks).
# A Hugging Face model names its own blocks in ``_no_split_modules`` (e.g. ["BertLayer"]).
DEFAULT_UNITS = ("TransformerEncoderLayer", "TransformerDecoderLayer")


class FSDP2Strategy(Strategy):
    """``fully_shard`` each unit, then the root, over all ranks; options from the ``parallelism`` group and
    mixed precision from ``amp`` (bf16 or fp16 parameters in forward and backward, fp32 gradient reduction)."""

    name = "fsdp2"
    sharded = True

    @property
    def options(self) -> ParallelismConfig:
        return self.cfg.parallelism if self.cfg is not None else ParallelismConfig(strategy=self.name)

    def mesh(self, ctx: DistContext, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module, ctx: DistContext, device: torch.device, *, timer: Any = None,
             handoff: Optional[GradientHandoff] = None) -> nn.Module:
        _need_group(self.name)
        broadcast_from_rank0(model)  # fully_shard keeps each rank's slice as it is: start from rank 0's values
        return _hand_over(self._shard(model, ctx, device), handoff)

    def build(self, factory: Callable[[], nn.Module], ctx: DistContext, device: torch.device, *,
              timer: Any = None, handoff: Optional[GradientHandoff] = None) -> nn.Module:
        """Built whole on rank 0 only, as torch documents for FSDP2: rank 0 runs ``factory()`` on the CPU (its
        seeded initialization, so the weights are DDP's), every other rank under ``torch.device("meta")`` (no
        storage); all shard, the others allocate only their shards (``to_empty``), and rank 0's full state dict
        reaches every rank's shards (``set_model_state_dict(broadcast_from_rank0=True)``); buffers, non-persistent
        ones too, are broadcast. The meta build draws no random numbers, so the ranks' torch RNG continues from
        rank 0's, as it would after every rank had built the model from the same seed."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        _need_group(self.name)
        main = dist.get_rank() == 0
        if main:
            model = factory()
        else:
            with torch.device("meta"):
                model = factory()
        full = model.state_dict() if main else {}  # keeps rank 0's whole tensors alive until they are sent
        _broadcast_rng_state(device)
        model = self._shard(model, ctx, device)
        if not main:
            model.to_empty(device=device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        broadcast_buffers(model)
        return _hand_over(model, handoff)

    def _shard(self, model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        o = self.options
        units = shard_units(model, o.shard_modules)
        units = [_wrap_unit(model, name, unit, o.activation_checkpointing) for name, unit in units]
        if self.cfg is not None and self.cfg.trainer.compile:
            for unit in units:
                unit.compile(mode=self.cfg.trainer.compile_mode)  # in place: the state dict keeps its keys
        mesh = self.mesh(ctx, device)
        kwargs = {"mesh": mesh, "reshard_after_forward": o.reshard_after_forward, "mp_policy": self._mp_policy()}
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        amp = self.cfg.amp if self.cfg is not None else None
        if amp is None or not amp.enabled:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=DTYPES[amp.dtype], reduce_dtype=torch.float32)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return _gradient_sync_off(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm over every rank's shards (each shard's norm is a partial sum: ``full_tensor``
        reduces it), then each local shard scaled by the same factor."""
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def grad_scaler(self, enabled: bool, device: torch.device) -> torch.amp.GradScaler:
        """fp16: ``ShardedGradScaler``, whose inf/NaN check is agreed over all ranks (each sees only its
        shards of the gradients)."""
        if not enabled:
            return super().grad_scaler(enabled, device)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard works in place: the module is its own state-dict module


class HSDPStrategy(FSDP2Strategy):
    """FSDP2 on a 2-D mesh: replicate across nodes, shard within a node (``LOCAL_WORLD_SIZE`` ranks)."""

    name = "hsdp"

    def mesh(self, ctx: DistContext, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, hsdp_shape(dist.get_world_size(), ctx.local_world_size),
                                mesh_dim_names=("replicate", "shard"))


def hsdp_shape(world: int, nproc_per_node: int) -> tuple[int, int]:
    """(replicas, shards): one replica per node, each node's processes sharing one copy of the state."""
    if nproc_per_node < 1 or world % nproc_per_node:
        raise ConfigError("parallelism.strategy", "hsdp", "use the same cluster.nproc_per_node on every node, or "
                          "parallelism.strategy=fsdp2", f"needs the world size ({world}) to be a multiple of the "
                          f"processes per node ({nproc_per_node})")
    return world // nproc_per_node, nproc_per_node


def shard_units(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules (qualified name, module) that are each one unit of sharding, innermost first: those whose
    class is named in ``names``, else the model's own blocks (``_no_split_modules``, or torch's transformer
    layers); none is fine (the root is then the only unit). A name the model has no module of is an error."""
    wanted = set(names) or set(getattr(model, "_no_split_modules", None) or DEFAULT_UNITS)
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    missing = set(names) - {type(m).__name__ for _, m in found}
    if missing:
        have = sorted({type(m).__name__ for _, m in model.named_modules()} - {type(model).__name__})
        raise ConfigError("parallelism.shard_modules", sorted(missing), f"name classes the model has, e.g. one of "
                          f"{', '.join(have[:8])}, or [] for the built-in models' blocks",
                          f"names no module of {type(model).__name__}")
    return found[::-1]  # children before their parents: an inner unit is sharded before one that holds it


def _wrap_unit(model: nn.Module, name: str, unit: nn.Module, checkpointing: bool) -> nn.Module:
    """``unit``, or ``unit`` under activation checkpointing put in its place in the model (the wrapper's state
    dict hooks drop its prefix, so checkpoints keep their keys)."""
    if not checkpointing:
        return unit
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parent_name, _, attr = name.rpartition(".")
    wrapped = checkpoint_wrapper(unit)
    model.get_submodule(parent_name).register_module(attr, wrapped)
    return wrapped


def _hand_over(model: nn.Module, handoff: Optional[GradientHandoff]) -> nn.Module:
    """With ``handoff``, each sharded parameter's gradient is handed over from the post-accumulate-grad hook that
    FSDP2 runs right after its unit's reduce-scatter, so only in a backward pass that synchronizes gradients
    (inside ``no_sync`` nothing is reduced and no hook runs). Registered on the final parameters (after any
    ``to_empty``)."""
    if handoff is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param: handoff.ready(param, param.grad))
    return model


def _need_group(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"parallelism.strategy={name} needs a process group. Fix: elastic.init("
                           "process_group=True), or run under orch launch or torchrun")


def broadcast_buffers(model: nn.Module) -> None:
    """Every rank gets rank 0's buffers (FSDP2 shards no buffer; a non-persistent one is in no state dict)."""
    with torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer.data, src=0)


def _broadcast_rng_state(device: torch.device) -> None:
    """Rank 0's torch CPU RNG state on every rank (a tensor collective: on the device the backend serves)."""
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())


def broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank gets rank 0's parameters and buffers (what DDP's constructor does), so sharding starts from
    one model even where the ranks' initializations differ."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


@contextlib.contextmanager
def _gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """No reduce-scatter in these backward passes, and the parameters stay gathered after them: the unsharded
    gradients accumulate on each rank and the next micro-batch's forward needs no all-gather (more memory for
    the length of the accumulation; one reduce-scatter per step, and with ``reshard_after_forward=false`` one
    all-gather, instead of one per micro-batch). The last micro-batch's backward, outside, reshards."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)

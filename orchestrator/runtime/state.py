"""The training state and its one serializer: what a checkpoint holds and what a healing replica group loads.

:class:`TrainingState` holds the registered ``Stateful`` components and the session's :class:`Progress`.
:meth:`TrainingState.state_dict` is the one way the state becomes a dict (torchtitan's shape: one ``states``
dict serves the checkpointer and torchft's healing alike): one entry per registered component (``"model"``,
``"optim"``, ...: its ``state_dict()``), ``"trainer"`` (the progress: step, samples consumed, epoch, and the
world size it was saved at), and the caller's own *records*, Stateful objects too: a checkpoint adds
``"rng"`` (every rank's RNG states, :class:`RankRngStates`), a healing peer adds its own RNG state, its metrics
window and where the state came from. :meth:`TrainingState.load_state_dict` reads the same dict back.

In a checkpoint each entry is one payload (see orchestrator/checkpoint/). Rank 0's components are the job's:
under DDP the model, optimizer, scheduler and grad scaler are identical on every rank. RNG states differ per
rank: they are gathered. On restore at another world size, ranks that existed before get their own RNG state
back and new ranks are seeded from (seed, rank, step); the data position is a global sample index
(``GlobalBatchSampler``), so the data continues exactly where the job stopped.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, runtime_checkable

import torch

from orchestrator.errors import CheckpointError

PROGRESS_PAYLOAD = "trainer"  # the built-in trainer's name for it since its first checkpoints: kept so they resume
RNG_PAYLOAD = "rng"
RESERVED_NAMES = (PROGRESS_PAYLOAD, RNG_PAYLOAD)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a payload is a file: <name>.pt


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (torch's ``Stateful``): modules, optimizers,
    LR schedulers, grad scalers, or an object of your own."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass
class Progress:
    """Where training stands; what a checkpoint must restore besides the tensors."""

    step: int = 0
    """Optimizer steps completed."""
    samples_consumed: int = 0
    """Global samples trained on: the data position (``GlobalBatchSampler(start_sample=...)``)."""
    epoch: int = 0


def unwrap(obj: Any) -> Any:
    """The module DDP or ``torch.compile`` wraps: its state dict has no ``module.``/``_orig_mod.`` prefixes, so a
    checkpoint loads with or without the wrapper (a single process uses no DDP)."""
    while True:
        if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            obj = obj.module
        elif isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod  # torch.compile's OptimizedModule
        else:
            return obj


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over parameter names and raw bytes in module order: equal only for bit-identical models. A sharded
    parameter (a DTensor, FSDP2) is hashed whole, so the hash does not depend on the strategy or the world size;
    gathering it is a collective, so then every rank calls this. Names are the state dict's (an activation
    checkpointing wrapper's prefix left out)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        tensor = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        h.update(name.replace("_checkpoint_wrapped_module.", "").encode())
        h.update(tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_model_fits(checkpoint_model: dict[str, torch.Tensor], model: torch.nn.Module, step: int,
                     name: str = "model") -> None:
    """Refuse a checkpoint whose parameter names or shapes differ, listing every differing key
    (instead of ``strict=False`` silently leaving layers at their random init)."""
    current = model.state_dict()
    missing = sorted(set(current) - set(checkpoint_model))
    unexpected = sorted(set(checkpoint_model) - set(current))
    reshaped = sorted(f"{k} {tuple(checkpoint_model[k].shape)}->{tuple(current[k].shape)}"
                      for k in set(current) & set(checkpoint_model) if checkpoint_model[k].shape != current[k].shape)
    if missing or unexpected or reshaped:
        parts = [f"{what} ({len(keys)}): {', '.join(keys[:20])}{' ...' if len(keys) > 20 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape changed", reshaped))
                 if keys]
        which = "the model" if name == "model" else f"the model {name!r}"
        raise CheckpointError(f"checkpoint step {step} does not fit {which} ({'; '.join(parts)}). Fix: resume with "
                              "the model it was saved from, or start fresh with checkpoint.resume=never or a new "
                              "checkpoint.url")


class TrainingState:
    """The named components a session checkpoints (registration order), and its :class:`Progress`."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.components: dict[str, Any] = {}

    def register(self, states: Mapping[str, Any]) -> None:
        """Add ``states`` (name -> Stateful). Raises ValueError naming a bad name or an object without
        ``state_dict``/``load_state_dict``."""
        for name, obj in states.items():
            if not isinstance(name, str) or not _NAME_RE.match(name) or name == "manifest":
                raise ValueError(f"state name {name!r} is not usable as a checkpoint file name. Fix: letters, digits, "
                                 "_ . - starting with a letter or digit (not 'manifest')")
            if name in RESERVED_NAMES:
                raise ValueError(f"state name {name!r} is the session's own ({', '.join(RESERVED_NAMES)}: progress and "
                                 "RNG states are saved for you). Fix: register it under another name")
            obj = unwrap(obj)
            if not isinstance(obj, Stateful):
                raise ValueError(f"state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(). Fix: "
                                 "register a module, optimizer, scheduler, grad scaler or an object with both methods")
            self.components[name] = obj

    def first_model(self) -> Optional[torch.nn.Module]:
        """The first registered module (the one ``params_sha256`` in ``training_finished`` is computed over)."""
        return next((obj for obj in self.components.values() if isinstance(obj, torch.nn.Module)), None)

    def state_dict(self, world_size: int, records: Optional[Mapping[str, Any]] = None,
                   skip: Iterable[str] = ()) -> dict[str, Any]:
        """The state as one dict: every component's ``state_dict()``, the progress (``"trainer"``, with
        ``world_size``), and each of ``records`` (name -> Stateful: what the caller adds, e.g. ``"rng"``).
        ``skip``: components the caller saves another way (the DCP engine's modules and optimizers)."""
        records, skip = self._records(records), set(skip)
        return {**{name: obj.state_dict() for name, obj in self.components.items() if name not in skip},
                PROGRESS_PAYLOAD: {**asdict(self.progress), "world_size": world_size},
                **{name: record.state_dict() for name, record in records.items()}}

    def load_state_dict(self, state: Mapping[str, Any], records: Optional[Mapping[str, Any]] = None,
                        skip: Iterable[str] = ()) -> None:
        """Load what :meth:`state_dict` made: every component (but ``skip``), then the progress, then each of
        ``records`` (in their order, so a record can read the progress just loaded). A checkpoint is checked first
        (:meth:`check`)."""
        records, skip = self._records(records), set(skip)
        for name, obj in self.components.items():
            if name not in skip:
                obj.load_state_dict(state[name])
        saved = state[PROGRESS_PAYLOAD]
        self.progress.step, self.progress.samples_consumed = saved["step"], saved["samples_consumed"]
        self.progress.epoch = saved["epoch"]
        for name, record in records.items():
            record.load_state_dict(state[name])

    def check(self, state: dict[str, Any], step: int) -> None:
        """Refuse, before anything is loaded, a checkpoint that lacks a registered component or whose modules
        differ from the registered ones."""
        missing = [name for name in self.components if name not in state]
        if missing:
            raise CheckpointError(f"checkpoint step {step} has no {', '.join(map(repr, missing))} (it holds "
                                  f"{', '.join(sorted(state))}). Fix: register the states it was saved with, or start "
                                  "fresh with checkpoint.resume=never or a new checkpoint.url")
        for name, obj in self.components.items():
            if isinstance(obj, torch.nn.Module):
                check_model_fits(state[name], obj, step, name)

    def _records(self, records: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
        clash = sorted(set(records or {}) & (set(self.components) | {PROGRESS_PAYLOAD}))
        if clash:
            raise ValueError(f"record name(s) {clash} clash with the training state's own entries")
        return records or {}


class Record:
    """A Stateful made of two functions: a record that a serializer's caller adds beside the components."""

    def __init__(self, get: Callable[[], Any], load: Callable[[Any], None]):
        self.get, self.load = get, load

    def state_dict(self) -> Any:
        return self.get()

    def load_state_dict(self, state: Any) -> None:
        self.load(state)


class RngState:
    """This rank's RNG states (Python's and torch's, and the CUDA device's), as a record: what a healing peer
    sends beside the state, so that the group goes on drawing what the peer would have."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state, self.device)


class RankRngStates:
    """A checkpoint's ``"rng"`` payload: every rank's RNG states (``per_rank``, gathered by the caller before a
    save). Loading gives this rank its own back; a rank the checkpointed job did not have is seeded,
    reproducibly, from (``seed``, rank, the step just loaded into ``progress``)."""

    def __init__(self, device: torch.device, rank: int = 0, seed: int = 0, progress: Optional[Progress] = None,
                 per_rank: Optional[list[Any]] = None):
        self.device, self.rank, self.seed, self.progress = device, rank, seed, progress
        self.per_rank = per_rank or []

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": self.per_rank}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        per_rank = state["per_rank"]
        if self.rank < len(per_rank):
            set_rng_state(per_rank[self.rank], self.device)
            return
        step = self.progress.step if self.progress is not None else 0
        random.seed(self.seed * 1_000_003 + self.rank * 7919 + step)
        torch.manual_seed(self.seed * 1_000_003 + self.rank * 7919 + step)

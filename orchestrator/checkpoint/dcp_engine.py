"""The ``dcp`` engine: every rank writes its own shards through torch DCP; rank 0 commits the manifest last.

Save (every rank): rank 0 opens the step's directory (the manager's temporary one where the filesystem
renames) and broadcasts it; each registered module and the optimizers that hold its parameters give their
FQN-keyed state (``get_model_state_dict``/``get_optimizer_state_dict``: DTensor shards under FSDP2, full tensors
under DDP, which DCP writes once); the tensors go to DCP's fsspec writer (``__<rank>_<n>.distcp`` per rank and
``.metadata``), everything that is not a tensor (optimizer hyperparameters, schedulers, the progress, the RNG
states, a component of one's own) goes through the pickle-free codec, written by rank 0. Every rank hashes its
own shard files and rank 0 writes ``manifest.json`` listing every file with its size and sha256: the commit, so
fence, retention, lineage and ``orch ckpt`` work as for the ``rank0`` engine. A failure on any rank is gathered
and nothing is committed.

``async_save``: the tensors are staged to CPU (pinned where there is CUDA) and ``dcp.async_save`` writes them in a
background thread on a gloo process group of the checkpoint's own, so its collectives never meet the training
loop's; a thread per rank waits for that write, then the ranks agree (on the same group) and rank 0 commits.
An emergency save is synchronous.

Restore: rank 0 picks the newest valid checkpoint (every checksum verified, ``.metadata`` read safely, see
orchestrator/checkpoint/dcp_metadata.py) and broadcasts its step and small state; every rank builds its own
target state (its shards at today's world size and strategy), checks the modules' global shapes against the
index, loads its shards with ``dcp.load`` (resharding) and sets them with ``set_*_state_dict``.

A checkpoint of the ``rank0`` engine (a DDP run's, whole payloads) restores too, so a run can switch to a sharded
strategy and resume: rank 0 reads its payloads (``torch.load(weights_only=True)`` or safetensors, as the rank0
engine does) and keeps the modules and optimizers; every rank checks their shapes against its own, and
``set_*_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` sends each tensor from rank 0 into every
rank's shards (the optimizer's state, keyed by parameter index there, is keyed by FQN first). The rest (progress,
schedulers, scaler, RNG) is broadcast and loaded as for a DCP checkpoint.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from orchestrator.errors import CheckpointError
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import TrainingState, check_model_fits

from .dcp_metadata import METADATA_NAME, SHARD_SUFFIX, SafeReader, UnsafeCheckpoint, parse_metadata, saved_shapes
from .engine_api import Collectives, Restored
from .manager import CheckpointManager
from .manifest import DCP_FORMAT, FileEntry, sha256_hex
from .staging import StagingArea
from .storage import step_dirname

PLAIN_PAYLOAD = "dcp_plain"
"""The non-tensor leaves of the DCP components' state (flattened key -> value): rank 0's, as JSON."""
# One process without a process group is what no_dist is for; DCP warns each time (from its writer thread too).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)
COMMIT_TIMEOUT = datetime.timedelta(seconds=120)  # a background commit waiting on a rank that is gone gives up


class DcpEngine:
    """See the module docstring; :class:`~.engines.CheckpointEngine`'s contract. ``async_save``: periodic saves
    write in the background (an emergency one never)."""

    name = DCP_FORMAT

    def __init__(self, manager: CheckpointManager, state: TrainingState, ctx: DistContext, comm: Collectives,
                 async_save: bool):
        self.manager, self.state, self.ctx, self.comm, self.async_save = manager, state, ctx, comm, async_save
        self._group: Any = None  # the background writes' own gloo group, made at the first async save
        self._stager: Any = None
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[CheckpointError] = None

    # -- what goes through DCP ----------------------------------------------------------------------
    def _pairs(self) -> list[tuple[str, torch.nn.Module, list[tuple[str, torch.optim.Optimizer]]]]:
        """Each registered module with the registered optimizers whose parameters it holds."""
        comps = self.state.components
        modules = [(n, m) for n, m in comps.items() if isinstance(m, torch.nn.Module)]
        pairs = [(n, m, []) for n, m in modules]
        owned = [{id(p) for p in m.parameters()} for _, m in modules]
        for name, optim in comps.items():
            if not isinstance(optim, torch.optim.Optimizer):
                continue
            params = {id(p) for group in optim.param_groups for p in group["params"]}
            owner = next((i for i, ids in enumerate(owned) if params <= ids), None)
            if owner is None:
                raise CheckpointError(f"optimizer {name!r} holds parameters of no registered module, so DCP cannot "
                                      "key its state. Fix: register the module it optimizes beside it")
            pairs[owner][2].append((name, optim))
        return pairs

    def _dcp_names(self) -> list[str]:
        return [n for name, _, optims in self._pairs() for n in (name, *(o for o, _ in optims))]

    def _current(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(tensors, plain leaves, mapping): this rank's DCP state, flattened, split into what DCP writes and
        what the codec does."""
        state: dict[str, Any] = {}
        for name, module, optims in self._pairs():
            state[name] = get_model_state_dict(module)
            for oname, optim in optims:
                state[oname] = get_optimizer_state_dict(module, optim)
        flat, mapping = flatten_state_dict(state)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        return tensors, plain, mapping

    # -- save ---------------------------------------------------------------------------------------
    def save(self, step: int, metadata: Optional[dict[str, Any]], records: Mapping[str, Any], *,
             sync: bool = False) -> float:
        t0 = time.perf_counter()
        self.wait()
        opened: Any = None
        refused: Optional[CheckpointError] = None
        if self.ctx.is_main:
            try:
                opened = self.manager.open_step(step)
            except CheckpointError as e:  # CheckpointFenced included: rank 0 raises it as it is
                opened, refused = {"error": str(e)}, e
        opened = self.comm.broadcast_object(opened)
        if isinstance(opened, dict):
            raise refused or CheckpointError(opened["error"])
        if opened is None:
            return time.perf_counter() - t0  # committed on an object store already: see open_step
        dirname = opened
        tensors, plain, _ = self._current()
        payloads = None
        if self.ctx.is_main:
            payloads = {**self.state.state_dict(self.ctx.world_size, records, skip=self._dcp_names()),
                        PLAIN_PAYLOAD: plain}
        writer = FsspecWriter(self.manager.storage.url_for(dirname))
        grouped = dist.is_available() and dist.is_initialized()
        if self.async_save and not sync:
            group = self._async_group() if grouped else None
            try:
                future = dcp.async_save(tensors, storage_writer=writer, process_group=group,
                                        async_stager=self._async_stager(), no_dist=not grouped)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - staging failed: the ranks still agree
                future = e
            if self.ctx.is_main:
                payloads = StagingArea(reuse=False).stage(payloads)  # the loop changes the state right after
            stall_s = time.perf_counter() - t0
            self._thread = threading.Thread(target=self._commit_in_background,
                                            args=(step, dirname, future, payloads, metadata, stall_s, group),
                                            name=f"orch-dcp-commit-{step}", daemon=True)
            self._thread.start()
            return stall_s
        error = None
        try:
            dcp.save(tensors, storage_writer=writer, no_dist=not grouped)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - gathered below: every rank learns it
            error = self._describe(e)
        failure = self._commit(step, dirname, error, payloads, metadata, None, time.perf_counter() - t0, t0,
                               is_async=False)
        if failure is not None:
            raise failure
        return time.perf_counter() - t0

    def _describe(self, e: BaseException) -> str:
        """One line for a failed write: DCP's CheckpointException unwrapped to each failing rank's error."""
        if isinstance(e, CheckpointException):
            return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in e.failures.items())
        return f"rank {self.ctx.rank}: {type(e).__name__}: {e}"

    def _async_group(self) -> Any:
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=COMMIT_TIMEOUT)
        return self._group

    def _async_stager(self) -> Any:
        """DCP's stager, kept between saves; pinned memory and non-blocking copies where there is CUDA."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def _commit_in_background(self, step: int, dirname: str, future: Any, payloads: Optional[dict],
                              metadata: Optional[dict], stall_s: float, group: Any) -> None:
        t0 = time.perf_counter()
        error = None
        try:
            if isinstance(future, BaseException):
                raise future
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException
            error = self._describe(e)
        try:
            self._failure = self._commit(step, dirname, error, payloads, metadata, group, stall_s, t0,
                                         is_async=True)
        except Exception as e:  # noqa: BLE001 - a peer gone mid-agreement: kept for the next save()/wait()
            self._failure = CheckpointError(f"background DCP save of step {step} to {self.manager.url} could not be "
                                            f"agreed on: {type(e).__name__}: {e}")

    def _commit(self, step: int, dirname: str, error: Optional[str], payloads: Optional[dict],
                metadata: Optional[dict], group: Any, stall_s: float, t0: float,
                is_async: bool) -> Optional[CheckpointError]:
        """Every rank: hash this rank's shards, gather, rank 0 writes the codec payloads and the manifest (or
        removes everything when a rank failed); the outcome is broadcast. Returns the failure, or None."""
        files: dict[str, list[Any]] = {}
        if error is None:
            try:
                files = self._hash_files(dirname, lambda f: f.startswith(f"__{self.ctx.rank}_"))
            except Exception as e:  # noqa: BLE001
                error = self._describe(e)
        reports = self.comm.all_gather_object({"error": error, "files": files}, self.ctx.world_size, group)
        outcome, failure = None, None
        if self.ctx.is_main:
            errors = [r["error"] for r in reports if r["error"]]
            try:
                if errors:
                    raise self.manager.abort_step(step, dirname, "; ".join(errors), is_async)
                entries = {name: FileEntry(size, sha) for r in reports for name, (size, sha) in r["files"].items()}
                entries.update({k: FileEntry(*v) for k, v in
                                self._hash_files(dirname, lambda f: f == METADATA_NAME).items()})
                entries.update(self.manager.write_payloads(dirname, payloads))
                self.manager.commit_step(step, dirname, entries, metadata or {}, stall_s=stall_s,
                                         write_s=time.perf_counter() - t0, is_async=is_async)
            except CheckpointError as e:  # CheckpointFenced included: rank 0 keeps its type
                outcome, failure = str(e), e
            except Exception as e:  # noqa: BLE001
                failure = self.manager.abort_step(step, dirname, f"{type(e).__name__}: {e}", is_async)
                outcome = str(failure)
        outcome = self.comm.broadcast_object(outcome, group)
        return (failure or CheckpointError(outcome)) if outcome else None

    def _hash_files(self, dirname: str, wanted: Any) -> dict[str, list[Any]]:
        storage = self.manager.storage
        out = {}
        for fname in storage.list_files(dirname):
            if wanted(fname):
                data = storage.read_bytes(f"{dirname}/{fname}")
                out[fname] = [len(data), sha256_hex(data)]
        return out

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # -- restore ------------------------------------------------------------------------------------
    def restore(self, wanted: Optional[int], records: Mapping[str, Any]) -> Optional[Restored]:
        self.wait()
        head: Any = None
        whole: dict[str, Any] = {}  # rank 0's, from a rank0-engine checkpoint: the modules' and optimizers' payloads
        if self.ctx.is_main:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    loaded = self.manager.load(wanted)
                if loaded is not None:
                    index = loaded.files.get(METADATA_NAME)
                    if loaded.format != DCP_FORMAT:
                        whole = self._take_whole(loaded.state)
                    head = {"step": loaded.step, "state": loaded.state, "metadata": loaded.metadata,
                            "format": loaded.format, "index_sha256": index.sha256 if index else None,
                            "whole": {n: {k: list(v.shape) for k, v in whole[n].items()} if n in self._modules()
                                      else {} for n in whole}}
            except CheckpointError as e:
                head = {"error": str(e)}
        head = self.comm.broadcast_object(head)
        if head is None:
            return None
        if "error" in head:
            raise CheckpointError(head["error"])
        step, state = head["step"], head["state"]
        if head["format"] == DCP_FORMAT:
            self._load_shards(step, state, head["index_sha256"])
        else:
            saved = head["whole"]
            self._check_fits(set(saved), {n: saved[n] for n in self._modules() if n in saved}, state, step)
            self._load_whole(whole)
        self.state.load_state_dict(state, records, skip=self._dcp_names())
        return Restored(step, head["metadata"], head["format"])

    def _load_shards(self, step: int, state: dict[str, Any], index_sha256: Optional[str]) -> None:
        """A DCP checkpoint: every rank reads its shards (resharded to today's layout) into the state."""
        url = self.manager.storage.url_for(step_dirname(step))
        try:
            index = parse_metadata(self.manager.storage.read_bytes(f"{step_dirname(step)}/{METADATA_NAME}"),
                                   index_sha256)
        except (UnsafeCheckpoint, FileNotFoundError) as e:
            raise CheckpointError(f"checkpoint {url} cannot be read safely: {e}. Fix: resume from another step "
                                  "(`orch ckpt list` marks the valid ones)") from e
        self._check(index, state, step)
        tensors, plain, mapping = self._current()
        grouped = dist.is_available() and dist.is_initialized()
        dcp.load(tensors, storage_reader=SafeReader(url, index_sha256), no_dist=not grouped)
        saved_plain = state.get(PLAIN_PAYLOAD, {})
        full = unflatten_state_dict({**tensors, **{k: saved_plain.get(k, v) for k, v in plain.items()}}, mapping)
        for name, module, optims in self._pairs():
            set_model_state_dict(module, full[name])
            for oname, optim in optims:
                set_optimizer_state_dict(module, optim, full[oname])

    def _load_whole(self, whole: dict[str, Any]) -> None:
        """A rank0-engine checkpoint: rank 0's whole modules and optimizers (``whole``; empty elsewhere) into every
        rank's state, each tensor sent from rank 0 into this rank's shards."""
        grouped = dist.is_available() and dist.is_initialized()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=grouped)
        for name, module, optims in self._pairs():
            set_model_state_dict(module, whole.get(name, {}), options=options)
            for oname, optim in optims:
                set_optimizer_state_dict(module, optim, whole.get(oname, {}), options=options)

    def _take_whole(self, state: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: a rank0-engine checkpoint's modules and optimizers taken out of its payloads, each optimizer's
        state keyed by FQN (here, so that a mismatch is refused before any rank waits on a broadcast)."""
        whole: dict[str, Any] = {}
        for name, module, optims in self._pairs():
            if name in state:
                whole[name] = state.pop(name)
            for oname, optim in optims:
                if oname in state:
                    whole[oname] = fqn_keyed(module, optim, state.pop(oname), oname)
        return whole

    def _modules(self) -> list[str]:
        return [name for name, _, _ in self._pairs()]

    def _check(self, index: Any, state: dict[str, Any], step: int) -> None:
        """Refuse, before loading, a checkpoint without a registered component or whose modules differ."""
        keys = list(index.state_dict_metadata)
        saved = {n for n in self._dcp_names() if any(k.startswith(f"{n}.") for k in keys)}
        self._check_fits(saved, {n: saved_shapes(index, n) for n in self._modules()}, state, step)

    def _check_fits(self, saved: set[str], shapes: dict[str, dict[str, Any]], state: dict[str, Any],
                    step: int) -> None:
        """``saved``: the modules and optimizers the checkpoint holds; ``shapes``: each module's global shapes."""
        missing = [n for n in self._dcp_names() if n not in saved]
        missing += [n for n in self.state.components if n not in self._dcp_names() and n not in state]
        if missing:
            raise CheckpointError(f"checkpoint step {step} has no {', '.join(map(repr, missing))} (it holds "
                                  f"{', '.join(sorted(saved | set(state)))}). Fix: register the states it was saved "
                                  "with, or start fresh with checkpoint.resume=never or a new checkpoint.url")
        for name, module, _ in self._pairs():
            current = {k: torch.empty(v.shape, device="meta") for k, v in get_model_state_dict(module).items()}
            saved_model = {k: torch.empty(s, device="meta") for k, s in shapes[name].items()}
            check_model_fits(saved_model, SimpleNamespace(state_dict=lambda c=current: c), step, name)


def fqn_keyed(module: torch.nn.Module, optim: torch.optim.Optimizer, saved: dict[str, Any],
              name: str) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the rank0 engine saved it (state and param groups keyed by parameter
    index, in the order of the optimizer's groups) keyed by FQN instead, as ``get_optimizer_state_dict``
    keys it: the index is a position in this optimizer's groups, the FQN that parameter's name in
    ``module`` (no activation checkpointing or compile prefix)."""
    names = {id(p): n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
             for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optim.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    count = sum(len(g["params"]) for g in groups)
    if len(groups) != len(optim.param_groups) or count != len(order):
        raise CheckpointError(f"optimizer {name!r} of the checkpoint has {len(groups)} parameter group(s) of "
                              f"{count} parameters, this one {len(optim.param_groups)} of {len(order)}. Fix: build "
                              "the optimizer as the checkpointed run did, or start fresh with checkpoint.resume=never")
    return {"state": {order[int(i)]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in groups]}

"""CheckpointManager: save (optionally in the background), list, load and prune checkpoints at one URL.

Protocol (see :mod:`.manifest`): ``<url>/step_<N:09d>/`` holds one ``<name>.pt`` file per payload, written
with ``torch.save``, then ``manifest.json`` written last. On a filesystem with rename (local disk, NFS) the
whole step is written as ``.step_<N>.tmp-<uuid>/`` and committed by renaming it to ``step_<N:09d>``; an
existing step of the same number is renamed aside, replaced, then deleted, so a valid copy exists at every
moment. On object stores a save is committed exactly when its manifest is written; a re-save of an existing
step writes its payloads under new names beside the old ones, switches the manifest (one PUT), then deletes the
old payloads. Either way a writer killed at any point leaves the old set of checkpoints or the new one, plus at
most one directory or set of files that every reader ignores; a failed save removes its partial files.

Payloads are ``torch.save`` files (``format="torch"``) or, with ``format="safetensors"``, per payload a
safetensors file of its tensors and a JSON file of the rest (:func:`orchestrator.checkpoint.wire.split`): read
back without any unpickling. Manifests carry the writer's run id and lineage; retention deletes only checkpoints
its own run wrote (see :meth:`CheckpointManager._prune`). A ``fence`` (orchestrator/checkpoint/fence.py) is asked
before a save writes anything and again right before its commit; a save it refuses commits nothing.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from orchestrator.events import (CheckpointFailed, CheckpointRetentionFailed, CheckpointSaved, CheckpointSkipped,
                                 Event)

from .errors import CheckpointError, CheckpointFenced, CheckpointSetupError
from .manifest import (
    DCP_FORMAT,
    DCP_INDEX,
    DCP_SHARD_SUFFIX,
    MANIFEST_NAME,
    PAYLOAD_FORMATS,
    FileEntry,
    Manifest,
    ManifestError,
    build_manifest,
    check_checksum,
    check_sizes,
    encode_manifest,
    parse_manifest,
    sha256_hex,
)
from .preflight import open_storage, preflight_storage
from .staging import StagingArea
from .storage import CheckpointStorage, list_tmp_dirs, step_dirname, tmp_dirname

log = logging.getLogger(__name__)

_PAYLOAD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# <payload>[.r<tag>].<ext>: the tag marks files of a re-save on an object store, written beside the old ones.
_PAYLOAD_FILE_RE = re.compile(r"^(?P<name>.+?)(?P<tag>\.r[0-9a-f]{8})?\.(?P<ext>pt|safetensors|json)$")

EventHook = Callable[[str, dict], None]
Fence = Callable[[], "str | None"]  # why this writer may not commit now (its lease is another run's), or None


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step_N`` directory. ``valid``: manifest parses and every listed file exists with its listed
    size (checksums are verified by :meth:`CheckpointManager.load`). ``reason`` says why it is not valid."""

    step: int
    url: str
    valid: bool
    reason: str | None
    total_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)
    created_t: float | None = None
    run_id: str | None = None
    lineage: tuple[str, ...] = ()
    format: str | None = None
    """The manifest's payload format (``dcp``: written by the DCP engine); None without a manifest."""


@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint: ``state`` maps payload name (``"model"``, ``"optim"``, ...) to its CPU object.
    ``format`` is its manifest's; a ``dcp`` checkpoint's DCP files (``files``: the manifest's entries) are
    verified, not read: the DCP engine loads them into its sharded state."""

    step: int
    state: dict[str, Any]
    metadata: dict[str, Any]
    run_id: str | None = None
    lineage: tuple[str, ...] = ()
    format: str = "torch"
    files: dict[str, FileEntry] = field(default_factory=dict)


_WRITE_FIX = "check that the URL is reachable and writable from this process (free space, permissions, credentials)"
_INVALID_FIX = ("load another step (`orch ckpt list URL` marks the valid ones), or load() with no step for the newest "
                "valid one")


class _NoSpace(OSError):
    """The filesystem reports less free space than the save is expected to need."""


class _Fenced(Exception):
    """The fence refused the save: this writer's lease on the URL is not its run's any more."""


class _Unreadable(Exception):
    """A checkpoint that passed the size check but cannot be read back (checksum, missing file, unsafe)."""


class CheckpointManager:
    """Saves and loads checkpoints under ``url`` through fsspec.

    ``keep_last``: valid checkpoints kept after each committed save (>= 1). ``async_save``: serialize and
    write in a background thread (at most one in flight) so the caller only waits for the copy to CPU.
    ``on_event(name, fields)``: called with ``checkpoint_saved`` / ``checkpoint_failed`` /
    ``checkpoint_skipped`` / ``checkpoint_retention_failed`` and the JSON fields of that event (built by its
    constructor in orchestrator/events.py); from the background thread for async saves.
    ``run_id``: recorded in every manifest with the lineage (the run ids before it, from the checkpoint
    :meth:`load` resumed from); retention then deletes only checkpoints this run id wrote, never those it
    resumed from or another run's. None: no run id (retention treats checkpoints without one as its own).
    ``format``: ``torch`` or ``safetensors``. ``fence()``: asked before a save writes anything, again right
    before its commit and before retention deletes anything; a reason returned refuses the save
    (CheckpointFenced: ``checkpoint_failed``, nothing committed, its partial files removed) or skips retention.
    Not thread-safe: call ``save``/``wait``/``load`` from one thread (the training loop).
    """

    def __init__(
        self,
        url: str,
        keep_last: int = 3,
        async_save: bool = True,
        on_event: EventHook | None = None,
        run_id: str | None = None,
        format: str = "torch",
        fence: Fence | None = None,
    ):
        if not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointSetupError(f"CheckpointManager keep_last={keep_last!r}", "must be an integer >= 1",
                                       "keep at least 1 checkpoint: keep_last=1 or more")
        if format not in PAYLOAD_FORMATS:
            raise CheckpointSetupError(f"CheckpointManager format={format!r}", "is not a checkpoint format",
                                       f"use one of {', '.join(PAYLOAD_FORMATS)}")
        self.run_id, self.format, self._fence = run_id, format, fence
        self.lineage: tuple[str, ...] = (run_id,) if run_id else ()
        self.resumed_from: dict[str, Any] | None = None
        self._loading: set[int] = set()  # steps being read now: retention leaves them alone
        self.url = url
        self.keep_last = keep_last
        self.async_save = async_save
        self._on_event = on_event
        self._storage: CheckpointStorage | None = None  # resolved lazily so that preflight() owns the errors
        self._thread: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        # Async saves keep their CPU buffers between saves (cheaper stall); sync saves free them.
        self._staging = StagingArea(reuse=async_save)

    @property
    def storage(self) -> CheckpointStorage:
        """The resolved storage (raises CheckpointSetupError for an unknown scheme or a missing package)."""
        if self._storage is None:
            self._storage = open_storage(self.url, setting=None)
        return self._storage

    # -- preflight --------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Check before training that checkpoints can be written to ``url`` (probe write + delete).

        Raises CheckpointSetupError (a UserError, exit 2) naming the URL, the problem and the fix.
        """
        self._storage = preflight_storage(self.url, setting=None)

    # -- save -------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], metadata: dict | None = None) -> float:
        """Save ``state`` (payload name -> nested dicts/lists/tuples of tensors and plain values) as ``step``.

        Waits for the previous save (raising CheckpointError if it failed, without saving this one), copies
        every tensor to CPU, then serializes, writes payloads, writes the manifest and applies retention:
        in a background thread when ``async_save``, else before returning. Returns the seconds the caller
        was blocked. Raises CheckpointError for state ``torch.load(weights_only=True)`` could not read back,
        a non-JSON ``metadata``, or (sync mode) a failed write.
        """
        t0 = time.perf_counter()
        self.wait()
        metadata = dict(metadata or {})
        _check_payload_names(state)
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint metadata for step {step} is not JSON-serializable: {e}. Fix: pass "
                                  "metadata made of str, int, finite float, bool, None, lists and dicts") from e
        # The copy is the only part that must block: training mutates parameters in place right after.
        cpu_state = self._staging.stage(state)
        if not self.async_save:
            self._write(step, cpu_state, metadata, is_async=False, t_call=t0)
            return time.perf_counter() - t0
        stall_s = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(step, cpu_state, metadata, stall_s),
            name=f"orch-ckpt-save-{step}",
            daemon=False,  # an interpreter exiting mid-save waits for the commit instead of tearing it
        )
        self._thread.start()
        return stall_s

    def wait(self) -> None:
        """Block until no save is in flight; raise CheckpointError if the last background save failed."""
        self._join()
        if self._failure is not None:
            step, err = self._failure
            self._failure = None
            if isinstance(err, CheckpointFenced):
                raise err  # its own message: the save was refused, not failed
            raise CheckpointError(
                f"background checkpoint save of step {step} to {self.url} failed: {type(err).__name__}: {err}. "
                f"Fix: {_WRITE_FIX}"
            ) from err

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write_in_background(self, step: int, cpu_state: dict, metadata: dict, stall_s: float) -> None:
        try:
            self._write(step, cpu_state, metadata, is_async=True, stall_s=stall_s)
        except Exception as e:  # noqa: BLE001 - kept for the next save()/wait() to raise, never dropped
            unwrap = isinstance(e, CheckpointError) and e.__cause__ and not isinstance(e, CheckpointFenced)
            self._failure = (step, e.__cause__ if unwrap else e)

    def _write(
        self, step: int, cpu_state: dict, metadata: dict, *, is_async: bool,
        stall_s: float | None = None, t_call: float | None = None,
    ) -> None:
        """Serialize + write payloads + manifest, emit checkpoint_saved, prune. CheckpointError on failure.

        The reported stall is ``stall_s`` when given (async), else the time since ``t_call`` (sync).
        """
        t0 = time.perf_counter()
        stepdir = step_dirname(step)
        try:
            storage = self.storage
            self._check_fence()
            self._check_free_space(storage)
            if storage.has_rename:
                manifest = self._write_and_rename(storage, step, stepdir, cpu_state, metadata)
            else:
                manifest = self._write_in_place(storage, step, stepdir, cpu_state, metadata)
        except Exception as e:  # noqa: BLE001 - any failure must reach the caller, never vanish
            raise self._failed(step, e, is_async) from e
        write_s = time.perf_counter() - t0
        if stall_s is None:
            stall_s = time.perf_counter() - (t_call if t_call is not None else t0)
        self._emit(CheckpointSaved(step=step, stall_s=stall_s, write_s=write_s, bytes=manifest.total_bytes,
                                   async_=is_async, url=storage.url_for(stepdir)))
        self._prune()

    def _failed(self, step: int, e: Exception, is_async: bool) -> CheckpointError:
        """Emit ``checkpoint_failed`` for the save of ``step`` that ``e`` ended; the error to raise."""
        error = f"refused, nothing committed: {e}" if isinstance(e, _Fenced) else f"{type(e).__name__}: {e}"
        self._emit(CheckpointFailed(step=step, error=error, async_=is_async, url=self.url))
        if isinstance(e, _NoSpace):
            return CheckpointError(f"checkpoint save of step {step} to {self.url} refused: {e}")
        if isinstance(e, _Fenced):
            return CheckpointFenced(
                f"checkpoint save of step {step} to {self.url} refused, nothing committed: {e}. Fix: another "
                "launch holds this checkpoint URL now; give each run its own checkpoint.url")
        return CheckpointError(
            f"checkpoint save of step {step} to {self.url} failed: {type(e).__name__}: {e}. Fix: {_WRITE_FIX}")

    # -- files written by an engine (orchestrator/checkpoint/dcp_engine.py) -------------------------
    def open_step(self, step: int) -> str | None:
        """The directory (relative to the URL) an engine writes the files of ``step`` into before
        :meth:`commit_step`: a temporary one where the filesystem renames, else the step's own. Fence and free
        space are checked first (CheckpointError/CheckpointFenced with ``checkpoint_failed``, as :meth:`save`).
        None on an object store that already holds ``step``: files of fixed names cannot be replaced in place."""
        self.wait()
        try:
            storage = self.storage
            self._check_fence()
            self._check_free_space(storage)
            if storage.has_rename:
                storage.restore_orphans()
                dirname = tmp_dirname(step)
            else:
                dirname = step_dirname(step)
                if storage.list_files(dirname):
                    return None
            storage.makedirs(dirname)
        except Exception as e:  # noqa: BLE001
            raise self._failed(step, e, is_async=False) from e
        return dirname

    def write_payloads(self, dirname: str, state: dict[str, Any]) -> dict[str, FileEntry]:
        """Each payload of ``state`` as safetensors + JSON files in ``dirname`` (no pickle); their entries."""
        _check_payload_names(state)
        entries: dict[str, FileEntry] = {}
        for name, obj in state.items():
            for ext, data in _safetensors_files(obj):
                fname = f"{name}.{ext}"
                entries[fname] = FileEntry(size=len(data), sha256=sha256_hex(data))
                self._write_payload(self.storage, f"{dirname}/{fname}", data)
        return entries

    def commit_step(self, step: int, dirname: str, files: dict[str, FileEntry], metadata: dict, *,
                    stall_s: float, write_s: float, is_async: bool) -> Manifest:
        """Commit the files an engine wrote in ``dirname`` (from :meth:`open_step`) as ``step``: the manifest
        listing ``files`` written last (format ``dcp``), the rename where there is one, ``checkpoint_saved``,
        retention. A failure removes the files and raises as :meth:`save` does."""
        storage = self.storage
        try:
            manifest = build_manifest(step, files, metadata, format=DCP_FORMAT, run_id=self.run_id,
                                      lineage=self.lineage, resumed_from=self.resumed_from)
            self._check_fence()
            storage.write_bytes_atomic(f"{dirname}/{MANIFEST_NAME}", encode_manifest(manifest))
            if storage.has_rename:
                storage.commit_dir(dirname, step_dirname(step))
        except Exception as e:  # noqa: BLE001
            _quietly(storage.remove, dirname)
            raise self._failed(step, e, is_async) from e
        self._emit(CheckpointSaved(step=step, stall_s=stall_s, write_s=write_s, bytes=manifest.total_bytes,
                                   async_=is_async, url=storage.url_for(step_dirname(step))))
        self._prune()
        return manifest

    def abort_step(self, step: int, dirname: str, error: str, is_async: bool) -> CheckpointError:
        """Remove what an engine wrote for ``step`` after ``error`` (a rank's); the error to raise."""
        _quietly(self.storage.remove, dirname)
        return self._failed(step, RuntimeError(error), is_async)

    def _write_files(self, storage: CheckpointStorage, step: int, dirname: str, cpu_state: dict,
                     metadata: dict, tag: str = "") -> Manifest:
        """Serialize each payload into ``dirname`` (file names carry ``tag``), then its manifest last.

        On failure the payload files written so far are removed before the error propagates."""
        entries: dict[str, FileEntry] = {}
        storage.makedirs(dirname)
        try:
            for name, obj in cpu_state.items():
                for ext, data in self._serialize(obj):
                    fname = f"{name}{tag}.{ext}"
                    entries[fname] = FileEntry(size=len(data), sha256=sha256_hex(data))
                    self._write_payload(storage, f"{dirname}/{fname}", data)
                    del data
            manifest = build_manifest(step, entries, metadata, format=self.format, run_id=self.run_id,
                                      lineage=self.lineage, resumed_from=self.resumed_from)
            if not storage.has_rename:
                self._check_fence()  # on object stores the manifest written next is the commit
            storage.write_bytes_atomic(f"{dirname}/{MANIFEST_NAME}", encode_manifest(manifest))
        except BaseException:
            for fname in entries:
                _quietly(storage.remove_file, f"{dirname}/{fname}")
            raise
        return manifest

    def _serialize(self, obj: Any) -> list[tuple[str, Any]]:
        """(extension, bytes) of the files that hold one payload in this manager's format."""
        if self.format == "safetensors":
            return _safetensors_files(obj)
        buf = io.BytesIO()
        torch.save(obj, buf)
        return [("pt", buf.getbuffer())]

    def _write_in_place(self, storage: CheckpointStorage, step: int, stepdir: str, cpu_state: dict,
                        metadata: dict) -> Manifest:
        """Object stores: no rename, so the manifest written last is the commit. A new step that fails is
        removed whole. A re-save never deletes the committed step first: its payloads go under new names beside
        the old ones, the manifest is switched to them, and only then are the old payloads deleted."""
        if not storage.list_files(stepdir):
            try:
                return self._write_files(storage, step, stepdir, cpu_state, metadata)
            except BaseException:
                _quietly(storage.remove, stepdir)
                raise
        manifest = self._write_files(storage, step, stepdir, cpu_state, metadata, tag=f".r{uuid.uuid4().hex[:8]}")
        for fname in storage.list_files(stepdir):
            if fname != MANIFEST_NAME and fname not in manifest.files:
                _quietly(storage.remove_file, f"{stepdir}/{fname}")
        return manifest

    def _write_payload(self, storage: CheckpointStorage, relpath: str, data: memoryview) -> None:
        """Write one payload file (a seam: tests replace it to fail midway through a save)."""
        storage.write_bytes(relpath, data)

    def _write_and_rename(self, storage: CheckpointStorage, step: int, stepdir: str, cpu_state: dict,
                          metadata: dict) -> Manifest:
        """Write the step under a temporary name, then commit it by rename (swapping out an existing one).

        A failure removes the temporary directory, so the previous checkpoints stay as they were.
        """
        storage.restore_orphans()
        tmp = tmp_dirname(step)
        try:
            manifest = self._write_files(storage, step, tmp, cpu_state, metadata)
            self._check_fence()  # the rename is the commit
            storage.commit_dir(tmp, stepdir)
        except BaseException:
            _quietly(storage.remove, tmp)
            raise
        return manifest

    def _check_free_space(self, storage: CheckpointStorage) -> None:
        """Refuse a save (``_NoSpace``) when the filesystem reports less free space than the newest valid
        checkpoint took: better one clear checkpoint_failed than a disk filled to the last byte."""
        free = storage.free_bytes()
        if free is None:
            return
        previous = [i for i in self.list() if i.valid]
        if not previous:
            return
        need = previous[-1].total_bytes
        if free < need:
            raise _NoSpace(
                f"not enough free space under {self.url}: {free} bytes free, the previous checkpoint (step "
                f"{previous[-1].step}) took {need} bytes. Fix: free space on that filesystem, lower "
                "checkpoint.keep_last, or point checkpoint.url at a larger one"
            )

    def _check_fence(self) -> None:
        """Raise _Fenced when the fence refuses (a fence that fails to answer refuses too: unknown is not ours)."""
        if self._fence is None:
            return
        try:
            reason = self._fence()
        except Exception as e:  # noqa: BLE001 - the lease could not be read: committing blind is what fencing forbids
            reason = f"the lease could not be read ({type(e).__name__}: {e})"
        if reason:
            raise _Fenced(reason)

    # -- retention --------------------------------------------------------------------------------
    def _prune(self) -> None:
        """Keep the ``keep_last`` newest valid checkpoints this run wrote; drop its older valid ones, and
        incomplete or temporary directories older than the newest valid one. Never deleted: a checkpoint another
        run wrote (the runs this one resumed from included, and steps copied in from elsewhere), the newest valid
        one, one being loaded; nothing at all while the fence refuses. Failures warn (the new checkpoint is
        committed)."""
        try:
            self._check_fence()
        except _Fenced:
            return
        try:
            infos = self.list()
            valid = [i.step for i in infos if i.valid]
            if not valid:
                return
            own = [i.step for i in infos if i.valid and self._own(i)]
            keep = set(own[-self.keep_last:]) | self._loading
            newest = valid[-1]
            for info in infos:
                if info.step == newest or info.step in keep:
                    continue
                if (info.valid and self._own(info)) or (not info.valid and info.step < newest
                                                        and (info.run_id is None or self._own(info))):
                    self.storage.remove(step_dirname(info.step))
            for step, name in list_tmp_dirs(self.storage):  # left by writers that died before their commit
                if step < newest:
                    self.storage.remove(name)
        except Exception as e:  # noqa: BLE001
            msg = f"checkpoint retention under {self.url} failed: {type(e).__name__}: {e}"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            self._emit(CheckpointRetentionFailed(error=msg, url=self.url))

    def _own(self, info: CheckpointInfo) -> bool:
        """Whether this run wrote ``info`` (checkpoints without a run id belong to a manager without one: the
        behavior before run ids existed). Its ancestors' are not its own: they may be copies another run
        still counts on, or the only record of where this run came from."""
        return info.run_id == self.run_id

    # -- listing ----------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Every ``step_N`` directory under ``url`` with its validity, sorted by step."""
        return [self._inspect(step)[0] for step in self.storage.list_steps()]

    def latest_valid_step(self) -> int | None:
        """Step of the newest valid checkpoint (by manifest and sizes), or None."""
        valid = [i.step for i in self.list() if i.valid]
        return valid[-1] if valid else None

    def _inspect(self, step: int) -> tuple[CheckpointInfo, Manifest | None]:
        storage = self.storage
        stepdir = step_dirname(step)
        url = storage.url_for(stepdir)
        present = storage.list_files(stepdir)

        def invalid(reason: str, manifest: Manifest | None = None) -> tuple[CheckpointInfo, None]:
            total = manifest.total_bytes if manifest else sum(present.values())
            meta = manifest.metadata if manifest else {}
            created = manifest.created_t if manifest else None
            run_id, lineage = (manifest.run_id, manifest.lineage) if manifest else (None, ())
            fmt = manifest.format if manifest else None
            return CheckpointInfo(step, url, False, reason, total, meta, created, run_id, lineage, fmt), None

        if MANIFEST_NAME not in present:
            return invalid("no manifest.json (incomplete write)")
        try:
            manifest = parse_manifest(storage.read_bytes(f"{stepdir}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            return invalid("no manifest.json (incomplete write)")
        except ManifestError as e:
            return invalid(str(e))
        if manifest.step != step:
            return invalid(f"manifest says step {manifest.step}, directory says {step}", manifest)
        reason = check_sizes(manifest, present)
        if reason:
            return invalid(reason, manifest)
        info = CheckpointInfo(step, url, True, None, manifest.total_bytes, manifest.metadata, manifest.created_t,
                              manifest.run_id, manifest.lineage, manifest.format)
        return info, manifest

    # -- load -------------------------------------------------------------------------------------
    def load(self, step: int | None = None) -> LoadedCheckpoint | None:
        """Load checkpoint ``step``, or with None the newest one that is valid and passes its checksums.

        With None, each newer checkpoint that is incomplete or corrupt is skipped with ``warnings.warn``
        and a ``checkpoint_skipped`` event, and None is returned if no checkpoint can be loaded. With an
        explicit step that is absent, invalid or corrupt: CheckpointError naming the reason. Payloads are
        read with ``torch.load(weights_only=True, map_location="cpu")``: loading never runs pickled code.
        Waits for an in-flight save first (its failure is still reported by the next save()/wait()).
        """
        self._join()
        if step is not None:
            steps = self.storage.list_steps()
            if step not in steps:
                fix = (f"load one of the steps there ({', '.join(map(str, steps[-10:]))}), or load() with no step "
                       "for the newest valid one") if steps else "check the URL: nothing was saved under it"
                raise CheckpointError(f"no checkpoint at step {step} under {self.url}. Fix: {fix}")
            reason, loaded = self._try_load(step)
            if loaded is None:
                raise CheckpointError(f"checkpoint {self.storage.url_for(step_dirname(step))} is not valid: "
                                      f"{reason}. Fix: {_INVALID_FIX}")
            return self._adopt(loaded)
        # Another writer may commit newer steps and delete older ones while this loop runs: steps that vanished
        # are not corrupt (no skip event), and the listing is taken again until no untried step is left.
        tried: set[int] = set()
        for _ in range(5):
            candidates = [c for c in reversed(self.storage.list_steps()) if c not in tried]
            if not candidates:
                break
            for candidate in candidates:
                tried.add(candidate)
                reason, loaded = self._try_load(candidate)
                if loaded is not None:
                    return self._adopt(loaded)
                if self.storage.exists(step_dirname(candidate)):
                    self._skip(self._inspect(candidate)[0], reason)
        return None

    def verify(self, step: int) -> str | None:
        """Why :meth:`load` would skip checkpoint ``step`` (everything it checks, payloads deserialized too),
        or None when it would load it."""
        self._join()
        return self._try_load(step)[0]

    def _try_load(self, step: int) -> tuple[str | None, LoadedCheckpoint | None]:
        self._loading.add(step)
        try:
            info, manifest = self._inspect(step)
            if manifest is None:
                return info.reason, None
            return None, self._read(manifest)
        except _Unreadable as e:
            return str(e), None
        finally:
            self._loading.discard(step)

    def _adopt(self, loaded: LoadedCheckpoint) -> LoadedCheckpoint:
        """This manager's later saves descend from ``loaded``: its lineage, then this run."""
        if self.run_id is not None:
            ancestors = tuple(r for r in loaded.lineage if r != self.run_id)
            self.lineage = (*ancestors, self.run_id)
            if loaded.run_id != self.run_id:
                self.resumed_from = {"run_id": loaded.run_id, "step": loaded.step}
        return loaded

    def _skip(self, info: CheckpointInfo, reason: str) -> None:
        warnings.warn(f"skipping checkpoint {info.url}: {reason}", RuntimeWarning, stacklevel=3)
        self._emit(CheckpointSkipped(step=info.step, reason=reason, url=info.url))

    def _read(self, manifest: Manifest) -> LoadedCheckpoint:
        stepdir = step_dirname(manifest.step)
        blobs = {}
        # Verify every checksum before deserializing anything, so a corrupt checkpoint costs no unpickling.
        for fname in manifest.files:
            try:
                data = self.storage.read_bytes(f"{stepdir}/{fname}")
            except FileNotFoundError as e:
                raise _Unreadable(f"missing file {fname}") from e
            reason = check_checksum(manifest, fname, data)
            if reason:
                raise _Unreadable(reason)
            if manifest.format == DCP_FORMAT and _is_dcp_file(fname):
                _check_dcp_file(fname, data)  # verified, not kept: every rank reads its own shards
                continue
            blobs[fname] = data
        state = {}
        files_of: dict[str, dict[str, bytes]] = {}
        for fname, data in blobs.items():
            match = _PAYLOAD_FILE_RE.match(fname)
            if match is None:
                raise _Unreadable(f"{fname} is not a payload file name")
            files_of.setdefault(match["name"], {})[match["ext"]] = data
        for name, files in files_of.items():
            try:
                state[name] = _deserialize("safetensors" if manifest.format == DCP_FORMAT else manifest.format, files)
            except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError: refuse, never run code
                raise _Unreadable(f"payload {name!r} cannot be read back safely ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from e
        return LoadedCheckpoint(step=manifest.step, state=state, metadata=dict(manifest.metadata),
                                run_id=manifest.run_id, lineage=manifest.lineage, format=manifest.format,
                                files=dict(manifest.files))

    # -- events -----------------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event.event, event.fields())
        except Exception:  # noqa: BLE001 - a broken listener must not break checkpointing
            log.exception("checkpoint event listener failed on %s", event.event)


def _deserialize(fmt: str, files: dict[str, bytes]) -> Any:
    """One payload from its files: ``torch.load(weights_only=True)``, or safetensors + JSON (no unpickling)."""
    if fmt == "safetensors":
        from safetensors.torch import load as st_load

        from .wire import join

        return join(json.loads(files["json"]), st_load(files["safetensors"]))
    return torch.load(io.BytesIO(files["pt"]), weights_only=True, map_location="cpu")


def _safetensors_files(obj: Any) -> list[tuple[str, Any]]:
    """A payload's files without pickle: its tensors as safetensors, the rest as JSON (:func:`.wire.split`)."""
    from safetensors.torch import save as st_save

    from .wire import split

    skeleton, tensors = split(obj)
    return [("safetensors", st_save(tensors)), ("json", json.dumps(skeleton, separators=(",", ":")).encode())]


def _is_dcp_file(fname: str) -> bool:
    return fname == DCP_INDEX or fname.endswith(DCP_SHARD_SUFFIX)


def _check_dcp_file(fname: str, data: bytes) -> None:
    """A DCP checkpoint's index must read back safely (its checksum is verified already); shards are DCP's."""
    from .dcp_metadata import UnsafeCheckpoint, parse_metadata  # torch DCP: imported when a DCP index is read

    if fname == DCP_INDEX:
        try:
            parse_metadata(data)
        except UnsafeCheckpoint as e:
            raise _Unreadable(str(e)) from e


def _quietly(remove: Callable[[str], None], relpath: str) -> None:
    """Clean up after a failed save; the save's own error is the one to report."""
    try:
        remove(relpath)
    except Exception:  # noqa: BLE001
        log.exception("could not remove partial checkpoint file(s) %s", relpath)


def _check_payload_names(state: dict) -> None:
    if not isinstance(state, dict) or not state:
        raise CheckpointError("checkpoint state must be a non-empty dict of payload name -> object, e.g. "
                              "{'model': model.state_dict()}")
    for name in state:
        if (not isinstance(name, str) or not _PAYLOAD_NAME_RE.match(name) or name == "manifest"
                or _PAYLOAD_FILE_RE.match(f"{name}.pt")["name"] != name):
            raise CheckpointError(
                f"checkpoint payload name {name!r} is not usable as a file name. Fix: name payloads with letters, "
                "digits, _ . - that start with a letter or digit"
            )

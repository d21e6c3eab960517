"""Checkpoint storage: a thin fsspec wrapper addressed by ``str`` URLs.

URLs stay strings end to end (never ``pathlib``), so ``s3://bucket/x`` is never mangled into ``s3:/bucket/x``.
Object stores have no atomic rename: there writes go straight to their final name and a checkpoint becomes
visible only when its manifest is written last (see :mod:`orchestrator.checkpoint.manifest`). On a filesystem
with rename (local disk, NFS) a step is written under a temporary name and committed by renaming it
(:meth:`CheckpointStorage.commit_dir`); temporary names never match ``step_N`` and are never listed.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

STEP_DIR_RE = re.compile(r"^step_(\d+)$")
# Names a save uses before its commit; they start with "." and never match STEP_DIR_RE.
TMP_DIR_RE = re.compile(r"^\.step_(\d+)\.tmp-[0-9a-f]+$")
OLD_DIR_RE = re.compile(r"^\.step_(\d+)\.old-[0-9a-f]+$")


class UnusableURL(ValueError):
    """A checkpoint URL that names no place to write (``s3://``, ``file:///``); ``problem`` and ``fix`` say why."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")


def normalize_url(url: str) -> str:
    """``url`` with trailing slashes dropped from its path (never from ``scheme://``), or UnusableURL.

    Refused: an empty URL, a scheme with no bucket or path after it (``s3://``, ``gs://``, ``memory://``,
    ``file://``) and ``file:///`` (the filesystem root). ``file:///abs/path`` keeps meaning ``/abs/path``.
    """
    if not isinstance(url, str) or not url.strip():
        raise UnusableURL("is empty", "give a local path or a URL with a bucket and path, e.g. s3://my-bucket/ckpt")
    if "://" not in url:
        return url.rstrip("/") or url  # a plain path; "/" stays "/"
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        if not rest.strip("/"):
            what = "names the filesystem root" if rest else "has no path after 'file://'"
            raise UnusableURL(what, "give an absolute directory, e.g. file:///data/ckpt (or the plain path /data/ckpt)")
        return f"file://{rest.rstrip('/')}"
    if not rest.strip("/"):
        example = f"{scheme}://my-bucket/checkpoints" if scheme in ("s3", "gs", "gcs", "az", "abfs") \
            else f"{scheme}://some/path"
        raise UnusableURL(f"has no bucket or path after '{scheme}://'", f"name a bucket and prefix, e.g. {example}")
    return f"{scheme}://{rest.rstrip('/')}"


def tmp_dirname(step: int) -> str:
    """A fresh temporary directory name for writing ``step`` before its commit (unique per save)."""
    return f".step_{step}.tmp-{uuid.uuid4().hex}"


def step_dirname(step: int) -> str:
    """Directory name of a step: ``step_`` plus the step zero-padded to 9 digits (sorts as text too)."""
    return f"step_{step:09d}"


def url_scheme(url: str) -> str:
    """The scheme of ``url`` (``"file"`` for a plain path)."""
    return url.split("://", 1)[0] if "://" in url else "file"


def missing_package_for(scheme: str) -> str | None:
    """The pip package fsspec needs for ``scheme`` (e.g. ``"s3fs"`` for s3), or None if fsspec has none."""
    impl = known_implementations.get(scheme)
    return impl["class"].split(".", 1)[0] if impl else None


class CheckpointStorage:
    """Byte-level access to everything under one root URL.

    Contract: relative paths use ``/`` and never start with ``/``; ``read_bytes`` and ``list_files`` always
    see the store as it is now (fsspec's listing cache is dropped first, since other processes write too).
    Raises what fsspec raises: ``ValueError`` for an unknown scheme, ``ImportError`` for a missing backend
    package, ``OSError`` subclasses for I/O failures.
    """

    def __init__(self, url: str, **storage_options: Any):
        self.url = normalize_url(url)
        self.fs, self.root = url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/") or "/"
        # Local disks (and memory) need real directories before a file can be created in them; object
        # stores must NOT get makedirs: s3fs/gcsfs makedirs on a missing bucket would create the bucket.
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.needs_dirs = self.is_local or "memory" in _protocols(self.fs)
        # Only a local (or NFS) mount gives an atomic directory rename; s3fs/gcsfs "mv" is copy + delete.
        self.has_rename = self.is_local
        self.atomic_create = self.is_local or _has_conditional_put(self.fs)
        """Whether :meth:`create_exclusive` is atomic here (see there); False: check, then write."""

    # -- addressing -------------------------------------------------------------------------------
    def path(self, relpath: str = "") -> str:
        """Filesystem path (as fsspec wants it) of ``relpath`` under the root."""
        if not relpath:
            return self.root
        return f"{self.root.rstrip('/')}/{relpath.lstrip('/')}"

    def url_for(self, relpath: str = "") -> str:
        """User-facing URL of ``relpath``, built on the URL the caller gave (so it reads back the same)."""
        return f"{self.url}/{relpath}" if relpath else self.url

    # -- writes -----------------------------------------------------------------------------------
    def makedirs(self, relpath: str = "") -> None:
        """Create ``relpath`` as a directory where the filesystem has directories; a no-op on object stores."""
        if self.needs_dirs:
            self.fs.makedirs(self.path(relpath), exist_ok=True)

    def write_bytes(self, relpath: str, data: bytes | memoryview) -> None:
        """Write ``data`` to ``relpath`` under its final name, replacing any old content.

        On a local disk the data is fsynced before returning, so that a manifest written afterwards never
        reaches the disk before the payload it describes (a power loss otherwise could reorder them).
        """
        path = self.path(relpath)
        if self.needs_dirs:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, bytes(data))

    def write_bytes_atomic(self, relpath: str, data: bytes | memoryview) -> None:
        """Like :meth:`write_bytes`, but on a local disk through a temporary file and ``os.replace``, so a
        reader sees the old content or the new, never a torn file. Elsewhere the same as write_bytes."""
        if not self.is_local:
            self.write_bytes(relpath, data)
            return
        tmp = f"{relpath}.tmp-{uuid.uuid4().hex}"
        try:
            self.write_bytes(tmp, data)
            os.replace(self.path(tmp), self.path(relpath))
        except BaseException:
            self.remove_file(tmp)
            raise
        _fsync_dir(self.path(relpath).rsplit("/", 1)[0])

    def create_exclusive(self, relpath: str, data: bytes) -> bool:
        """Create ``relpath`` holding ``data`` only if it does not exist: True if this call created it, False if
        it existed. Readers see the whole content or no file, never a part.

        Atomic where :attr:`atomic_create` says so: on a local disk or NFS the data is written to a private
        temporary file and hard-linked to ``relpath`` (``link`` fails when the name exists, also over NFS,
        where ``O_EXCL`` alone would expose an empty file); on S3 (s3fs) a PUT with ``If-None-Match: *``; on GCS
        (gcsfs) an upload with ``ifGenerationMatch=0``. Elsewhere it checks, then writes: two callers racing
        within that window may both get True, the later write winning."""
        if self.is_local:
            return self._link_exclusive(relpath, data)
        path = self.path(relpath)
        if self.needs_dirs:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            if self.atomic_create or "memory" in _protocols(self.fs):  # memory: one process, open("xb")
                self.fs.pipe_file(path, bytes(data), mode="create")
            elif self.exists(relpath):
                return False
            else:
                self.fs.pipe_file(path, bytes(data))
        except FileExistsError:
            return False
        finally:
            self.fs.invalidate_cache(path)
        return True

    def _link_exclusive(self, relpath: str, data: bytes) -> bool:
        tmp = f"{relpath}.tmp-{uuid.uuid4().hex}"
        self.write_bytes(tmp, data)
        try:
            os.link(self.path(tmp), self.path(relpath))
        except FileExistsError:
            # NFS may retry a link whose reply was lost and report EEXIST for its own success: the temporary
            # file then has two links.
            return os.stat(self.path(tmp)).st_nlink == 2
        finally:
            self.remove_file(tmp)
        _fsync_dir(self.path(relpath).rsplit("/", 1)[0])
        return True

    def commit_dir(self, tmp_relpath: str, final_relpath: str) -> None:
        """Make the fully written ``tmp_relpath`` directory appear as ``final_relpath`` (needs has_rename).

        An existing ``final_relpath`` is renamed aside first, the new one renamed in, then the old one
        deleted: a valid copy exists at every moment (after a crash between the two renames it is the
        ``.step_N.old-*`` directory, which :meth:`restore_orphans` puts back). If renaming the new one in
        fails, the old one is put back before the error propagates.
        """
        if not self.has_rename:
            raise NotImplementedError("commit_dir needs a filesystem with atomic rename")
        final = self.path(final_relpath)
        tmp = self.path(tmp_relpath)
        parent = final.rsplit("/", 1)[0]
        if not os.path.exists(final):
            os.rename(tmp, final)
            _fsync_dir(parent)
            return
        match = STEP_DIR_RE.match(final_relpath.rsplit("/", 1)[-1])
        label = f"step_{int(match.group(1))}" if match else final_relpath.rsplit("/", 1)[-1].lstrip(".")
        old = f"{parent}/.{label}.old-{uuid.uuid4().hex}"
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)

    def restore_orphans(self) -> None:
        """Put back a ``.step_N.old-*`` directory whose ``step_N`` is missing (a writer died mid-swap).

        Only on filesystems with rename; a no-op elsewhere and when the root does not exist.
        """
        if not self.has_rename or not os.path.isdir(self.root):
            return
        names = os.listdir(self.root)
        for name in names:
            match = OLD_DIR_RE.match(name)
            if not match:
                continue
            final = f"{self.root}/{step_dirname(int(match.group(1)))}"
            if os.path.exists(final):
                shutil.rmtree(f"{self.root}/{name}", ignore_errors=True)
            else:
                os.rename(f"{self.root}/{name}", final)

    def free_bytes(self) -> int | None:
        """Free space under the root where the filesystem reports it (local disks), else None."""
        if not self.is_local:
            return None
        path = self.root
        while path and not os.path.exists(path):
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        try:
            return shutil.disk_usage(path or ".").free
        except OSError:
            return None

    def remove(self, relpath_dir: str) -> None:
        """Delete ``relpath_dir`` and everything under it; missing is fine."""
        try:
            self.fs.rm(self.path(relpath_dir), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path(relpath_dir))

    def remove_file(self, relpath: str) -> None:
        """Delete one file; missing is fine."""
        try:
            self.fs.rm_file(self.path(relpath))
        except FileNotFoundError:
            pass

    # -- reads ------------------------------------------------------------------------------------
    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of ``relpath``; ``FileNotFoundError`` if it is absent."""
        return self.fs.cat_file(self.path(relpath))

    def exists(self, relpath: str = "") -> bool:
        """Whether ``relpath`` (file or directory) exists now."""
        self.fs.invalidate_cache(self.path(relpath))
        return self.fs.exists(self.path(relpath))

    def list_files(self, relpath_dir: str) -> dict[str, int]:
        """Name -> size in bytes of the plain files directly in ``relpath_dir`` ({} if it is absent).

        One listing call, so validating a checkpoint on an object store costs one request, not one per file.
        """
        path = self.path(relpath_dir)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    def list_steps(self) -> list[int]:
        """Steps of every ``step_N`` directory under the root, ascending; [] if the root does not exist.

        A directory is listed whether or not it holds a complete checkpoint: validity is the manifest's job.
        """
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        steps = []
        for e in entries:
            match = STEP_DIR_RE.match(e["name"].rstrip("/").rsplit("/", 1)[-1])
            if match and e.get("type") == "directory":
                steps.append(int(match.group(1)))
        return sorted(set(steps))


def _fsync_dir(path: str) -> None:
    """Persist a rename in ``path`` (a directory entry) where the OS allows opening directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_tmp_dirs(storage: "CheckpointStorage") -> list[tuple[int, str]]:
    """(step, name) of every temporary ``.step_N.tmp-*`` directory under the root (left by dead writers)."""
    storage.fs.invalidate_cache(storage.root)
    try:
        entries = storage.fs.ls(storage.root, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        match = TMP_DIR_RE.match(name)
        if match and e.get("type") == "directory":
            out.append((int(match.group(1)), name))
    return out


_CONDITIONAL_PUT_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}  # s3fs: If-None-Match: *; gcsfs: ifGenerationMatch=0


def _has_conditional_put(fs: Any) -> bool:
    """Whether ``fs.pipe_file(..., mode="create")`` is a conditional create on the server (s3fs and gcsfs
    releases that take ``mode``), not fsspec's generic check-then-write."""
    if not _CONDITIONAL_PUT_PROTOCOLS & set(_protocols(fs)):
        return False
    import inspect

    try:
        return "mode" in inspect.signature(type(fs)._pipe_file).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)

"""Checkpoint storage: a thin fsspec wrapper addressed by ``str`` URLs.

URLs stay strings end to end (never ``pathlib``), so ``s3://bucket/x`` is never mangled into ``s3:/bucket/x``.
Writes go straight to their final name because object stores have no atomic rename; a checkpoint becomes
visible only when its manifest is written last (see :mod:`orchestrator.checkpoint.manifest`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

STEP_DIR_RE = re.compile(r"^step_(\d+)$")


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
        self.url = url.rstrip("/") if url.rstrip("/") else url
        self.fs, self.root = url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/") or "/"
        # Local disks (and memory) need real directories before a file can be created in them; object
        # stores must NOT get makedirs: s3fs/gcsfs makedirs on a missing bucket would create the bucket.
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.needs_dirs = self.is_local or "memory" in _protocols(self.fs)

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


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)

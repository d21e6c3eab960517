"""The checkpoint manifest: what makes a ``step_N`` directory a checkpoint.

``manifest.json`` is written LAST, after every payload file. It lists each file with its size and sha256,
plus ``step``, ``format_version``, ``created_t`` and a caller-supplied JSON ``metadata`` dict, and (optional, so
older manifests still parse) the payload ``format`` (``torch``, ``safetensors``, or ``dcp``: DCP shards plus
safetensors + JSON payloads), the ``run_id`` that wrote it
and its ``lineage``: the run ids it descends from, oldest first, ending with its own, and ``resumed_from``
(``{"run_id", "step"}`` of the checkpoint its run resumed from, or null). Retention reads ``run_id``: a run
deletes only the steps it wrote. A directory without a parseable manifest is not a checkpoint (a writer died
before committing). A checkpoint is *valid* when every listed file exists with the listed size; checksums are
checked when payloads are read, because reading every byte just to list checkpoints would be too slow on an
object store.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
PAYLOAD_FORMATS = ("torch", "safetensors")
DCP_FORMAT = "dcp"  # model and optimizer as torch DCP shards (every rank's), the rest as safetensors + JSON
MANIFEST_FORMATS = (*PAYLOAD_FORMATS, DCP_FORMAT)
DCP_INDEX = ".metadata"  # a dcp checkpoint's DCP files: the index (read safely, dcp_metadata.py) and the shards
DCP_SHARD_SUFFIX = ".distcp"
_LATEST_T = 4102444800.0  # 2100-01-01: a created_t beyond it is not a time this manifest was written at


class ManifestError(ValueError):
    """A manifest that cannot be parsed or does not describe a checkpoint of this format."""


@dataclass(frozen=True)
class FileEntry:
    """One payload file of a checkpoint: its size in bytes and hex sha256."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest. ``files`` maps file name (relative to the step directory) to its entry."""

    step: int
    format_version: int
    created_t: float
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = "torch"
    run_id: str | None = None
    lineage: tuple[str, ...] = ()
    resumed_from: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        """Sum of the listed payload sizes."""
        return sum(e.size for e in self.files.values())


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def build_manifest(
    step: int, files: Mapping[str, FileEntry], metadata: Mapping[str, Any], created_t: float | None = None,
    **lineage: Any,
) -> Manifest:
    """A manifest for ``files`` already written at ``step``. ``metadata`` must be JSON-serializable.
    ``lineage``: the optional ``format``, ``run_id``, ``lineage``, ``resumed_from`` fields."""
    return Manifest(
        step=int(step),
        format_version=FORMAT_VERSION,
        created_t=time.time() if created_t is None else float(created_t),
        files=dict(files),
        metadata=dict(metadata),
        **lineage,
    )


def encode_manifest(manifest: Manifest) -> bytes:
    """The JSON bytes stored as ``manifest.json``. Raises ``TypeError`` if metadata is not JSON."""
    doc = {
        "format_version": manifest.format_version,
        "step": manifest.step,
        "created_t": manifest.created_t,
        "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in manifest.files.items()},
        "metadata": manifest.metadata,
        "format": manifest.format,
    }
    if manifest.run_id is not None:
        doc.update(run_id=manifest.run_id, lineage=list(manifest.lineage), resumed_from=manifest.resumed_from)
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode()


def parse_manifest(data: bytes) -> Manifest:
    """Parse ``manifest.json`` bytes; raises :class:`ManifestError` naming what is wrong."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"unsupported format_version {version!r} (this orch reads {FORMAT_VERSION})")
    try:
        files = {
            str(name): FileEntry(size=int(e["size"]), sha256=str(e["sha256"]))
            for name, e in doc["files"].items()
        }
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TypeError("metadata is not an object")
        created_t = float(doc["created_t"])
        if not (math.isfinite(created_t) and 0 <= created_t <= _LATEST_T):
            raise ValueError(f"created_t {doc['created_t']!r} is not a time (unix seconds before 2100)")
        fmt = doc.get("format", "torch")
        if fmt not in MANIFEST_FORMATS:
            raise ValueError(f"unknown payload format {fmt!r}")
        lineage = doc.get("lineage") or []
        resumed = doc.get("resumed_from")
        if not isinstance(lineage, list) or not all(isinstance(r, str) for r in lineage) or not (
                resumed is None or isinstance(resumed, dict)):
            raise TypeError("lineage is not a list of run ids, or resumed_from not an object")
        run_id = doc.get("run_id")
        return Manifest(
            step=int(doc["step"]),
            format_version=version,
            created_t=created_t,
            files=files,
            metadata=metadata,
            format=fmt,
            run_id=None if run_id is None else str(run_id),
            lineage=tuple(lineage),
            resumed_from=resumed,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"manifest is malformed ({type(e).__name__}: {e})") from e


def check_sizes(manifest: Manifest, present: Mapping[str, int]) -> str | None:
    """Why the files ``present`` (name -> size) do not match ``manifest``, or None when they all do."""
    for name, entry in manifest.files.items():
        if name not in present:
            return f"missing file {name}"
        if present[name] != entry.size:
            return f"size mismatch for {name}: {present[name]} bytes, manifest says {entry.size}"
    return None


def check_checksum(manifest: Manifest, name: str, data: bytes | memoryview) -> str | None:
    """Why ``data`` is not the file ``name`` of ``manifest`` (size or sha256 differ), or None if it is."""
    entry = manifest.files.get(name)
    if entry is None:
        return f"{name} is not listed in the manifest"
    if len(data) != entry.size:
        return f"size mismatch for {name}: {len(data)} bytes, manifest says {entry.size}"
    if sha256_hex(data) != entry.sha256:
        return f"checksum mismatch for {name} (sha256 differs from the manifest: corrupt)"
    return None

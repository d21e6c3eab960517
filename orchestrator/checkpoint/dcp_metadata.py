"""Reading torch DCP checkpoints without trusting them: the ``.metadata`` index through an allowlist unpickler.

DCP's own reader ``pickle.load``\\ s ``.metadata`` and reads non-tensor items with ``torch.load(weights_only=False)``:
whoever can write to the checkpoint URL could run code in every rank that resumes from it. orch's DCP engine
gives DCP tensors only (the rest goes through the pickle-free codec, orchestrator/checkpoint/wire.py), so
here ``.metadata`` is checked against the sha256 its manifest lists, then unpickled by :class:`_Allowlist`
(DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts, paths, plain containers: constructing them runs no
user code), and a checkpoint whose index holds any non-tensor (bytes) item is refused. Tensor shards are read by
DCP itself with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.planner import LoadItemType

from .manifest import DCP_INDEX as METADATA_NAME
from .manifest import DCP_SHARD_SUFFIX as SHARD_SUFFIX

_ALLOWED: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                               "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                               "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "pathlib": ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
    "collections": ("OrderedDict",),
    "builtins": ("set", "frozenset", "tuple", "list", "dict"),
}


class UnsafeCheckpoint(ValueError):
    """A DCP checkpoint orch will not read: its index fails its checksum, names a class outside the allowlist,
    or holds non-tensor (pickled) items."""


class _Allowlist(pickle.Unpickler):
    """Finds only the classes a DCP index is made of; anything else (``os.system``, ``builtins.eval``) refuses."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{METADATA_NAME} refers to {module}.{name}, which a DCP index never holds (refused "
                               "unread: loading it could run code)")


def parse_metadata(data: bytes, expected_sha256: Optional[str] = None) -> dcp_meta.Metadata:
    """The DCP index in ``data``: checked against ``expected_sha256`` (its manifest's), unpickled by the
    allowlist, tensors only. UnsafeCheckpoint otherwise; nothing in ``data`` runs."""
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise UnsafeCheckpoint(f"{METADATA_NAME} does not match the sha256 its manifest lists (changed after commit)")
    try:
        metadata = _Allowlist(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or malformed: refused, never half-read
        raise UnsafeCheckpoint(f"{METADATA_NAME} is not a DCP index ({type(e).__name__}: {str(e)[:120]})") from e
    if not isinstance(metadata, dcp_meta.Metadata):
        raise UnsafeCheckpoint(f"{METADATA_NAME} holds a {type(metadata).__name__}, not a DCP index")
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items()
                     if not isinstance(v, dcp_meta.TensorStorageMetadata))
    if pickled:
        raise UnsafeCheckpoint(f"{METADATA_NAME} holds non-tensor items ({', '.join(pickled[:5])}), which DCP reads "
                               "with torch.load(weights_only=False); orch's checkpoints give DCP tensors only")
    return metadata


def saved_shapes(metadata: dcp_meta.Metadata, prefix: str) -> dict[str, torch.Size]:
    """The global shape of every tensor under ``prefix.`` (one component's state dict), keyed without it."""
    head = f"{prefix}."
    return {k[len(head):]: v.size for k, v in metadata.state_dict_metadata.items() if k.startswith(head)}


class SafeReader(FsspecReader):
    """DCP's fsspec reader with the index read by :func:`parse_metadata` (checked against ``metadata_sha256``)
    and bytes items refused: what every rank loads a DCP checkpoint through."""

    def __init__(self, path: str, metadata_sha256: Optional[str], **kwargs: Any):
        super().__init__(path, **kwargs)
        self.metadata_sha256 = metadata_sha256

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_NAME), "rb") as stream:
            metadata = parse_metadata(stream.read(), self.metadata_sha256)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_meta.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise UnsafeCheckpoint("the load plan reads non-tensor items, which DCP would torch.load unsafely")
        return super().read_data(plan, planner)

"""Checkpoints through fsspec (local, file://, s3://, gs://, memory://): atomic by manifest-last, async save.

Layout: ``<url>/step_<N:09d>/{<payload>.pt..., manifest.json}``. See :mod:`.manager` for the protocol.
"""

from .errors import CheckpointError, CheckpointFenced, CheckpointSetupError
from .inspect import format_checkpoint_detail, format_checkpoint_list
from .manager import CheckpointInfo, CheckpointManager, LoadedCheckpoint
from .manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, ManifestError
from .preflight import open_storage, preflight_storage
from .storage import CheckpointStorage, step_dirname

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointFenced",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointSetupError",
    "CheckpointStorage",
    "FileEntry",
    "LoadedCheckpoint",
    "Manifest",
    "ManifestError",
    "format_checkpoint_detail",
    "format_checkpoint_list",
    "open_storage",
    "preflight_storage",
    "step_dirname",
]

"""Checkpoints through fsspec (local, file://, s3://, gs://, memory://): atomic by manifest-last, async save.

Layout: ``<url>/step_<N:09d>/{<payload>.pt..., manifest.json}``. See :mod:`.manager` for the protocol.

The names below are loaded on first use (PEP 562): the driver takes leases and checks storage through this
package's torch-free modules (``lease``, ``storage``, ``preflight``) without importing torch, which only the
workers and the checkpoint tools need.
"""

from __future__ import annotations

from orchestrator.plugins import lazy_exports

_EXPORTS = {
    "CheckpointError": "errors", "CheckpointFenced": "errors", "CheckpointSetupError": "errors",
    "format_checkpoint_detail": "inspect", "format_checkpoint_list": "inspect",
    "CheckpointInfo": "manager", "CheckpointManager": "manager", "LoadedCheckpoint": "manager",
    "FORMAT_VERSION": "manifest", "MANIFEST_NAME": "manifest", "FileEntry": "manifest", "Manifest": "manifest",
    "ManifestError": "manifest",
    "open_storage": "preflight", "preflight_storage": "preflight",
    "CheckpointStorage": "storage", "step_dirname": "storage",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

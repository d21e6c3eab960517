"""Errors of the checkpoint package; defined in orch's one hierarchy (:mod:`orchestrator.errors`)."""

from __future__ import annotations

from orchestrator.errors import CheckpointError, CheckpointSetupError

__all__ = ["CheckpointError", "CheckpointSetupError"]

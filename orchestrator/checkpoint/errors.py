"""Errors of the checkpoint package, rooted in orch's one hierarchy (:mod:`orchestrator.errors`)."""

from __future__ import annotations

from orchestrator.errors import OrchError


class CheckpointError(OrchError):
    """A checkpoint could not be saved or loaded: a failed (background) write, an invalid or corrupt
    checkpoint asked for by step, or state that cannot be stored safely. Exit code 1 (a run failure)."""

"""Errors of the checkpoint package; defined in orch's one hierarchy (:mod:`orchestrator.errors`)."""

from __future__ import annotations

from orchestrator.errors import CheckpointError, CheckpointSetupError


class CheckpointFenced(CheckpointError):
    """A save refused because the writer's lease on the checkpoint URL is not its run's any more (see
    :mod:`orchestrator.checkpoint.fence`): nothing was committed. Exit 1."""


__all__ = ["CheckpointError", "CheckpointFenced", "CheckpointSetupError"]

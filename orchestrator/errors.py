"""One error hierarchy for orch.

Every error a user can cause or meet derives from :class:`OrchError`. The CLI prints ``str(error)`` as one
line and exits with ``error.exit_code``: 2 for bad input (config, environment), 1 for a run that failed.
"""

from __future__ import annotations

from typing import Any


class OrchError(Exception):
    """Base of every error orch raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UserError(OrchError):
    """Bad input from the user: exit 2, nothing started, nothing half-written."""

    exit_code = 2


class ConfigError(UserError):
    """A config key holds a value orch cannot use. The message names the key, the value and the fix."""

    def __init__(self, key: str, value: Any, fix: str, problem: str = "is invalid"):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r} {problem}. Fix: {fix}")


class EnvironmentMismatch(UserError):
    """The machine cannot run what the config asks for (no CUDA, too few GPUs, unreachable cluster)."""


class CheckpointError(OrchError):
    """A checkpoint could not be saved or loaded: a failed (background) write, an invalid or corrupt checkpoint
    asked for by step, or state that cannot be stored safely. The message names the step and URL. Exit 1."""


class CheckpointSetupError(CheckpointError, UserError):
    """The checkpoint code cannot work as set up: a URL it cannot use (unknown scheme, missing package, missing
    bucket, missing or bad credentials, not writable) or a bad setting. Raised before anything is written.
    Exit 2. ``subject`` names what is wrong (``checkpoint URL 's3://b/x'``), then the problem and the fix."""

    exit_code = 2

    def __init__(self, subject: str, problem: str, fix: str):
        self.subject, self.problem, self.fix = subject, problem, fix
        super().__init__(f"{subject} {problem}. Fix: {fix}")


class RunFailed(OrchError):
    """A launched run ended in failure; the message names the root-cause rank and its error."""

    exit_code = 1


class Interrupted(OrchError):
    """The user stopped a run (SIGINT/SIGTERM to orch); every process it started was ended."""

    exit_code = 130


class Preempted(OrchError):
    """orch itself was told to leave (SIGTERM, e.g. a pod eviction) and every node checkpointed first.
    Exit code 75 (EX_TEMPFAIL) lets schedulers treat it as "run again", not as a failure."""

    exit_code = 75

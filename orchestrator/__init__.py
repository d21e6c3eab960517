"""orch: an elastic distributed training orchestrator for PyTorch.

The Python API (docs/python-api.md)::

    import orchestrator

    cfg = orchestrator.compose("cpu_gloo", ["trainer.max_steps=5"])        # the validated OrchConfig
    result = orchestrator.launch("cpu_gloo", ["trainer.max_steps=5"])      # a LaunchResult; prints nothing

Importing this package is cheap: the functions import what they need (Hydra, torch, Ray) when called.
"""

from __future__ import annotations

import sys as _sys
import types as _types
from typing import TYPE_CHECKING, Optional, Sequence, TextIO

if TYPE_CHECKING:
    from orchestrator.config.schema import OrchConfig
    from orchestrator.launch import LaunchResult

__version__ = "0.1.0"
__all__ = ["compose", "launch", "__version__"]


def compose(preset: str, overrides: Sequence[str] = ()) -> "OrchConfig":
    """Compose preset ``preset`` (a ``conf/*.yaml`` name, as ``orch launch conf=NAME``) with Hydra
    ``overrides`` (``["trainer.max_steps=5", "cluster.nnodes=1:2"]``) and validate it, as ``orch launch`` does.

    Returns the typed config (an ``OrchConfig``). ``run.dir`` is as given (``None`` unless set): a launch picks
    the default run dir itself. Raises ConfigError/UserError (the CLI's exit 2) for a bad preset or override.
    A Hydra app of the caller's own (``@hydra.main``, ``initialize()``) is left as it was.
    """
    from orchestrator.config.compose import compose_config

    return compose_config(preset, list(overrides))


def launch(preset: str, overrides: Sequence[str] = (), *, echo: Optional[TextIO] = None,
           dry_run: bool = False) -> "LaunchResult":
    """Run preset ``preset`` with Hydra ``overrides``, as ``orch launch conf=PRESET OVERRIDES...`` does, and
    return a ``LaunchResult`` (``status``, ``run_dir``, ``run_id``, ``summary``) once the run succeeded.

    Prints nothing: ``echo=sys.stdout`` (any text stream) shows node output, live progress and a dry run's
    plan there. ``dry_run``: start nothing; the result's ``status`` is ``dry-run`` and ``plan`` holds the plan.
    Raises what the CLI turns into exit codes (orchestrator.errors): UserError/ConfigError (2: bad input,
    nothing written), RunFailed (1), Preempted (75), Interrupted (130); a run's error carries its
    LaunchResult as ``error.result``. A Hydra app of the caller's own is left as it was.
    """
    from orchestrator.launch import launch_preset

    return launch_preset(preset, list(overrides), echo=echo, dry_run=dry_run)


class _Package(_types.ModuleType):
    """Keeps ``orchestrator.launch`` the function above. Importing the submodule ``orchestrator.launch`` (the
    implementation) would otherwise replace the package's attribute with the module, so a second call of
    ``orchestrator.launch(...)`` would find a module. The submodule is still ``sys.modules["orchestrator.launch"]``
    and ``from orchestrator.launch import ...`` works as before."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

"""Registries of named plug-ins: orch's own by ``module:attr`` string, others through an entry point group.
Sites (``launcher``, ``orch.sites``) and parallelism strategies (``parallelism.strategy``, ``orch.parallelism``)
are found this way; a name found nowhere is a one-line ConfigError naming every known one."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Mapping

from orchestrator.errors import ConfigError


def load_named(key: str, name: str, builtins: Mapping[str, str], group: str, what: str) -> Any:
    """The object ``name`` names: ``builtins[name]`` (``module:attr``, imported now) or the entry point of that
    name in ``group``; otherwise ConfigError for config key ``key`` ("is not a ``what``")."""
    target = builtins.get(name)
    if target is None:
        found = [ep for ep in entry_points(group=group) if ep.name == name]
        if not found:
            known = sorted({*builtins, *(ep.name for ep in entry_points(group=group))})
            raise ConfigError(key, name, f"use one of {', '.join(known)}", f"is not a {what}")
        return found[0].load()
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)

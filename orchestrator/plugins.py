"""Registries of named plug-ins: orch's own by ``module:attr`` string, others through an entry point group.
Sites (``launcher``, ``orch.sites``) and parallelism strategies (``parallelism.strategy``, ``orch.parallelism``)
are found this way; a name found nowhere is a one-line ConfigError naming every known one. A package's own
names are found the same way, on first use (:func:`lazy_exports`)."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping

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


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562) for the names in ``exports`` (name -> the submodule of
    ``package`` that defines it): each is imported on first use and kept in the package, so importing the
    package (or one of its light submodules) costs none of its heavy ones."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__

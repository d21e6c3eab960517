"""Typed, validated configuration: Hydra presets in conf/ composed onto the schemas in schema.py.

The names below are imported on first use (PEP 562): a submodule (the schema, the value checks) is imported
without composing's Hydra, which agents and workers do not need."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"OrchConfig": "orchestrator.config.schema", "compose_config": "orchestrator.config.compose",
            "list_presets": "orchestrator.config.compose", "list_groups": "orchestrator.config.compose",
            "load_run_config": "orchestrator.config.compose"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

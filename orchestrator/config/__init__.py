"""Typed, validated configuration: Hydra presets in conf/ composed onto the schemas in schema.py.

The names below are imported on first use (PEP 562): a submodule (the schema, the value checks) is imported
without composing's Hydra, which agents and workers do not need."""

from __future__ import annotations

from orchestrator.plugins import lazy_exports

_EXPORTS = {"OrchConfig": "schema", "compose_config": "compose", "list_presets": "compose",
            "list_groups": "compose", "load_run_config": "compose"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

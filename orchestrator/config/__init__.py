"""Typed, validated configuration: Hydra presets in conf/ composed onto the schemas in schema.py."""

from orchestrator.config.compose import compose_config, list_groups, list_presets, load_run_config
from orchestrator.config.schema import OrchConfig

__all__ = ["OrchConfig", "compose_config", "list_presets", "list_groups", "load_run_config"]

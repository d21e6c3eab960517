"""Compose a preset plus overrides into a validated :class:`OrchConfig`, once, where the config enters.

Hydra does the composing (defaults lists, groups, ``+key``/``~key`` overrides, interpolation); this module
only registers the schema, translates Hydra's exceptions into one-line :class:`ConfigError` messages, and
runs validation by converting to dataclasses with ``OmegaConf.to_object`` (so ``__post_init__`` runs).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from functools import cache
from typing import Any, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config.schema import OrchConfig
from orchestrator.config.validate import validate_config
from orchestrator.errors import ConfigError, UserError

SCHEMA_NAME = "orch_schema"


@cache
def register_schema() -> None:
    """Presets list ``orch_schema`` first; it brings the typed schema plus the defaults of groups that every
    preset has without naming them (``logger: none``, ``parallelism: ddp``), so ``logger=...`` and
    ``parallelism=...`` overrides work on any preset, user ones too (a preset picks another with ``- override
    parallelism: fsdp2``). Registered when a config is first composed: Hydra is imported only by what composes
    (~0.2 s), not by the agents and workers, which load a run's resolved config.yaml with OmegaConf alone."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="_orch_schema_typed", node=OrchConfig)
    ConfigStore.instance().store(name=SCHEMA_NAME, node={"defaults": ["_orch_schema_typed", {"logger": "none"},
                                                                  {"parallelism": "ddp"}, "_self_"]})


CONF_PATH_ENV = "ORCH_CONF_PATH"  # extra preset directories, searched after orch's own (os.pathsep-separated)


def conf_dir() -> Path:
    """orch's own presets: ``orchestrator/conf``, the repository's top-level ``conf/`` (a link to it in a
    checkout, a copy inside the installed wheel)."""
    return Path(__file__).resolve().parents[1] / "conf"


def user_conf_dirs() -> list[Path]:
    """The user's preset directories, added to orch's own: ``$ORCH_CONF_PATH`` (``dir1:dir2``) and
    ``$ORCH_CONF_DIR`` (the older single-directory name, which now adds too)."""
    entries = os.environ.get(CONF_PATH_ENV, "").split(os.pathsep) + [os.environ.get("ORCH_CONF_DIR", "")]
    return [Path(e).resolve() for e in entries if e.strip()]


def _conf_dirs() -> list[Path]:
    return [conf_dir()] + [d for d in user_conf_dirs() if d != conf_dir()]


def list_presets() -> list[str]:
    """Names usable as ``conf=NAME``: the top-level YAML files of orch's conf dir and the user's."""
    return sorted({p.stem for d in _conf_dirs() for p in d.glob("*.yaml")})


def list_groups() -> dict[str, list[str]]:
    """Config groups with their options, e.g. ``{"backend": ["gloo", "nccl"], ...}`` (the user's included)."""
    groups: dict[str, set[str]] = {}
    for conf in _conf_dirs():
        for d in sorted(conf.iterdir()) if conf.is_dir() else ():
            if d.is_dir() and not d.name.startswith((".", "_")):
                groups.setdefault(d.name, set()).update(p.stem for p in d.glob("*.yaml"))
    return {name: sorted(options) for name, options in sorted(groups.items())}


def refuse_hydra_overrides(overrides: Sequence[str]) -> None:
    """orch runs Hydra's compose API, not a Hydra app: ``hydra.*`` keys (``hydra.run.dir``, ``hydra.job.chdir``,
    ``hydra.searchpath``) would be ignored silently, so they are refused, naming orch's own key."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "hydra" or key.startswith("hydra."):
            raise ConfigError(key, override.partition("=")[2] or None,
                              "orch sets the run's directory with run.dir=PATH (it never changes the working "
                              f"directory); extra preset directories go in ${CONF_PATH_ENV}", "is not used by orch")


def split_preset(tokens: Sequence[str]) -> tuple[str, list[str]]:
    """``conf=NAME`` picks the preset; every other token is a Hydra override, passed through untouched."""
    presets = [t.split("=", 1)[1] for t in tokens if t.startswith("conf=")]
    if len(presets) != 1:
        raise UserError(f"conf={'|'.join(presets) or '(missing)'}: give exactly one conf=NAME. "
                        f"Fix: orch launch conf=NAME with NAME one of {', '.join(list_presets())}")
    return presets[0], [t for t in tokens if not t.startswith("conf=")]


def compose_dictconfig(preset: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Run Hydra's compose for ``preset`` with ``overrides``; raise ConfigError on anything Hydra rejects."""
    overrides = [_spelled(o) for o in overrides]
    refuse_hydra_overrides(overrides)
    _check_override_keys(overrides)
    if preset not in list_presets():
        raise ConfigError("conf", preset, f"use one of {', '.join(list_presets())}", "is not a known preset")
    # Hydra looks the preset up in the primary dir only (the search path is applied after): the dir that holds it
    # is primary, the others follow in order.
    dirs = _conf_dirs()
    primary = next(d for d in dirs if (d / f"{preset}.yaml").is_file())
    rest = [d for d in dirs if d != primary]
    searchpath = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in rest)}]"] if rest else []
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_schema()
    try:
        with own_hydra(), initialize_config_dir(config_dir=str(primary), version_base="1.3"):
            return compose(config_name=preset, overrides=list(overrides) + searchpath)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _translate(exc, overrides) from None
    except AssertionError as exc:  # OmegaConf asserts when an override reaches under a null node
        raise _under_null(overrides) or exc from None
    except ValueError as exc:  # Hydra's plain ValueError for a group override that is not a name (backend=5)
        raise _bad_group_value(overrides) or exc from None


# Keys a Python field cannot be named: ``async`` is a keyword, so ``checkpoint.async`` is ``checkpoint.async_save``.
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def _spelled(override: str) -> str:
    """``override`` with an aliased key (``checkpoint.async=true``) under the field's name."""
    prefix = override[:len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(prefix):].partition("=")
    return f"{prefix}{KEY_ALIASES.get(key, key)}{eq}{value}"


def _check_override_keys(overrides: Sequence[str]) -> None:
    """``=5`` (no key) would reach Hydra as an unexplained internal error."""
    for override in overrides:
        if "=" in override and not override.lstrip("+~").split("=", 1)[0].strip():
            raise UserError(f"override {override!r} has no key. Fix: write key=value, e.g. trainer.max_steps=5")


def _bad_group_value(overrides: Sequence[str]) -> UserError | None:
    groups = list_groups()
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key in groups and value not in groups[key]:
            return ConfigError(key, value, f"use one of {', '.join(groups[key])}", f"is not a known option of group {key!r}")
    return None


@contextlib.contextmanager
def own_hydra() -> Iterator[None]:
    """Compose in a Hydra of orch's own and hand the caller's back untouched.

    A caller may be inside its own ``@hydra.main`` app or ``initialize()`` context (``orchestrator.launch``
    from a Hydra app): its ``GlobalHydra`` and version base are process-wide singletons. They are taken out
    (not cleared: clearing would empty the caller's instance) and put back afterwards, whatever happens.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase

    saved = {cls: Singleton._instances.pop(cls, None) for cls in (GlobalHydra, VersionBase)}
    try:
        yield
    finally:
        for cls, instance in saved.items():
            if instance is None:
                Singleton._instances.pop(cls, None)
            else:
                Singleton._instances[cls] = instance


def compose_config(preset: str, overrides: Sequence[str] = ()) -> OrchConfig:
    """Compose and validate: the one place a launch's configuration is checked."""
    return to_validated(compose_dictconfig(preset, overrides))


def to_validated(cfg: DictConfig) -> OrchConfig:
    """Convert a composed DictConfig to dataclasses (running every ``__post_init__``) and cross-check it."""
    _reject_unknown_typed_keys(cfg)
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        raise _translate(exc, ()) from None
    validate_config(config)
    return config


def _reject_unknown_typed_keys(node: DictConfig, prefix: str = "") -> None:
    """``+group.key=v`` can add keys to a typed group that its dataclass would silently ignore: refuse them."""
    import dataclasses

    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        path = f"{prefix}{key}"
        if fields is not None and key not in fields:
            raise ConfigError(path, node._get_node(key)._value(), "check the spelling (see docs/configuration.md); "
                              f"{prefix.rstrip('.') or 'this group'} is typed and accepts only its own keys",
                              "is not a known key")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and fields is not None:
            _reject_unknown_typed_keys(child, path + ".")


def load_run_config(path: str) -> OrchConfig:
    """Load a run dir's resolved ``config.yaml`` (as workers do) back onto the schema, validated."""
    schema = OmegaConf.structured(OrchConfig)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise _translate(exc, ()) from None
    return to_validated(merged)


def _translate(exc: Exception, overrides: Sequence[str]) -> UserError:
    """Turn Hydra/OmegaConf's multi-line errors into one line naming the key, the value and the fix."""
    text = f"{exc}\n{exc.__cause__ or ''}"
    key = _first(text, r"full_key: ([\w.\[\]]+)", r"Could not override '([\w.]+)'", r"'([\w.]+)' does not exist")
    given = {o.lstrip("+~").split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
    value = given.get(key)
    existing = _first(text, r"An item is already at '([\w.]+)'")
    if existing:
        return ConfigError(existing, given.get(existing), f"override it without the +: {existing}=...", "already exists")
    deleted = _first(text, r"Error merging override ~([\w.]+)")
    if deleted:
        return ConfigError(deleted, None, "set it to another value (or null where allowed) instead: typed keys "
                           "cannot be removed", "cannot be deleted")
    missing_option = re.search(r"Could not (?:find|load) '([\w.]+)/([\w.]+)'", text)
    if missing_option:
        group, option = missing_option.groups()
        choices = ", ".join(re.findall(r"^\t(\S+)$", text, re.M) or list_groups().get(group, []))
        return ConfigError(group, option, f"use one of {choices}", f"is not a known option of group {group!r}")
    if "does not exist" in text:
        return ConfigError(key or "?", None, "delete only keys the preset has (see `orch launch --help`)",
                           "cannot be deleted: it does not exist")
    if "not in struct" in text or re.search(r"Key '[\w]+' not in '", text):
        # `+key` adds keys only to the free-form `_target_` nodes (model, optim, ...); typed groups refuse it.
        add = "" if key is None or _in_typed_group(key) else f", or add a new key with +{key}=..."
        return ConfigError(key or "?", value, f"check the spelling (see `orch launch --help` and "
                           f"docs/configuration.md){add}", "is not a known key")
    if "could not be converted" in text or "is not a valid" in text:
        value = _first(text, r"Value '([^']*)'") or value
        return ConfigError(key or "?", value, "give a value of the key's type (see docs/configuration.md)",
                           "has the wrong type")
    bad = _first(text, r"Error parsing override '([^']*)'")
    if bad or "mismatched input" in text or "OverrideParseException" in type(exc).__name__:
        return UserError(f"override {bad or ' '.join(overrides)!r} cannot be parsed ({text.splitlines()[0]}). "
                         "Fix: quote values with special characters, e.g. 'key=\"http://host/{x}\"'")
    if "Missing mandatory value" in text:
        return ConfigError(key or "?", "???", "set it in the preset or as an override", "is required but missing")
    first = next((ln for ln in str(exc).splitlines() if ln.strip()), str(exc))
    return UserError(f"invalid configuration: {first} Fix: check the overrides against `orch launch --help`")


def _under_null(overrides: Sequence[str]) -> UserError | None:
    """``logger.mlflow.experiment=x`` without ``logger=mlflow``: ``logger.mlflow`` is null, so say to select it."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("logger=")]
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        parts = key.split(".")
        if len(parts) > 2 and parts[0] == "logger" and not any(parts[1] in c for c in chosen):
            return ConfigError(key, value, f"select that logger too: logger={parts[1]} (or logger=[...,{parts[1]}])",
                               f"cannot be set: logger.{parts[1]} is off")
    return None


def _in_typed_group(key: str) -> bool:
    """Whether ``key``'s parent is a schema dataclass (``trainer.x``), not a free-form node (``optim.x``)."""
    import dataclasses
    import typing

    node: Any = OrchConfig
    for part in key.split(".")[:-1]:
        if not dataclasses.is_dataclass(node):
            return False
        node = typing.get_type_hints(node).get(part, Any)
        node = next((a for a in typing.get_args(node) if dataclasses.is_dataclass(a)), node)  # Optional[X]
    return dataclasses.is_dataclass(node)


def _first(text: str, *patterns: str):
    for pattern in patterns:
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    return None

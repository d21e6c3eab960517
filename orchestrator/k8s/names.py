"""Object names: ``<k8s.name or orch>-<run id>``, so two renders of one preset never collide, and every name
the cluster will derive from them (Services, Jobs, pod hostnames) checked against Kubernetes' rules here,
where the error can name the setting, rather than by an API server that rejects one object of several."""

from __future__ import annotations

import re
import secrets
from typing import Iterable

from orchestrator.config.schema import OrchConfig
from orchestrator.config.values import run_id_slug
from orchestrator.errors import ConfigError

MAX_LABEL = 63  # a DNS label: Service names, pod hostnames, label values
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def new_run_id(preset: str) -> str:
    """``<preset>-<6 hex>`` as a DNS label: unique per render, readable in ``kubectl get``."""
    return f"{run_id_slug(preset, 20)}-{secrets.token_hex(3)}"


def object_name(cfg: OrchConfig) -> str:
    """The name of the job object and the stem of every other name of the run. ``run.id`` is set by then
    (``render`` gives a fresh one when the user did not)."""
    return f"{cfg.k8s.name or 'orch'}-{cfg.run.id}"


def check_names(cfg: OrchConfig, names: Iterable[str]) -> None:
    """Every name must be an RFC 1035 label of at most 63 characters (the strictest rule among the objects,
    Services and hostnames that carry it). A bad one is the run id's or k8s.name's fault: say which to change.
    (``run.id``'s characters are checked where the config is composed: config/values.py.)"""
    for name in names:
        if len(name) > MAX_LABEL or not RFC1035.match(name):
            raise ConfigError("run.id", cfg.run.id, "shorten run.id or k8s.name (names are <k8s.name or orch>-<run.id>)",
                              f"makes the name {name!r} ({len(name)} characters), which Kubernetes refuses (at most "
                              f"{MAX_LABEL}, lower-case letters, digits and '-', starting with a letter)")

"""The tracker contract, the fan-out over several trackers, and ``open_trackers``."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

from orchestrator.errors import UserError

log = logging.getLogger(__name__)

# Config keys whose values never reach a tracker: environment blocks are dropped, secret-looking keys redacted,
# and a password inside a URL (``scheme://user:pass@host``) is masked.
ENV_KEYS = {"env", "environment"}
SECRET_KEY = re.compile(r"(password|passwd|secret_?key|access_?key|api_?key|token|credential)", re.I)
URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")
REDACTED = "<redacted>"

# Option name -> module under orchestrator.tracking that defines ``open(settings, run_dir, run_name)``.
BACKENDS = {"tensorboard": "tensorboard", "mlflow": "mlflow_store", "wandb": "wandb_run"}
# Option name -> the top-level package it needs; the orch extra that installs it has the option's name.
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def package_installed(package: str) -> bool:
    """``package`` is importable here (found without importing it: mlflow and wandb take seconds to import)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing_package_error(name: str) -> UserError:
    """The one-line exit-2 error for logger ``name`` whose package is not installed."""
    return UserError(f"logger={name}: the {PACKAGES[name]} package is not installed. "
                     f"Fix: pip install 'orch[{name}]'")


class Tracker(Protocol):
    """One backend's open run. Called on rank 0 only; values are already flattened and numeric."""

    def log_config(self, params: dict[str, str]) -> None:
        """Record the run's configuration, ``{"trainer.max_steps": "10", ...}`` (dotted keys, str values)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's scalar metrics."""

    def log_summary(self, step: int, metrics: dict[str, float], files: list[Path], status: str) -> None:
        """At the run's end (the driver, after ``summary.json``): its figures as final metrics, its files (config,
        summary, report and plots) as artifacts, and how it ended (``succeeded``, ``failed``, ...)."""

    def close(self) -> None:
        """Flush and finish the run; the tracker is not used afterwards."""


class Trackers:
    """Every tracker the ``logger`` group selected, behind one object; empty means a no-op.

    A tracker that raises while logging is reported once and dropped: tracking never fails a training run.
    """

    def __init__(self, trackers: Mapping[str, Tracker] | None = None):
        self._trackers: dict[str, Tracker] = dict(trackers or {})

    @property
    def names(self) -> list[str]:
        """The open backends, e.g. ``["tensorboard", "mlflow"]``; ``[]`` for the no-op."""
        return list(self._trackers)

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def log_config(self, config: Any) -> None:
        """Log ``config`` (a dict, a dataclass or an OmegaConf node), flattened to dotted keys: the keys that
        matter for the run (:func:`relevant_params`)."""
        if self._trackers:
            params = relevant_params(flatten_config(config))
            self._each("log_config", params)

    def log_summary(self, step: int, metrics: Mapping[str, Any], files: list[Path], status: str) -> None:
        """The run's end: final metrics (numeric ones), artifacts, its status (see :class:`Tracker`)."""
        if self._trackers:
            self._each("log_summary", int(step), numeric_metrics(metrics), [Path(f) for f in files], status)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log the finite numeric values of ``metrics`` at ``step`` (see :func:`numeric_metrics`)."""
        if self._trackers:
            values = numeric_metrics(metrics)
            if values:
                self._each("log_metrics", int(step), values)

    def close(self) -> None:
        """Close every tracker (idempotent)."""
        trackers, self._trackers = self._trackers, {}
        for name, tracker in trackers.items():
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - closing one must not stop closing the others
                log.warning("logger=%s: close failed: %s", name, exc)

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self._trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker outage must not stop training
                log.warning("logger=%s: %s failed, tracker disabled for the rest of the run: %s", name, method, exc)
                self._trackers.pop(name, None)
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001
                    pass


def open_trackers(cfg: Any, run_dir: str | Path, rank: int, run_name: Optional[str] = None) -> Trackers:
    """Open the trackers ``cfg.logger`` selects, writing under ``run_dir`` by default.

    ``cfg`` is an :class:`~orchestrator.config.schema.OrchConfig` (or anything with a ``logger`` attribute of
    type :class:`~orchestrator.config.schema.LoggerConfig`). Only ``rank == 0`` opens anything; every other
    rank, and ``logger=none``, gets a no-op :class:`Trackers`. The run's name in each tracker is the orch run
    id (``run_name``, else :func:`run_name_of`). A backend whose package is missing raises UserError here, naming the
    extra to install (config validation says the same before a launch gets this far).
    """
    logger_cfg = getattr(cfg, "logger", None)
    if rank != 0 or logger_cfg is None:
        return Trackers()
    run_dir = Path(run_dir)
    run_name = run_name or run_name_of(cfg, run_dir)
    opened: dict[str, Tracker] = {}
    try:
        for name in selected(logger_cfg):
            if not package_installed(PACKAGES[name]):
                raise missing_package_error(name)
            module = importlib.import_module(f"orchestrator.tracking.{BACKENDS[name]}")
            opened[name] = module.open(getattr(logger_cfg, name), run_dir, run_name)
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)


def run_name_of(cfg: Any, run_dir: Path) -> str:
    """The orch run id: ``run.id``, else ``$ORCH_RUN_ID`` (the plan gives it to every node), else torchrun's
    rendezvous id (orch's run id), else the run dir's name. Stable across worker restarts, so a restarted
    rank 0 finds its run again."""
    run_id = getattr(getattr(cfg, "run", None), "id", None)
    elastic_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return (run_id or os.environ.get("ORCH_RUN_ID") or (elastic_id if elastic_id and elastic_id != "none" else None)
            or Path(run_dir).name)


def selected(logger_cfg: Any) -> list[str]:
    """Names of the backends set (not None) in a LoggerConfig, in a fixed order."""
    return [name for name in BACKENDS if getattr(logger_cfg, name, None) is not None]


def flatten_config(config: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}, "l": [1, 2]}`` -> ``{"a.b": "1", "l": "[1, 2]"}``: dotted keys, string values.

    Accepts dicts, dataclass instances and OmegaConf nodes (resolved). Lists stay one value. This is the
    configuration only: nothing from the environment is ever added, so no secret reaches a tracker.
    """
    config = _plain(config)
    out: dict[str, str] = {}
    if not isinstance(config, Mapping):
        return {prefix.rstrip(".") or "config": str(config)}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if str(key) in ENV_KEYS:
            continue  # environment variables for pods (k8s.env): may hold credentials
        if SECRET_KEY.search(str(key)):
            out[path] = REDACTED
        elif isinstance(value, Mapping) and value:
            out.update(flatten_config(value, path + "."))
        elif isinstance(value, Mapping):
            out[path] = "{}"
        else:
            out[path] = "" if value is None else URL_PASSWORD.sub(r"\1***@", str(value))
    return out


EMPTY_VALUES = ("", "{}", "[]", "None", "null")
KUBERNETES_ENV = "KUBERNETES_SERVICE_HOST"  # set in every pod: a launch inside Kubernetes


def relevant_params(params: Mapping[str, str]) -> dict[str, str]:
    """The params worth a tracker's space: no empty values (an unset option says nothing), and no ``k8s.*`` keys
    outside a Kubernetes pod (they only describe manifests a local or Ray launch never renders)."""
    in_k8s = bool(os.environ.get(KUBERNETES_ENV))
    return {k: v for k, v in params.items()
            if v not in EMPTY_VALUES and (in_k8s or not (k == "k8s" or k.startswith("k8s.")))}


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of ``metrics`` as floats (bools, strings, None and NaN/inf are dropped)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
            value = value.item()  # a 0-d tensor or numpy scalar
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        value = float(value)
        if math.isfinite(value):
            out[str(key)] = value
    return out


def _plain(config: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config

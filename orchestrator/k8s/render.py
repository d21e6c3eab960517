"""``orch k8s render``: the composed config of ``orch launch`` -> the objects of one format -> YAML.

The output is deterministic (keys sorted, no timestamps, no cluster state), so checked-in manifests can be
compared with a fresh render (tests/test_k8s_manifests.py) and reviewed as diffs. The one exception is the run
id: unless ``run.id`` is given, each render draws a fresh one (so two renders never collide), and the header's
command names it, so running that command again gives the same bytes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from orchestrator.config.k8s_checks import check_env
from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError
from orchestrator.k8s.job import render_job
from orchestrator.k8s.jobset import render_jobset
from orchestrator.k8s.names import new_run_id
from orchestrator.k8s.pods import is_pod_local
from orchestrator.k8s.pytorchjob import render_pytorchjob
from orchestrator.k8s.rayjob import render_rayjob
from orchestrator.k8s.trainjob import render_trainjob

FORMATS: dict[str, Callable[[OrchConfig, Sequence[str]], list[dict[str, Any]]]] = {
    "job": render_job,
    "jobset": render_jobset,
    "trainjob": render_trainjob,
    "pytorchjob": render_pytorchjob,
    "rayjob": render_rayjob,
}


class _Dumper(yaml.SafeDumper):
    """Writes a shared object out in full each time: no ``&id001`` anchors for kubectl readers to untangle."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass(frozen=True)
class Rendered:
    """The objects of one format, and the command that renders them (written into the YAML's header)."""

    format: str
    command: str
    objects: list[dict[str, Any]]
    warnings: tuple[str, ...] = ()

    def text(self) -> str:
        header = (f"# Rendered by `{self.command}`.\n"
                  "# Do not edit: change the config and render again (see docs/kubernetes.md).\n")
        return header + "".join("---\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=True, default_flow_style=False, width=4096)
                                for obj in self.objects)

    def summary(self) -> str:
        return ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in self.objects)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, f"use one of {', '.join(FORMATS)}", "is not a known format")


def render(preset: str, overrides: Sequence[str], fmt: str) -> Rendered:
    """Compose ``preset`` with ``overrides`` exactly as ``orch launch`` does, then build ``fmt``'s objects.
    Raises ConfigError (exit 2) for an unknown format and for configs no cluster could run well."""
    from orchestrator.config.compose import compose_config

    check_format(fmt)
    cfg = compose_config(preset, overrides)
    check_env(cfg.k8s.env)  # here, not at compose: only a manifest would hold the value in plain text
    if not cfg.run.id:
        cfg.run.id = new_run_id(preset)
        overrides = [*overrides, f"run.id={cfg.run.id}"]
    command = shlex.join(["orch", "k8s", "render", f"conf={preset}", *overrides, "--format", fmt])
    return Rendered(fmt, command, FORMATS[fmt](cfg, list(overrides)), tuple(_warnings(cfg, fmt)))


def _warnings(cfg: OrchConfig, fmt: str) -> list[str]:
    """What renders but will disappoint (several pods on pod-local checkpoints are refused outright)."""
    if fmt != "rayjob" and cfg.cluster.max_nodes == 1 and is_pod_local(cfg.checkpoint.url, cfg):
        return [f"checkpoint.url={cfg.checkpoint.url!r} is on the pod's own disk: a pod that replaces a preempted one "
                f"starts again from step 0. Fix: checkpoint.url=s3://BUCKET/orch/{cfg.preset} (or gs://...)"]
    return []


def write(rendered: Rendered, out_dir: str) -> Path:
    """Write ``<out_dir>/<format>.yaml`` (the directory is created); returns its path."""
    path = Path(out_dir) / f"{rendered.format}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rendered.text())
    return path

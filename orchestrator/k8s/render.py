"""``orch k8s render``: the composed config of ``orch launch`` -> the objects of one format -> YAML.

The output is deterministic (keys sorted, no timestamps, no cluster state), so checked-in manifests can be
compared with a fresh render (tests/test_k8s_manifests.py) and reviewed as diffs. The one exception is the run
id: unless ``run.id`` is given, each render draws a fresh one (so two renders never collide), and the header's
command names it, so running that command again gives the same bytes. Nothing a render writes holds a
credential: ``k8s.env`` and every override are checked for one first (config/k8s_checks.py), and the text
itself once more before it is returned.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from orchestrator.config.k8s_checks import URL_CREDENTIAL, check_rendered_values
from orchestrator.config.schema import OrchConfig
from orchestrator.errors import ConfigError, UserError
from orchestrator.k8s.job import render_job
from orchestrator.k8s.jobset import render_jobset
from orchestrator.k8s.names import new_run_id
from orchestrator.k8s.pods import create_secret_command, is_pod_local
from orchestrator.k8s.pytorchjob import render_pytorchjob
from orchestrator.k8s.rayjob import render_rayjob
from orchestrator.k8s.trainjob import render_trainjob
from orchestrator.trust.secret import RUN_SECRET_ENV

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
    """The objects of one format, the command that renders them, and the one that creates the Secret of the
    run's secret that they refer to ("": none), both written into the YAML's header."""

    format: str
    command: str
    objects: list[dict[str, Any]]
    warnings: tuple[str, ...] = ()
    secret_command: str = ""

    def text(self) -> str:
        header = (f"# Rendered by `{self.command}`.\n"
                  "# Do not edit: change the config and render again (see docs/kubernetes.md).\n")
        if self.secret_command:
            gated = ("The rendezvous store and the quorum service admit" if _runs(self.objects, "quorum-service")
                     else "The rendezvous store admits")
            header += (f"# {gated} only holders of the run's secret. Create its Secret (the value\n"
                       f"# is in no manifest) before applying:\n#   {self.secret_command}\n")
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
    # Here, not at compose: a credential in a value is harmless until a manifest holds it in plain text.
    check_rendered_values(list(overrides), cfg.k8s)
    if not cfg.run.id:
        cfg.run.id = new_run_id(preset)
        overrides = [*overrides, f"run.id={cfg.run.id}"]
    command = shlex.join(["orch", "k8s", "render", f"conf={preset}", *overrides, "--format", fmt])
    objects = FORMATS[fmt](cfg, list(overrides))
    gated = _gates_store(objects)
    rendered = Rendered(fmt, command, objects, tuple(_warnings(cfg, fmt, objects, gated)),
                        create_secret_command(cfg) if gated else "")
    _refuse_credentials(rendered.text())
    return rendered


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every container of every pod template in ``objects``, wherever the format nests it."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(c for c in node.get("containers", []) if isinstance(c, dict) and "image" in c)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    return found


def _gates_store(objects: list[dict[str, Any]]) -> bool:
    """Whether some container takes the run's secret from a Secret (the store and its nodes, when gated)."""
    return any(e.get("name") == RUN_SECRET_ENV and "valueFrom" in e for c in _containers(objects) for e in c.get("env", []))


def _runs(objects: list[dict[str, Any]], command: str) -> bool:
    """Whether some container runs ``orch <command>`` (``rendezvous-store``, ``quorum-service``)."""
    return any(c.get("args", [""])[0] == command for c in _containers(objects))


def _warnings(cfg: OrchConfig, fmt: str, objects: list[dict[str, Any]], gated: bool) -> list[str]:
    """What renders but will disappoint or expose (several pods on pod-local checkpoints are refused outright)."""
    warnings = []
    if fmt != "rayjob" and cfg.cluster.max_nodes == 1 and is_pod_local(cfg.checkpoint.url, cfg):
        warnings.append(f"checkpoint.url={cfg.checkpoint.url!r} is on the pod's own disk: a pod that replaces a "
                        f"preempted one starts again from step 0. Fix: checkpoint.url=s3://BUCKET/orch/{cfg.preset} "
                        "(or gs://...)")
    if not gated and _runs(objects, "rendezvous-store"):
        warnings.append("k8s.run_secret='': the rendezvous store is not gated; any pod that gets past its "
                        "NetworkPolicy (or where none is enforced) can join or rewrite the job's rendezvous. Fix: "
                        "drop k8s.run_secret (a Secret named after the job) or name one you created")
    return warnings


def _refuse_credentials(text: str) -> None:
    """The last line of defence: a credential in a URL reached the text by a way no check knew of."""
    if URL_CREDENTIAL.search(text):
        raise UserError("the rendered manifest would hold a credential inside a URL (scheme://user:password@ or "
                        "scheme://token@) in plain text. Fix: take it out of the config and give it to the pods "
                        "from a Secret: +k8s.secrets.VAR=SECRET (or SECRET/KEY), or k8s.checkpoint_secret")


def write(rendered: Rendered, out_dir: str) -> Path:
    """Write ``<out_dir>/<format>.yaml`` whole or not at all: under a temporary name, then renamed over the
    file; on failure the temporary file and every directory this call created are removed again, and the
    error is a ConfigError naming ``-o`` (exit 2). Returns the file's path."""
    out = Path(out_dir)
    created = [d for d in (out, *out.parents) if not d.exists()]
    path = out / f"{rendered.format}.yaml"
    tmp = out / f".{path.name}.{os.getpid()}.tmp"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x") as f:
            f.write(rendered.text())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        for d in created:  # innermost first; only what is still empty (nothing of anyone else's)
            with contextlib.suppress(OSError):
                d.rmdir()
        raise ConfigError("-o", out_dir, "name a directory this process can create and write to",
                          f"cannot be written ({e.strerror or e})") from None
    return path

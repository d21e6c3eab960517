"""Human-readable views of checkpoints: the text behind ``orch ckpt list RUN_OR_URL`` and ``orch ckpt inspect``."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.rundir import EVENTS_FILE, EventName, read_jsonl

from .hf_dirs import COMPLETE_MARKER, hf_checkpoints
from .locate import checkpoint_url_of, hf_output_dir_of
from .manager import CheckpointManager
from .manifest import (DCP_FORMAT, DCP_INDEX, DCP_SHARD_SUFFIX, MANIFEST_NAME, ManifestError, check_checksum,
                       parse_manifest)
from .storage import STEP_DIR_RE, step_dirname

HF_ENGINE = "hf"
"""``orch ckpt list``'s engine of a transformers.Trainer checkpoint (orchestrator/checkpoint/hf_dirs.py)."""


def format_checkpoint_list(run_or_url: str) -> str:
    """A table of every checkpoint of a run dir or under a checkpoint URL (:func:`checkpoint_url_of`): step,
    valid, reason (periodic, final, preemption, stop), size, created, config fingerprint, engine, world size.

    orch's ``step_N`` directories come first; HF Trainer's ``checkpoint-N`` directories under ``<url>/hf`` (or
    under ``run_or_url`` itself, HF's output_dir) follow as engine ``hf``, valid when orch marked them complete.
    Validity here is manifest + sizes (no checksums: that would read every byte); ``inspect`` checks them.
    Raises CheckpointSetupError (a UserError, exit 2) for an unusable URL.
    """
    url = checkpoint_url_of(run_or_url)
    infos = CheckpointManager(url).list()
    hf_dir = hf_output_dir_of(url)
    hf = hf_checkpoints(hf_dir)
    of_run = f" (the checkpoint URL of run dir {run_or_url})" if url != run_or_url else ""
    if not infos and not hf:
        return f"no checkpoints under {url}{of_run}"
    stopped = _stop_saved_steps(run_or_url) if of_run else set()
    rows = [("step", "valid", "reason", "size", "created", "config_fingerprint", "engine", "world_size")]
    for i in infos:
        rows.append((
            str(i.step),
            "yes" if i.valid else f"no: {i.reason}",
            _reason(i.metadata.get("reason"), i.step, stopped),
            _human_bytes(i.total_bytes),
            _fmt_time(i.created_t),
            str(i.metadata.get("config_fingerprint") or "-"),
            engine_of(i.format),
            str(i.metadata.get("world_size") or "-"),
        ))
    for c in hf:
        marker = c.marker or {}
        created = marker.get("t")
        rows.append((
            str(c.step),
            "yes" if c.complete else "no: not marked complete",
            _reason(marker.get("reason"), c.step, stopped),
            _human_bytes(c.total_bytes),
            _fmt_time(created if isinstance(created, (int, float)) else None),
            "-",
            HF_ENGINE,
            str(marker.get("world_size") or "-"),
        ))
    note = (f"\nengine {HF_ENGINE}: transformers.Trainer's checkpoint-N under {hf_dir}, valid once OrchCallback "
            f"marked it complete ({COMPLETE_MARKER})") if hf else ""
    return f"checkpoints under {url}{of_run}\n" + _table(rows) + note


def _reason(saved_for: object, step: int, stopped: set[int]) -> str:
    """Why a checkpoint was saved, as its writer recorded it; an emergency save that ``orch stop`` asked for
    reads ``stop`` (the workers see a stop as a preemption notice: only the run dir's events tell them apart)."""
    if saved_for == "preemption" and step in stopped:
        return "stop"
    return str(saved_for or "-")


def _stop_saved_steps(run_dir: str) -> set[int]:
    """Steps of the emergency checkpoints saved after an ``orch stop`` (a ``stop_requested`` event, before the
    next ``launch_started``) in the run dir's events."""
    steps: set[int] = set()
    stopping = False
    for e in read_jsonl(Path(run_dir) / EVENTS_FILE):
        name = e.get("event")
        if name == EventName.STOP_REQUESTED:
            stopping = True
        elif name == EventName.LAUNCH_STARTED:
            stopping = False
        elif name == EventName.EMERGENCY_CHECKPOINT and stopping and isinstance(e.get("step"), int):
            steps.add(e["step"])
    return steps


def format_checkpoint_detail(url_or_step_url: str) -> str:
    """The text of :func:`inspect_checkpoint` alone."""
    return inspect_checkpoint(url_or_step_url)[0]


def inspect_checkpoint(url_or_step_url: str) -> tuple[str, str | None]:
    """Files, sizes, checksum results (ok/bad/missing), lineage and metadata of one checkpoint, and why
    ``load()`` would skip it (None when it would load it: every check load makes, payloads read back too).

    Accepts ``URL/step_000000012`` or ``URL`` or a run dir (then the newest ``step_N`` directory, valid or not). Every
    payload is read to verify its sha256. Raises UserError when there is no such checkpoint directory.
    """
    root, step = _split_step_url(url_or_step_url)
    root = checkpoint_url_of(root)
    manager = CheckpointManager(root)
    storage = manager.storage
    steps = storage.list_steps()
    if step is None:
        if not steps:
            raise UserError(f"no checkpoints under {root}. Fix: give the URL a run saved to (its checkpoint.url, "
                            "or <run dir>/checkpoints)")
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"no checkpoint directory {step_dirname(step)} under {root}. Fix: pick a step that "
                        f"`orch ckpt list {root}` shows")
    stepdir = step_dirname(step)
    present = storage.list_files(stepdir)
    lines = [f"checkpoint {storage.url_for(stepdir)}"]
    problem = manager.verify(step)
    try:
        manifest = parse_manifest(storage.read_bytes(f"{stepdir}/{MANIFEST_NAME}"))
    except (FileNotFoundError, ManifestError):
        lines.append(f"valid: no ({problem})")
        lines += [f"  {name}  {_human_bytes(size)}" for name, size in sorted(present.items())]
        return "\n".join(lines), problem
    rows = [("file", "size", "sha256", "check")]
    for fname, entry in manifest.files.items():
        if fname not in present:
            check = "missing"
        else:
            reason = check_checksum(manifest, fname, storage.read_bytes(f"{stepdir}/{fname}"))
            check = "ok" if reason is None else f"bad: {reason}"
        rows.append((fname, _human_bytes(entry.size), entry.sha256[:16], check))
    lines.append(
        f"step: {manifest.step}  format_version: {manifest.format_version}  format: {manifest.format}  "
        f"created: {_fmt_time(manifest.created_t)}  valid: {'yes' if problem is None else f'no ({problem})'}"
    )
    shards = sorted(f for f in manifest.files if f.endswith(DCP_SHARD_SUFFIX))
    lines.append(f"engine: {engine_of(manifest.format)}  world_size: {manifest.metadata.get('world_size', '-')}"
                 + (f"  DCP shards: {len(shards)} (+ {DCP_INDEX})" if manifest.format == DCP_FORMAT else ""))
    if manifest.run_id is not None:
        resumed = manifest.resumed_from
        lines.append(f"run: {manifest.run_id}  lineage: {' > '.join(manifest.lineage)}  resumed from: "
                     + (f"step {resumed.get('step')} of {resumed.get('run_id')}" if resumed else "-"))
    lines.append(_table(rows))
    lines.append("metadata:")
    lines.append(json.dumps(manifest.metadata, indent=2, sort_keys=True))
    return "\n".join(lines), problem


def engine_of(fmt: str | None) -> str:
    """The engine that wrote a checkpoint of manifest format ``fmt`` (``-``: no manifest)."""
    return "-" if fmt is None else "dcp" if fmt == DCP_FORMAT else "rank0"


def _split_step_url(url: str) -> tuple[str, int | None]:
    # String surgery, not pathlib: a URL such as s3://bucket/run must keep its double slash.
    trimmed = url.rstrip("/")
    if "://" in url and "://" not in trimmed:
        return url, None  # "s3://", "file:///": left whole so that open_storage refuses it, not "s3:" locally
    head, _, last = trimmed.rpartition("/")
    match = STEP_DIR_RE.match(last)
    if match and head and not head.endswith(":/"):
        return head, int(match.group(1))
    return trimmed or url, None


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")

"""Human-readable views of checkpoints: the text behind ``orch ckpt list URL`` and ``orch ckpt inspect``."""

from __future__ import annotations

import datetime as _dt
import json

from orchestrator.errors import UserError

from .manager import CheckpointManager
from .manifest import (DCP_FORMAT, DCP_INDEX, DCP_SHARD_SUFFIX, MANIFEST_NAME, ManifestError, check_checksum,
                       parse_manifest)
from .storage import STEP_DIR_RE, step_dirname


def format_checkpoint_list(url: str) -> str:
    """A table of every ``step_N`` directory under ``url``: step, valid, size, created, config fingerprint.

    Validity here is manifest + sizes (no checksums: that would read every byte); ``inspect`` checks them.
    Raises CheckpointSetupError (a UserError, exit 2) for an unusable URL.
    """
    infos = CheckpointManager(url).list()
    if not infos:
        return f"no checkpoints under {url}"
    rows = [("step", "valid", "size", "created", "config_fingerprint", "engine", "world_size")]
    for i in infos:
        rows.append((
            str(i.step),
            "yes" if i.valid else f"no: {i.reason}",
            _human_bytes(i.total_bytes),
            _fmt_time(i.created_t),
            str(i.metadata.get("config_fingerprint") or "-"),
            engine_of(i.format),
            str(i.metadata.get("world_size") or "-"),
        ))
    return f"checkpoints under {url}\n" + _table(rows)


def format_checkpoint_detail(url_or_step_url: str) -> str:
    """The text of :func:`inspect_checkpoint` alone."""
    return inspect_checkpoint(url_or_step_url)[0]


def inspect_checkpoint(url_or_step_url: str) -> tuple[str, str | None]:
    """Files, sizes, checksum results (ok/bad/missing), lineage and metadata of one checkpoint, and why
    ``load()`` would skip it (None when it would load it: every check load makes, payloads read back too).

    Accepts ``URL/step_000000012`` or ``URL`` (then the newest ``step_N`` directory, valid or not). Every
    payload is read to verify its sha256. Raises UserError when there is no such checkpoint directory.
    """
    root, step = _split_step_url(url_or_step_url)
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

"""What orch's records are called in a tracker: the Hugging Face / Lightning convention, ``train/...`` for what the
model does, ``system/...`` for the machinery around it, ``goodput/...`` and ``summary/...`` once the run ended.

A ``metrics.jsonl`` record keeps its own flat names (the run dir's format, docs/run-dir.md); only what goes to a
tracker is renamed here, so every script style (the built-in trainer, the elastic API, the HF callback) logs the
same names. docs/tracking.md lists them.
"""

from __future__ import annotations

from typing import Any, Mapping

TRAIN_KEYS = ("loss", "lr", "samples_per_s", "grad_norm", "grad_scale", "tokens_per_s")
"""Record keys that describe training itself: ``train/<key>``. Every other numeric key is ``system/<key>``."""
NOT_METRICS = ("t", "step")


def train_metrics(record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``metrics.jsonl`` record as trackers take it: ``train/loss``, ``train/lr``, ``train/samples_per_s``...;
    ``system/world_size``, ``system/step_time_s``, ``system/restart_count``...; ``timing`` as
    ``system/timing/<phase>_s`` and a mode's ``ft`` seconds as ``system/ft/<name>``. None values are left out."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in NOT_METRICS or value is None:
            continue
        if isinstance(value, Mapping):
            group = "timing" if key == "timing" else key
            out.update({f"system/{group}/{k}": v for k, v in value.items() if v is not None})
        else:
            out[f"train/{key}" if key in TRAIN_KEYS else f"system/{key}"] = value
    return out


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``summary.json``'s figures as final metrics: ``summary/wall_s``, ``summary/steps_completed``,
    ``summary/final_loss``, ``summary/succeeded`` (1 or 0), ...; ``goodput/goodput``, ``goodput/productive_s``,
    ``goodput/lost_steps`` and ``goodput/badput/<category>_s``. Only numbers (the trackers drop the rest)."""
    out: dict[str, Any] = {f"summary/{k}": summary.get(k) for k in (
        "wall_s", "steps_completed", "first_loss", "final_loss", "samples_per_s", "restarts", "preemptions",
        "nodes_lost")}
    out["summary/succeeded"] = 1.0 if summary.get("status") == "succeeded" else 0.0
    goodput = summary.get("goodput") or {}
    for key in ("goodput", "productive_s", "lost_steps"):
        out[f"goodput/{key}"] = goodput.get(key)
    out.update({f"goodput/badput/{k}": v for k, v in (goodput.get("badput") or {}).items()})
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

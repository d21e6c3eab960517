"""transformers.Trainer's checkpoints in an orch run: where they go and how orch marks one complete.

The HF integration (orchestrator/integrations/hf.py) writes them and ``orch ckpt list`` reads them; the layout
lives here because the checkpoint package may not import the integration (nor transformers). HF writes a
``checkpoint-<step>/`` directory file by file, so rank 0 writes :data:`COMPLETE_MARKER` into it last: only a
marked one is whole. Filesystem paths only: HF saves to nothing else.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

HF_SUBDIR = "hf"
"""HF's ``output_dir`` is ``<checkpoint URL>/hf``: beside orch's own ``step_N`` directories, never among them."""
COMPLETE_MARKER = "orch_complete.json"
"""Written by rank 0 into a ``checkpoint-<step>`` directory once every rank's part of it is written:
``{"step", "world_size", "reason", "t"}``."""
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class HfCheckpoint:
    """One ``checkpoint-<step>`` directory; ``marker``: its :data:`COMPLETE_MARKER` record, None when unmarked
    (a save cut short, or one that is still being written)."""

    step: int
    path: str
    total_bytes: int
    marker: Optional[dict[str, Any]] = field(default=None)

    @property
    def complete(self) -> bool:
        return self.marker is not None


def hf_checkpoints(output_dir: Optional[str]) -> list[HfCheckpoint]:
    """Every ``checkpoint-<step>`` directory under ``output_dir``, by step; [] when there is no such directory."""
    if not output_dir or not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_DIR_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append(HfCheckpoint(int(match.group(1)), path, _tree_bytes(path), _read_marker(path)))
    return sorted(found, key=lambda c: c.step)


def _read_marker(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(path, COMPLETE_MARKER)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # there, so complete; its fields unreadable
    return record if isinstance(record, dict) else {}


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # removed while we looked (retention)
    return total

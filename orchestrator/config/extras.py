"""Whether an optional extra that a setting needs is importable here (checked where the config is composed)."""

from __future__ import annotations

import os
from typing import Optional

TORCHFT_REQUIREMENT = "torchft-nightly==2026.10.26"  # the `ft` extra of pyproject.toml


def torchft_problem() -> Optional[str]:
    """Why torchft (``fault_tolerance.mode=per_step``) cannot be used here, or None."""
    # torchft's Rust side logs every quorum and commit at INFO, and reads RUST_LOG when first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft.manager  # noqa: F401
    except ImportError as exc:
        return f"needs torchft ({TORCHFT_REQUIREMENT}), which is not importable here ({exc})"
    return None

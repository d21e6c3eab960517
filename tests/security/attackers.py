"""What the attack tests send: pickles that would run code, and clients that hold no secret. Shared by the
tests in this folder (nothing here runs on import)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path


class Touch:
    """Unpickling this runs ``touch <marker>``: the proof that a payload ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def touching_pickle(marker: Path) -> bytes:
    return pickle.dumps(Touch(marker))


def touching_state(marker: Path) -> bytes:
    """torch's base64 rendezvous state as torch's backend stores it, carrying the payload."""
    return base64.b64encode(touching_pickle(marker))


# A stranger's torch TCPStore client, in a process of its own: writes ``key = value`` at host:port. Prints
# WROTE, or REFUSED and why.
STRANGER = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, key, value = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3)).set(key, value)
    print("WROTE")
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


# The same, for many targets in one process (torch imports once): a JSON list of [host, port, key, value] on
# stdin, one verdict line per target.
STRANGER_MANY = """
import json, sys
from datetime import timedelta
from torch.distributed import TCPStore
for host, port, key, value in json.load(sys.stdin):
    try:
        TCPStore(host, port, is_master=False, timeout=timedelta(seconds=1.5)).set(key, value)
        print("WROTE", flush=True)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, flush=True)
"""


def _stranger_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "ORCH_RUN_SECRET"}


def stranger_writes(host: str, port: int, key: str, value: bytes | str, timeout: float = 60) -> str:
    """Run :data:`STRANGER` (no secret in its environment); returns its verdict."""
    value = value.decode() if isinstance(value, bytes) else value
    out = subprocess.run([sys.executable, "-c", STRANGER, host, str(port), key, value], capture_output=True,
                         text=True, timeout=timeout, env=_stranger_env())
    return out.stdout.strip() or f"REFUSED (exit {out.returncode})"


def stranger_writes_many(targets: list[tuple[str, int, str, bytes | str]], timeout: float = 300) -> list[str]:
    """:data:`STRANGER_MANY` over ``targets`` (host, port, key, value); one verdict per target, in order."""
    payload = json.dumps([[h, p, k, v.decode() if isinstance(v, bytes) else v] for h, p, k, v in targets])
    out = subprocess.run([sys.executable, "-c", STRANGER_MANY], input=payload, capture_output=True, text=True,
                         timeout=timeout, env=_stranger_env())
    verdicts = out.stdout.strip().splitlines()
    return verdicts + [f"REFUSED (exit {out.returncode})"] * (len(targets) - len(verdicts))

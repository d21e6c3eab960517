"""What checking a ``_target_`` learned, remembered: the next launch checks the same target without importing it.

Checking a target's arguments needs its signature, so it imports the target, and ``torch.optim.AdamW`` or
orch's own models import torch: 2-3 s of CPU at the start of every launch (torch, then ``torch._dynamo`` when
the optimizer is constructed) in a driver that needs no torch otherwise, on the cores the node agents are
starting on. So two answers are remembered, keyed by the question and by the code it was asked of:

- a target's facts (:func:`~orchestrator.config.target_args.target_facts`: its parameters, which are
  required, which are numbers): the arguments are then checked against them without the target, every time;
- that torch's optimizer accepted a given set of arguments when constructed.

The code is the target's top-level package and orch itself, each ``.py`` file's path, size and modification
time (found without importing: ~60 ms for torch's 2,300 files), plus the Python version: any change asks
again. Failures are never remembered, so a refusal is always fresh.

The file is ``$XDG_CACHE_HOME/orch/checked_targets.json`` (default ``~/.cache/orch/``) in a directory created
0700, JSON only: only its owner can make a check be skipped, and at worst a skipped check leaves a bad argument
for the workers to find, as they would without any check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

CACHE_ENV = "XDG_CACHE_HOME"
CACHE_FILE = "checked_targets.json"
MAX_ENTRIES = 512  # the oldest answers are dropped past this


def cache_path() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orch" / CACHE_FILE


@lru_cache(maxsize=None)
def code_fingerprint(top_level: str) -> Optional[str]:
    """The identity of top-level package or module ``top_level``'s code, without importing it: every ``.py``
    file's path, size and modification time. None if it cannot be found that way."""
    try:
        spec = importlib.util.find_spec(top_level)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    roots = list(spec.submodule_search_locations or [])
    if len(roots) == 1 and (record := _installed_record(roots[0], top_level)) is not None:
        return record
    files = [spec.origin] if not roots else []
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs.sort()
            files.extend(os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))
    digest = hashlib.sha256()
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            continue
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _installed_record(root: str, top_level: str) -> Optional[str]:
    """The identity of package ``top_level`` at ``root`` when pip installed it there as a distribution of the same
    name (torch): its RECORD file's path, size and modification time, which every install rewrites. Walking
    such a package's files instead would stat thousands of them at every launch (torch: ~0.05 s)."""
    parent, wanted = os.path.dirname(root), top_level.lower().replace("-", "_")
    try:
        entries = [e for e in os.scandir(parent) if e.name.endswith(".dist-info")
                   and e.name.split("-")[0].lower().replace(".", "_") == wanted]
    except OSError:
        return None
    if len(entries) != 1:
        return None  # none (an editable checkout), or several versions side by side: walk the files
    try:
        st = os.stat(os.path.join(entries[0].path, "RECORD"))
    except OSError:
        return None
    return hashlib.sha256(f"{entries[0].path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()


def question_key(question: list[Any], target: str) -> Optional[str]:
    """``question`` (JSON) asked of ``target``'s code and orch's, hashed; None when either cannot be
    fingerprinted (then nothing is remembered)."""
    target_code, orch_code = code_fingerprint(str(target).split(".")[0]), code_fingerprint("orchestrator")
    if target_code is None or orch_code is None:
        return None
    what = json.dumps([question, sys.version_info[:2], target_code, orch_code], sort_keys=True, default=repr)
    return hashlib.sha256(what.encode()).hexdigest()


def _load(path: Path) -> dict[str, Any]:
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _store(path: Path, answers: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(list(answers.items())[-MAX_ENTRIES:]), f)
        os.replace(tmp, path)  # readers see the old answers or the new, whole; a concurrent writer's may win
    except OSError:
        pass  # a read-only home: every launch asks again, as without this file


def remembered(question: list[Any], target: str, answer: Callable[[], Any],
               valid: Callable[[Any], bool] = lambda value: value is not None) -> Any:
    """``answer()`` (JSON, not None; it may raise, and then nothing is remembered) to ``question`` about
    ``target``, or the answer it gave before on the same code (if ``valid``: a file edited by hand is asked
    again, not trusted)."""
    key = question_key(question, target)
    path = cache_path()
    if key is not None:
        known = _load(path).get(key)
        if known is not None and valid(known):
            return known
    value = answer()
    if key is not None:
        answers = _load(path)
        answers.pop(key, None)
        _store(path, {**answers, key: value})
    return value

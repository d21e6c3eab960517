"""Notice files: the one way orch tells the workers of one node that the node is about to be taken away.

A notice is ``<run dir>/notices/node<N>-<agent pid>.json``, ``{"t", "grace_s", "node", "agent_pid", "source",
"detail"}``, written by whoever learns of the preemption outside the workers: ``orch chaos preempt`` (source
``chaos``), or the controller, before it forwards its own SIGTERM to the node's torchrun agent (source
``sigterm``: a pod eviction). The workers under that agent (their parent process) read it:

- at start-up, so workers that torchrun (re)starts after the notice came, between two rounds, still act on it
  at their first step boundary: the file is never removed, it lasts as long as the agent;
- in their SIGTERM handler, under orch's launcher (``ORCH_SIGTERM_NOTICE=file``, set by the plan): torchrun
  also SIGTERMs the workers it restarts for a membership change, and only a ``sigterm`` notice file says that
  this SIGTERM is a preemption notice;
- ``chaos`` notices are also polled by local rank 0 (the ``chaos`` source), since no signal comes with them.

Workers write one too: a notice a cloud metadata source announced (perhaps only once) is handed over to the
agent's file (:meth:`AgentNotices.hand_over`), so that it outlives a restart of the workers that saw it.

The agent PID in the name keeps a replacement agent for the same node index from acting on its predecessor's
notice. Imports nothing from torch, Ray or a launcher.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from orchestrator.rundir import NOTICES_DIR

SIGTERM_NOTICE_ENV = "ORCH_SIGTERM_NOTICE"
"""How a worker reads SIGTERM: ``file`` (set on every node by orch's plan): a notice only if a ``sigterm``
notice file for its agent exists, otherwise torchrun restarting the workers; ``always`` or unset (a bare
torchrun, where the kubelet or a scheduler signals torchrun directly): every SIGTERM is a notice."""
SIGTERM_NOTICE_FILE = "file"
SIGTERM_NOTICE_ALWAYS = "always"
SIGTERM_SOURCE = "sigterm"
"""The notice source that announces a SIGTERM: a notice of any other source stands on its own."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice: which source saw it, when (unix seconds), and what it said."""

    source: str
    detail: str
    t: float = field(default_factory=time.time)
    grace_s: Optional[float] = None
    """Seconds from ``t`` to the hard kill, when the notice says (notice files do); None: the configured grace."""


def notice_path(run_dir: str | os.PathLike, node: int, agent_pid: int) -> Path:
    """The notice file of one torchrun agent (``agent_pid``) of node ``node``."""
    return Path(run_dir) / NOTICES_DIR / f"node{node}-{agent_pid}.json"


def deliver_notice(run_dir: str | os.PathLike, node: int, agent_pid: int, grace_s: float, source: str,
                   detail: str = "") -> Path:
    """Give the workers of agent ``agent_pid`` (node ``node``) a preemption notice: the node goes away in
    ``grace_s`` seconds. Returns the notice file's path.

    The file appears whole or not at all (written aside, then renamed into place), so a reader never sees half
    a notice. ``source="sigterm"`` promises that the agent gets SIGTERM next (deliver first, then signal): it
    is what turns the SIGTERM the workers then receive into a notice, so it replaces an earlier notice of
    another source (workers that already hold that one keep it) and is never replaced by a later one. Any
    other source is a notice by itself, which the workers poll or read at start-up.
    """
    path = notice_path(run_dir, node, agent_pid)
    if source != SIGTERM_SOURCE:
        current = read_notice(run_dir, node, agent_pid)
        if current is not None and current.source == SIGTERM_SOURCE:
            return path  # the SIGTERM it announces is on its way: the workers must still read it as a notice
    record = {"t": time.time(), "grace_s": grace_s, "node": node, "agent_pid": agent_pid, "source": source,
              "detail": detail}
    return _write(path, record, replace=True)


def _write(path: Path, record: dict, replace: bool) -> Path:
    """Write ``record`` to ``path`` whole (aside, then renamed or linked into place); ``replace=False`` leaves a
    notice already there as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    tmp.write_text(json.dumps(record) + "\n")
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic create-if-absent
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: a rename is atomic too, only not create-if-absent
        if not path.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_notice(run_dir: str | os.PathLike, node: int, agent_pid: int) -> Optional[Notice]:
    """The notice given to agent ``agent_pid`` of node ``node``, or None. One ``open``: cheap enough for a
    signal handler. A file that does not parse is treated as absent (never written by deliver_notice)."""
    try:
        record = json.loads(notice_path(run_dir, node, agent_pid).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    source = str(record.get("source") or "chaos")  # files written before sources were recorded: chaos drills
    grace = record.get("grace_s")
    detail = record.get("detail") or f"{source} notice file (grace {grace} s)"
    return Notice(source, detail, float(record.get("t", time.time())), None if grace is None else float(grace))


@dataclass(frozen=True)
class AgentNotices:
    """The notice file of this worker's torchrun agent, as the worker reads it: only notices whose source is in
    ``accept`` (the sources the worker's ``preemption.sources`` enables) count."""

    run_dir: str
    node: int
    agent_pid: int
    accept: frozenset[str]

    @classmethod
    def of_parent(cls, run_dir: str, node: int, accept: set[str] | frozenset[str]) -> "AgentNotices":
        """This worker's agent is its parent process: torchrun starts every worker itself."""
        return cls(str(run_dir), node, os.getppid(), frozenset(accept))

    @property
    def path(self) -> Path:
        return notice_path(self.run_dir, self.node, self.agent_pid)

    def read(self) -> Optional[Notice]:
        notice = read_notice(self.run_dir, self.node, self.agent_pid)
        return notice if notice is not None and notice.source in self.accept else None

    def hand_over(self, notice: Notice) -> Path:
        """Keep ``notice`` (one a polled source saw: a cloud's metadata may announce it only once) for the
        workers this agent starts next, should torchrun restart these before they act on it. Keeps its time, and
        leaves a notice already in the file (orch's, or an earlier one) as it is."""
        record = {"t": notice.t, "grace_s": notice.grace_s, "node": self.node, "agent_pid": self.agent_pid,
                  "source": notice.source, "detail": notice.detail}
        return _write(self.path, record, replace=False)


def sigterm_notice_mode(environ: Mapping[str, str] = os.environ) -> str:
    """``file`` or ``always`` (see SIGTERM_NOTICE_ENV); raises ValueError naming the variable for anything else."""
    mode = environ.get(SIGTERM_NOTICE_ENV) or SIGTERM_NOTICE_ALWAYS
    if mode not in (SIGTERM_NOTICE_FILE, SIGTERM_NOTICE_ALWAYS):
        raise ValueError(f"{SIGTERM_NOTICE_ENV}={mode!r} is invalid. Fix: use {SIGTERM_NOTICE_FILE!r} (under orch's "
                         f"launcher) or {SIGTERM_NOTICE_ALWAYS!r} / unset (every SIGTERM is a notice)")
    return mode

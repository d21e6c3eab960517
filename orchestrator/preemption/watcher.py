"""The worker's view of preemption: any source may raise the flag; the trainer acts at a step boundary.

A notice only sets the flag, so the current step finishes and the emergency checkpoint is written before the
process exits with ``PREEMPTED_EXIT_CODE``, which launchers read as "preempted", not "failed".

SIGTERM means one of two things to a torchrun worker: a preemption notice (the kubelet, a scheduler, or orch
forwarding its own SIGTERM through the agent), or torchrun stopping the workers it is about to restart for a
membership change (a node joined or left). ``sigterm_mode`` says how to tell them apart:

- ``always`` (a bare torchrun; nothing else tells them apart): every SIGTERM is a notice;
- ``file`` (under orch's launcher, ``ORCH_SIGTERM_NOTICE=file``): a SIGTERM is a notice only when this worker's
  agent has a ``sigterm`` notice file (orch writes it before it forwards SIGTERM, see notices.py). Otherwise
  torchrun is restarting the workers: no checkpoint, no event, the worker leaves, unless it is already saving
  on a notice. A notice of another source that it held but had not acted on yet is not lost: it is in the
  agent's notice file (chaos drills write one; a polled cloud notice is handed over to one, since a metadata
  service may announce it only once), which outlives the workers: the next ones read it at start-up and act
  on it at their first step boundary.

Leaving on a restart: each agent notices a joining node on its own monitor tick, so the workers of a round get
their SIGTERMs up to a tick or more apart. A worker that left at once would break the collective its peers are
in, and they would fail (``worker_failed``, a restart spent) before their own agent restarts them. A caller that
agrees at every step boundary (``defer_restart``: the built-in trainer) therefore only records the SIGTERM
(``restart_requested``), agrees with the other ranks at the next boundary, and then every rank leaves through
:meth:`PreemptionWatcher.leave_for_restart` as its own SIGTERM arrives. Without ``defer_restart`` (no step
boundary to agree at) the worker leaves inside the handler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import NoReturn, Optional

from orchestrator.preemption.notices import (SIGTERM_NOTICE_ALWAYS, SIGTERM_NOTICE_FILE, SIGTERM_SOURCE,
                                             AgentNotices, Notice)
from orchestrator.preemption.sources import NoticeSource

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: try again later, elsewhere
RESTART_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a SIGTERM death: torchrun only waits for it
RESTART_MESSAGE = b"[orch] SIGTERM without a preemption notice: torchrun is restarting the workers; leaving now\n"
NO_RESTART_MESSAGE = (b"[orch] another rank left on a SIGTERM without notice, but this worker's agent sent it none: "
                      b"a node is leaving; leaving too so the agent starts a new round\n")


class PreemptionWatcher:
    """Collects notices from ``sources`` (polled in a daemon thread), from ``notices`` (this worker's agent's
    notice file, read once at :meth:`start` and, in ``file`` mode, on SIGTERM) and from SIGTERM per
    ``sigterm_mode``: ``always``, ``file`` (see the module docstring) or None (SIGTERM keeps its default
    action). ``notice`` is the first notice seen; it never changes after. ``defer_restart``: the caller agrees on
    ``restart_requested`` with the other ranks at every step boundary and then calls :meth:`leave_for_restart`
    (see the module docstring); until :meth:`stop`."""

    def __init__(self, sources: list[NoticeSource], sigterm_mode: Optional[str], poll_interval_s: float,
                 notices: Optional[AgentNotices] = None, defer_restart: bool = False):
        if sigterm_mode not in (None, SIGTERM_NOTICE_ALWAYS, SIGTERM_NOTICE_FILE):
            raise ValueError(f"sigterm_mode={sigterm_mode!r}: use None, {SIGTERM_NOTICE_ALWAYS!r} or "
                             f"{SIGTERM_NOTICE_FILE!r}")
        self.sources, self.sigterm_mode, self.poll_interval_s = sources, sigterm_mode, poll_interval_s
        self.notices = notices
        self.notice: Optional[Notice] = None
        self.restart_requested = False
        """This worker got a SIGTERM that is no notice (``file`` mode, ``defer_restart``): torchrun restarts it."""
        self._defer_restart = defer_restart
        self._restart_agreed = False
        self._acting = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "PreemptionWatcher":
        """Read the agent's notice file (a notice given between rounds, before these workers started, is acted on
        at their first step boundary), install the SIGTERM handler, start polling. Call from the main thread."""
        if self.notices is not None:
            self._take(self.notices.read())
        if self.sigterm_mode is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.sources and self.notice is None:
            self._thread = threading.Thread(target=self._poll_forever, name="orch-preemption-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; no step boundary comes any more, so a SIGTERM that is no notice ends the worker at once."""
        self._stop.set()
        self._defer_restart = False

    @property
    def noticed(self) -> bool:
        return self.notice is not None

    def mark_acting(self) -> None:
        """The worker is saving and leaving on a notice (its own or another rank's): from now on a SIGTERM that
        is no notice does not end it early; the emergency checkpoint is worth more than a prompt restart."""
        self._acting = True

    def leave_for_restart(self, wait_s: float) -> NoReturn:
        """The ranks agreed at a step boundary that torchrun is restarting the workers (some rank got its SIGTERM):
        leave as soon as this worker's own SIGTERM comes (at once if it came already), without a checkpoint. If
        none comes within ``wait_s``, this agent is not restarting: a peer node is leaving, and the round is
        broken all the same, so leave anyway and let the agent start a new one."""
        self._restart_agreed = True
        if self.restart_requested:
            self._leave(RESTART_MESSAGE, RESTART_EXIT_CODE)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)  # the SIGTERM handler leaves from inside this sleep
        self._leave(NO_RESTART_MESSAGE, RESTART_EXIT_CODE)

    def _take(self, notice: Optional[Notice]) -> None:
        if notice is not None and self.notice is None:
            self.notice = notice

    def _on_sigterm(self, signum, frame) -> None:
        if self.sigterm_mode == SIGTERM_NOTICE_ALWAYS:
            self._take(Notice(SIGTERM_SOURCE, "SIGTERM received"))
            return
        if self._acting:
            return
        notice = self.notices.read() if self.notices is not None else None
        if notice is not None and notice.source == SIGTERM_SOURCE:
            self._take(notice)
            return
        if self._defer_restart and not self._restart_agreed:
            self.restart_requested = True  # the next step boundary tells every rank
            return
        self._leave(RESTART_MESSAGE, 128 + signum)

    @staticmethod
    def _leave(message: bytes, code: int) -> NoReturn:
        """Leave for a restart: nothing to save, and torchrun's next round waits for this exit, so skip the
        interpreter's teardown (1-2 s of torch module and process-group finalizers on a busy node)."""
        os.write(2, message)  # not print(): a signal handler may have interrupted a write to sys.stderr
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a reentrant flush from inside a handler: what it held is lost, never the exit
                pass
        os._exit(code)

    def _hand_over(self, notice: Notice) -> None:
        if self.notices is None:
            return
        try:
            self.notices.hand_over(notice)
        except OSError:  # a run dir that cannot be written: these workers still act on the notice themselves
            pass

    def _poll_forever(self) -> None:
        while not self._stop.is_set() and self.notice is None:
            for source in self.sources:
                try:
                    notice = source.poll()
                except Exception:  # an unreachable metadata server is not a notice; keep polling
                    notice = None
                if notice is not None:
                    self._take(notice)
                    self._hand_over(notice)
                    return
            self._stop.wait(self.poll_interval_s)

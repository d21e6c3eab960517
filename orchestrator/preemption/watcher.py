"""The worker's view of preemption: any source may raise the flag; the trainer acts at a step boundary.

SIGTERM (Kubernetes, torchrun forwarding its own SIGTERM, generic schedulers) only sets the flag, so the
current step finishes and the emergency checkpoint is written before the process exits with
``PREEMPTED_EXIT_CODE``, which launchers read as "preempted", not "failed".
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

from orchestrator.preemption.sources import Notice, NoticeSource

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: try again later, elsewhere


class PreemptionWatcher:
    """Collects notices from ``sources`` (polled in a daemon thread) and, if ``sigterm``, from SIGTERM."""

    def __init__(self, sources: list[NoticeSource], handle_sigterm: bool, poll_interval_s: float):
        self.sources, self.handle_sigterm, self.poll_interval_s = sources, handle_sigterm, poll_interval_s
        self.notice: Optional[Notice] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "PreemptionWatcher":
        if self.handle_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.sources:
            self._thread = threading.Thread(target=self._poll_forever, name="orch-preemption-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def noticed(self) -> bool:
        return self.notice is not None

    def _on_sigterm(self, signum, frame) -> None:
        if self.notice is None:
            self.notice = Notice("sigterm", "SIGTERM received")

    def _poll_forever(self) -> None:
        while not self._stop.is_set() and self.notice is None:
            for source in self.sources:
                try:
                    notice = source.poll()
                except Exception:  # an unreachable metadata server is not a notice; keep polling
                    notice = None
                if notice is not None and self.notice is None:
                    self.notice = notice
                    return
            self._stop.wait(self.poll_interval_s)

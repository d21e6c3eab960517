"""Preemption notices: where they come from (sources), how orch hands one to a node's workers (notices), and
how a worker learns of one (watcher).

Imports no Ray and no launcher: the watcher runs inside torchrun workers, in pods and under the controller.
"""

from orchestrator.preemption.notices import (SIGTERM_NOTICE_ENV, SIGTERM_NOTICE_FILE, AgentNotices, Notice,
                                             deliver_notice, notice_path, read_notice, sigterm_notice_mode)
from orchestrator.preemption.sources import NoticeSource, build_sources
from orchestrator.preemption.watcher import PREEMPTED_EXIT_CODE, PreemptionWatcher

__all__ = ["Notice", "NoticeSource", "build_sources", "PreemptionWatcher", "PREEMPTED_EXIT_CODE", "AgentNotices",
           "deliver_notice", "notice_path", "read_notice", "sigterm_notice_mode", "SIGTERM_NOTICE_ENV",
           "SIGTERM_NOTICE_FILE"]

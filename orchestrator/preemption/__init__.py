"""Preemption notices: where they come from (sources) and how a worker learns of one (watcher).

Imports no Ray and no launcher: the watcher runs inside torchrun workers, in pods and under the controller.
"""

from orchestrator.preemption.sources import Notice, NoticeSource, build_sources
from orchestrator.preemption.watcher import PREEMPTED_EXIT_CODE, PreemptionWatcher

__all__ = ["Notice", "NoticeSource", "build_sources", "PreemptionWatcher", "PREEMPTED_EXIT_CODE"]

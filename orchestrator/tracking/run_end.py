"""The run's end in its trackers: the driver, once ``summary.json`` is written, opens the run's tracker runs again
(the same ones rank 0 logged into: found by the run id) and adds the summary's figures as final metrics
(orchestrator/tracking/names.py), the run's files as artifacts and how it ended.

Tracking never fails a run: a tracker that cannot be opened or written here is reported in one line and skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from orchestrator.rundir import CONFIG_FILE, SUMMARY_FILE
from orchestrator.tracking.api import open_trackers, selected
from orchestrator.tracking.names import summary_metrics

log = logging.getLogger(__name__)
REPORT_FILES = ("report.md", "report.json")


def run_files(run_dir: str | Path) -> list[Path]:
    """What a tracker keeps of the run: config.yaml, summary.json, and ``orch report``'s report and plots when
    they are there."""
    run_dir = Path(run_dir)
    names = (CONFIG_FILE, SUMMARY_FILE, *REPORT_FILES)
    return [run_dir / n for n in names if (run_dir / n).is_file()] + sorted(run_dir.glob("*.png"))


def record_run_end(cfg: Any, run_dir: str | Path, run_id: str, summary: Mapping[str, Any]) -> None:
    """Final metrics, artifacts and the status of run ``run_id`` in every tracker ``cfg.logger`` selects."""
    if getattr(cfg, "logger", None) is None or not selected(cfg.logger):
        return
    try:
        with open_trackers(cfg, run_dir, rank=0, run_name=run_id) as trackers:
            trackers.log_config(cfg)  # a tracker run rank 0 never opened (a run that failed early) gets it here
            trackers.log_summary(int(summary.get("steps_completed") or 0), summary_metrics(summary),
                                 run_files(run_dir), str(summary.get("status")))
    except Exception as exc:  # noqa: BLE001 - the run is over and recorded in its run dir; trackers are extra
        log.warning("trackers: the run's end was not recorded: %s", exc)

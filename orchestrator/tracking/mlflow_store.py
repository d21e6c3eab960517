"""MLflow: one MLflow run per orch run, through ``MlflowClient`` (the ``mlflow`` extra: ``mlflow-skinny``).

The client is used directly, never ``mlflow.start_run``: no process-global active run, no environment or git
autologging, so nothing but the config and the metrics leaves the process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# MLflow caps a param value at 6000 characters (500 on older servers) and a batch at 100 params / 1000 metrics.
MAX_PARAM_CHARS = 500
PARAM_BATCH = 100
RUN_TAG = "orch.run_id"  # the orch run an MLflow run belongs to: restarted workers find and continue it


def default_tracking_uri(run_dir: Path) -> str:
    """A file store in the run dir: ``file:///abs/<run dir>/mlruns``."""
    return (Path(run_dir).resolve() / "mlruns").as_uri()


def is_file_store(uri: str) -> bool:
    """A ``file:`` URI or a plain path (MLflow's file store), not ``sqlite:``, ``http(s):``, ``databricks``..."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive


class MLflowTracker:
    """Params from the config, metrics per step; the run ends FINISHED on close. One orch run is one MLflow
    run: workers that restart (and open the tracker again) continue the run tagged with the same run name."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str):
        if is_file_store(tracking_uri):
            # MLflow 3 refuses its file store ("maintenance mode") unless this is set; it is still the store that
            # needs no database and no server, so the run dir can hold everything.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        previous = self._find_run(experiment_id, run_name)
        if previous:  # workers restarted (failure, membership change, resume): keep logging into the same run
            self.run_id = previous.info.run_id
            self._logged = dict(previous.data.params)
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=run_name,
                                                  tags={RUN_TAG: run_name}).info.run_id
            self._logged = {}
        self._status = "FINISHED"

    def _find_run(self, experiment_id: str, run_name: str):
        if "'" in run_name:
            return None
        runs = self._client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'",
                                        max_results=1)
        return runs[0] if runs else None

    def log_config(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A param cannot change once logged (MLflow rejects it): after a restart, log only the new keys.
        items = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in params.items() if key not in self._logged]
        self._logged.update((p.key, p.value) for p in items)
        for start in range(0, len(items), PARAM_BATCH):
            self._client.log_batch(self.run_id, params=items[start:start + PARAM_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_summary(self, step: int, metrics: dict[str, float], files: list[Path], status: str) -> None:
        """Final metrics at the last step, the files as artifacts, and the run's end as MLflow's status (FAILED,
        KILLED for a run stopped or preempted: ``orch resume`` goes on with it)."""
        self.log_metrics(step, metrics)
        for path in files:
            self._client.log_artifact(self.run_id, str(path))
        self._status = {"succeeded": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")

    def close(self) -> None:
        self._client.set_terminated(self.run_id, self._status)


def open(settings: Any, run_dir: Path, run_name: str) -> MLflowTracker:
    """Open a run in ``settings.experiment`` at ``settings.tracking_uri`` (default ``<run dir>/mlruns``)."""
    return MLflowTracker(settings.tracking_uri or default_tracking_uri(run_dir), settings.experiment, run_name)

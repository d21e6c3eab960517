"""Experiment tracking: TensorBoard, MLflow and Weights & Biases, chosen with the ``logger`` config group.

Rank 0 opens the trackers once and feeds them the run's flattened config and every metrics record::

    trackers = open_trackers(cfg, run_dir, rank)
    trackers.log_config(config_dict)
    trackers.log_metrics(step, {"train/loss": 2.1, "train/lr": 3e-3})
    trackers.close()

Any other rank, or ``logger=none``, gets a :class:`Trackers` that does nothing, so callers need no ``if``.
"""

from orchestrator.tracking.api import Tracker, Trackers, flatten_config, numeric_metrics, open_trackers

__all__ = ["Tracker", "Trackers", "flatten_config", "numeric_metrics", "open_trackers"]

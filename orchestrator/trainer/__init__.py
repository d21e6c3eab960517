"""The built-in trainer: the first user of the elastic API (orchestrator/elastic/), on top of the worker's
layers. ``python -m orchestrator.trainer.train --config RUN_DIR/config.yaml`` is what torchrun runs on every
rank when the run names no entrypoint of its own (:mod:`.train`); :class:`~.trainer.Trainer` is the loop."""

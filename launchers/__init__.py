"""orch's sites: where a launch's nodes run and where its store lives, one module per launcher name
(``local.py``, ``ray.py``) plus the test-cluster variant of both (``testcluster.py``), all driven by one wiring
(``runner.py``). ``orchestrator.site`` finds them by name; nothing under ``orchestrator/`` imports this package."""

"""The opt-in pytest plugin for test clusters: ``pytest -p orch_testcluster`` or, in a conftest.py,
``pytest_plugins = ["orch_testcluster"]``. It is not loaded into every pytest session of a machine where orch
is installed; see orchestrator/testcluster/pytest_plugin.py for the ``testcluster`` fixture."""

from orchestrator.testcluster.pytest_plugin import pytest_configure, testcluster, testcluster_unavailable  # noqa: F401

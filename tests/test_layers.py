"""The package layers of docs/architecture.md, as import-linter contracts (pyproject.toml's
``[tool.importlinter]``): no loops between orch's packages (imports inside functions included), nothing under
``orchestrator/`` importing a site, the core path knowing no test cluster, the worker side in layers
(runtime < checkpoint < ft < elastic < trainer < integrations, over a base and leaves that import none of them)
and never importing the driver side or Ray. Fast: import-linter reads the sources, imports nothing of orch.
``lint-imports`` at the repository's root prints the same report."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def test_the_layer_contracts_hold(monkeypatch, capsys):
    from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # lint_imports puts the cwd first
    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_logo=True, no_cache=True)
    assert status == EXIT_STATUS_SUCCESS, capsys.readouterr().out[-8000:]

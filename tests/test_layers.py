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


def imported_by(modules: list[str], package: str) -> bool:
    """Whether importing ``modules`` in a fresh interpreter imports ``package``."""
    import subprocess
    import sys

    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint({package!r} in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() in ("True", "False"), result.stderr[-3000:]
    return result.stdout.strip() == "True"


@pytest.mark.slow
def test_the_driver_imports_no_torch():
    """The launch command's own modules (config, plan, site, controller, run dir, reports) import no torch:
    only the workers and the checkpoint tools need it, and importing it costs the driver 2-3 s of CPU at every
    launch, on the cores its agents are starting on. (Config checks that need a target remember what they
    learned: orchestrator/config/checked_targets.py.)"""
    driver = ["orchestrator.cli", "orchestrator.launch", "launchers.runner", "launchers.local", "launchers.ray",
              "launchers.testcluster", "orchestrator.controller.controller", "orchestrator.preflight",
              "orchestrator.report.summary", "orchestrator.checkpoint.lease", "orchestrator.rendezvous.store",
              "orchestrator.ft.driver", "orchestrator.ft.quorum", "orchestrator.tracking.run_end"]
    assert not imported_by(driver, "torch")


@pytest.mark.slow
def test_agents_and_the_elastic_api_import_no_hydra():
    """A node's agent and a user script's worker (the elastic API) load the run's resolved config.yaml with
    OmegaConf; Hydra's composing is the driver's (importing it cost each of them ~0.2 s of a launch's start).
    The built-in trainer imports hydra.utils for ``instantiate`` alone."""
    assert not imported_by(["orchestrator.rendezvous.agent", "orchestrator.elastic"], "hydra")


CORE_PATH = ["orchestrator/plan", "orchestrator/controller", "orchestrator/launch.py", "orchestrator/rundir.py",
             "orchestrator/report", "orchestrator/elastic", "orchestrator/runtime", "orchestrator/checkpoint"]


def test_the_core_path_names_per_step_at_most_five_times():
    """A fault-tolerance mode is a plug-in (orchestrator/ft): the core path that runs every mode does not know
    per_step by name, in code or in comments (issue 24: at most 5 references)."""
    found = []
    for entry in CORE_PATH:
        path = ROOT / entry
        for source in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            found += [f"{source.relative_to(ROOT)}:{n}" for n, line in enumerate(source.read_text().splitlines(), 1)
                      if "per_step" in line]
    assert len(found) <= 5, found

"""The wheel works outside a checkout: built from a clean copy of the repository, installed into a fresh venv,
run from another directory, it finds its presets (they ship inside it, docs/configuration.md).

Installing torch and Ray into the fresh venv takes minutes here, so by default the venv gets the test venv's
installed packages (orch's own left out) through links and ``pip check`` proves they satisfy the wheel's
requirements; ``ORCH_WHEEL_TEST_FULL=1`` installs ``torch==2.13.0`` and the wheel with its dependencies instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from orchproc import REPO

LEFT_OUT = shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache")


def run(*argv, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ORCH_CONF_PATH", "ORCH_CONF_DIR")}
    out = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{argv}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out


def link_installed_packages(venv: Path) -> None:
    """The test venv's installed distributions, orch's own (and its editable finder) left out."""
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for entry in ours.iterdir():
        if entry.name.startswith(("orch-", "__editable__", "orchestrator", "orch_testcluster", "pip")) or (theirs / entry.name).exists():
            continue
        (theirs / entry.name).symlink_to(entry)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_from_a_clean_copy_runs_outside_the_repo(tmp_path):
    src, venv, elsewhere = tmp_path / "src", tmp_path / "venv", tmp_path / "elsewhere"
    shutil.copytree(REPO, src, symlinks=True, ignore=LEFT_OUT)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src,
        cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("orch-*.whl"))
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile"]
    if os.environ.get("ORCH_WHEEL_TEST_FULL") == "1":
        run(*pip, "torch==2.13.0", wheel, cwd=tmp_path, timeout=800)
    else:
        link_installed_packages(venv)
        run(*pip, "--no-deps", wheel, cwd=tmp_path)
        checked = subprocess.run([venv / "bin" / "python", "-m", "pip", "check"], capture_output=True, text=True)
        assert not [line for line in checked.stdout.splitlines() if line.startswith("orch ")], checked.stdout

    elsewhere.mkdir()
    where = run(venv / "bin" / "python", "-c", "import orchestrator; print(orchestrator.__file__)", cwd=elsewhere)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel's copy, not the checkout
    planned = run(venv / "bin" / "orch", "launch", "conf=cpu_gloo", "--dry-run", cwd=elsewhere)
    assert "launch plan for preset 'cpu_gloo'" in planned.stdout
    assert f"run dir:      {elsewhere}/runs/cpu_gloo/" in planned.stdout
    helped = run(venv / "bin" / "orch", "launch", "--help", cwd=elsewhere)
    assert "bert8gpu, bert8gpu_fsdp, cpu_elastic, cpu_fsdp, cpu_gloo" in helped.stdout
    assert not (elsewhere / "runs").exists()  # a dry run writes nothing

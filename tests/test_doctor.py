"""Tests for orchestrator.doctor: run the real environment checks (CPU machine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.doctor import Check, format_checks, main_doctor, run_checks

REPO = Path(__file__).resolve().parents[1]

EXPECTED_NAMES = {
    "python", "torch", "cuda", "nccl", "gloo", "defaults", "cpu",
    "shm", "ray", "fsspec", "free_port", "hostname",
}


@pytest.fixture(scope="module")
def checks() -> dict[str, Check]:
    result = run_checks()
    assert all(isinstance(c, Check) for c in result)
    return {c.name: c for c in result}


@pytest.mark.timeout(60)
def test_all_checks_present_and_required_ok(checks):
    assert EXPECTED_NAMES <= set(checks)
    for c in checks.values():
        assert isinstance(c.detail, str) and c.detail
        if c.required:
            assert c.ok, f"required check {c.name} failed: {c.detail}"
    assert {n for n, c in checks.items() if c.required} == {"torch", "gloo", "free_port"}


@pytest.mark.timeout(60)
def test_gloo_ok(checks):
    assert checks["gloo"].ok and checks["gloo"].required


@pytest.mark.timeout(60)
def test_free_port_ok_with_port(checks):
    c = checks["free_port"]
    assert c.ok and c.required, c.detail
    m = re.search(r"port (\d+)", c.detail)
    assert m and int(m.group(1)) > 0
    assert "TCPStore" in c.detail


@pytest.mark.timeout(60)
def test_cuda_absent_is_not_a_failure(checks):
    if torch.cuda.is_available():
        pytest.skip("CUDA present on this machine")
    c = checks["cuda"]
    assert c.ok and not c.required
    assert "no CUDA devices" in c.detail and "cpu_gloo" in c.detail
    assert checks["nccl"].ok


@pytest.mark.timeout(60)
def test_torch_and_info_checks(checks):
    assert torch.__version__ in checks["torch"].detail
    if torch.version.cuda is None:
        assert "CPU build" in checks["torch"].detail
    assert str(torch.get_default_dtype()) in checks["defaults"].detail
    assert str(torch.get_num_threads()) in checks["cpu"].detail
    assert "/dev/shm" in checks["shm"].detail


@pytest.mark.timeout(60)
def test_failing_probe_is_isolated(monkeypatch):
    import orchestrator.doctor as doctor

    def boom():
        raise RuntimeError("probe exploded")

    probes = list(doctor._PROBES)
    probes[0] = ("python", boom, False)
    probes.insert(1, ("needed", boom, True))
    monkeypatch.setattr(doctor, "_PROBES", probes)
    result = {c.name: c for c in doctor.run_checks()}
    assert not result["python"].ok and "probe exploded" in result["python"].detail
    assert result["gloo"].ok  # later probes still ran
    assert main_doctor() == 1  # a failing required check -> exit code 1


@pytest.mark.timeout(60)
def test_format_checks_table():
    text = format_checks([Check("a", True, "fine", True), Check("bb", False, "meh")])
    lines = text.splitlines()
    assert lines[0].split() == ["STATUS", "CHECK", "REQUIRED", "DETAIL"]
    assert any(line.startswith("OK") and "fine" in line for line in lines)
    assert any(line.startswith("WARN") and "meh" in line for line in lines)
    assert "all ok" in text


@pytest.mark.timeout(60)
def test_main_doctor_exit_code_and_plain_output(capsys):
    assert main_doctor() == 0
    out = capsys.readouterr().out
    assert "STATUS" in out and "free_port" in out and torch.__version__ in out


@pytest.mark.timeout(60)
def test_main_doctor_json(capsys):
    assert main_doctor(json_out=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, list)
    assert EXPECTED_NAMES <= {d["name"] for d in data}
    for d in data:
        assert set(d) == {"name", "ok", "detail", "required"}
    assert next(d for d in data if d["name"] == "gloo")["ok"] is True


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c",
         "from orchestrator.doctor import main_doctor; raise SystemExit(main_doctor())"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=50,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert torch.__version__ in proc.stdout

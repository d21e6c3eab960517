"""What a target check learned is remembered for the same code (no import the next time); a change asks again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from orchestrator.config.checked_targets import cache_path, code_fingerprint, remembered
from orchestrator.config.validate import check_instantiable
from orchestrator.errors import ConfigError


def asked(question, target, answers):
    return remembered(question, target, lambda: answers.append(question) or {"n": len(answers)})


def test_an_answer_is_remembered_per_question_and_a_failure_never_is():
    answers: list = []
    assert asked(["test", "orchestrator.runtime.models.BertMLM"], "orchestrator.runtime.models.BertMLM",
                 answers) == {"n": 1}
    assert asked(["test", "orchestrator.runtime.models.BertMLM"], "orchestrator.runtime.models.BertMLM",
                 answers) == {"n": 1}
    assert asked(["test", "torch.optim.AdamW", {"lr": 0.1}], "torch.optim.AdamW", answers) == {"n": 2}
    assert len(answers) == 2

    def refuse():
        answers.append("refused")
        raise ConfigError("optim", "torch.optim.SGD", "set optim.momentum", "refuses its arguments")

    for _ in range(2):
        with pytest.raises(ConfigError):
            remembered(["test", "torch.optim.SGD", {"nesterov": True}], "torch.optim.SGD", refuse)
    assert answers.count("refused") == 2
    assert cache_path().parent.stat().st_mode & 0o777 == 0o700
    assert isinstance(json.loads(cache_path().read_text()), dict)


def test_a_remembered_answer_of_the_wrong_shape_is_asked_again():
    target = "orchestrator.runtime.schedule.warmup_cosine"
    remembered(["facts", target], target, lambda: {"n": 1}, valid=lambda v: True)  # as if edited by hand
    check_instantiable("scheduler", {"_target_": target, "warmup_steps": 1, "total_steps": 10}, ("optimizer",))
    with pytest.raises(ConfigError, match="scheduler.total_steps.*out of range"):
        check_instantiable("scheduler", {"_target_": target, "warmup_steps": 1, "total_steps": 0}, ("optimizer",))


def test_an_edit_to_the_targets_package_asks_again_and_its_arguments_are_checked_every_time(tmp_path, monkeypatch):
    pkg = tmp_path / "orch_userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("class Net:\n    def __init__(self, width: int = 1):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_instantiable("model", {"_target_": "orch_userpkg.models.Net", "width": 2})
    with pytest.raises(ConfigError, match=r"model.width.*whole number"):  # from the remembered facts
        check_instantiable("model", {"_target_": "orch_userpkg.models.Net", "width": "abc"})
    (pkg / "models.py").write_text("class Net:\n    def __init__(self, depth: int = 1, extra=None):\n        pass\n")
    sys.modules.pop("orch_userpkg.models", None)
    code_fingerprint.cache_clear()
    with pytest.raises(ConfigError, match=r"model.width.*not an argument.*accepts: depth, extra"):
        check_instantiable("model", {"_target_": "orch_userpkg.models.Net", "width": 2})


def test_a_pip_installed_package_is_known_by_its_record_and_a_reinstall_asks_again(tmp_path, monkeypatch):
    """A distribution pip installed (torch) is fingerprinted by its RECORD, not by statting its thousands of
    files at every launch: rewriting RECORD (an install or upgrade) changes it, editing a file of a checkout
    with no dist-info beside it changes it too (its files are walked)."""
    pkg = tmp_path / "orch_pipped"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    record = tmp_path / "orch_pipped-1.0.dist-info" / "RECORD"
    record.parent.mkdir()
    record.write_text("orch_pipped/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code_fingerprint.cache_clear()
    installed = code_fingerprint("orch_pipped")
    (pkg / "__init__.py").write_text("x = 1\n")  # pip owns the files: only a new install counts
    code_fingerprint.cache_clear()
    assert code_fingerprint("orch_pipped") == installed
    record.write_text("orch_pipped/__init__.py,,\norch_pipped/more.py,,\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("orch_pipped") != installed, "a reinstall is new code"
    record.parent.rename(tmp_path / "elsewhere")  # no distribution of that name: a checkout, walked
    code_fingerprint.cache_clear()
    walked = code_fingerprint("orch_pipped")
    (pkg / "__init__.py").write_text("x = 22\n")
    code_fingerprint.cache_clear()
    assert walked not in (None, installed) and code_fingerprint("orch_pipped") != walked


def test_an_unimportable_target_is_refused_every_time():
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"model._target_.*cannot be imported"):
            check_instantiable("model", {"_target_": "orchestrator.runtime.models.NoSuchModel"})


@pytest.mark.slow
def test_the_second_composition_of_a_preset_imports_no_torch(tmp_path):
    """The driver's start: the second launch of a preset composes and validates without importing torch, and a
    bad learning rate is still refused (from the remembered facts). Its own cache dir: other tests in this
    process may have filled the session's."""
    script = textwrap.dedent("""
        import json, sys
        from orchestrator.config.compose import compose_config
        from orchestrator.errors import ConfigError
        compose_config("cpu_gloo", ["optim.lr=0.01"])
        try:
            compose_config("cpu_gloo", ["optim.lr=-1"])
            refused = None
        except ConfigError as e:
            refused = str(e)
        print(json.dumps(["torch" in sys.modules, refused]))
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    first, second = (subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                                    env=env) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout)[0] is True
    torch_imported, refused = json.loads(second.stdout)
    assert torch_imported is False and "optim.lr" in refused and "positive" in refused

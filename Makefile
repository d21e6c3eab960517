# Two entry points on a fresh machine with only python3: `make demo` and `make test` (`make test-fast`: the
# tests that start no process, in under three minutes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned to a CPU-friendly release (override for CUDA: make demo TORCH_SPEC="torch==2.14.1").
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast install clean

$(BIN)/orch: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	# An editable install leaves orch's own modules uncompiled: where PYTHONDONTWRITEBYTECODE is set (most
	# container images) every driver, agent and worker would compile them again at its start (~0.3 s each).
	$(BIN)/python -m compileall -q orchestrator launchers
	touch $(BIN)/orch

install: $(BIN)/orch

demo: install
	$(BIN)/orch launch conf=cpu_gloo

# The whole suite in two processes (one test module each at a time: a module's cluster fixtures stay in one
# process): about 21 minutes on two cores instead of 41.
test: install
	$(BIN)/pytest -q -n 2 --dist loadfile

test-fast: install
	$(BIN)/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache

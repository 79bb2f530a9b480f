# Two commands do all set-up: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast test-gpu lint setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch that this kind of machine keeps on disk; a plain `torch` pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[dev]"
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA driver found: installing the gpu extra (CuPy)"; \
		$(PY) -m pip install -q -e ".[dev,gpu]"; fi
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) main.py

test: $(STAMP)
	QT_QPA_PLATFORM=offscreen OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu"

test-fast: $(STAMP)
	QT_QPA_PLATFORM=offscreen OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu and not slow"

lint: $(STAMP)
	$(PY) -m ruff check .

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV)

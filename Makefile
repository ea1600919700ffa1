# `make run` trains the bundled main job (a small GPT on the Python standard library's source,
# then text sampled from its ONNX export); `make test` runs the test suite.
# Both create .venv on first use (torch==2.13.0 first, then this package with its extras) and
# are idempotent: the install step re-runs only when setup.py changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench install clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.py | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[cpu,dev,mpi]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/ort-trainer train configs/gpt_stdlib.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

# ort_trainer vs PyTorch eager vs torch.compile; writes docs/benchmarks.md and docs/benchmarks.png
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info

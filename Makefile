# `make run` trains the bundled main job (a small GPT on the Python standard library's source,
# then text sampled from its ONNX export); `make test` runs the test suite.
# Both create .venv on first use (torch==2.13.0 first, then this package with its extras) and
# are idempotent: the install step re-runs only when setup.py or the runtime changes.
#
# Every ONNX Runtime distribution installs the same `onnxruntime` module, so each environment holds
# exactly one: .venv the one of RUNTIME (an extra of setup.py: cpu, cuda or training), .venv-legacy
# the 1.19.2 training build, where `make test-legacy` runs the parity, checkpoint, rewrite and MPI tests.
PYTHON ?= python3
LEGACY_PYTHON ?= $(PYTHON)
RUNTIME ?= training
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(RUNTIME)
LEGACY_VENV := .venv-legacy
LEGACY_PY := $(LEGACY_VENV)/bin/python
LEGACY_STAMP := $(LEGACY_VENV)/.installed-training
LEGACY_TESTS := tests/test_parity.py tests/test_checkpoint.py tests/test_distributed.py $(wildcard tests/test_rewrites*.py)
# While .venv holds the training build, .venv-current holds today's onnxruntime, where the torch
# gradient source is tested (the whole suite moves there once every feature runs on it).
CURRENT_VENV := .venv-current
CURRENT_PY := $(CURRENT_VENV)/bin/python
CURRENT_STAMP := $(CURRENT_VENV)/.installed-cpu
CURRENT_TESTS := tests/test_gradient_sources.py tests/test_torch_autograd.py tests/test_onnx_to_torch.py \
	tests/test_runtime.py tests/test_optimizers.py tests/test_accumulation_and_scaling.py tests/test_checkpoint.py \
	tests/test_state_dict.py tests/test_save_as_onnx.py tests/test_distributed.py

# the distribution each extra installs, and every one an earlier install may have left behind
RUNTIME_DIST_cpu := onnxruntime
RUNTIME_DIST_cuda := onnxruntime-gpu
RUNTIME_DIST_training := onnxruntime-training-cpu
RUNTIME_DISTS := onnxruntime onnxruntime-gpu onnxruntime-training onnxruntime-training-cpu

# $(call install_into,VENV,EXTRA): torch first (a local CPU build), then this package with the
# runtime of EXTRA. A runtime of another extra is uninstalled first, together with the wanted one
# (their files overlap, so the wanted one must be installed again after the other's removal).
define install_into
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet torch==2.13.0
	if $(1)/bin/python -m pip show --quiet $(filter-out $(RUNTIME_DIST_$(2)),$(RUNTIME_DISTS)) >/dev/null 2>&1; then \
		$(1)/bin/python -m pip uninstall --quiet -y $(RUNTIME_DISTS); fi
	$(1)/bin/python -m pip install --quiet -e ".[$(2),dev,mpi]"
	rm -f $(1)/.installed $(1)/.installed-*
	touch $(1)/.installed-$(2)
endef

.PHONY: run test test-legacy test-current bench install install-legacy install-current clean

install: $(STAMP)

install-legacy: $(LEGACY_STAMP)

install-current: $(CURRENT_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(LEGACY_PY):
	$(LEGACY_PYTHON) -m venv $(LEGACY_VENV)

$(CURRENT_PY):
	$(PYTHON) -m venv $(CURRENT_VENV)

$(STAMP): setup.py | $(PY)
	$(call install_into,$(VENV),$(RUNTIME))

$(LEGACY_STAMP): setup.py | $(LEGACY_PY)
	$(call install_into,$(LEGACY_VENV),training)

$(CURRENT_STAMP): setup.py | $(CURRENT_PY)
	$(call install_into,$(CURRENT_VENV),cpu)

run: $(STAMP)
	$(VENV)/bin/ort-trainer train configs/gpt_stdlib.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

# the tests that must pass on both runtimes, run on the 1.19.2 training build (Python <= 3.12:
# set LEGACY_PYTHON where python3 is newer)
test-legacy: $(LEGACY_STAMP)
	$(LEGACY_PY) -m pytest -q $(LEGACY_TESTS)

# the torch gradient source and ONNX-model input on today's onnxruntime (the [cpu] extra)
test-current: $(CURRENT_STAMP)
	$(CURRENT_PY) -m pytest -q $(CURRENT_TESTS)

# ort_trainer vs PyTorch eager vs torch.compile; writes docs/benchmarks.md and docs/benchmarks.png
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(LEGACY_VENV) $(CURRENT_VENV) build *.egg-info

# `make run` trains the bundled main job (a small GPT on the Python standard library's source,
# then text sampled from its ONNX export); `make test` runs the test suite; `make docs` builds the
# documentation site with the API reference into site/.
# Each creates .venv on first use (torch==2.13.0 first, then this package with its extras) and
# is idempotent: the install step re-runs only when setup.py or the runtime changes.
#
# Every ONNX Runtime distribution installs the same `onnxruntime` module, so each environment holds
# exactly one: .venv the one of RUNTIME (an extra of setup.py: cpu, cuda or training), .venv-legacy
# the 1.19.2 training build, where `make test-legacy` runs the parity, checkpoint, rewrite and MPI tests.
PYTHON ?= python3
LEGACY_PYTHON ?= $(PYTHON)
RUNTIME ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(RUNTIME)
LEGACY_VENV := .venv-legacy
LEGACY_PY := $(LEGACY_VENV)/bin/python
LEGACY_STAMP := $(LEGACY_VENV)/.installed-training
LEGACY_TESTS := tests/test_parity.py tests/test_batchnorm.py tests/test_data_sizes.py tests/test_adaptive_softmax.py tests/test_layer_drop.py tests/test_checkpoint.py tests/test_distributed.py tests/test_shape_graphs.py tests/test_index_checks.py $(wildcard tests/test_rewrites*.py)

# the distribution each extra installs, and every one an earlier install may have left behind
RUNTIME_DIST_cpu := onnxruntime
RUNTIME_DIST_cuda := onnxruntime-gpu
RUNTIME_DIST_training := onnxruntime-training-cpu
RUNTIME_DISTS := onnxruntime onnxruntime-gpu onnxruntime-training onnxruntime-training-cpu

# $(call install_into,VENV,EXTRA[,TORCH]): torch first (TORCH, 2.13.0 by default: a local CPU build), then
# this package with the runtime of EXTRA. A runtime of another extra is uninstalled first, together with the
# wanted one (their files overlap, so the wanted one must be installed again after the other's removal).
define install_into
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet torch==$(or $(3),2.13.0)
	if $(1)/bin/python -m pip show --quiet $(filter-out $(RUNTIME_DIST_$(2)),$(RUNTIME_DISTS)) >/dev/null 2>&1; then \
		$(1)/bin/python -m pip uninstall --quiet -y $(RUNTIME_DISTS); fi
	$(1)/bin/python -m pip install --quiet -e ".[$(2),dev,mpi]"
	rm -f $(1)/.installed $(1)/.installed-*
	touch $(1)/.installed-$(2)
endef

.PHONY: run test test-gpu-torch test-large test-tolerances test-legacy bench bench-real bench-threads gpu-check gpu-wheels kernels docs install install-legacy clean

install: $(STAMP)

install-legacy: $(LEGACY_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(LEGACY_PY):
	$(LEGACY_PYTHON) -m venv $(LEGACY_VENV)

$(STAMP): setup.py | $(PY)
	$(call install_into,$(VENV),$(RUNTIME))

$(LEGACY_STAMP): setup.py | $(LEGACY_PY)
	$(call install_into,$(LEGACY_VENV),training)

run: $(STAMP)
	$(VENV)/bin/ort-trainer train configs/gpt_stdlib.yaml --overwrite

# The tests run in TEST_WORKERS processes (pytest-xdist; each takes the next test as it finishes one), 0: in pytest's
# own. Two keep both cores of a 2-core machine busy: most tests spend their time in one Python thread (tracing,
# exporting, starting processes).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

# the suite on the CPU under the torch the GPU machines hold (GPU_TORCH: 2.11.0, PyPI's CUDA 13 build, about 5 GB
# in .venv-torch-2.11.0, set up as .venv is): a GPU run builds its graphs with that torch's exporter
GPU_TORCH ?= 2.11.0
GPU_TORCH_VENV := .venv-torch-$(GPU_TORCH)
GPU_TORCH_STAMP := $(GPU_TORCH_VENV)/.installed-cpu

$(GPU_TORCH_VENV)/bin/python:
	$(PYTHON) -m venv $(GPU_TORCH_VENV)

$(GPU_TORCH_STAMP): setup.py | $(GPU_TORCH_VENV)/bin/python
	$(call install_into,$(GPU_TORCH_VENV),cpu,$(GPU_TORCH))

test-gpu-torch: $(GPU_TORCH_STAMP)
	$(GPU_TORCH_VENV)/bin/python -m pytest -q $(XDIST) -m "not slow" tests

# the documentation site with the API reference generated from the docstrings (mkdocs.yml), into
# site/; any warning is an error: a docstring that cannot be rendered, a public name without one, a
# broken link between pages (tests/test_docs_build.py runs the same build in `make test`)
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# the slow tests: a GPT-2 of 656 M weights (2.6 GB, over protobuf's 2 GB limit) trains, saves as ONNX
# with external data and resumes from a checkpoint within its training memory (about 10 minutes and
# 16 GB on 2 cores)
test-large: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# The suite under 1 and then 2 threads (torch and ONNX Runtime; sums change order), recording how
# close every numeric comparison comes to its bound; fails on a comparison with less than a 10x
# margin (tests/tolerances.py says where the bounds come from). About twice `make test`.
AUDIT := $(CURDIR)/.tolerance-audit.jsonl
test-tolerances: $(STAMP)
	rm -f $(AUDIT)
	for threads in 1 2; do \
		OMP_NUM_THREADS=$$threads ORT_TRAINER_TOLERANCE_AUDIT=$(AUDIT) $(PY) -m pytest -q -m "not slow" tests || exit 1; done
	$(PY) tests/_tolerance_audit.py $(AUDIT)

# the tests that must pass on both runtimes, run on the 1.19.2 training build (Python <= 3.12:
# set LEGACY_PYTHON where python3 is newer)
test-legacy: $(LEGACY_STAMP)
	$(LEGACY_PY) -m pytest -q $(XDIST) $(LEGACY_TESTS)

# ort_trainer vs eager PyTorch and torch.compile at GPT-2 small, BERT-base, a 656 M-weight GPT-2 and a 1024-wide MLP
# (step, peak RSS, cold and warm builds, save_as_onnx); writes docs/benchmarks_real/<CPU kind>.md and lists it in
# docs/benchmarks_real.md (about 60 minutes and 16 GB on 2 cores)
bench-real: $(STAMP)
	$(PY) benchmarks/real_sizes.py

# where device.host_threads' automatic bound belongs on this machine: steps with the host work on one torch
# thread against torch's count, MLPs of 2-34 M weights, a process each (~3 min on 2 cores); writes docs/benchmarks_threads.md
bench-threads: $(STAMP)
	$(PY) benchmarks/host_threads.py --out docs/benchmarks_threads.md

# ort_trainer on both runtimes vs PyTorch eager vs torch.compile; writes docs/benchmarks.md and
# docs/benchmarks.png
bench: $(STAMP) $(LEGACY_STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(LEGACY_PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run.py --legacy-python $(LEGACY_PY)

# On a GPU machine, in an environment with a CUDA build of torch and ort_trainer[cuda,dev]
# (onnxruntime-gpu) installed: the `cuda`-marked tests, then the GPU benchmark (BERT-base and GPT-2
# small, fp32/fp16/bf16, against eager and torch.compile; about 13 minutes on an H200), which writes
# docs/benchmarks_gpu.md and docs/benchmarks_gpu.jsonl. docs/gpu.md says how to set that environment up, also without network.
GPU_PYTHON ?= python3
# e.g. GPU_PYTEST_ARGS=--junitxml=cuda.xml: the measured differences the cuda tests record as properties
GPU_PYTEST_ARGS ?=
# e.g. GPU_BENCH_ARGS="--deadline 420": start no benchmark process after 7 minutes (a short lease)
GPU_BENCH_ARGS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu.py --preflight
	$(GPU_PYTHON) -m pytest -q -m cuda -rs tests $(GPU_PYTEST_ARGS)
	$(GPU_PYTHON) benchmarks/gpu.py $(GPU_BENCH_ARGS)

# ort_trainer's kernel library (ort_trainer/kernels: the operators of graph_optimizations.fused_gelu_gradient),
# built with nvcc where found (CPU and CUDA kernels), else the C++ compiler; it prints the library's path, which
# ORT_TRAINER_KERNELS_LIBRARY can name on a machine without a compiler. Built on first use otherwise.
kernels:
	$(PY) -c "from ort_trainer.kernels import build; print(build())"

# What a GPU machine without network needs (Python 3.12, x86-64), in .gpu-wheels/ as parts of at most
# 60 MiB with an install.sh, and the MPI wheels in .gpu-wheels-mpi/ (docs/gpu.md: carrying them to such a
# machine). GPU_ARCHS (90: H100 and H200) names the GPUs whose code onnxruntime-gpu keeps.
gpu-wheels:
	PYTHON=$(PYTHON) KERNELS_PYTHON=$(PY) benchmarks/gpu_wheels.sh .gpu-wheels

clean:
	rm -rf $(VENV) $(LEGACY_VENV) build site *.egg-info

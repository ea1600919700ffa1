"""Shared fixtures: an isolated graph cache per test session, one build of each kernel library per run,
deterministic seeds, Python's own SIGINT handler (``python_sigint_handler``); the ``cuda`` marker.

``OMP_NUM_THREADS=N`` runs torch and every ONNX Runtime session the tests make with N intra-op
threads (sums change order with the thread count: ``make test-tolerances`` runs both 1 and 2);
``ORT_TRAINER_TOLERANCE_AUDIT=FILE`` records how close each comparison comes to its bound.
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs CUDAExecutionProvider and a GPU (run by make gpu-check)")
    config.addinivalue_line("markers", "slow: minutes and over 10 GB of memory (run by make test-large, not make test)")
    if os.environ.get("ORT_TRAINER_TOLERANCE_AUDIT"):
        import _tolerance_audit

        _tolerance_audit.install()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # torch follows OMP_NUM_THREADS; ONNX Runtime's sessions are told to follow it too
        import ort_trainer.distributed

        ort_trainer.distributed._intra_op_threads = int(threads)


def pytest_unconfigure(config):
    if os.environ.get("ORT_TRAINER_TOLERANCE_AUDIT"):
        import _tolerance_audit

        _tolerance_audit.write(os.environ["ORT_TRAINER_TOLERANCE_AUDIT"])


def pytest_collection_modifyitems(config, items):
    """Every ``cuda`` test skips with one reason where training on CUDA cannot run."""
    from ort_trainer.devices import cuda_missing

    missing = cuda_missing()
    if missing is None:
        return
    skip = pytest.mark.skip(reason=f"needs CUDAExecutionProvider and a GPU: {missing}")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["ORT_TRAINER_CACHE_DIR"] = str(tmp_path_factory.mktemp("graph_cache"))
    yield


@pytest.fixture(autouse=True, scope="session")
def _kernels_built_once():
    """Every kernel library built into the one folder where caching is off (``ORT_TRAINER_CACHE_DIR=off``), with the
    graph cache on too: each library is built once for the whole run, by whichever test worker needs it first (a
    build takes about 40 s with nvcc), and kept for the next run (its folder is named by the hash of its sources and
    compiler command, so a change builds anew). Tests of the cache's own folders pass folders of their own."""
    from ort_trainer import kernels
    from ort_trainer.kernels import torch_allocator, torch_ops

    shared = kernels._scratch_root()
    with pytest.MonkeyPatch.context() as patch:
        for module in (kernels, torch_allocator, torch_ops):
            patch.setattr(module, "_root", lambda: shared)
        yield shared


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for the test: a process started in the background by a
    non-interactive shell inherits SIGINT ignored (POSIX), and Python then installs none, so a
    Ctrl-C could not be sent to it at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

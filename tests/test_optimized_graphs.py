"""ONNX Runtime's optimized graphs, saved by the first process and loaded by later ones
(``ort_trainer/_optimized_graphs.py``): the loaded session trains bit-equal to one that optimized the
graph itself, a file ONNX Runtime refuses is set aside, and the user's own session options never
use them."""

import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ort_trainer import ORTTrainer, _optimized_graphs
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim import AdamConfig

from models import ENCODER_DESC, TinyEncoder, clone, mlm_batch, mlm_loss

STEPS = 3


def _train(model, options=None):
    """Losses and final weights of STEPS Adam steps of the tiny encoder on fixed batches."""
    trainer = ORTTrainer(clone(model), ENCODER_DESC, AdamConfig(lr=1e-2), loss_fn=mlm_loss, options=options or {})
    generator = torch.Generator().manual_seed(0)
    losses = [float(trainer.train_step(*mlm_batch(generator))[0]) for _ in range(STEPS)]
    return losses, {name: np.array(value) for name, value in trainer.state_dict()["model"]["full_precision"].items()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / ".optimized"


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_a_session_from_the_saved_optimized_graph_trains_bit_equal(cache, caplog, half):
    """The first trainer optimizes its graphs and saves them; the second loads them (optimizations off)
    and its losses and weights equal the first's bit for bit: the same kernels on the same graph."""
    torch.manual_seed(0)
    model = TinyEncoder()
    options = {"mixed_precision": {"enabled": True, "dtype": "float16",
                                   "loss_scaler": DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)}} \
        if half else {}
    first = _train(model, options)
    saved = sorted(cache.glob("*.onnx"))
    assert saved, "the first process saved no optimized graph"
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"):
        second = _train(model, options)
    loaded = [r.getMessage() for r in caplog.records if "session made from the optimized graph" in r.getMessage()]
    assert loaded, "the second trainer optimized its graphs again"
    assert second[0] == first[0]
    for name, value in first[1].items():
        np.testing.assert_array_equal(second[1][name], value, err_msg=name)
    assert sorted(cache.glob("*.onnx")) == saved  # nothing written twice


def test_a_refused_optimized_graph_is_set_aside_and_the_graph_optimized(cache, caplog):
    """A file ONNX Runtime cannot load (here: truncated) is removed and its key marked refused; the
    trainer optimizes the graph itself and trains as the first did."""
    torch.manual_seed(0)
    model = TinyEncoder()
    first = _train(model)
    files = sorted(cache.glob("*.onnx"))
    for path in files:
        path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"):
        second = _train(model)
    assert second[0] == first[0]
    assert any("refused its optimized graph" in r.getMessage() for r in caplog.records)
    assert not list(cache.glob("*.onnx")) and len(list(cache.glob("*.refused"))) == len(files)
    third = _train(model)  # refused keys stay refused: optimized each time, nothing saved
    assert third[0] == first[0] and not list(cache.glob("*.onnx"))


def test_the_users_own_session_options_and_a_cache_turned_off_save_nothing(cache, monkeypatch):
    torch.manual_seed(0)
    model = TinyEncoder()
    _train(model, {"session_options": ort.SessionOptions()})
    assert not cache.exists() or not list(cache.iterdir())
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    _train(model)
    assert not cache.exists() or not list(cache.iterdir())


def test_the_key_names_the_graph_the_runtime_and_the_cpu(tmp_path, monkeypatch):
    """Another graph, optimization level, disabled optimizer or CPU is another file."""
    graphs = _optimized_graphs.OptimizedGraphs(tmp_path)
    options = ort.SessionOptions()
    providers = [("CPUExecutionProvider", {})]
    base = graphs.key(b"graph", options, providers, [])
    assert graphs.key(b"graph", options, providers, []) == base
    assert graphs.key(b"graph2", options, providers, []) != base
    assert graphs.key(b"graph", options, providers, ["SkipLayerNormFusion"]) != base
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert graphs.key(b"graph", options, providers, []) != base
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    monkeypatch.setattr(_optimized_graphs, "host_identity", lambda: "another CPU")
    assert _optimized_graphs.OptimizedGraphs(tmp_path).key(b"graph", options, providers, []) != base

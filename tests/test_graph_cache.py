"""The training graph is built once and reused from the disk cache, also by another process."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig, SGDConfig

JOB = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from models import MLP, MLP_DESC, mlp_batch
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        loss = trainer.train_step(*mlp_batch(gen))[0]
    print("loss", repr(loss.item()))
""")


def _run_job(cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ORT_TRAINER_CACHE_DIR=str(cache_dir), ORT_TRAINER_LOG_LEVEL="INFO")
    script = JOB.format(tests=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=True)


def test_second_process_reuses_the_cached_graph(tmp_path):
    first = _run_job(tmp_path)
    second = _run_job(tmp_path)
    assert "built the training graph" in first.stderr and "reused" not in first.stderr
    assert "reused the cached training graph" in second.stderr and "built the training graph" not in second.stderr
    assert first.stdout == second.stdout  # same losses from the cached graph
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    # the symbolic graph, and the static-shape graph of the one batch shape the job uses
    assert len(entries) == 2 and all((entry / "meta.json").exists() for entry in entries)


def test_cache_key_covers_what_shapes_the_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    batch = mlp_batch(torch.Generator().manual_seed(0))

    def build(model, config, **options):
        trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy,
                             options=options or None)
        trainer.train_step(*batch)
        return trainer._graphs.from_cache

    assert build(MLP(), AdamConfig(lr=1e-2)) is False
    assert build(MLP(), AdamConfig(lr=5e-2)) is True  # new initial weights are graph inputs
    # the optimizer graph is rebuilt every time (milliseconds); the cached gradient graph is shared
    assert build(MLP(), SGDConfig()) is True
    assert build(MLP(hidden=16), SGDConfig()) is False  # another architecture
    assert build(MLP(), SGDConfig(), utils={"frozen_weights": ["fc1.bias"]}) is False
    assert build(MLP(), SGDConfig(), utils={"frozen_weights": ["fc1.bias"]}) is True


def test_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    batch = mlp_batch(torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=torch.nn.functional.cross_entropy)
        trainer.train_step(*batch)
        assert trainer._graphs.from_cache is False


def test_user_hook_and_debug_graph_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    seen = []

    def hook(model: onnx.ModelProto):
        seen.append(sorted({n.op_type for n in model.graph.node}))
        model.graph.node[0].doc_string = "touched by the user's hook"

    paths = {
        "model_after_graph_transforms_path": str(tmp_path / "forward.onnx"),
        "model_with_gradient_graph_path": str(tmp_path / "gradient.onnx"),
        "model_with_training_graph_path": str(tmp_path / "optimizer.onnx"),
    }
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy,
                         options={"_internal_use": {"extra_postprocess": hook}, "debug": {"graph_save_paths": paths},
                                  "graph_optimizations": {"cross_entropy": False}})
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert seen and "Gemm" in seen[0] and "SoftmaxCrossEntropyLoss" in seen[0]
    forward = onnx.load(paths["model_after_graph_transforms_path"])
    assert forward.graph.node[0].doc_string == "touched by the user's hook"
    sce = [n for n in forward.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"][0]
    assert len(sce.output) == 2  # the trainability pass added log_prob
    gradient = onnx.load(paths["model_with_gradient_graph_path"])
    assert {"fc1.weight_grad", "fc2.bias_grad"} <= {o.name for o in gradient.graph.output}
    optimizer = onnx.load(paths["model_with_training_graph_path"])
    outputs = {o.name for o in optimizer.graph.output}
    assert {"group0[0:837].Moment_1.out", "all_finite", "global_gradient_norm"} <= outputs  # one segment: 837 weights


def test_weight_names_are_checked_on_a_cache_hit_too(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    batch = mlp_batch(torch.Generator().manual_seed(0))
    ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=torch.nn.functional.cross_entropy).train_step(*batch)
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(params=[{"params": ["fc9.weight"]}]),
                         loss_fn=torch.nn.functional.cross_entropy)
    try:
        trainer.train_step(*batch)
    except ValueError as error:
        assert "'fc9.weight' is not a weight of the model" in str(error)
    else:
        raise AssertionError("an unknown weight name was accepted")
    assert trainer._graphs.from_cache is True

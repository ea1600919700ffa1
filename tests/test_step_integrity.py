"""A step trains what PyTorch would, or refuses before changing anything (issue 10, items 5, 6, 7, 21).

- inputs PyTorch rejects (negative or too large class labels and token ids, one value per
  BatchNorm channel, empty batches) are refused before the step runs;
- impossible learning rates are refused up front, and an update that would make a weight
  non-finite is skipped like a non-finite gradient;
- dropout masks are a function of (seed, rank, step), so resuming is exact with dropout;
- Ctrl-C inside ``train_step`` never leaves counters and weights out of step.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim import AdamConfig, LambConfig, SGDConfig
from tolerances import FLOAT32, check, relative_error

CE = torch.nn.functional.cross_entropy
ROOT = Path(__file__).resolve().parents[1]


def _weights(trainer):
    return {k: v.copy() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


# ---- item 5: inputs PyTorch rejects -----------------------------------------------------------
@pytest.mark.parametrize("bad", [-3, 5, 17])
def test_an_out_of_range_class_label_is_refused_before_the_step(bad):
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    before = _weights(trainer)
    y = y.clone()
    y[5] = bad
    with pytest.raises(ValueError) as error:
        trainer.train_step(x, y)
    message = str(error.value)
    assert f"input 'label': value {bad} at index [5]" in message and "valid values are 0..4" in message
    assert _same(before, _weights(trainer)) and trainer._train_step_info.step == 1
    with pytest.raises(ValueError, match="valid values are 0..4"):
        trainer.eval_step(x, y)
    with pytest.raises(IndexError):  # what PyTorch says about the same batch
        CE(torch.randn(8, 5), y)


def test_ignore_index_labels_stay_valid_and_token_ids_are_checked_against_the_embedding():
    trainer = ORTTrainer(TinyEncoder(), ENCODER_DESC, AdamConfig(lr=1e-3), loss_fn=mlm_loss)
    ids, labels = mlm_batch(torch.Generator().manual_seed(0))
    assert (labels == -100).any()
    trainer.train_step(ids, labels)  # -100 is the loss's ignore_index: valid
    bad_ids, bad_labels = ids.clone(), labels.clone()
    bad_ids[1, 2] = -1
    bad_labels[0, 0] = -7
    with pytest.raises(ValueError) as error:
        trainer.train_step(bad_ids, bad_labels)
    message = str(error.value)
    # every problem at once: the token id (embedding rows) and the label (classes, or ignore_index)
    assert "input 'ids': value -1 at index [1, 2]" in message and "'embed.weight'" in message
    assert "valid values are 0..49" in message
    assert "input 'labels': value -7 at index [0, 0]" in message and "or -100 (ignore_index)" in message
    assert trainer._train_step_info.step == 1


class _BatchNormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(20, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc(x))))


def test_a_batch_of_one_through_batchnorm_is_refused_and_the_statistics_survive():
    model = _BatchNormMLP()
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    before = _weights(trainer)
    with pytest.raises(ValueError, match=r"BatchNorm in module norm gets 1 value per channel .*at least 2"):
        trainer.train_step(x[:1], y[:1])
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # PyTorch agrees
        clone(model).train()(x[:1])
    assert _same(before, _weights(trainer)) and trainer._train_step_info.step == 1
    assert np.isfinite(trainer.state_dict()["model"]["full_precision"]["norm.running_var"]).all()
    trainer.eval_step(x[:1], y[:1])  # eval mode uses the running statistics: one sample is fine
    trainer.train_step(x, y)  # and training goes on


def test_a_nan_batch_leaves_batchnorm_statistics_finite():
    trainer = ORTTrainer(_BatchNormMLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    before = _weights(trainer)
    x_nan = x.clone()
    x_nan[0, 0] = float("nan")
    trainer.train_step(x_nan, y)
    assert trainer._train_step_info.all_finite is False
    assert _same(before, _weights(trainer))  # weights and running statistics untouched
    trainer.train_step(x, y)
    assert trainer._train_step_info.all_finite is True
    assert all(np.isfinite(v).all() for v in _weights(trainer).values())


def test_an_empty_batch_is_refused_with_the_input_named():
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    with pytest.raises(ValueError, match=r"input 'x': dimension 0 \('batch'\) is 0, an empty batch"):
        trainer.train_step(x[:0], y[:0])
    assert trainer._train_step_info.step == 1


# ---- item 6: learning rates and non-finite updates ----------------------------------------------
@pytest.mark.parametrize("lr", [math.inf, 1e300, math.nan, -1.0])
def test_impossible_learning_rates_are_refused_at_construction(lr):
    for config in (SGDConfig, AdamConfig, LambConfig):
        with pytest.raises(ValueError, match=r"\.lr: must"):
            config(lr=lr)
    with pytest.raises(ValueError, match=r"params\[0\]\.lr: must"):
        AdamConfig(params=[{"params": ["fc1.weight"], "lr": lr}])


def test_a_learning_rate_made_nan_later_is_refused_before_the_step():
    config = AdamConfig(lr=1e-3)
    trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    before = _weights(trainer)
    config.lr = float("nan")
    with pytest.raises(ValueError, match=r"optim_config\.lr: must be a finite number, got nan"):
        trainer.train_step(x, y)
    info = trainer._train_step_info
    assert (info.step, info.optimization_step) == (1, 1) and _same(before, _weights(trainer))
    config.lr = 1e-3
    trainer.train_step(x, y)
    assert info.optimization_step == 2


class _Scaled(torch.nn.Module):
    """A linear model whose gradient is 1000 per weight: any lr above 3.4e35 overflows float32."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return (self.w * x).sum() * 1000.0


def test_an_update_that_overflows_is_skipped_and_blames_the_learning_rate(caplog):
    desc = {"inputs": [("x", [4])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(_Scaled(), desc, SGDConfig(lr=1e37),
                         options={"mixed_precision": {"loss_scaler": DynamicLossScaler(loss_scale=4.0)}})
    with caplog.at_level("WARNING", logger="ort_trainer"):
        trainer.train_step(np.ones(4, np.float32))
    info = trainer._train_step_info
    assert info.all_finite is False and info.optimization_step == 0 and info.step == 1
    assert np.array_equal(_weights(trainer)["w"], np.zeros(4, np.float32))
    assert "would make weights non-finite" in caplog.text and "lower the learning rate" in caplog.text
    trainer.optim_config.lr = 1e-3
    trainer.train_step(np.ones(4, np.float32))
    assert info.all_finite is True
    # w = 0 − lr · g, g = 1000 · 4 / 4 (integers and a power-of-two loss scale: exact); lr = 1e-3
    # is rounded to float32 once and its product with g once, the subtraction from 0 is exact: 2
    # roundings, 2u relative from −1 (observed at 1 and 2 threads: 0, the product rounds to −1.0)
    check(relative_error(_weights(trainer)["w"], -np.ones(4)), 2 * FLOAT32, "w")  # lr * 1000


# ---- item 7: dropout masks are reproducible, and resume is exact ---------------------------------
def _dropout_mlp():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 5))


def test_resume_with_dropout_gives_the_uninterrupted_losses(tmp_path):
    model = _dropout_mlp()
    gen = torch.Generator().manual_seed(7)
    batches = [mlp_batch(gen) for _ in range(12)]
    config = AdamConfig(lr=1e-2)
    straight = ORTTrainer(clone(model), MLP_DESC, config, loss_fn=CE)
    expected = [straight.train_step(x, y)[0].item() for x, y in batches]

    first = ORTTrainer(clone(model), MLP_DESC, config, loss_fn=CE)
    got = [first.train_step(x, y)[0].item() for x, y in batches[:6]]
    first.save_checkpoint(tmp_path / "half.h5")
    torch.manual_seed(99)  # a new process would start from another seed: the checkpoint restores it
    second = ORTTrainer(clone(model), MLP_DESC, config, loss_fn=CE)
    second.load_checkpoint(tmp_path / "half.h5")
    got += [second.train_step(x, y)[0].item() for x, y in batches[6:]]
    assert got == expected
    # and the masks do differ from step to step (dropout is really on)
    outputs = [straight.train_step(*batches[0])[0].item() for _ in range(2)]
    assert outputs[0] != outputs[1]


@pytest.mark.skipif(shutil.which("ort-trainer", path=str(Path(sys.executable).parent)) is None,
                    reason="needs the ort-trainer console script")
def test_cli_resume_of_the_shipped_dropout_config_is_exact(tmp_path):
    cli = shutil.which("ort-trainer", path=str(Path(sys.executable).parent))
    # no schedule: a cosine one spans train.max_steps, which differs between the two halves here
    common = ["train.log_every=1", "train.eval_every=0", "train.checkpoint_every=5", "export.onnx=false",
              "lr_scheduler.type=none"]

    def run(out, steps, *extra):
        result = subprocess.run([cli, "train", str(ROOT / "configs" / "digits_mlp.yaml"), f"output_dir={out}",
                                 f"train.max_steps={steps}", *common, *extra], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr

    def losses(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    run(tmp_path / "straight", 10)
    run(tmp_path / "resumed", 5)
    run(tmp_path / "resumed", 10, "--resume")
    expected, got = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]


# ---- item 21: Ctrl-C never splits a step ---------------------------------------------------------
def _interrupt_after(obj, name):
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arriving right after this part of the step
        return result

    setattr(obj, name, wrapped)
    return original


@pytest.mark.parametrize("where", ["update.step", "forward_backward"])
def test_ctrl_c_inside_train_step_applies_the_step_whole(where, python_sigint_handler):
    model = MLP()
    options = {"batch": {"gradient_accumulation_steps": 2}}
    trainer = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=options)
    reference = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=options)
    gen = torch.Generator().manual_seed(1)
    batches = [mlp_batch(gen) for _ in range(4)]
    for x, y in batches[:1]:
        trainer.train_step(x, y)
        reference.train_step(x, y)
    target, name = (trainer._engine.update, "step") if where == "update.step" else (trainer._engine, where)
    original = _interrupt_after(target, name)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_step(*batches[1])  # the window's last micro-batch: backward and the update
    setattr(target, name, original)
    reference.train_step(*batches[1])
    info, expected = trainer._train_step_info, reference._train_step_info
    assert (info.step, info.optimization_step) == (expected.step, expected.optimization_step) == (2, 1)
    assert _same(_weights(trainer), _weights(reference))
    for x, y in batches[2:]:  # and training goes on exactly as without the interrupt
        trainer.train_step(x, y)
        reference.train_step(x, y)
    assert _same(_weights(trainer), _weights(reference))


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_torch_source_reads_the_checks_off_the_traced_program(dynamic):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    from ort_trainer.graph.gradient import autograd
    from ort_trainer.graph.export.program_checks import find_program_constraints
    from ort_trainer.model_desc import parse_model_desc

    def constraints(model, desc, loss, batch, dims):
        desc = parse_model_desc(desc)
        traced = autograd.trace(model, loss, desc, [np.asarray(b) for b in batch], dynamic=dynamic)
        return find_program_constraints(traced.program, desc.input_names, traced._job["weight_of"],
                                        {io.name: list(io.shape) for io in desc.inputs}, None if dynamic else dims)

    def summary(found):
        return [(r["what"], r["steps"], r["index"], r["low"], r["high"], r["ignore"]) for r in found["indices"]]

    # a static trace's sizes are named by the symbol of that size, so the checks serve every shape
    found = constraints(_BatchNormMLP(), MLP_DESC, CE, mlp_batch(torch.Generator().manual_seed(0)), {"batch": 8})
    label = [{"op": "input", "name": "label"}]
    assert summary(found) == [("classes of the cross-entropy in the loss function", label, 0, 0, 5, -100)]
    assert found["batchnorm"] == [{"module": "norm", "shape": ["batch", 16]}]
    found = constraints(TinyEncoder(), ENCODER_DESC, mlm_loss, mlm_batch(torch.Generator().manual_seed(0)),
                        {"batch": 4, "seq": 12})
    ids, labels = [{"op": "input", "name": "ids"}], [{"op": "input", "name": "labels"}]
    positions = [*ids, {"op": "size", "x": {"ref": 0}, "dim": 1}, {"op": "arange", "start": 0, "end": {"ref": 1}, "step": 1}]
    assert summary(found) == [
        ("rows of 'embed.weight' (embedding lookup in embed)", ids, 0, 0, 50, None),
        ("rows of 'position.weight' (embedding lookup in position)", positions, 2, 0, 64, None),  # arange(seq)
        ("classes of the cross-entropy in the loss function", labels, 0, 0, 50, -100)]
    assert found["batchnorm"] == []


def test_an_onnx_model_with_its_loss_refuses_an_out_of_range_label():
    import io

    import onnx

    from models import MLPWithLoss

    x, y = mlp_batch(torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.onnx.export(MLPWithLoss(), (x, y), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["x", "label"], output_names=["loss", "logits"],
                      dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}, "logits": {0: "batch"}})
    from ort_trainer import _runtime

    if _runtime.resolve_gradient_source() == "torch":
        pytest.importorskip("onnx2fx", reason="ONNX models take the torch route through onnx2fx (the [cpu] extra)")
    trainer = ORTTrainer(onnx.load_from_string(buffer.getvalue()), MLP_DESC, SGDConfig(lr=0.1))
    trainer.train_step(x, y)
    before = _weights(trainer)
    y = y.clone()
    y[2] = 9
    with pytest.raises(ValueError, match=r"input 'label': value 9 at index \[2\] .*valid values are 0\.\.4"):
        trainer.train_step(x, y)
    assert _same(before, _weights(trainer)) and trainer._train_step_info.step == 1

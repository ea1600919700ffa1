"""The two gradient sources behind ``graph.gradient_source`` train the same model the same way.

``"torch"`` (PyTorch's autograd exported to standard ONNX) runs on any ONNX Runtime, so these
tests run on whichever runtime is installed; comparisons with ``"onnxruntime"`` (the gradient
builder) need the 1.19.2 training build and skip without it.
"""

import numpy as np
import pytest
import torch

from models import ENCODER_DESC, MLP, MLP_DESC, MLPWithLoss, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer, _runtime
from ort_trainer.optim import AdamConfig, LambConfig
from tolerances import check, steps_bound

pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
CE = torch.nn.functional.cross_entropy
TORCH = {"graph": {"gradient_source": "torch"}}
needs_training_build = pytest.mark.skipif(not _runtime.has_training_build(),
                                          reason="the 'onnxruntime' gradient source needs onnxruntime-training")

# Every comparison here is ONNX Runtime (the 'torch' source) against eager PyTorch, or against the
# 'onnxruntime' source, after n training steps: both sides compute the same float32 forward,
# backward and Adam update, adding each sum (≤ 64 terms) in their own order: ≤ 64·u of the sum's
# magnitude per step (Higham's bound), carried through the weights at most once per step, so
# losses and weights differ by at most steps_bound(n) = n·64·u relatively (tolerances.py); the
# clipping norm (a sum of 837 squares for the MLP) and LAMB's trust ratios add longer sums still.
# - The MLP, 5 to 10 steps: steps_bound is 1.9e-5 (5 steps) to 3.8e-5 (10); the value kept holds
#   losses and weights to 1e-5, below that worst case. Observed at 1 and 2 threads: ≤ 1.4e-7
#   (losses) and 7.0e-8 (weights), 72x under. The comparisons with the 'onnxruntime' source need
#   the training build and were not observed on this machine.
MLP_BOUND = 1e-5
# - The transformer, 6 steps: steps_bound(6) = 2.3e-5. Observed at 1 and 2 threads: ≤ 7.2e-8
#   (losses) and 1.2e-6 (weights), 19x under.
ENCODER_BOUND = steps_bound(6)


def _options(source, **extra):
    return {"graph": {"gradient_source": source}, **extra}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _torch_weights(trainer):
    return {k: v.numpy() for k, v in trainer.state_dict(pytorch_format=True).items()}


@pytest.mark.parametrize("window", [1, 3])
def test_torch_source_trains_the_mlp_like_pytorch(window):
    model = MLP()
    reference = clone(model)
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE,
                         options=_options("torch", batch={"gradient_accumulation_steps": window}))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        x, y = mlp_batch(gen, batch=8 * window)
        for part in range(window):
            loss = trainer.train_step(x[8 * part:8 * part + 8], y[8 * part:8 * part + 8])[0]
            if window == 1:
                expected = CE(reference(x), y).item()
                assert loss.item() == pytest.approx(expected, rel=MLP_BOUND)
        optimizer.zero_grad()
        CE(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
    assert trainer._train_step_info.optimization_step == 8
    got = _torch_weights(trainer)
    for key, value in reference.state_dict().items():
        check(_rel(got[key], value.numpy()), MLP_BOUND, key)


def test_torch_source_trains_the_transformer_like_pytorch():
    model = TinyEncoder()
    reference = clone(model)
    trainer = ORTTrainer(model, ENCODER_DESC, AdamConfig(lr=1e-3), loss_fn=mlm_loss, options=TORCH)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        ids, labels = mlm_batch(gen, seq=12 if step % 2 else 9)  # two sequence lengths
        loss = trainer.train_step(ids, labels)[0].item()
        optimizer.zero_grad()
        expected = mlm_loss(reference(ids), labels)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        assert loss == pytest.approx(expected.item(), rel=ENCODER_BOUND)
    got = _torch_weights(trainer)
    for key, value in reference.state_dict().items():
        check(_rel(got[key], value.numpy()), ENCODER_BOUND, key)


@needs_training_build
@pytest.mark.parametrize("config", [AdamConfig(lr=1e-2, lambda_coef=0.01), LambConfig(lr=1e-2)], ids=["adam", "lamb"])
def test_both_sources_train_to_the_same_weights(config):
    model = MLP()
    trainers = {source: ORTTrainer(clone(model), MLP_DESC, config, loss_fn=CE, options=_options(source))
                for source in ("torch", "onnxruntime")}
    gen = torch.Generator().manual_seed(11)
    for _ in range(10):
        x, y = mlp_batch(gen)
        losses = [t.train_step(x, y)[0].item() for t in trainers.values()]
        assert losses[0] == pytest.approx(losses[1], rel=MLP_BOUND)
    a, b = (_torch_weights(t) for t in trainers.values())
    for k in a:
        check(_rel(a[k], b[k]), MLP_BOUND, k)


@needs_training_build
def test_a_checkpoint_of_one_source_resumes_in_the_other(tmp_path):
    model = MLP()
    gen = torch.Generator().manual_seed(2)
    batches = [mlp_batch(gen) for _ in range(8)]
    straight = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=_options("onnxruntime"))
    expected = [straight.train_step(x, y)[0].item() for x, y in batches]
    first = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=_options("onnxruntime"))
    got = [first.train_step(x, y)[0].item() for x, y in batches[:4]]
    first.save_checkpoint(tmp_path / "half.h5")
    second = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=TORCH)
    second.load_checkpoint(tmp_path / "half.h5")
    got += [second.train_step(x, y)[0].item() for x, y in batches[4:]]
    np.testing.assert_allclose(got, expected, rtol=MLP_BOUND)
    assert second._train_step_info.optimization_step == 8


def test_torch_source_resumes_exactly_with_dropout(tmp_path):
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 5))
    gen = torch.Generator().manual_seed(6)
    batches = [mlp_batch(gen) for _ in range(8)]
    straight = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=TORCH)
    expected = [straight.train_step(x, y)[0].item() for x, y in batches]
    first = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=TORCH)
    got = [first.train_step(x, y)[0].item() for x, y in batches[:4]]
    first.save_checkpoint(tmp_path / "half.h5")
    torch.manual_seed(77)
    second = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=TORCH)
    second.load_checkpoint(tmp_path / "half.h5")
    got += [second.train_step(x, y)[0].item() for x, y in batches[4:]]
    assert got == expected
    # dropout is on: the same batch twice gives two losses
    assert straight.train_step(*batches[0])[0].item() != straight.train_step(*batches[0])[0].item()


def test_an_onnx_model_with_its_loss_trains_through_the_torch_source(tmp_path):
    pytest.importorskip("onnx2fx", reason="ONNX models take the torch route through onnx2fx (the [cpu] extra)")
    import io

    import onnx

    module = MLPWithLoss()
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.onnx.export(module, (x, y), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["x", "label"], output_names=["loss", "logits"],
                      dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}, "logits": {0: "batch"}})
    onnx_model = onnx.load_from_string(buffer.getvalue())
    reference = clone(module)
    trainer = ORTTrainer(onnx_model, MLP_DESC, AdamConfig(lr=1e-2), options=TORCH)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        x, y = mlp_batch(gen)
        loss = trainer.train_step(x, y)[0].item()
        optimizer.zero_grad()
        expected, _ = reference(x, y)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        assert loss == pytest.approx(expected.item(), rel=MLP_BOUND)
    weights = trainer.state_dict()["model"]["full_precision"]
    for key, value in reference.state_dict().items():
        check(_rel(weights[key], value.numpy()), MLP_BOUND, key)

"""Training on a GPU (``make gpu-check``): every test here is marked ``cuda`` and skips, with the
reason, where CUDAExecutionProvider, a CUDA build of torch or a GPU is missing (tests/conftest.py).

Each test compares against PyTorch eager on the same GPU, or checks where the engine's memory lives.
"""

import numpy as np
import pytest
import torch

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig
from tolerances import check

pytestmark = pytest.mark.cuda

STEPS = 20
# ONNX Runtime's CUDA kernels against PyTorch eager on the same GPU (float32, no TF32 on either
# side), and the CPU against the GPU after a checkpoint round trip: each step's sums (≤ 64 terms:
# cuBLAS, reductions) may add in another order, at most 64·u per step, and torch's
# clip_grad_norm_ and the graph's clipping sum the squares of every gradient (837 for the MLP,
# 22386 for the encoder) in another order, at most n·u / 2 apart on the norm. Carried through the
# steps: 20 · (64 + 837 / 2) · u = 5.7e-4 at worst for the MLP (more for the encoder); the test
# holds the tighter 1e-4. A loss right after a checkpoint is loaded (identical state) is one forward
# apart, 64·u = 3.8e-6 at worst, and is held to the same 1e-4. Not re-measured in this pass (no GPU
# here); docs/gpu.md records that these pass on an H100 but no measured difference.
RTOL = 1e-4
CUDA = {"device": {"id": "cuda"}}
CE = torch.nn.functional.cross_entropy

MODELS = {
    "mlp": (MLP, MLP_DESC, CE, lambda gen: mlp_batch(gen), 1e-2),
    "encoder": (TinyEncoder, ENCODER_DESC, mlm_loss, lambda gen: mlm_batch(gen), 3e-3),
}


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    return (torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected)).item()


@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_torch_cuda_eager(name):
    """20 AdamW steps with clipping on identical weights and batches: losses and every weight
    within rel 1e-4 of PyTorch eager on the same GPU (no TF32 on either side)."""
    make, desc, loss_fn, batch, lr = MODELS[name]
    model = make()
    reference = clone(model).cuda()
    trainer = ORTTrainer(model, desc, AdamConfig(lr=lr), loss_fn=loss_fn, options=CUDA)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(3)
    ort_losses, torch_losses = [], []
    for _ in range(STEPS):
        inputs, label = batch(gen)
        ort_losses.append(trainer.train_step(inputs, label)[0].item())
        optimizer.zero_grad()
        loss = loss_fn(reference(inputs.cuda()), label.cuda())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(ort_losses, torch_losses, rtol=RTOL)
    assert np.mean(ort_losses[-5:]) < np.mean(ort_losses[:5])
    state = trainer.state_dict(pytorch_format=True)
    for key, expected in reference.state_dict().items():
        check(_relative_error(state[key], expected), RTOL, key)


def test_buffers_and_outputs_live_on_the_gpu():
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=CUDA)
    gen = torch.Generator().manual_seed(0)
    loss, logits = trainer.train_step(*mlp_batch(gen))
    engine = trainer._engine
    assert engine.device.type == "cuda" and type(engine.placement).__name__ == "CUDADevice"
    buffers = [*engine.weights_flat, engine.grads_flat, *engine.fixed_tensors.values(),
               *(t for p in (0, 1) for t in engine.states_flat[p].values()),
               *(t for p in (0, 1) for t in engine.buffers[p].values())]
    assert all(t.device == engine.device for t in buffers)
    # outputs come back as CUDA tensors (DLPack), never through host memory
    assert loss.device == engine.device and logits.device == engine.device
    eval_loss, eval_logits = trainer.eval_step(*mlp_batch(gen))
    assert eval_loss.device == engine.device and eval_logits.device == engine.device
    pointers = [t.data_ptr() for t in buffers]
    kept = logits.clone()
    for _ in range(3):
        trainer.train_step(*mlp_batch(gen))
    assert [t.data_ptr() for t in buffers] == pointers  # bound once, updated in place
    torch.testing.assert_close(logits, kept, rtol=0, atol=0)  # a later step does not overwrite an output


def test_inputs_given_on_the_gpu_train_like_host_inputs():
    model = MLP()
    host = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=CUDA)
    device = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options=CUDA)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = mlp_batch(gen)
        torch.testing.assert_close(device.train_step(x.cuda(), y.cuda())[0], host.train_step(x, y)[0], rtol=0, atol=0)


# A captured step replays the kernels the uncaptured one launches, on the same values in the same order:
# only kernels that add with atomics (the embedding's gradient) may sum in another order, 64·u per step as
# above (float32), well inside RTOL; in float16 such a float32 ulp may round one half-precision element the
# other way (2^-11 of it), averaged into the loss over its rows and carried through 20 steps: 1e-3 holds that.
CAPTURE_TOLERANCE = {"fp32": RTOL, "float16": 1e-3}


@pytest.mark.parametrize("precision", CAPTURE_TOLERANCE)
@pytest.mark.parametrize("name", MODELS)
def test_a_captured_step_trains_as_an_uncaptured_one(name, precision, record_property):
    """``device.cuda_graph``: 20 AdamW steps captured and replayed against the same steps run node by
    node (losses and weights within CAPTURE_TOLERANCE); the step times of both are recorded."""
    import time

    make, desc, loss_fn, batch, lr = MODELS[name]
    model = make()
    mixed = {"mixed_precision": {"enabled": True, "dtype": precision}} if precision != "fp32" else {}
    results = {}
    for captured in (False, True):
        options = {"device": {"id": "cuda", "cuda_graph": captured}, **mixed}
        trainer = ORTTrainer(clone(model), desc, AdamConfig(lr=lr), loss_fn=loss_fn, options=options)
        gen = torch.Generator().manual_seed(3)
        losses, times = [], []
        for _ in range(STEPS):
            inputs, label = batch(gen)
            start = time.perf_counter()
            losses.append(trainer.train_step(inputs, label)[0].item())
            times.append(time.perf_counter() - start)
        results[captured] = losses, trainer.state_dict(pytorch_format=True), float(np.median(times[5:]))
    (uncaptured, expected, plain_s), (captured, state, captured_s) = results[False], results[True]
    record_property("step_ms_uncaptured", plain_s * 1e3)
    record_property("step_ms_captured", captured_s * 1e3)
    np.testing.assert_allclose(captured, uncaptured, rtol=CAPTURE_TOLERANCE[precision])
    for key, value in expected.items():
        check(_relative_error(state[key], value), CAPTURE_TOLERANCE[precision], key)


def test_a_gpu_index_past_the_last_names_the_gpus():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device.id: 'cuda:{count}': there is no GPU {count}; this machine has "
                                         rf"{count}: cuda:0 \("):
        ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=CE, options={"device": {"id": f"cuda:{count}"}})


def test_checkpoint_round_trip_gpu_cpu_gpu(tmp_path):
    """A GPU run's checkpoint continues on the CPU, and the CPU's back on the GPU: weights and
    optimizer states carry over exactly, and both continue the same training."""
    model = TinyEncoder()
    gen = torch.Generator().manual_seed(7)
    batches = [mlm_batch(gen) for _ in range(6)]
    gpu = ORTTrainer(clone(model), ENCODER_DESC, AdamConfig(lr=3e-3), loss_fn=mlm_loss, options=CUDA)
    for batch in batches[:3]:
        gpu.train_step(*batch)
    gpu.save_checkpoint(tmp_path / "gpu.h5")

    cpu = ORTTrainer(clone(model), ENCODER_DESC, AdamConfig(lr=3e-3), loss_fn=mlm_loss, options={"device": {"id": "cpu"}})
    cpu.load_checkpoint(tmp_path / "gpu.h5")
    _assert_same_state(cpu.state_dict(), gpu.state_dict(), rtol=0)
    for batch in batches[3:5]:
        np.testing.assert_allclose(cpu.train_step(*batch)[0].item(), gpu.train_step(*batch)[0].item(), rtol=RTOL)
    cpu.save_checkpoint(tmp_path / "cpu.h5")

    again = ORTTrainer(clone(model), ENCODER_DESC, AdamConfig(lr=3e-3), loss_fn=mlm_loss, options=CUDA)
    again.load_checkpoint(tmp_path / "cpu.h5")
    _assert_same_state(again.state_dict(), cpu.state_dict(), rtol=0)
    assert again._engine.weights_flat[0].device.type == "cuda"
    np.testing.assert_allclose(again.train_step(*batches[5])[0].item(), cpu.train_step(*batches[5])[0].item(), rtol=RTOL)
    again.model.cuda()  # the user's module may live on the GPU: it is written where it is
    again.update_torch_model()
    expected = again.state_dict(pytorch_format=True)
    for key, value in again.model.state_dict().items():
        assert value.device.type == "cuda" and expected[key].device.type == "cpu"
        torch.testing.assert_close(value.cpu(), expected[key], rtol=0, atol=0)


def _assert_same_state(got: dict, expected: dict, rtol: float) -> None:
    assert got["train_step_info"] == expected["train_step_info"]
    for name, value in expected["model"]["full_precision"].items():
        np.testing.assert_allclose(got["model"]["full_precision"][name], value, rtol=rtol, atol=0)
    for name, states in expected["optimizer"].items():
        for state, value in states.items():
            np.testing.assert_allclose(got["optimizer"][name][state], value, rtol=rtol, atol=0)


# ---- mixed precision against torch.autocast on the same GPU ----------------------------------------------------
# The graph casts as CPU autocast does (the trace runs on CPU tensors: docs/usage.md, "Mixed precision"); CUDA
# autocast has the same float16 list for linear layers and matmuls and the same float32 list for the losses, but
# also keeps softmax, LayerNorm and GELU in float32. So the MLP (linear, ReLU, cross-entropy) is held to the CPU
# test's tolerance and the encoder to a looser one, stated here before the first GPU run and to be tightened
# from what it measures. Measured on an H100 (onnxruntime-gpu 1.31.1, torch 2.11+cu130; two runs, the same values):
# worst relative loss difference over the 50 steps MLP 1.65e-3 (float16), 3.5e-3 (bfloat16); encoder 3.1e-4
# (float16), 1.9e-3 (bfloat16). The first 10 steps agree to 1.2e-4 (MLP float16), float16's rounding; the rest is
# drift that grows with training at lr 1e-2. bfloat16 keeps 8 bits of mantissa (3.9e-3 per rounding) where float16
# keeps 11 (4.9e-4). Each run records its worst as a property (make gpu-check GPU_PYTEST_ARGS=--junitxml=cuda.xml).
# Arithmetic: at equal weights, losses of half-precision logits differ by at most 2 sides · 2 roundings · u
# (test_mixed_precision.py's LOSS_BOUND): 2.0e-3 for float16, 1.6e-2 for bfloat16; the drift of 50 Adam steps
# at lr 1e-2 adds to that. The measured values above are 1.8x (MLP float16) to 5.3x (encoder bfloat16) under
# these tolerances: less than the suite's 10x margin, not yet derived (not re-measured in this pass: no GPU here).
MIXED_TOLERANCE = {("mlp", "float16"): 3e-3, ("mlp", "bfloat16"): 1e-2,
                   ("encoder", "float16"): 1e-3, ("encoder", "bfloat16"): 1e-2}


@pytest.mark.parametrize("loss_only", [False, True], ids=["all-outputs", "loss-only"])
@pytest.mark.parametrize("half_loss", [False, True], ids=["defaults", "half_precision_levers"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", MODELS)
def test_mixed_precision_follows_torch_cuda_autocast_for_50_steps(name, dtype, half_loss, loss_only, record_property):
    """50 AdamW steps in mixed precision: losses within MIXED_TOLERANCE (relative) of PyTorch eager
    under ``torch.autocast("cuda", dtype)`` with a ``GradScaler`` for float16 (none for bfloat16),
    the loss scale step for step GradScaler's, float32 master weights. With
    ``graph_optimizations.half_precision_loss``, ``half_precision_bias_gradient``,
    ``half_precision_transposed_products``, ``half_precision_gelu``, ``gelu_forward_kernel`` (ONNX Runtime's
    FastGelu / BiasGelu CUDA kernels for the GELUs' forward) and ``bfloat16_softmax_gradient`` too
    (a bfloat16 attention's softmax gradient in bfloat16, where the model has one): each row's log-probability one
    rounding more (u of its size, averaged over the rows of the mean), the scores' gradient two, the bias
    gradients and the transposed products summed in another order before their one rounding, the GELU's
    derivative ~8 roundings in the half dtype instead of one (the encoder's ``F.gelu``): well inside the
    same tolerance; the bfloat16 runs are their only check of bfloat16 values (the CPU has no bfloat16
    softmax, product or element-wise kernels). With only the loss fetched, the encoder's head projects its labelled rows alone
    (``sparse_labels`` inside the autocast region), whose selection's gradient is added in float32."""
    from ort_trainer.amp import DynamicLossScaler

    make, desc, loss_fn, batch, lr = MODELS[name]
    model = make()
    reference = clone(model).cuda()
    half = getattr(torch, dtype)
    scaler = DynamicLossScaler(loss_scale=2.0 ** 8, up_scale_window=10) if dtype == "float16" else None
    mixed = {"enabled": True, "dtype": dtype, **({"loss_scaler": scaler} if scaler else {})}
    trainer = ORTTrainer(model, desc, AdamConfig(lr=lr), loss_fn=loss_fn,
                         options={**CUDA, "utils": {"grad_norm_clip": False}, "mixed_precision": mixed,
                                  "graph_optimizations": {"half_precision_loss": half_loss,
                                                          "half_precision_bias_gradient": half_loss,
                                                          "half_precision_transposed_products": half_loss,
                                                          "half_precision_gelu": half_loss,
                                                          "gelu_forward_kernel": half_loss,
                                                          "bfloat16_softmax_gradient": half_loss}})
    if loss_only:
        trainer._train_step_info.fetches = ["loss"]
    optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.0)
    grad_scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8, growth_interval=10, enabled=scaler is not None)
    gen = torch.Generator().manual_seed(5)
    ours, theirs, our_scales, their_scales = [], [], [], []
    for _ in range(50):
        inputs, label = batch(gen)
        outputs = trainer.train_step(inputs, label)
        ours.append((outputs if loss_only else outputs[0]).item())
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=half):
            loss = loss_fn(reference(inputs.cuda()), label.cuda())
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        theirs.append(loss.item())
        if scaler is not None:
            our_scales.append(scaler.loss_scale)
            their_scales.append(grad_scaler.get_scale())
    relative = np.abs(np.array(ours) - theirs) / np.abs(theirs)
    record_property("worst_relative_loss_difference", float(relative.max()))
    record_property("first_10_steps_worst", float(relative[:10].max()))
    check(relative.max(), MIXED_TOLERANCE[name, dtype], (relative.max(), int(relative.argmax())))
    assert our_scales == their_scales
    assert all(t.dtype == torch.float32 for t in trainer._engine.weights_flat)
    rewritten = [n for n in trainer._graphs.gradient.graph.node if n.name.endswith("/half_loss/LogSoftmax")]
    assert len(rewritten) == (1 if half_loss else 0)
    summed = [n for n in trainer._graphs.gradient.graph.node if n.name.endswith("/half_column_sums/MatMul")]
    assert bool(summed) == half_loss

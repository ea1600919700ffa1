"""The passes on the "torch" source's eval graph (``passes.apply_eval_passes``) and the CPU
sessions' ``unfused_skip_layer_norm``: each against float64 PyTorch in eval mode, with its effect on
the graph ONNX Runtime runs."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.devices import CPUDevice
from ort_trainer.graph import passes
from ort_trainer.optim import SGDConfig

from models import tiny_gpt2
from tolerances import FLOAT32

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

PASSES = passes.EVAL_PASSES

# Every comparison here: ONNX Runtime's float32 eval forward against float64 PyTorch in eval mode,
# each sum within n·u of its terms' magnitude (Higham's bound), adding up along the chain; the
# float64 side's own rounding is 2^-29 of that. Outputs near 0 carry the error of the largest.
# - GPT-2 (2 layers, width 16): per layer c_attn (16 terms), scores (8), softmax (8), attention (8),
#   c_proj (16), two LayerNorms (2·16), c_fc (16) and the MLP's c_proj (64): ≈ 170; with the final
#   LayerNorm and the head (16 + 16): GPT2_LOGITS_BOUND = 370u = 2.2e-5 relative (observed at 1 and
#   2 threads: ≤ 0.0036 of the bound, 270x under). The loss adds the log-sum-exp over 50
#   classes and the mean over 16 positions: ≈ 440u = 2.6e-5 at worst; GPT2_LOSS_BOUND is kept at
#   1e-6 (observed ≤ 6.1e-8, 16x under).
# - the erf-GELU classifier (8 → 32 → 5): up (8), the GELU (erf: a few ulps and 5 roundings), down
#   (32), the log-sum-exp (5) and the mean (6): CLASSIFIER_BOUND = 64u = 3.8e-6 relative (observed:
#   loss ≤ 2.1e-8, 180x under; logits ≤ 0.022 of the bound, 45x under).
GPT2_LOGITS_BOUND = 370 * FLOAT32
GPT2_LOSS_BOUND = 1e-6
CLASSIFIER_BOUND = 64 * FLOAT32


def _evaluated(model, desc, batch, on: bool, **options):
    """``(trainer, outputs of eval_step)`` with the eval passes all on or all off."""
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={"graph_optimizations": {**{name: on for name in PASSES},
                                                          "shape_specialization": False},
                                  "graph": {"gradient_source": "torch"}, **options})
    outputs = trainer.eval_step(*batch)
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else outputs
    return trainer, [o.detach().numpy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in outputs]


def _reference(model, batch, names=None):
    """The model's eval-mode outputs in float64 (the batch passed by keyword with ``names``)."""
    reference = copy.deepcopy(model).double().eval()
    batch = tuple(b.double() if b.is_floating_point() else b for b in batch)
    with torch.no_grad():
        outputs = reference(**dict(zip(names, batch))) if names else reference(*batch)
    if isinstance(outputs, torch.Tensor):
        return [outputs.numpy()]
    return [o.numpy() for o in (outputs if isinstance(outputs, tuple) else (outputs.loss, outputs.logits))]


def _eval_graph(trainer) -> onnx.ModelProto:
    return trainer._shapes.symbolic_graphs().eval


def _op_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node} | {n.op_type for f in model.functions for n in f.node}


def test_gpt2_eval_graph_loses_the_loss_function_the_sequences_and_the_nan_guard():
    model, desc = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the first 3 query rows of that sequence see no key at all
    batch = (ids, mask, ids)
    results = {on: _evaluated(model, desc, batch, on) for on in (False, True)}
    off, on = _eval_graph(results[False][0]), _eval_graph(results[True][0])
    assert {"SoftmaxCrossEntropyLoss", "SequenceAt", "IsNaN"} <= _op_types(off)
    assert not {"SoftmaxCrossEntropyLoss", "SequenceAt", "SequenceConstruct", "IsNaN"} & _op_types(on)
    counts = passes.apply_eval_passes(copy.deepcopy(off), {name: True for name in PASSES})
    # one loss; q, k and v of 2 layers; 2 attention softmaxes; GPT-2's GELU is the tanh one; the labels' Pad (of
    # symbolic shape in this graph: its fill's shape read at run time)
    assert counts == {"cross_entropy": 1, "half_precision_loss": 0, "integer_pads": 1, "sequences": 6,
                      "output_reshape": 0, "safe_softmax": 2, "gelu": 0}  # half_precision_loss: none in float32
    expected = _reference(model, batch, ("input_ids", "attention_mask", "labels"))
    loss, logits = results[True][1]
    atol = GPT2_LOGITS_BOUND * float(np.abs(expected[1]).max())
    np.testing.assert_allclose(loss, expected[0], rtol=GPT2_LOSS_BOUND)
    np.testing.assert_allclose(logits, expected[1], rtol=GPT2_LOGITS_BOUND, atol=atol)
    # without the passes, torchlib's mask leaves the fully masked rows uniform, not zero as in torch
    loss, logits = results[False][1]
    np.testing.assert_allclose(logits[0], expected[1][0], rtol=GPT2_LOGITS_BOUND, atol=atol)
    np.testing.assert_allclose(logits[1, 3:], expected[1][1, 3:], rtol=GPT2_LOGITS_BOUND, atol=atol)
    # a difference, not a tolerance: the uniform rows are off by far more than rounding, even at 1e-4
    assert not np.allclose(logits[1, :3], expected[1][1, :3], rtol=1e-4, atol=1e-5)


class _ErfGeluClassifier(torch.nn.Module):
    """Linear -> nn.GELU() (the erf form, as BERT's) -> Linear -> cross-entropy."""

    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 5)

    def forward(self, x, labels):
        logits = self.down(self.act(self.up(x)))
        return F.cross_entropy(logits, labels), logits


_CLASSIFIER_DESC = {"inputs": [("x", ["batch", 8]), ("labels", ["batch"])],
                    "outputs": [("loss", [], True), ("logits", ["batch", 5])]}


def test_erf_gelu_is_reordered_so_that_onnxruntime_fuses_it(tmp_path):
    torch.manual_seed(0)
    model = _ErfGeluClassifier()
    generator = torch.Generator().manual_seed(2)
    batch = (torch.randn(6, 8, generator=generator) * 3, torch.randint(0, 5, (6,), generator=generator))
    results = {on: _evaluated(model, _CLASSIFIER_DESC, batch, on) for on in (False, True)}
    counts = passes.apply_eval_passes(copy.deepcopy(_eval_graph(results[False][0])),
                                              {name: True for name in PASSES})
    assert counts["gelu"] == 1 and counts["cross_entropy"] == 1
    for on in (False, True):  # what ONNX Runtime makes of each graph
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"optimized_{on}.onnx")
        ort.InferenceSession(_eval_graph(results[on][0]).SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
        fused = "Gelu" in _op_types(onnx.load(options.optimized_model_filepath))
        assert fused == on
    expected = _reference(model, batch)
    for on in (False, True):
        np.testing.assert_allclose(results[on][1][0], expected[0], rtol=CLASSIFIER_BOUND)
        np.testing.assert_allclose(results[on][1][1], expected[1], rtol=CLASSIFIER_BOUND,
                                   atol=CLASSIFIER_BOUND * float(np.abs(expected[1]).max()))


class _MaskedAttention(torch.nn.Module):
    """``scaled_dot_product_attention`` with a boolean mask read from the batch (HF's sdpa path)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).unsqueeze(1).split(8, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.unsqueeze(1)).sum()


_ATTENTION_DESC = {"inputs": [("x", ["batch", "seq", 8]), ("keep", ["batch", "seq", "seq"])],
                   "outputs": [("out", [], True)]}


def test_eval_safe_softmax_zeroes_fully_masked_rows_and_keeps_nan_rows_as_torch_does():
    torch.manual_seed(0)
    model = _MaskedAttention()
    x = torch.randn(2, 4, 8)
    keep = torch.ones(2, 4, 4, dtype=torch.bool)
    keep[0, 1] = False  # a fully masked row: 0 in torch and in both graphs
    finite = _reference(model, (x, keep))[0]
    trainer, (out,) = _evaluated(model, _ATTENTION_DESC, (x, keep), True)
    # qkv (8 terms), scores (8), softmax (4), attention (4) and the sum of the 64 outputs: ≈ 90u of
    # Σ|outputs|, 10.7 times the sum here (it cancels): ≈ 960u = 5.7e-5 at worst; kept at 1e-5
    # (observed at 1 and 2 threads: ≤ 7.3e-8, 137x under)
    np.testing.assert_allclose(out, finite, rtol=1e-5)
    off = _evaluated(model, _ATTENTION_DESC, (x, keep), False)[1][0]  # torchlib's mask: a uniform row
    assert np.isfinite(off) and abs(off - finite) > 0.1  # a difference, not a tolerance
    x[1, 2, 0] = float("nan")  # a NaN score row: torch keeps NaN, the translation's IsNaN guard zeroed it
    with torch.no_grad():
        assert torch.isnan(model.eval()(x, keep))
    assert np.isnan(trainer.eval_step(x, keep).item())
    assert "IsNaN" not in _op_types(_eval_graph(trainer))


class _Residual(torch.nn.Module):
    """A residual Add before a LayerNorm, on 3-D activations: ONNX Runtime's SkipLayerNormFusion pattern."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.dense(x)).square().mean()


def test_unfused_skip_layer_norm_turns_the_fusion_off_on_cpu_sessions(tmp_path):
    assert CPUDevice().disabled_optimizers(True) == ["SkipLayerNormFusion"]
    assert CPUDevice().disabled_optimizers(False) == []
    torch.manual_seed(0)
    model = _Residual()
    x = torch.randn(2, 8, 16)
    desc = {"inputs": [("x", ["batch", "seq", 16])], "outputs": [("loss", [], True)]}
    expected = _reference(model, (x,))[0]
    for on in (False, True):
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"eval_{on}.onnx")
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph_optimizations": {"unfused_skip_layer_norm": on},
                                      "graph": {"gradient_source": "torch"}, "session_options": options})
        loss = trainer.eval_step(x)  # the eval session is the last one made: the file is its graph
        fused = "SkipLayerNormalization" in _op_types(onnx.load(options.optimized_model_filepath))
        assert fused != on
        # dense (16 terms), the LayerNorm's mean and variance (16 each) and the mean of the 256
        # squares: ≈ 300u = 1.8e-5 at worst; kept at 1e-5 (observed at 1 and 2 threads: ≤ 6.2e-8,
        # 160x under)
        np.testing.assert_allclose(loss.item(), expected, rtol=1e-5)

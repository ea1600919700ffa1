"""The ``half_precision_loss`` pass (``graph/passes/loss.py``): under mixed precision, a float32
cross-entropy over half-precision scores computed in the scores' dtype, with no float32 copy of them.

Checked against float64 PyTorch (loss and every gradient, the pass on and off), on the graph (the
loss's tensors of the scores' size are float16, and none is float32), on the eval graph, and on a
hand-built pattern in float16 and bfloat16 (types consistent; float16 values against float64 NumPy).
bfloat16 values need a GPU: ONNX Runtime's CPU provider has no bfloat16 softmax.
"""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes import loss as loss_pass
from ort_trainer.optim import SGDConfig

from models import ENCODER_DESC, VOCAB, TinyEncoder, assert_float32_untouched, mlm_batch, mlm_loss, tiny_gpt2
from tolerances import FLOAT16, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float16 training against float64 PyTorch, relative to each tensor's norm: along the longest chain of
# the tiny models' gradients, each operation rounded to float16 once (TinyEncoder's: the embeddings, two
# post-LN layers of ~15 each — products, attention, softmax, layer norms and their backwards — the head and
# the loss: ~40), 40·u16 = 2.0e-2. The pass adds to the scores' gradient one rounding of p and one of the
# row weight (2·u16) and to each row's log-probability one rounding (u16 of its size), inside that bound;
# the loss is a mean of those. Observed (1 and 2 threads, worst tensor): GPT-2 9.4e-4 on and off,
# TinyEncoder 1.33e-3 on, 1.52e-3 off: 13x under.
HALF_BOUND = 40 * FLOAT16
# The pass on against off (both float16 training): they differ by the loss's roundings only: each row's
# log-probability one u16 of its size, the scores' gradient 2·u16, carried through the same ~40 roundings
# of the backward on both sides: 40·u16 again. Observed: at most 6.1e-4 (the loss 5.0e-5): 32x under.
ON_OFF_BOUND = 40 * FLOAT16


def _scaler():
    # a fixed loss scale of 1: the gradients compared are the unscaled ones, and no step is skipped
    return DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)


def _step(model, desc, batch, on: bool, loss_fn=None, fetch_logits: bool = True):
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler": _scaler()},
                                  "graph_optimizations": {"half_precision_loss": on}})
    if not fetch_logits:
        trainer._train_step_info.fetches = ["loss"]  # the benchmarks' loop: the logits are not fetched
    outputs = trainer.train_step(*batch)
    loss = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    return trainer, float(loss), {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


def _relative(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


def _score_tensors(model: onnx.ModelProto, vocab: int) -> dict[str, int]:
    """``{name: element type}`` of the graph's values of rank 2 or more whose last axis is the vocabulary
    and whose first is not (the scores and their gradients, not the head's weight)."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    found = {}
    for info in [*graph.value_info, *graph.output]:
        dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
        if len(dims) >= 2 and dims[-1] == vocab and dims[0] != vocab:
            found[info.name] = info.type.tensor_type.elem_type
    return found


def _loss_values(model: onnx.ModelProto, vocab: int) -> dict[str, int]:
    """The element types of the scores-sized values that the loss's own nodes write (its log-softmax,
    softmax, exponential, scatter and the casts between them), leaving out the cast of the scores'
    gradient that a head's bias gradient sums in float32 (read by a column sum or a ReduceSum: torch's
    decomposition of the bias gradient, not the loss's)."""
    types = _score_tensors(model, vocab)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    ops = ("LogSoftmax", "Softmax", "Exp", "ScatterElements", "Cast", "Mul")
    return {o: types[o] for n in model.graph.node if n.op_type in ops for o in n.output if o in types
            and not (n.op_type == "Cast" and readers.get(o) and all(
                r.op_type == "ReduceSum" or "column_sums" in r.name for r in readers[o]))}


def _gpt2_case():
    model, desc = tiny_gpt2(seq=8)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 8), generator=gen)
    return model, desc, (ids, torch.ones_like(ids), ids), None


def _encoder_case():
    torch.manual_seed(0)
    return TinyEncoder(), ENCODER_DESC, mlm_batch(torch.Generator().manual_seed(6)), mlm_loss


def _float64(model, batch, loss_fn):
    double = copy.deepcopy(model).double()
    if loss_fn is None:
        ids, mask, labels = batch
        value = double(input_ids=ids, attention_mask=mask, labels=labels).loss
    else:
        value = loss_fn(double(batch[0]), batch[1])
    value.backward()
    return float(value.detach()), {n: p.grad.numpy() for n, p in double.named_parameters()}


@pytest.mark.parametrize("case", ["gpt2", "encoder", "encoder-loss-only"])
def test_float16_loss_within_float16_rounding_of_float64(case, record_property):
    """One float16 step, the pass on and off: the loss and every gradient within HALF_BOUND of float64
    PyTorch's, on against off within ON_OFF_BOUND. Hugging Face GPT-2's ``logits.float()`` loss (a Cast,
    then a Reshape), a masked-LM ``F.cross_entropy`` with ignored labels (a Reshape, then the autocast
    Cast; a weight per row), and the same with only the loss fetched (``sparse_labels`` projects the
    labelled rows alone). With the pass on, every scores-sized value the loss writes is float16 and none
    is float32 (off: float32)."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    loss64, grads64 = _float64(model, batch, loss_fn)
    results, errors = {}, {}
    for on in (True, False):
        trainer, value, grads = _step(model, desc, batch, on, loss_fn, fetch_logits=case != "encoder-loss-only")
        results[on] = (value, grads)
        errors[on] = {"loss": abs(value - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, HALF_BOUND, (on, name))
        gradient = trainer._graphs.gradient
        written = _loss_values(gradient, VOCAB)
        wanted = TensorProto.FLOAT16 if on else TensorProto.FLOAT
        assert written and wanted in set(written.values()), written
        if on:
            assert TensorProto.FLOAT not in set(written.values()), written
            assert sum(n.name.endswith("/half_loss/LogSoftmax") for n in gradient.graph.node) == 1
            assert sum(n.name.endswith("/half_loss/Softmax") for n in gradient.graph.node) == 1
    on_off = {"loss": abs(results[True][0] - results[False][0]) / abs(results[False][0]),
              **{name: _relative(results[True][1][name], grad) for name, grad in results[False][1].items()}}
    for name, error in on_off.items():
        check(error, ON_OFF_BOUND, ("on/off", name))
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()},
                               "on/off": max(on_off.values()), "on/off loss": on_off["loss"]})


def test_the_pass_leaves_float32_training_bit_equal():
    """fp32 training has no half-precision scores: the graph and the gradients with the flag on and off
    are the same."""
    model, desc, batch, loss_fn = _encoder_case()
    assert_float32_untouched(model, desc, batch, "half_precision_loss", loss_fn)


def test_eval_step_computes_the_loss_in_float16():
    """The eval graph gets the forward half: its log-softmax is float16, and eval_step's loss is within
    HALF_BOUND of float64 PyTorch's on the same weights (and of the pass off)."""
    model, desc, batch, loss_fn = _encoder_case()
    losses = {}
    for on in (True, False):
        trainer, _, _ = _step(model, desc, batch, on, loss_fn)
        losses[on] = float(trainer.eval_step(*batch)[0])
        if on:
            eval_graph = trainer._graphs.eval
            assert eval_graph is not None
            softmaxes = [n for n in eval_graph.graph.node if n.op_type == "LogSoftmax"]
            assert [n.name.endswith("/half_loss/LogSoftmax") for n in softmaxes] == [True]
    double = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        expected = float(loss_fn(double(batch[0]), batch[1]))
    for on, value in losses.items():
        check(abs(value - expected) / abs(expected), HALF_BOUND, on)


# ---- the pass on a hand-built pattern: the cross_entropy pass's backward, as the joint graph holds it


def _pattern(dtype: int, rows: int = 6, vocab: int = 40, extra_reader: bool = False) -> onnx.ModelProto:
    """Cast(L) -> Reshape -> LogSoftmax -> GatherElements (the loss) and Exp -> Mul(w) ->
    ScatterElements(add, -w) -> Reshape -> Cast(dtype) (the scores' gradient), L of shape
    [2, rows/2, vocab] in ``dtype``. ``extra_reader``: the float32 copy is also a graph output."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["L"], ["wide"], to=f32),
        helper.make_node("Reshape", ["wide", "flat"], ["scores"]),
        helper.make_node("LogSoftmax", ["scores"], ["Y"], axis=-1),
        helper.make_node("GatherElements", ["Y", "target"], ["picked"], axis=1),
        helper.make_node("Exp", ["Y"], ["P"]),
        helper.make_node("Mul", ["P", "w"], ["Pw"]),
        helper.make_node("Neg", ["w"], ["spread"]),
        helper.make_node("ScatterElements", ["Pw", "target", "spread"], ["G"], axis=1, reduction="add"),
        helper.make_node("Reshape", ["G", "shape3"], ["G3"]),
        helper.make_node("Cast", ["G3"], ["dL"], to=dtype),
    ]
    inputs = [helper.make_tensor_value_info("L", dtype, [2, rows // 2, vocab]),
              helper.make_tensor_value_info("target", TensorProto.INT64, [rows, 1]),
              helper.make_tensor_value_info("w", f32, [rows, 1])]
    outputs = [helper.make_tensor_value_info("picked", f32, [rows, 1]),
               helper.make_tensor_value_info("dL", dtype, [2, rows // 2, vocab])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("wide", f32, [2, rows // 2, vocab]))
    inits = [numpy_helper.from_array(np.array([rows, vocab], np.int64), "flat"),
             numpy_helper.from_array(np.array([2, rows // 2, vocab], np.int64), "shape3")]
    model = helper.make_model(helper.make_graph(nodes, "loss", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16], ids=["float16", "bfloat16"])
def test_the_rewritten_pattern_is_well_typed(dtype):
    """In float16 and bfloat16 the rewrite leaves a graph that ONNX's full check and strict shape
    inference accept (every node's inputs of one type), with no float32 value of the scores' size and a
    scatter that assigns (``reduction="none"``: ONNX Runtime's CUDA ``add`` picks its kernel by element
    size and would add bfloat16 bits as float16)."""
    model = _pattern(dtype)
    assert loss_pass.half_precision_loss(model) == 1
    onnx.checker.check_model(model, full_check=True)
    graph = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}
    sized = [v.name for v in [*graph.value_info, *graph.output] if v.type.tensor_type.shape.dim
             and v.type.tensor_type.shape.dim[-1].dim_value == 40]
    assert sized and all(types[name] == dtype for name in sized), {n: types[n] for n in sized}
    scatters = [n for n in graph.node if n.op_type == "ScatterElements"]
    assert len(scatters) == 1 and all(a.name != "reduction" for a in scatters[0].attribute)
    assert loss_pass.half_precision_loss(model) == 0  # nothing left to rewrite


def test_the_rewritten_pattern_against_float64():
    """The float16 pattern's two outputs with ONNX Runtime, rewritten, against float64 NumPy: each row's
    log-probability within one u16 of its size (plus the scores' own float32 roundings), each gradient
    within 3·u16 of the largest (p rounded, w rounded, the product rounded; at the label, (p - 1)·w in
    float32 from the rounded p, then rounded); ignored rows (w = 0) exactly zero."""
    import onnxruntime as ort

    rows, vocab = 6, 40
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, rows // 2, vocab)) * 3).astype(np.float16)
    target = rng.integers(0, vocab, (rows, 1)).astype(np.int64)
    w = np.full((rows, 1), 1 / 5, np.float32)
    w[2] = 0.0  # an ignored row
    model = _pattern(TensorProto.FLOAT16)
    assert loss_pass.half_precision_loss(model) == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    picked, gradient = session.run(None, {"L": logits, "target": target, "w": w})
    x = logits.astype(np.float64).reshape(rows, vocab)
    log_p = x - x.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    expected_picked = np.take_along_axis(log_p, target, 1)
    np.testing.assert_allclose(picked, expected_picked, rtol=2 * FLOAT16, atol=0)
    expected = np.exp(log_p) * w.astype(np.float64)
    np.put_along_axis(expected, target, np.take_along_axis(expected, target, 1) - w.astype(np.float64), 1)
    got = gradient.astype(np.float64).reshape(rows, vocab)
    assert np.abs(got - expected).max() <= 3 * FLOAT16 * np.abs(expected).max()
    assert (got[2] == 0).all()


def test_a_float32_copy_read_elsewhere_is_left_alone():
    """When the float32 scores are read outside the pattern (here a graph output), nothing is rewritten:
    the copy would be made anyway, and the pass keeps to what it can remove."""
    model = _pattern(TensorProto.FLOAT16, extra_reader=True)
    before = [n.op_type for n in model.graph.node]
    assert loss_pass.half_precision_loss(model) == 0
    assert [n.op_type for n in model.graph.node] == before

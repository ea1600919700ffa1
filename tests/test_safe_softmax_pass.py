"""The "torch" source's ``safe_softmax`` pass (``graph/softmax.py``): the fully-masked-row guard
of ``scaled_dot_product_attention``'s softmax, checked against float64 PyTorch gradients and torch's
own outputs for masked, NaN and inf rows."""

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.passes import softmax
from ort_trainer.graph import passes
from ort_trainer.optim import SGDConfig

from models import tiny_gpt2
from tolerances import FLOAT32, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 30, 16, 2, 3, 6
GUARD_OPS = ("Equal", "Not", "Cast", "ReduceMax", "ReduceMin", "ReduceSum", "And", "Where")


class TinyAttention(torch.nn.Module):
    """One attention block through ``F.scaled_dot_product_attention`` (whose softmax is
    ``aten._safe_softmax``) with an additive float mask or ``is_causal``; returns the attention output
    too, whose fully masked rows are 0."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, mask, labels):
        x = self.embed(ids)
        batch, seq, width = x.shape
        q, k, v = (t.reshape(batch, seq, HEADS, width // HEADS).transpose(1, 2)
                   for t in self.qkv(x).split(HIDDEN, dim=2))
        if self.causal:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch, seq, width)
        logits = self.head(attended)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), attended


DESC = {"inputs": [("ids", ["batch", "seq"]), ("mask", ["batch", 1, "seq", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("attended", ["batch", "seq", HIDDEN])]}


def _batch(mask=None):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.zeros(BATCH, 1, SEQ, SEQ) if mask is None else mask, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _padding_mask():
    """Key padding on the last two positions of batch 1, and every key masked for queries 0 and 3 of
    batch 2: two fully masked rows (all -inf) whose attention output torch sets to 0."""
    mask = torch.zeros(BATCH, 1, SEQ, SEQ)
    mask[1, :, :, -2:] = float("-inf")
    mask[2, :, [0, 3], :] = float("-inf")
    return mask


def _step(model, batch, on, static=True, **passes):
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0),
                         options={"graph_optimizations": {"safe_softmax": on, "shape_specialization": static, **passes},
                                  "graph": {"gradient_source": "torch"}})
    loss, attended = trainer.train_step(*batch)
    return trainer, loss, attended, {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}


def _reference(model, batch):
    """float64 PyTorch: loss, attention output and gradients."""
    double = copy.deepcopy(model).double()
    ids, mask, labels = batch
    loss, attended = double(ids, mask.double(), labels)
    loss.backward()
    return loss, attended, {name: p.grad.numpy() for name, p in double.named_parameters()}


# float32 (ONNX Runtime) against float64 PyTorch, each sum within n·u of its terms' magnitude
# (Higham's bound), adding up along the chain:
# - the attention output: qkv (16 terms), the scores (8), the softmax (6, after an exp), the
#   attention (6), plus a few elementwise roundings: ATTENDED_BOUND = 40u = 2.4e-6 relative, of the
#   largest output where outputs cancel (observed at 1 and 2 threads: ≤ 0.045 of the bound, 22x
#   under); against float32 PyTorch (the NaN test) both sides are within it of the exact value: 80u
#   apart (observed ≤ 0.016 of that, 61x under);
# - the loss adds the head (16), the log-sum-exp over 30 classes and the mean over 18 positions:
#   ≈ 104u = 6.2e-6 at worst; LOSS_BOUND is kept at 1e-6 (observed ≤ 5.2e-8, 19x under);
# - the gradients add the backward's transposed chain and the weight gradients' sums over 18
#   positions: ≈ 230u = 1.4e-5 at worst; REFERENCE_BOUND is kept at 1e-5 (observed ≤ 1.8e-7, 55x under).
ATTENDED_BOUND = 40 * FLOAT32
LOSS_BOUND = 1e-6
REFERENCE_BOUND = 1e-5


def _assert_close(got, expected, rtol=REFERENCE_BOUND):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        error = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12)
        check(error, rtol, f"{name}: relative error {error:.2e}")


def _ops(trainer):
    return [n.op_type for n in trainer._graphs.gradient.graph.node if n.op_type in GUARD_OPS]


def _count(trainer, op_type):
    return sum(n.op_type == op_type for n in trainer._graphs.gradient.graph.node)


@pytest.mark.parametrize("causal, static", [(True, True), (False, True), (False, False)],
                         ids=["is_causal", "padding-mask", "padding-mask-symbolic"])
def test_safe_softmax_matches_float64_pytorch(causal, static):
    """Causal attention, and a padding mask that masks whole rows: gradients and attention outputs as
    float64 PyTorch's (fully masked rows give 0, not NaN); the guard's Equal/Not/Cast/ReduceMax/Cast/Not
    chain over the scores becomes ReduceMax + ReduceSum and three nodes on the [B, H, S, 1] results,
    the full-size zero tensor a scalar; the outputs are the same bits with the pass off. In the
    symbolic graph (no shape specialization) too."""
    model = TinyAttention(causal)
    batch = _batch(None if causal else _padding_mask())
    expected_loss, expected_attended, expected_grads = _reference(model, batch)
    results = {on: _step(model, batch, on, static) for on in (False, True)}
    for on, (_, loss, attended, grads) in results.items():
        _assert_close(grads, expected_grads)
        np.testing.assert_allclose(loss.item(), expected_loss.item(), rtol=LOSS_BOUND)
        expected_numpy = expected_attended.detach().numpy()
        np.testing.assert_allclose(attended.numpy(), expected_numpy, rtol=ATTENDED_BOUND,
                                   atol=ATTENDED_BOUND * float(np.abs(expected_numpy).max()))
    if not causal:
        assert (results[True][2][2, [0, 3]] == 0).all()
    np.testing.assert_array_equal(results[True][2].numpy(), results[False][2].numpy())
    on, off = results[True][0], results[False][0]
    assert _count(off, "Not") - _count(on, "Not") == 2
    assert _count(off, "Cast") - _count(on, "Cast") == 2
    assert _count(on, "ReduceSum") - _count(off, "ReduceSum") == 1 and _count(on, "And") - _count(off, "And") == 1
    assert _count(on, "Where") == _count(off, "Where")
    # one node fewer in the guard, and the full-size zero tensor it no longer reads pruned (drop_dead_nodes): its
    # Expand, and in the symbolic graph the two nodes that compute its shape
    assert len(off._graphs.gradient.graph.node) - len(on._graphs.gradient.graph.node) == (2 if static else 4)
    assert not any(n.op_type == "Expand" and n.name.startswith("node_full_like") for n in on._graphs.gradient.graph.node)
    if static:
        scores_shaped = {t: [i.name for i in t._graphs.gradient.graph.initializer
                             if list(i.dims) == [BATCH, HEADS, SEQ, SEQ]] for t in (on, off)}
        assert len(scores_shaped[off]) == 1 and not scores_shaped[on]  # the zeros_like(out) constant is gone


def test_nan_and_inf_rows_match_pytorch():
    """Rows of the scores holding NaN stay NaN as in torch (``x == -inf`` is false at NaN, so torch
    keeps the softmax's NaN), also where all other entries are -inf (ONNX Runtime's ReduceMax skips
    NaN: the sum tells); a row with +inf is not masked either; all -inf rows give 0. The pass's
    outputs and gradients are the same bits as without it."""
    mask = _padding_mask()
    mask[0, :, 1, :] = float("-inf")
    mask[0, :, 1, 2] = float("nan")  # NaN among -inf
    mask[0, :, 4, 3] = float("nan")  # NaN among finite
    mask[1, :, 2, 0] = float("inf")
    model, batch = TinyAttention(causal=False), _batch(mask)
    _, expected = model(*batch)
    expected = expected.detach().numpy()
    results = {on: _step(model, batch, on) for on in (False, True)}
    attended = results[True][2].numpy()
    np.testing.assert_array_equal(np.isnan(attended), np.isnan(expected))
    assert np.isnan(attended[0, 1]).all() and np.isnan(attended[0, 4]).all() and (attended[2, [0, 3]] == 0).all()
    finite = ~np.isnan(expected)
    bound = 2 * ATTENDED_BOUND  # float32 on both sides
    np.testing.assert_allclose(attended[finite], expected[finite], rtol=bound,
                               atol=bound * float(np.abs(expected[finite]).max()))
    np.testing.assert_array_equal(attended, results[False][2].numpy())
    for name, grad in results[True][3].items():
        np.testing.assert_array_equal(grad, results[False][3][name])


def test_pass_off_keeps_the_decomposition():
    """With the pass off the graph is the exporter's (the guard chain as torchlib spells it); the pass
    run on that graph rewrites one guard and gives the graph the trainer builds with it on. (Without
    ``activation_recompute``, which runs after it and would copy the guard's ``Where`` into the
    backward: the guard then has two readers, and the pass leaves a shared guard alone.)"""
    model, batch = TinyAttention(causal=False), _batch(_padding_mask())
    off, on = (_step(model, batch, flag, activation_recompute=False)[0] for flag in (False, True))
    assert _ops(off) == ["Equal", "Not", "Cast", "ReduceMax", "Cast", "Not", "Where", *_ops(off)[7:]]
    assert not any("safe_softmax" in n.name for n in off._graphs.gradient.graph.node)
    rewritten = copy.deepcopy(off._graphs.gradient)
    assert passes.apply_joint_passes(rewritten, {"safe_softmax": True}) == {"safe_softmax": 1}
    assert [n.op_type for n in rewritten.graph.node] == [n.op_type for n in on._graphs.gradient.graph.node]
    assert softmax.safe_softmax(rewritten) == 0  # nothing left to match


def test_plain_softmax_is_left_alone():
    """``torch.softmax`` has no guard: nothing to rewrite."""
    class Plain(TinyAttention):
        def forward(self, ids, mask, labels):
            x = self.embed(ids)
            scores = torch.softmax(x @ x.transpose(-1, -2) + mask[:, 0], dim=-1)
            logits = self.head(scores @ x)
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), scores @ x

    trainer = _step(Plain(causal=False), _batch(), True)[0]
    assert not any("safe_softmax" in n.name for n in trainer._graphs.gradient.graph.node)


def test_safe_softmax_applies_to_hugging_face_gpt2():
    """HF GPT-2's sdpa attention has one guard per layer; gradients with the pass equal those without."""
    model, desc = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding
    results = {}
    for on in (False, True):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph_optimizations": {"safe_softmax": on},
                                      "graph": {"gradient_source": "torch"}})
        loss, logits = trainer.train_step(ids, attention_mask, ids)
        results[on] = (trainer, logits.numpy().copy(), {w: g.numpy().copy() for w, g in trainer._engine.grads.items()})
    counts = passes.apply_joint_passes(copy.deepcopy(results[False][0]._graphs.gradient), {"safe_softmax": True})
    if counts["safe_softmax"] == 0:
        import transformers  # present: tiny_gpt2 skips without it

        pytest.skip(f"transformers {transformers.__version__}'s GPT-2 attention has no safe-softmax guard here")
    assert counts == {"safe_softmax": model.config.n_layer}
    np.testing.assert_array_equal(results[True][1], results[False][1])
    for name, grad in results[True][2].items():
        np.testing.assert_array_equal(grad, results[False][2][name])


def _half_guard_model(elem_type: int) -> onnx.ModelProto:
    """torchlib's guard over half-precision scores as a half-precision attention traces it: the
    comparison with ``-inf`` on a float32 cast of the scores (torch computes it in float32)."""
    from onnx import TensorProto, helper, numpy_helper

    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], axis=-1),
        helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
        helper.make_node("Equal", ["x32", "minus_inf"], ["eq"]),
        helper.make_node("Not", ["eq"], ["ne"]),
        helper.make_node("Cast", ["ne"], ["ne64"], to=TensorProto.INT64),
        helper.make_node("ReduceMax", ["ne64", "axes"], ["any64"], keepdims=1),
        helper.make_node("Cast", ["any64"], ["any"], to=TensorProto.BOOL),
        helper.make_node("Not", ["any"], ["all"]),
        helper.make_node("Where", ["all", "zero", "p"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(0, dtype), "zero")]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("x", elem_type, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", elem_type, [2, 3, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_guard_of_half_precision_scores_is_rewritten(dtype):
    """A half-precision attention's guard compares a float32 cast of the scores with ``-inf``: the
    pass matches through that cast (exact: -inf and NaN survive it). float16 reductions read the scores
    themselves, and the outputs are the same bits as the unrewritten graph's on ONNX Runtime's CPU,
    fully masked rows 0 and a NaN row NaN. bfloat16 reductions read a float32 copy (ONNX Runtime's CUDA
    provider has no bfloat16 ReduceMax, and its CPU provider no bfloat16 kernels to run here)."""
    import onnxruntime as ort
    from onnx import TensorProto

    elem_type = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.BFLOAT16
    model = _half_guard_model(elem_type)
    rewritten = copy.deepcopy(model)
    assert softmax.safe_softmax(rewritten) == 1
    nodes = {n.op_type: n for n in rewritten.graph.node}
    assert "Not" not in nodes and [n.op_type for n in rewritten.graph.node].count("Cast") == (dtype == "bfloat16")
    reduced = nodes["ReduceMax"].input[0]
    assert reduced == ("x" if dtype == "float16" else nodes["Cast"].output[0])
    if dtype == "bfloat16":
        return
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float16)
    x[0, 1] = -np.inf
    x[1, 2, 0] = np.nan
    outputs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
               for m in (model, rewritten)]
    np.testing.assert_array_equal(outputs[1], outputs[0])
    assert (outputs[1][0, 1] == 0).all() and np.isnan(outputs[1][1, 2]).all()

"""The ``activation_recompute`` and ``transposed_products`` joint-graph passes
(``ort_trainer/graph/passes/recompute.py``): gradients against float64 PyTorch, the forward keeping
one tensor per GELU, ONNX Runtime keeping the copies apart, and products with their transposes
folded computing what the graph computed before."""

import copy
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

pytest.importorskip("onnxscript", reason="the 'torch' gradient source exports with onnxscript")

from ort_trainer import ORTTrainer, kernels  # noqa: E402
from ort_trainer.graph.names import LOSS_SCALE_INPUT  # noqa: E402
from ort_trainer.graph.passes import recompute  # noqa: E402
from ort_trainer.optim import SGDConfig  # noqa: E402

from test_gelu_pass import ACTIVATIONS, DESC, WIDTH, Block, _assert_close, _batch, _reference  # noqa: E402
from tolerances import FLOAT32  # noqa: E402

PASSES = ("activation_recompute", "transposed_products")


def _trainer(model, batch, on, **passes):
    options = {"graph": {"gradient_source": "torch"},
               "graph_optimizations": {**{name: on for name in PASSES}, **passes}}
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0), options=options)
    loss = trainer.train_step(*batch)
    return trainer, float(loss), {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}


def _forward_values_read_by_backward(model: onnx.ModelProto) -> set[str]:
    """Values the forward computes (nodes before the loss scale's first reader) that the backward reads."""
    nodes = list(model.graph.node)
    seed = next(i for i, n in enumerate(nodes) if LOSS_SCALE_INPUT in n.input)
    forward = {o for n in nodes[:seed] for o in n.output if n.op_type != "Constant"}
    return {name for n in nodes[seed:] for name in n.input if name in forward}


@pytest.mark.parametrize("name", ["new_gelu", "gelu", "erf_gelu"])
def test_gradients_match_float64_and_the_forward_keeps_the_input_alone(name):
    """tanh and erf GELUs: with the passes, the gradients of float64 PyTorch (the bound of
    ``test_gelu_pass``: the copies are the forward's operators on the same values, bit-equal to
    them, and a Gemm with a transposed operand sums the same terms), the same loss bit for bit,
    and the backward reads one forward value of the GELU where it read three (a, Φ or x², s, and
    the output). Without ``transposed_products`` it read each weight's transpose from the forward too."""
    model, batch = Block(ACTIVATIONS[name]), _batch()
    expected = _reference(model, batch)
    _, loss_off, grads_off = _trainer(model, batch, on=False)
    on, loss_on, grads_on = _trainer(model, batch, on=True)
    _assert_close(grads_off, expected)
    _assert_close(grads_on, expected)
    assert loss_on == loss_off
    kept, _, _ = _trainer(model, batch, on=True, activation_recompute=False)
    read_off = _forward_values_read_by_backward(kept._graphs.gradient)
    read_on = _forward_values_read_by_backward(on._graphs.gradient)
    assert len(read_off) - len(read_on) == 2, (read_off, read_on)
    nodes = on._graphs.gradient.graph.node
    assert any(n.name.endswith("/recompute") for n in nodes)
    # each copy's value (and the alias its region reads) has its original's type and shape, which later passes
    # (gelu_forward_kernel) need to rewrite it
    infos = {info.name: info.type for info in on._graphs.gradient.graph.value_info}
    copied = [o for n in nodes if n.name.endswith("/recompute") for o in n.output]
    assert copied and all(infos.get(o) == infos[o.removesuffix("/recompute")] for o in copied
                          if o.removesuffix("/recompute") in infos), copied
    transposed = {o for n in nodes if n.op_type == "Transpose" for o in n.output}
    assert not [n for n in nodes if n.op_type in ("MatMul", "Gemm") and transposed & set(n.input)]


class _SummedRows(Block):
    """The GELU's output summed to one value per row before the loss (no second Linear)."""

    def __init__(self, activation):
        super().__init__(activation)
        del self.down

    def forward(self, x, y):
        return ((self.activation(3.0 * self.up(x)).sum(1) - y[:, 0]) ** 2).mean()


def test_a_region_whose_backward_reader_reads_a_scalar_gradient_is_recomputed():
    """The copies wait for a value their first backward reader reads; here a scalar (the gradient of the rows'
    sums, broadcast), which ``_alias_after`` sliced along axis 0: ONNX Runtime refused the graph when the session
    was made ("Unexpected axis value: 0. Expected range [0, 0)"). It slices the value flattened; the gradients
    equal float64 PyTorch's (test_gelu_pass's bound) and the loss is the one without the pass, bit for bit."""
    model, batch = _SummedRows(ACTIVATIONS["new_gelu"]), _batch()
    expected = _reference(model, batch)
    _, loss_off, grads_off = _trainer(model, batch, on=False)
    on, loss_on, grads_on = _trainer(model, batch, on=True)
    _assert_close(grads_on, expected)
    assert loss_on == loss_off
    assert any(n.name.endswith("/recompute") for n in on._graphs.gradient.graph.node)


@pytest.mark.parametrize("name", ["new_gelu", "gelu"])
def test_onnxruntime_keeps_the_copies_apart(name, tmp_path):
    """ONNX Runtime's optimizers (its common subexpression elimination among them) leave two of the
    GELU's transcendental node, the forward's and the backward's copy."""
    model, batch = Block(ACTIVATIONS[name]), _batch()
    trainer, _, _ = _trainer(model, batch, on=True)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(trainer._graphs.gradient.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    op = "Sigmoid" if name == "new_gelu" else "Erf"
    assert sum(n.op_type == op for n in optimized.graph.node) == 2


def test_hugging_face_gpt2_losses_and_gradients_unchanged():
    """A 2-layer Hugging Face GPT-2: the passes recompute each layer's GELU and attention
    probabilities and fold its transposes; its loss is the same bit for bit and its gradients equal
    to float32 rounding: only the products' kernels differ (a Gemm with a transposed operand for
    ONNX Runtime's FusedMatMul), each a sum of at most 64 terms in any order, 2 · 64u apart by
    Higham's bound, carried through 2 layers (×4)."""
    from models import tiny_gpt2

    model, desc = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    results = {}
    for on in (False, True):
        options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {name: on for name in PASSES}}
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
        loss, _ = trainer.train_step(ids, torch.ones_like(ids), ids)
        results[on] = (trainer, loss.item(), {w: g.numpy().copy() for w, g in trainer._engine.grads.items()})
    assert results[True][1] == results[False][1]
    nodes = results[True][0]._graphs.gradient.graph.node
    assert sum(n.name.endswith("/recompute") and n.op_type == "Sigmoid" for n in nodes) == 2
    assert sum(n.name.endswith("/recompute") and n.op_type == "Softmax" for n in nodes) == 2  # attention
    _assert_close(results[True][2], results[False][2], rtol=4 * 2 * 64 * FLOAT32)


class Attention(torch.nn.Module):
    """Two heads of self-attention over padded sequences (keys masked out), a projection and a
    mean-squared error: ``torch``'s fused attention (decomposed into the math form at export) or
    the softmax written out (scale by division, additive mask)."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask, y):
        batch, seq, _ = x.shape
        q, k, v = (t.reshape(batch, seq, 2, WIDTH // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        keep = mask[:, None, None, :] > 0
        if self.fused:
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // 2)
            heads = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
        return F.mse_loss(self.out(heads.transpose(1, 2).reshape(batch, seq, WIDTH)), y)


ATTENTION_DESC = {"inputs": [("x", [3, 6, WIDTH]), ("mask", [3, 6]), ("y", [3, 6, WIDTH])],
                  "outputs": [("loss", [], True)]}


@pytest.mark.parametrize("fused, kernel", [(True, False), (False, False), (True, True)],
                         ids=["sdpa", "written-out", "sdpa-SafeSoftmax-kernel"])
def test_attention_probabilities_recomputed_in_the_backward(fused, kernel, tmp_path):
    """The backward recomputes each attention's probabilities from q and k (which it keeps for their
    own gradients) instead of reading the forward's [batch, heads, seq, seq] tensor: gradients of
    float64 PyTorch with the pass and without (the bound of ``test_gelu_pass``: the copy computes
    the forward's operators on the same values, bit-equal to them), the same loss bit for bit, and
    ONNX Runtime's optimizers keep the two softmaxes apart. With ``fused_safe_softmax`` the softmax
    copied is ort_trainer's ``BiasSafeSoftmax`` kernel, which adds the mask."""
    gen = torch.Generator().manual_seed(0)
    model = Attention(fused)
    mask = torch.ones(3, 6)
    mask[0, 4:] = 0  # padded keys: the mask is added, and the safe softmax guards fully masked rows
    batch = (torch.randn(3, 6, WIDTH, generator=gen), mask, torch.randn(3, 6, WIDTH, generator=gen))
    double = copy.deepcopy(model).double()
    double(batch[0].double(), batch[1], batch[2].double()).backward()
    expected = {name: p.grad.numpy() for name, p in double.named_parameters()}
    results = {}
    for on in (False, True):
        options = {"graph": {"gradient_source": "torch"},
                   "graph_optimizations": {**{name: on for name in PASSES}, "fused_safe_softmax": kernel}}
        trainer = ORTTrainer(copy.deepcopy(model), ATTENTION_DESC, SGDConfig(lr=0.0), options=options)
        loss = float(trainer.train_step(*batch))
        grads = {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}
        _assert_close(grads, expected)
        gradient = trainer._graphs.gradient
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in gradient.graph.value_info}
        probabilities = {n for n in _forward_values_read_by_backward(gradient) if shapes.get(n) in ([3, 2, 6, 6],
                                                                                                     [6, 6, 6])}
        results[on] = loss, probabilities, gradient
    assert results[True][0] == results[False][0]
    assert results[False][1] and not results[True][1], (results[False][1], results[True][1])
    gradient = results[True][2]
    softmax = "BiasSafeSoftmax" if kernel else "Softmax"  # (the kernel adds the mask)
    assert sum(n.op_type == softmax and n.name.endswith("/recompute") for n in gradient.graph.node) == 1
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    if kernel:
        kernels.register(options)
    ort.InferenceSession(gradient.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert sum(n.op_type == softmax for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node) == 2


def test_a_softmax_of_a_product_with_a_weight_is_left_alone():
    """A softmax over ``x @ W`` (a classifier's probabilities, read by the loss): recomputing it would
    run the weight's product again, so only an attention's ``q·kᵀ`` (two activations) is recomputed."""
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(WIDTH, WIDTH)  # so that the backward reads the weight too
            self.weight = torch.nn.Parameter(torch.randn(WIDTH, 5))

        def forward(self, x, y):
            return F.mse_loss(torch.softmax(self.up(x) @ self.weight, dim=-1), y)

    desc = {"inputs": [("x", [3, 6, WIDTH]), ("y", [3, 6, 5])], "outputs": [("loss", [], True)]}
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(3, 6, WIDTH, generator=gen), torch.rand(3, 6, 5, generator=gen))
    trainer = ORTTrainer(Head(), desc, SGDConfig(lr=0.0), options={"graph": {"gradient_source": "torch"}})
    trainer.train_step(*batch)
    assert not [n for n in trainer._graphs.gradient.graph.node if n.name.endswith("/recompute")]


def _products_model() -> onnx.ModelProto:
    """MatMul(Aᵀ, B), MatMul(A, Bᵀ) with that Transpose also read elsewhere, Gemm(A, Cᵀ, bias) with
    transB=1 already, and a batched MatMul of a transposed 3-D tensor (left alone)."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
        helper.make_node("MatMul", ["at", "b"], ["p1"]),
        helper.make_node("Transpose", ["b"], ["bt"], perm=[1, 0]),
        helper.make_node("MatMul", ["a", "bt"], ["p2"]),
        helper.make_node("Neg", ["bt"], ["bt_neg"]),
        helper.make_node("Transpose", ["c"], ["ct"], perm=[1, 0]),
        helper.make_node("Gemm", ["a", "ct", "bias"], ["p3"], transB=1),
        helper.make_node("Transpose", ["d"], ["dt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["dt", "e"], ["p4"]),
    ]
    inputs = [helper.make_tensor_value_info(n, f, s) for n, s in
              [("a", [6, 6]), ("b", [6, 6]), ("c", [6, 6]), ("bias", [6]), ("d", [2, 5, 3]), ("e", [2, 5, 4])]]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("p1", "p2", "bt_neg", "p3", "p4")]
    graph = helper.make_graph(nodes, "products", inputs, outputs, value_info=[
        helper.make_tensor_value_info(n, f, [6, 6]) for n in ("at", "bt", "ct")] + [
        helper.make_tensor_value_info("dt", f, [2, 3, 5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_transposed_products_unit():
    """Three products become Gemms reading the untransposed tensors (Gemm's transB=1 and a
    Transpose of C: transB=0), the Transposes nothing else reads go, the batched product stays; the
    outputs equal the original graph's to float32 rounding (sums of 6 terms: 6u of their magnitude,
    checked at 2 · 6u)."""
    model = _products_model()
    rewritten = copy.deepcopy(model)
    assert recompute.transposed_products(rewritten) == 3
    nodes = {n.output[0]: n for n in rewritten.graph.node}
    assert [nodes[p].op_type for p in ("p1", "p2", "p3", "p4")] == ["Gemm", "Gemm", "Gemm", "MatMul"]
    attrs = {p: {a.name: a.i for a in nodes[p].attribute} for p in ("p1", "p2", "p3")}
    assert attrs == {"p1": {"transA": 1}, "p2": {"transB": 1}, "p3": {}}
    assert [n.output[0] for n in rewritten.graph.node if n.op_type == "Transpose"] == ["bt", "dt"]
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (model, rewritten)]
    for before, after in zip(*run):
        np.testing.assert_allclose(after, before, rtol=2 * 6 * FLOAT32, atol=2 * 6 * FLOAT32 * np.abs(before).max())

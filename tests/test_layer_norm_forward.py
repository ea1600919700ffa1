"""``graph_optimizations.fused_layer_norm`` (``graph/passes/layer_norm_forward.py``): a float32 LayerNorm whose
output only half-precision products read, as one ``LayerNormToFloat16`` / ``LayerNormToBFloat16`` kernel node that
writes the half output itself; one whose float32 output others read too, as ``LayerNormWithFloat16`` /
``LayerNormWithBFloat16``, writing both.

Checked on a tiny Hugging Face GPT-2 (two pre-norm layers) in float16 mixed precision on the CPU, and in float16 and
bfloat16 on CUDA (``make gpu-check``): its five LayerNorms become kernel nodes, the loss and every gradient within
the half dtype's bound of float64 PyTorch and of the graph without the switch (the kernel's statistics are summed in
another order than ONNX Runtime's, a float32 rounding apart before the half one). A tiny BERT (post-norm) likewise,
for the LayerNormWith* nodes that write the float32 output as well. The kernel's values: ``test_kernels.py``.
"""

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import _runtime
from ort_trainer.graph.passes import layer_norm_forward
from ort_trainer.kernels import DOMAIN

from models import VOCAB, tiny_bert_mlm
from test_half_loss import _gpt2_case, _relative
from test_layer_norm_sums import _check_float64, _mixed_step
from tolerances import check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# mixed precision against float64 and on against off, relative to each tensor's norm: test_aligned_products.py's
# bound (~20 roundings of the half dtype); bfloat16's unit roundoff is 8x float16's
BOUNDS = {"float16": 1e-2, "bfloat16": 8e-2}


@pytest.mark.parametrize("precision, device, sums", [
    ("float16", "cpu", False), ("float16", "cpu", True), pytest.param("float16", "cuda", True, marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", False, marks=pytest.mark.cuda)])
def test_the_layer_norms_write_their_half_output_within_rounding(precision, device, sums):
    """Five LayerNorm kernel nodes (every layer's two and the final one, whose output the head's half product
    reads), no LayerNormalization left: the first reads the embeddings' float32 sum, the four others compute the
    residual stream's sum before them (an Add of a Cast, or with ``sums``, fused_gradient_sums' AddHalf), which no
    other node writes any more; the loss and every gradient within BOUNDS of float64 and of the graph without the
    switch."""
    model, desc, batch, _ = _gpt2_case()
    loss_off, grads_off, _ = _mixed_step(model, desc, batch, precision, device,
                                         {"fused_gradient_sums": sums, "fused_layer_norm": False})
    loss_on, grads_on, graph = _mixed_step(model, desc, batch, precision, device,
                                           {"fused_gradient_sums": sums, "fused_layer_norm": True})
    op = "LayerNormToFloat16" if precision == "float16" else "LayerNormToBFloat16"
    norms = [n for n in graph.node if n.domain == DOMAIN and n.op_type in (op, f"Add{op}")]
    assert [n.op_type for n in norms] == [op] + [f"Add{op}"] * 4
    producers = {o: n for n in graph.node for o in n.output}
    for norm in norms[1:]:  # (the sum, its last output, read on: by the next sum's node and the backward)
        assert producers[norm.output[-1]] is norm and [r for r in graph.node if norm.output[-1] in r.input]
        assert producers[norm.input[0]].op_type != "Cast" and producers[norm.input[1]].op_type != "Cast"
    assert not [n for n in graph.node if n.op_type == "LayerNormalization"]
    _check_against_off(loss_on, grads_on, loss_off, grads_off, BOUNDS[precision])
    _check_float64(model, batch, loss_on, grads_on, BOUNDS[precision])


def _check_against_off(loss_on: float, grads_on: dict, loss_off: float, grads_off: dict, bound: float) -> None:
    """The loss and every gradient with the switch within ``bound`` of those without it."""
    check(abs(loss_on - loss_off) / abs(loss_off), bound, "loss against off")
    for name, grad in grads_off.items():
        check(_relative(grads_on[name], grad), bound, (name, "against off"))


def _bert_case():
    """A tiny Hugging Face BERT (post-norm: the residual stream reads each LayerNorm's float32 output, the next
    sublayer's products its half cast) and a masked-LM batch."""
    model, desc = tiny_bert_mlm()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 8), generator=gen)
    labels = torch.where(torch.rand(3, 8, generator=gen) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]  # (a labelled word in every row)
    return model, desc, (ids, torch.ones_like(ids), labels)


@pytest.mark.parametrize("precision, device", [
    ("float16", "cpu"), pytest.param("float16", "cuda", marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda)])
def test_post_norm_layer_norms_write_both_outputs_within_rounding(precision, device):
    """BERT: the embeddings' LayerNorm and the three that a next layer's products read become LayerNormWith* nodes
    (float32 output for the residual, half for the products, no Cast left of their output); the last layer's and
    the head's, which half products alone read, LayerNormTo*; each layer's, after a sublayer, computes the residual
    sum before it too (AddLayerNorm*); the loss and every gradient within BOUNDS of float64 and of the graph without
    the switch."""
    model, desc, batch = _bert_case()
    loss_off, grads_off, _ = _mixed_step(model, desc, batch, precision, device, {"fused_layer_norm": False})
    loss_on, grads_on, graph = _mixed_step(model, desc, batch, precision, device, {"fused_layer_norm": True})
    dtype = "Float16" if precision == "float16" else "BFloat16"
    kinds = [n.op_type for n in graph.node if n.domain == DOMAIN and "LayerNorm" in n.op_type
             and "LayerNormGrad" not in n.op_type]
    assert sorted(kinds) == [f"AddLayerNormTo{dtype}"] + [f"AddLayerNormWith{dtype}"] * 3 + [
        f"LayerNormTo{dtype}", f"LayerNormWith{dtype}"], kinds
    assert not [n for n in graph.node if n.op_type == "LayerNormalization"]
    for node in graph.node:
        if "LayerNormWith" in node.op_type:  # its float32 output read on, by no Cast
            readers = [r for r in graph.node if node.output[0] in r.input]
            assert readers and not [r for r in readers if r.op_type == "Cast"], node.name
    _check_against_off(loss_on, grads_on, loss_off, grads_off, BOUNDS[precision])
    # against float64: but attention's query and key weights, whose gradients through this tiny model's near-uniform
    # softmax are small against the half roundings before them (5e-2 in float16 on or off; the key bias's is zero)
    _check_float64(model, batch, loss_on, grads_on, BOUNDS[precision], unchecked=(".query.", ".key."))


def _model(nodes, outputs, x_shape=(4, 8), scale_shape=(8,)):
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", f32, list(x_shape)),
                                            helper.make_tensor_value_info("g", f32, list(scale_shape)),
                                            helper.make_tensor_value_info("b", f32, list(scale_shape))],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_what_the_kernel_cannot_take_is_left_alone():
    """A LayerNorm over two axes is left; the plain one (through a Reshape) becomes the kernel node and a Reshape of
    its half output, the cast's name kept; one whose float32 output another node reads too, the node writing both
    outputs (the float32 one under its name, the half one under the cast's)."""
    f16 = TensorProto.FLOAT16
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [32, 1])
    ln = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "m", "r"], axis=-1)
    shared = _model([ln, helper.make_node("Cast", ["y"], ["h"], to=f16), helper.make_node("Neg", ["y"], ["n"])],
                    [("h", f16, [4, 8]), ("n", TensorProto.FLOAT, [4, 8]), ("m", TensorProto.FLOAT, [4, 1])])
    two_axes = _model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=1),
                       helper.make_node("Cast", ["y"], ["h"], to=f16)], [("h", f16, [2, 4, 8])],
                      x_shape=(2, 4, 8), scale_shape=(4, 8))
    plain = _model([ln, helper.make_node("Constant", [], ["s"], value=shape),
                    helper.make_node("Reshape", ["y", "s"], ["v"]), helper.make_node("Cast", ["v"], ["h"], to=f16)],
                   [("h", f16, [32, 1]), ("m", TensorProto.FLOAT, [4, 1]), ("r", TensorProto.FLOAT, [4, 1])])
    assert layer_norm_forward.fused_layer_norm(two_axes) == 0
    assert layer_norm_forward.fused_layer_norm(shared) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in shared.graph.node] == [
        ("LayerNormWithFloat16", ["x", "g", "b"], ["y", "m", "r", "h"]), ("Neg", ["y"], ["n"])]
    assert layer_norm_forward.fused_layer_norm(plain) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in plain.graph.node] == [
        ("LayerNormToFloat16", ["x", "g", "b"], ["y/half", "m", "r"]), ("Constant", [], ["s"]),
        ("Reshape", ["y/half", "s"], ["h"])]
    onnx.checker.check_model(plain)


def test_a_residual_sum_before_the_layer_norm_is_computed_by_its_node():
    """``LayerNorm(r + Cast(h))`` (r float32, h float16), whose sum another node reads too: one
    ``AddLayerNormToFloat16(r, h, g, b)`` where the sum was, writing the sum under its name (the Add and the Cast
    gone); the same from an ``AddHalf(r, h)``. Left to the plain kernel: a sum whose cast another node reads, and
    one made before the LayerNorm's weight."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16

    def model(sum_nodes, weight_after=False, extra=()):
        ln = helper.make_node("LayerNormalization", ["s", "w", "b"], ["y", "m", "r2"], axis=-1)
        weight = [helper.make_node("Identity", ["g"], ["w"])]
        nodes = (sum_nodes + weight if weight_after else weight + sum_nodes) + [
            ln, helper.make_node("Cast", ["y"], ["half"], to=f16), helper.make_node("Neg", ["s"], ["n"]), *extra]
        graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", f32, [4, 8]),
                                                helper.make_tensor_value_info("h", f16, [4, 8]),
                                                helper.make_tensor_value_info("g", f32, [8]),
                                                helper.make_tensor_value_info("b", f32, [8])],
                                  [helper.make_tensor_value_info(*o) for o in [
                                      ("half", f16, [4, 8]), ("n", f32, [4, 8]), ("m", f32, [4, 1])]],
                                  value_info=[helper.make_tensor_value_info("s", f32, [4, 8]),
                                              helper.make_tensor_value_info("w", f32, [8]),
                                              helper.make_tensor_value_info("c", f32, [4, 8])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    cast_add = [helper.make_node("Cast", ["h"], ["c"], to=f32), helper.make_node("Add", ["x", "c"], ["s"])]
    add_half = [helper.make_node("AddHalf", ["x", "h"], ["s"], domain=DOMAIN)]
    fused = ("AddLayerNormToFloat16", ["x", "h", "w", "b"], ["half", "m", "r2", "s"])
    for sums in (cast_add, add_half):
        graph = model(sums)
        assert layer_norm_forward.fused_layer_norm(graph) == 1
        assert [(n.op_type, list(n.input), list(n.output)) for n in graph.graph.node] == [
            ("Identity", ["g"], ["w"]), fused, ("Neg", ["s"], ["n"])]
    shared_cast = model(cast_add, extra=[helper.make_node("Neg", ["c"], ["n2"])])
    late_weight = model(add_half, weight_after=True)
    for graph in (shared_cast, late_weight):
        assert layer_norm_forward.fused_layer_norm(graph) == 1
        assert [n.op_type for n in graph.graph.node if "LayerNorm" in n.op_type] == ["LayerNormToFloat16"]

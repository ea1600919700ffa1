"""``graph_optimizations.causal_attention`` (``graph/passes/causal_attention.py``): a fused attention whose mask holds
the causal triangle computes it in torch's kernel (attribute ``causal`` 1) and adds only the mask's other terms as
a bias.

Checked: the tiny Hugging Face GPT-2 with a padded sequence (its mask the triangle and-ed with the padding), in
float32 and float16 on the CPU (and float16 / bfloat16 on CUDA under ``make gpu-check``), packed and not: the loss
and every gradient bit for bit those with the switch off (every score masked before is masked now, by the kernel,
and no other: the kernels add no bias where it was 0 and skip whole blocks only where every score was -inf), and
within rounding of float64 PyTorch; a mask that is the triangle alone needs no bias at all; and the rewrite leaves
a mask alone where it is not the triangle, masks to a finite value, or has keys of another length than queries.

``graph_optimizations.torch_attention_choice`` (``graph/passes/attention_backend.py``) too: on CUDA the kernel torch
picks (``make gpu-check``), within rounding of float64; on the CPU, where the nodes run torch's CPU flash attention
either way, bit for bit the switch off's.
"""

import copy

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.passes.causal_attention import causal_attention
from ort_trainer.kernels import TORCH_OPS_DOMAIN, _compilers
from ort_trainer.optim import SGDConfig

from test_fused_attention import BOUNDS, OPTIONS, _Attention, _device_step
from test_half_loss import _float64, _gpt2_case, _relative
from tolerances import check

pytestmark = [pytest.mark.skipif(not _runtime.has_onnxscript(),
                                 reason="the 'torch' gradient source exports with onnxscript"),
              pytest.mark.skipif(_compilers()[1] is None,
                                 reason="builds a library against torch: needs a C++ compiler")]


def _attention_nodes(trainer) -> list[tuple[str, int]]:
    """(op type, causal attribute) of each of torch's attention nodes in the training graph."""
    return [(n.op_type, next((a.i for a in n.attribute if a.name == "causal"), 0))
            for n in trainer._graphs.gradient.graph.node if n.domain == TORCH_OPS_DOMAIN and "Attention" in n.op_type]


def _padded_gpt2_case():
    """The tiny GPT-2 with the second sequence's last three tokens padded (mask 0, labels ignored)."""
    model, desc, (ids, mask, labels), _ = _gpt2_case()
    mask, labels = mask.clone(), labels.clone()
    mask[1, -3:], labels[1, -3:] = 0, -100
    return model, desc, (ids, mask, labels)


@pytest.mark.parametrize("precision, device", [
    ("float32", "cpu"), ("float16", "cpu"), pytest.param("float16", "cuda", marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_padded_gpt2_bit_for_bit_with_the_triangle_in_the_kernel(precision, device, packed, record_property):
    """With the switch, each layer's attention nodes are causal and add only the padding (no And with the
    triangle left); the loss and every gradient bit for bit the switch off's on the CPU, and within the bound of
    float64 PyTorch."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    model, desc, batch = _padded_gpt2_case()
    results = {}
    for causal in (False, True):
        trainer, loss, grads = _device_step(model, desc, batch, precision, device, {
            "fused_attention": True, "packed_attention": packed, "causal_attention": causal})
        results[causal] = (loss, grads)
        prefix = "Packed" if packed else ""
        assert _attention_nodes(trainer) == ([(f"{prefix}BiasAttention", int(causal))] * 2 +
                                             [(f"{prefix}BiasAttentionGrad", int(causal))] * 2)
        graph = trainer._graphs.gradient.graph
        biases = {n.input[-1 if "Grad" not in n.op_type else -3] for n in graph.node if n.domain == TORCH_OPS_DOMAIN}
        producers = {n.output[0]: n for n in graph.node}
        # on, the bias of the padding alone: a Where of one term that no constant is
        terms = {producers[name].input[0] for name in biases}
        assert all(name.endswith("/causal_rest") for name in biases) == causal, biases
        assert all((producers[t].op_type != "And") == causal for t in terms), terms
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    same = loss_on == loss_off and all(np.array_equal(grads_on[name], grad) for name, grad in grads_off.items())
    record_property("bit_for_bit", same)
    if device == "cpu":  # (on CUDA the memory-efficient kernel may sum the kept blocks alike too: recorded)
        assert same, (loss_on, loss_off)
    bound = BOUNDS[precision]  # (test_fused_attention's)
    loss64, grads64 = _float64(model, batch, None)
    check(abs(loss_on - loss64) / abs(loss64), bound, "loss")
    for name, grad in grads64.items():
        check(_relative(grads_on[name].astype(np.float64), grad), bound, name)


def test_a_mask_that_is_the_triangle_alone_needs_no_bias():
    """A boolean tril mask passed to scaled_dot_product_attention: Attention and AttentionGrad, causal, no bias;
    the gradients bit for bit those of the bias."""
    gen = torch.Generator().manual_seed(4)
    batch = tuple(torch.randn(3, 5, 8, generator=gen) for _ in range(3))  # x, y (unread), target
    desc = {"inputs": [("x", [3, 5, 8]), ("y", [3, 5, 8]), ("target", [3, 5, 8])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    model, grads = _Attention("bool"), {}
    for causal in (False, True):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={**OPTIONS, "graph_optimizations": {"fused_attention": True,
                                                                         "causal_attention": causal}})
        trainer.train_step(*batch)
        grads[causal] = {name: grad.numpy() for name, grad in trainer._engine.grads.items()}
        assert _attention_nodes(trainer) == ([("Attention", 1), ("AttentionGrad", 1)] if causal else
                                             [("BiasAttention", 0), ("BiasAttentionGrad", 0)])
    for name, grad in grads[False].items():
        assert np.array_equal(grads[True][name], grad), name


def _graph(triangle: np.ndarray, masked: float, keys: int = 4):
    """BiasAttention and its gradient on a bias Where(And(triangle, padding), 0, masked), q [2, 4, 2, 8]
    (layout 1) and k, v [2, keys, 2, 8]."""
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("And", ["triangle", "padding"], ["mask"]),
             helper.make_node("Where", ["mask", "zero", "masked"], ["bias"]),
             helper.make_node("BiasAttention", ["q", "k", "v", "bias"], ["out", "lse"], domain=TORCH_OPS_DOMAIN,
                              layout=1, scale=0.35, causal=0),
             helper.make_node("BiasAttentionGrad", ["dout", "q", "k", "v", "bias", "out", "lse"], ["dq", "dk", "dv"],
                              domain=TORCH_OPS_DOMAIN, layout=1, scale=0.35, causal=0)]
    inits = [helper.make_tensor("triangle", TensorProto.BOOL, list(triangle.shape), triangle.ravel().tolist()),
             helper.make_tensor("zero", f32, [], [0.0]), helper.make_tensor("masked", f32, [], [masked])]
    inputs = [("q", [2, 4, 2, 8]), ("k", [2, keys, 2, 8]), ("v", [2, keys, 2, 8]), ("dout", [2, 4, 2, 8])]
    model = helper.make_model(helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info(n, f32, s) for n, s in inputs] +
        [helper.make_tensor_value_info("padding", TensorProto.BOOL, [2, 1, 1, keys])],
        [helper.make_tensor_value_info(n, f32, None) for n in ("out", "dq", "dk", "dv")], inits,
        value_info=[helper.make_tensor_value_info("bias", f32, [2, 1, 4, keys])]))
    return model


def test_the_rewrite_takes_only_the_causal_triangle():
    """The triangle and a padding term: the nodes causal and their bias Where(padding, 0, -inf) [2, 1, 1, 4]; an
    upper triangle, a finite masked value, or 6 keys for 4 queries: nothing rewritten."""
    tril = np.tril(np.ones((1, 1, 4, 4), dtype=bool))
    model = _graph(tril, -np.inf)
    assert causal_attention(model) == 2
    nodes = {n.op_type: n for n in model.graph.node}
    old = next(n for n in model.graph.node if n.output[0] == "bias")  # left for drop_dead_nodes
    assert list(old.input) == ["mask", "zero", "masked"]
    rest = [n for n in model.graph.node if n.output[0] == "bias/causal_rest"]
    assert [(n.op_type, list(n.input)) for n in rest] == [("Where", ["padding", "zero", "masked"])]
    for op in ("BiasAttention", "BiasAttentionGrad"):
        assert "bias/causal_rest" in nodes[op].input and {a.name: a.i for a in nodes[op].attribute}["causal"] == 1
    info = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.value_info}
    assert info["bias/causal_rest"] == [2, 1, 1, 4]
    order = [n.output[0] for n in model.graph.node]
    assert order.index("bias/causal_rest") < order.index("out")
    for triangle, masked, keys in [(np.triu(np.ones((1, 1, 4, 4), dtype=bool)), -np.inf, 4),
                                   (tril, -1e4, 4), (np.tril(np.ones((1, 1, 4, 6), dtype=bool)), -np.inf, 6)]:
        assert causal_attention(_graph(triangle, masked, keys)) == 0, (masked, keys)


def _backends(trainer) -> set[int]:
    return {next((a.i for a in n.attribute if a.name == "backend"), 0)
            for n in trainer._graphs.gradient.graph.node if n.domain == TORCH_OPS_DOMAIN and "Attention" in n.op_type}


@pytest.mark.parametrize("precision, device", [
    ("float32", "cpu"), pytest.param("float16", "cuda", marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("causal", [False, True], ids=["bias", "causal"])
def test_torch_attention_choice_within_rounding_of_float64(precision, device, causal, record_property):
    """``torch_attention_choice``: every attention node asks for torch's kernel (attribute backend 1); the padded
    tiny GPT-2's loss and every gradient within the bound of float64 PyTorch, on CUDA with the kernel torch picks for
    the mask the nodes add (cuDNN's or the memory-efficient one; with ``causal_attention`` the padding's bias only).
    On the CPU the nodes run torch's CPU flash attention either way: bit for bit the switch off's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    model, desc, batch = _padded_gpt2_case()
    results = {}
    for choice in (False, True):
        trainer, loss, grads = _device_step(model, desc, batch, precision, device, {
            "fused_attention": True, "packed_attention": True, "causal_attention": causal,
            "torch_attention_choice": choice})
        results[choice] = (loss, grads)
        assert _backends(trainer) == {int(choice)} and len(_attention_nodes(trainer)) == 4
    if device == "cpu":
        assert results[True][0] == results[False][0]
        for name, grad in results[False][1].items():
            assert np.array_equal(results[True][1][name], grad), name
    bound = BOUNDS[precision]
    loss64, grads64 = _float64(model, batch, None)
    loss, grads = results[True]
    errors = {"loss": abs(loss - loss64) / abs(loss64),
              **{name: _relative(grads[name].astype(np.float64), grad) for name, grad in grads64.items()}}
    for name, error in errors.items():
        check(error, bound, name)
    record_property("errors", max(errors.values()))

"""The ``half_precision_attention`` pass (``graph/gradient/attention.py``): under mixed precision,
``scaled_dot_product_attention`` computed in the half dtype instead of torch's math attention,
which upcasts every ``[B, H, S, S]`` tensor to float32.

Checked against float64 PyTorch (the exact function), against the same graph with the pass off
(the math attention's float32 computation), and on the graph: the attention's products are float16.
"""

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph import passes
from ort_trainer.graph.gradient import attention
from ort_trainer.optim import SGDConfig

from models import assert_float32_untouched, tiny_gpt2
from test_safe_softmax_pass import BATCH, DESC, HEADS, SEQ, TinyAttention, _batch, _padding_mask
from tolerances import FLOAT16, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# attention() against torch's own scaled_dot_product_attention, both in float64: the same arithmetic
# in another order (the math attention scales q and k by √scale as attention() does): each output is
# a softmax of sums of ≤ 8 products, then a sum of ≤ 8 products: 32 roundings at most, 32·u64 = 3.6e-15;
# the test holds 1e-13 of the largest output.
FLOAT64_BOUND = 1e-13
# float16 against float64, relative to each tensor's norm: every value of the float16 computation is
# rounded at most once per operation (u16 = 4.9e-4) and its sums are accumulated in float32 (ONNX
# Runtime's float16 MatMul and Softmax); along the longest chain of TinyAttention's gradients (the
# embedding, the q/k/v and head Linear layers, the scores, the softmax and its backward, the attention,
# the loss): ~20 roundings to float16, 20·u16 = 9.8e-3. The same bound as test_mixed_precision.py's
# float16 gradients (1e-2), which it also checks against float64.
HALF_BOUND = 1e-2
# The pass changes which values are float16: with it off, the scores, softmax and attention are float32
# between float16 inputs and outputs. Both are held to HALF_BOUND. Observed (worst tensor, 1 and 2
# threads): with the pass 5.4e-4 (padding mask) / 4.5e-4 (causal), without it 4.7e-4 / 3.9e-4: 18x under; with the
# softmax gradient in float16 too (half_precision_softmax_gradient) 5.3e-4 / 4.5e-4.
SCORES = [BATCH, HEADS, SEQ, SEQ]


def _dtypes(model: onnx.ModelProto) -> dict[str, int]:
    graph = onnx.shape_inference.infer_shapes(model).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    graph = onnx.shape_inference.infer_shapes(model).graph
    return {v.name: len(v.type.tensor_type.shape.dim) for v in [*graph.value_info, *graph.output]}


@pytest.mark.parametrize("case", ["bool-mask", "float-mask", "causal", "scale", "gqa"])
def test_attention_is_torchs_scaled_dot_product_attention(case):
    """In float64, ``attention`` computes what ``F.scaled_dot_product_attention`` does, fully masked
    rows (every key ``-inf`` / ``False``) giving 0, within FLOAT64_BOUND of the largest output."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    kwargs = {}
    if case == "bool-mask":
        mask = torch.rand(2, 1, 6, 6, generator=gen) > 0.3
        mask[1, :, 2] = False  # a fully masked row
        kwargs["attn_mask"] = mask
    elif case == "float-mask":
        kwargs["attn_mask"] = _padding_mask()[1:].double()  # batch 1: queries 0 and 3 see no key
    elif case == "causal":
        kwargs["is_causal"] = True
    elif case == "scale":
        kwargs["scale"] = 0.3
    else:
        k, v = k[:, :2], v[:, :2]
        kwargs["enable_gqa"] = True
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = attention.attention(q, k, v, **kwargs)
    check(float((got - expected).abs().max() / expected.abs().max()), FLOAT64_BOUND, case)
    if case == "bool-mask":
        assert (got[1, :, 2] == 0).all()
    elif case == "float-mask":
        assert (got[1, :, [0, 3]] == 0).all()


def _half_step(model, batch, on: bool):
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0),
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler":
                                                      DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)},
                                  "graph_optimizations": {"half_precision_attention": on}})
    loss, attended = trainer.train_step(*batch)
    return trainer, float(loss), attended.double().numpy(), {w: g.numpy().astype(np.float64)
                                                              for w, g in trainer._engine.grads.items()}


def _float64(model, batch):
    double = copy.deepcopy(model).double()
    ids, mask, labels = batch
    loss, attended = double(ids, mask.double(), labels)
    loss.backward()
    return float(loss.detach()), attended.detach().numpy(), {n: p.grad.numpy() for n, p in double.named_parameters()}


def _relative(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.parametrize("causal", [False, True], ids=["padding-mask", "is_causal"])
def test_float16_attention_is_the_exact_attention_within_float16_rounding(causal, record_property):
    """TinyAttention under float16 mixed precision, one step: the loss, the attention output and every
    gradient within HALF_BOUND (1e-2) of float64 PyTorch's, with the pass on and off; fully masked rows
    give 0. With the pass on, the graph's [B, H, S, S] products and softmax are float16 (off: float32)
    and the guard of the fully masked rows is still rewritten (``safe_softmax``: its ReduceMax/ReduceSum form);
    the softmax's gradient is float16 too (``half_precision_softmax_gradient``)."""
    model = TinyAttention(causal)
    batch = _batch(None if causal else _padding_mask())
    loss64, attended64, grads64 = _float64(model, batch)
    errors = {}
    for on in (True, False):
        trainer, loss, attended, grads = _half_step(model, batch, on)
        errors[on] = {"loss": abs(loss - loss64) / abs(loss64), "attended": _relative(attended, attended64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, HALF_BOUND, (on, name))
        if not causal:
            assert (attended[2, [0, 3]] == 0).all()
        gradient = trainer._graphs.gradient
        types, ranks = _dtypes(gradient), _ranks(gradient)
        # the forward's softmax, and its copy in the backward (activation_recompute) of the same type
        softmax = [n for n in gradient.graph.node if n.op_type == "Softmax" and not n.name.endswith("/recompute")]
        assert [types[n.output[0]] for n in softmax] == [onnx.TensorProto.FLOAT16 if on else onnx.TensorProto.FLOAT]
        copies = [n for n in gradient.graph.node if n.op_type == "Softmax" and n.name.endswith("/recompute")]
        assert [types[n.output[0]] for n in copies] == [onnx.TensorProto.FLOAT16 if on else onnx.TensorProto.FLOAT]
        assert any(n.name.endswith("/safe_softmax/ReduceMax") for n in gradient.graph.node), "guard not rewritten"
        # the softmax's gradient: float16 with the pass (half_precision_softmax_gradient), float32 without
        subs = [types[n.output[0]] for n in gradient.graph.node if n.op_type == "Sub" and ranks[n.output[0]] == 4]
        assert subs == [onnx.TensorProto.FLOAT16 if on else onnx.TensorProto.FLOAT], subs
        assert sum(n.name.endswith("/half_softmax_gradient/Sub") for n in gradient.graph.node) == (1 if on else 0)
        # the attention's batched products (rank 3: [B·H, S, S] and [B·H, S, head]), forward and backward
        batched = {types[n.output[0]] for n in gradient.graph.node if n.op_type == "MatMul" and ranks[n.output[0]] == 3}
        assert batched == {onnx.TensorProto.FLOAT16 if on else onnx.TensorProto.FLOAT}, batched
    record_property("errors", {on: max(e.values()) for on, e in errors.items()})


def test_the_pass_is_off_for_float32_and_leaves_it_bit_equal():
    """fp32 training never takes the rewrite: the graph and gradients with the flag on and off are the same."""
    assert_float32_untouched(TinyAttention(False), DESC, _batch(_padding_mask()), "half_precision_attention")


def test_hugging_face_gpt2_trains_and_evaluates_in_float16_attention():
    """HF GPT-2 (sdpa attention, left padding, dropout 0.1 so the attention's dropout is rewritten too):
    float16 training with the pass computes every attention product in float16, takes 5 steps with a
    finite falling loss and evaluates within float16 rounding of PyTorch's autocast eval (both
    float16 logits: LOSS_BOUND-like 2 sides · 2 roundings · u16 · ~10 roundings of the chain = 2e-2
    relative at worst)."""
    model, desc = tiny_gpt2(dropout=0.1, seq=16)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.5),
                         options={"graph": {"gradient_source": "torch"},
                                  "mixed_precision": {"enabled": True, "dtype": "float16"}})
    losses = [float(trainer.train_step(ids, mask, ids)[0]) for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    types = _dtypes(trainer._graphs.gradient)
    scores = [n for n in trainer._graphs.gradient.graph.node if n.op_type == "Softmax"]  # and their copies
    assert len(scores) == 2 * model.config.n_layer and all(types[n.output[0]] == onnx.TensorProto.FLOAT16 for n in scores)
    assert sum(n.name.endswith("/recompute") for n in scores) == model.config.n_layer  # activation_recompute
    eval_loss = float(trainer.eval_step(ids, mask, ids)[0])
    reference = copy.deepcopy(model)
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    reference.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        expected = float(reference(input_ids=ids, attention_mask=mask, labels=ids).loss)
    check(abs(eval_loss - expected) / abs(expected), 2 * 2 * 10 * FLOAT16, (eval_loss, expected))


def test_the_pass_counts_only_half_precision_calls():
    """``half_precision`` rewrites a float16 call and leaves a float32 one (the program after it still
    exports): counted by the call's query dtype."""
    class Two(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q.half(), k.half(), v.half()).float() + \
                F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 2, 4, 8)
    program = torch.export.export(Two(), (q, q, q))
    assert attention.half_precision(program) == 1
    assert attention.half_precision(program) == 0  # already rewritten


# A float16 softmax gradient y·dy − y·Σ(y·dy) computed in float16 (half_precision_softmax_gradient) against
# float64 on the same float16 inputs. Per element, the product p = y·dy, the row sum s, y·s and the difference
# are each rounded to float16 once: u16 = 2^-11 relative, or 2^-25 absolute below float16's smallest normal
# 2^-14 (subnormals: the test's smallest probabilities are); the sum accumulates in float32 (S·u32 = 4e-6 of
# Σ|p| for S = 64, negligible). So |error| <= 4·(u16·(|p| + |y|·Σ|p|) + 2^-25); the test holds twice that.
# Torch's float32 decomposition rounds once, at the end, within the same bound.
SOFTMAX_GRADIENT_ROUNDINGS = 8


def _softmax_gradient_model(rewritten: bool, half: int = onnx.TensorProto.FLOAT16) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    shape = [2, 3, 5, 64]
    f16, f32 = half, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["dy"], ["c_dy"], to=f32), helper.make_node("Cast", ["y"], ["c_y"], to=f32),
             helper.make_node("Mul", ["c_dy", "c_y"], ["p"]),
             helper.make_node("ReduceSum", ["p", "axes"], ["s"], keepdims=1),
             helper.make_node("Mul", ["c_y", "s"], ["q"]), helper.make_node("Sub", ["p", "q"], ["r"]),
             helper.make_node("Cast", ["r"], ["grad"], to=f16),
             helper.make_node("Cast", ["c_y"], ["y_again"], to=f16)]  # another reader keeps the cast of y
    graph = helper.make_graph(
        nodes, "softmax_gradient", [helper.make_tensor_value_info(n, f16, shape) for n in ("dy", "y")],
        [helper.make_tensor_value_info("grad", f16, shape), helper.make_tensor_value_info("y_again", f16, shape)],
        [onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model)
    if rewritten:
        rewrite = passes.softmax.bfloat16_gradient if half == TensorProto.BFLOAT16 else passes.softmax.half_precision_gradient
        assert rewrite(model) == 1
    onnx.checker.check_model(model, full_check=True)
    return model


def _softmax_gradient_inputs(dtype: torch.dtype) -> tuple:
    """``(y, dy, expected, magnitude)``: softmax probabilities and a gradient in ``dtype`` ([2, 3, 5, 64], seed
    0), the softmax gradient ``y·dy − y·Σ(y·dy)`` of those values in float64, and the magnitude its rounding
    errors scale with, ``|y·dy| + |y|·Σ|y·dy|``."""
    gen = torch.Generator().manual_seed(0)
    y = torch.softmax(torch.randn(2, 3, 5, 64, generator=gen, dtype=torch.float64) * 3, -1).to(dtype)
    dy = (torch.randn(2, 3, 5, 64, generator=gen, dtype=torch.float64) * 100).to(dtype)
    y64, dy64 = y.double().numpy(), dy.double().numpy()
    p = y64 * dy64
    return y, dy, p - y64 * p.sum(-1, keepdims=True), np.abs(p) + np.abs(y64) * np.abs(p).sum(-1, keepdims=True)


def test_the_softmax_gradient_in_float16_is_within_float16_rounding_of_float64(record_property):
    """``half_precision_softmax_gradient`` on the decomposed float16 softmax gradient: four float16
    nodes under the output's name (the cast of ``y`` that another node reads stays), each element within
    SOFTMAX_GRADIENT_ROUNDINGS·(u16·(|y·dy| + |y|·Σ|y·dy|) + 2⁻²⁵) of float64, as is torch's float32 form."""
    import onnxruntime as ort

    y, dy, expected, magnitude = _softmax_gradient_inputs(torch.float16)
    scale = FLOAT16 * magnitude + 2.0 ** -25
    model = _softmax_gradient_model(True)
    assert [n.op_type for n in model.graph.node] == ["Cast", "Mul", "ReduceSum", "Mul", "Sub", "Cast"]
    worst = {}
    for rewritten in (True, False):
        session = ort.InferenceSession(_softmax_gradient_model(rewritten).SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        grad, y_again = session.run(None, {"dy": dy.numpy(), "y": y.numpy()})
        assert grad.dtype == np.float16
        np.testing.assert_array_equal(y_again, y.numpy())
        worst[rewritten] = float((np.abs(grad.astype(np.float64) - expected) / scale).max())
        check(worst[rewritten], SOFTMAX_GRADIENT_ROUNDINGS, rewritten)
    record_property("worst_in_roundings", worst)


def test_the_softmax_gradient_pass_leaves_float32_and_partial_patterns():
    """No rewrite where the result is cast to float32 (not the float16 pattern), or where the product is read
    outside the pattern (a graph output)."""
    model = _softmax_gradient_model(False)
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output[0] == "grad":
            node.attribute[0].i = onnx.TensorProto.FLOAT  # a float32 result: not the float16 pattern
    assert passes.softmax.half_precision_gradient(model) == 0
    model = _softmax_gradient_model(False)
    model.graph.output.append(onnx.helper.make_tensor_value_info("p", onnx.TensorProto.FLOAT, None))
    assert passes.softmax.half_precision_gradient(model) == 0


def _as_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every bfloat16 value, cast and initializer made float32 (the CPU has no bfloat16 kernels):
    the same nodes, to check what they compute."""
    from onnx import TensorProto, numpy_helper

    model = copy.deepcopy(model)
    graph = model.graph
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.BFLOAT16:
                attr.i = TensorProto.FLOAT
    for init in graph.initializer:
        if init.data_type == TensorProto.BFLOAT16:
            assert set(onnx.numpy_helper.to_array(init).astype(np.float32).reshape(-1)) == {1.0}  # the ones column
            init.CopyFrom(numpy_helper.from_array(np.ones(list(init.dims), np.float32), init.name))
    return model


def test_the_bfloat16_softmax_gradient_is_well_typed_and_computes_the_same_formula():
    """``bfloat16_softmax_gradient``: four bfloat16 nodes under the output's name, the row sum a MatMul by a
    [64, 1] bfloat16 column of ones (no bfloat16 ReduceSum on CUDA); ONNX's full check and strict shape
    inference accept it. Its values (bfloat16 made float32, the CPU having no bfloat16 kernels) are the formula's
    within float32 rounding: 8·(u32·(|y·dy| + |y|·Σ|y·dy|)) (as the float16 test's bound, u32 for u16). The
    float16 pass leaves bfloat16 alone, and this one float16."""
    import onnxruntime as ort
    from onnx import TensorProto

    model = _softmax_gradient_model(True, TensorProto.BFLOAT16)
    assert [n.op_type for n in model.graph.node] == ["Cast", "Mul", "MatMul", "Mul", "Sub", "Cast"]
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    ones = [i for i in model.graph.initializer if "ones" in i.name]
    assert [(i.data_type, list(i.dims)) for i in ones] == [(TensorProto.BFLOAT16, [64, 1])]
    assert passes.softmax.half_precision_gradient(_softmax_gradient_model(False, TensorProto.BFLOAT16)) == 0
    assert passes.softmax.bfloat16_gradient(_softmax_gradient_model(False)) == 0

    y, dy, expected, magnitude = _softmax_gradient_inputs(torch.float32)
    scale = 2.0 ** -24 * magnitude
    session = ort.InferenceSession(_as_float32(model).SerializeToString(), providers=["CPUExecutionProvider"])
    grad, _ = session.run(None, {"dy": dy.numpy(), "y": y.numpy()})
    check(float((np.abs(grad.astype(np.float64) - expected) / scale).max()), SOFTMAX_GRADIENT_ROUNDINGS, "bfloat16")


def test_the_bfloat16_softmax_gradient_needs_the_last_axis_and_its_length():
    """No rewrite where the sum is not over the last axis alone, or its length is not static."""
    from onnx import TensorProto

    model = _softmax_gradient_model(False, TensorProto.BFLOAT16)
    axes = next(i for i in model.graph.initializer if i.name == "axes")
    axes.CopyFrom(onnx.numpy_helper.from_array(np.array([2], np.int64), "axes"))
    assert passes.softmax.bfloat16_gradient(model) == 0
    model = _softmax_gradient_model(False, TensorProto.BFLOAT16)
    for info in model.graph.input:
        info.type.tensor_type.shape.dim[-1].dim_param = "seq"
    del model.graph.value_info[:]
    assert passes.softmax.bfloat16_gradient(model) == 0


def test_bfloat16_softmax_gradients_of_gpt2_are_rewritten():
    """A tiny Hugging Face GPT-2 in bfloat16 (the graph built, its session refused on the CPU): with
    ``bfloat16_softmax_gradient`` each layer's attention softmax gradient is the bfloat16 form, and no float32
    copy of a [batch, heads, seq, seq] bfloat16 value is left but the safe softmax guard's (its row maximum: no
    bfloat16 ReduceMax on CUDA); off, torch's float32 decomposition stays."""
    from onnx import TensorProto

    from ort_trainer.amp.kernels import MissingKernelError

    model, desc = tiny_gpt2(seq=8)
    ids = torch.randint(0, 40, (3, 8), generator=torch.Generator().manual_seed(5))
    for on in (True, False):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph": {"gradient_source": "torch"}, "mixed_precision": {
                                 "enabled": True, "dtype": "bfloat16"},
                                 "graph_optimizations": {"bfloat16_softmax_gradient": on}})
        with pytest.raises(MissingKernelError):
            trainer.train_step(ids, torch.ones_like(ids), ids)
        gradient = trainer._graphs.gradient
        rewritten = sum(n.name.endswith("/half_softmax_gradient/MatMul_sum") for n in gradient.graph.node)
        inferred = {v.name: v.type.tensor_type for v in onnx.shape_inference.infer_shapes(gradient).graph.value_info}
        scores_f32 = [n.name for n in gradient.graph.node if n.op_type == "Cast" and n.output[0] in inferred
                      and inferred[n.output[0]].elem_type == TensorProto.FLOAT
                      and [d.dim_value for d in inferred[n.output[0]].shape.dim][-2:] == [8, 8]
                      and "/safe_softmax/" not in n.name and "/recompute/" not in n.name]
        assert rewritten == (2 if on else 0)  # one per layer
        assert bool(scores_f32) != on, scores_f32

"""The ``half_precision_bias_gradient`` pass (``graph/passes/copies.py``, ``half_column_sums``): under
mixed precision, a half-precision product's bias gradient summed by a half-precision MatMul by ones
instead of torch's float32 sum between casts.

Checked against float64 PyTorch (loss and every gradient, the pass on and off), on the graph (no
float32 copy of a half gradient is summed), on a hand-built pattern in float16 (values against float64
NumPy) and bfloat16 (types only: the CPU has no bfloat16 product).
"""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes import copies
from ort_trainer.optim import SGDConfig

from models import ENCODER_DESC, TinyEncoder, mlm_batch, mlm_loss
from tolerances import FLOAT16, FLOAT32, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float16 training against float64 PyTorch: TinyEncoder's longest chain of float16 roundings, ~40
# (tests/test_half_loss.py's HALF_BOUND, derived there): 40·u16 = 2.0e-2. The pass rounds each bias gradient
# once, as the cast back did, from a float32 sum in another order. On against off: the bias gradients differ
# by a float32 summation order (K·u32) before the one rounding, which can flip that rounding: u16 of each
# bias gradient; the other gradients are equal. Observed: worst tensor 1.52e-3 against float64 (13x under),
# on/off 0 (float32 sums of at most 48 float16 values are exact here: the same rounding on both sides).
HALF_BOUND = 40 * FLOAT16
ON_OFF_BOUND = 2 * FLOAT16


def _step(model, batch, on: bool):
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), ENCODER_DESC, SGDConfig(lr=0.0), loss_fn=mlm_loss,
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler":
                                                      DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)},
                                  "graph_optimizations": {"half_precision_bias_gradient": on}})
    loss = float(trainer.train_step(*batch)[0])
    return trainer, loss, {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


def _relative(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


def _half_sums_in_float32(model: onnx.ModelProto) -> int:
    """The float32 sums (ReduceSum, or column_sums' MatMul by ones) of a float32 cast of a float16 value
    whose result is cast back to float16: torch's spelling of a half product's bias gradient. (Other float32
    sums of half values stay: a LayerNorm's, which autocast runs in float32, sums its float32 gradient.)"""
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    types = {v.name: v.type.tensor_type.elem_type
             for v in onnx.shape_inference.infer_shapes(model).graph.value_info}

    def source_of(name):
        node = producer.get(name)
        while node is not None and node.op_type == "Reshape":
            node = producer.get(node.input[0])
        return node

    def narrowed(name):
        after = readers.get(name, [])
        while len(after) == 1 and after[0].op_type == "Reshape":
            after = readers.get(after[0].output[0], [])
        return any(n.op_type == "Cast" and helper.get_attribute_value(n.attribute[0]) == TensorProto.FLOAT16
                   for n in after)

    found = 0
    for node in model.graph.node:
        if node.op_type == "ReduceSum" or (node.op_type == "MatMul" and "column_sums" in node.name):
            source = source_of(node.input[0] if node.op_type == "ReduceSum" else node.input[1])
            if (source is not None and source.op_type == "Cast" and types.get(source.input[0]) == TensorProto.FLOAT16
                    and narrowed(node.output[0])):
                found += 1
    return found


def test_float16_bias_gradients_within_float16_rounding_of_float64(record_property):
    """One float16 step of TinyEncoder (every Linear has a bias), the pass on and off: the loss and every
    gradient within HALF_BOUND of float64 PyTorch's, on against off within ON_OFF_BOUND; with the pass no
    float32 copy of a float16 gradient is summed, and each bias gradient is one float16 MatMul by ones."""
    torch.manual_seed(0)
    model, batch = TinyEncoder(), mlm_batch(torch.Generator().manual_seed(6))
    double = copy.deepcopy(model).double()
    loss64 = mlm_loss(double(batch[0]), batch[1])
    loss64.backward()
    loss64 = float(loss64.detach())
    grads64 = {n: p.grad.numpy() for n, p in double.named_parameters()}
    results, errors = {}, {}
    for on in (True, False):
        trainer, loss, grads = _step(model, batch, on)
        results[on] = (loss, grads)
        errors[on] = {"loss": abs(loss - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, HALF_BOUND, (on, name))
        gradient = trainer._graphs.gradient
        rewritten = sum(n.name.endswith("/half_column_sums/MatMul") for n in gradient.graph.node)
        if on:
            assert _half_sums_in_float32(gradient) == 0
            # every Linear's bias (TinyEncoder's query, value, out, ff1, ff2 and the head), not the LayerNorms'
            assert rewritten == len([n for n in grads if n.endswith(".bias") and "norm" not in n]), rewritten
        else:
            assert _half_sums_in_float32(gradient) > 0 and rewritten == 0
    on_off = {name: _relative(results[True][1][name], grad) for name, grad in results[False][1].items()}
    for name, error in on_off.items():
        check(error, ON_OFF_BOUND, ("on/off", name))
    assert results[True][0] == results[False][0]  # the forward is untouched
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()}, "on/off": max(on_off.values())})


def _pattern(dtype: int, keepdims: int = 0) -> onnx.ModelProto:
    """``Cast(ReduceSum(Cast(dy, float32), [0, 1]), dtype)`` of a ``[3, 5, 7]`` ``dy``."""
    nodes = [helper.make_node("Cast", ["dy"], ["wide"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["wide", "axes"], ["total"], keepdims=keepdims),
             helper.make_node("Cast", ["total"], ["bias_grad"], to=dtype)]
    out_shape = [1, 1, 7] if keepdims else [7]
    graph = helper.make_graph(nodes, "sum", [helper.make_tensor_value_info("dy", dtype, [3, 5, 7])],
                              [helper.make_tensor_value_info("bias_grad", dtype, out_shape)],
                              [numpy_helper.from_array(np.array([0, 1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_the_rewritten_sum_is_well_typed(dtype, keepdims):
    """float16 and bfloat16, with and without keepdims: one MatMul by ones of the dtype, no cast left,
    ONNX's full check and strict shape inference accept the graph, and the output keeps its shape."""
    model = _pattern(dtype, keepdims)
    assert copies.half_column_sums(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Reshape", "MatMul", "Reshape"]  # [15, 7] in, [7] or [1, 1, 7] out
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    ones = next(i for i in inferred.graph.initializer if "ones" in i.name)
    assert ones.data_type == dtype and list(ones.dims) == [1, 15]
    assert copies.half_column_sums(model) == 0


def test_the_rewritten_sum_against_float64():
    """float16 with ONNX Runtime: the sum of 15 rows within one float16 rounding of the float64 sum
    (plus the float32 accumulation's 15·u32 of the sum of magnitudes)."""
    import onnxruntime as ort

    dy = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float16)
    model = _pattern(TensorProto.FLOAT16)
    assert copies.half_column_sums(model) == 1
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"dy": dy})[0]
    exact = dy.astype(np.float64).sum((0, 1))
    bound = FLOAT16 * np.abs(exact) + 15 * FLOAT32 * np.abs(dy.astype(np.float64)).sum((0, 1))
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all(), (got, exact)


def test_a_float32_copy_read_elsewhere_is_left_alone():
    """The widening cast read by another node too (the float32 copy is needed anyway): nothing rewritten."""
    model = _pattern(TensorProto.FLOAT16)
    model.graph.output.append(helper.make_tensor_value_info("wide", TensorProto.FLOAT, [3, 5, 7]))
    assert copies.half_column_sums(model) == 0

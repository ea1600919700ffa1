"""The ``half_precision_transposed_products`` pass (``graph/passes/recompute.py``,
``half_transposed_products``): ``transposed_products`` for the float16 and bfloat16 ``MatMul`` nodes of
a mixed-precision graph. Checked against float64 PyTorch (loss and every gradient, on and off), on the
graph (no 2-D half ``Transpose`` read by a ``MatMul`` is left) and for float32 (nothing changes).
"""

import copy

import numpy as np
import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim import SGDConfig

from models import assert_float32_untouched
from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import FLOAT16, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float16 training against float64 PyTorch: the tiny models' chains of ~40 float16 roundings
# (test_half_loss.py's HALF_BOUND, derived there), 40·u16 = 2.0e-2; the pass changes no rounding, only
# which kernel multiplies (a Gemm reading the transposed operand in place of a copy of it). On against
# off: the products may sum in another order (float32 accumulation inside, then one float16 rounding each),
# which can flip a rounding and carry it through the backward's ~40: 40·u16 as well. Observed: worst tensor
# 9.4e-4 off / 5.7e-4 on (GPT-2), 1.52e-3 off / 1.11e-3 on (TinyEncoder), 13x under.
HALF_BOUND = 40 * FLOAT16


def _step(model, desc, batch, loss_fn, on: bool):
    torch.manual_seed(0)
    options = {"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "graph_optimizations": {"half_precision_transposed_products": on},
               "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler":
                                   DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn, options=options)
    outputs = trainer.train_step(*batch)
    return trainer, float(outputs[0]), {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


def _transposed_half_matmuls(model: onnx.ModelProto) -> int:
    """2-D MatMul nodes that read a 2-D float16 Transpose (a rank-3 input times a transposed matrix, the
    head computed in the logits' shape by ``output_reshape``, is left to ONNX Runtime: one product)."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    info = {v.name: v.type.tensor_type for v in graph.value_info}
    producer = {o: n for n in graph.node for o in n.output}
    found = 0
    for node in graph.node:
        two_d = all(name in info and len(info[name].shape.dim) == 2 for name in node.input)
        for name in node.input if node.op_type == "MatMul" and two_d else ():
            source = producer.get(name)
            if source is not None and source.op_type == "Transpose" and name in info \
                    and info[name].elem_type == onnx.TensorProto.FLOAT16 and len(info[name].shape.dim) == 2:
                found += 1
    return found


@pytest.mark.parametrize("case", ["gpt2", "encoder"])
def test_half_products_fold_their_transposes_within_float16_rounding_of_float64(case, record_property):
    """One float16 step, the pass on and off: the loss and every gradient within HALF_BOUND of float64
    PyTorch's and of each other; with the pass no 2-D float16 Transpose feeds a MatMul."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    loss64, grads64 = _float64(model, batch, loss_fn)
    results, errors = {}, {}
    for on in (True, False):
        trainer, loss, grads = _step(model, desc, batch, loss_fn, on)
        results[on] = (loss, grads)
        errors[on] = {"loss": abs(loss - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, HALF_BOUND, (on, name))
        left = _transposed_half_matmuls(trainer._graphs.gradient)
        assert (left == 0) if on else (left > 0), left
    for name, grad in results[False][1].items():
        check(_relative(results[True][1][name], grad), HALF_BOUND, ("on/off", name))
    record_property("errors", {on: max(e.values()) for on, e in errors.items()})


def test_float32_graphs_do_not_change():
    """fp32 training: the flag changes nothing (transposed_products has folded the float32 products): the
    same graph, bitwise the same gradients."""
    model, desc, batch, loss_fn = _encoder_case()
    assert_float32_untouched(model, desc, batch, "half_precision_transposed_products", loss_fn)

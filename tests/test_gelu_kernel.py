"""The ``gelu_forward_kernel`` joint-graph pass (``graph/passes/gelu_kernel.py``): a GELU's forward
region, once ``activation_recompute`` gave its backward its own copies, as one ``com.microsoft``
``FastGelu`` (tanh) or ``BiasGelu`` with a zero bias (erf) node.

Checked against float64 PyTorch: one float32 step of a tiny GPT-2 (tanh GELU) and of TinyEncoder
(erf), and one float16 step of the GPT-2, loss and every gradient, the pass on and off; the graphs
(one kernel per layer, no forward element-wise GELU left); what is left alone: a region a backward
still reads, a function that is not GELU (QuickGELU's ``x · σ(1.702x)``).
"""

import copy

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes.gelu_kernel import gelu_forward_kernel
from ort_trainer.optim import SGDConfig

from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import FLOAT16, FLOAT32, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float32 against float64, relative to each tensor's norm: the tiny GPT-2's logits carry ~370 roundings
# (test_eval_passes.py's GPT2_LOGITS_BOUND derivation) and the backward runs the chain back once more,
# ~800 in all; the kernel computes the GELU in another sequence of operations (its own tanh), a few
# roundings on each activation inside that. Bound: 4000·u32 = 2.4e-4, a 5x margin. On against off: the
# same chain from the GELU's output on, within the same bound.
FLOAT32_BOUND = 4000 * FLOAT32
# float16: test_half_loss.py's HALF_BOUND (40 roundings of the tiny models' longest float16 chain)
HALF_BOUND = 40 * FLOAT16


def _step(model, desc, batch, loss_fn, on: bool, half: bool, fused_gradient: bool = False):
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)  # unscaled gradients, no skipped step
    mixed = {"enabled": True, "dtype": "float16", "loss_scaler": scaler} if half else {"enabled": False}
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "mixed_precision": mixed,
                                  "graph_optimizations": {"gelu_forward_kernel": on,
                                                          "fused_gelu_gradient": fused_gradient}})
    outputs = trainer.train_step(*batch)
    loss = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    return trainer, float(loss), {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


@pytest.mark.parametrize("case, half, fused_gradient",
                         [("gpt2", False, False), ("encoder", False, False), ("gpt2", True, False),
                          ("gpt2", False, True), ("encoder", False, True), ("gpt2", True, True)],
                         ids=["gpt2-float32", "encoder-float32", "gpt2-float16", "gpt2-float32-fused-gradient",
                              "encoder-float32-fused-gradient", "gpt2-float16-fused-gradient"])
def test_the_kernel_trains_within_rounding_of_float64(case, half, fused_gradient, record_property):
    """One step, the pass on and off: the loss and every gradient within the bound of float64 PyTorch's,
    on against off too. On, each layer's GELU forward is one kernel node and no forward Sigmoid or Erf is
    left. The backward's recomputed copies keep theirs where the element-wise backward reads their inner values;
    with ``fused_gelu_gradient`` (whose kernel reads the GELU's input alone) a copy computes the output alone, for
    the next product's weight gradient, and is one kernel node too: no Sigmoid or Erf is left at all."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    bound = HALF_BOUND if half else FLOAT32_BOUND
    loss64, grads64 = _float64(model, batch, loss_fn)
    results, errors = {}, {}
    for on in (True, False):
        trainer, value, grads = _step(model, desc, batch, loss_fn, on, half, fused_gradient)
        results[on] = grads
        errors[on] = {"loss": abs(value - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, bound, (on, name))
        nodes = trainer._graphs.gradient.graph.node
        kernels = [n for n in nodes if n.op_type in ("FastGelu", "BiasGelu") and n.domain == "com.microsoft"]
        transcendental = [n for n in nodes if n.op_type == "Sigmoid" or "erf" in n.op_type.lower()]  # aten_special_erf
        forward = [n for n in transcendental if "/recompute" not in n.name]
        copies = 2 if fused_gradient else 0  # the recomputed copies the pass rewrites: one a layer
        assert len(kernels) == (2 + copies if on else 0), [n.name for n in kernels]  # the tiny models' two layers
        assert {n.op_type for n in kernels} <= {"FastGelu" if case == "gpt2" else "BiasGelu"}
        assert len(forward) == (0 if on else 2), [n.name for n in forward]
        assert len(transcendental) == (4 - 2 - copies if on else 4), [n.name for n in transcendental]
    on_off = {name: _relative(results[True][name], grad) for name, grad in results[False].items()}
    for name, error in on_off.items():
        check(error, bound, ("on/off", name))
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()}, "on/off": max(on_off.values())})


def _region_graph(slope: float, backward_reads_s: bool = False, elem_type: int = TensorProto.FLOAT):
    """``y = x · σ(x · (slope + A·x²))`` (the gelu pass's tanh form with ``B = slope``), read by ``Identity``;
    ``backward_reads_s``: ``s`` read outside the region too."""
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    scalars = {"A": 2 * np.sqrt(2 / np.pi) * 0.044715, "B": slope}
    nodes = [helper.make_node("Mul", ["x", "A"], ["xa"]), helper.make_node("Mul", ["xa", "x"], ["t"]),
             helper.make_node("Add", ["t", "B"], ["tb"]), helper.make_node("Mul", ["x", "tb"], ["u"]),
             helper.make_node("Sigmoid", ["u"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"]),
             helper.make_node("Identity", ["y"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", elem_type, [4])]
    if backward_reads_s:
        nodes.append(helper.make_node("Mul", ["s", "g"], ["ds"]))
        outputs.append(helper.make_tensor_value_info("ds", elem_type, [4]))
    inputs = [helper.make_tensor_value_info(n, elem_type, [4]) for n in ["x", "g"][:1 + backward_reads_s]]
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(np.array(v, dtype), n) for n, v in scalars.items()],
                              value_info=[helper.make_tensor_value_info("x", elem_type, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("elem_type", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_a_gelu_region_of_any_float_type_becomes_one_fast_gelu(elem_type):
    """The constants rounded to float16 or bfloat16 are still this GELU's (within 64 of its roundings)."""
    model = _region_graph(2 * np.sqrt(2 / np.pi), elem_type=elem_type)
    assert gelu_forward_kernel(model) == 1
    assert [(n.op_type, n.domain, list(n.input), list(n.output)) for n in model.graph.node] == [
        ("FastGelu", "com.microsoft", ["x"], ["y"]), ("Identity", "", ["y"], ["out"])]
    assert any(o.domain == "com.microsoft" for o in model.opset_import)


def test_a_region_the_backward_reads_or_another_function_is_left_alone():
    still_read = _region_graph(2 * np.sqrt(2 / np.pi), backward_reads_s=True)
    assert gelu_forward_kernel(still_read) == 0
    # QuickGELU: x · σ(1.702 x), here as the same nodes with A = 0.0713 kept: not GELU in the tails
    quick = _region_graph(1.702)
    assert gelu_forward_kernel(quick) == 0
    assert [n.op_type for n in quick.graph.node].count("Sigmoid") == 1


def test_a_bfloat16_gelu_becomes_a_bfloat16_kernel():
    """bfloat16 (types only: the CPU has no bfloat16 kernels, the graph is built and the session refused)."""
    from ort_trainer.amp.kernels import MissingKernelError

    model, desc, batch, _ = _gpt2_case()
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={"graph": {"gradient_source": "torch"},
                                  "mixed_precision": {"enabled": True, "dtype": "bfloat16"},
                                  "graph_optimizations": {"gelu_forward_kernel": True}})
    with pytest.raises(MissingKernelError):
        trainer.train_step(*batch)
    gradient = trainer._graphs.gradient
    types = {v.name: v.type.tensor_type.elem_type for v in gradient.graph.value_info}
    kernels = [n for n in gradient.graph.node if n.op_type == "FastGelu"]
    assert len(kernels) == 2 and all(types[n.input[0]] == types[n.output[0]] == TensorProto.BFLOAT16
                                     for n in kernels)

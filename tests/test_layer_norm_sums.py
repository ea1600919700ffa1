"""``graph_optimizations.fused_layer_norm_gradient``'s joint part (``graph/passes/layer_norm_sums.py``): a
LayerNorm's gradient added into the residual's gradient in its kernel (``LayerNormGradAdd``), dy read in its own
dtype and, under mixed precision, the sum written in the half dtype too (``LayerNormGradAddCast``).

Checked on a tiny Hugging Face GPT-2 (two pre-norm layers): the loss and every gradient bit for bit those of the
same switch without the joint part (the kernel adds and rounds as the ``Add`` and ``Cast`` nodes do) in float32,
and on CUDA (``make gpu-check``) in float32, float16 and bfloat16; within rounding of float64 PyTorch in each,
float16 on the CPU too (where ONNX Runtime's unfused graph skips a rounding: the test says why). Chains it must
leave alone: dgamma read before the sum, a broadcast residual, a gradient read twice. A post-norm LayerNorm's
gradient cast to half in its kernel (``LayerNormGradToFloat16``): the kernel's values in test_kernels.py, the graphs
in test_fused_kernels.py.
"""

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph import passes
from ort_trainer.graph.passes import layer_norm_sums
from ort_trainer.kernels import DOMAIN
from ort_trainer.optim import SGDConfig

from test_half_loss import _float64, _gpt2_case, _relative
from tolerances import FLOAT32, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# against float64 PyTorch, relative to each tensor's norm: float32, test_fused_kernels.py's bound (~800 roundings of
# the tiny GPT-2's longest chain, 5x margin); float16 and bfloat16 mixed precision, test_aligned_products.py's
# (~20 roundings of the half dtype; bfloat16's unit roundoff is 8x float16's)
BOUNDS = {"fp32": 4000 * FLOAT32, "float16": 1e-2, "bfloat16": 8e-2}


def _mixed_step(model, desc, batch, precision: str, device: str, switches: dict):
    """One unscaled SGD step (lr 0) of a Hugging Face model in ``precision`` ("fp32", "float16", "bfloat16") on
    ``device`` with the ``graph_optimizations`` ``switches``: the loss, every gradient (float64 arrays), the graph."""
    mixed = {} if precision == "fp32" else {"mixed_precision": {
        "enabled": True, "dtype": precision,
        **({"loss_scaler": DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)} if precision == "float16"
           else {})}}
    options = {"device": {"id": device}, "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "graph_optimizations": switches, **mixed}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    loss = float(trainer.train_step(*[t.to(device) for t in batch])[0].cpu())
    grads = {w: g.float().cpu().numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}
    return loss, grads, trainer._graphs.gradient.graph


def _check_float64(model, batch, loss: float, grads: dict, bound: float, unchecked: tuple[str, ...] = ()) -> None:
    """The loss and every gradient within ``bound`` of float64 PyTorch's (relative to each tensor's norm), but those
    of the weights whose names contain one of ``unchecked``."""
    loss64, grads64 = _float64(model, batch, None)
    check(abs(loss - loss64) / abs(loss64), bound, "loss")
    for name, grad in grads64.items():
        if not any(part in name for part in unchecked):
            check(_relative(grads[name], grad), bound, name)


def _step(model, desc, batch, precision: str, device: str, joint: bool, monkeypatch):
    """One step with fused_layer_norm_gradient on (``joint``: its joint part too), built afresh (the graph cache
    keys the switch, not the pass): loss, gradients, graph."""
    with monkeypatch.context() as patch:
        patch.setenv("ORT_TRAINER_CACHE_DIR", "off")
        if not joint:
            patch.setattr(passes, "_JOINT", tuple((name, run) for name, run in passes._JOINT
                                                  if run is not layer_norm_sums.layer_norm_residual_sums))
        return _mixed_step(model, desc, batch, precision, device, {"fused_layer_norm_gradient": True})


@pytest.mark.parametrize("precision, device", [
    ("fp32", "cpu"), ("float16", "cpu"),
    pytest.param("float16", "cuda", marks=pytest.mark.cuda), pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda),
    pytest.param("fp32", "cuda", marks=pytest.mark.cuda)])
def test_the_residual_sums_are_the_unfused_graphs_bit_for_bit(precision, device, monkeypatch):
    """The loss and every gradient bit for bit those without the joint part (float16 on the CPU: see below), within
    BOUNDS of float64 as well; four of the five LayerNorms' gradients go on into a residual sum (every layer's two:
    the final one's is read twice), each now one node that reads dy in its own dtype (a half product's, under mixed
    precision) and, but for the last (the embeddings' gradients read it), writes the sum's half cast for the
    products after it."""
    model, desc, batch, _ = _gpt2_case()
    loss_off, grads_off, graph_off = _step(model, desc, batch, precision, device, False, monkeypatch)
    loss_on, grads_on, graph = _step(model, desc, batch, precision, device, True, monkeypatch)
    # ONNX Runtime's CPU provider has no float16 MatMul: it computes one in float32 between casts, and drops the
    # cast back to float16 where a Cast to float32 follows (the unfused graph's dy), so there dy skips a float16
    # rounding that autocast's product has, and the fused node's half dy has; GPUs multiply in float16
    if device != "cpu" or precision == "fp32":
        assert loss_on == loss_off
        for name, grad in grads_off.items():
            assert np.array_equal(grads_on[name], grad), name
    fused = [n for n in graph.node if n.domain == DOMAIN and n.op_type.startswith("LayerNormGradAdd")]
    kinds = [n.op_type for n in fused]
    # (mixed precision: the first layer's first sum goes on to the embeddings' float32 gradients, with no cast)
    assert len(fused) == 4 and kinds.count("LayerNormGradAddCast") == (0 if precision == "fp32" else 3), kinds
    # one node for the gradient and the Add; under mixed precision also for dy's cast (and view) and the sum's, and
    # the final LayerNorm's gradient cast for the last products in its kernel (LayerNormGradTo*)
    casts = [n for n in graph.node if n.domain == DOMAIN and n.op_type.startswith("LayerNormGradTo")]
    assert len(casts) == (0 if precision == "fp32" else 1)
    assert len(graph.node) <= len(graph_off.node) - len(fused) - (0 if precision == "fp32" else 2 * 3 + 1 + 1)
    _check_float64(model, batch, loss_on, grads_on, BOUNDS[precision])


def _layer_norm_grad(dy: str, dx: str, suffix: str = "") -> onnx.NodeProto:
    return helper.make_node("LayerNormGrad", [dy, "x", "mean", "rstd", "gamma"],
                            [dx, "dgamma" + suffix, "dbeta" + suffix, "partials" + suffix], domain=DOMAIN)


def _graph(nodes, inputs, outputs):
    f32 = TensorProto.FLOAT
    values = [("x", f32, [4, 8]), ("mean", f32, [4, 1]), ("rstd", f32, [4, 1]), ("gamma", f32, [8]), *inputs]
    graph = helper.make_graph(nodes, "sums", [helper.make_tensor_value_info(*v) for v in values],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              value_info=[helper.make_tensor_value_info("dx", f32, [4, 8]),
                                          helper.make_tensor_value_info("y", f32, [4, 8]),
                                          helper.make_tensor_value_info("d32", f32, [4, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def test_what_the_chain_cannot_take_is_left_alone():
    """dgamma read before the sum (the node would move past its reader), a residual broadcast over the rows, a
    gradient another node reads too; the plain chain with a half dy becomes one LayerNormGradAddCast."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    sums = [("dgamma", f32, [8]), ("dbeta", f32, [8])]
    early = _graph([_layer_norm_grad("dy", "dx"), helper.make_node("Neg", ["dgamma"], ["early"]),
                    helper.make_node("Add", ["r", "dx"], ["y"])],
                   [("dy", f32, [4, 8]), ("r", f32, [4, 8])], [("y", f32, [4, 8]), ("early", f32, [8]), *sums[1:]])
    broadcast = _graph([_layer_norm_grad("dy", "dx"), helper.make_node("Add", ["r", "dx"], ["y"])],
                       [("dy", f32, [4, 8]), ("r", f32, [1, 8])], [("y", f32, [4, 8]), *sums])
    shared = _graph([_layer_norm_grad("dy", "dx"), helper.make_node("Add", ["r", "dx"], ["y"])],
                    [("dy", f32, [4, 8]), ("r", f32, [4, 8])], [("y", f32, [4, 8]), ("dx", f32, [4, 8]), *sums])
    plain = _graph([helper.make_node("Cast", ["dy"], ["d32"], to=f32), _layer_norm_grad("d32", "dx"),
                    helper.make_node("Add", ["dx", "r"], ["y"]), helper.make_node("Cast", ["y"], ["y16"], to=f16)],
                   [("dy", f16, [4, 8]), ("r", f32, [4, 8])], [("y", f32, [4, 8]), ("y16", f16, [4, 8]), *sums])
    for model in (early, broadcast, shared):
        assert layer_norm_sums.layer_norm_residual_sums(model) == 0
    assert layer_norm_sums.layer_norm_residual_sums(plain) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in plain.graph.node] == [
        ("LayerNormGradAddCast", ["dy", "x", "mean", "rstd", "gamma", "r"],
         ["y", "dgamma", "dbeta", "partials", "y16"])]

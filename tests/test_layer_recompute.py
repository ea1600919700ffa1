"""``graph_optimizations.layer_recompute`` (``ort_trainer/graph/passes/layer_recompute.py``): each sublayer
recomputed in the backward from its LayerNorm's input. Checked against float64 PyTorch (one float32 step of a
tiny Hugging Face GPT-2, pre-LN, and of TinyEncoder, post-LN; one float16 step of the GPT-2), on against off
bit for bit, and the forward values the backward reads."""

import copy
import re

import numpy as np
import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.names import LOSS_SCALE_INPUT
from ort_trainer.optim import SGDConfig

from models import tiny_gpt2
from test_fused_kernels import FLOAT32_BOUND, HALF_BOUND, _step
from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")


def _regions(model: onnx.ModelProto) -> set[str]:
    """The tags of the sublayers the pass copied into the backward (``.../layer_recomputeN``)."""
    return {found.group(0) for n in model.graph.node if (found := re.search(r"/layer_recompute\d+", n.name))}


def _kept(model: onnx.ModelProto) -> dict[str, list]:
    """Forward values (before the loss scale's first reader) that the backward reads, with their shapes."""
    nodes = list(model.graph.node)
    seed = next(i for i, n in enumerate(nodes) if LOSS_SCALE_INPUT in n.input)
    forward = {o for n in nodes[:seed] for o in n.output if n.op_type != "Constant"}
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
              for i in [*inferred.graph.value_info, *inferred.graph.input]}
    return {name: shapes.get(name) for n in nodes[seed:] for name in n.input if name in forward}


@pytest.mark.parametrize("case, half", [("gpt2", None), ("encoder", None), ("gpt2", "float16")],
                         ids=["gpt2-float32", "encoder-float32", "gpt2-float16"])
def test_recomputed_sublayers_train_as_float64_and_as_the_kept_ones_bit_for_bit(case, half, record_property):
    """One step on and off: the loss and every gradient within the bound of float64 PyTorch's (test_fused_kernels'
    bounds), and on equal to off bit for bit in float32 (the copies run the forward's operators on the same values).
    On, two sublayers a layer (attention, MLP) are copied where a LayerNorm reads their input."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    bound = HALF_BOUND if half else FLOAT32_BOUND
    loss64, grads64 = _float64(model, batch, loss_fn)
    results = {}
    for on in (True, False):
        trainer, value, grads = _step(model, desc, batch, loss_fn, "layer_recompute", on, half)
        check(abs(value - loss64) / abs(loss64), bound, (on, "loss"))
        for name, grad in grads64.items():
            check(_relative(grads[name], grad), bound, (on, name))
        results[on] = value, grads, trainer._graphs.gradient
    if half:  # ONNX Runtime's CPU provider casts float16 nodes to float32 and back, and elides some of those casts
        # where a value has one reader: the forward's values lose readers here, so on and off may round differently
        check(abs(results[True][0] - results[False][0]) / abs(results[False][0]), bound, "on/off loss")
        for name, grad in results[False][1].items():
            check(_relative(results[True][1][name], grad), bound, ("on/off", name))
    else:
        assert results[True][0] == results[False][0]
        for name, grad in results[False][1].items():
            np.testing.assert_array_equal(results[True][1][name], grad, err_msg=name)
    # TinyEncoder's first attention reads the embeddings' sum, which no LayerNorm reads: three sublayers there
    assert len(_regions(results[True][2])) == (4 if case == "gpt2" else 3) and not _regions(results[False][2])
    record_property("copied_nodes", sum("/layer_recompute" in n.name for n in results[True][2].graph.node))


def test_the_forward_keeps_the_layernorm_inputs_and_no_sublayer_activation():
    """A 2-layer GPT-2 (width 16, MLP 64, 2 heads, batch 2 × 8): on, the backward reads no [2, 8, 64] MLP value
    and no [2, 2, 8, 8] attention value from the forward, and fewer forward values in all; what it still reads
    of the residual stream's width are the LayerNorms' inputs, and of the linear layers' flattened inputs only the
    head's (after the last LayerNorm: not recomputed)."""
    model, desc = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    kept = {}
    for on in (False, True):
        options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {"layer_recompute": on}}
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
        trainer.train_step(ids, torch.ones_like(ids), ids)
        kept[on] = _kept(trainer._graphs.gradient)
    wide = {name for name, shape in kept[False].items() if shape in ([2, 8, 64], [2, 2, 8, 8], [4, 8, 8])}
    assert wide and not {name for name, shape in kept[True].items() if shape in ([2, 8, 64], [2, 2, 8, 8], [4, 8, 8])}
    # of the residual stream's width: the five LayerNorms' inputs, and the head's input (flattened) alone
    inputs = {n.input[0] for n in trainer._graphs.gradient.graph.node
              if n.op_type == "LayerNormalization" and "/layer_recompute" not in n.name}
    assert {name for name, shape in kept[True].items() if shape == [2, 8, 16]} == inputs and len(inputs) == 5
    assert len([name for name, shape in kept[False].items() if shape == [16, 16]]) == 7
    assert len([name for name, shape in kept[True].items() if shape == [16, 16]]) == 1


def test_a_sublayer_whose_dropout_draws_on_the_device_is_left_as_it_is():
    """A Dropout drawn by ONNX Runtime's kernel (``host_dropout_masks`` off) would draw another mask in the copy:
    GPT-2's attention drops probabilities the backward reads, so its sublayers are not copied; its MLP's Dropout
    comes after every value the backward reads (its mask is read where the forward left it), so the MLPs are.
    With the masks drawn on the host (graph inputs, the default on the CPU) all four are."""
    model, desc = tiny_gpt2(dropout=0.1)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    regions = {}
    for host in (True, False):
        options = {"graph": {"gradient_source": "torch"},
                   "graph_optimizations": {"layer_recompute": True, "host_dropout_masks": host}}
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
        loss, _ = trainer.train_step(ids, torch.ones_like(ids), ids)
        assert np.isfinite(loss.item())
        regions[host] = _regions(trainer._graphs.gradient)
        assert not [n for n in trainer._graphs.gradient.graph.node
                    if "/layer_recompute" in n.name and n.op_type == "Dropout"]
    assert len(regions[True]) == 4 and len(regions[False]) == 2, regions

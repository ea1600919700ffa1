"""``graph_optimizations.fused_gradient_sums`` (``graph/passes/gradient_sums.py``): a float32 sum of a
half-precision gradient (``Add(sum, Cast(g))``) as one ``AddHalf`` kernel node.

Checked on a tiny Hugging Face GPT-2 with a 1031-word vocabulary in float16 mixed precision, its loss in pieces
and its head's products padded (``aligned_products``): the tied embedding's gradient is the sum of the pieces'
head gradients, and with the switch their chain of sums is one ``AddHalf`` node that reads each padded product
itself (the chain's first term too, read in float16); the loss and every gradient bit for bit those of the graph
without it (the kernel widens and adds, in the chain's order, as Cast and Add do), and within the float16 bound of
float64 PyTorch. Sums it must leave alone: a broadcast, a cast another node reads too; a chain whose partial sum
another node reads stays two nodes.
"""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes import gradient_sums
from ort_trainer.kernels import DOMAIN
from ort_trainer.optim import SGDConfig

from models import tiny_gpt2
from test_aligned_products import VOCAB, _relative
from tolerances import check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")


def _step(model, desc, batch, on: bool, device: str, rows: int):
    options = {"device": {"id": device}, "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler":
                                   DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)},
               "graph_optimizations": {"aligned_products": True, "fused_cross_entropy": True, "loss_pieces": True,
                                       "loss_piece_elements": rows * VOCAB, "fused_gradient_sums": on}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    trainer._train_step_info.fetches = ["loss"]
    loss = float(trainer.train_step(*[t.to(device) for t in batch]).cpu())
    (key,) = [k for k in trainer._engine._session_sets if k is not None and k[1] == ()]
    graph = trainer._shapes.graphs_for(key)[0]().graph
    return loss, {w: g.float().cpu().numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}, graph


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("pieces", [4, 16])
def test_the_tied_embeddings_sums_read_the_half_gradients_bit_for_bit(monkeypatch, device, pieces):
    """The loss and every gradient bit for bit those without the switch, within the float16 bound of float64
    PyTorch; the head's gradient is summed from the pieces' padded products, read as they are, by one node (four
    pieces) or a chain of them (sixteen) (on CUDA, ``make gpu-check``: its kernel)."""
    from ort_trainer.graph.gradient import loss_pieces

    monkeypatch.setattr(loss_pieces, "_MIN_ROWS", 1)
    model, desc = tiny_gpt2(vocab=VOCAB)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    batch = (ids, torch.ones_like(ids), ids)
    (loss_off, grads_off, _), (loss_on, grads_on, graph) = (_step(model, desc, batch, on, device, 16 // pieces)
                                                            for on in (False, True))
    assert loss_on == loss_off
    for name, grad in grads_off.items():
        assert np.array_equal(grads_on[name], grad), name
    double = copy.deepcopy(model).double()
    out = double(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    out.loss.backward()
    # float16 mixed precision against float64: test_aligned_products.py's bound (~20 float16 roundings)
    check(abs(loss_on - float(out.loss.detach())) / float(out.loss.detach()), 1e-2, "loss")
    for name, parameter in double.named_parameters():
        check(_relative(grads_on[name], parameter.grad.numpy()), 1e-2, name)
    sums = {n.output[0]: n for n in graph.node if n.domain == DOMAIN and n.op_type == "AddHalf"}
    producers = {o: n for n in graph.node for o in n.output}
    # the pieces' head gradients: a chain of nodes of three half terms at most (gradient_sums._MAX_TERMS), the
    # first's first term in float16 too (the sum's rows an attribute), each term a piece's padded product
    chain = [sums["transformer.wte.weight_grad"]]
    while chain[0].input[0] in sums:
        chain.insert(0, sums[chain[0].input[0]])
    terms = [chain[0].input[0]] + [name for n in chain for name in n.input[1:]]
    assert len(terms) == pieces and all(len(n.input) <= 4 for n in chain), [list(n.input) for n in chain]
    assert all(producers[name].op_type in ("Gemm", "MatMul", "FusedMatMul") for name in terms), terms
    assert [[(a.name, a.i) for a in n.attribute] for n in chain] == [[("rows", VOCAB)]] + [[]] * (len(chain) - 1)
    # the residual stream's sums (a float32 sum and one half branch each) need no rows
    assert all(not n.attribute and len(n.input) == 2 for n in sums.values() if n not in chain)


def _graph(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "sums", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_broadcast_or_a_shared_cast_is_left_alone():
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    broadcast = _graph([helper.make_node("Cast", ["g"], ["c"], to=f32), helper.make_node("Add", ["s", "c"], ["y"])],
                       [("s", f32, [4, 8]), ("g", f16, [1, 8])], [("y", f32, [4, 8])])
    shared = _graph([helper.make_node("Cast", ["g"], ["c"], to=f32), helper.make_node("Add", ["s", "c"], ["y"])],
                    [("s", f32, [4, 8]), ("g", f16, [4, 8])], [("y", f32, [4, 8]), ("c", f32, [4, 8])])
    same = _graph([helper.make_node("Cast", ["g"], ["c"], to=f32), helper.make_node("Add", ["s", "c"], ["y"])],
                  [("s", f32, [4, 8]), ("g", f16, [4, 8])], [("y", f32, [4, 8])])
    assert gradient_sums.fused_gradient_sums(broadcast) == 0
    assert gradient_sums.fused_gradient_sums(shared) == 0
    assert gradient_sums.fused_gradient_sums(same) == 1
    assert [(n.op_type, list(n.input)) for n in same.graph.node if n.domain == DOMAIN] == [("AddHalf", ["s", "g"])]


def test_a_chain_is_one_node_unless_another_node_reads_a_partial_sum():
    """``s + g1 + g2 + g3`` (each g a float16 tensor cast to float32) is one ``AddHalf(s, g1, g2, g3)``; where a
    partial sum is a graph output too, the chain is cut there: two nodes."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16

    def chain(outputs):
        nodes = [helper.make_node("Cast", [f"g{i}"], [f"c{i}"], to=f32) for i in (1, 2, 3)]
        nodes += [helper.make_node("Add", [a, f"c{i}"], [f"p{i}"]) for i, a in ((1, "s"), (2, "p1"), (3, "p2"))]
        return _graph(nodes, [("s", f32, [4, 8])] + [(f"g{i}", f16, [4, 8]) for i in (1, 2, 3)],
                      [(name, f32, [4, 8]) for name in outputs])

    whole, cut = chain(["p3"]), chain(["p3", "p1"])
    assert gradient_sums.fused_gradient_sums(whole) == 3
    assert [(n.op_type, list(n.input), list(n.output)) for n in whole.graph.node if n.domain == DOMAIN] == [
        ("AddHalf", ["s", "g1", "g2", "g3"], ["p3"])]
    assert gradient_sums.fused_gradient_sums(cut) == 3
    assert [(list(n.input), list(n.output)) for n in cut.graph.node if n.domain == DOMAIN] == [
        (["s", "g1"], ["p1"]), (["p1", "g2", "g3"], ["p3"])]


def test_a_long_chain_is_nodes_of_three_half_tensors_at_most():
    """Seven half terms after a float32 sum: nodes of 3, 3 and 1 (gradient_sums._MAX_TERMS), each reading the one
    before, so that no node keeps more than three half gradients waiting."""
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    nodes = [helper.make_node("Cast", [f"g{i}"], [f"c{i}"], to=f32) for i in range(1, 8)]
    nodes += [helper.make_node("Add", ["s" if i == 1 else f"p{i - 1}", f"c{i}"], [f"p{i}"]) for i in range(1, 8)]
    model = _graph(nodes, [("s", f32, [4, 8])] + [(f"g{i}", f16, [4, 8]) for i in range(1, 8)], [("p7", f32, [4, 8])])
    assert gradient_sums.fused_gradient_sums(model) == 7
    assert [list(n.input) for n in model.graph.node if n.domain == DOMAIN] == [
        ["s", "g1", "g2", "g3"], ["p3", "g4", "g5", "g6"], ["p6", "g7"]]

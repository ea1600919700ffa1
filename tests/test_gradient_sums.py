"""``graph_optimizations.fused_gradient_sums`` (``graph/passes/gradient_sums.py``): a float32 sum of a
half-precision gradient (``Add(sum, Cast(g))``) as one ``AddHalf`` kernel node.

Checked on a tiny Hugging Face GPT-2 with a 1031-word vocabulary in float16 mixed precision, its loss in pieces
and its head's products padded (``aligned_products``): the tied embedding's gradient is the sum of the pieces'
head gradients and the embedding's, and with the switch every one of those sums is an ``AddHalf`` that reads the
padded product itself (the chain's first term too, read in float16); the loss and every gradient bit for bit those
of the graph without it (the kernel widens and adds as Cast and Add do), and within the float16 bound of float64
PyTorch. Sums it must leave alone: a
broadcast, a cast another node reads too.
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


def _step(model, desc, batch, on: bool, device: str):
    options = {"device": {"id": device}, "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler":
                                   DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)},
               "graph_optimizations": {"aligned_products": True, "fused_cross_entropy": True, "loss_pieces": True,
                                       "loss_piece_elements": 4 * VOCAB, "fused_gradient_sums": on}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    trainer._train_step_info.fetches = ["loss"]
    loss = float(trainer.train_step(*[t.to(device) for t in batch]).cpu())
    (key,) = [k for k in trainer._engine._session_sets if k is not None and k[1] == ()]
    graph = trainer._shapes.graphs_for(key)[0]().graph
    return loss, {w: g.float().cpu().numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}, graph


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_tied_embeddings_sums_read_the_half_gradients_bit_for_bit(monkeypatch, device):
    """The loss and every gradient bit for bit those without the switch, within the float16 bound of float64
    PyTorch; three sums or more read the padded head product itself (on CUDA, ``make gpu-check``: its kernel)."""
    from ort_trainer.graph.gradient import loss_pieces

    monkeypatch.setattr(loss_pieces, "_MIN_ROWS", 1)
    model, desc = tiny_gpt2(vocab=VOCAB)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    batch = (ids, torch.ones_like(ids), ids)
    (loss_off, grads_off, _), (loss_on, grads_on, graph) = (_step(model, desc, batch, on, device)
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
    sums = [n for n in graph.node if n.domain == DOMAIN and n.op_type == "AddHalf"]
    producers = {o: n for n in graph.node for o in n.output}
    # the pieces' head gradients (three sums of four pieces at least), each read from the padded product
    padded = [n for n in sums if producers[n.input[1]].op_type in ("Gemm", "MatMul", "FusedMatMul")]
    assert len(padded) >= 3, [(n.name, producers[n.input[1]].op_type) for n in sums]
    # the chain's first term read in float16 too, from its padded product, the sum's rows an attribute
    firsts = [n for n in sums if any(a.name == "rows" for a in n.attribute)]
    assert len(firsts) == 1 and producers[firsts[0].input[0]].op_type in ("Gemm", "MatMul", "FusedMatMul"), firsts


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

"""On the CPU the module's parameters and buffers are the trainer's own buffers (issue 24): no
second copy of the weights, and the module holds the trained values after every step, as with a
``torch.optim`` optimizer. Where the weights are double-buffered (``graph.optimizer='graph'``)
the module keeps its own memory and ``update_torch_model`` copies into it."""

import copy
import os
import sys

import numpy as np
import torch

from models import MLP, MLP_DESC, TinyEncoder, ENCODER_DESC, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig
from state_helpers import trained_mlp


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


def test_the_module_holds_the_trained_weights_in_the_engines_memory():
    model = TinyEncoder()
    initial = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, ENCODER_DESC, AdamConfig(lr=1e-2), loss_fn=mlm_loss)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        trainer.train_step(*mlm_batch(gen))
    engine = trainer._engine
    flat = _storage(engine.weights_flat[0])
    for name, parameter in model.named_parameters():
        assert _storage(parameter) == flat, name  # a view of the engine's flat weights: one copy in all
    weights = trainer.state_dict()["model"]["full_precision"]
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), weights[name])  # trained, without update_torch_model
    assert any(not torch.equal(model.state_dict()[n], initial[n]) for n in initial)
    trainer.update_torch_model()  # a no-op copy: still shared, still equal
    for name, parameter in model.named_parameters():
        assert _storage(parameter) == flat, name
        np.testing.assert_array_equal(parameter.detach().numpy(), weights[name])


def test_tied_weights_stay_one_parameter():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    desc = {"inputs": [("ids", ["batch"]), ("labels", ["batch"])], "outputs": [("loss", [], True), ("logits", ["batch", 10])]}
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    ids = torch.arange(6) % 10
    trainer.train_step(ids, ids)
    assert model[1].weight is model[0].weight
    (name,) = [w for w in trainer.state_dict()["model"]["full_precision"] if w.endswith("weight")][:1]
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), trainer.state_dict()["model"]["full_precision"][name])


def test_double_buffered_weights_leave_the_module_to_update_torch_model():
    model = MLP()
    initial = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy,
                         options={"graph": {"optimizer": "graph"}})
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, initial[name], rtol=0, atol=0)  # its own memory, untouched
    trainer.update_torch_model()
    weights = trainer.state_dict()["model"]["full_precision"]
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), weights[name])


def test_loading_a_state_reaches_the_shared_module():
    source = trained_mlp(3)
    model = MLP()
    target = trained_mlp(1, model=model)
    target.load_state_dict(source.state_dict())
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), source.state_dict()["model"]["full_precision"][name])


def test_the_module_lets_go_of_its_weights_before_the_gradients_and_moments_exist(monkeypatch):
    """The engine hands its weight buffers to the trainer before it allocates anything else, so the
    module's own copy is freed first: at no point does the process hold the weights twice beside
    the optimizer's state (a 656 M-weight model: 2.6 GB at its peak)."""
    model = TinyEncoder()
    parameters = dict(model.named_parameters())
    old = {name: _storage(p) for name, p in parameters.items()}
    flat_buffers = []  # the engine's flat buffers (zero-filled, or the weights' left to their copy), in order

    def counting(make):
        def counted(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(os.path.join("ort_trainer", "engine.py")):
                flat_buffers.append(args)
            return make(*args, **kwargs)
        return counted

    monkeypatch.setattr(torch, "zeros", counting(torch.zeros))
    monkeypatch.setattr(torch, "empty", counting(torch.empty))
    seen = {}
    share = ORTTrainer._share_module_memory

    def watched(self, live):
        seen["buffers allocated before"] = len(flat_buffers)
        share(self, live)
        seen["module's storage"] = {name: _storage(p) for name, p in parameters.items()}

    monkeypatch.setattr(ORTTrainer, "_share_module_memory", watched)
    trainer = ORTTrainer(model, ENCODER_DESC, AdamConfig(lr=1e-2), loss_fn=mlm_loss)
    trainer.train_step(*mlm_batch(torch.Generator().manual_seed(0)))
    assert seen["buffers allocated before"] == 1  # the flat weights alone: no moments, no gradients yet
    assert len(flat_buffers) > 1  # they came after
    flat = _storage(trainer._engine.weights_flat[0])
    for name, storage in seen["module's storage"].items():
        assert storage == flat != old[name], name  # already the engine's memory, in the call back


def _malloc_in_use():
    """Bytes glibc's malloc has handed out and not had back (None off glibc, or before 2.33)."""
    import ctypes
    import gc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    gc.collect()
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def test_a_graph_kept_after_edits_holds_only_what_it_holds_now():
    """onnx's upb protobuf keeps what an edit removes allocated until the whole model is freed (BERT-base's
    gradient graph held ~60 MB that way after the joint passes): the graphs the trainer keeps are
    ``onnx_graph.compacted`` copies."""
    import onnx
    import pytest
    from onnx import helper

    from ort_trainer.graph.onnx_graph import compacted

    if _malloc_in_use() is None:
        pytest.skip("reads glibc's malloc statistics")
    io = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])]
    model = helper.make_model(helper.make_graph([], "g", io, io))
    before = _malloc_in_use()
    for _ in range(5):  # a pass that rewrites the node list, five times over
        nodes = [helper.make_node("Identity", ["x"], [f"y{i}"], name=f"n{i}") for i in range(20000)]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    del nodes, model.graph.node[:]
    edited = _malloc_in_use() - before
    kept = compacted(model)
    assert kept.SerializeToString() == model.SerializeToString()
    del model
    # 100,000 nodes were made (> 5 MB however small a node is); the graph holds none of them now
    assert edited > 5e6 and _malloc_in_use() - before < edited / 4, (edited, _malloc_in_use() - before)

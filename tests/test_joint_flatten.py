"""``graph/gradient/joint_flatten.py``: the joint graph's calling convention changed in place where
``aot_export_module`` traces the whole joint graph a second time (3-6 s of GPT-2 small's cold
build). The gradient graph built either way is the same computation: the same ONNX nodes (each
identified by its operator, attributes and what its inputs are computed from, not by its name),
the same outputs in the same order."""

import collections
import contextlib
import hashlib

import numpy as np
import onnx
import pytest
import torch

from ort_trainer import _runtime
from ort_trainer.graph.gradient import autograd, joint_flatten, joint_onnx
from ort_trainer.model_desc import parse_model_desc

from models import tiny_gpt2

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")


def _computation(model: onnx.ModelProto) -> tuple:
    """Each node by what it computes (operator, attributes, and its inputs' own identities, from the
    graph inputs and initializer values up), as a multiset; the outputs' identities and types in
    order; the inputs' names and types. Value names and node order do not enter."""
    graph, identity = model.graph, {"": ""}
    for value in graph.input:
        identity[value.name] = "input " + value.name
    for tensor in graph.initializer:
        value = onnx.numpy_helper.to_array(tensor)
        identity[tensor.name] = f"constant {value.dtype} {value.shape} " + hashlib.sha256(value.tobytes()).hexdigest()
    nodes = collections.Counter()
    for node in graph.node:  # topologically ordered
        key = hashlib.sha256(repr((node.domain, node.op_type, [identity[name] for name in node.input],
                                   sorted(a.SerializeToString() for a in node.attribute))).encode()).hexdigest()
        nodes[key] += 1
        for index, name in enumerate(node.output):
            identity[name] = f"{key}:{index}"
    outputs = [(value.name, identity[value.name], value.type.SerializeToString()) for value in graph.output]
    inputs = [(value.name, value.type.SerializeToString()) for value in graph.input]
    return nodes, outputs, inputs


def _gradient_graph(model, desc, batch, flattened: bool, monkeypatch, **build) -> onnx.ModelProto:
    """The gradient graph of ``model``, its joint graph flattened in place or retraced by torch."""
    monkeypatch.setattr(joint_onnx, "flattened_in_place",
                        joint_flatten.flattened_in_place if flattened else contextlib.nullcontext)
    traced = autograd.trace(model, None, parse_model_desc(desc), [np.asarray(t) for t in batch],
                            frozen_weights=build.pop("frozen_weights", ()), autocast=build.pop("autocast", None))
    return autograd.build(traced, with_eval=False, **build).gradient


def _flattened_count(monkeypatch) -> list:
    """Calls of ``joint_flatten.flatten``, each True where it flattened (did not hand back to torch)."""
    calls, flatten = [], joint_flatten.flatten

    def counted(joint, inputs):
        flattened = flatten(joint, inputs)
        calls.append(flattened is not None)
        return flattened

    monkeypatch.setattr(joint_flatten, "flatten", counted)
    return calls


def _gpt2_batch(seed: int = 0) -> list:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))
    return [ids, torch.ones_like(ids), ids]


@pytest.mark.parametrize("autocast", [None, "float16"])
def test_hf_gpt2_s_gradient_graph_is_the_retraced_one(autocast, monkeypatch):
    """HF GPT-2 (tied embedding, masks, symbolic batch and sequence, the kept ``gelu_backward`` of
    the gelu pass; float16: autocast's casts and the half-precision attention), every output and the
    loss alone (the sparse-labels projection)."""
    model, desc = tiny_gpt2(seq=8)
    build = {"gelu": True, "half_attention": autocast is not None, "autocast": autocast}
    for outputs, sparse in ((None, False), (["loss"], True)):
        calls = _flattened_count(monkeypatch)
        flat = _gradient_graph(model, desc, _gpt2_batch(), True, monkeypatch, outputs=outputs,
                               sparse_labels=sparse, **dict(build))
        assert calls == [True]
        retraced = _gradient_graph(model, desc, _gpt2_batch(), False, monkeypatch, outputs=outputs,
                                   sparse_labels=sparse, **dict(build))
        assert _computation(flat) == _computation(retraced)


class _Normalized(torch.nn.Module):
    """BatchNorm (running statistics: buffers the joint graph returns updated), a frozen layer, a
    second output that needs no gradient."""

    def __init__(self):
        super().__init__()
        self.frozen, self.linear, self.norm = torch.nn.Linear(6, 6), torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x, y):
        h = self.norm(self.linear(torch.relu(self.frozen(x))))
        return torch.nn.functional.mse_loss(h, y), h


def test_batchnorm_and_frozen_weights_gradient_graph_is_the_retraced_one(monkeypatch):
    torch.manual_seed(0)
    model = _Normalized()
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch", 4])],
            "outputs": [("loss", [], True), ("h", ["batch", 4])]}
    batch = [torch.randn(5, 6), torch.randn(5, 4)]
    build = {"frozen_weights": ["frozen.weight", "frozen.bias"]}
    calls = _flattened_count(monkeypatch)
    flat = _gradient_graph(model, desc, batch, True, monkeypatch, **dict(build))
    assert calls == [True]
    retraced = _gradient_graph(model, desc, batch, False, monkeypatch, **dict(build))
    assert _computation(flat) == _computation(retraced)
    names = [value.name for value in flat.graph.output]
    assert "norm.running_mean.updated" in names and not any(name.startswith("frozen.") for name in names), names


def test_a_graph_it_does_not_expect_is_left_to_torch_s_retrace(monkeypatch):
    """Inputs whose ``requires_grad`` disagrees with the gradients (what ``flattened_joint`` refuses):
    ``flatten`` declines and leaves the graph untouched; the build then goes on as torch's; and
    ``make_fx`` is torch's again after the context, also after an error."""
    from torch._functorch import aot_autograd

    declined, flatten = [], joint_flatten.flatten

    def disagreeing_first(joint, inputs):
        code = joint.code
        declined.append(flatten(joint, [torch.empty(0) for _ in inputs]) is None and joint.code == code)
        return flatten(joint, inputs)

    monkeypatch.setattr(joint_flatten, "flatten", disagreeing_first)
    model, desc = tiny_gpt2(seq=8)
    _gradient_graph(model, desc, _gpt2_batch(), True, monkeypatch)
    assert declined == [True]

    make_fx = aot_autograd.make_fx
    with pytest.raises(RuntimeError, match="inside"):
        with joint_flatten.flattened_in_place():
            assert aot_autograd.make_fx is not make_fx
            raise RuntimeError("inside")
    assert aot_autograd.make_fx is make_fx
    assert joint_flatten.flatten(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), []) is None  # not a joint graph

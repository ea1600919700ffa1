"""ONNX models with their loss inside, turned into torch modules for PyTorch's autograd.

The converted module must compute what ONNX Runtime computes on the original graph, give the
gradients of the torch module the graph was exported from, and go through ``torch.export`` (static
and symbolic sizes) and the joint forward/backward export the current runtime trains with.
"""

import copy
import io
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from models import ENCODER_DESC, MLP_DESC, MLPWithLoss, TinyEncoder, mlm_batch, mlm_loss, mlp_batch
from ort_trainer.graph.gradient import onnx_to_torch
from ort_trainer.graph.gradient.onnx_to_torch import UnsupportedOnnxOperatorError, onnx_to_module
from tolerances import FLOAT32, REDUCTION

# The converted module (PyTorch's float32 kernels) against ONNX Runtime on the graph it came from,
# against float64 PyTorch, or against itself through torch.export: the same operations, each sum
# added in each side's own order. Along the chain of sums from the inputs to an output the errors
# add (Higham's bound: a sum of n terms is off by ≤ n·u of their magnitudes); the encoder's forward
# adds ≈ 480 terms in sequence (embeddings 2, attention 32 + 8 + 7 + 7 + 32, LayerNorm 2·32,
# feed-forward 32 + 64, two LayerNorms 2·2·32, head 32, log-softmax 50, mean ≤ 21) and a gradient
# the backward's as well. On values ≤ 4.5 in magnitude (losses near ln 50 ≈ 3.9, logits,
# log-probabilities; gradients ≤ 0.94) that is ≥ 480·u·4.5 = 1.3e-4 absolute in the worst case;
# against ONNX Runtime, two float32 sides, the simplest cases give 2·67·u·1.6 = 1.3e-5 (the MLP:
# 21 + 33 + 5 + 8 terms in sequence) and 2·40·u·4.5 = 2.1e-5 (a single SoftmaxCrossEntropyLoss,
# ≈ 40 operations). TOL, absolute, is below those worst cases. Observed at 1 and 2 threads:
# ≤ 4.8e-7 (outputs and losses) and 2.1e-7 (gradients), 21x under; the running statistics
# ≤ 6.0e-8, the torch.export copies 0.
TOL = 1e-5


@pytest.fixture
def converter():
    pytest.importorskip("onnx2fx", reason="the ONNX-to-torch conversion needs onnx2fx (pip install onnx2fx)")


def _export(module, args, names, outputs, dynamic_axes=None, training=True):
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(module, args, buffer, dynamo=False, training=mode, do_constant_folding=False,
                      opset_version=17, input_names=names, output_names=outputs, dynamic_axes=dynamic_axes)
    return onnx.load_from_string(buffer.getvalue())


def _ort(model, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {k: np.asarray(v) for k, v in feeds.items()})


class EncoderWithLoss(torch.nn.Module):
    """The tests' transformer encoder (embeddings, attention with softmax, LayerNorm, GELU) and its
    masked-LM loss; every view and position range is computed from the input's sizes."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.encoder = TinyEncoder(layers=1, dropout=dropout)

    def forward(self, ids, labels):
        logits = self.encoder(ids)
        return mlm_loss(logits, labels), logits


class CNNWithLoss(torch.nn.Module):
    """Conv, BatchNorm (momentum 0.3: ONNX momentum 0.7), max-pool, flatten and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4, momentum=0.3)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, images, label):
        x = F.max_pool2d(torch.relu(self.bn(self.conv(images))), 2)
        logits = self.fc(torch.flatten(x, 1))
        return F.cross_entropy(logits, label), logits


def _mlp_case():
    module = MLPWithLoss()
    x, y = mlp_batch(torch.Generator().manual_seed(1))
    model = _export(module, (x, y), ["x", "label"], ["loss", "logits"],
                    {"x": {0: "batch"}, "label": {0: "batch"}, "logits": {0: "batch"}})
    return module, model, MLP_DESC, (x, y)


def _encoder_case(dropout=0.0):
    module = EncoderWithLoss(dropout)
    ids, labels = mlm_batch(torch.Generator().manual_seed(2), batch=3, seq=7)
    axes = {"ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    model = _export(module, (ids, labels), ["ids", "labels"], ["loss", "logits"], axes)
    return module, model, ENCODER_DESC, (ids, labels)


CNN_DESC = {"inputs": [("images", ["batch", 1, 8, 8]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}


def _cnn_case():
    module = CNNWithLoss()
    gen = torch.Generator().manual_seed(3)
    images, label = torch.randn(6, 1, 8, 8, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    model = _export(module, (images, label), ["images", "label"], ["loss", "logits"])
    return module, model, CNN_DESC, (images, label)


class LogSoftmaxWithLoss(torch.nn.Module):
    """Sequence tagger with LogSoftmax and NegativeLogLikelihoodLoss (``ignore_index``): the reshape
    between them keeps the exporter from fusing the two into SoftmaxCrossEntropyLoss."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 8)
        self.proj = torch.nn.Linear(8, 6)

    def forward(self, ids, tags):
        log_prob = F.log_softmax(self.proj(torch.tanh(self.embed(ids))), dim=-1)
        return F.nll_loss(log_prob.reshape(-1, 6), tags.reshape(-1), ignore_index=-1), log_prob


TAGGER_DESC = {"inputs": [("ids", ["batch", "seq"]), ("tags", ["batch", "seq"])],
               "outputs": [("loss", [], True), ("log_prob", ["batch", "seq", 6])]}


def _tagger_case():
    module = LogSoftmaxWithLoss()
    gen = torch.Generator().manual_seed(6)
    ids, tags = torch.randint(0, 30, (4, 5), generator=gen), torch.randint(-1, 6, (4, 5), generator=gen)
    axes = {"ids": {0: "batch", 1: "seq"}, "tags": {0: "batch", 1: "seq"}, "log_prob": {0: "batch", 1: "seq"}}
    model = _export(module, (ids, tags), ["ids", "tags"], ["loss", "log_prob"], axes)
    return module, model, TAGGER_DESC, (ids, tags)


CASES = {"mlp": _mlp_case, "encoder": _encoder_case, "cnn": _cnn_case, "tagger": _tagger_case}


def _grads(module, args):
    module.zero_grad()
    loss = module(*args)[0]
    loss.backward()
    return loss, {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_onnx_runtime_and_gradients_equal_the_torch_module(converter, case):
    source, model, desc, args = CASES[case]()
    names = [d[0] for d in desc["inputs"]]
    converted, torch_keys = onnx_to_module(model, desc)

    # the converted module runs the ONNX graph: ONNX Runtime's outputs (training mode, batch statistics)
    expected = _ort(model, dict(zip(names, args)))
    with torch.no_grad():
        got = converted(*args)
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e, rtol=0, atol=TOL)

    # its gradients are the torch module's, computed in float64
    reference = copy.deepcopy(source).double()
    ref_args = [a.double() if a.is_floating_point() else a for a in args]
    ref_loss, ref_grads = _grads(reference, ref_args)
    loss, grads = _grads(converted, args)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=TOL)
    by_key = {keys[0]: name for name, keys in torch_keys.items()}
    assert set(grads) == {k for k in by_key if k in ref_grads}
    for key, grad in grads.items():
        torch.testing.assert_close(grad.double(), ref_grads[by_key[key]], rtol=0, atol=TOL, msg=key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_keeps_the_initializer_names(converter, case):
    source, model, desc, _ = CASES[case]()
    converted, torch_keys = onnx_to_module(model, desc)
    floats = [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]
    assert torch_keys == {name: [name] for name in floats}
    state = converted.state_dict()
    assert sorted(state) == sorted(floats)
    initializers = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for name in floats:
        np.testing.assert_array_equal(state[name].numpy(), initializers[name])
    # BatchNorm running statistics are buffers, every other float initializer a parameter
    statistics = {k for k in floats if "running" in k}
    assert {k for k, _ in converted.named_buffers()} == statistics
    assert {k for k, _ in converted.named_parameters()} == set(floats) - statistics


def test_batchnorm_updates_its_running_statistics_as_onnx_runtime_does(converter):
    _, model, desc, args = _cnn_case()
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in bn.output[1:]])
    expected = _ort(exposed, {"images": args[0], "label": args[1]})
    converted, _ = onnx_to_module(model, desc)
    with torch.no_grad():
        converted(*args)
    np.testing.assert_allclose(converted.get_buffer(bn.input[3]).numpy(), expected[2], rtol=0, atol=TOL)
    np.testing.assert_allclose(converted.get_buffer(bn.input[4]).numpy(), expected[3], rtol=0, atol=TOL)

    # eval(): the running statistics normalise, as in torch.nn.BatchNorm2d
    converted.eval()
    reference = CNNWithLoss().eval()
    reference.load_state_dict(converted.state_dict(), strict=False)
    with torch.no_grad():
        for a, b in zip(converted(*args), reference(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    np.testing.assert_array_equal(converted.get_buffer("bn.running_mean").numpy(), reference.bn.running_mean.numpy())


def test_dropout_draws_a_mask_in_training_and_is_off_in_eval(converter):
    source, model, desc, args = _encoder_case(dropout=0.3)
    converted, _ = onnx_to_module(model, desc)
    # same seed, same mask: the converted graph's dropout is PyTorch's
    torch.manual_seed(11)
    loss, grads = _grads(converted, args)
    torch.manual_seed(11)
    ref_loss, ref_grads = _grads(source, args)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=TOL)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=0, atol=TOL, msg=key)
    torch.manual_seed(12)
    # not a tolerance: a new mask changes the loss (by 0.13 here), far more than the 1e-4 (10·TOL) asked
    assert _grads(converted, args)[0].item() != pytest.approx(loss.item(), abs=1e-4)  # a new mask
    converted.eval()
    source.eval()
    with torch.no_grad():
        for a, b in zip(converted(*args), source(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_torch_export_with_static_and_symbolic_sizes(converter):
    _, model, desc, args = _encoder_case()
    converted, _ = onnx_to_module(model, desc)
    static = torch.export.export(converted, args)
    with torch.no_grad():
        for a, b in zip(static.module()(*args), converted(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=64)
    symbolic = torch.export.export(converted, args, dynamic_shapes=(({0: batch, 1: seq}, {0: batch, 1: seq}),))
    other = mlm_batch(torch.Generator().manual_seed(4), batch=2, seq=11)
    with torch.no_grad():
        for a, b in zip(symbolic.module()(*other), converted(*other)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)


class _Detached(torch.nn.Module):
    """The loss and, detached, the other outputs: what the joint forward/backward export takes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        loss, *rest = self.inner(*args)
        return (loss, *(r.detach() for r in rest))


@pytest.mark.parametrize("case", ["encoder", "cnn"])
def test_joint_forward_backward_export_gives_the_gradients(converter, case):
    from torch.export.experimental import _export_forward_backward

    _, model, desc, args = CASES[case]()
    converted, _ = onnx_to_module(model, desc)
    joint = _export_forward_backward(torch.export.export(_Detached(converted), args), joint_loss_index=0)
    kinds = [s.kind.name for s in joint.graph_signature.output_specs]
    assert kinds.count("GRADIENT_TO_PARAMETER") == len(list(converted.parameters()))
    assert kinds.count("BUFFER_MUTATION") == (2 if case == "cnn" else 0)
    state, user_inputs = joint.state_dict, iter(args)
    flat = [state[spec.target] if spec.kind.name in ("PARAMETER", "BUFFER")
            else joint.constants[spec.target] if spec.kind.name == "CONSTANT_TENSOR" else next(user_inputs)
            for spec in joint.graph_signature.input_specs]
    results = joint.graph_module(*flat)
    _, grads = _grads(converted, args)
    by_parameter = {s.target: r for s, r in zip(joint.graph_signature.output_specs, results)
                    if s.kind.name == "GRADIENT_TO_PARAMETER"}
    assert sorted(by_parameter) == sorted("inner." + key for key in grads)
    for key, grad in grads.items():
        torch.testing.assert_close(by_parameter["inner." + key], grad, rtol=0, atol=TOL, msg=key)


def _graph_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_softmax_cross_entropy_with_log_prob_weights_and_ignore_index(converter):
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 4, "d"])
    labels = helper.make_tensor_value_info("labels", TensorProto.INT64, ["n", "d"])
    weights = onnx.numpy_helper.from_array(np.array([1.0, 0.5, 2.0, 1.5], np.float32), "class_weights")
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels", "class_weights"], ["loss", "log_prob"],
                            ignore_index=1, reduction="mean")
    model = _graph_model([node], [scores, labels],
                         [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                          helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, ["n", 4, "d"])], [weights])
    desc = {"inputs": [("scores", ["n", 4, "d"]), ("labels", ["n", "d"])],
            "outputs": [("loss", [], True), ("log_prob", ["n", 4, "d"])]}
    converted, torch_keys = onnx_to_module(model, desc)
    assert torch_keys == {"class_weights": ["class_weights"]}
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 4, 5, generator=gen), torch.randint(0, 4, (3, 5), generator=gen)
    with torch.no_grad():
        got = converted(x, y)
    for e, g in zip(_ort(model, {"scores": x, "labels": y}), got):
        np.testing.assert_allclose(g.numpy(), e, rtol=0, atol=TOL)


def test_size_arithmetic_stays_symbolic_under_torch_export(converter):
    """Shape/Gather/Div/Concat/Reshape, ConstantOfShape/Equal/Where/Expand, Range, and Slices
    (of a constant table, of a tensor) ending at a size:
    ``y = (x.view(b, s/2, 2*h) + (arange(s/2) + table[:s/2])[:, None]).expand(...)[:, :s/2-1]``."""
    i64 = lambda name, values: onnx.numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["s"], axis=0),
        helper.make_node("Div", ["s", "two"], ["half"]),
        helper.make_node("Mul", ["h", "two"], ["wide"]),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
        helper.make_node("Unsqueeze", ["half", "axis0"], ["half1"]),
        helper.make_node("Unsqueeze", ["wide", "axis0"], ["wide1"]),
        helper.make_node("Concat", ["b1", "half1", "wide1"], ["view"], axis=0),
        helper.make_node("Reshape", ["x", "view"], ["viewed"]),
        helper.make_node("Range", ["zero", "half", "one"], ["positions"]),
        helper.make_node("Slice", ["table", "zero1", "half1"], ["first"]),
        helper.make_node("Add", ["positions", "first"], ["twice"]),
        helper.make_node("Cast", ["twice"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["positions_f", "axis1"], ["column"]),
        helper.make_node("Add", ["viewed", "column"], ["shifted"]),
        helper.make_node("ConstantOfShape", ["three"], ["ones"],
                         value=onnx.numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Mul", ["ones", "minus_one"], ["minus"]),
        helper.make_node("Concat", ["b1", "half1", "wide1"], ["target"], axis=0),
        helper.make_node("Equal", ["target", "minus"], ["keep"]),
        helper.make_node("Where", ["keep", "ones", "target"], ["expand_to"]),
        helper.make_node("Expand", ["shifted", "expand_to"], ["expanded"]),
        helper.make_node("Sub", ["half1", "one1"], ["end"]),
        helper.make_node("Slice", ["expanded", "zero1", "end", "one1"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    constants = [i64("zero", 0), i64("one", 1), i64("two", 2), i64("h", 3), i64("axis0", [0]), i64("axis1", [1]),
                 i64("three", [3]), i64("minus_one", -1), i64("one1", [1]), i64("zero1", [0]),
                 i64("table", np.arange(64))]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 3])
    model = _graph_model(nodes, [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                                      helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], constants)
    desc = {"inputs": [("x", ["b", "s", 3])], "outputs": [("loss", [], True), ("y", ["b", "t", 6])]}
    converted, torch_keys = onnx_to_module(model, desc)
    assert torch_keys == {} and not list(converted.state_dict())
    x1 = torch.randn(2, 8, 3)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=64)
    exported = torch.export.export(converted, (x1,), dynamic_shapes=(({0: batch, 1: 2 * seq},),))
    for value in (x1, torch.randn(3, 12, 3)):
        expected = _ort(model, {"x": value})
        # y is x plus an integer position (one rounding, the same on both sides); the loss sums ≤ 90
        # elements of y (3·5·6), ≈ 360 in all, in another order on each side: ≤ 2·90·u·Σ|y| ≈ 4e-3
        # apart in the worst case. The values kept allow 1e-5 + 1e-6·|loss| (3.7e-4 at 362).
        # Observed at 1 and 2 threads: ≤ 3.1e-5 on the loss (8.4e-8 of it), 12x under.
        for e, g in zip(expected, converted(value)):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-6, atol=TOL)  # the loss sums to ~400
        for e, g in zip(expected, exported.module()(value)):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-6, atol=TOL)


class PadWithLoss(torch.nn.Module):
    """``F.pad``: the exporter computes its pads from constants (ConstantOfShape, Concat, a
    reversing Slice, Transpose), which must reach the pad as numbers."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        y = F.pad(x * self.weight, (1, 2), value=0.5)
        return (y * y).sum(), y


def test_pads_computed_from_constants_reach_pad_as_numbers(converter):
    x = torch.randn(3, 4)
    model = _export(PadWithLoss(), (x,), ["x"], ["loss", "y"], {"x": {0: "batch"}, "y": {0: "batch"}})
    assert {"Pad", "Slice", "Transpose", "ConstantOfShape"} <= {n.op_type for n in model.graph.node}
    desc = {"inputs": [("x", ["batch", 4])], "outputs": [("loss", [], True), ("y", ["batch", 7])]}
    converted, _ = onnx_to_module(model, desc)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(converted, (x,), dynamic_shapes=(({0: batch},),))
    for value in (x, torch.randn(5, 4)):
        expected = _ort(model, {"x": value})
        # y is x·w padded (one rounding, the same on both sides); the loss sums ≤ 35 squares, in
        # another order on each side: ≤ 35·u of the sum of their magnitudes, the loss itself
        # (Higham's bound); 64·u covers it (observed at 1 and 2 threads: 2.3·u, 28x under)
        with torch.no_grad():
            for e, got in zip(expected, converted(value)):
                np.testing.assert_allclose(got.numpy(), e, rtol=REDUCTION * FLOAT32, atol=0)
            for e, got in zip(expected, exported.module()(value)):
                np.testing.assert_allclose(got.numpy(), e, rtol=REDUCTION * FLOAT32, atol=0)


def test_initializer_names_that_are_no_torch_paths_map_through_torch_keys(converter):
    f32 = lambda name, values: onnx.numpy_helper.from_array(np.array(values, np.float32), name)  # noqa: E731
    names = ["onnx::MatMul_7", "block.scale", "block", "/fc/bias"]
    nodes = [helper.make_node("MatMul", ["x", names[0]], ["h"]), helper.make_node("Mul", ["h", names[1]], ["s"]),
             helper.make_node("Add", ["s", names[2]], ["t"]), helper.make_node("Add", ["t", names[3]], ["u"]),
             helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0)]
    initializers = [f32(names[0], np.ones((3, 2))), f32(names[1], [2.0, 3.0]), f32(names[2], [0.5, 0.25]),
                    f32(names[3], [1.0, -1.0])]
    model = _graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                         [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers)
    converted, torch_keys = onnx_to_module(model, {"inputs": [("x", [4, 3])], "outputs": [("loss", [], True)]})
    assert torch_keys[names[1]] == [names[1]]
    keys = [torch_keys[n][0] for n in names]
    assert len(set(keys)) == len(names) and sorted(converted.state_dict()) == sorted(keys)
    state = converted.state_dict()
    for name, initializer in zip(names, initializers):
        np.testing.assert_array_equal(state[torch_keys[name][0]].numpy(), onnx.numpy_helper.to_array(initializer))
    x = torch.randn(4, 3)
    loss, grads = _grads(converted, (x,))
    # the loss adds 3 products per row, 2 scalings and 2 additions, then 8 terms (Σ|terms| ≈ 19
    # against a loss of ≈ 13), on each side: ≤ 2·14·u·19/13 = 2.4e-6 of it apart at worst, the value
    # kept is below it. Observed at 1 and 2 threads: 0. The bias gradient adds four 1.0s: exact.
    np.testing.assert_allclose(loss.item(), _ort(model, {"x": x})[0], rtol=1e-6)
    np.testing.assert_array_equal(grads[torch_keys[names[3]][0]].numpy(), [4.0, 4.0])


def test_inputs_follow_the_description_order_and_names(converter):
    source, model, _, (x, y) = _mlp_case()
    desc = {"inputs": [("label", ["batch"]), ("x", ["batch", 20])], "outputs": [("logits", ["batch", 5]),
                                                                              ("loss", [], True)]}
    converted, _ = onnx_to_module(model, desc)
    with torch.no_grad():
        logits, loss = converted(y, x)
        by_name = converted(x=x, label=y)
        ref_loss, ref_logits = source(x, y)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOL)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=TOL)
    torch.testing.assert_close(by_name[1], loss)
    with pytest.raises(TypeError, match="missing"):
        converted(y)


def test_a_description_that_does_not_match_the_model_is_refused(converter):
    _, model, _, _ = _mlp_case()
    bad = {"inputs": [("features", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    with pytest.raises(ValueError, match="'features' is not an input of the ONNX model"):
        onnx_to_module(model, bad)


def test_an_unsupported_operator_is_named_with_the_runtime_that_trains_it(converter):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                                    [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("Frobnicate", ["x"], ["f"], domain="com.example", name="frob"),
             helper.make_node("ReduceSum", ["f"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "s"], ["c"]),
             helper.make_node("If", ["c"], ["loss"], then_branch=then_branch, else_branch=then_branch, name="branch")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    desc = {"inputs": [("x", [2, 3])], "outputs": [("loss", [], True)]}
    with pytest.raises(UnsupportedOnnxOperatorError) as raised:
        onnx_to_module(model, desc)
    message = str(raised.value)
    assert "com.example::Frobnicate (node 'frob')" in message
    assert "If (node 'branch')" in message
    assert 'pip install "ort_trainer[training]"' in message
    assert raised.value.operators == {("com.example", "Frobnicate"): ["frob"], ("", "If"): ["branch"]}
    assert isinstance(raised.value, ValueError)


def test_without_the_converter_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx2fx", None)
    model = _graph_model([helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0)],
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                         [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    with pytest.raises(ImportError, match=r"pip install onnx2fx .*ort_trainer\[training\]"):
        onnx_to_module(model, {"inputs": [("x", [2])], "outputs": [("loss", [], True)]})
    assert onnx_to_torch.CONVERTER == "onnx2fx"

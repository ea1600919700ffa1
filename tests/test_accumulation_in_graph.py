"""Gradient accumulation inside the "torch" source's graph: each gradient output returns its
accumulator input plus the micro-batch's gradient, and the engine binds both to one buffer
(``onnx_graph.sum_into_inputs``). Checked against float64 sums, through ONNX Runtime's optimizer."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from models import MLP, MLP_DESC, clone, mlp_batch
from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.onnx_graph import dangling_names, sum_into_inputs
from ort_trainer.optim import SGDConfig
from tolerances import FLOAT32, check, relative_error

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

M, K, N = 24, 40, 16
RUNS = 3
# Each output after 3 runs: 3 float32 sums (the accumulator's two additions and the product or the
# reduction of ≤ 40 terms, each within 40u of its magnitude, Higham) against the float64 sum of the
# same float32 inputs: ≤ 3 · (40 + 2) · u = 7.5e-6 of the largest value. Observed at 1 and 2
# threads: 2.1e-7, 36x under.
GRAPH_BOUND = RUNS * (K + 2) * FLOAT32


def _graph() -> onnx.ModelProto:
    """Every kind of value an accumulated output can have:

    - ``prod = MatMul(a, b)``: ONNX Runtime's CPU optimizer fuses it and the accumulator's ``Add``
      into one ``Gemm``;
    - ``cols = ReduceSum(a)``, also read by ``twice`` and by an ``If``'s subgraph (``branch``);
    - ``const``, an initializer;
    - ``folded``: ``Gemm(aᵀ, b)`` through two cancelling ``Transpose`` nodes (the exporter's weight
      gradients), and ``folded_id``: ``Gemm(a, b)`` through an ``Identity``: both take the accumulator
      as ``C``;
    - ``shared = Gemm(a, b)``, also read by ``negated``, and ``flipped = Transpose(Gemm(a, bᵀ))``:
      these keep an ``Add``.
    """
    then = helper.make_graph([helper.make_node("Identity", ["cols"], ["picked"])], "then", [],
                             [helper.make_tensor_value_info("picked", TensorProto.FLOAT, [K])])
    other = helper.make_graph([helper.make_node("Neg", ["cols"], ["negated_cols"])], "else", [],
                              [helper.make_tensor_value_info("negated_cols", TensorProto.FLOAT, [K])])
    nodes = [helper.make_node("MatMul", ["a", "b"], ["prod"]),
             helper.make_node("ReduceSum", ["a", "axis"], ["cols"], keepdims=0),
             helper.make_node("Mul", ["cols", "two"], ["twice"]),
             helper.make_node("If", ["flag"], ["branch"], then_branch=then, else_branch=other),
             helper.make_node("Gemm", ["at", "b"], ["product_t"], transA=1),
             helper.make_node("Transpose", ["product_t"], ["product_tt"], perm=[1, 0]),
             helper.make_node("Transpose", ["product_tt"], ["folded"], perm=[1, 0]),
             helper.make_node("Gemm", ["a", "b"], ["product_id"]),
             helper.make_node("Identity", ["product_id"], ["folded_id"]),
             helper.make_node("Gemm", ["a", "b"], ["shared"]),
             helper.make_node("Neg", ["shared"], ["negated"]),
             helper.make_node("Gemm", ["a", "bt"], ["product_bt"], transB=1),
             helper.make_node("Transpose", ["product_bt"], ["flipped"], perm=[1, 0])]
    floats = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        nodes, "g", [floats("a", [M, K]), floats("b", [K, N]), floats("at", [K, M]), floats("bt", [N, K]),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [floats(name, shape) for name, shape in OUTPUTS.items()],
        initializer=[numpy_helper.from_array(np.array([0], np.int64), "axis"),
                     numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                     numpy_helper.from_array(np.array([1.0, -2.0, 0.5], np.float32), "const")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


OUTPUTS = {"prod": [M, N], "cols": [K], "twice": [K], "branch": [K], "const": [3], "folded": [M, N],
           "folded_id": [M, N], "shared": [M, N], "negated": [M, N], "flipped": [N, M]}
ACCUMULATED = ["prod", "cols", "const", "folded", "folded_id", "shared", "flipped"]


def test_outputs_add_into_the_buffers_their_accumulators_share():
    """Three runs, each accumulated output bound to the buffer of its accumulator input: every
    buffer holds its start value plus three times the run's value; the graph's own readers of an
    accumulated value (``twice``, the subgraph, ``negated``) still read the run's value, not the sum.
    The exporter's two weight-gradient forms take the accumulator as ``C`` (no ``Add``, no
    transposes left); the others get an ``Add``."""
    model = _graph()
    assert sum_into_inputs(model, {name: name + ".acc" for name in ACCUMULATED}) == 2
    assert not dangling_names(model.graph)
    onnx.checker.check_model(model, full_check=True)
    adds = {node.output[0] for node in model.graph.node if node.op_type == "Add"}
    assert adds == {"prod", "cols", "const", "shared", "flipped"}
    gemms = {node.output[0]: list(node.input) for node in model.graph.node if node.op_type == "Gemm"}
    assert gemms["folded"] == ["at", "b", "folded.acc"] and gemms["folded_id"] == ["a", "b", "folded_id.acc"]
    assert sum(node.op_type == "Transpose" for node in model.graph.node) == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
    start = {name: rng.standard_normal(OUTPUTS[name], dtype=np.float32) for name in ACCUMULATED}
    buffers = {name: torch.from_numpy(value.copy()) for name, value in start.items()}
    binding = session.io_binding()
    for name, value in [("a", a), ("b", b), ("at", a.T.copy()), ("bt", b.T.copy()), ("flag", np.array(True))]:
        binding.bind_cpu_input(name, value)
    for name, tensor in buffers.items():
        binding.bind_input(name + ".acc", "cpu", 0, np.float32, list(tensor.shape), tensor.data_ptr())
        binding.bind_output(name, "cpu", 0, np.float32, list(tensor.shape), tensor.data_ptr())
    others = ["twice", "branch", "negated"]
    for name in others:
        binding.bind_output(name, "cpu")
    for _ in range(RUNS):
        session.run_with_iobinding(binding)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    product = a64 @ b64
    once = {"prod": product, "cols": a64.sum(0), "const": np.array([1.0, -2.0, 0.5]), "folded": product,
            "folded_id": product, "shared": product, "flipped": product.T}
    for name in ACCUMULATED:
        check(relative_error(buffers[name].numpy(), start[name] + RUNS * once[name]), GRAPH_BOUND, name)
    returned = dict(zip(others, (v.numpy() for v in binding.get_outputs()[-len(others):])))
    expected = {"twice": 2 * once["cols"], "branch": once["cols"], "negated": -product}
    for name in others:
        check(relative_error(returned[name], expected[name]), GRAPH_BOUND, name)


def test_an_output_that_is_an_input_is_refused():
    graph = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])])
    with pytest.raises(ValueError, match=r"outputs \['x'\] are graph inputs"):
        sum_into_inputs(helper.make_model(graph), {"x": "x.acc"})


# 5 windows of 3 micro-batches of 8 against float64 PyTorch accumulating the same micro-batches
# (SGD, lr 0.1): each step's gradients are float32 sums of ≤ 64 terms (steps_bound's REDUCTION),
# the window's three added in float32; carried through the weights, 5 steps: ≤ 5 · (64 + 3) · u =
# 2.0e-5. Observed at 1 and 2 threads: 1.3e-7, 150x under.
TRAINING_BOUND = 5 * (64 + 3) * FLOAT32


def test_accumulating_training_equals_float64_pytorch_and_holds_one_gradient_buffer(tmp_path, monkeypatch):
    """Weights after 5 windows equal float64 PyTorch's (``.grad`` accumulating the micro-batches' mean,
    one step per window);
    the engine holds one set of gradient buffers; a second trainer finds the accumulating graph in
    the cache and computes the same weights bit for bit."""
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    model = MLP()
    reference = clone(model).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def trainer():
        return ORTTrainer(clone(model), MLP_DESC, SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy,
                          options={"graph": {"gradient_source": "torch"}, "batch": {"gradient_accumulation_steps": 3},
                                   "utils": {"grad_norm_clip": False}})

    first, second = trainer(), trainer()
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        for _ in range(3):
            x, y = mlp_batch(gen, batch=8)
            first.train_step(x, y)
            second.train_step(x, y)
            (torch.nn.functional.cross_entropy(reference(x.double()), y) / 3).backward()  # the window's mean
        optimizer.step()
        optimizer.zero_grad()
    assert first._engine.accumulated_flat is first._engine.grads_flat
    assert not first._graphs.from_cache and second._graphs.from_cache
    got, again = (t.state_dict(pytorch_format=True) for t in (first, second))
    for name, value in reference.state_dict().items():
        check(relative_error(got[name], value.numpy()), TRAINING_BOUND, name)
        torch.testing.assert_close(again[name], got[name], rtol=0, atol=0)


def test_micro_batches_of_other_sizes_add_into_the_same_buffers():
    """A window of micro-batches of 8, 5 and 8 rows (a specialised graph per size, each its own
    session): the buffers hold the float64 sum of the three gradients, the smaller one's included."""
    model = MLP()
    trainer = ORTTrainer(clone(model), MLP_DESC, SGDConfig(lr=0.0), loss_fn=torch.nn.functional.cross_entropy,
                         options={"graph": {"gradient_source": "torch"}, "batch": {"gradient_accumulation_steps": 4}})
    reference = clone(model).double()
    gen = torch.Generator().manual_seed(6)
    for rows in (8, 5, 8):
        x, y = mlp_batch(gen, batch=rows)
        trainer.train_step(x, y)
        torch.nn.functional.cross_entropy(reference(x.double()), y).backward()
    assert len(trainer._engine._session_sets) == 2
    got = trainer._engine.accumulated_values()
    for name, parameter in reference.named_parameters():
        # one window of 3 float32 gradients (sums of ≤ 64 terms) added in float32: ≤ 3 · (64 + 2) · u =
        # 1.2e-5. Observed at 1 and 2 threads: 9.4e-8, 125x under.
        check(relative_error(got[name], parameter.grad.numpy()), 3 * (64 + 2) * FLOAT32, name)

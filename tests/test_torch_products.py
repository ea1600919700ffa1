"""``graph_optimizations.torch_products`` (``graph/passes/torch_products.py``, ``kernels/csrc/torch_ops.cc``): each
``Gemm`` and ``MatMul`` as an ``ort_trainer.torch`` node that runs torch's BLAS inside ONNX Runtime.

The operators against float64 torch (every attribute of ``Gemm``, each way ``C`` broadcasts, ``MatMul``'s batch
broadcasting and folded transposes, float32 / float16 / bfloat16) and their errors; the pass on a tiny GPT-2 (every
product taken, the step within rounding of float64 PyTorch and of the switch off, float32 and float16) and on a
hand-built graph (a Transpose of the last two axes folded, other ones and vector operands left alone). On CUDA
(``make gpu-check``): the tiny GPT-2's float16 step.
"""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes.torch_products import torch_products
from ort_trainer.kernels import _compilers, torch_ops
from ort_trainer.optim import SGDConfig

# one step of the tiny GPT-2 with a switch on or off (SGD lr 0, unscaled float16), and its bounds against float64:
# ~800 float32 roundings of its longest chain (5x margin; MKL sums each product's terms in another order than MLAS,
# the same float32 arithmetic), 40 of float16's
from test_fused_kernels import FLOAT32_BOUND, HALF_BOUND, _step
from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import BFLOAT16, FLOAT16, FLOAT32, check

pytestmark = pytest.mark.skipif(_compilers()[1] is None, reason="builds a library against torch: needs a C++ compiler")

_ELEM = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}
# a product of K = 24 terms, each rounded, summed in the dtype's accumulator (float32 for every dtype in torch's CPU
# kernels), then rounded once to the dtype: within (K·u32 + u)·Σ|a·b| of float64, doubled for margin
_UNIT = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}


def _session(op: str, inputs: dict, dtype: torch.dtype, out_dtype: torch.dtype | None = None,
             **attributes) -> ort.InferenceSession:
    """One node of the torch operators' domain, its inputs ``{name: dims}``, output ``y`` (of ``out_dtype``, else
    the inputs' dtype)."""
    elem = _ELEM[dtype]
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), ["y"], domain=torch_ops.DOMAIN, **attributes)], "product",
        [helper.make_tensor_value_info(name, elem, dims) for name, dims in inputs.items()],
        [helper.make_tensor_value_info("y", _ELEM[out_dtype or dtype], None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(torch_ops.DOMAIN, 1)], ir_version=8)
    options = ort.SessionOptions()
    torch_ops.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session, feeds: dict[str, torch.Tensor], out_dims: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One run on the tensors bound in place; ``dtype``: the output's."""
    binding = session.io_binding()
    for name, tensor in feeds.items():
        tensor = tensor.contiguous()
        feeds[name] = tensor  # (kept alive through the run)
        binding.bind_input(name, "cpu", 0, _ELEM[tensor.dtype], list(tensor.shape), tensor.data_ptr())
    out = torch.full(out_dims, float("nan"), dtype=dtype)
    binding.bind_output("y", "cpu", 0, _ELEM[dtype], out_dims, out.data_ptr())
    session.run_with_iobinding(binding)
    return out


def _within(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, terms: int) -> None:
    bound = 2 * (terms * FLOAT32 + _UNIT[dtype]) * magnitude + 1e-30
    excess = (got.double() - want).abs() - bound
    assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("dtype", list(_ELEM), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_dims", [None, [7], [5, 7], [5, 1], [1]], ids=["no-c", "row", "full", "column", "one"])
def test_gemm_is_onnx_gemm(dtype, trans_a, trans_b, c_dims):
    """y = alpha · op(a) · op(b) + beta · c (c broadcast), against float64 over the same rounded operands."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(*([24, 5] if trans_a else [5, 24]), generator=gen).to(dtype)
    b = torch.randn(*([7, 24] if trans_b else [24, 7]), generator=gen).to(dtype)
    feeds, dims = {"a": a, "b": b}, {"a": list(a.shape), "b": list(b.shape)}
    op, attributes = "Gemm", {"transA": trans_a, "transB": trans_b, "alpha": 0.5}
    if c_dims is not None:
        feeds["c"] = torch.randn(*c_dims, generator=gen).to(dtype)
        dims["c"] = c_dims
        op, attributes["beta"] = "BiasGemm", -2.0
    y = _run(_session(op, dims, dtype, **attributes), feeds, [5, 7], dtype)
    a64, b64 = a.double().t() if trans_a else a.double(), b.double().t() if trans_b else b.double()
    want = 0.5 * a64 @ b64
    magnitude = 0.5 * a64.abs() @ b64.abs()
    if c_dims is not None:
        want = want - 2.0 * feeds["c"].double()
        magnitude = magnitude + 2.0 * feeds["c"].double().abs()
    _within(y, want, magnitude, dtype, 25)


@pytest.mark.parametrize("dtype", list(_ELEM), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("a_dims, b_dims", [([5, 24], [24, 7]), ([3, 5, 24], [24, 7]), ([2, 1, 5, 24], [3, 24, 7]),
                                            ([5, 24], [2, 24, 7]), ([24], [3, 24, 7]), ([3, 5, 24], [24]),
                                            ([24], [24])],
                         ids=["2d", "3d-2d", "broadcast", "2d-3d", "vector-3d", "3d-vector", "vectors"])
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 1)])
def test_matmul_is_onnx_matmul(dtype, a_dims, b_dims, trans_a, trans_b):
    """numpy's matmul (batch axes broadcast, a vector a row or a column), an operand's last two axes swapped where
    transA / transB says (given so, read in place; a vector has none to swap), against float64."""
    trans_a, trans_b = trans_a and len(a_dims) > 1, trans_b and len(b_dims) > 1
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(*a_dims, generator=gen).to(dtype)
    b = torch.randn(*b_dims, generator=gen).to(dtype)
    stored_a = a.transpose(-1, -2).contiguous() if trans_a else a
    stored_b = b.transpose(-1, -2).contiguous() if trans_b else b
    want = torch.matmul(a.double(), b.double())
    session = _session("MatMul", {"a": list(stored_a.shape), "b": list(stored_b.shape)}, dtype,
                       transA=trans_a, transB=trans_b)
    y = _run(session, {"a": stored_a, "b": stored_b}, list(want.shape), dtype)
    assert list(y.shape) == list(want.shape)
    _within(y, want, torch.matmul(a.double().abs(), b.double().abs()), dtype, 24)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["GemmToFloat", "MatMulToFloat"])
def test_half_products_to_float_are_not_rounded_to_half(dtype, op):
    """GemmToFloat (transA, alpha 0.5) and MatMulToFloat (a batch) of half operands write float32: within float32
    roundings of the float64 product of the same half values (K = 24 terms), far inside half's rounding."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(*([24, 5] if op == "GemmToFloat" else [2, 5, 24]), generator=gen).to(dtype)
    b = torch.randn(24, 7, generator=gen).to(dtype)
    attributes = {"transA": 1, "alpha": 0.5} if op == "GemmToFloat" else {}
    session = _session(op, {"a": list(a.shape), "b": list(b.shape)}, dtype, torch.float32, **attributes)
    a64 = a.double().t() if op == "GemmToFloat" else a.double()
    scale = 0.5 if op == "GemmToFloat" else 1.0
    want = scale * torch.matmul(a64, b.double())
    y = _run(session, {"a": a, "b": b}, list(want.shape), torch.float32)
    excess = (y.double() - want).abs() - 2 * 25 * FLOAT32 * scale * torch.matmul(a64.abs(), b.double().abs())
    assert y.dtype == torch.float32 and float(excess.max()) <= 0


def test_products_that_do_not_fit_are_refused_naming_the_shapes():
    session = _session("MatMul", {"a": [5, 24], "b": [23, 7]}, torch.float32)
    with pytest.raises(Exception, match=r"MatMul: a's columns \(24\) and b's rows \(23\) differ"):
        session.run(None, {"a": np.ones((5, 24), np.float32), "b": np.ones((23, 7), np.float32)})
    message = r"Gemm: a must be of rank 1 \(not transposed\) or more, b of rank 2 or more"
    session = _session("Gemm", {"a": [24], "b": [24, 7]}, torch.float32, transA=1)
    with pytest.raises(Exception, match=message):
        session.run(None, {"a": np.ones(24, np.float32), "b": np.ones((24, 7), np.float32)})
    session = _session("Gemm", {"a": [5, 24], "b": [24]}, torch.float32)
    with pytest.raises(Exception, match=message):
        session.run(None, {"a": np.ones((5, 24), np.float32), "b": np.ones(24, np.float32)})


@pytest.mark.parametrize("dtype", list(_ELEM), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["Gemm", "GemmToFloat"])
def test_a_gemm_of_a_row_of_ones_is_a_column_sum(dtype, op):
    """A 1-D a is one row (product_views.py's column sums): ones[10] times b [2, 5, 7] read as its rows is b's column
    sums, y [7]; against float64 over the same rounded operands."""
    if op == "GemmToFloat" and dtype == torch.float32:
        pytest.skip("GemmToFloat takes half operands")
    b = (torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    want, magnitude = b.double().sum((0, 1)), b.double().abs().sum((0, 1))
    out_dtype = torch.float32 if op == "GemmToFloat" else dtype
    y = _run(_session(op, {"a": [10], "b": [2, 5, 7]}, dtype, out_dtype), {"a": torch.ones(10, dtype=dtype), "b": b},
             [7], out_dtype)
    _within(y, want, magnitude, out_dtype, 10 + 1)


@pytest.mark.parametrize("dtype", list(_ELEM), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op, trans_a, trans_b", [("BiasGemm", 0, 0), ("BiasGemm", 0, 1), ("Gemm", 1, 0),
                                                  ("GemmToFloat", 1, 0), ("GemmToFloat", 0, 1)])
def test_gemm_reads_operands_of_rank_3_as_their_rows(dtype, op, trans_a, trans_b):
    """A Gemm operand of rank 3 is the matrix of its rows ([2, 5, k] as [10, k], product_views.py): a not
    transposed gives y [2, 5, n] (a linear layer's forward, its input gradient), a transposed a 2-D y (a weight
    gradient, b [2, 5, n] its rows too); against float64 over the same rounded operands."""
    if op == "GemmToFloat" and dtype == torch.float32:
        pytest.skip("GemmToFloat takes half operands")
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, 5, 24, generator=gen).to(dtype)  # rows: 10
    b = (torch.randn(2, 5, 7, generator=gen) if trans_a else
         torch.randn(*([7, 24] if trans_b else [24, 7]), generator=gen)).to(dtype)
    a64, b64 = a.double().reshape(10, 24), b.double().reshape(-1, b.shape[-1])
    a64, b64 = a64.t() if trans_a else a64, b64.t() if trans_b else b64
    feeds, dims = {"a": a, "b": b}, {"a": list(a.shape), "b": list(b.shape)}
    want, magnitude = a64 @ b64, a64.abs() @ b64.abs()
    if op == "BiasGemm":
        feeds["c"], dims["c"] = torch.randn(7, generator=gen).to(dtype), [7]
        want, magnitude = want + feeds["c"].double(), magnitude + feeds["c"].double().abs()
    out_dims = [24, 7] if trans_a else [2, 5, 7]
    out_dtype = torch.float32 if op == "GemmToFloat" else dtype
    y = _run(_session(op, dims, dtype, out_dtype, transA=trans_a, transB=trans_b), feeds, out_dims, out_dtype)
    terms = 10 if trans_a else 24
    _within(y.reshape(want.shape), want, magnitude, out_dtype if op == "GemmToFloat" else dtype, terms + 1)


def test_half_products_only_a_cast_to_float_reads_write_float32():
    """A float16 Gemm read by a Cast to float32 alone becomes GemmToFloat writing the Cast's output; a MatMul read
    through a Reshape that the Cast alone reads becomes MatMulToFloat writing a float32 value the Reshape reads (its
    type recorded); a Gemm read through two Transposes that undo each other becomes GemmToFloat writing the Cast's
    output, the Transposes gone; a product another node reads too keeps its half output and its Cast."""
    h, f = TensorProto.FLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Gemm", ["a", "b"], ["p"], transA=1),
             helper.make_node("Cast", ["p"], ["p32"], to=f),
             helper.make_node("MatMul", ["ones", "b"], ["q"]),
             helper.make_node("Reshape", ["q", "flat"], ["q1"]),
             helper.make_node("Cast", ["q1"], ["q32"], to=f),
             helper.make_node("MatMul", ["a", "b"], ["r"], name="shared"),
             helper.make_node("Cast", ["r"], ["r32"], to=f),
             helper.make_node("Neg", ["r"], ["rn"]),
             helper.make_node("Gemm", ["b", "a"], ["s"], transA=1, transB=1),
             helper.make_node("Transpose", ["s"], ["st"], perm=[1, 0]),
             helper.make_node("Transpose", ["st"], ["stt"], perm=[1, 0]),
             helper.make_node("Cast", ["stt"], ["s32"], to=f)]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("a", h, [4, 4]), helper.make_tensor_value_info("b", h, [4, 3]),
        helper.make_tensor_value_info("ones", h, [1, 4]),
        helper.make_tensor_value_info("flat", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info(name, f, None) for name in ("p32", "q32", "r32", "s32")]
        + [helper.make_tensor_value_info("rn", h, None)])
    model = helper.make_model(graph)
    model.graph.value_info.extend([helper.make_tensor_value_info("p", h, [4, 3]),
                                   helper.make_tensor_value_info("q", h, [1, 3]),
                                   helper.make_tensor_value_info("q1", h, [3])])
    assert torch_products(model) == 4
    ops = {n.name or n.output[0]: (n.op_type, list(n.input), list(n.output)) for n in model.graph.node}
    assert ("GemmToFloat", ["a", "b"], ["p32"]) in ops.values()
    assert ("GemmToFloat", ["b", "a"], ["s32"]) in ops.values() and "Transpose" not in {op for op, _, _ in ops.values()}
    assert ("MatMulToFloat", ["ones", "b"], ["q/float32"]) in ops.values()
    assert ("Reshape", ["q/float32", "flat"], ["q32"]) in ops.values()
    assert ops["shared"][0] == "MatMul" and sum(op == "Cast" for op, _, _ in ops.values()) == 1
    info = {i.name: i.type.tensor_type.elem_type for i in model.graph.value_info}
    assert info == {"q/float32": f}


def test_the_pass_folds_last_axes_transposes_and_leaves_integers():
    """A MatMul reading a Transpose of its operand's last two axes reads the operand with transB=1 (the Transpose,
    unread, left for the dead-node sweep); a Transpose of other axes stays read; a vector operand's MatMul is taken
    too; an integer Gemm stays ONNX Runtime's."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "wt"], ["y"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("MatMul", ["xt", "w2"], ["z"]),
             helper.make_node("MatMul", ["v", "w2"], ["u"]),
             helper.make_node("Gemm", ["n", "m"], ["k"])]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("x", f, [2, 3, 4]), helper.make_tensor_value_info("w", f, [2, 5, 4]),
        helper.make_tensor_value_info("w2", f, [4, 6]), helper.make_tensor_value_info("v", f, [4]),
        helper.make_tensor_value_info("n", i64, [2, 2]), helper.make_tensor_value_info("m", i64, [2, 2])],
        [helper.make_tensor_value_info(name, f, None) for name in ("y", "z", "u")]
        + [helper.make_tensor_value_info("k", i64, None)])
    model = helper.make_model(graph)
    model.graph.value_info.extend([helper.make_tensor_value_info("wt", f, [2, 4, 5]),
                                   helper.make_tensor_value_info("xt", f, [3, 2, 4])])
    assert torch_products(model) == 3
    by_output = {n.output[0]: n for n in model.graph.node}
    y, z = by_output["y"], by_output["z"]
    assert (y.domain, list(y.input), [a.i for a in y.attribute]) == (torch_ops.DOMAIN, ["x", "w"], [0, 1])
    assert (z.domain, list(z.input), [a.i for a in z.attribute]) == (torch_ops.DOMAIN, ["xt", "w2"], [0, 0])
    assert by_output["u"].domain == torch_ops.DOMAIN and by_output["k"].domain == ""


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_gpt2_step_with_torchs_products_within_rounding_of_float64(half, record_property):
    """One step of the tiny GPT-2, the switch on and off: every Gemm and MatMul of the gradient graph is torch's
    (none of ONNX Runtime's left), the loss and every gradient within the bound of float64 PyTorch's, and of the
    switch off."""
    model, desc, batch, _ = _gpt2_case()
    loss64, grads64 = _float64(model, batch, None)
    losses, results = {}, {}
    for on in (True, False):
        trainer, losses[on], results[on] = _step(model, desc, batch, None, "torch_products", on,
                                                 "float16" if half else None)
        graph = trainer._graphs.gradient.graph
        ours = [n for n in graph.node if n.domain == torch_ops.DOMAIN]
        theirs = [n.name for n in graph.node if n.domain == "" and n.op_type in ("Gemm", "MatMul")]
        if on:
            assert len(ours) >= 20 and not theirs, theirs
            # half: each weight's and bias's gradient written in float32 by its product, no Cast of one left
            widened = [n for n in ours if n.op_type.endswith("ToFloat")]
            assert (len(widened) >= 8) == half, len(widened)
            cast_inputs = {n.input[0] for n in graph.node if n.op_type == "Cast"}
            assert not [n.name for n in widened if n.output[0] in cast_inputs]
        else:
            assert not ours and theirs
    _check_on_and_off(losses, results, loss64, grads64, HALF_BOUND if half else FLOAT32_BOUND, record_property)


def _check_on_and_off(losses: dict, results: dict, loss64: float, grads64: dict, bound: float,
                      record_property) -> None:
    """The loss and every gradient of a step with the switch on and off (``{on: ...}``) within ``bound`` of float64
    PyTorch's, and the two steps' gradients within twice it of each other; the largest error with the switch on
    recorded."""
    errors = {on: {"loss": abs(losses[on] - loss64) / abs(loss64),
                   **{w: _relative(g, grads64[w]) for w, g in results[on].items()}} for on in (True, False)}
    for on in (True, False):
        for name, error in errors[on].items():
            check(error, bound, (on, name))
    for name, grad in results[True].items():
        check(_relative(grad, results[False][name]), 2 * bound, ("on-off", name))
    record_property("largest_error", max(errors[True].values()))


def _undone_transpose_pairs(graph) -> int:
    """How many ``Transpose`` nodes read a ``Transpose`` whose ``perm`` theirs undoes."""
    producer = {o: n for n in graph.node for o in n.output}
    count = 0
    for node in graph.node:
        first = producer.get(node.input[0]) if node.op_type == "Transpose" else None
        if first is not None and first.op_type == "Transpose":
            p, q = [list(n.attribute[0].ints) for n in (first, node)]
            count += all(p[axis] == i for i, axis in enumerate(q))
    return count


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_weight_gradients_through_undone_transposes_are_written_in_float32(record_property):
    """The tiny encoder's ``nn.Linear`` weight gradients reach their float32 ``Cast`` through ``t()`` of ``t()`` of
    the product (torch's decomposition of the linear's backward; BERT's too): in float16 with the switch each such
    product writes the Cast's float32 output itself and the pair of Transposes goes with the Cast; the loss and every
    gradient within the bound of float64 PyTorch's, and of the switch off (which keeps the pairs)."""
    model, desc, batch, loss_fn = _encoder_case()
    loss64, grads64 = _float64(model, batch, loss_fn)
    graphs, losses, results = {}, {}, {}
    for on in (True, False):
        trainer, losses[on], results[on] = _step(model, desc, batch, loss_fn, "torch_products", on, "float16")
        graphs[on] = trainer._graphs.gradient.graph
    assert _undone_transpose_pairs(graphs[False]) >= 4 and _undone_transpose_pairs(graphs[True]) == 0
    widened = [n for n in graphs[True].node if n.op_type.endswith("ToFloat")]
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    assert len(widened) >= linears, (len(widened), linears)  # every weight's, and biases' column sums
    _check_on_and_off(losses, results, loss64, grads64, HALF_BOUND, record_property)


@pytest.mark.cuda
def test_gpt2_float16_step_on_cuda_within_rounding_of_float64():
    """The tiny GPT-2's float16 step on CUDA (cuBLAS through torch, the biases in its epilogue) within the bound of
    float64 PyTorch's."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    model, desc, batch, _ = _gpt2_case()
    loss64, grads64 = _float64(model, batch, None)
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "device": {"id": "cuda"},
                                  "mixed_precision": {"enabled": True, "dtype": "float16", "loss_scaler": scaler},
                                  "graph_optimizations": {"torch_products": True}})
    loss = float(trainer.train_step(*(t.cuda() for t in batch))[0])
    assert any(n.domain == torch_ops.DOMAIN for n in trainer._graphs.gradient.graph.node)
    check(abs(loss - loss64) / abs(loss64), HALF_BOUND, "loss")
    for name, grad in trainer._engine.grads.items():
        check(_relative(grad.float().cpu().numpy().astype(np.float64), grads64[name]), HALF_BOUND, name)


def test_an_onnx_model_of_these_operators_is_recognised():
    """``uses_torch_ops`` (the sessions' registration) sees the products' domain."""
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"],
                                                                  domain=torch_ops.DOMAIN)], "g", [], []))
    assert torch_ops.uses_torch_ops(model) and isinstance(model, onnx.ModelProto)


def _viewed(model: onnx.ModelProto, feeds: dict, rewrites: int, kernels: bool = False) -> list[tuple]:
    """``product_views`` on ``model`` in place, asserting that it counts ``rewrites`` and that ONNX Runtime on the CPU
    computes every output bit for bit as before it (``kernels``: ort_trainer's kernel library registered too); the
    ``(op type, inputs, outputs)`` of its nodes after, the unread ones dropped."""
    from ort_trainer import kernels as kernel_library
    from ort_trainer.graph.onnx_graph import drop_dead_nodes
    from ort_trainer.graph.passes.product_views import product_views

    options = ort.SessionOptions()
    torch_ops.register(options)
    if kernels:
        kernel_library.register(options)

    def run():
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds)

    before = run()
    assert product_views(model) == rewrites
    drop_dead_nodes(model)
    for got, want in zip(run(), before):
        assert got.shape == want.shape and np.array_equal(got, want)
    return [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def test_product_views_read_and_write_the_tensors_reshapes_flattened():
    """``product_views`` (torch_products' last step) on a hand-built linear layer: the forward BiasGemm reads x
    [2, 5, 24] and writes y [2, 5, 7] itself (both Reshapes gone), the weight gradient's GemmToFloat (transA) reads x
    and dy [2, 5, 7] as their rows; where another node reads the flat product, its Reshape stays and the product
    writes 2-D; the values are the same (ONNX Runtime on the CPU, bit for bit)."""
    h, i64 = TensorProto.FLOAT16, TensorProto.INT64

    def graph(flat_read_elsewhere: bool):
        nodes = [helper.make_node("Reshape", ["x", "rows24"], ["x2"]),
                 helper.make_node("BiasGemm", ["x2", "w", "c"], ["y2"], domain=torch_ops.DOMAIN),
                 helper.make_node("Reshape", ["y2", "y_dims"], ["y"]),
                 helper.make_node("Reshape", ["dy", "rows7"], ["dy2"]),
                 helper.make_node("GemmToFloat", ["x2", "dy2"], ["dw"], domain=torch_ops.DOMAIN, transA=1)]
        outputs = [("y", h, [2, 5, 7]), ("dw", TensorProto.FLOAT, [24, 7])]
        if flat_read_elsewhere:
            nodes.append(helper.make_node("Identity", ["y2"], ["y2_copy"]))
            outputs.append(("y2_copy", h, [10, 7]))
        inits = [helper.make_tensor("rows24", i64, [2], [10, 24]), helper.make_tensor("rows7", i64, [2], [10, 7]),
                 helper.make_tensor("y_dims", i64, [3], [2, 5, 7])]
        info = [helper.make_tensor_value_info(n, h, s) for n, s in [("x2", [10, 24]), ("y2", [10, 7]),
                                                                      ("dy2", [10, 7])]]
        return helper.make_model(helper.make_graph(
            nodes, "linear", [helper.make_tensor_value_info(n, h, s) for n, s in [
                ("x", [2, 5, 24]), ("w", [24, 7]), ("c", [7]), ("dy", [2, 5, 7])]],
            [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], inits, value_info=info),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(torch_ops.DOMAIN, 1)], ir_version=8)

    gen = torch.Generator().manual_seed(6)
    feeds = {name: torch.randn(*dims, generator=gen).to(torch.float16).numpy()
             for name, dims in [("x", [2, 5, 24]), ("w", [24, 7]), ("c", [7]), ("dy", [2, 5, 7])]}
    for elsewhere in (False, True):
        # (the count: operands and outputs that skip a Reshape)
        layout = _viewed(graph(elsewhere), feeds, 2 if elsewhere else 4)
        if elsewhere:  # the forward as it was (its flat output read elsewhere), the weight gradient on x and dy
            assert ("GemmToFloat", ["x", "dy"], ["dw"]) in layout
            assert ("BiasGemm", ["x2", "w", "c"], ["y2"]) in layout and ("Reshape", ["y2", "y_dims"], ["y"]) in layout
        else:
            assert layout == [("BiasGemm", ["x", "w", "c"], ["y"]), ("GemmToFloat", ["x", "dy"], ["dw"])]


@pytest.mark.parametrize("op, dtype", [("MatMulToFloat", TensorProto.FLOAT16), ("MatMul", TensorProto.FLOAT)])
def test_product_views_sum_columns_with_a_row_of_ones(op, dtype):
    """``product_views`` on a bias's gradient as ``column_sums`` writes it (ones [1, 10] times dy [2, 5, 7] flattened
    by two Reshapes, the product's [1, 7] reshaped to [7]): one Gemm of a 1-D row of ones that reads dy and writes
    [7]; where another node reads the [1, 7] product, it stays as it was. The same values bit for bit (ONNX Runtime
    on the CPU)."""
    i64, out = TensorProto.INT64, TensorProto.FLOAT if op == "MatMulToFloat" else dtype
    name = "FLOAT16" if dtype == TensorProto.FLOAT16 else "FLOAT"

    def graph(sum_read_elsewhere: bool):
        nodes = [helper.make_node("Reshape", ["dy", "rows7"], ["dy2"]),
                 helper.make_node("Reshape", ["dy2", "rows7"], ["view"]),
                 helper.make_node(op, ["ones", "view"], ["sum"], domain=torch_ops.DOMAIN),
                 helper.make_node("Reshape", ["sum", "bias_dims"], ["db"])]
        outputs = [("db", out, [7])]
        if sum_read_elsewhere:
            nodes.append(helper.make_node("Identity", ["sum"], ["sum_copy"]))
            outputs.append(("sum_copy", out, [1, 7]))
        inits = [helper.make_tensor("rows7", i64, [2], [10, 7]), helper.make_tensor("bias_dims", i64, [1], [7]),
                 helper.make_tensor("ones", dtype, [1, 10], [1.0] * 10)]
        return helper.make_model(helper.make_graph(
            nodes, "bias", [helper.make_tensor_value_info("dy", dtype, [2, 5, 7])],
            [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], inits,
            value_info=[helper.make_tensor_value_info("dy2", dtype, [10, 7])]),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(torch_ops.DOMAIN, 1)], ir_version=8)

    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    feeds = {"dy": (torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(7)) * 9).numpy().astype(np_dtype)}
    for elsewhere in (False, True):
        model = graph(elsewhere)
        layout = _viewed(model, feeds, 0 if elsewhere else 2)
        if elsewhere:
            assert (op, ["ones", "view"], ["sum"]) in layout
        else:
            row = f"ort_trainer/column_sums/row_10_{name.lower()}"
            assert layout == [(op.replace("MatMul", "Gemm"), [row, "dy"], ["db"])]
            assert [list(i.dims) for i in model.graph.initializer if i.name == row] == [[10]]
            assert "ones" not in {i.name for i in model.graph.initializer}


@pytest.mark.parametrize("as_sum", [False, True], ids=["term", "sum"])
def test_product_views_write_rows_that_a_kernel_reads_as_elements(as_sum):
    """A Gemm on x [2, 5, 24] flattened by a Reshape, whose product an AddHalf reads as a half term (its elements in
    order, whatever the shape): the Gemm reads x and writes [2, 5, 7], the Reshape gone. Read as the AddHalf's sum
    (whose shape is its output's) it stays as it was. The same values bit for bit (ONNX Runtime on the CPU)."""
    from ort_trainer import kernels

    h, f, i64 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT64
    inputs = ["p", "s"] if as_sum else ["s", "p"]
    nodes = [helper.make_node("Reshape", ["x", "rows24"], ["x2"]),
             helper.make_node("Gemm", ["x2", "w"], ["p"], domain=torch_ops.DOMAIN),
             helper.make_node("AddHalf", inputs, ["y"], domain=kernels.DOMAIN)]
    model = helper.make_model(helper.make_graph(
        nodes, "rows", [helper.make_tensor_value_info("x", h, [2, 5, 24]),
                        helper.make_tensor_value_info("w", h, [24, 7]),
                        helper.make_tensor_value_info("s", h if as_sum else f, [10, 7] if as_sum else [2, 5, 7])],
        [helper.make_tensor_value_info("y", f, None)], [helper.make_tensor("rows24", i64, [2], [10, 24])],
        value_info=[helper.make_tensor_value_info("x2", h, [10, 24]), helper.make_tensor_value_info("p", h, [10, 7])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(torch_ops.DOMAIN, 1),
                       helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)], ir_version=8)
    gen = torch.Generator().manual_seed(8)
    feeds = {"x": torch.randn(2, 5, 24, generator=gen).to(torch.float16).numpy(),
             "w": torch.randn(24, 7, generator=gen).to(torch.float16).numpy(),
             "s": torch.randn(*([10, 7] if as_sum else [2, 5, 7]), generator=gen).numpy().astype(
                 np.float16 if as_sum else np.float32)}
    layout = _viewed(model, feeds, 0 if as_sum else 1, kernels=True)
    assert layout == ([("Reshape", ["x", "rows24"], ["x2"]), ("Gemm", ["x2", "w"], ["p"]), ("AddHalf", inputs, ["y"])]
                      if as_sum else [("Gemm", ["x", "w"], ["p"]), ("AddHalf", inputs, ["y"])])
    assert as_sum or [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info
                      if v.name == "p"] == [[2, 5, 7]]

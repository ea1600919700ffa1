"""``graph_optimizations.weight_casts`` (``graph/passes/weight_casts.py``): a mixed-precision step's half copies of its
float32 weights (one ``Cast`` a weight) as one ``CastsToFloat16`` (``CastsToBFloat16``) node of ort_trainer's
kernels, a padded product's weight written padded.

The kernel rounds as a ``Cast`` does, to nearest even: checked bit for bit against torch's casts (every special
value, padded rows of +0; its CUDA kernel's launches in ``test_cuda_emulated.py``). On a tiny Hugging Face GPT-2 with
a 1031-word vocabulary whose head's products are padded to 1088 rows (``aligned_products``), the switch leaves one
node where the step had a ``Cast`` a weight and the head's ``Concat`` pad, and the loss and every gradient are bit
for bit those without it, and within the float16 bound of float64 PyTorch.
"""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import _runtime, kernels
from ort_trainer.graph.passes.weight_casts import weight_casts
from ort_trainer.kernels import DOMAIN

from models import tiny_gpt2
from test_aligned_products import VOCAB
from test_fused_attention import BOUNDS, _device_step
from test_half_loss import _float64, _relative
from test_kernels import _bound_run, _library_on, _session, needs_compiler
from tolerances import check

_HALF = {torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def cpu_library():
    """The C++ compiler's build of the kernels (test_kernels.py's)."""
    return kernels.build(cuda=False)


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_copies_round_as_casts_do_bit_for_bit(cpu_library, device, dtype):
    """Three tensors (one with every special value: ties to even, overflow to inf, subnormals, underflow to 0, NaN,
    -0) rounded to ``dtype`` bit for bit as torch casts them; the attribute output_rows pads two of them with rows
    of +0 (0: b keeps its own rows) (on CUDA, ``make gpu-check``: its kernel)."""
    gen = torch.Generator().manual_seed(3)
    specials = torch.tensor([65504.0, 65520.0, 1e6, -1e6, 2.0 ** -25, 2.0 ** -26, 1e-30, float("inf"), float("nan"),
                             -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 3.0e38, 1.0 + 2.0 ** -8, -2.5, 7.0])
    xs = {"a": specials.view(4, 4), "b": torch.randn(5, 3, 7, generator=gen) * 50, "c": torch.randn(9, generator=gen)}
    rows = [6, 0, 12]  # (0: x's own)
    library, provider = _library_on(device, cpu_library)
    op = "CastsToFloat16" if dtype == torch.float16 else "CastsToBFloat16"
    session = _session(library, op, {name: TensorProto.FLOAT for name in xs},
                       {f"y{name}": _HALF[dtype] for name in xs}, provider=provider, output_rows=rows)
    outputs = {f"y{name}": torch.empty((r or x.shape[0], *x.shape[1:]), dtype=dtype, device=device)
               for (name, x), r in zip(xs.items(), rows)}
    out = _bound_run(session, {name: x.to(device) for name, x in xs.items()}, outputs)
    for (name, x), r in zip(xs.items(), rows):
        got = out[f"y{name}"].cpu()
        want = torch.cat([x.to(dtype), torch.zeros(((r or x.shape[0]) - x.shape[0], *x.shape[1:]), dtype=dtype)])
        nan = want.isnan()  # (NaN's bits are not one pattern: torch writes bfloat16's as 0x7fc0, a GPU as 0x7fff)
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16),
                                                             want[~nan].view(torch.int16)), name


@needs_compiler
def test_half_copies_refuse_fewer_rows_than_x_holds(cpu_library):
    session = _session(cpu_library, "CastsToFloat16", {"x": TensorProto.FLOAT, "x2": TensorProto.FLOAT},
                       {"y": TensorProto.FLOAT16, "y2": TensorProto.FLOAT16}, output_rows=[2, 3])
    with pytest.raises(Exception, match=r"CastsToFloat16: output_rows\[1\] \(3\) must be at least x's first dim \(4\)"):
        session.run(None, {"x": np.zeros((2, 3), np.float32), "x2": np.zeros((4, 3), np.float32)})
    session = _session(cpu_library, "CastsToFloat16", {"x": TensorProto.FLOAT}, {"y": TensorProto.FLOAT16},
                       output_rows=[2, 3])
    with pytest.raises(Exception, match=r"CastsToFloat16: output_rows has 2 values for 1 tensors"):
        session.run(None, {"x": np.zeros((2, 3), np.float32)})


def _graph(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "casts", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _zeros(name: str, shape, dtype=np.float16, value=0.0) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.full(shape, value, dtype)))


def test_the_pass_takes_the_inputs_casts_and_zero_row_pads_alone():
    """Casts of float32 graph inputs to float16 are one node, to bfloat16 another (its pad too); a Cast to float32,
    a Cast of a computed tensor and of an int64 input stay; a pad of zero rows that alone reads its copy is written by
    the node (output_rows); a pad of ones, of -0, or of a copy another node reads too, stays a Concat."""
    f32, f16, bf16, i64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64
    nodes = [helper.make_node("Cast", ["w1"], ["h1"], to=f16), helper.make_node("Cast", ["w2"], ["h2"], to=f16),
             _zeros("z2", (3, 4)), helper.make_node("Concat", ["h2", "z2"], ["p2"], axis=0),
             helper.make_node("Cast", ["w3"], ["h3"], to=f16), _zeros("o3", (3, 4), value=1.0),
             helper.make_node("Concat", ["h3", "o3"], ["p3"], axis=0),
             helper.make_node("Cast", ["w4"], ["h4"], to=f16), _zeros("m4", (3, 4), value=-0.0),
             helper.make_node("Concat", ["h4", "m4"], ["p4"], axis=0),
             helper.make_node("Cast", ["w5"], ["h5"], to=f16), _zeros("z5", (3, 4)),
             helper.make_node("Concat", ["h5", "z5"], ["p5"], axis=0), helper.make_node("Neg", ["h5"], ["n5"]),
             helper.make_node("Cast", ["w6"], ["h6"], to=bf16),
             _zeros("z6", (2,), helper.tensor_dtype_to_np_dtype(bf16)),
             helper.make_node("Concat", ["h6", "z6"], ["p6"], axis=0), helper.make_node("Cast", ["w1"], ["f1"], to=f32),
             helper.make_node("Neg", ["w1"], ["n1"]), helper.make_node("Cast", ["n1"], ["h7"], to=f16),
             helper.make_node("Cast", ["i"], ["h8"], to=f16)]
    inputs = [("w1", f32, [2, 4]), *[(f"w{k}", f32, [5, 4]) for k in (2, 3, 4, 5)], ("w6", f32, [7]), ("i", i64, [3])]
    outputs = [("h1", f16, None), ("p2", f16, None), ("p3", f16, None), ("p4", f16, None), ("p5", f16, None),
               ("n5", f16, None), ("p6", bf16, None), ("f1", f32, None), ("h7", f16, None), ("h8", f16, None)]
    model = _graph(nodes, inputs, outputs)
    assert weight_casts(model) == 6
    copies = [n for n in model.graph.node if n.domain == DOMAIN]
    assert [(n.op_type, list(n.input), list(n.output)) for n in copies] == [
        ("CastsToFloat16", ["w1", "w2", "w3", "w4", "w5"], ["h1", "p2", "h3", "h4", "h5"]),
        ("CastsToBFloat16", ["w6"], ["p6"])]
    assert [[(a.name, list(a.ints)) for a in n.attribute] for n in copies] == [[("output_rows", [0, 8, 0, 0, 0])],
                                                                                [("output_rows", [9])]]
    assert model.graph.node[0] is copies[0]  # (where the first Cast was)
    left = [(n.op_type, n.output[0]) for n in model.graph.node if n.op_type in ("Cast", "Concat")]
    assert left == [("Concat", "p3"), ("Concat", "p4"), ("Concat", "p5"), ("Cast", "f1"), ("Cast", "h7"),
                    ("Cast", "h8")]


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
@needs_compiler
@pytest.mark.parametrize("precision, device", [
    ("float16", "cpu"), pytest.param("float16", "cuda", marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("aligned", [False, True], ids=["unpadded", "padded"])
def test_gpt2_step_bit_for_bit_with_one_copy_node(precision, device, aligned):
    """The loss and every gradient bit for bit the switch off's, within the bound of float64 PyTorch; one CastsTo*
    node in place of every Cast of a weight, and with ``aligned_products`` the head's weight written padded (no
    Concat)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    model, desc = tiny_gpt2(vocab=VOCAB)
    if device == "cpu":
        # ONNX Runtime's CPU provider runs a float16 product in float32 (InsertCastTransformer) and drops the pair
        # of casts a weight's Cast to float16 then makes: the weights' rounding never happens there, while the
        # kernel rounds. Weights that float16 holds exactly make both graphs compute the same values.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.float16 if precision == "float16" else torch.bfloat16).float())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    batch = (ids, torch.ones_like(ids), ids)
    results, casts = {}, {}
    for on in (False, True):
        trainer, loss, grads = _device_step(model, desc, batch, precision, device,
                                            {"aligned_products": aligned, "weight_casts": on})
        results[on] = loss, grads
        graph = trainer._graphs.gradient.graph
        inputs = {i.name for i in graph.input}
        casts[on] = [n.input[0] for n in graph.node if n.op_type == "Cast" and n.input[0] in inputs]
    (copies,) = [n for n in graph.node if n.domain == DOMAIN and n.op_type.startswith("CastsTo")]
    assert casts[True] == [] and list(copies.input) == casts[False]
    assert {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"} <= set(copies.input)
    rows = {a.name: list(a.ints) for a in copies.attribute}.get("output_rows")
    head = list(copies.input).index("transformer.wte.weight")
    assert (rows is not None and rows[head] > VOCAB) == aligned, rows
    assert not [n.name for n in graph.node if n.op_type == "Concat" and copies.output[head] in n.input]
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    assert loss_on == loss_off
    for name, grad in grads_off.items():
        assert np.array_equal(grads_on[name], grad), name
    loss64, grads64 = _float64(copy.deepcopy(model), batch, None)
    check(abs(loss_on - loss64) / abs(loss64), BOUNDS[precision], "loss")
    for name, grad in grads64.items():
        check(_relative(grads_on[name].astype(np.float64), grad), BOUNDS[precision], name)

"""``benchmarks/graph_traffic.py``: the bytes a training graph's nodes move, by kind of operator."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import _runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import graph_traffic  # noqa: E402


def test_bytes_and_flops_of_a_hand_built_graph():
    """Cast [2, 3] float32 -> float16 (24 + 12 bytes), a Reshape (a view: nothing), a float16 MatMul by a
    [3, 4] initializer (12 + 24 in, 16 out; 2·2·4·3 FLOPs) and a Gemm with transA (the contracted length is
    A's first axis)."""
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Reshape", ["h", "shape"], ["r"]),
             helper.make_node("MatMul", ["r", "w"], ["y"]),
             helper.make_node("Gemm", ["x", "v"], ["z"], transA=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 5])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "shape"),
         numpy_helper.from_array(np.zeros((3, 4), np.float16), "w"),
         numpy_helper.from_array(np.zeros((2, 5), np.float32), "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = graph_traffic.traffic(model)
    assert result["kinds"] == {"casts": [36, 1], "matrix products": [52 + 24 + 40 + 60, 2]}
    assert result["ops"]["MatMul"] == [52, 1] and result["ops"]["Gemm"] == [124, 1]
    assert result["flops"] == 2 * 2 * 4 * 3 + 2 * 3 * 5 * 2
    assert result["unknown"] == 0 and result["nodes_total"] == 4
    assert [op for _, op, _ in result["nodes"]] == ["Gemm", "MatMul", "Cast"]


def test_bias_copies_and_torchs_products():
    """A biased ONNX Gemm [2, 3] · [3, 5] + c[5], float32: its inputs and output (24 + 60 + 20 + 40 bytes), and
    with ``bias_copies`` the output twice more (ONNX Runtime's copy of c into it, read back); torch_products'
    BiasGemm and MatMul (transB: the [2, 5, 3] operand read as [2, 3, 5]), whose shapes ONNX shape inference does
    not give, take theirs from their operands and have no such copy."""
    from ort_trainer.kernels import TORCH_OPS_DOMAIN

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"]),
             helper.make_node("BiasGemm", ["x", "w", "c"], ["t"], domain=TORCH_OPS_DOMAIN),
             helper.make_node("MatMul", ["x", "u"], ["m"], domain=TORCH_OPS_DOMAIN, transB=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, [2, 3])],
        [helper.make_tensor_value_info(name, f, None) for name in ("y", "t", "m")],
        [numpy_helper.from_array(np.zeros((3, 5), np.float32), "w"),
         numpy_helper.from_array(np.zeros(5, np.float32), "c"),
         numpy_helper.from_array(np.zeros((2, 5, 3), np.float32), "u")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(TORCH_OPS_DOMAIN, 1)])
    plain, copies = graph_traffic.traffic(model), graph_traffic.traffic(model, bias_copies=True)
    assert plain["unknown"] == 0
    assert plain["ops"]["Gemm"] == [144, 1] and copies["ops"]["Gemm"] == [144 + 80, 1]
    assert plain["ops"]["BiasGemm"] == copies["ops"]["BiasGemm"] == [144, 1]
    assert plain["ops"]["MatMul"] == [24 + 120 + 80, 1]  # m: [2, 2, 5]
    assert plain["flops"] == 2 * (2 * 10 * 3) + 2 * 20 * 3


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_the_script_compares_two_settings(capsys):
    """The tiny GPT-2 in float16 with half_precision_gelu (the default) against it off: the tables are printed,
    and the float32 GELU backward moves more bytes."""
    pytest.importorskip("transformers")
    graph_traffic.main(["--model", "gpt2-tiny", "--precision", "fp16", "--compare", '{"half_precision_gelu": false}',
                        "--top", "5"])
    out = capsys.readouterr().out
    assert "| kind | MB moved | nodes | MB moved (compared) |" in out and "| operator |" in out
    moved = [float(re.search(r"([\d.]+) MB moved", line).group(1)) for line in out.splitlines()
             if line.startswith(("gpt2-tiny fp16", "against"))]
    assert len(moved) == 2 and moved[1] > moved[0], moved


def test_cuda_placement_finds_the_copies_onnx_runtime_would_make():
    """``cuda_placement.host_copies`` on hand-built graphs, as ONNX Runtime's CUDA provider places them: a shape
    computed from the dims alone (``Shape`` of a symbolic shape, then ``Concat``: on the host) needs no copy; one
    computed from a float tensor's values (a ``ReduceSum`` on the GPU) is copied to the host for the ``Reshape``
    that reads it; a host value a GPU node reads (a ``Cast`` of dims, on the host, into a ``Mul`` of a GPU value) is
    copied to it; the ``Shape`` of a static shape is folded (no node, no copy); a float node that reads a graph input
    and a host value runs on the host (as ONNX Runtime places it: the input copied at binding), named."""
    from cuda_placement import host_copies

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    fixed = helper.make_tensor_value_info("f", TensorProto.FLOAT, [2, 4])
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
             numpy_helper.from_array(np.array([0], np.int64), "zero")]
    nodes = [helper.make_node("Shape", ["x"], ["dims"], end=1, name="dims"),
             helper.make_node("Concat", ["dims", "minus_one"], ["shape"], axis=0, name="on_host"),
             helper.make_node("Reshape", ["x", "shape"], ["a"], name="fine"),
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, name="total"),
             helper.make_node("Cast", ["total"], ["count"], to=TensorProto.INT64, name="count"),
             helper.make_node("Unsqueeze", ["count", "zero"], ["count1"], name="count1"),
             helper.make_node("Concat", ["count1", "minus_one"], ["shape2"], axis=0, name="on_gpu"),
             helper.make_node("Reshape", ["x", "shape2"], ["b"], name="waits"),
             helper.make_node("Cast", ["dims"], ["dims_float"], to=TensorProto.FLOAT, name="float_dims"),
             helper.make_node("Neg", ["x"], ["minus_x"], name="on_the_gpu"),
             helper.make_node("Mul", ["minus_x", "dims_float"], ["c"], name="reads_host"),
             helper.make_node("Shape", ["f"], ["static"], name="folded"),
             helper.make_node("Reshape", ["f", "static"], ["d"], name="static_reshape"),
             helper.make_node("Mul", ["x", "dims_float"], ["e"], name="float_on_host")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcde"]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, fixed], outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.graph.value_info.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                   for n in ("dims_float", "e")])
    assert host_copies(model) == [("HostFloats", "Cast 'float_dims'", "dims_float"), ("HostFloats", "Mul "
                                  "'float_on_host'", "e"), ("MemcpyToHost", "Reshape 'waits'", "shape2"),
                                  ("MemcpyFromHost", "Mul 'reads_host'", "dims_float")]

"""The translation's constant folding (``joint_onnx._optimize``) does not evaluate an ``Expand``
whose result it would drop for its size: the same graph, without the evaluation (GPT-2 small's
joint graph has 17 such expansions, ~0.6 s of its cold build)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import _runtime

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the translation's folding is onnxscript's")


def _model() -> onnx.ModelProto:
    """Two expansions of a constant: one past the folder's output limit (512·512 elements), one small."""
    constants = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                 numpy_helper.from_array(np.array([1024, 1024], np.int64), "large_shape"),
                 numpy_helper.from_array(np.array([4, 4], np.int64), "small_shape")]
    nodes = [helper.make_node("Expand", ["one", "large_shape"], ["large"]),
             helper.make_node("Expand", ["one", "small_shape"], ["small"]),
             helper.make_node("Add", ["x", "large"], ["y"]), helper.make_node("Add", ["z", "small"], ["w"])]
    graph = helper.make_graph(nodes, "expansions",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _optimized(monkeypatch, skip: bool) -> tuple[onnx.ModelProto, list]:
    import onnx_ir as ir
    from onnxscript.optimizer import _constant_folding

    from ort_trainer.graph.gradient import joint_onnx

    evaluated = []
    evaluate = _constant_folding._reference_evaluator.evaluate

    def spied(domain, op_type, version, *args, **kwargs):
        evaluated.append(op_type)
        return evaluate(domain, op_type, version, *args, **kwargs)

    monkeypatch.setattr(_constant_folding._reference_evaluator, "evaluate", spied)
    if not skip:
        monkeypatch.setattr(joint_onnx, "_unless_expanded_past", lambda limit, node: None)
    model = ir.serde.deserialize_model(_model())
    joint_onnx._optimize(model, full=False)
    monkeypatch.undo()
    return ir.serde.serialize_model(model), evaluated


def test_a_large_expansion_is_not_evaluated_and_the_graph_is_the_same(monkeypatch):
    """The 1024 × 1024 expansion stays an ``Expand`` either way; with the rule it is never evaluated, the
    4 × 4 one is folded into a constant as before."""
    with_rule, evaluated = _optimized(monkeypatch, skip=True)
    without_rule, evaluated_without = _optimized(monkeypatch, skip=False)
    assert evaluated_without.count("Expand") == 2 and evaluated.count("Expand") == 1
    assert [n.op_type for n in with_rule.graph.node] == [n.op_type for n in without_rule.graph.node]
    assert [n.op_type for n in with_rule.graph.node].count("Expand") == 1  # the large one
    assert with_rule.graph == without_rule.graph
    ort = pytest.importorskip("onnxruntime")
    feeds = {"x": np.zeros((1024, 1024), np.float32), "z": np.arange(16, dtype=np.float32).reshape(4, 4)}
    y, w = ort.InferenceSession(with_rule.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(y, 1.0)
    np.testing.assert_array_equal(w, feeds["z"] + 1.0)

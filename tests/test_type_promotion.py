"""``graph/gradient/promotion.py``: the exporter's explicit type promotion on the nodes that need
it only, with the graphs of the exporter's pass, which re-runs every node on fake tensors (~1 s of
GPT-2 small's cold build, 2.3 s of its first save)."""

import copy

import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.gradient import promotion
from ort_trainer.optim import SGDConfig

from models import tiny_gpt2

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")


def _nodes(model: onnx.ModelProto) -> list:
    return [(n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
            for n in model.graph.node]


def _build(precision: str, tmp_path, name: str) -> tuple:
    """HF GPT-2's training graph and saved model, built from scratch (an empty cache)."""
    model, desc = tiny_gpt2(seq=8)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    options = {} if precision == "float32" else {"mixed_precision": {"enabled": True, "dtype": "float16"}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.1),
                         options={"graph": {"gradient_source": "torch"}, **options})
    loss = float(trainer.train_step(ids, torch.ones_like(ids), ids)[0])
    trainer.save_as_onnx(str(tmp_path / f"{name}.onnx"))
    return _nodes(trainer._graphs.gradient), _nodes(onnx.load(str(tmp_path / f"{name}.onnx"))), loss


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_promoting_only_the_nodes_that_need_it_gives_the_pass_s_graphs(precision, monkeypatch, tmp_path):
    """HF GPT-2 (masks, integer positions, a cross-entropy; float16: autocast's casts, in submodules):
    its joint program has nodes to promote (Python integers scaling float tensors, a sum of booleans),
    its float32 eval-mode program (the saved model's) none. The training graph, the saved model and
    the first loss equal those of the exporter's pass run over every node."""
    from torch.onnx._internal.exporter import _fx_passes

    from ort_trainer.graph.gradient import joint_onnx

    counts = []
    targeted = promotion.insert_type_promotions
    monkeypatch.setattr(joint_onnx, "insert_type_promotions", lambda gm: counts.append(targeted(gm)))
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "targeted"))
    checked = _build(precision, tmp_path, "targeted")
    monkeypatch.setattr(joint_onnx, "insert_type_promotions", _fx_passes.insert_type_promotion_nodes)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "whole"))
    whole = _build(precision, tmp_path, "whole")
    assert counts[0] > 0 and len(counts) == 2, counts  # the joint program, then the saved model's
    if precision == "float32":
        assert counts[1] == 0
    assert checked == whole


class _IntegerDivision(torch.nn.Module):
    """Divides an integer tensor by an integer (a true division: float), which the pass must cast."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, counts):
        return self.linear(x).sum() / (counts.sum() + 1)


def test_an_implicit_promotion_still_runs_the_pass():
    """A program whose integer operands a division promotes to float: the check says so, and the
    pass inserts the casts it always did."""
    program = torch.export.export(_IntegerDivision(), (torch.randn(2, 4), torch.tensor([1, 2])))
    gm = program.run_decompositions().graph_module
    before = [n.target for n in gm.graph.nodes]
    assert promotion.insert_type_promotions(gm) >= 1
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert casts and len(list(gm.graph.nodes)) > len(before)


def test_the_pass_finds_an_overload_by_its_schema_where_torch_traced_the_operator():
    """torch before 2.13 found the overload that takes a promoted node's operands by tracing the operator, and
    a fake tensor's ``prim.device`` could come first ("Expected same OpOverload packet", torch 2.11: a loss
    piece's float32 ``add`` of its logits and the head's bias). Inside ``_overloads_by_schema`` the pass's search
    matches schemas, on fake tensors too, and the traced search is back on leaving; a torch that matches schemas
    already (2.13: no ``_OpTraceDispatchMode``) is left as it is."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    def traced(packet, args, kwargs):
        raise AssertionError("the traced search ran")

    older = SimpleNamespace(_OpTraceDispatchMode=object, find_compatible_op_overload=traced)
    with FakeTensorMode():
        logits, bias = torch.empty(16, 40), torch.empty(40)
    with promotion._overloads_by_schema(older):
        search = older.find_compatible_op_overload
        assert search(torch.ops.aten.add, (logits, bias), {}) is torch.ops.aten.add.Tensor
        assert search(torch.ops.aten.add, (logits, bias), {"alpha": 2}) is torch.ops.aten.add.Tensor
        with pytest.raises(RuntimeError, match="no overload of aten.add takes these operands"):
            search(torch.ops.aten.add, ("text", bias), {})
    assert older.find_compatible_op_overload is traced
    current = SimpleNamespace(find_compatible_op_overload=traced)
    with promotion._overloads_by_schema(current):
        assert current.find_compatible_op_overload is traced


def test_traces_record_no_stack_trace_where_torch_can_say_so(monkeypatch):
    """``without_stack_traces`` turns ``torch.fx.config.do_not_emit_stack_traces`` on inside and back after; a
    torch without the switch (2.11) traces as it is."""
    from types import SimpleNamespace

    from ort_trainer.graph.gradient import torch_export

    config = SimpleNamespace(do_not_emit_stack_traces=False)
    monkeypatch.setattr(torch.fx, "config", config)
    with torch_export.without_stack_traces():
        assert config.do_not_emit_stack_traces is True
    assert config.do_not_emit_stack_traces is False
    monkeypatch.setattr(torch.fx, "config", SimpleNamespace())
    with torch_export.without_stack_traces():
        pass

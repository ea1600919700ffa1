"""``graph/gradient/promotion.py``: the exporter's explicit type promotion runs only on a program
that has an operand whose type its rule would change, and otherwise leaves the graph as the pass
would (the pass re-runs every node on fake tensors: ~1 s of GPT-2 small's cold build)."""

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


def _node_list(module: torch.fx.GraphModule) -> list:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in module.graph.nodes]


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_a_program_whose_promotions_are_explicit_skips_the_pass_which_would_change_nothing(
        precision, monkeypatch, tmp_path):
    """HF GPT-2 (masks, integer positions, a cross-entropy; float16: autocast's casts): its training
    program needs promotions (Python integers scaling float tensors, a sum of booleans); in float32
    its eval-mode program (the saved model's) needs none (float16: autocast's mixed operands do). The
    pass, run anyway on each module said to need none, leaves its graph as it was."""
    from torch.onnx._internal.fx import passes

    decisions, unchanged = [], []
    decide = promotion._needs_promotion

    def checked(module, table, type_promotion):
        decisions.append(decide(module, table, type_promotion))
        if not decisions[-1]:
            before = _node_list(module)
            passes.InsertTypePromotion(module).run()
            unchanged.append(_node_list(module) == before)
        return decisions[-1]

    monkeypatch.setattr(promotion, "_needs_promotion", checked)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))  # built here, not found
    model, desc = tiny_gpt2(seq=8)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.ones_like(ids), ids)
    options = {} if precision == "float32" else {"mixed_precision": {"enabled": True, "dtype": "float16"}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.1),
                         options={"graph": {"gradient_source": "torch"}, **options})
    trainer._train_step_info.fetches = ["loss"]
    trainer.train_step(*batch)
    trainer._train_step_info.fetches = []
    trainer.eval_step(*batch)
    trainer.save_as_onnx(str(tmp_path / "model.onnx"))
    onnx.checker.check_model(str(tmp_path / "model.onnx"))
    assert decisions[0] and len(decisions) >= 2, decisions
    if precision == "float32":
        assert not any(decisions[1:]), decisions
        assert unchanged and all(unchanged), unchanged
    else:
        assert all(unchanged), unchanged


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
    assert promotion.insert_type_promotions(gm) == 1
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert casts and len(list(gm.graph.nodes)) > len(before)

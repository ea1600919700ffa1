"""Branches on a size the data gives (``ort_trainer/graph/export/data_sizes.py``): on the TorchScript route
(``onnxruntime`` gradient source) the trace would take the traced batch's branch at every step, so a size of a
tensor sized by the data, read on a branch's line, is refused; arithmetic on such a size stays in the graph and
trains as PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.optim import SGDConfig
from tolerances import check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_training_build(), reason="the 'onnxruntime' gradient source "
                                "needs the onnxruntime-training 1.19.2 build")
_DESC = {"inputs": [("x", ["batch", 3]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
_ROUTE = {"graph": {"gradient_source": "onnxruntime"}}


class _BranchOnCount(torch.nn.Module):
    """The mean square of the selected rows' outputs, zero where none is selected: a loss of 0.0 at every step
    when traced on a batch that selects none (PyTorch's: 0.093 on the next batch)."""

    def __init__(self, form):
        super().__init__()
        self.linear, self.form = torch.nn.Linear(3, 1), form

    def forward(self, x, y):
        out = self.linear(x).squeeze(1)
        selected = out[y > 0]
        if self.form == "if":
            if selected.shape[0] == 0:
                return out.sum() * 0
            return selected.pow(2).mean()
        if self.form == "conditional":
            return out.sum() * 0 if len(selected) == 0 else selected.pow(2).mean()
        if self.form == "named":
            count = len(selected)
            if count == 0:
                return out.sum() * 0
            return selected.pow(2).sum() / count
        count = selected.numel()  # read on its own line: the division keeps the traced count in the graph
        return selected.pow(2).sum() / count


@pytest.mark.parametrize("form", ["if", "conditional", "named"])
def test_a_branch_on_a_selections_size_is_refused_naming_the_line(form):
    trainer = ORTTrainer(_BranchOnCount(form), _DESC, SGDConfig(), options=_ROUTE)
    with pytest.raises(ExportError, match=r"a branch on the size of a tensor sized by the data .* in module "
                                          r"<top-level forward> \(_BranchOnCount\) at .*test_data_sizes\.py:\d+ "
                                          r"\((if selected|return out|count = len).*torch\.count_nonzero"):
        trainer.train_step(torch.randn(6, 3), torch.zeros(6, dtype=torch.int64))


def test_arithmetic_on_a_selections_size_trains_as_pytorch_whatever_the_count():
    torch.manual_seed(0)
    model = _BranchOnCount("arithmetic")
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, _DESC, SGDConfig(lr=0.1), options=_ROUTE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step, selected in enumerate([3, 1, 5]):
        x = torch.randn(6, 3, generator=generator)
        y = (torch.arange(6) < selected).long()
        got = float(trainer.train_step(x, y))
        optimizer.zero_grad()
        expected = reference(x, y)
        expected.backward()
        optimizer.step()
        # float32 sums of at most 6 terms (the selection's squares), carried through the weights
        check(relative_error(got, float(expected)), steps_bound(step + 1, length=6), f"step {step}")

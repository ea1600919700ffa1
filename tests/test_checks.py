"""Checks that raise on the batch's values (``if labels.max() >= vocab: raise``, ``assert``, the one inside
``F.gaussian_nll_loss``) are traced where they pass, and logged (``graph/export/validations.py``,
``graph/export/checked_losses.py``); a branch that does not raise stays refused."""

import logging

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _logging, _runtime
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.optim import SGDConfig
from models import sgd_steps_as_pytorch
from tolerances import steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")
TORCH = {"graph": {"gradient_source": "torch"}}
DESC = {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}


def _train_as_pytorch(model, desc, batches, caplog, source="torch"):
    """SGD steps of ``model`` in the trainer and in PyTorch: the losses agree; the warnings logged."""
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        # the same float32 arithmetic summed in other orders; observed <= 0.03 of the bound
        sgd_steps_as_pytorch(model, desc, batches, 0.1, lambda step: steps_bound(step + 1),
                             {"graph": {"gradient_source": source}})
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


class Checked(torch.nn.Module):
    """Checks that raise on the batch's values, as Hugging Face's CTC models check their labels."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        if y is not None and y.max() >= 3:
            raise ValueError("labels must be < 3")
        out = self.linear(x)
        assert torch.isfinite(out).all(), "the logits must be finite"
        if not (out.abs() < 1e6).all():
            raise ValueError("the logits are out of range")
        return F.cross_entropy(out, y)


@pytest.mark.parametrize("source", ["torch", "onnxruntime"])
def test_checks_that_raise_are_traced_where_they_pass_and_logged(source, caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_LOGGED", set())  # (each check is logged once per process)
    if source == "onnxruntime" and not _runtime.has_training_build():
        pytest.skip("the 'onnxruntime' gradient source needs the onnxruntime-training 1.19.2 build")
    torch.manual_seed(11)
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]
    logged = [m for m in _train_as_pytorch(Checked(), DESC, batches, caplog, source) if "a check that raises" in m]
    assert len(logged) == 3 and all("test_checks.py" in m for m in logged), logged
    assert "y.max() >= 3" in logged[0] and "assert torch.isfinite(out).all()" in logged[1]


def test_a_failing_check_raises_the_users_error_on_the_onnxruntime_route():
    """That route traces the first batch itself: the check runs on it."""
    if not _runtime.has_training_build():
        pytest.skip("the 'onnxruntime' gradient source needs the onnxruntime-training 1.19.2 build")
    trainer = ORTTrainer(Checked(), DESC, SGDConfig(), options={"graph": {"gradient_source": "onnxruntime"}})
    with pytest.raises(Exception, match="labels must be < 3"):
        trainer.train_step(torch.randn(5, 4), torch.tensor([0, 1, 5, 2, 1]))


class Branching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.linear(x)
        if out.mean() > 0:  # a branch on the data, no check: the graph would freeze the traced batch's side
            out = out * 2
        return F.cross_entropy(out, y)


def test_a_branch_that_does_not_raise_is_still_refused():
    trainer = ORTTrainer(Branching(), DESC, SGDConfig(lr=0.1), options=TORCH)
    with pytest.raises(ExportError, match=r"as a Python bool .*test_checks\.py:\d+ \(if out\.mean\(\) > 0:"):
        trainer.train_step(torch.randn(5, 4), torch.randint(0, 3, (5,)))




class GaussianHead(torch.nn.Module):
    """A mean and a variance per target: heteroscedastic ([b, 3] variances), or one per row ([b] variances)."""

    def __init__(self, per_row: bool, full: bool, reduction: str):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4 if per_row else 6)
        self.per_row, self.full, self.reduction = per_row, full, reduction

    def forward(self, x, y):
        h = self.linear(x)
        variance = F.softplus(h[:, 3] if self.per_row else h[:, 3:])
        loss = F.gaussian_nll_loss(h[:, :3], y, variance, full=self.full, reduction=self.reduction)
        return loss.mean() if self.reduction == "none" else loss


@pytest.mark.parametrize("per_row, full, reduction", [(False, False, "mean"), (True, True, "sum"),
                                                      (False, True, "none")])
def test_gaussian_nll_loss_trains_as_pytorch(per_row, full, reduction, caplog, monkeypatch):
    monkeypatch.setattr(_logging, "_LOGGED", set())  # (logged once per process)
    torch.manual_seed(17)
    batches = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(3)]
    desc = {"inputs": [("x", ["b", 4]), ("y", ["b", 3])], "outputs": [("loss", [], True)]}
    logged = _train_as_pytorch(GaussianHead(per_row, full, reduction), desc, batches, caplog)
    assert any("F.gaussian_nll_loss checks that no variance is negative" in m for m in logged), logged

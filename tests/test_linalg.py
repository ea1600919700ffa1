"""``torch.linalg.inv``, ``solve``, ``det``, ``slogdet`` and ``logdet`` train on the ``torch``
route (``graph/export/linalg.py``): the
inverse as ONNX Runtime's ``Inverse`` with torch's gradient formula, a solve as the inverse times the right-hand
side, the float32 determinant as ONNX ``Det``. Gradients against float64 PyTorch (which runs LU factorisations),
training, evaluation and the saved model against PyTorch."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript: pip install onnxscript")

from ort_trainer.graph.export.torchscript import ExportError  # noqa: E402
from ort_trainer.graph.gradient.autograd import export_joint  # noqa: E402
from models import classified_batches, sgd_steps_as_pytorch  # noqa: E402
from test_torch_autograd import assert_grads_match, desc, feeds_for, reference, run  # noqa: E402
from tolerances import FLOAT32, check, relative_error, steps_bound  # noqa: E402


class Matrices(torch.nn.Module):
    """Features through learned matrices: multiplied by an inverse (one and a batch of two), solved for (a matrix
    right-hand side, a vector, from the right), scaled by a determinant and its sign, shifted by log-determinants
    (``slogdet`` of a batch, ``logdet``)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.eye(4) + 0.2 * torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.eye(4) + 0.2 * torch.randn(2, 4, 4))
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = x @ torch.linalg.inv(self.a) + (x @ self.b.inverse()).mean(0)
        h = h + torch.linalg.solve(self.a, x.T).T + torch.linalg.solve(self.b[0], x, left=False)
        h = h + torch.linalg.solve(self.b[1], x[0]) * torch.linalg.det(self.a)
        h = h + 0.1 * torch.linalg.slogdet(self.b).logabsdet.sum() + 0.1 * torch.logdet(self.a @ self.a.T)
        return self.head(h * torch.slogdet(self.a)[0])


DESC = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True), ("out", ["batch", 3])]}


def test_gradients_equal_float64_pytorchs():
    """Within the suite's 1e-5 of float64 PyTorch's gradients (test_torch_autograd: float32 arithmetic of sums of
    a few terms; the inverses of matrices of condition ~2 add a few roundings)."""
    torch.manual_seed(0)
    model = Matrices()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    graphs = export_joint(model, F.cross_entropy, desc(DESC), [x.numpy(), y.numpy()])
    assert any(n.op_type == "Inverse" and n.domain == "com.microsoft" for n in graphs.gradient.graph.node)
    _, grads, _ = reference(model, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
    assert_grads_match(run(graphs.gradient, feeds_for(model, graphs.meta, {"x": x, "y": y})), graphs.meta, grads)


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return F.cross_entropy(out, y), out


def test_trains_evaluates_and_saves_as_pytorch(tmp_path):
    torch.manual_seed(1)
    batches = classified_batches(3, rows=6, features=4, seed=2)
    # float32 sums of at most 8 terms a step (the inverses' own roundings included), carried through the weights
    trainer, pytorch = sgd_steps_as_pytorch(_Loss(Matrices()), DESC, batches, 0.1,
                                            lambda step: steps_bound(step + 1, length=8),
                                            {"graph": {"gradient_source": "torch"}})
    x, y = batches[0]
    with torch.no_grad():
        want = pytorch(x, y)[1].numpy()
    check(relative_error(np.asarray(trainer.eval_step(x, y)[1]), want), steps_bound(4, length=8), "eval")
    path = tmp_path / "matrices.onnx"
    trainer.save_as_onnx(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: v for i, v in zip(session.get_inputs(), (x.numpy(), y.numpy()))}
    saved = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    check(relative_error(saved["out"], want), steps_bound(4, length=8), "saved model")


class DoubleDet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.eye(3, dtype=torch.float64))

    def forward(self, x):
        return (x.double() * torch.linalg.det(self.a)).sum().float()


def test_a_float64_determinant_is_refused_naming_the_operator():
    """ONNX Runtime has no float64 Det: left to torch's exporter, which names what it cannot translate."""
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import SGDConfig

    trainer = ORTTrainer(DoubleDet(), {"inputs": [("x", ["batch", 3])], "outputs": [("loss", [])]}, SGDConfig(),
                         options={"graph": {"gradient_source": "torch"}})
    with pytest.raises(ExportError, match=r"no translation for aten\.linalg_lu_solve"):
        trainer.train_step(torch.randn(2, 3))


def test_log_determinants_and_signs_are_torchs():
    """float32 matrices of either sign of determinant, a batch: signs equal, log-determinants within 10·2^-24 of
    torch's relative to max(1, |value|) (Det's LU and torch's add ~n roundings, n = 4); logdet NaN where the
    determinant is negative; the named fields as torch's."""
    from ort_trainer.graph.export.linalg import linalg_slogdet, logdet, slogdet

    generator = torch.Generator().manual_seed(3)
    a = torch.randn(6, 4, 4, generator=generator)
    ours, theirs = linalg_slogdet(a), torch.linalg.slogdet(a)
    assert type(ours) is type(theirs) and torch.equal(ours.sign, theirs.sign) and (theirs.sign < 0).any()
    check(float(((ours.logabsdet - theirs.logabsdet).abs() / theirs.logabsdet.abs().clamp(min=1)).max()),
          10 * FLOAT32, "logabsdet")
    assert type(slogdet(a)) is type(torch.slogdet(a))
    assert torch.equal(logdet(a).isnan(), torch.logdet(a).isnan())

"""In-place changes of an output whose backward reads it (DeBERTa's masked softmax zeroes its softmax's output in
place inside a Function taken for its forward) are taken out of place before autograd
(``graph/gradient/out_of_place.py``): the same values, checked in float64, and gradients equal to float64 PyTorch
running the Function's own backward."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript: pip install onnxscript")

from ort_trainer.graph.export import guard  # noqa: E402
from ort_trainer.graph.export.torchscript import ExportError  # noqa: E402
from ort_trainer.graph.gradient import before_autograd, out_of_place  # noqa: E402
from ort_trainer.graph.gradient.autograd import export_joint  # noqa: E402
from ort_trainer.graph.gradient.fx_nodes import rewrite_graphs  # noqa: E402
from test_torch_autograd import assert_grads_match, desc, feeds_for, reference, run  # noqa: E402


class Changes(torch.nn.Module):
    """Two changes that go out of place (a softmax's output masked, a sigmoid's incremented), one that stays (a
    product's: its backward does not read it) and one that cannot go (``tanh``'s output doubled after a view of it
    was taken: the view sees the change)."""

    def forward(self, x):
        s = torch.softmax(x, -1)
        s.masked_fill_(x > 0, 0)
        t = torch.sigmoid(x)
        t.add_(s)
        p = s * 3
        p.sub_(1)
        v = torch.tanh(x)
        w = v.view(-1)
        v.mul_(2)
        return t, p, w


def test_the_rewrite_keeps_every_value_and_leaves_a_viewed_change_in_place():
    x = torch.randn(3, 4, dtype=torch.float64)
    program = torch.export.export(Changes(), (x,), strict=False)
    before = program.module()(x)
    assert rewrite_graphs(program, out_of_place.out_of_place) == 2
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert {"aten.masked_fill.Scalar", "aten.add.Tensor", "aten.sub_.Tensor", "aten.mul_.Tensor"} <= set(targets)
    after = program.module()(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the same operations on the same values


class MaskedSoftmax(torch.autograd.Function):
    """DeBERTa's ``XSoftmax``, shortened: its softmax's output zeroed in place where masked, its backward
    softmax's, written by hand."""

    @staticmethod
    def forward(ctx, x, mask):
        out = torch.softmax(x.masked_fill(~mask, -1e9), -1)
        out.masked_fill_(~mask, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, -1, out.dtype), None


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scores, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(MaskedSoftmax.apply(self.scores(x), x > -0.5))


def test_a_function_changing_its_saved_output_in_place_has_float64_pytorchs_gradients(monkeypatch):
    monkeypatch.setattr(guard, "DERIVATIVE_BACKWARDS", guard.DERIVATIVE_BACKWARDS | {f"{__name__}.MaskedSoftmax"})
    torch.manual_seed(3)
    model = Attention()
    d = desc({"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
              "outputs": [("loss", [], True), ("out", ["batch", 3])]})
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    graphs = export_joint(model, F.cross_entropy, d, [x.numpy(), y.numpy()])
    _, grads, _ = reference(model, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))  # the Function's backward
    assert_grads_match(run(graphs.gradient, feeds_for(model, graphs.meta, {"x": x, "y": y})), graphs.meta, grads)

    monkeypatch.setattr(before_autograd, "out_of_place", lambda graph: 0)  # without the rewrite: refused
    with pytest.raises(ExportError, match="modified by an inplace operation"):
        export_joint(Attention(), F.cross_entropy, d, [x.numpy(), y.numpy()])

"""``nn.LSTM`` as oneDNN's LSTM layers on the ``torch`` gradient source (``graph_optimizations.fused_lstm``,
``ort_trainer/graph/export/fused_lstm.py``): each layer and direction one ``LSTMLayer`` node running the kernels
eager PyTorch trains with on the CPU, ``save_as_onnx`` writing ONNX's own ``LSTM`` (``kernels/standard_lstm.py``),
checked against eager PyTorch and a float64 reference.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer import ORTTrainer
from ort_trainer._runtime import has_onnxscript
from ort_trainer.graph.export import fused_lstm
from ort_trainer.kernels import torch_ops
from ort_trainer.optim import SGDConfig
from tolerances import FLOAT32, check, relative_error, steps_bound

pytestmark = [pytest.mark.skipif(not has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript"),
              pytest.mark.skipif(not fused_lstm.available(), reason="this torch has no oneDNN")]

# The trainer against eager PyTorch, float32, 3 SGD steps: the same LSTM kernels, then the head's and the loss's
# sums in another order (8 steps x 12 features x 2 directions feed each output): steps_bound(3, length=192) =
# 3.4e-5. Observed: <= 1.9e-7.
TRAINING_BOUND = steps_bound(3, length=8 * 12 * 2)
# ONNX's LSTM (save_as_onnx) against float64 PyTorch: each gate sums 5 inputs + 6 states + 2 biases, through 8
# steps and 2 layers whose states carry every earlier step's error: 2 x 8 x 13 = 208 roundings of float32, with a
# 10x margin for the activations' own (sigmoid, tanh: a few ulps each): 1.2e-4. Observed: <= 1.2e-7.
STANDARD_BOUND = 10 * 2 * 8 * 13 * FLOAT32
_TORCH_ROUTE = {"graph": {"gradient_source": "torch"}}


def _with_fused_layers(function):
    """``function()`` with ``torch.lstm`` computed as the export guard computes it (a training trace)."""
    replacements = fused_lstm.replacements(True)

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return replacements.get(func, func)(*args, **(kwargs or {}))

    with Mode():
        return function()


def test_each_layer_is_pytorchs_own_kernel_bit_for_bit():
    """Outputs, final states and every gradient of the fused layers equal eager PyTorch's (the same oneDNN kernels on
    the same tensors): one and two layers, directions, with and without biases and initial states, batch first."""
    for bidirectional, layers, bias, batch_first, with_hx in itertools.product(*[(False, True)] * 5):
        layers += 1
        torch.manual_seed(layers)
        lstm = torch.nn.LSTM(5, 6, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=batch_first)
        x = torch.randn((3, 7, 5) if batch_first else (7, 3, 5), requires_grad=True)
        states = layers * (2 if bidirectional else 1)
        hx = tuple(torch.randn(states, 3, 6, requires_grad=True) for _ in range(2)) if with_hx else None
        leaves = [x, *lstm.parameters(), *(hx or ())]

        def run():
            output, (h, c) = lstm(x, hx)
            return [output, h, c, *torch.autograd.grad(output.pow(2).sum() + 2 * h.sum() + 3 * c.sum(), leaves)]

        what = f"{bidirectional=} {layers=} {bias=} {batch_first=} {with_hx=}"
        for got, expected in zip(_with_fused_layers(run), run()):
            assert torch.equal(got, expected), what


def test_the_layers_keep_no_workspace_outside_training_and_a_backward_without_one_says_why():
    lstm = torch.nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3)
    zeros = torch.zeros(2, 4)
    weights = [p.detach() for p in lstm.parameters()]
    *outputs, key = fused_lstm.lstm_layer_op(x, *weights, zeros, zeros, False, False)
    assert int(key[0]) == 0
    with pytest.raises(RuntimeError, match="kept no workspace for this backward"):
        fused_lstm.lstm_layer_grad_op(x, *weights, zeros, zeros, *outputs, key, torch.ones_like(outputs[0]),
                                      zeros, zeros, False)


class _Tagger(torch.nn.Module):
    """Features -> a value per step and the final states' energy: a 2-layer bidirectional LSTM with a head."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(5, 6, num_layers=2, bidirectional=True)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x, target):
        out, (h, c) = self.lstm(x)
        predicted = self.head(out)
        return torch.nn.functional.mse_loss(predicted, target) + h.pow(2).mean() + c.pow(2).mean(), predicted


_DESC = {"inputs": [("x", ["steps", "batch", 5]), ("target", ["steps", "batch", 3])],
         "outputs": [("loss", [], True), ("predicted", ["steps", "batch", 3])]}


def _layer_nodes(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(n.op_type, next((a.i for a in n.attribute if a.name == "train"), -1))
            for n in model.graph.node if n.domain == torch_ops.DOMAIN]


def test_a_fused_lstm_trains_evaluates_and_exports_like_pytorch(tmp_path):
    torch.manual_seed(0)
    model = _Tagger()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, _DESC, SGDConfig(lr=0.1), options=_TORCH_ROUTE)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = torch.randn(8, 4, 5, generator=generator), torch.randn(8, 4, 3, generator=generator)
        got = float(trainer.train_step(*batch)[0].detach())
        optimizer.zero_grad()
        expected = reference(*batch)[0]
        expected.backward()
        optimizer.step()
        check(relative_error(got, float(expected.detach())), TRAINING_BOUND, f"step {step}")
    # each layer and direction one node (the gradient graph: 4 forwards, 4 backwards), nothing unrolled
    gradient = trainer._graphs.gradient
    assert sorted(_layer_nodes(gradient)) == [("LSTMLayer", 1)] * 4 + [("LSTMLayerGrad", -1)] * 4
    assert not any(n.op_type == "Sigmoid" for n in gradient.graph.node)
    # the graphs with torch's kernels run without spinning intra-op threads (they would take torch's cores)
    sessions = trainer._engine.sessions
    assert sessions._torch_kernel_options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # the others keep the default (spinning)
        sessions.options.get_session_config_entry("session.intra_op.allow_spinning")
    state = trainer.state_dict(pytorch_format=True)
    for name, expected in reference.state_dict().items():
        check(relative_error(state[name].numpy(), expected.numpy()), TRAINING_BOUND, name)

    batch = torch.randn(11, 3, 5, generator=generator), torch.randn(11, 3, 3, generator=generator)  # a new length
    with torch.no_grad():
        expected = reference(*batch)
    check(relative_error(trainer.eval_step(*batch)[1].numpy(), expected[1].numpy()), TRAINING_BOUND, "eval_step")
    evaluations = [_layer_nodes(model) for model in trainer._engine.sessions._models.values()
                   if _layer_nodes(model) and ("LSTMLayerGrad", -1) not in _layer_nodes(model)]
    assert evaluations and all(sorted(nodes) == [("LSTMLayer", 0)] * 4 for nodes in evaluations), \
        "the eval graph's layers keep no workspace for a backward"

    path = tmp_path / "tagger.onnx"
    trainer.save_as_onnx(str(path))
    saved = onnx.load(str(path))
    assert [n.op_type for n in saved.graph.node].count("LSTM") == 4 and not _layer_nodes(saved)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["steps", "batch", 5]  # one model for every length
    batch = torch.randn(13, 2, 5, generator=generator), torch.randn(13, 2, 3, generator=generator)
    outputs = session.run(None, {"x": batch[0].numpy(), "target": batch[1].numpy()})
    with torch.no_grad():
        float64 = copy.deepcopy(reference).double()(*(t.double() for t in batch))
    for name, got, expected in zip(("loss", "predicted"), outputs, float64):
        check(relative_error(np.asarray(got, dtype=np.float64), expected.numpy()), STANDARD_BOUND, name)


class _Summed(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.rnn(x)[0].sum(-1), target)


@pytest.mark.parametrize("case", ["switched off", "projections", "gru"])
def test_what_the_layers_do_not_take_trains_unrolled(case, tmp_path):
    """With the switch off, an LSTM with projections, and a GRU, the recurrence is unrolled as before (no layer
    nodes) and trains like eager PyTorch; eval_step and the saved model too (an LSTM with projections is unrolled
    there: ONNX's LSTM has none, and its translation made an invalid graph)."""
    torch.manual_seed(0)
    projections = 4 if case == "projections" else 0
    rnn = torch.nn.GRU(5, 6, batch_first=True) if case == "gru" else \
        torch.nn.LSTM(5, 6, proj_size=projections, batch_first=True)
    model = _Summed(rnn)
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", ["batch", 3, 5]), ("target", ["batch", 3])], "outputs": [("loss", [], True)]}
    options = {**_TORCH_ROUTE, "graph_optimizations": {"fused_lstm": case != "switched off"}}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), options=options)
    x, target = torch.randn(4, 3, 5), torch.randn(4, 3)
    with torch.no_grad():
        expected = float(reference(x, target))
    check(relative_error(float(trainer.eval_step(x, target)), expected), TRAINING_BOUND, f"{case}: eval_step")
    check(relative_error(float(trainer.train_step(x, target)), float(reference(x, target))), TRAINING_BOUND, case)
    assert not _layer_nodes(trainer._graphs.gradient)
    trainer.save_as_onnx(str(tmp_path / "rnn.onnx"))
    session = ort.InferenceSession(str(tmp_path / "rnn.onnx"), providers=["CPUExecutionProvider"])
    saved = float(session.run(None, {"x": x.numpy(), "target": target.numpy()})[0])
    check(relative_error(saved, float(trainer.eval_step(x, target))), TRAINING_BOUND, f"{case}: the saved model")

"""Packed sequences (``pack_padded_sequence`` into ``nn.LSTM``/``nn.GRU``/``nn.RNN``, ``pad_packed_sequence``) on
the ``torch`` gradient source: trained as padded batches masked by their lengths
(``ort_trainer/graph/export/packed_sequences.py``), checked against PyTorch's packed kernels in float64 and against
eager PyTorch's training, ``eval_step`` and ``save_as_onnx``.
"""

from __future__ import annotations

import copy
import functools
import itertools

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ort_trainer import ORTTrainer
from ort_trainer._runtime import has_onnxscript
from ort_trainer.graph.export import fused_lstm, packed_sequences
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.kernels import torch_ops
from ort_trainer.optim import SGDConfig
from models import sgd_steps_as_pytorch
from tolerances import FLOAT32, FLOAT64, check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")

# The masked recurrence against PyTorch's packed kernel, float64: the same gate arithmetic with sums of at most
# 6 steps × (4 inputs + 5 hidden) = 54 terms per layer, 2 layers deep, each in another order. 108 · u, with a
# 100x margin for the gradients' longer chains: 1.2e-12. Observed: ≤ 3.6e-15 of the values' magnitude.
FLOAT64_BOUND = 100 * 2 * 6 * (4 + 5) * FLOAT64
# The trainer against eager PyTorch, float32, 4 SGD steps: the gate sums take 7 steps × (12 inputs + 6 hidden)
# terms in each of 2 layers: steps_bound(4, length=252) = 6.0e-5. Observed: ≤ 1.1e-7 (losses), 5.7e-8 (weights).
TRAINING_BOUND = steps_bound(4, length=2 * 7 * (12 + 6))
# oneDNN's float32 LSTM (masked_direction) against the float64 packed kernel: the same 2 · 6 · 9 = 108 roundings of
# float32 along a chain, and the cell state's closed form one more, with a 10x margin for the activations' own
# (sigmoid, tanh: a few ulps each): 6.4e-5. Observed: <= 2.9e-7 of the values' magnitude.
FUSED_BOUND = 10 * 2 * 6 * (4 + 5) * FLOAT32
_TORCH_ROUTE = {"graph": {"gradient_source": "torch"}}  # "auto" picks the TorchScript route with onnxruntime-training


def _packed_by_pytorch(rnn, x, lengths, batch_first, enforce_sorted, hx):
    out, hidden = rnn(pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted), hx)
    padded, lengths = pad_packed_sequence(out, batch_first=batch_first, total_length=x.shape[1 if batch_first else 0])
    return padded, lengths, hidden if isinstance(hidden, tuple) else (hidden,)


def _packed_masked(rnn, x, lengths, batch_first, enforce_sorted, hx, lstm_direction=None):
    """``_packed_by_pytorch`` with ``packed_sequences``' pack, recurrence and pad (as the guard calls them)."""
    batch_dim = 0 if batch_first else 1
    order = None if enforce_sorted else torch.sort(lengths, descending=True)[1]
    if order is not None:
        x, lengths = x.index_select(batch_dim, order), lengths[order]
    packed = PackedSequence(*packed_sequences.pack(x, lengths, batch_first), order)
    out, hidden = packed_sequences._packed_forward(rnn, packed, hx, lstm_direction)
    padded, lengths = packed_sequences.pad(out.data, out.batch_sizes, batch_first, 0.0, x.shape[batch_dim ^ 1])
    if order is not None:
        padded, lengths = padded.index_select(batch_dim, out.unsorted_indices), lengths[out.unsorted_indices]
    return padded, lengths, hidden if isinstance(hidden, tuple) else (hidden,)


@pytest.mark.parametrize("layer, options", [(torch.nn.LSTM, {}), (torch.nn.LSTM, {"proj_size": 3}),
                                            (torch.nn.GRU, {}), (torch.nn.GRU, {"bias": False}), (torch.nn.RNN, {}),
                                            (torch.nn.RNN, {"nonlinearity": "relu"})],
                         ids=["lstm", "lstm-projected", "gru", "gru-without-biases", "rnn-tanh", "rnn-relu"])
def test_the_masked_recurrence_is_pytorchs_packed_kernel_in_float64(layer, options):
    """Outputs, final states and the gradients of all of them, for 1 and 2 layers, one and two directions, batch
    first or not, sorted or not, with and without initial states: a length of 1 and sequences ending before the
    padding included."""
    generator = torch.Generator().manual_seed(3)
    steps, batch = 6, 4
    for bidirectional, layers, batch_first, enforce_sorted, with_hx in itertools.product(*[(False, True)] * 5):
        layers += 1
        torch.manual_seed(layers)
        rnn = layer(4, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, **options).double()
        lengths = torch.tensor([6, 5, 3, 1] if enforce_sorted else [5, 3, 6, 1])
        x = torch.randn((batch, steps, 4) if batch_first else (steps, batch, 4), dtype=torch.double,
                        generator=generator, requires_grad=True)
        states = layers * (2 if bidirectional else 1)
        hx = None
        if with_hx:
            hx = torch.randn(states, batch, options.get("proj_size", 5), dtype=torch.double, generator=generator)
            if layer is torch.nn.LSTM:
                hx = (hx, torch.randn(states, batch, 5, dtype=torch.double, generator=generator))
        expected = _packed_by_pytorch(rnn, x, lengths, batch_first, enforce_sorted, hx)
        got = _packed_masked(rnn, x, lengths, batch_first, enforce_sorted, hx)
        assert torch.equal(got[1], expected[1])
        weights = torch.randn(expected[0].shape, dtype=torch.double, generator=generator)
        gradients = [torch.autograd.grad((padded * weights).sum() + sum(h.sum() for h in hidden),
                                         [x, *rnn.parameters()]) for padded, _, hidden in (got, expected)]
        what = f"{bidirectional=} {layers=} {batch_first=} {enforce_sorted=} {with_hx=}"
        pairs = [("output", got[0], expected[0]), *[("final state", a, b) for a, b in zip(got[2], expected[2])],
                 *[("gradient", a, b) for a, b in zip(*gradients)]]
        for name, a, b in pairs:
            check(relative_error(a.detach().numpy(), b.detach().numpy()), FLOAT64_BOUND, f"{what}: {name}")


@pytest.mark.skipif(not fused_lstm.available(), reason="this torch has no oneDNN")
def test_a_packed_lstm_through_onednns_layers_is_pytorchs_packed_kernel():
    """``fused_lstm.masked_direction`` (float32: oneDNN's kernels) against PyTorch's packed kernel in float64:
    outputs, both final states and all their gradients, for the cases above, with and without biases; the cell
    state at each sequence's last step is summed in closed form. A zero length keeps the initial states exactly."""
    generator = torch.Generator().manual_seed(3)
    lstm_direction = functools.partial(fused_lstm.masked_direction, True)  # keeping workspaces: a backward follows
    for bidirectional, layers, batch_first, enforce_sorted, with_hx, bias in itertools.product(*[(False, True)] * 6):
        layers += 1
        torch.manual_seed(layers)
        lstm = torch.nn.LSTM(4, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
        lengths = torch.tensor([6, 5, 3, 1] if enforce_sorted else [5, 3, 6, 1])
        x = torch.randn((4, 6, 4) if batch_first else (6, 4, 4), generator=generator, requires_grad=True)
        states = layers * (2 if bidirectional else 1)
        hx = tuple(torch.randn(states, 4, 5, generator=generator) for _ in range(2)) if with_hx else None
        float64 = copy.deepcopy(lstm).double()
        x64 = x.detach().double().requires_grad_()
        expected = _packed_by_pytorch(float64, x64, lengths, batch_first, enforce_sorted,
                                      None if hx is None else tuple(h.double() for h in hx))
        got = _packed_masked(lstm, x, lengths, batch_first, enforce_sorted, hx, lstm_direction)
        assert torch.equal(got[1], expected[1])
        weights = torch.randn(expected[0].shape, dtype=torch.double, generator=generator)
        gradients = [torch.autograd.grad((padded * weights.to(padded.dtype)).sum() + sum(h.sum() for h in hidden),
                                         leaves) for (padded, _, hidden), leaves in
                     ((got, [x, *lstm.parameters()]), (expected, [x64, *float64.parameters()]))]
        what = f"{bidirectional=} {layers=} {batch_first=} {enforce_sorted=} {with_hx=} {bias=}"
        pairs = [("output", got[0], expected[0]), *[("final state", a, b) for a, b in zip(got[2], expected[2])],
                 *[("gradient", a, b) for a, b in zip(*gradients)]]
        for name, a, b in pairs:
            check(relative_error(a.detach().double().numpy(), b.detach().numpy()), FUSED_BOUND, f"{what}: {name}")
    assert not fused_lstm._WORKSPACES, "every backward took its forward's workspace"
    lstm = torch.nn.LSTM(4, 5)
    x, hx = torch.randn(6, 2, 4), tuple(torch.randn(1, 2, 5) for _ in range(2))
    packed = PackedSequence(*packed_sequences.pack(x, torch.tensor([3, 0]), False))
    with torch.no_grad():
        out, (h, c) = packed_sequences._packed_forward(lstm, packed, hx, functools.partial(fused_lstm.masked_direction,
                                                                                           False))
    assert not out.data.reshape(6, 2, 5)[:, 1].any() and torch.equal(h[0, 1], hx[0][0, 1])
    assert torch.equal(c[0, 1], hx[1][0, 1])


class _Classifier(torch.nn.Module):
    """Token ids and their lengths -> classes: the mean of a packed bidirectional 2-layer RNN's outputs over each
    sequence's own steps, beside the last layer's final state."""

    def __init__(self, layer):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.rnn = layer(8, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(12 + 6, 3)

    def forward(self, ids, lengths, label):
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, hidden = self.rnn(packed)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        out, lengths = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        pooled = out.sum(1) / lengths[:, None].to(out.dtype)
        return torch.nn.functional.cross_entropy(self.head(torch.cat([pooled, hidden[-1]], -1)), label)


_DESC = {"inputs": [("ids", ["batch", 7]), ("lengths", ["batch"]), ("label", ["batch"])],
         "outputs": [("loss", [], True)]}


def _batch(generator, batch=5):
    lengths = torch.randint(1, 8, (batch,), generator=generator)
    return torch.randint(0, 20, (batch, 7), generator=generator), lengths, torch.randint(0, 3, (batch,),
                                                                                          generator=generator)


@pytest.mark.parametrize("layer, fused", [(torch.nn.LSTM, True), (torch.nn.LSTM, False), (torch.nn.GRU, True)],
                         ids=["lstm", "lstm-unrolled", "gru"])
def test_a_packed_rnn_trains_evaluates_and_exports_like_pytorch(layer, fused, tmp_path):
    """An LSTM runs oneDNN's layers (``graph_optimizations.fused_lstm``, on by default: one ``LSTMLayer`` node per
    layer and direction); switched off, and a GRU, unrolled."""
    torch.manual_seed(0)
    options = {**_TORCH_ROUTE, "graph_optimizations": {"fused_lstm": fused}}
    generator = torch.Generator().manual_seed(1)
    trainer, reference = sgd_steps_as_pytorch(_Classifier(layer), _DESC, [_batch(generator) for _ in range(4)], 0.5,
                                              lambda _: TRAINING_BOUND, options)
    layers = [n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == torch_ops.DOMAIN]
    fused_layers = fused and layer is torch.nn.LSTM and fused_lstm.available()
    assert sorted(layers) == (["LSTMLayer"] * 4 + ["LSTMLayerGrad"] * 4 if fused_layers else [])
    state = trainer.state_dict(pytorch_format=True)
    for name, expected in reference.state_dict().items():
        check(relative_error(state[name].numpy(), expected.numpy()), TRAINING_BOUND, name)
    batch = _batch(generator, batch=3)
    with torch.no_grad():
        expected = float(reference(*batch))
    check(relative_error(float(trainer.eval_step(*batch)), expected), TRAINING_BOUND, "eval_step")
    path = tmp_path / "classifier.onnx"
    trainer.save_as_onnx(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 7]  # the batch stays symbolic
    outputs = session.run(None, {"ids": batch[0].numpy(), "lengths": batch[1].numpy(), "label": batch[2].numpy()})
    check(relative_error(np.asarray(outputs[0]), expected), TRAINING_BOUND, "save_as_onnx")


class _Seq2Seq(torch.nn.Module):
    """A packed encoder's final states, both of every layer, start a decoder over the targets (``c_n`` read too)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.encoder = torch.nn.LSTM(8, 6, num_layers=2, batch_first=True)
        self.decoder = torch.nn.LSTM(8, 6, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(6, 20)

    def forward(self, ids, lengths, targets):
        _, state = self.encoder(pack_padded_sequence(self.embed(ids), lengths, batch_first=True,
                                                     enforce_sorted=False))
        out, _ = self.decoder(self.embed(targets[:, :-1]), state)
        return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), targets[:, 1:].flatten())


# 4 SGD steps; each gate sums 8 inputs + 6 states through the encoder's 7 steps and the decoder's 5, 2 layers each:
# steps_bound(4, length=2 * 12 * 14) = 8.0e-5.
SEQ2SEQ_BOUND = steps_bound(4, length=2 * (7 + 5) * (8 + 6))


@pytest.mark.skipif(not fused_lstm.available(), reason="this torch has no oneDNN")
def test_a_packed_encoders_final_cell_state_trains_and_saves_with_a_symbolic_length_like_pytorch(tmp_path):
    """Through oneDNN's layers a packed LSTM's graph has no step of its own: ``save_as_onnx`` keeps the sequence
    length symbolic (the unrolled recurrence fixes it)."""
    torch.manual_seed(0)
    desc = {"inputs": [("ids", ["batch", "steps"]), ("lengths", ["batch"]), ("targets", ["batch", 6])],
            "outputs": [("loss", [], True)]}
    generator = torch.Generator().manual_seed(1)
    batches = [(*_batch(generator)[:2], torch.randint(0, 20, (5, 6), generator=generator)) for _ in range(4)]
    trainer, reference = sgd_steps_as_pytorch(_Seq2Seq(), desc, batches, 0.5, lambda _: SEQ2SEQ_BOUND, _TORCH_ROUTE)
    layers = [n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == torch_ops.DOMAIN]
    assert sorted(layers) == ["LSTMLayer"] * 4 + ["LSTMLayerGrad"] * 4  # the encoder's 2 and the decoder's 2
    state = trainer.state_dict(pytorch_format=True)
    for name, expected in reference.state_dict().items():
        check(relative_error(state[name].numpy(), expected.numpy()), SEQ2SEQ_BOUND, name)
    path = tmp_path / "seq2seq.onnx"
    trainer.save_as_onnx(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", "steps"]
    batch = (torch.randint(0, 20, (3, 11), generator=generator), torch.tensor([11, 4, 9]),
             torch.randint(0, 20, (3, 6), generator=generator))  # a length the training never saw
    with torch.no_grad():
        expected = float(reference(*batch))
    (got,) = session.run(None, {name: t.numpy() for name, t in zip(("ids", "lengths", "targets"), batch)})
    check(relative_error(float(got), expected), SEQ2SEQ_BOUND, "save_as_onnx")


class _LossOnPackedRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x, lengths, labels):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        targets = pack_padded_sequence(labels, lengths, enforce_sorted=False)
        return torch.nn.functional.cross_entropy(self.head(out.data), targets.data)


def test_an_operation_on_a_packed_batchs_rows_is_refused_naming_the_fix():
    """A loss over ``PackedSequence.data`` would count the padding rows the masked batch keeps: refused."""
    desc = {"inputs": [("x", [5, 2, 4]), ("lengths", [2]), ("labels", [5, 2])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(_LossOnPackedRows(), desc, SGDConfig(), options=_TORCH_ROUTE)
    with pytest.raises(ExportError, match=r"(?s)linear\(\) on a PackedSequence's \.data in module head \(Linear\) "
                                          r"at .*test_packed_sequences\.py:\d+ \(return .*self\.head\(out\.data\).*"
                                          r"padding rows.*pad_packed_sequence.*cross_entropy\(\) on a PackedSequence"):
        trainer.train_step(torch.randn(5, 2, 4), torch.tensor([5, 3]), torch.randint(0, 2, (5, 2)))


@pytest.mark.parametrize("on_fake", [False, True], ids=["eager", "fake"])
def test_the_operator_record_keys_a_packed_model_whatever_the_lengths(on_fake):
    """PyTorch's packing reads the lengths into Python, which makes the record decline (every build would trace);
    the record packs as the trace does, so the graph cache finds a packed model without an export."""
    from ort_trainer.graph.export import op_record
    from ort_trainer.model_desc import parse_model_desc

    torch.manual_seed(0)
    model, generator = _Classifier(torch.nn.LSTM), torch.Generator().manual_seed(2)
    keys = [op_record.record(model, None, parse_model_desc(_DESC), [t.numpy() for t in _batch(generator)],
                             op_record.exporting_flags, on_fake=on_fake) for _ in range(2)]
    assert keys[0] is not None and keys[0].key == keys[1].key

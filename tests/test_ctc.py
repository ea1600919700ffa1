"""CTC loss trains on the ``torch`` route as in PyTorch: ``F.ctc_loss`` / ``nn.CTCLoss`` (and Hugging Face's
``...ForCTC`` models) run torch's own CTC kernels inside ONNX Runtime (``graph/export/ctc.py``,
``kernels/csrc/torch_ops.cc``), and ``save_as_onnx`` writes the loss in standard operators
(``kernels/standard_ctc.py``)."""

import copy
import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.kernels.standard_ctc import standard_ctc
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.graph.gradient.autograd import export_joint
from ort_trainer.kernels import TORCH_OPS_DOMAIN, _compilers, torch_ops
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig
from models import sgd_steps_as_pytorch
from tolerances import FLOAT32, FLOAT64, check, relative_error, steps_bound

pytestmark = [pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                 "onnxscript"),
              pytest.mark.skipif(_compilers()[1] is None, reason="torch's CTC kernels are built with a C++ compiler")]
TORCH = {"graph": {"gradient_source": "torch"}}
CLASSES, STEPS = 6, 4
# Lengths of the test batches: sequence 2 cannot align its 3 labels in 2 frames (an infinite loss).
INPUT_LENGTHS, TARGET_LENGTHS = [9, 7, 2], [4, 2, 3]


class Frames(torch.nn.Module):
    """Per-frame class log-probabilities [frames, batch, classes] of features [batch, frames, 4], and their CTC
    loss against targets [batch, 4] (padded), or concatenated first with ``masked_select`` (Hugging Face's way)."""

    def __init__(self, concatenated: bool = False, reduction: str = "mean", zero_infinity: bool = True):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(16, CLASSES)
        self.concatenated, self.reduction, self.zero_infinity = concatenated, reduction, zero_infinity

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.b(torch.tanh(self.a(x))).log_softmax(-1).transpose(0, 1)
        if self.concatenated:
            targets = targets.masked_select(torch.arange(targets.shape[1]) < target_lengths[:, None])
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction=self.reduction,
                          zero_infinity=self.zero_infinity)
        return (loss.sum() if self.reduction == "none" else loss), log_probs  # (the per-sequence losses summed)


DESC = {"inputs": [("x", ["batch", "frames", 4]), ("targets", ["batch", "longest"]), ("input_lengths", ["batch"]),
                   ("target_lengths", ["batch"])],
        "outputs": [("loss", [], True), ("log_probs", ["frames", "batch", CLASSES])]}


def _batch(seed: int, frames: int = 9):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(1, CLASSES, (3, 4), generator=g)
    targets[1, 2:] = -100  # padding past a target's length is never read
    lengths = [min(n, frames) for n in INPUT_LENGTHS]
    return (torch.randn(3, frames, 4, generator=g), targets, torch.tensor(lengths), torch.tensor(TARGET_LENGTHS))


# Gradients in float32 from ONNX Runtime against float64 PyTorch: the CTC recursions over 9 frames round ~6 times
# a frame each way (a 3-term log-sum-exp and an add: ~110 roundings), after the model's sums (16 and 4 terms) and
# log-softmax (6): ~150·u = 8.9e-6 of the largest gradient; bound 20x that. Observed (2-core Intel Xeon): <= 0.02.
GRADIENT_BOUND = 150 * FLOAT32 * 20


@pytest.mark.parametrize("concatenated, reduction", [(False, "mean"), (True, "sum"), (True, "none")])
def test_ctc_gradients_equal_float64_pytorch(concatenated, reduction):
    torch.manual_seed(3)
    model = Frames(concatenated, reduction)
    graphs = export_joint(model, None, parse_model_desc(DESC), [t.numpy() for t in _batch(0)])
    batch = _batch(1, frames=8)  # another batch, fewer frames
    double = copy.deepcopy(model).double()
    double(batch[0].double(), *batch[1:])[0].backward()
    options = ort.SessionOptions()
    torch_ops.register(options)
    session = ort.InferenceSession(graphs.gradient.SerializeToString(), options, providers=["CPUExecutionProvider"])
    state = model.state_dict()
    feeds = {name: t.numpy() for name, t in zip(["x", "targets", "input_lengths", "target_lengths"], batch)}
    feeds.update({w: state[keys[0]].numpy() for w, keys in graphs.meta["torch_keys"].items()})
    feeds["__loss_scale"] = np.array(1.0, np.float32)
    wanted = {i.name for i in session.get_inputs()}
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {k: v for k, v in feeds.items() if k in wanted})))
    grads = dict(double.named_parameters())
    assert graphs.meta["trained"]
    for weight in graphs.meta["trained"]:
        want = grads[graphs.meta["torch_keys"][weight][0]].grad.numpy()
        check(relative_error(got[weight + "_grad"], want), GRADIENT_BOUND, weight)


# ONNX Runtime against eager PyTorch, float32, the same kernels for the CTC and the same arithmetic elsewhere,
# sums added in other orders: steps_bound (the longest sum 16 terms; the CTC's recursions are torch's own code
# on both sides). Observed (2-core Intel Xeon): <= 0.02 of the bound.
TRAIN_BOUND = steps_bound(STEPS, length=64)


def _changing_frames():
    """The training batches: STEPS of them, of 9 and 8 frames in turn."""
    return (_batch(step, frames=9 - step % 2) for step in range(STEPS))


@pytest.mark.parametrize("concatenated", [False, True])
def test_ctc_trains_evaluates_and_saves_as_pytorch(concatenated, tmp_path):
    """Four SGD steps at changing frame counts, eval_step, and the saved model in a stock InferenceSession."""
    torch.manual_seed(5)
    trainer, reference = sgd_steps_as_pytorch(Frames(concatenated), DESC, _changing_frames(), 0.5,
                                              lambda step: TRAIN_BOUND, TORCH)
    batch = _batch(STEPS)
    loss, log_probs = trainer.eval_step(*batch)
    with torch.no_grad():
        want_loss, want_log_probs = reference(*batch)
    check(relative_error(float(loss), float(want_loss)), TRAIN_BOUND, "eval loss")
    check(relative_error(np.asarray(log_probs), want_log_probs.numpy()), TRAIN_BOUND, "eval log_probs")
    path = tmp_path / "ctc.onnx"
    trainer.save_as_onnx(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    saved = session.run(None, {name: t.numpy() for name, t in zip(["x", "targets", "input_lengths",
                                                                     "target_lengths"], batch)})
    # the saved loss: the same recursions in standard operators, rounded in another order (~110 roundings)
    check(relative_error(saved[0], float(want_loss)), 150 * FLOAT32 * 20, "saved loss")


@pytest.mark.cuda
def test_ctc_trains_on_cuda_as_pytorch():
    """torch's CUDA CTC kernels on ONNX Runtime's stream (the lengths and targets copied to the host by them and by
    the target check), against PyTorch on the CPU."""
    torch.manual_seed(5)
    # the CUDA kernels' exp and log round otherwise than the CPU's: the recursions' ~110 roundings a step
    sgd_steps_as_pytorch(Frames(concatenated=True), DESC, _changing_frames(), 0.5,
                         lambda step: TRAIN_BOUND + (step + 1) * 150 * FLOAT32 * 20,
                         {**TORCH, "device": {"id": "cuda"}})


def _standard_session(elem_type: int, rank: int) -> ort.InferenceSession:
    node = helper.make_node("CTCLoss", ["log_probs", "targets", "input_lengths", "target_lengths"], ["loss"],
                            domain=TORCH_OPS_DOMAIN, blank=2)
    graph = helper.make_graph(standard_ctc([node], {"log_probs": elem_type}), "ctc", [
        helper.make_tensor_value_info("log_probs", elem_type, ["frames", "batch", "classes"]),
        helper.make_tensor_value_info("targets", TensorProto.INT64, ["batch", "longest"] if rank == 2 else ["all"]),
        helper.make_tensor_value_info("input_lengths", TensorProto.INT64, ["batch"]),
        helper.make_tensor_value_info("target_lengths", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", elem_type, ["batch"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("rank", [1, 2])
def test_the_standard_operators_compute_torchs_ctc_loss(rank):
    """In float64, against F.ctc_loss: blank 2, an empty target, repeated labels, a sequence that cannot align."""
    torch.manual_seed(7)
    log_probs = torch.randn(12, 4, 5, dtype=torch.float64).log_softmax(-1)
    targets = torch.tensor([[1, 3, 4, 1, 0], [0, 0, 0, 0, 0], [4, 4, 1, 0, 0], [3, 3, 0, 0, 0]])
    input_lengths, target_lengths = torch.tensor([12, 7, 5, 2]), torch.tensor([5, 0, 3, 2])
    fed = torch.cat([targets[i, :n] for i, n in enumerate(target_lengths)]) if rank == 1 else targets
    want = F.ctc_loss(log_probs, fed, input_lengths, target_lengths, blank=2, reduction="none")
    assert torch.isinf(want[3]) and not torch.isinf(want[:3]).any()
    got = _standard_session(TensorProto.DOUBLE, rank).run(None, {
        "log_probs": log_probs.numpy(), "targets": fed.numpy(), "input_lengths": input_lengths.numpy(),
        "target_lengths": target_lengths.numpy()})[0]
    assert np.isinf(got[3])
    # the same recursion in float64, ~110 roundings over 12 frames
    check(relative_error(got[:3], want[:3].numpy()), 150 * FLOAT64 * 20, "float64 losses")


def test_a_target_outside_the_classes_fails_the_step_naming_it():
    model = Frames()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.5), options=TORCH)
    trainer.train_step(*_batch(0))
    x, targets, input_lengths, target_lengths = _batch(1)
    targets[0, 1] = CLASSES + 3
    with pytest.raises(Exception, match=rf"CTCLoss: a target is {CLASSES + 3}, outside the {CLASSES} classes"):
        trainer.train_step(x, targets, input_lengths, target_lengths)


def test_the_onnxruntime_route_names_the_torch_route_for_ctc_loss():
    if not _runtime.has_training_build():
        pytest.skip("the 'onnxruntime' gradient source needs the onnxruntime-training 1.19.2 build")
    trainer = ORTTrainer(Frames(), DESC, SGDConfig(), options={"graph": {"gradient_source": "onnxruntime"}})
    with pytest.raises(ExportError, match=r"aten::ctc_loss.*gradient_source=\"torch\".*F\.ctc_loss"):
        trainer.train_step(*_batch(0))


def _bound_128(steps: int) -> float:
    return steps_bound(steps, length=128)


class _HuggingFaceCTC(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, audio, mask, labels):
        return self.model(input_values=audio, attention_mask=mask, labels=labels).loss


def test_hugging_face_wav2vec2_for_ctc_trains_evaluates_and_saves_as_pytorch(tmp_path, caplog):
    """Its labels padded with -100, taken by masked_select; its check of the labels traced where it passes."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    torch.manual_seed(13)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        vocab_size=12, pad_token_id=0, layerdrop=0.0, mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, ctc_loss_reduction="mean",
        ctc_zero_infinity=True)
    model = _HuggingFaceCTC(transformers.Wav2Vec2ForCTC(config).train())
    desc = {"inputs": [("audio", ["batch", "samples"]), ("mask", ["batch", "samples"]), ("labels", ["batch", "len"])],
            "outputs": [("loss", [], True)]}
    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        audio = torch.randn(2, 1600 + 160 * seed, generator=g)
        mask = torch.ones_like(audio, dtype=torch.long)
        mask[1, -400:] = 0
        labels = torch.randint(1, 12, (2, 6), generator=g)
        labels[1, 4:] = -100
        return audio, mask, labels

    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        # a small rate: a CTC loss of ~60 moves these tiny weights far in one step at larger ones, and differences
        # in the last bits grow with the step (at 0.05 the loss falls from 63 to 9 in one step). The longest sums:
        # the feed-forward's and the positional convolution's 64 terms, the attention's and the CTC's over ~20
        # frames, taken as 128 (test_hf_families.py's); observed <= 0.1 of the bound
        trainer, reference = sgd_steps_as_pytorch(model, desc, (batch(step) for step in range(3)), 1e-3,
                                                  lambda step: _bound_128(step + 1), TORCH)
    assert any("labels.max() >= self.config.vocab_size" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        want = float(reference(*batch(3)))
    check(relative_error(float(trainer.eval_step(*batch(3))), want), _bound_128(4), "eval")
    trainer.save_as_onnx(tmp_path / "wav2vec2.onnx")
    session = ort.InferenceSession(str(tmp_path / "wav2vec2.onnx"), providers=["CPUExecutionProvider"])
    saved = session.run(None, dict(zip(["audio", "mask", "labels"], (t.numpy() for t in batch(3)))))[0]
    # the CTC recursion in standard operators over ~20 frames, rounded in another order than torch's kernel
    check(relative_error(float(saved), want), _bound_128(4) + 150 * FLOAT32 * 20, "saved")

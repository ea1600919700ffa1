"""Index checks derived from the graph (``graph/export/index_rules.py`` and its two front-ends).

A class label, a token id or a position reaches the operator that indexes with it through the
model's own computation (a causal LM pads its labels with the ignore index and shifts them; a
loss masks them with ``where``; positions are an ``arange`` of the sequence length). The checks
evaluate that computation on the batch, so they refuse exactly what PyTorch's kernels refuse.
"""

import copy
import io

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.graph.export import index_rules
from ort_trainer.graph.export.input_checks import BatchChecks, find_input_constraints
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import AdamConfig, SGDConfig

CLASSES, SEQ = 7, 6

# label transformations a model or a loss applies before the cross-entropy, as PyTorch runs them
TRANSFORMS = {
    "as_is": lambda y, m: y,
    "causal_shift": lambda y, m: F.pad(y, (0, 1), value=-100)[..., 1:],
    "left_shift_slice": lambda y, m: y[:, 1:],
    "drop_last": lambda y, m: y[:, :-1],
    "masked_fill_negative": lambda y, m: y.masked_fill(y < 0, -100),
    "where_mask_input": lambda y, m: torch.where(m > 0, y, torch.full_like(y, -100)),
    "transpose": lambda y, m: y.t().contiguous(),
    "offset": lambda y, m: (y + 1) - 1,
    "select_and_stack": lambda y, m: torch.cat([y[:, 0], y[:, -1]]),
    "narrow": lambda y, m: y.narrow(1, 1, 2),
    "flip_by_index": lambda y, m: y.index_select(1, torch.arange(y.shape[1] - 1, -1, -1)),
    "unsqueeze_expand": lambda y, m: y.unsqueeze(1).expand(-1, 2, -1).reshape(-1, y.shape[1]),
}


# their static traces hold a number other than 0 or ±1 that no symbol explains (5 = seq - 1, 2)
SHAPE_SPECIFIC_WHEN_STATIC = {"flip_by_index", "narrow"}


class _Tagger(torch.nn.Module):
    """Per-position scores, with the loss inside: cross-entropy of ``transform(labels, mask)``."""

    def __init__(self, transform):
        super().__init__()
        self.transform = transform
        self.embed = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, CLASSES)

    def targets(self, labels, mask):
        return self.transform(labels, mask)

    def forward(self, ids, mask, labels):
        scores = self.head(self.embed(ids)).mean(1)  # [batch, classes]
        targets = self.targets(labels, mask).reshape(-1)
        repeated = scores.repeat_interleave(targets.numel() // scores.shape[0], 0)[: targets.numel()]
        loss = F.cross_entropy(repeated, targets, ignore_index=-100)
        return loss, scores


DESC = {"inputs": [("ids", ["batch", "seq"]), ("mask", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("scores", ["batch", CLASSES])]}


def _program_rules(model, batch, dynamic):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    from ort_trainer.graph.export.program_checks import find_program_constraints
    from ort_trainer.graph.gradient import autograd

    desc = parse_model_desc(DESC)
    traced = autograd.trace(model, None, desc, [b.numpy() for b in batch], dynamic=dynamic)
    dims = None if dynamic else {"batch": batch[0].shape[0], "seq": batch[0].shape[1]}
    return find_program_constraints(traced.program, desc.input_names, traced._job["weight_of"],
                                    {io.name: list(io.shape) for io in desc.inputs}, dims)


def _batch(gen, batch, seq, valid=False):
    """Token ids, a 0/1 mask and labels: valid classes, or with values on both sides of the range."""
    ids = torch.randint(0, 11, (batch, seq), generator=gen)
    mask = torch.randint(0, 2, (batch, seq), generator=gen)
    labels = torch.randint(0, CLASSES, (batch, seq), generator=gen) if valid else \
        torch.randint(-2, CLASSES + 2, (batch, seq), generator=gen)
    return ids, mask, labels


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_a_rule_computes_the_targets_pytorch_computes_for_a_batch_of_another_shape(name, dynamic):
    model = _Tagger(TRANSFORMS[name])
    gen = torch.Generator().manual_seed(0)
    constraints = _program_rules(model, _batch(gen, 3, SEQ), dynamic)
    [rule] = [r for r in constraints["indices"] if "cross-entropy" in r["what"]]
    assert rule["low"] == 0 and rule["high"] == CLASSES and rule["ignore"] == -100
    # A static trace writes sizes the model computed as numbers (arange(seq - 1, -1, -1) as arange(5, ...)):
    # a rule with a number that may be one holds for the traced shapes only; those of other shapes come from
    # their own traces. Every other rule, and every rule of a symbolic trace, serves every shape.
    generic = "shapes" not in rule
    assert generic == (dynamic or name not in SHAPE_SPECIFIC_WHEN_STATIC)
    for shape in [(3, SEQ), (5, 9), (2, 4)][: 3 if generic else 1]:  # the traced shape and two others
        ids, mask, labels = _batch(gen, *shape)
        feeds = {"ids": ids.numpy(), "mask": mask.numpy(), "labels": labels.numpy()}
        computed = index_rules.evaluate(rule["steps"], feeds, at=rule["index"])
        expected = model.targets(labels, mask).numpy()
        # the check reads the values (the trailing reshapes and expands it skips move or repeat them)
        np.testing.assert_array_equal(np.unique(computed), np.unique(expected))
        # and refuses exactly the batches PyTorch's cross-entropy refuses
        problem = index_rules.violations(rule, feeds)
        bad = expected[(expected != -100) & ((expected < 0) | (expected >= CLASSES))]
        assert (problem is None) == (bad.size == 0), problem
        if bad.size:
            with pytest.raises(IndexError):
                F.cross_entropy(torch.zeros(expected.size, CLASSES), torch.from_numpy(expected).reshape(-1),
                                ignore_index=-100)


def test_the_report_points_at_the_input_element_the_bad_value_came_from():
    model = _Tagger(TRANSFORMS["causal_shift"])
    gen = torch.Generator().manual_seed(0)
    [rule] = [r for r in _program_rules(model, _batch(gen, 2, SEQ, valid=True), dynamic=False)["indices"]
              if "cross-entropy" in r["what"]]
    labels = torch.randint(0, CLASSES, (4, 8), generator=gen)
    labels[2, 5] = -5
    labels[3, 0] = 99  # shifted out of the targets: PyTorch never reads it, so neither does the check
    feeds = {"ids": np.zeros((4, 8), np.int64), "mask": np.ones((4, 8), np.int64), "labels": labels.numpy()}
    problem = index_rules.violations(rule, feeds)
    assert problem.startswith("input 'labels': value -5 at index [2, 5] is out of range for the classes of the "
                              "cross-entropy in <top-level forward>: valid values are 0..6, or -100 (ignore_index) "
                              "(1 invalid value(s) in this batch)")
    labels[2, 5] = 3
    assert index_rules.violations(rule, {**feeds, "labels": labels.numpy()}) is None


def test_a_masked_label_that_pytorch_ignores_trains_and_an_unmasked_one_is_refused():
    model = _Tagger(TRANSFORMS["where_mask_input"])
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1))
    gen = torch.Generator().manual_seed(0)
    ids, mask, labels = _batch(gen, 4, SEQ, valid=True)
    mask[1, 3], labels[1, 3] = 0, -5  # masked out: -100 reaches the loss
    loss = trainer.train_step(ids, mask, labels)[0]
    expected = reference(ids, mask, labels)[0]  # PyTorch takes the batch too
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())  # one float32 forward, ~50 terms
    mask[1, 3] = 1  # now it reaches the loss
    with pytest.raises(ValueError, match=r"input 'labels': value -5 at index \[1, 3\]"):
        trainer.train_step(ids, mask, labels)
    with pytest.raises(IndexError):
        reference(ids, mask, labels)
    assert trainer._train_step_info.step == 1


transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
VOCAB, POSITIONS = 100, 16
HF_DESC = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                      ("labels", ["batch", "seq"])],
           "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _lm_batch(batch=2, seq=POSITIONS):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return ids, torch.ones_like(ids), ids.clone()


def _weights(trainer):
    return {k: v.copy() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


@pytest.mark.parametrize("bad", [-5, VOCAB - 5 + VOCAB, VOCAB])
def test_a_causal_lm_refuses_a_label_its_shifted_loss_would_wrap(bad):
    """GPT2LMHeadModel computes its loss inside: labels padded with -100 and shifted by one. ONNX's
    GatherElements would read -5 as class V-5; PyTorch raises."""
    model = _gpt2()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, HF_DESC, AdamConfig(lr=1e-3))
    ids, mask, labels = _lm_batch()
    trainer.train_step(ids, mask, labels)
    before = _weights(trainer)
    labels[1, 9] = bad
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match=rf"input 'labels': value {bad} at index \[1, 9\] is out of range for the "
                                             r"classes of the cross-entropy .*valid values are 0\.\.99, or -100"):
            step(ids, mask, labels)
    with pytest.raises(IndexError):
        reference(input_ids=ids, attention_mask=mask, labels=labels)
    assert trainer._train_step_info.step == 1
    assert all(np.array_equal(before[k], v) for k, v in _weights(trainer).items())
    labels[1, 9], labels[0, 0] = 3, bad  # the first label is shifted out: PyTorch never reads it
    reference(input_ids=ids, attention_mask=mask, labels=labels)
    trainer.train_step(ids, mask, labels)


def test_a_sequence_longer_than_the_position_table_is_refused_before_any_graph_is_built():
    from ort_trainer import _runtime

    trainer = ORTTrainer(_gpt2(), HF_DESC, AdamConfig(lr=1e-3))
    expected = (r"inputs of these shapes \(input_ids \[2, 20\]\) make the model compute index 16 for the rows of "
                r"'transformer.wpe.weight' \(embedding lookup in transformer.wpe\), whose valid values are 0\.\.15")
    if _runtime.resolve_gradient_source() == "torch":
        with pytest.raises(ValueError, match=expected):
            trainer.train_step(*_lm_batch(seq=20))
    else:  # the TorchScript export runs the model on the batch: PyTorch's own error, said as such
        with pytest.raises(RuntimeError, match=r"raised IndexError \(index out of range in self\) on the first batch"):
            trainer.train_step(*_lm_batch(seq=20))
    assert trainer._graphs is None  # refused before the build
    trainer.train_step(*_lm_batch(seq=POSITIONS))
    assert trainer._shapes.specialised == {(("batch", 2), ("seq", POSITIONS))}
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match=expected):
            step(*_lm_batch(seq=20))
    assert trainer._shapes.specialised == {(("batch", 2), ("seq", POSITIONS))}  # no graph for the new shape
    trainer.train_step(*_lm_batch(seq=12))  # shorter sequences still train


def test_checks_of_shapes_alone_run_once_per_shape():
    checks = BatchChecks({"indices": [
        {"what": "positions", "steps": [{"op": "input", "name": "ids"}, {"op": "size", "x": {"ref": 0}, "dim": 1},
                                        {"op": "arange", "start": 0, "end": {"ref": 1}, "step": 1}],
         "index": 2, "low": 0, "high": 8, "ignore": None}]})
    assert not checks.value_rules and len(checks.shape_rules) == 1
    calls = []
    original = index_rules.violations

    def counted(rule, feeds):
        calls.append(rule["what"])
        return original(rule, feeds)

    index_rules.violations = counted
    try:
        for _ in range(3):
            assert checks.problems({"ids": np.zeros((2, 8), np.int64)}, {}, training=True) == []
        assert len(checks.problems({"ids": np.zeros((2, 9), np.int64)}, {}, training=True)) == 1
    finally:
        index_rules.violations = original
    assert calls == ["positions", "positions"]


def test_a_rule_that_cannot_serve_a_batch_is_skipped_not_fatal(caplog):
    checks = BatchChecks({"indices": [
        {"what": "classes",
         "steps": [{"op": "input", "name": "y"}, {"op": "reshape", "x": {"ref": 0}, "shape": [3, 3]}],
         "index": 1, "low": 0, "high": 4, "ignore": None}]})
    with caplog.at_level("INFO", logger="ort_trainer"):
        assert checks.problems({"y": np.zeros(5, np.int64)}, {}, training=True) == []
    assert "could not check the classes" in caplog.text


def test_an_onnx_graph_with_a_shifted_label_is_checked_where_its_loss_reads_it():
    """The TorchScript exporter's graph of a shifted cross-entropy: Pad, Slice and Reshape before
    SoftmaxCrossEntropyLoss, read by the ONNX front-end."""
    model = _Tagger(TRANSFORMS["causal_shift"])
    batch = _batch(torch.Generator().manual_seed(0), 3, SEQ, valid=True)
    buffer = io.BytesIO()
    torch.onnx.export(model, batch, buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["ids", "mask", "labels"], output_names=["loss", "scores"],
                      dynamic_axes={name: {0: "batch", 1: "seq"} for name in ("ids", "mask", "labels")},
                      opset_version=17)
    constraints = find_input_constraints(onnx.load_from_string(buffer.getvalue()), ["ids", "mask", "labels"])
    checks = BatchChecks(constraints)
    labels = torch.randint(0, CLASSES, (4, 9))
    feeds = {"ids": np.zeros((4, 9), np.int64), "mask": np.ones((4, 9), np.int64), "labels": labels.numpy()}
    assert checks.problems(feeds, {}, training=True) == []
    feeds["labels"][3, 4] = -5
    feeds["labels"][0, 0] = -5  # shifted out
    [problem] = checks.problems(feeds, {}, training=True)
    assert problem.startswith("input 'labels': value -5 at index [3, 4] is out of range for the classes of the "
                              "cross-entropy")
    feeds["ids"][1, 1] = 11
    found = checks.problems(feeds, {}, training=True)
    assert any("input 'ids': value 11 at index [1, 1]" in p for p in found), found


def test_an_mlp_label_check_still_costs_one_comparison():
    """The common rule (labels straight into the loss) is the input itself: no step to evaluate."""
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    [rule] = trainer._graphs.meta["input_constraints"]["indices"]
    assert rule["steps"] == [{"op": "input", "name": "label"}] and rule["high"] == 5

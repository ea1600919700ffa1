"""Model descriptions in both forms, and how outputs map to them."""

import copy

import numpy as np
import pytest
import torch

from models import MLP, mlp_batch
from ort_trainer import IODescription, ModelDescription, ORTTrainer
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig

CE = torch.nn.functional.cross_entropy


def test_dict_form_and_io_description_form_are_equivalent():
    as_dict = parse_model_desc({"inputs": [["x", ["batch", 20]], ("label", ["batch"], torch.int64)],
                                "outputs": [("logits", ["batch", 5]), ("loss", [], True)]})
    as_objects = parse_model_desc(ModelDescription(
        [IODescription("x", ["batch", 20]), IODescription("label", ["batch"], dtype=np.int64)],
        [IODescription("logits", ["batch", 5]), IODescription("loss", [], is_loss=True)],
    ))
    assert as_dict.fingerprint() == as_objects.fingerprint()
    assert as_dict.loss_name == "loss" and as_dict.loss_index == 1
    assert as_dict.inputs[1].numpy_dtype == np.int64


def test_first_output_is_the_loss_when_none_is_marked():
    desc = parse_model_desc({"inputs": [("x", [2])], "outputs": [("a", []), ("b", [2])]})
    assert desc.loss_name == "a"


def test_loss_may_be_listed_after_the_model_outputs():
    desc = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])],
            "outputs": [("logits", ["batch", 5]), ("loss", [], True)]}
    trainer = ORTTrainer(MLP(), desc, SGDConfig(), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    logits, loss = trainer.train_step(x, y)
    assert tuple(logits.shape) == (8, 5) and loss.dim() == 0
    assert loss.item() > 0


def test_fetches_restrict_the_returned_outputs_and_inputs_go_by_name():
    trainer = ORTTrainer(MLP(), {"inputs": [("x", ["batch", 20]), ("label", ["batch"])],
                                 "outputs": [("loss", [], True), ("logits", ["batch", 5])]}, SGDConfig(), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer._train_step_info.fetches = ["logits"]
    logits = trainer.train_step(label=y, x=x)
    assert isinstance(logits, torch.Tensor) and tuple(logits.shape) == (8, 5)
    trainer._train_step_info.fetches = []
    assert len(trainer.eval_step(x.numpy(), label=y.numpy())) == 2


def test_every_problem_of_a_description_is_reported_at_once():
    """A non-string name used to hide the rest: here each entry has its own problem, and two losses."""
    bad = {
        "inputs": [("x", ["batch", 20]), (3, ["batch"]), ("z",), {"name": "w", "shap": [1]}, ("x", [1])],
        "outputs": [("loss", [], True), ("y", [2.5], True), ("x", [2])],
        "extra": 1,
    }
    with pytest.raises(ValueError) as info:
        parse_model_desc(bad)
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid model description:"
    assert [line.strip() for line in lines[1:]] == [
        "model_desc: unknown keys ['extra']; expected 'inputs' and 'outputs'",
        "model_desc.inputs[2]: expected (name, shape[, dtype]), got ('z',)",
        "model_desc.inputs[3]: unknown keys ['shap']; known keys: ['dtype', 'is_loss', 'name', 'num_classes', 'shape']",
        "model_desc.inputs[3]: missing ['shape']; every entry needs 'name' and 'shape'",
        "model_desc.inputs[1].name: expected a non-empty str, got 3",
        "model_desc.inputs[4].name: duplicate name 'x' (also model_desc.inputs[0].name); names must be unique",
        "model_desc.outputs[1].shape[0]: expected an int or a str, got 2.5",
        "model_desc.outputs: exactly one output may have is_loss=True, got ['loss', 'y']; mark the loss only",
        "model_desc: names used for both an input and an output: ['x']; rename one",
    ]


def test_missing_or_malformed_lists_are_reported_together():
    with pytest.raises(ValueError) as info:
        parse_model_desc({"inputs": "x"})
    assert "model_desc.inputs: expected a list, got str" in str(info.value)
    assert "model_desc.outputs: missing; give a list of (name, shape, is_loss)" in str(info.value)
    with pytest.raises(ValueError) as info:
        parse_model_desc(ModelDescription([IODescription("x", [2]), None], [IODescription("x", ["b"], is_loss=1)]))
    message = str(info.value)
    assert "model_desc.inputs[1]: expected an IODescription, got NoneType" in message
    assert "model_desc.outputs[0].is_loss: expected a bool, got 1" in message
    assert "model_desc: names used for both an input and an output: ['x']" in message


def test_outputs_not_fetched_are_dropped_from_the_graphs_and_change_nothing_else():
    """Fetching only the loss (a classifier: sparse_labels does not apply) runs graphs without the
    logits output, so ONNX Runtime need not give them a buffer of their own; losses and weights
    stay bitwise those of the graph with every output."""
    desc = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
    model = MLP()
    trainers = [ORTTrainer(m, desc, SGDConfig(lr=0.1), loss_fn=CE) for m in (model, copy.deepcopy(model))]
    trainers[1]._train_step_info.fetches = ["loss"]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = mlp_batch(gen)
        loss_all, _ = trainers[0].train_step(x, y)
        loss_only = trainers[1].train_step(x, y)
        assert loss_all.item() == loss_only.item()
    for key, value in trainers[0].state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(value, trainers[1].state_dict()["model"]["full_precision"][key])
    sessions = trainers[1]._engine._current
    assert [o.name for o in sessions.training.gradient.get_outputs()][:1] == ["loss"]
    assert "logits" not in {o.name for o in sessions.training.gradient.get_outputs()}
    assert sessions.training.output_names == ["loss"]
    assert trainers[1].eval_step(x, y).dim() == 0  # the eval graph of this fetch set returns the loss only

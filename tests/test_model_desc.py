"""Model descriptions in both forms, and how outputs map to them."""

import numpy as np
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

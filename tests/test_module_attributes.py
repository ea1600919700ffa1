"""A Python attribute or a mode of the model changed after its graphs were traced is refused before the step,
naming it: the graphs hold the values the trace read, where PyTorch reads them anew every forward."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, ORTTrainerOptions
from ort_trainer.optim import SGDConfig
from tolerances import check, steps_bound

DESC = {"inputs": [("x", ["batch", "seq", 8]), ("y", ["batch"])],
        "outputs": [("loss", [], True), ("out", ["batch", 3])]}


class Tempered(torch.nn.Module):
    """Logits divided by a temperature held as a Python float, and one held as a buffer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.temperature = 1.0
        self.register_buffer("scale", torch.tensor(1.0))
        self.longest = 0  # set by the forward itself, as a rotary embedding caches the longest length it saw

    def forward(self, x):
        self.longest = max(self.longest, x.shape[1])
        return self.norm(self.linear(x.mean(1))) / self.temperature / self.scale


def _batch(seed: int, seq: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, seq, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)


def test_a_changed_python_attribute_is_refused_before_the_step_naming_it():
    torch.manual_seed(0)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(*_batch(0))
    before = {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}
    model.temperature = 2.0
    with pytest.raises(RuntimeError, match=r"attribute 'temperature' of module <top-level> \(Tempered\): 1.0 -> 2.0.*"
                                           r"register_buffer"):
        trainer.train_step(*_batch(1))
    with pytest.raises(RuntimeError, match="temperature"):
        trainer.eval_step(*_batch(1))
    assert trainer._train_step_info.step == 1  # nothing ran
    for key, value in trainer.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    model.temperature = 1.0  # as traced again: the steps go on
    trainer.train_step(*_batch(1))


def _trains_as_pytorch(change, steps: int, options: dict | None = None) -> None:
    """``steps`` SGD steps of ``Tempered`` against PyTorch's, ``change(step, module, trainer)`` applied to both
    models before each."""
    torch.manual_seed(0)
    model = Tempered()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        for module in (model, reference):
            change(step, module, trainer if module is model else None)
        x, y = _batch(step)
        loss = trainer.train_step(x, y)[0].item()
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        optimizer.step()
        # the same float32 arithmetic, each sum (the mean over 4 positions, the product's 8 terms, BatchNorm's 6
        # rows) added in its own order: <= 16·u per step, carried through the weights (Higham)
        check(abs(loss - expected.item()) / abs(expected.item()), steps_bound(steps, length=16), f"step {step}")


def test_a_buffer_changed_in_place_trains_as_pytorch():
    """The fix the message gives: a value that changes during training as a buffer, changed in place."""
    _trains_as_pytorch(lambda step, module, _: module.scale.fill_(4.0) if step == 1 else None, steps=3)


def test_a_mode_changed_after_the_build_is_refused_unless_the_trace_is_the_same():
    torch.manual_seed(0)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(*_batch(0))
    model.eval()  # a whole model in eval mode is traced after model.train(): the same graphs
    trainer.train_step(*_batch(1))
    model.train()  # back, as after a validation pass in PyTorch
    trainer.train_step(*_batch(2))
    model.norm.eval()  # freezing the BatchNorm now would need another trace
    with pytest.raises(RuntimeError, match="module norm would train in eval mode, where it was traced in training"):
        trainer.train_step(*_batch(3))


def test_attributes_the_forward_sets_while_traced_for_a_new_shape_are_no_change():
    torch.manual_seed(0)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(*_batch(0, seq=4))
    trainer.train_step(*_batch(1, seq=9))  # a new shape: traced again, the forward sets model.longest = 9
    trainer.train_step(*_batch(2, seq=4))
    trainer.eval_step(*_batch(3, seq=9))


def test_a_buffer_replaced_or_changed_after_the_build_is_copied_to_the_engine():
    """A buffer the script replaces (no longer the engine's tensor, as on a GPU, where the module's buffers stay on
    the host and the engine holds copies), then changes in place, then after ``update_torch_model``: each step
    reads the value the script set, as PyTorch's forward does."""
    def change(step, module, trainer):
        if step == 1:
            module.scale = torch.tensor(5.0)
        elif step == 2:
            module.scale.fill_(2.0)
        elif step == 3 and trainer is not None:
            trainer.update_torch_model()

    _trains_as_pytorch(change, steps=4)


def test_a_state_loaded_after_a_buffer_change_wins_over_it():
    torch.manual_seed(0)
    model = Tempered()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    trainer.train_step(*_batch(0))
    saved = trainer.state_dict()
    model.scale = torch.tensor(5.0)
    trainer.load_state_dict(saved)  # later than the change: its scale, 1.0, is what the steps read
    trainer.train_step(*_batch(1))
    assert float(trainer.state_dict(pytorch_format=True)["scale"]) == 1.0
    model.scale.fill_(3.0)  # a change after the load is copied
    trainer.train_step(*_batch(2))
    assert float(trainer.state_dict(pytorch_format=True)["scale"]) == 3.0


# the ONNX optimizer graph double-buffers the weights: the module keeps tensors of its own, as on a GPU
UNSHARED = ORTTrainerOptions({"graph": {"optimizer": "graph"}})


def _clip(step, module, trainer, synced=True):
    """WGAN's weight clipping of the linear layer, after the trainer's weights were copied to the module."""
    if step and trainer is not None and synced:
        trainer.update_torch_model()
    with torch.no_grad():
        module.linear.weight.clamp_(-0.2, 0.2)


@pytest.mark.parametrize("options", [None, UNSHARED], ids=["shared", "unshared"])
def test_a_parameter_changed_in_place_trains_as_pytorch(options):
    _trains_as_pytorch(_clip, steps=4, options=options)


def test_a_parameter_changed_where_the_module_holds_stale_values_is_refused():
    with pytest.raises(RuntimeError, match=r"'linear.weight' was changed after steps had changed it.*"
                                           r"update_torch_model\(\) first"):
        _trains_as_pytorch(lambda step, module, trainer: _clip(step, module, trainer, synced=False), steps=3,
                           options=UNSHARED)


def test_statistics_the_trace_of_a_new_shape_changes_and_puts_back_are_no_change_of_the_script():
    """A batch of a new size (an epoch's last) is traced: its forward updates the BatchNorm statistics in place and
    the trace puts them back, which bumps their versions. With the module's own tensors (as on a GPU), that was
    taken for the script changing trained statistics after steps, and refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True), ("out", ["batch", 3])]}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=UNSHARED)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, size in enumerate([8, 8, 5, 8]):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,), generator=gen)
        trainer.train_step(x, y)
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    got = trainer.state_dict(pytorch_format=True)
    # 4 SGD steps of float32 sums of at most 8 terms (the batch statistics, the products), each side in its own
    # order, carried through the weights (all of magnitude <= 1.5 here): steps_bound(4, length=8) = 1.9e-6.
    # Observed (2-core Intel Xeon): <= 6e-8, 32x under.
    for key, value in reference.state_dict().items():
        check(float((got[key].double() - value.double()).abs().max()), steps_bound(4, length=8), key)


def test_requires_grad_changed_after_the_build_is_refused_and_a_new_trainer_trains_the_new_set():
    """Unfreezing a backbone after some steps (or freezing a layer) was ignored: the graphs kept training the weights
    they were built for. It is refused before the step; the fix the message names trains as PyTorch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True), ("out", ["batch", 3])]}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        if step == 2:
            model[0].requires_grad_(True)
            with pytest.raises(RuntimeError, match=r"requires_grad of the model's weights changed after the graphs "
                                                   r"were built: '0.weight' False -> True, '0.bias' False -> True"):
                trainer.train_step(x, y)
            trainer.update_torch_model()
            trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
            reference[0].requires_grad_(True)
            optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        loss = trainer.train_step(x, y)[0].item()
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        optimizer.step()
        # sums of <= 8 terms a step, each side in its own order, through the weights (Higham): steps_bound(4, 8)
        check(abs(loss - expected.item()) / expected.item(), steps_bound(4, length=8), f"step {step}")
    model[2].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'2.weight' True -> False"):
        trainer.train_step(x, y)

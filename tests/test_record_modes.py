"""Autograd state in the operator record: what changes the traced training graph without changing
the operators that run (grad mode, inference mode, ``detach``, requires_grad) must change the
record key, or a cache hit by record trains the wrong graph (issue 23: a layer frozen by
``torch.set_grad_enabled(not self.freeze)`` was trained from a graph cached with ``freeze=False``)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import MLP, MLP_DESC, clone, mlp_batch, torch_step
from ort_trainer import ORTTrainer
from ort_trainer.graph.export import op_record
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig
from tolerances import steps_bound

LR = 0.5
STEPS = 3


class _Freezable(MLP):
    """The issue's model: ``fc1`` runs under ``set_grad_enabled(not freeze)``."""

    def __init__(self, freeze: bool = False, region=None):
        super().__init__()
        self.freeze = freeze
        self.region = region or (lambda: torch.set_grad_enabled(not self.freeze))

    def forward(self, x):
        with self.region():
            h = torch.relu(self.fc1(x))
        return self.fc2(h)


class _NoGrad(MLP):
    def __init__(self, enabled: bool):
        super().__init__()
        self.enabled = enabled

    def forward(self, x):
        with torch.no_grad() if self.enabled else torch.enable_grad():
            h = torch.relu(self.fc1(x))
        return self.fc2(h)


class _InferenceMode(_NoGrad):
    def forward(self, x):
        with torch.inference_mode(self.enabled):
            h = torch.relu(self.fc1(x))
        return self.fc2(h.clone())


class _Detached(_NoGrad):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h.detach() if self.enabled else h)


class _ForwardRequiresGrad(_NoGrad):
    """requires_grad of an input switched on inside the forward: what the backward reaches changes."""

    def forward(self, x):
        if self.enabled:
            x = x.clone().requires_grad_(True)
        return self.fc2(torch.relu(self.fc1(x)))


def _key(model):
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    record = op_record.record(model, F.cross_entropy, parse_model_desc(MLP_DESC), [x.numpy(), y.numpy()],
                              op_record.exporting_flags)
    return None if record is None else record.key


def _seeded(factory, *args):
    torch.manual_seed(0)
    return factory(*args)


PAIRS = {
    "set_grad_enabled(False) region": (lambda: _Freezable(False), lambda: _Freezable(True)),
    "no_grad region": (lambda: _NoGrad(False), lambda: _NoGrad(True)),
    "inference_mode region": (lambda: _InferenceMode(False), lambda: _InferenceMode(True)),
    "detach": (lambda: _Detached(False), lambda: _Detached(True)),
    "requires_grad set in the forward": (lambda: _ForwardRequiresGrad(False), lambda: _ForwardRequiresGrad(True)),
}


@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
def test_autograd_state_inside_the_forward_changes_the_key(pair):
    first, second = (_key(_seeded(factory)) for factory in pair)
    assert first is not None and second is not None
    assert first != second
    assert _key(_seeded(pair[0])) == first  # and the key is still a key: the same model, the same key


def test_grad_mode_outside_the_trainer_does_not_change_the_key():
    """The record runs under ``enable_grad`` whatever the caller's mode, as the trace does."""
    key = _key(_seeded(MLP))
    with torch.no_grad():
        assert _key(_seeded(MLP)) == key


# ---- the pipeline: a cache hit by record must train what eager trains --------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))


def _train(model):
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=LR), loss_fn=F.cross_entropy,
                         options={"graph": {"gradient_source": "torch"}})
    gen = torch.Generator().manual_seed(0)
    losses = [float(trainer.train_step(*mlp_batch(gen))[0]) for _ in range(STEPS)]
    return losses, trainer.state_dict(pytorch_format=True), trainer._graphs.from_cache


def _eager(model):
    reference = clone(model)
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    gen = torch.Generator().manual_seed(0)
    losses = [torch_step(reference, optimizer, F.cross_entropy, (x,), y, None)
              for x, y in (mlp_batch(gen) for _ in range(STEPS))]
    return losses, reference.state_dict()


# Both sides compute a 20-32-5 MLP in float32 for 3 SGD steps: each may add a dot product (≤ 32
# terms, fc2) in another order, 32u of its magnitude per step (Higham's bound), carried through the
# weights once per step: steps_bound(STEPS, length=32) = 5.7e-6 relative; weights near 0 carry the
# error of their tensor's largest entry. Observed at 1 and 2 threads: ≤ 0.023 of the bound, 43x
# under. A frozen layer trained by mistake moves by lr·|g| ~ 1e-2 (the 0.08), far outside it.
_BOUND = steps_bound(STEPS, length=32)


@pytest.mark.parametrize("order", [(False, True), (True, False)], ids=["unfrozen first", "frozen first"])
def test_a_cached_graph_never_trains_the_wrong_grad_mode(order, cache):
    for freeze in order:
        model = _seeded(_Freezable, freeze)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        expected_losses, expected_weights = _eager(model)
        losses, weights, _ = _train(model)
        np.testing.assert_allclose(losses, expected_losses, rtol=_BOUND)
        for name, value in expected_weights.items():
            np.testing.assert_allclose(weights[name], value, rtol=_BOUND, atol=_BOUND * float(value.abs().max()),
                                       err_msg=name)
        for name in ("fc1.weight", "fc1.bias"):
            frozen = torch.equal(weights[name], initial[name])
            assert frozen == freeze, f"{name}: freeze={freeze}, but the weight {'did not move' if frozen else 'moved'}"


def test_the_same_grad_mode_is_still_a_hit_by_record(cache, monkeypatch):
    _train(_seeded(_Freezable, True))
    _train(_seeded(_Freezable, True))  # a hit by trace links the record
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: pytest.fail("traced although cached by record"))
    losses, _, from_cache = _train(_seeded(_Freezable, True))
    assert from_cache is True
    np.testing.assert_allclose(losses, _eager(_seeded(_Freezable, True))[0], rtol=_BOUND)


def test_module_training_flags_left_by_the_user_train_as_the_cache_key_says(cache):
    """The training graph is traced with every module in training mode (and the eval graph in
    eval mode) whatever flags the user left on the modules, so they are not part of what is traced
    and a hit between two such models is right: both train as eager does with ``model.train()``."""
    class _WithDropout(MLP):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.fc1(x))))

    plain = _seeded(_WithDropout)
    flagged = _seeded(_WithDropout)
    flagged.fc1.eval()
    flagged.drop.eval()
    assert _key(plain) == _key(flagged)
    first, _, _ = _train(plain)
    second, _, from_cache = _train(flagged)
    assert from_cache is True and second == first
    np.testing.assert_allclose(second, _eager(_seeded(_WithDropout))[0], rtol=_BOUND)

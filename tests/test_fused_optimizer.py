"""The fused in-place optimizer update (``graph.optimizer="fused"``, ort_trainer/update.py) against the
ONNX optimizer graph and against torch.optim, its non-finite guarantees, and the memory it saves."""

import logging
import re

import numpy as np
import pytest
import torch

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch, torch_step
from ort_trainer import ORTTrainer
from tolerances import FLOAT32, check
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig
from ort_trainer.update import FusedUpdate, GraphUpdate

CE = torch.nn.functional.cross_entropy
STEPS = 30
# The two updates compute api.md's formula with the same float32 operations in another order (the
# gradient norm summed by torch.dot vs ONNX Runtime's ReduceSum, g·s vs g/(1/s), torch's lerp for
# the first moment): about 10 rounded operations per weight and step, each off by at most u, and
# the difference of one step carried into the next at most once. So after STEPS steps weights and
# moments differ by at most u · 10 · STEPS = 1.8e-5 of their largest magnitude. Observed on a 2-core
# AMD EPYC at 1 and 2 threads: 4u after the first step, at most 1.1e-6 (18u) after 30, not growing
# with the steps (16x under the bound). test_optimizers.py checks both against float64 references.
TRAJECTORY_BOUND = FLOAT32 * 10 * STEPS
# Both updates against torch.optim step for step (12 MLP steps, no clipping): ONNX Runtime's forward
# and backward against torch's, each step's sums (≤ 64 terms) in another order, carried through the
# weights: the loss of step k and the weights after it are at most steps_bound(12) = 4.6e-5 apart.
# The test holds the tighter 1e-5, below that worst case (which has every rounding add the same
# way). A weight near zero carries the rounding of the sums that update it, whose size is that of
# the tensor's weights, not its own: an absolute floor of TORCH_RTOL · 0.1, below TORCH_RTOL times
# the MLP's weight scale (initialised within 1/√20 = 0.22 and 1/√32 = 0.18).
# Observed at 1 and 2 threads: losses 1.5e-7 (66x under), weights 0.024 of the bound (42x under).
TORCH_RTOL = 1e-5
TORCH_ATOL = TORCH_RTOL * 0.1
SETUPS = {"mlp": (MLP, MLP_DESC, CE, mlp_batch), "transformer": (TinyEncoder, ENCODER_DESC, mlm_loss, mlm_batch)}


def _trainer(setup, model, config, implementation, **options):
    _, desc, loss_fn, _ = SETUPS[setup]
    options = {**options, "graph": {"optimizer": implementation}}
    return ORTTrainer(clone(model), desc, config, loss_fn=loss_fn, options=options)


def _batches(setup, seed, n=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [SETUPS[setup][3](gen) for _ in range(n)]


def _state(trainer):
    """Weights and optimizer moments, by name."""
    state = trainer.state_dict()
    out = {f"w/{k}": v for k, v in state["model"]["full_precision"].items()}
    out.update({f"{s}/{k}": v for k, states in state["optimizer"].items() for s, v in states.items()
                if s.startswith("Moment")})
    return out


def _assert_relative(got, expected, bound=TRAJECTORY_BOUND, moment_bound=None) -> dict[str, float]:
    """max |Δ| of every tensor within ``bound`` (optimizer moments: ``moment_bound``, default
    ``bound``) of that tensor's largest magnitude; returns the worst ratio of weights ("w") and of
    moments ("Moment")."""
    assert got.keys() == expected.keys()
    worst = {"w": 0.0, "Moment": 0.0}
    for name in expected:
        a, b = np.asarray(got[name], np.float64), np.asarray(expected[name], np.float64)
        scale = max(float(np.abs(b).max()), 1e-30)
        error = float(np.abs(a - b).max()) / scale
        kind = "w" if name.startswith("w/") else "Moment"
        limit = bound if kind == "w" or moment_bound is None else moment_bound
        check(error, limit, f"{name}: max |Δ| over max |value|")
        worst[kind] = max(worst[kind], error)
    return worst


# ---- fused against the graph: 30 steps, per optimizer and mode the fused path handles ---------------
CASES = {  # setup, config, options (a function: a loss scaler is stateful, one per trainer)
    "sgd": ("mlp", SGDConfig(lr=0.05), dict),
    "adam": ("mlp", AdamConfig(lr=2e-3), lambda: {"utils": {"grad_norm_clip": False}}),
    "adamw_clipped": ("mlp", AdamConfig(lr=1e-2, lambda_coef=0.01, max_norm_clip=0.5), dict),
    "groups": ("mlp", AdamConfig(lr=1e-2, lambda_coef=0.1, params=[
        {"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}, {"params": ["fc2.weight"], "lr": 3e-2}]), dict),
    "sgd_groups": ("mlp", SGDConfig(lr=0.05, params=[{"params": ["fc2.weight", "fc2.bias"], "lr": 0.2}]), dict),
    "accumulation": ("mlp", AdamConfig(lr=1e-2, lambda_coef=0.01),
                     lambda: {"batch": {"gradient_accumulation_steps": 3}}),
    "sgd_accumulation": ("mlp", SGDConfig(lr=0.05), lambda: {"batch": {"gradient_accumulation_steps": 3}}),
    "sgd_momentum": ("mlp", SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3), dict),
    "sgd_momentum_groups": ("mlp", SGDConfig(lr=0.05, momentum=0.9, dampening=0.2, params=[
        {"params": ["fc1.weight"], "momentum": 0.5, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01},
        {"params": ["fc2.bias"], "momentum": 0.0, "weight_decay": 0.1}, {"params": ["fc2.weight"], "momentum": 0.0}]),
                            dict),
    "sgd_momentum_accumulation": ("mlp", SGDConfig(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
                                  lambda: {"batch": {"gradient_accumulation_steps": 3}}),
    "loss_scaler": ("mlp", AdamConfig(lr=1e-2),
                    lambda: {"mixed_precision": {"loss_scaler": DynamicLossScaler(loss_scale=2.0 ** 12)}}),
    "transformer": ("transformer", AdamConfig(lr=2e-3, lambda_coef=0.05), dict),
}


@pytest.mark.parametrize("case", CASES)
def test_the_fused_update_equals_the_graph_update_after_30_steps(case):
    setup, config, options = CASES[case]
    model = SETUPS[setup][0]()
    fused = _trainer(setup, model, config, "fused", **options())
    graph = _trainer(setup, model, config, "graph", **options())
    for x, y in _batches(setup, 40):
        fused.train_step(x, y)
        graph.train_step(x, y)
    assert isinstance(fused._engine.update, FusedUpdate) and isinstance(graph._engine.update, GraphUpdate)
    assert fused._train_step_info.optimization_step == graph._train_step_info.optimization_step > 0
    _assert_relative(_state(fused), _state(graph))
    assert fused._engine.update.exact_updates == 0  # the bound never needed the exact path here


@pytest.mark.parametrize("config, why", [
    (LambConfig(lr=1e-3), "Lamb's trust ratio"),
    (AdamConfig(weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE, lambda_coef=0.01), "AFTER_WEIGHT_UPDATE"),
    (AdamConfig(do_bias_correction=False), "do_bias_correction=False"),
    (AdamConfig(params=[{"params": ["fc2.bias"], "weight_decay_mode": DecayMode.AFTER_WEIGHT_UPDATE}]),
     r"AFTER_WEIGHT_UPDATE \(params\[0\]\)"),
])
def test_modes_without_a_fused_kernel_run_the_graph_and_say_why(config, why, caplog):
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"):
        trainer = _trainer("mlp", MLP(), config, "fused")
        x, y = mlp_batch(torch.Generator().manual_seed(0))
        trainer.train_step(x, y)
    assert isinstance(trainer._engine.update, GraphUpdate)
    assert trainer._engine.weights_flat[0] is not trainer._engine.weights_flat[1]
    assert any("optimizer update: the ONNX optimizer graph, because" in r.getMessage() for r in caplog.records)
    assert re.search(why, caplog.text)


def test_the_graph_option_forces_the_graph_and_fused_is_the_default(caplog):
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"):
        default = ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=CE)
        default.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert isinstance(default._engine.update, FusedUpdate)
    assert "torch's fused SGD (add_) kernel in place" in caplog.text
    forced = _trainer("mlp", MLP(), SGDConfig(), "graph")
    forced.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert isinstance(forced._engine.update, GraphUpdate)
    with pytest.raises(ValueError, match=r"graph\.optimizer: must be one of \['fused', 'graph'\], got 'onnx'"):
        ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=CE, options={"graph": {"optimizer": "onnx"}})


# ---- fused against torch.optim, step for step ----------------------------------------------------------
@pytest.mark.parametrize("implementation", ["fused", "graph"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_both_updates_follow_torch_optim_step_for_step(optimizer, implementation):
    model = MLP()
    reference = clone(model)
    if optimizer == "sgd":
        config, torch_optimizer = SGDConfig(lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    else:
        config = AdamConfig(lr=1e-2, lambda_coef=0.05, params=[{"params": ["fc2.bias"], "lambda_coef": 0.0}])
        torch_optimizer = torch.optim.AdamW([
            {"params": [reference.fc1.weight, reference.fc1.bias, reference.fc2.weight]},
            {"params": [reference.fc2.bias], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.05)
    trainer = _trainer("mlp", model, config, implementation, utils={"grad_norm_clip": False})
    for x, y in _batches("mlp", 41, n=12):
        loss = trainer.train_step(x, y)[0].item()
        assert loss == pytest.approx(torch_step(reference, torch_optimizer, CE, (x,), y, clip=None), rel=TORCH_RTOL)
        got = trainer.state_dict(pytorch_format=True)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=TORCH_RTOL, atol=TORCH_ATOL)
    assert trainer._engine.update.name == implementation


# ---- non-finite steps change nothing -----------------------------------------------------------------
def _everything(trainer):
    info = trainer._train_step_info
    return {**_state(trainer), "counters": np.array([info.step, info.optimization_step])}


def _bitwise_same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


@pytest.mark.parametrize("config", [SGDConfig(lr=0.1), SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.01),
                                    AdamConfig(lr=1e-2, lambda_coef=0.01)])
def test_a_non_finite_gradient_changes_nothing_and_training_goes_on_like_the_graph(config):
    model = MLP()
    fused, graph = (_trainer("mlp", model, config, kind) for kind in ("fused", "graph"))
    batches = _batches("mlp", 42, n=6)
    for x, y in batches[:3]:
        fused.train_step(x, y)
        graph.train_step(x, y)
    before = _everything(fused)
    x_nan = batches[3][0].clone()
    x_nan[0, 0] = float("nan")
    fused.train_step(x_nan, batches[3][1])
    graph.train_step(x_nan, batches[3][1])
    assert fused._train_step_info.all_finite is False and graph._train_step_info.all_finite is False
    after = _everything(fused)
    before["counters"][0] += 1  # step counts the call; optimization_step does not move
    assert _bitwise_same(before, after)
    for x, y in batches[4:]:
        fused.train_step(x, y)
        graph.train_step(x, y)
    _assert_relative(_state(fused), _state(graph))


class _Scaled(torch.nn.Module):
    """A linear model whose gradient is 1000 for every one of its ``size`` weights."""

    def __init__(self, size):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return (self.w * x).sum() * 1000.0


def test_gradients_whose_squares_overflow_float32_are_not_finite_on_both_paths():
    """The graph sums squares in float32: with a loss scale of 1e16 every gradient is 1e19, finite,
    but the sum of their squares (4e38) is not; the fused path skips the step as the graph does."""
    for kind in ("fused", "graph"):
        scaler = DynamicLossScaler(loss_scale=1e16)
        desc = {"inputs": [("x", [4])], "outputs": [("loss", [], True)]}
        trainer = ORTTrainer(_Scaled(4), desc, SGDConfig(lr=1e-3),
                             options={"graph": {"optimizer": kind}, "mixed_precision": {"loss_scaler": scaler}})
        trainer.train_step(np.ones(4, np.float32))
        info = trainer._train_step_info
        assert (info.all_finite, info.optimization_step, scaler.loss_scale) == (False, 0, 5e15), kind
        np.testing.assert_array_equal(trainer._engine.grads["w"].numpy(),
                                      np.full(4, 1e19, np.float32))


def _scaled_trainer(size, config, kind):
    desc = {"inputs": [("x", [size])], "outputs": [("loss", [], True)]}
    return ORTTrainer(_Scaled(size), desc, config, options={"graph": {"optimizer": kind}})


@pytest.mark.parametrize("config", [SGDConfig(lr=1e37), SGDConfig(lr=1e37, momentum=0.9, nesterov=True),
                                    AdamConfig(lr=1e38, max_norm_clip=1e30)])
def test_an_update_that_would_overflow_takes_the_exact_path_and_changes_nothing(config, caplog):
    trainer = _scaled_trainer(4, config, "fused")
    trainer.eval_step(np.ones(4, np.float32))  # builds the engine: its optimizer state is in the "before"
    before = _everything(trainer)
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"):
        trainer.train_step(np.ones(4, np.float32))
    info, update = trainer._train_step_info, trainer._engine.update
    assert update.exact_updates == 1 and "computed on copies: not finite, dropped" in caplog.text
    assert info.all_finite is False and info.optimization_step == 0
    before["counters"][0] += 1
    assert _bitwise_same(before, _everything(trainer))
    graph = _scaled_trainer(4, config, "graph")  # the graph refuses it too
    graph.train_step(np.ones(4, np.float32))
    assert graph._train_step_info.all_finite is False
    trainer.optim_config.lr = 1e-3
    trainer.train_step(np.ones(4, np.float32))
    assert info.all_finite is True and update.exact_updates == 1  # a small update: the fast path again


def test_the_exact_path_runs_only_when_the_bound_says_so_and_keeps_a_finite_update():
    """1000 weights with gradient 1000 each: the bound (lr·‖g‖₂ per weight, times 1000 weights) passes
    float32's range / 4 at lr 1e31, while the update itself (-1e34 per weight, sum -1e37) is finite."""
    size = 1000
    fused, graph = (_scaled_trainer(size, SGDConfig(lr=1e31), kind) for kind in ("fused", "graph"))
    ones = np.ones(size, np.float32)
    for trainer in (fused, graph):
        trainer.train_step(ones)
    update = fused._engine.update
    assert update.exact_updates == 1 and fused._train_step_info.optimization_step == 1
    np.testing.assert_allclose(_state(fused)["w/w"], np.full(size, -1e34), rtol=1e-6)
    assert _bitwise_same(_state(fused), _state(graph))
    for trainer in (fused, graph):
        trainer.optim_config.lr = 1e-3
        trainer.train_step(ones)
    assert update.exact_updates == 1  # the bound measured again after the exact step: fast once more
    assert _bitwise_same(_state(fused), _state(graph))


@pytest.mark.parametrize("config", [AdamConfig(lr=1e-2, lambda_coef=0.01, max_norm_clip=0.5),
                                    SGDConfig(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)])
def test_the_exact_path_computes_what_the_fast_path_computes(config):
    """Forcing the exact path (copies, then copied back) on every step gives bitwise the fast path's result."""
    model = MLP()
    fast, exact = (_trainer("mlp", model, config, "fused") for _ in range(2))
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    exact.train_step(x, y)  # builds the engine
    fast.train_step(x, y)
    exact._engine.update._bounds_after = lambda *args: None
    for x, y in _batches("mlp", 43, n=5):
        fast.train_step(x, y)
        exact.train_step(x, y)
    assert exact._engine.update.exact_updates == 5 and fast._engine.update.exact_updates == 0
    assert _bitwise_same(_state(fast), _state(exact))


@pytest.mark.parametrize("config", [SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.5, params=[
    {"params": ["fc1.weight"], "nesterov": True}, {"params": ["fc2.bias"], "momentum": 0.5, "dampening": 1.5},
    {"params": ["fc2.weight"], "momentum": 0.0}]), AdamConfig(lr=0.5, lambda_coef=0.5)])
def test_the_carried_bounds_hold_the_largest_weight_and_moment_step_after_step(config):
    """``_bounds_after``'s bounds on max|w| and max|m| (Adam's first moment, SGD's momentum buffer) are at least
    the measured ones after every step, with large rates, Nesterov momentum, a dampening past 1 and weight decay."""
    trainer = _trainer("mlp", MLP(), config, "fused")
    for x, y in _batches("mlp", 44, n=8):
        trainer.train_step(x * 10, y)
        update = trainer._engine.update
        assert update._bounds is not None and update.exact_updates == 0
        w_max, m_max = FusedUpdate._measure(update)
        assert update._bounds[0] >= w_max and update._bounds[1] >= m_max and m_max > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_the_measured_bounds_are_the_largest_magnitudes_exactly_and_nan_from_any_segment(threads):
    """``_measure``'s one-pass ends against ``vector_norm(·, inf)`` (the exact max|x|: no rounding
    either way), over segments of other sizes, signs and an empty one; a NaN or inf in any segment,
    first or last, makes the bound non-finite (the step then goes the exact way)."""
    from types import SimpleNamespace

    from ort_trainer.devices import torch_threads
    from ort_trainer.update import _Segment

    generator = torch.Generator().manual_seed(7)
    sizes = (1, 0, 100_003, 4097)

    def segments(scale: float) -> list:
        return [_Segment(0, torch.randn(n, generator=generator) * scale * (i + 1) - (i == 3) * 50.0,
                         torch.empty(n), [torch.randn(n, generator=generator) * scale, torch.empty(n)])
                for i, n in enumerate(sizes)]

    with torch_threads(threads):
        for scale in (1e-3, 1.0, 3e30):
            segs = segments(scale)
            fake = SimpleNamespace(_segments=segs, _sgd=False)
            w_max, m_max = FusedUpdate._measure(fake)
            reference = [max(float(torch.linalg.vector_norm(s.weights if k == 0 else s.states[0],
                                                            float("inf"))) for s in segs if s.weights.numel())
                         for k in (0, 1)]
            assert (w_max, m_max) == tuple(reference)
            stateless = [_Segment(s.group, s.weights, s.grads, []) for s in segs]  # SGD without momentum
            assert FusedUpdate._measure(SimpleNamespace(_segments=stateless, _sgd=True)) == (w_max, 0.0)
        for position in (0, 2, 3):
            for bad in (float("nan"), float("inf"), -float("inf")):
                segs = segments(1.0)
                segs[position].weights[-1] = bad
                w_max, _ = FusedUpdate._measure(SimpleNamespace(_segments=segs, _sgd=False))
                assert not np.isfinite(w_max) and (np.isnan(w_max) or w_max == float("inf")), (position, bad)
                if np.isnan(bad):
                    assert np.isnan(w_max)
    assert FusedUpdate._measure(SimpleNamespace(_segments=[], _sgd=False)) == (0.0, 0.0)


def test_carried_bounds_that_grew_too_large_are_measured_again_before_the_exact_path():
    """The carried bounds only grow (a long run multiplies them by the rounding slack every step):
    when they no longer rule an overflow out, the weights are measured again, and the step stays
    on the fast path while the real values are small."""
    model, config = MLP(), AdamConfig(lr=1e-3)
    trainer = _trainer("mlp", model, config, "fused")
    batches = _batches("mlp", 45, n=3)
    trainer.train_step(*batches[0])
    update = trainer._engine.update
    update._bounds = (1e37, 1e37)  # as if carried through an enormous number of steps
    trainer.train_step(*batches[1])
    assert update.exact_updates == 0 and update._bounds[0] < 1e7  # measured: about 4e5
    trainer.train_step(*batches[2])
    assert update.exact_updates == 0


def test_loaded_weights_reset_the_bound():
    """After a state with huge weights is loaded, the bound is measured again: the next update takes
    the exact path instead of trusting bounds from before the load."""
    trainer = _scaled_trainer(1000, SGDConfig(lr=1e-3), "fused")
    ones = np.ones(1000, np.float32)
    trainer.train_step(ones)
    state = trainer.state_dict()
    state["model"]["full_precision"]["w"] = np.full(1000, 3e35, np.float32)  # sum 3e38: within float32
    trainer.load_state_dict(state)
    trainer.train_step(ones)
    assert trainer._engine.update.exact_updates == 1 and trainer._train_step_info.all_finite is True


# ---- memory: one set of weights and states --------------------------------------------------------------
def _buffer_bytes(engine):
    tensors = [*engine.weights_flat, *(t for p in (0, 1) for t in engine.states_flat[p].values())]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(unique.values())


def test_the_fused_update_holds_weights_and_states_once():
    model, config = MLP(), AdamConfig(lr=1e-2)
    fused, graph = (_trainer("mlp", model, config, kind) for kind in ("fused", "graph"))
    for trainer in (fused, graph):
        trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    weights = sum(p.numel() for p in model.parameters())
    engine = fused._engine
    assert engine.weights_flat[0] is engine.weights_flat[1] and engine.states_flat[0] is engine.states_flat[1]
    assert engine.buffers[0] is engine.buffers[1]
    assert _buffer_bytes(engine) == 3 * 4 * weights  # weights, Moment_1, Moment_2: float32, once
    assert _buffer_bytes(graph._engine) == 2 * 3 * 4 * weights


# ---- on a GPU (make gpu-check): the same kernels on CUDA views of the flat buffers ----------------------
@pytest.mark.cuda
@pytest.mark.parametrize("case", ["sgd", "adamw_clipped", "loss_scaler", "transformer"])
def test_the_fused_update_on_cuda_equals_the_graph_update_on_cuda(case, record_property):
    """30 steps, fused against graph on the GPU. Weights: the CPU test's bound (u · 10 operations ·
    30 steps = 1.8e-5). Moments: besides the update's own rounding, both trainers' gradients come
    from CUDA kernels whose reductions (up to ~2^8 partial sums here) may add in another order on
    each run, up to u · 8 more per gradient per step, and the second moment squares the gradient
    (doubling its relative difference): 2 · 8 · u · 10 · 30 = 2.9e-4. Measured on an H100
    (onnxruntime-gpu 1.31.1, torch 2.11+cu130, stop 20): weights 1.4e-7 (sgd), 6.3e-7
    (adamw_clipped), 3.2e-7 (loss_scaler), 1.19e-6 (transformer), 15x under their bound; moments
    1.34e-5, 1.36e-5, 1.42e-5, 20x under theirs. Each run records its worst as a property
    (``--junitxml``)."""
    setup, config, options = CASES[case]
    model = SETUPS[setup][0]()
    fused = _trainer(setup, model, config, "fused", device={"id": "cuda"}, **options())
    graph = _trainer(setup, model, config, "graph", device={"id": "cuda"}, **options())
    for x, y in _batches(setup, 40):
        fused.train_step(x, y)
        graph.train_step(x, y)
    engine = fused._engine
    assert isinstance(engine.update, FusedUpdate) and engine.weights_flat[0].device.type == "cuda"
    assert engine.weights_flat[0] is engine.weights_flat[1] and engine.update.exact_updates == 0
    worst = _assert_relative(_state(fused), _state(graph), moment_bound=2 * 8 * TRAJECTORY_BOUND)
    record_property("worst_weight_difference", worst["w"])
    record_property("worst_moment_difference", worst["Moment"])

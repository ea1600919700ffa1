"""The ``gelu`` pass of the torch gradient source (``ort_trainer/graph/torch_gelu.py``): GELU's
forward and backward computed together, GELU formulas written out in Python recognised; gradients
against float64 PyTorch, node counts, and formulas it must leave alone."""

import collections
import copy
import math

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxscript", reason="the 'torch' gradient source exports with onnxscript")

from ort_trainer import ORTTrainer  # noqa: E402
from ort_trainer.graph.passes import forward as rewrites  # noqa: E402
from ort_trainer.graph.gradient import autograd, gelu as torch_gelu  # noqa: E402
from ort_trainer.model_desc import parse_model_desc  # noqa: E402
from ort_trainer.optim import SGDConfig  # noqa: E402

from models import tiny_gpt2  # noqa: E402
from tolerances import FLOAT32, check

WIDTH, HIDDEN = 8, 32
DESC = {"inputs": [("x", ["batch", WIDTH]), ("y", ["batch", WIDTH])], "outputs": [("loss", [], True)]}
ELEMENTWISE = {"Mul", "Add", "Sub", "Div", "Neg", "Pow", "Tanh", "Sigmoid", "Erf", "Exp"}
PASSES_OFF = {name: False for name in rewrites.ALL_PASSES}  # the gelu pass alone, on symbolic-shape graphs


def new_gelu(x):  # Hugging Face's NewGELUActivation (GPT-2), as transformers 5.x writes it
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def fast_gelu(x):  # Hugging Face's FastGELUActivation: another spelling of the same function
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def erf_gelu(x):  # Hugging Face's GELUActivation(use_gelu_python=True)
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def tanh_gelu(x):
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"new_gelu": new_gelu, "fast_gelu": fast_gelu, "erf_gelu": erf_gelu, "gelu": F.gelu,
               "tanh_gelu": tanh_gelu}
TANH = {"new_gelu", "fast_gelu", "tanh_gelu"}


class Block(torch.nn.Module):
    """Linear, activation, Linear, and a mean-squared error: the activation's input is large
    enough (×3) for both of GELU's tails to count."""

    def __init__(self, activation):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)
        self.activation = activation

    def forward(self, x, y):
        return F.mse_loss(self.down(self.activation(3.0 * self.up(x))), y)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, WIDTH, generator=gen), torch.randn(16, WIDTH, generator=gen)


def _reference(model, batch):
    double = copy.deepcopy(model).double()
    double(*(t.double() for t in batch)).backward()
    return {name: p.grad.numpy() for name, p in double.named_parameters()}


def _trainer(model, batch, gelu, **passes):
    options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {**PASSES_OFF, **passes, "gelu": gelu}}
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0), options=options)
    trainer.train_step(*batch)
    return trainer, {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}


# ONNX Runtime's float32 gradients of one step against float64 PyTorch's. Along Block's chain, each
# sum within n·u of its terms' magnitude (Higham's bound): up (8 terms), down (32), down's transpose
# (8), the weight gradients over 16 rows, and some 20 elementwise roundings of the GELU and its
# derivative (tanh, erf, exp: a few ulps each): ≈ 100u = 6e-6, amplified where the residual
# pred − y cancels (|pred| / |pred − y| up to a few): beyond 1e-5 at worst; GPT-2's chain (sums of
# ≤ 64 terms, the MLP) is longer. Kept at 1e-5 (observed at 1 and 2 threads: ≤ 4.3e-7, 23x under).
REFERENCE_BOUND = 1e-5


def _assert_close(got, expected, rtol=REFERENCE_BOUND):
    assert set(got) == set(expected)
    for name, value in expected.items():
        error = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12)
        check(error, rtol, f"{name}: relative error {error:.2e}")


def _op_counts(trainer) -> collections.Counter:
    """Operator types of the trainer's gradient graph, functions inlined (the exporter writes
    ``aten.erf`` as a function around one Erf)."""
    model = onnx.inliner.inline_local_functions(trainer._graphs.gradient)
    return collections.Counter(n.op_type for n in model.graph.node)


def _elementwise(counts) -> int:
    return sum(n for op, n in counts.items() if op in ELEMENTWISE)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_gradients_match_float64_pytorch_with_fewer_passes(name):
    """Every spelling: the pass's graph gives float64 PyTorch's gradients and has fewer elementwise
    nodes than autograd's own; the tanh forms compute one sigmoid and no tanh (the formula was
    found), the erf forms one erf (autograd's graph of F.gelu: two)."""
    model, batch = Block(ACTIVATIONS[name]), _batch()
    expected = _reference(model, batch)
    off_trainer, without = _trainer(model, batch, gelu=False)
    on_trainer, with_pass = _trainer(model, batch, gelu=True)
    _assert_close(without, expected)
    _assert_close(with_pass, expected)
    on, off = _op_counts(on_trainer), _op_counts(off_trainer)
    if name in TANH:
        assert on["Sigmoid"] == 1 and on["Tanh"] == 0 and off["Tanh"] >= 1, (on, off)
        # 6 forward + 7 backward nodes for the GELU, against autograd's 21-25 (the loss adds the same to both)
        assert _elementwise(off) - _elementwise(on) >= 8, (on, off)
    else:
        assert on["Erf"] == 1 and on["Exp"] == 1 and off["Erf"] == (2 if name == "gelu" else 1), (on, off)
        assert _elementwise(off) - _elementwise(on) >= 4, (on, off)


def test_gelu_node_counts_per_form():
    """The GELU itself, forward and backward: 13 elementwise nodes (tanh), 11 (erf)."""
    batch = _batch()
    baseline = _elementwise(_op_counts(_trainer(Block(torch.nn.Identity()), batch, gelu=True)[0]))
    tanh = _elementwise(_op_counts(_trainer(Block(new_gelu), batch, gelu=True)[0]))
    erf = _elementwise(_op_counts(_trainer(Block(F.gelu), batch, gelu=True)[0]))
    assert (tanh - baseline, erf - baseline) == (13, 11)


@pytest.mark.parametrize("shape_specialization", [False, True])
def test_with_every_other_pass_on(shape_specialization):
    """The default options (every pass on), on the symbolic-shape graph and on a static one."""
    model, batch = Block(new_gelu), _batch(1)
    expected = _reference(model, batch)
    options = {"graph": {"gradient_source": "torch"},
               "graph_optimizations": {"shape_specialization": shape_specialization}}
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0), options=options)
    trainer.train_step(*batch)
    _assert_close({w: g.numpy() for w, g in trainer._engine.grads.items()}, expected)
    assert _op_counts(trainer)["Sigmoid"] == 2  # the forward's, and its copy in the backward (activation_recompute)


def test_extreme_inputs_match_float64():
    """Saturated sigmoid / overflowing exp(a²) (|x| up to 40) give PyTorch's values, no NaN."""
    x = torch.tensor([-40.0, -12.0, -5.0, -1e-3, 0.0, 1e-3, 2.0, 9.0, 40.0])

    class Elementwise(torch.nn.Module):
        def __init__(self, activation):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(9))
            self.activation = activation

        def forward(self, x, y):
            return ((self.activation(self.scale * x) - y) ** 2).sum()

    desc = {"inputs": [("x", [9]), ("y", [9])], "outputs": [("loss", [], True)]}
    for activation in (new_gelu, F.gelu):
        model = Elementwise(activation)
        y = torch.zeros(9)
        expected = _reference(model, (x, y))
        options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {"gelu": True}}
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
        trainer.train_step(x, y)
        got = trainer._engine.grads["scale"].numpy()
        assert np.isfinite(got).all()
        # one element per input, no sums: the GELU, its derivative and the loss's products are some
        # 30 roundings, the sigmoid / exp / erf a few ulps each: 32u = 1.9e-6 relative (observed at 1
        # and 2 threads: ≤ 0.8u, 40x under). In the left tail (x = −5) 1 + erf and 1 + tanh cancel and
        # Φ keeps only an absolute error of a few u: the gradient there (−1e-10) is off by
        # ≈ 2|x|·(|gelu|·δgelu' + |gelu'|·δgelu) ≈ 5e-11 (observed 1e-11: too close to a bound of that
        # size for a 10x margin); atol keeps the 1e-6 floor the test was written with, under which
        # values (this tail, and the 5e-7 at x = ±1e-3) are compared absolutely.
        np.testing.assert_allclose(got, expected["scale"], rtol=32 * FLOAT32, atol=1e-6)


def test_pass_off_is_autograds_graph():
    """With the pass off the trainer's graph is the one built without any GELU work (the
    decomposed gelu_backward, the formula's own arithmetic)."""
    model, batch = Block(new_gelu), _batch()
    trainer, _ = _trainer(model, batch, gelu=False)
    sample = [t.numpy() for t in batch]
    plain = autograd.export_joint(copy.deepcopy(model), None, parse_model_desc(DESC), sample, dynamic=True,
                                        outputs=["loss"])
    ops = [n.op_type for n in trainer._graphs.gradient.graph.node]
    assert ops == [n.op_type for n in plain.gradient.graph.node]
    assert "Tanh" in ops and "Sigmoid" not in ops


def _traced(model, batch):
    return autograd.trace(model, None, parse_model_desc(DESC), [t.numpy() for t in batch], dynamic=False)


def _targets(program) -> collections.Counter:
    return collections.Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


class Shared(torch.nn.Module):
    """The tanh formula whose tanh is also read outside it (a partial match)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        h = self.up(x)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))
        return F.mse_loss(0.5 * h * (1.0 + t) + t, y)


def _not_gelu(x):  # the formula with another coefficient: a different function
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.04 * torch.pow(x, 3.0))))


def _two_inputs(x):  # the formula's shape, but the cube reads another tensor
    z = x.flip(-1)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(z, 3.0))))


@pytest.mark.parametrize("model", [Shared(), Block(_not_gelu), Block(_two_inputs)],
                         ids=["tanh-read-elsewhere", "other-coefficient", "two-inputs"])
def test_partial_matches_are_left_alone(model):
    batch = _batch(2)
    traced = _traced(copy.deepcopy(model), batch)
    before = _targets(traced.program)
    assert torch_gelu.rewrite_formulas(traced.program) == 0
    assert _targets(traced.program) == before and "aten.gelu.default" not in before
    expected = _reference(model, batch)
    trainer, grads = _trainer(model, batch, gelu=True)
    _assert_close(grads, expected)
    assert _op_counts(trainer)["Tanh"] >= 1 and _op_counts(trainer)["Sigmoid"] == 0


def test_formula_becomes_aten_gelu_before_autograd():
    """The pass's first half, on the traced program: each spelling is one aten.gelu with the
    right approximation, and the formula's nodes are gone."""
    for activation, approximate in ((new_gelu, "tanh"), (fast_gelu, "tanh"), (erf_gelu, "none")):
        traced = _traced(Block(activation), _batch())
        assert torch_gelu.rewrite_formulas(traced.program) == 1
        gelus = [n for n in traced.program.graph.nodes if n.target == torch.ops.aten.gelu.default]
        assert len(gelus) == 1 and gelus[0].kwargs.get("approximate", "none") == approximate
        targets = _targets(traced.program)
        assert not any(t in targets for t in ("aten.tanh.default", "aten.erf.default", "aten.pow.Tensor_Scalar"))


def test_hugging_face_activations_are_recognised():
    """The activations of the installed transformers (GPT-2's gelu_new, gelu_fast, the Python erf
    GELU) become aten.gelu."""
    activations = pytest.importorskip("transformers.activations", reason="needs transformers")
    for module, approximate in ((activations.NewGELUActivation(), "tanh"), (activations.FastGELUActivation(), "tanh"),
                                (activations.GELUActivation(use_gelu_python=True), "none")):
        traced = _traced(Block(module), _batch())
        assert torch_gelu.rewrite_formulas(traced.program) == 1, type(module).__name__
        gelus = [n for n in traced.program.graph.nodes if n.target == torch.ops.aten.gelu.default]
        assert [g.kwargs.get("approximate", "none") for g in gelus] == [approximate]


@pytest.mark.parametrize("activation", [new_gelu, F.gelu], ids=["tanh", "erf"])
def test_float16_mixed_precision_keeps_the_forward_and_differentiates_in_float32(activation):
    """Under float16 autocast the GELU's forward stays as traced (float16) and its backward is the
    same arithmetic in float32, as torch's own decomposition computes it: the gradients are within
    float16 rounding of float64 and no worse than autograd's graph."""
    from ort_trainer.amp import DynamicLossScaler

    model, batch, scale = Block(activation), _batch(3), 1024.0
    expected = _reference(model, batch)
    errors, float32 = {}, {}
    # the pass's own nodes, in float32: the sigmoid (tanh form), a / exp(a²) (erf form)
    backward = "Sigmoid" if activation is new_gelu else "Div"
    for gelu in (False, True):
        options = {"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                   "graph_optimizations": {**PASSES_OFF, "gelu": gelu},
                   "mixed_precision": {"enabled": True, "dtype": "float16",
                                       "loss_scaler": DynamicLossScaler(automatic_update=False, loss_scale=scale)}}
        trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=0.0), options=options)
        trainer.train_step(*batch)
        grads = {w: g.numpy().astype(np.float64) / scale for w, g in trainer._engine.grads.items()}
        errors[gelu] = max(np.linalg.norm(grads[k] - v) / np.linalg.norm(v) for k, v in expected.items())
        inferred = onnx.shape_inference.infer_shapes(trainer._graphs.gradient)
        types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
        float32[gelu] = sum(1 for n in inferred.graph.node
                            if n.op_type == backward and types.get(n.output[0]) == onnx.TensorProto.FLOAT)
    assert float32[True] == float32[False] + 1, float32
    # float16 products and activations: each sum of the chain (≤ 32 terms: the hidden layer, 16 rows
    # per weight gradient) within 32·u16 = 1.6e-2 of its terms' magnitude (Higham's bound, float16
    # accumulation at worst); kept at 1e-2 (observed at 1 and 2 threads: ≤ 3.4e-4, 29x under)
    check(errors[True], 1e-2, "float16 gradients against float64")
    # the pass no worse than autograd's own graph: a comparison of two errors, not a tolerance
    assert errors[True] < 1.5 * errors[False] + 1e-4, errors


def test_hugging_face_gpt2_gradients_match_float64():
    """A one-layer GPT2LMHeadModel (NewGELUActivation between its Conv1D projections): the formula
    is found in the real model and every gradient is float64 PyTorch's."""
    model, desc = tiny_gpt2(n_layer=1)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.ones_like(ids), ids.clone())
    double = copy.deepcopy(model).double()
    double(input_ids=batch[0], attention_mask=batch[1], labels=batch[2]).loss.backward()
    expected = {name: p.grad.numpy() for name, p in double.named_parameters()}
    options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {"gelu": True}}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    trainer.train_step(*batch)
    _assert_close({w: g.numpy() for w, g in trainer._engine.grads.items()}, expected)
    counts = _op_counts(trainer)
    assert counts["Sigmoid"] == 2 and counts["Tanh"] == 0, counts  # with activation_recompute's copy


def test_the_switch_is_part_of_the_graph_cache_key():
    """On by default, and a graph cached with the pass on is never reused with it off."""
    jobs = [ORTTrainer(Block(F.gelu), DESC, SGDConfig(lr=0.0), options=options)._job
            for options in ({}, {"graph_optimizations": {"gelu": False}})]
    assert jobs[0].passes["gelu"] is True and jobs[1].passes["gelu"] is False
    dtypes = {"x": "float32", "y": "float32"}
    assert jobs[0].record_cache_key("record", dtypes, None) != jobs[1].record_cache_key("record", dtypes, None)


@pytest.mark.parametrize("activation", [tanh_gelu, F.gelu], ids=["tanh", "erf"])
def test_a_backward_without_its_forward_recomputes_it(activation, monkeypatch):
    """A gelu_backward whose input is not the input of a forward gelu node (here: the forward reads
    an alias of it) recomputes the forward values it needs; the forward stays as traced."""
    rewrite = torch_gelu.rewrite_joint

    def aliased_then_rewritten(program, **options):
        for node in [n for n in program.graph.nodes if n.target == torch.ops.aten.gelu.default]:
            with program.graph.inserting_before(node):
                alias = program.graph.call_function(torch.ops.aten.alias.default, (node.args[0],))
            alias.meta["val"] = node.args[0].meta["val"]
            node.args = (alias, *node.args[1:])
        return rewrite(program, **options)

    monkeypatch.setattr(torch_gelu, "rewrite_joint", aliased_then_rewritten)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")  # the same model's graph, cached by another test
    model, batch = Block(activation), _batch(4)
    trainer, grads = _trainer(model, batch, gelu=True)
    _assert_close(grads, _reference(model, batch))
    counts = _op_counts(trainer)
    if activation is tanh_gelu:
        assert counts["Tanh"] == 1 and counts["Sigmoid"] == 1, counts  # the traced forward, the recomputation
    else:
        assert counts["Erf"] == 2 and counts["Div"] >= 1, counts

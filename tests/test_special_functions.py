"""The log-gamma function and its derivatives (``lgamma``, ``digamma``, ``polygamma(1, ·)``), which torch's ONNX
exporter cannot translate, are written out (``graph/gradient/special_functions.py``): equal to torch's float64
values, and models with ``torch.distributions``' Gamma, Beta and Student-t log-probabilities and a Gamma KL
divergence train as in PyTorch on the ``torch`` route. ``erfinv`` (Giles' approximation in float64) is within a
few float32 ulps of SciPy's and trains as PyTorch."""


import math

import pytest
import torch
from torch import distributions as D

from ort_trainer import _runtime
from ort_trainer.graph.gradient.special_functions import digamma, erfinv, lgamma, polygamma
from models import classified_batches, sgd_steps_as_pytorch
from tolerances import FLOAT32, FLOAT64, check, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")


def _points() -> torch.Tensor:
    """Positive arguments from 1e-3 to 1e4 and negative ones down to -10, none within 1e-3 of a pole."""
    x = torch.cat([torch.linspace(1e-3, 30, 6000, dtype=torch.float64),
                   torch.linspace(30, 1e4, 500, dtype=torch.float64),
                   torch.linspace(-9.99, 0.49, 6000, dtype=torch.float64)])
    return x[(x - x.round()).abs() > 1e-3]


@pytest.mark.parametrize("name", ["lgamma", "digamma", "trigamma"])
def test_the_functions_equal_scipys_in_float64_and_round_once_in_float32(name):
    """Against SciPy's (torch's own float64 trigamma is off by up to 1.2e-9 of SciPy's)."""
    special = pytest.importorskip("scipy.special", reason="the reference values are SciPy's")
    ours = {"lgamma": lgamma, "digamma": digamma, "trigamma": lambda x: polygamma(1, x)}[name]
    exact = {"lgamma": special.gammaln, "digamma": special.digamma, "trigamma": lambda x: special.polygamma(1, x)}[name]
    x = _points()
    want = torch.from_numpy(exact(x.numpy()))
    # float64: the series' truncation (< 1e-13 at 8 and above) and the roundings of ~40 operations on terms up to
    # 100 times the result (the raised sums of reciprocals near 0): 40 · 100 · 2^-53 = 4.4e-13, relative to
    # max(1, |value|); bound 10x that, observed <= 0.1 of it
    check(float(((ours(x) - want).abs() / want.abs().clamp(min=1.0)).max()), 10 * 40 * 100 * FLOAT64,
          f"{name} float64")
    # float32: computed in float64 from the float32 argument (exact), rounded once: at most 2^-24 relative plus
    # the float64 error; bound 10x that (the suite's margin), observed 0.1 of it
    x32 = x.float()
    want32 = torch.from_numpy(exact(x32.double().numpy()))
    error = ((ours(x32).double() - want32).abs() / want32.abs().clamp(min=1.0)).max()
    check(float(error), 10 * FLOAT32, f"{name} float32")


class Likelihoods(torch.nn.Module):
    """Negative log-likelihoods of Gamma, Beta and Student-t distributions whose parameters a layer computes, and
    the KL divergence between two Gammas (digamma in the forward, so polygamma(1, ·) in the backward)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 7)

    def forward(self, x, positive, unit, real):
        p = torch.nn.functional.softplus(self.linear(x)) + 0.1
        nll = -(D.Gamma(p[:, 0], p[:, 1]).log_prob(positive) + D.Beta(p[:, 2], p[:, 3]).log_prob(unit)
                + D.StudentT(p[:, 4], loc=self.linear(x)[:, 5]).log_prob(real))
        kl = D.kl_divergence(D.Gamma(p[:, 0], p[:, 1]), D.Gamma(p[:, 6], torch.ones_like(p[:, 6])))
        return (nll + kl).mean()


def test_distributions_with_the_gamma_function_train_as_pytorch():
    torch.manual_seed(37)
    desc = {"inputs": [("x", ["b", 4]), ("positive", ["b"]), ("unit", ["b"]), ("real", ["b"])],
            "outputs": [("loss", [], True)]}

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(6, 4, generator=g), torch.rand(6, generator=g) * 3 + 0.1,
                torch.rand(6, generator=g) * 0.9 + 0.05, torch.randn(6, generator=g))

    # float32 throughout but the gamma functions (ours rounded once from float64, torch's within an ulp or two
    # of float32): per step the sums' steps_bound; observed <= 0.05 of it
    sgd_steps_as_pytorch(Likelihoods(), desc, (batch(step) for step in range(3)), 0.05,
                         lambda step: steps_bound(step + 1), {"graph": {"gradient_source": "torch"}})


def test_erfinv_is_within_a_few_float32_ulps_of_scipys():
    """Giles' approximation: within 1.3e-7 of the exact value, relative (measured in float64 against SciPy over
    [-1, 1]: 1.25e-7), then one float32 rounding (2^-24): within 1.9e-7 of SciPy's; bound 2x that, observed
    1.7e-7. ±1, past ±1, NaN and -0 as torch's."""
    special = pytest.importorskip("scipy.special", reason="the reference values are SciPy's")
    x = torch.linspace(-1, 1, 400001, dtype=torch.float32)[1:-1]
    want = torch.from_numpy(special.erfinv(x.double().numpy()))
    nonzero = want != 0
    error = ((erfinv(x).double() - want).abs()[nonzero] / want.abs()[nonzero]).max()
    check(float(error), 2 * (1.3e-7 + FLOAT32), "erfinv float32")
    edges = torch.tensor([1.0, -1.0, 1.5, -2.0, float("nan"), -0.0, 0.0])
    ours, theirs = erfinv(edges), torch.erfinv(edges)
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    numbers = ~theirs.isnan()  # (-0 stays -0; a NaN's sign is no value)
    assert torch.equal(ours.signbit()[numbers], theirs.signbit()[numbers]) and erfinv(edges.double()) is NotImplemented


class Gaussianised(torch.nn.Module):
    """A layer's outputs squashed into (-0.9, 0.9) and mapped through the normal's inverse CDF (erfinv)."""

    def __init__(self):
        super().__init__()
        self.linear, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(torch.erfinv(0.9 * torch.tanh(self.linear(x)))), y)


def test_erfinv_trains_as_pytorch():
    torch.manual_seed(6)
    desc = {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    batches = classified_batches(3, rows=6, features=4, seed=7)
    # sums of at most 6 terms and erfinv's 4 ulps (against torch's kernel's 1) in the forward and its gradient's
    # exp(erfinv²): 16 units a step, carried through the weights
    sgd_steps_as_pytorch(Gaussianised(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=16),
                         {"graph": {"gradient_source": "torch"}})


@pytest.mark.parametrize("dtype, span", [(torch.float32, 36), (torch.float64, 300), (torch.float16, 4)],
                         ids=["float32", "float64", "float16"])
def test_hypot_is_torchs_without_overflow(dtype, span):
    """Magnitudes across the dtype's range (squares that overflow and underflow): float32 and half computed in
    float64 and rounded once, as torch's kernel rounds once, so within one ulp of it (2^-23 relative in float32;
    observed: equal here, <= 8.1e-8 on other draws); float64 scaled by the larger magnitude, ~4 roundings
    (observed 0.22 of 8.9e-16); infinities and NaN as torch's."""
    from ort_trainer.graph.gradient.special_functions import hypot

    generator = torch.Generator().manual_seed(8)
    scale = torch.pow(10.0, torch.randint(-span, span, (1000,), generator=generator).double())
    a = (torch.randn(1000, generator=generator).double() * scale).to(dtype)
    b = (torch.randn(1000, generator=generator).double() * scale.flip(0)).to(dtype)
    a[:5] = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 3.0]).to(dtype)
    b[:5] = torch.tensor([math.nan, 1.0, math.inf, 0.0, 4.0]).to(dtype)
    ours, theirs = hypot(a, b), torch.hypot(a, b)
    assert ours.dtype == dtype and torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.isinf(), theirs.isinf())
    normal = theirs.isfinite() & (theirs.double().abs() > torch.finfo(dtype).tiny)  # subnormals: a coarser grid
    relative = ((ours[normal].double() - theirs[normal].double()).abs() / theirs[normal].double()).max()
    check(float(relative), 4 * 2 * FLOAT64 if dtype == torch.float64 else 2 * torch.finfo(dtype).eps / 2, "hypot")


class Polar(torch.nn.Module):
    """Features' pairwise magnitudes (``torch.hypot``), as a complex layer written in real tensors computes them."""

    def __init__(self):
        super().__init__()
        self.real, self.imaginary, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(torch.hypot(self.real(x), self.imaginary(x))), y)


def test_hypot_trains_as_pytorch():
    torch.manual_seed(9)
    desc = {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    batches = classified_batches(3, rows=6, features=4, seed=10)
    # sums of at most 6 terms and hypot's one rounding (its gradient's division another) a step
    sgd_steps_as_pytorch(Polar(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=8),
                         {"graph": {"gradient_source": "torch"}})

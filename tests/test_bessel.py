"""The modified Bessel functions of orders 0 and 1 (``torch.special.i0``, ``i0e``, ``i1``, ``i1e``), which torch's
ONNX exporter cannot translate, are written out (``graph/gradient/bessel.py``): within a few float64 roundings of
torch's float64 values across both expansions, rounded once in float32, and a model with them (and so their
gradients, which read the others) trains as in PyTorch on the ``torch`` route."""

import math

import pytest
import torch

from ort_trainer import _runtime
from ort_trainer.graph.gradient import bessel
from models import classified_batches, sgd_steps_as_pytorch
from tolerances import FLOAT32, FLOAT64, check, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")

_FUNCTIONS = {"i0": (bessel.i0, torch.special.i0), "i0e": (bessel.i0e, torch.special.i0e),
              "i1": (bessel.i1, torch.special.i1), "i1e": (bessel.i1e, torch.special.i1e)}


@pytest.mark.parametrize("name", list(_FUNCTIONS))
def test_the_functions_equal_torchs_in_float64_and_round_once_in_float32(name):
    ours, theirs = _FUNCTIONS[name]
    x = torch.cat([torch.linspace(-750, 750, 30001, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, 1e-300, -1e-8, 19.999999, 20.0, 20.000001, math.inf, -math.inf])])
    want = theirs(x)
    got = ours(x)
    assert got.dtype == torch.float64 and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(torch.signbit(got[want.isinf()]), torch.signbit(want[want.isinf()]))
    finite = want.isfinite() & (want != 0)
    # float64: the series' 48 positive terms (each a product of a few roundings; no cancellation) or the asymptotic
    # expansion's 20 (their truncation below 4e-16), a square root and an exponential of up to 750 (its relative
    # error grows with the argument: 750 · 2^-53): ~60 roundings, bound 10x that. Observed: <= 2.1e-15 (0.03).
    check(float(((got - want).abs() / want.abs())[finite].max()), 10 * 60 * FLOAT64, f"{name} float64")
    # float32: the float64 value of the float32 argument, rounded once: 2^-24 relative plus the float64 error;
    # bound 10x. Observed: one rounding (0.1 of the bound).
    x32 = x.float()
    want32 = theirs(x32.double())
    got32 = ours(x32)
    assert got32.dtype == torch.float32 and torch.equal(got32.isinf(), want32.float().isinf())
    finite = want32.float().isfinite() & (want32 != 0)
    check(float(((got32.double() - want32).abs() / want32.abs())[finite].max()), 10 * FLOAT32, f"{name} float32")
    assert ours(torch.tensor([math.nan])).isnan().all()


class Concentrations(torch.nn.Module):
    """Per-class scores from the four functions of a layer's outputs (a von Mises-like normaliser and its ratios)."""

    def __init__(self):
        super().__init__()
        self.linear, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, y):
        h = 3 * torch.tanh(self.linear(x))
        features = torch.special.i0(h).log() + torch.special.i1(h) + torch.special.i0e(h) - torch.special.i1e(h)
        return torch.nn.functional.cross_entropy(self.head(features), y)


def test_a_model_with_them_trains_as_pytorch():
    torch.manual_seed(11)
    desc = {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    batches = classified_batches(3, rows=6, features=4, seed=12)
    # sums of at most 6 terms and each function's one rounding (torch's kernels round once too; the gradients read
    # the others and a division): 16 units a step, carried through the weights
    sgd_steps_as_pytorch(Concentrations(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=16),
                         {"graph": {"gradient_source": "torch"}})

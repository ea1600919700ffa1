"""Where the suite's numeric tolerances come from.

Every bound in a comparison is one of these, or a product of them with a comment that says how:
unit roundoff (the largest relative error of one rounded operation) × the number of rounded
operations between the two results compared × steps where errors add up, with a stated factor
for margin. ``make test-tolerances`` runs the suite under 1 and 2 threads and reports, for every
comparison, its observed error as a fraction of its bound (``tests/_tolerance_audit.py``); each
bound leaves at least a 10x margin over what was observed.
"""

from __future__ import annotations

import numpy as np

# Unit roundoff u: |fl(x ∘ y) − x ∘ y| ≤ u·|x ∘ y| for one correctly rounded operation.
FLOAT64 = 2.0 ** -53  # 1.11e-16
FLOAT32 = 2.0 ** -24  # 5.96e-8
FLOAT16 = 2.0 ** -11  # 4.88e-4
BFLOAT16 = 2.0 ** -8  # 3.91e-3


# The longest sum in the test models (tests/models.py): the 64-wide feed-forward layer of
# TinyEncoder. The MLP's layers are 20 and 32 wide, weight gradients sum over at most 48 batch
# positions, the softmax over 50 classes. The global gradient norm that clipping takes sums many
# more squares (837 for the MLP, 22386 for the encoder), but its relative error scales every
# gradient of the step alike, which Adam's and Lamb's m/√v cancel (up to ε) and SGD never clips.
REDUCTION = 64


def steps_bound(steps: int, unit: float = FLOAT32, length: int = REDUCTION, factor: float = 1.0) -> float:
    """A bound on the relative difference between two implementations after ``steps`` steps.

    Two implementations that compute the same float32 arithmetic but may add each sum of ``length``
    terms in another order (another kernel, another thread count) differ by at most
    ``length · unit`` of the sum's magnitude per step (Higham's γ_n bound for a dot product of
    length n); a difference carried into the next step through the weights adds at most once per
    step. ``factor`` is the stated margin or extra operation count of the caller.
    """
    return steps * length * unit * factor


def relative_error(got, expected) -> float:
    """max |got − expected| over max |expected| (0 when both are all zeros), in float64."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    difference = float(np.abs(got - expected).max()) if expected.size else 0.0
    if scale == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / scale


def norm_relative_error(got, expected) -> float:
    """‖got − expected‖₂ over ‖expected‖₂, in float64 (the error of a tensor as a whole)."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


def check(error: float, bound: float, what: str = "") -> None:
    """Assert ``error <= bound``; under the tolerance audit, record the ratio at the caller's line."""
    from _tolerance_audit import record

    record(error / bound if bound > 0 else (0.0 if error == 0 else float("inf")))
    assert error <= bound, f"{what}: error {error:.3g} exceeds its bound {bound:.3g}".lstrip(": ")

"""The tolerance audit: how close each numeric comparison of the suite comes to its bound.

With ``ORT_TRAINER_TOLERANCE_AUDIT=FILE`` set, ``conftest.py`` installs wrappers around
``np.testing.assert_allclose``, ``torch.testing.assert_close`` and ``pytest.approx`` (and
``tolerances.check`` records itself): each comparison records its observed error as a fraction
of its allowed error, ``max |a − b| / (atol + rtol·|b|)``, at the test line that made it. At the
end of the session the worst fraction per line is appended to FILE as JSON lines, tagged with
the thread count; ``python tests/_tolerance_audit.py FILE`` prints the lines whose margin is
under 10x. Exact comparisons (both tolerances 0) are not recorded: they have no margin to lose.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

_TESTS = str(Path(__file__).resolve().parent)
_SKIP = {"tolerances.py", "_tolerance_audit.py"}
_worst: dict[str, float] | None = None  # None: the audit is off


def _caller() -> str:
    """``file:line`` of the innermost frame in a test module (helpers in tests/ included)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TESTS) and os.path.basename(path) not in _SKIP:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def record(ratio: float) -> None:
    """Record one comparison's observed error as a fraction of its bound (no-op when the audit is off)."""
    if _worst is None:
        return
    site = _caller()
    _worst[site] = max(_worst.get(site, 0.0), float(ratio))


def _ratio(actual, expected, rtol: float, atol: float) -> float | None:
    try:
        a = np.asarray(actual, dtype=np.float64)
        b = np.asarray(expected, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if rtol == 0 and atol == 0:
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        difference = np.abs(a - b)
        allowed = atol + rtol * np.abs(b)
        both_nan = np.isnan(a) & np.isnan(b)
        same = (difference == 0) | both_nan | ((a == b) & np.isinf(a))
        ratio = np.where(same, 0.0, difference / allowed)
    return float(np.nan_to_num(ratio, nan=np.inf).max()) if ratio.size else 0.0


_TORCH_DEFAULTS = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
                   "float64": (1e-7, 1e-7)}


def install() -> None:
    """Wrap the comparison functions (called by conftest when the audit is on)."""
    global _worst
    import torch

    try:
        from _pytest.approx import Approx as ApproxBase, ApproxScalar  # pytest >= 9.2
    except ImportError:
        from _pytest.python_api import ApproxBase, ApproxScalar

    _worst = {}
    assert_allclose = np.testing.assert_allclose

    def audited_allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
        ratio = _ratio(actual, desired, rtol, atol)
        if ratio is not None:
            record(ratio)
        return assert_allclose(actual, desired, rtol, atol, *args, **kwargs)

    assert_close = torch.testing.assert_close

    def audited_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
            dtype = str(expected.dtype).replace("torch.", "")
            default = _TORCH_DEFAULTS.get(dtype, (0.0, 0.0))
            ratio = _ratio(actual.detach().cpu().double(), expected.detach().cpu().double(),
                           default[0] if rtol is None else rtol, default[1] if atol is None else atol)
            if ratio is not None:
                record(ratio)
        return assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    scalar_eq = ApproxScalar.__eq__
    negated = []  # inside ``x != approx(y)``: the values must differ, there is no margin to audit

    def audited_ne(self, actual):
        negated.append(True)
        try:
            return not self.__eq__(actual)
        finally:
            negated.pop()

    def audited_eq(self, actual):
        if negated:
            return scalar_eq(self, actual)
        try:
            tolerance = float(self.tolerance)
            ratio = _ratio(actual, self.expected, 0.0, tolerance) if tolerance > 0 else None
        except (TypeError, ValueError):
            ratio = None
        if ratio is not None:
            record(ratio)
        return scalar_eq(self, actual)

    np.testing.assert_allclose = audited_allclose
    torch.testing.assert_close = audited_close
    ApproxScalar.__eq__ = audited_eq
    ApproxBase.__ne__ = audited_ne


def write(path: str) -> None:
    """Append the worst fraction per comparison line to ``path`` (JSON lines)."""
    if not _worst:
        return
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    with open(path, "a") as handle:
        for site, ratio in sorted(_worst.items()):
            handle.write(json.dumps({"site": site, "ratio": ratio, "threads": threads}) + "\n")


def report(path: str, margin: float = 10.0) -> int:
    """Print every comparison line whose worst ratio leaves less than ``margin`` to its bound."""
    worst: dict[str, tuple[float, str]] = {}
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if entry["ratio"] > worst.get(entry["site"], (-1.0, ""))[0]:
            worst[entry["site"]] = (entry["ratio"], entry["threads"])
    tight = {s: v for s, v in worst.items() if v[0] * margin > 1}
    for site, (ratio, threads) in sorted(tight.items(), key=lambda kv: -kv[1][0]):
        print(f"{site:45s} {ratio:10.3g} of its bound (threads {threads}): margin {1 / ratio if ratio else float('inf'):.1f}x")
    print(f"{len(worst)} comparison lines audited; {len(tight)} with a margin under {margin:g}x")
    return 1 if tight else 0


if __name__ == "__main__":
    sys.exit(report(sys.argv[1]))

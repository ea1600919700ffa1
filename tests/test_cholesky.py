"""Cholesky factorisations and triangular solves train on the ``torch`` route (``graph/export/cholesky.py``), and
with them ``torch.distributions.MultivariateNormal`` (a covariance checked for positive definiteness,
``distribution_checks.py``, or a scale factor) and ``LowRankMultivariateNormal``: the functions against torch's in
float64 (values, torch's symmetrised gradient, ``info``), the exported gradients against float64 PyTorch, training,
evaluation and the saved model against PyTorch."""

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal

pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript: pip install onnxscript")

from ort_trainer import ORTTrainer, _logging  # noqa: E402
from ort_trainer.amp.kernels import MissingKernelError  # noqa: E402
from ort_trainer.graph.export import cholesky  # noqa: E402
from ort_trainer.graph.export.torchscript import ExportError  # noqa: E402
from ort_trainer.graph.gradient.autograd import export_joint  # noqa: E402
from ort_trainer.optim import SGDConfig  # noqa: E402
from models import sgd_steps_as_pytorch  # noqa: E402
from test_torch_autograd import assert_grads_match, desc, feeds_for, reference, run  # noqa: E402
from tolerances import FLOAT64, check, relative_error, steps_bound  # noqa: E402

# float64 against LAPACK's float64: both backward stable, so the factors and solutions differ by the condition
# (~40 here) times a few roundings per element of sums of up to n = 70 terms: 70 · 40 · 2^-53 = 3e-13; gradients
# (through an inverse of the factor) a condition further. Observed: factors <= 1e-15, gradients <= 3e-15.
FACTOR_BOUND = 70 * 40 * FLOAT64 * 10
GRADIENT_BOUND = FACTOR_BOUND * 40


def _spd(n: int, batch: tuple = (2,), seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, n + 5, dtype=torch.float64, generator=generator)
    return x @ x.mT / n + 0.1 * torch.eye(n, dtype=torch.float64)


def _values_and_gradients(ours, theirs, *inputs):
    """Both functions' outputs and the gradients of a random projection of them for each input."""
    got_inputs = [t.clone().requires_grad_() for t in inputs]
    want_inputs = [t.clone().requires_grad_() for t in inputs]
    got, want = ours(*got_inputs), theirs(*want_inputs)
    weights = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(9))
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    return got.detach(), want.detach(), [t.grad for t in got_inputs], [t.grad for t in want_inputs]


@pytest.mark.parametrize("n", [1, 5, 33, 70])  # one block, and several (BLOCK = 32)
@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "one-triangle-read"])
def test_cholesky_and_its_symmetrised_gradient_are_torchs(n, upper, symmetric):
    a = _spd(n)
    if not symmetric:  # torch reads one triangle; its gradient is symmetric all the same
        a = a + 0.01 * torch.randn(a.shape, dtype=a.dtype, generator=torch.Generator().manual_seed(1))
    got, want, got_grads, want_grads = _values_and_gradients(lambda m: cholesky.cholesky(m, upper=upper),
                                                             lambda m: torch.linalg.cholesky(m, upper=upper), a)
    check(relative_error(got, want), FACTOR_BOUND, "factor")
    check(relative_error(got_grads[0], want_grads[0]), GRADIENT_BOUND, "gradient")


@pytest.mark.parametrize("n", [4, 40])
def test_cholesky_ex_gives_torchs_info(n):
    """The order of the first leading minor that is not positive definite, per matrix; 0 where all are."""
    a = _spd(n, batch=(3,))
    a[1, n // 2, n // 2] = -1.0
    a[2, n - 1, n - 1] = float("nan")
    got, want = cholesky.cholesky_ex(a), torch.linalg.cholesky_ex(a)
    assert type(got) is type(want) and torch.equal(got.info, want.info) and want.info.tolist()[0] == 0
    check(relative_error(got.L[0], want.L[0]), FACTOR_BOUND, "the positive definite matrix's factor")
    got, want = cholesky.cholesky_deprecated(a[0], True), torch.cholesky(a[0], True)
    check(relative_error(got, want), FACTOR_BOUND, "torch.cholesky(upper=True)")


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unitriangular", [False, True])
def test_triangular_solves_read_one_triangle_as_torchs(upper, left, unitriangular):
    factor = torch.linalg.cholesky(_spd(6))
    triangle = factor.mT if upper else factor
    junk = 0.5 * torch.randn(triangle.shape, dtype=triangle.dtype, generator=torch.Generator().manual_seed(2))
    a = triangle + (junk.tril(-1) if upper else junk.triu(1))  # the other triangle: read by neither
    b = torch.randn(6, 3, dtype=a.dtype, generator=torch.Generator().manual_seed(3))  # broadcast over a's batch
    b = b if left else b.mT
    kwargs = {"upper": upper, "left": left, "unitriangular": unitriangular}
    got, want, got_grads, want_grads = _values_and_gradients(
        lambda m, r: cholesky.solve_triangular(m, r, **kwargs),
        lambda m, r: torch.linalg.solve_triangular(m, r, **kwargs), a, b)
    check(relative_error(got, want), FACTOR_BOUND, "solution")
    for got_grad, want_grad, name in zip(got_grads, want_grads, ("A", "B")):
        check(relative_error(got_grad, want_grad), GRADIENT_BOUND, f"gradient of {name}")


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_solve_inverse_and_the_deprecated_triangular_solve_are_torchs(upper):
    factor = torch.linalg.cholesky(_spd(7), upper=upper)
    b = torch.randn(2, 7, 2, dtype=factor.dtype, generator=torch.Generator().manual_seed(4))
    check(relative_error(cholesky.cholesky_solve(b, factor, upper), torch.cholesky_solve(b, factor, upper)),
          FACTOR_BOUND, "cholesky_solve")
    check(relative_error(cholesky.cholesky_inverse(factor[0], upper), torch.cholesky_inverse(factor[0], upper)),
          FACTOR_BOUND, "cholesky_inverse")
    for transpose in (False, True):
        got, want = cholesky.triangular_solve(b, factor, upper, transpose), torch.triangular_solve(b, factor, upper,
                                                                                                  transpose)
        assert type(got) is type(want) and torch.equal(got.cloned_coefficient, want.cloned_coefficient)
        check(relative_error(got.solution, want.solution), FACTOR_BOUND, f"triangular_solve (transpose={transpose})")


class Gaussians(torch.nn.Module):
    """A Gaussian head scored three ways: a full covariance (validated: positive definite), a scale factor made
    from the weights (its diagonal kept positive), and a low-rank covariance; plus a Gaussian process's
    ``cholesky_solve`` and log-determinant of 40 points (two blocks)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.body = torch.nn.Linear(3, 8)
        self.mean = torch.nn.Linear(8, d)
        self.raw = torch.nn.Parameter(0.3 * torch.randn(d, d))
        self.low_rank = torch.nn.Parameter(0.3 * torch.randn(d, 2))
        self.points = torch.nn.Parameter(torch.linspace(-1, 1, 40)[:, None] + 0.05 * torch.randn(40, 1))

    def forward(self, x, y):
        mean = self.mean(torch.tanh(self.body(x)))
        d = self.raw.shape[0]
        covariance = self.raw @ self.raw.mT + torch.eye(d)
        nll = -MultivariateNormal(mean, covariance_matrix=covariance).log_prob(y).mean()
        scale = self.raw.tril(-1) + torch.diag(F.softplus(torch.diagonal(self.raw)) + 0.5)
        nll = nll - MultivariateNormal(mean, scale_tril=scale).log_prob(y).mean()
        nll = nll - LowRankMultivariateNormal(mean, self.low_rank, torch.ones(d)).log_prob(y).mean()
        kernel = torch.exp(-torch.cdist(self.points, self.points) ** 2) + 0.1 * torch.eye(40)
        factor = torch.linalg.cholesky(kernel)
        targets = torch.sin(3 * self.points)
        fit = (targets * torch.cholesky_solve(targets, factor)).sum()
        return nll + 0.01 * (fit + 2 * torch.log(torch.diagonal(factor)).sum())


DESC = {"inputs": [("x", ["batch", 3]), ("y", ["batch", 4])], "outputs": [("loss", [], True)]}
BOUND_LENGTH = 48  # the longest float32 sum of a step (test_trains_evaluates_and_saves_as_pytorch)


def _batches(steps: int):
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 3, generator=generator), torch.randn(6, 4, generator=generator)) for _ in range(steps)]


def test_gradients_equal_float64_pytorchs():
    """Within the suite's 1e-5 of float64 PyTorch's (test_torch_autograd; the factors' inverses of matrices of
    condition <= ~100 add a few roundings)."""
    torch.manual_seed(0)
    model = Gaussians()
    x, y = _batches(1)[0]
    graphs = export_joint(model, None, desc(DESC), [x.numpy(), y.numpy()])
    _, grads, _ = reference(model, lambda m, x, y: m(x, y), (x, y))
    assert_grads_match(run(graphs.gradient, feeds_for(model, graphs.meta, {"x": x, "y": y})), graphs.meta, grads)


def test_trains_evaluates_and_saves_as_pytorch(tmp_path):
    torch.manual_seed(1)
    batches = _batches(4)
    # float32 sums of at most 48 terms a step (the 40-point kernel's), carried through the weights; the kernel's
    # factor (condition ~250: ~250 roundings of its entries) enters the loss scaled by 0.01, within that
    trainer, pytorch = sgd_steps_as_pytorch(Gaussians(), DESC, batches, 0.05,
                                            lambda step: steps_bound(step + 1, length=BOUND_LENGTH),
                                            {"graph": {"gradient_source": "torch"}})
    x, y = batches[0]
    with torch.no_grad():
        want = float(pytorch(x, y))
    check(relative_error(float(trainer.eval_step(x, y)), want), steps_bound(5, length=BOUND_LENGTH), "eval")
    path = tmp_path / "gaussians.onnx"
    trainer.save_as_onnx(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    saved = session.run(None, {"x": x.numpy(), "y": y.numpy()})[0]
    check(relative_error(np.asarray(saved), want), steps_bound(5, length=BOUND_LENGTH), "saved model")


class _Large(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.eye(4))

    def forward(self, x):
        return torch.linalg.cholesky(self.a @ self.a.mT + torch.eye(4)).sum() * x.sum()


def test_a_matrix_past_the_size_limit_is_refused_naming_the_operator_and_the_limit(monkeypatch, caplog):
    monkeypatch.setattr(cholesky, "MAX_ROWS", 3)
    monkeypatch.setattr(_logging, "_LOGGED", set())
    trainer = ORTTrainer(_Large(), {"inputs": [("x", ["batch", 4])], "outputs": [("loss", [])]}, SGDConfig(),
                         options={"graph": {"gradient_source": "torch"}})
    with caplog.at_level(logging.WARNING, logger="ort_trainer"), \
            pytest.raises(ExportError, match=r"linalg_cholesky(_ex)?\.default"):
        trainer.train_step(torch.randn(2, 4))
    assert "matrices of 4 rows" in caplog.text and "at most 3 rows" in caplog.text


class GaussianProcess(torch.nn.Module):
    """A Gaussian process's negative log marginal likelihood of 40 learned points (a kernel of condition ~250)."""

    def __init__(self):
        super().__init__()
        self.points = torch.nn.Parameter(torch.linspace(-1, 1, 40)[:, None] + 0.05 * torch.randn(40, 1))
        self.scale = torch.nn.Linear(3, 1)

    def forward(self, x):
        kernel = torch.exp(-torch.cdist(self.points, self.points) ** 2) + 0.1 * torch.eye(40)
        factor = torch.linalg.cholesky(kernel)
        targets = torch.sin(3 * self.points) * self.scale(x).mean()
        return 0.5 * (targets * torch.cholesky_solve(targets, factor)).sum() + torch.log(torch.diagonal(factor)).sum()


def test_mixed_precision_computes_them_in_float32_as_autocast_does(tmp_path):
    """autocast computes torch's factorisations and solves in float32, so are these, their products included (in
    half they would round the kernel's entries to 2^-11, ~250 times that in the factor of a condition-250 matrix;
    ONNX Runtime's Inverse has no bfloat16 kernel). float16: one step's loss within float32's steps_bound of eager
    autocast's. bfloat16 (whose products ONNX Runtime's CPU provider cannot run, so the graph is only built):
    every Inverse and matrix product of the factorisation and the solves reads float32."""
    torch.manual_seed(2)
    model = GaussianProcess()
    x = torch.randn(6, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        want = float(model(x))
    desc = {"inputs": [("x", ["batch", 3])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, SGDConfig(), options={"graph": {"gradient_source": "torch"},
                                                            "mixed_precision": {"enabled": True}})
    check(relative_error(float(trainer.train_step(x)), want), steps_bound(1, length=BOUND_LENGTH), "loss")
    path = tmp_path / "gradient.onnx"
    trainer = ORTTrainer(model, desc, SGDConfig(), options={
        "graph": {"gradient_source": "torch"}, "mixed_precision": {"enabled": True, "dtype": "bfloat16"},
        "debug": {"graph_save_paths": {"model_with_gradient_graph_path": str(path)}}})
    with pytest.raises(MissingKernelError, match=r"no bfloat16 kernel for \w+"):
        trainer.train_step(x)
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    inverses = [node.input[0] for node in graph.node if node.op_type == "Inverse"]
    assert inverses and all(types.get(name) == onnx.TensorProto.FLOAT for name in inverses)
    # the products in bfloat16 are the model's Linear's forward and its weight's gradient; none of the dozens the
    # factorisation, the solves and their gradients compute
    half = [node.name for node in graph.node if node.op_type in ("MatMul", "Gemm")
            and any(types.get(name) == onnx.TensorProto.BFLOAT16 for name in node.input)]
    assert len(half) == 2, half

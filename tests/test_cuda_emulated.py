"""ort_trainer's CUDA kernels (``ort_trainer/kernels/csrc/*.cu``) on the CPU: compiled by the C++ compiler against an
emulated CUDA runtime (``tests/cuda_emulation/cuda_runtime.h``: a block's threads are host threads, ``__syncthreads``
and the warps' shuffles wait as on a GPU, and a launch CUDA refuses or leaves undefined is the launch's error), each
launcher called as ``ops.cc`` calls it, and checked as its values would be on a GPU: against float64 within bounds
derived from the kernel's float32 arithmetic, bit for bit where the kernel promises it. Every tensor lies between
guard bands (NaN beside an input, so that a read past it shows in the result; a sentinel beside an output, which a
write past it changes), and every output starts as NaN (an element never written shows).

Bounds: u32 = 2⁻²⁴ a rounded float32 operation; a GPU's ``expf``, ``logf``, ``rsqrtf`` are within 2 ulp (4·u32); a
float32 sum of terms in a tree of depth k (each thread's share in order, then shuffles and the block's warps) is
within k·u32 of the sum of the terms' magnitudes; the output's rounding to its dtype u (u32, 2⁻¹¹, 2⁻⁸) of its
magnitude, plus half the subnormals' spacing.
"""

import ctypes
import hashlib
import math
import re
from pathlib import Path

import pytest
import torch

from ort_trainer import kernels

from tolerances import BFLOAT16, FLOAT16, FLOAT32

_CSRC = Path(kernels.__file__).parent / "csrc"
_EMULATION = Path(__file__).parent / "cuda_emulation"
# dtype: (ONNX type, unit roundoff, half the subnormals' spacing)
_TYPES = {torch.float32: (1, FLOAT32, 2.0 ** -150), torch.float16: (10, FLOAT16, 2.0 ** -25),
          torch.bfloat16: (16, BFLOAT16, 2.0 ** -134)}
_IDS = ["float32", "float16", "bfloat16"]
_PAD = 64  # guard elements each side (128 bytes and more: an aligned tensor stays 16-byte aligned)
_SENTINEL = -4096.0  # exact in every dtype here
_LAUNCH = re.compile(r"\b([A-Za-z_]\w*(?:<[^;<>()]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)

P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "gelu_grad": [I, I, P, P, P, L],
    "layer_norm_grad": [I, I, I, I, *[P] * 11, L, L, L],
    "layer_norm_cast": [I, *[P] * 9, L, L, ctypes.c_float],
    "softmax_grad": [I, P, P, P, L, L],
    "safe_softmax": [I, P, P, I, P, P, L, P, L, L],
    "cross_entropy": [I, P, P, P, P, L, L, L, L],
    "cross_entropy_grad": [I, P, P, P, P, P, L, L, L, L],
    "add_half": [I, I, P, P, I, P, L],
    "half_copies": [I, P, P, P, P, I],
    "device_copy": [P, P, L],
    "seeded_dropout": [I, P, P, P, L, P, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_float],
}

needs_compiler = pytest.mark.skipif(kernels._compilers()[1] is None, reason="no C++ compiler here")


def _command(output: Path) -> list[str]:
    """The compiler's command for the emulated library at ``output``: the kernels' sources, their launches rewritten
    to the emulation's, written beside it."""
    sources = []
    for source in sorted(_CSRC.glob("*.cu")):
        text, launches = _LAUNCH.subn(lambda m: f'::emu::launcher({m[1]}, "{m[1]}", {m[2]})(', source.read_text())
        assert launches, f"no launch found in {source.name}"
        sources.append(output.parent / f"{source.stem}.cc")
        sources[-1].write_text(text)
    # -ffp-contract=off: no product and sum fused where the source writes them apart (nvcc fuses some: the bounds
    # hold either way)
    return [kernels._compilers()[1], "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
            "-Wall", "-Wno-unknown-pragmas", "-I", str(_EMULATION), "-I", str(_CSRC), *map(str, sources),
            str(_EMULATION / "launchers.cc"), "-o", str(output)]


@pytest.fixture(scope="module")
def emulated():
    """The emulated library's launchers, ``name(*arguments)`` failing the test with the launch's error; built once
    per run of the sources (the test workers share the build)."""
    digest = hashlib.sha256()
    for source in sorted([*_CSRC.iterdir(), *_EMULATION.iterdir()]):
        if source.suffix in (".h", ".cuh", ".cu", ".cc"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    path = kernels._root() / f"emulated-{digest.hexdigest()[:16]}" / "libemulated.so"
    library = ctypes.CDLL(str(kernels._built(path, _command, "the emulated CUDA kernels")))

    def launcher(name):
        function = getattr(library, f"emu_{name}")
        function.argtypes, function.restype = _SIGNATURES[name], ctypes.c_char_p

        def launch(*arguments):
            error = function(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in arguments))
            if error is not None:
                raise RuntimeError(error.decode())
        return launch

    chunks = library.emu_layer_norm_chunks
    chunks.argtypes, chunks.restype = [L], L
    launchers = {name: launcher(name) for name in _SIGNATURES}
    launchers["layer_norm_chunks"] = chunks
    return launchers


class Memory:
    """Tensors between guard bands; ``check()`` asserts that no output's band changed."""

    def __init__(self):
        self.outputs = []

    @staticmethod
    def _placed(values: torch.Tensor, fill, offset: int):
        flat = torch.full((2 * _PAD + offset + values.numel(),), fill, dtype=values.dtype)
        inside = flat[_PAD + offset:_PAD + offset + values.numel()].view(values.shape)
        inside.copy_(values)
        return flat, inside

    def input(self, values: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``values`` with NaN each side (an integer tensor: a value no index takes), ``offset`` elements off the
        16-byte alignment."""
        fill = float("nan") if values.is_floating_point() else -(2 ** 40)
        return self._placed(values, fill, offset)[1]

    def output(self, shape, dtype=torch.float32) -> torch.Tensor:
        flat, inside = self._placed(torch.full(shape, float("nan"), dtype=dtype), _SENTINEL, 0)
        self.outputs.append((flat, inside.numel()))
        return inside

    def check(self):
        for flat, size in self.outputs:
            bands = torch.cat([flat[:_PAD], flat[-_PAD:]])
            assert (bands == _SENTINEL).all(), f"a write past an output of {size} elements"


def _excess(got: torch.Tensor, want: torch.Tensor, bound) -> float:
    """How far past ``bound`` the worst element of ``got`` lies from ``want`` (≤ 0: within), NaNs where both are."""
    both_nan = got.isnan() & want.isnan()
    excess = ((got.double() - want).abs() - bound).masked_fill(both_nan, -1.0)
    return float(excess.nan_to_num(nan=math.inf).max())


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=_IDS)
@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("layout", ["vectors", "odd-length", "unaligned"])
def test_gelu_grad_is_torchs_within_its_rounding(emulated, dtype, tanh, layout):
    """dy · GELU'(x) over x from -12 to 12 and ±30: 16-byte vectors where every pointer is aligned and the length a
    multiple of a vector's, an element a step otherwise. The arithmetic is the CPU kernel's (gelu.h): within
    u·|dx| + 64·u32·|dy| (test_kernels.py) of float64 ``gelu_backward``."""
    n = {"vectors": 3072, "odd-length": 3071, "unaligned": 3072}[layout]
    x = torch.cat([torch.linspace(-12, 12, n - 2), torch.tensor([30.0, -30.0])]).to(dtype)
    dy = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
    memory = Memory()
    offset = 1 if layout == "unaligned" else 0
    dx = memory.output((n,), dtype)
    emulated["gelu_grad"](_TYPES[dtype][0], tanh, memory.input(dy, offset), memory.input(x, offset), dx, n)
    memory.check()
    want = torch.ops.aten.gelu_backward(dy.double(), x.double(), approximate="tanh" if tanh else "none")
    bound = _TYPES[dtype][1] * want.abs() + _TYPES[dtype][2] + 64 * FLOAT32 * dy.double().abs()
    assert _excess(dx, want, bound) <= 0


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=_IDS)
@pytest.mark.parametrize("cols", [5, 33, 200])
def test_softmax_grad_is_torchs_within_its_float32_sum(emulated, dtype, cols):
    """dx = y · (dy - Σ dy·y) over 84 rows (a warp a row, 8 a block: the last block's last 4 warps have no row) of
    ``cols`` (fewer than a warp's lanes, or several a lane; 200: 4 a lane and step), a zero row among them: against
    float64 ``_softmax_backward_data``. The row's sum is a tree of depth k = ⌈cols/32⌉ + 3 + 5 (a lane's share, up to
    3 more where it takes 4 at a time, then the shuffles) over |dy·y| (and each product's rounding), which dx reads
    times |y|; then y·(dy - sum) rounds twice and the output once."""
    gen = torch.Generator().manual_seed(1)
    y = torch.softmax(torch.randn(84, cols, generator=gen) * 2, -1)
    y[3] = 0.0
    y, dy = y.to(dtype), torch.randn(84, cols, generator=gen).to(dtype)
    memory = Memory()
    dx = memory.output(y.shape, dtype)
    emulated["softmax_grad"](_TYPES[dtype][0], memory.input(dy), memory.input(y), dx, 84, cols)
    memory.check()
    y64, dy64 = y.double(), dy.double()
    want = torch.ops.aten._softmax_backward_data(dy64, y64, -1, torch.float64)
    depth = math.ceil(cols / 32) + 3 + 5 + 1
    total = (dy64 * y64).sum(-1, keepdim=True)
    bound = (_TYPES[dtype][1] * want.abs() + _TYPES[dtype][2]
             + 2 * FLOAT32 * y64.abs() * (dy64.abs() + total.abs())
             + depth * FLOAT32 * y64.abs() * (dy64 * y64).abs().sum(-1, keepdim=True))
    assert _excess(dx, want, bound) <= 0
    assert torch.equal(dx[3], torch.zeros(cols, dtype=dtype))


def _row_broadcast(x_shape, bias_shape):
    """ops.cc's ``row_broadcast``: x's leading dims, the bias's strides along them (0 where it has 1), and along the
    row."""
    dims = [1] * (len(x_shape) - len(bias_shape)) + list(bias_shape)
    strides, stride = [0] * len(dims), 1
    for i in reversed(range(len(dims))):
        strides[i] = 0 if dims[i] == 1 else stride
        stride *= dims[i]
    return (len(x_shape) - 1, torch.tensor(list(x_shape[:-1]), dtype=torch.int64),
            torch.tensor(strides[:-1], dtype=torch.int64), strides[-1])


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=_IDS)
@pytest.mark.parametrize("cols", [33, 300])
@pytest.mark.parametrize("bias_shape", [None, (3, 1, 7, -1), (3, 1, 1, -1), (-1,), (4, 1, 1), (3, 4, 7, -1)],
                         ids=["none", "mask", "padding-mask", "row", "per-head", "whole"])
def test_safe_softmax_is_torchs_and_its_bias_an_add_bit_for_bit(emulated, dtype, cols, bias_shape):
    """Safe softmax over [3, 4, 7, cols] scores with -inf entries, a row of only -inf (zeros) and a NaN (its row
    NaN): against float64 ``_safe_softmax``, y = exp(x - max) / Σ within (u + (k + 10 + |x - max|)·u32)·y: x - max
    rounds once (u32·|x - max| through exp), exp 4·u32, the sum's tree of depth k = ⌈cols/32⌉ + 3 + 5 (as the
    gradient's), 1/sum and the product once each; 300 columns: 4 a lane and step. With a bias (-1: cols), bit for bit
    the kernel's safe softmax of x + bias rounded to the dtype (torch's add), the bias broadcast as ops.cc gives it
    (masks, a row, a head's)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 7, cols, generator=gen) * 4
    x[x > 5] = float("-inf")
    x[0, 0, 0] = float("-inf")
    x[0, 0, 1, 3] = float("nan")
    x = x.to(dtype)
    rows, memory = x.numel() // cols, Memory()
    if bias_shape is None:
        y = memory.output(x.shape, dtype)
        emulated["safe_softmax"](_TYPES[dtype][0], memory.input(x), None, 0, None, None, 0, y, rows, cols)
        memory.check()
        want = torch.ops.aten._safe_softmax(x.double(), -1)
        top = x.double().amax(-1, keepdim=True)
        spread = (x.double() - top).abs().nan_to_num(posinf=0.0)
        depth = math.ceil(cols / 32) + 3 + 5
        bound = (_TYPES[dtype][1] + (depth + 10 + spread) * FLOAT32) * want.abs() + _TYPES[dtype][2]
        assert _excess(y, want, bound) <= 0
        assert torch.equal(y[0, 0, 0], torch.zeros(cols, dtype=dtype)) and y[0, 0, 1].isnan().all()
        return
    shape = tuple(cols if d == -1 else d for d in bias_shape)
    bias = torch.randn(*shape, generator=gen) * 3
    bias[bias > 4] = float("-inf")
    bias.view(-1)[:cols if bias.numel() > cols else 1] = float("-inf")
    bias = bias.to(dtype)
    rank, dims, strides, col_stride = _row_broadcast(x.shape, shape)
    fused, added = memory.output(x.shape, dtype), memory.output(x.shape, dtype)
    emulated["safe_softmax"](_TYPES[dtype][0], memory.input(x), memory.input(bias), rank, dims, strides, col_stride,
                             fused, rows, cols)
    emulated["safe_softmax"](_TYPES[dtype][0], memory.input(x + bias), None, 0, None, None, 0, added, rows, cols)
    memory.check()
    assert torch.equal(fused.isnan(), added.isnan()) and torch.equal(fused.nan_to_num(), added.nan_to_num())
    masked = (x + bias).eq(float("-inf")).all(-1)
    assert masked.any() and not fused[masked].any()  # (x's row of -inf, and where a mask's row is all -inf)


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=_IDS)
@pytest.mark.parametrize("rows, classes, cols", [(37, 101, 101), (37, 101, 128), (5, 600, 640), (3, 50257, 50304)],
                         ids=["rows", "padded-rows", "wider-than-a-block", "gpt2-head"])
def test_cross_entropy_and_its_gradient_are_torchs(emulated, dtype, rows, classes, cols):
    """Each row's loss and log-sum-exp of ``classes`` scores (rows ``cols`` wide: a padded product's, the rest large
    values that would dominate a row if read), a row ignored (ignore_index -7), and dx for a random grad a row, zero
    past ``classes``; GPT-2's padded head among them (each of 512 threads merging ~100 scores). The row's (max, Σ exp)
    merges are a tree of depth k = ⌈classes/512⌉ + 5 + 16, each merge ~7 roundings (an expf, a product, a sum) of a
    term's path, and the shifts x - max it takes, each rounded, add up to at most the row's range 2·max|x|: Σ within
    ε = (7k + 2·max|x|)·u32 relatively, lse = max + log Σ within ε + 4·u32·|log Σ| (logf; |log Σ| ≤ |lse| + max|x|)
    + u32·|lse| (the add), the loss that plus u32·(|lse| + |x[target]|). dx = g·(exp(x - lse) - [c = target]) reads
    that lse: each probability within lse's error + (|x| + |lse|)·u32 (the subtraction) + 6·u32 (expf, the product
    and the difference) relatively, then dx rounds to the dtype."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, classes, generator=gen) * 3).to(dtype)
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[1] = -7
    grad = torch.randn(rows, generator=gen)
    stored = torch.cat([x, torch.full((rows, cols - classes), 100.0, dtype=dtype)], 1)
    memory = Memory()
    losses, lse, dx = memory.output((rows,)), memory.output((rows,)), memory.output((rows, cols), dtype)
    elem = _TYPES[dtype][0]
    x_in, target_in = memory.input(stored), memory.input(target)
    emulated["cross_entropy"](elem, x_in, target_in, losses, lse, rows, cols, classes, -7)
    emulated["cross_entropy_grad"](elem, memory.input(grad), x_in, target_in, memory.input(lse.clone()), dx, rows, cols,
                                   classes, -7)
    memory.check()
    assert not dx[:, classes:].any() and losses[1] == 0 and not dx[1].any()
    x64 = x.double().requires_grad_()
    want_losses = torch.nn.functional.cross_entropy(x64, target, reduction="none", ignore_index=-7)
    want_lse = torch.logsumexp(x64, -1)
    (want_losses * grad.double()).sum().backward()
    k = math.ceil(classes / 512) + 5 + 16
    lse_abs, top = want_lse.detach().abs(), x64.detach().abs().amax(-1)
    picked = x64.detach().gather(1, target.clamp(min=0)[:, None])[:, 0].abs()
    lse_bound = (7 * k + 6 * top + 5 * lse_abs) * FLOAT32
    assert _excess(lse, want_lse.detach(), lse_bound) <= 0
    assert _excess(losses, want_losses.detach(), lse_bound + (lse_abs + picked) * FLOAT32) <= 0
    relative = lse_bound[:, None] + (6 + lse_abs[:, None] + x64.detach().abs()) * FLOAT32
    probabilities = torch.softmax(x64.detach(), -1)
    bound = (_TYPES[dtype][1] * x64.grad.abs() + _TYPES[dtype][2]
             + relative * probabilities * grad.double().abs()[:, None])
    assert _excess(dx[:, :classes], x64.grad, bound) <= 0


@needs_compiler
@pytest.mark.parametrize("cols", [640, 601], ids=["vectors", "scalars"])
def test_cross_entropy_of_rows_torch_cannot_score_is_nan(emulated, cols):
    """A NaN first or last in a row of 600 scores (beyond one block's 512 threads) makes its lse and loss NaN; a row
    of -inf has lse -inf and loss NaN; a target in the padding is out of range (loss NaN) and the padding's gradient
    stays zero: in rows of 640 (4 scores a thread and step) and 601 (one)."""
    x = torch.randn(5, cols)
    x[0, 0] = x[1, 599] = float("nan")
    x[2, :600] = float("-inf")
    target = torch.tensor([3, 4, 5, 610, 7])
    memory = Memory()
    losses, lse, dx = memory.output((5,)), memory.output((5,)), memory.output((5, cols))
    emulated["cross_entropy"](1, memory.input(x), memory.input(target), losses, lse, 5, cols, 600, -100)
    emulated["cross_entropy_grad"](1, memory.input(torch.ones(5)), memory.input(x), memory.input(target),
                                   memory.input(lse.clone()), dx, 5, cols, 600, -100)
    memory.check()
    assert losses[:4].isnan().all() and lse[:2].isnan().all() and lse[2] == float("-inf")
    assert not dx[:, 600:].any() and not dx[4].isnan().any()


def _layer_norm_inputs(rows: int, cols: int, dtype, gamma_dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen) * 3 + 1).to(dtype)
    dy = torch.randn(rows, cols, generator=gen).to(dtype)
    gamma = (torch.randn(cols, generator=gen) + 1).to(gamma_dtype)
    mean = x.double().mean(-1, keepdim=True).to(dtype)
    rstd = (x.double().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().to(dtype)
    return x, dy, gamma, mean, rstd


def _layer_norm_grad(emulated, memory, x, dy, gamma, mean, rstd, residual=None, cast=None):
    """LayerNormGrad's launch as layer_norm_ops.cc makes it: (dx, dgamma, dbeta, partials, dx_cast)."""
    rows, cols = x.shape
    chunks = emulated["layer_norm_chunks"](rows)
    dx, dgamma, dbeta = memory.output(x.shape, x.dtype), memory.output((cols,), gamma.dtype), memory.output(
        (cols,), gamma.dtype)
    partials = memory.output((chunks, 2, cols))
    dx_cast = memory.output(x.shape, cast) if cast is not None else None
    c = _TYPES[cast][0] if cast is not None else _TYPES[dy.dtype][0]
    emulated["layer_norm_grad"](_TYPES[x.dtype][0], _TYPES[dy.dtype][0], c, _TYPES[gamma.dtype][0], memory.input(dy),
                                memory.input(x), memory.input(mean), memory.input(rstd), memory.input(gamma),
                                None if residual is None else memory.input(residual), dx, dx_cast, dgamma, dbeta,
                                partials, rows, cols, chunks)
    return dx, dgamma, dbeta, partials, dx_cast


@needs_compiler
@pytest.mark.parametrize("dtype, gamma_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "float16-weights32", "bfloat16-weights32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows, cols", [(300, 48), (8, 1100), (20, 301)], ids=["300x48", "8x1100", "20x301"])
def test_layer_norm_grad_is_torchs_within_its_float32_sums(emulated, dtype, gamma_dtype, rows, cols):
    """dx, dgamma and dbeta against float64 ``native_layer_norm_backward`` from the same mean and rstd: rows of 48
    (4 columns a thread: 12 of a block of 32) over 3 chunks of 128 rows, of 1100 (4 columns a thread and step, 256
    threads, some with two steps) and of 301 (a column a thread and step: 256 threads, some with two). dx = r·(g -
    mean(g) - xhat·mean(g·xhat)): the row's two sums, trees of depth k = ⌈cols/32⌉ + 10 (a thread's share at most a
    warp's) over |g| and |g·xhat| (g = dy·gamma, xhat = (x - mean)·r, each term ~3 roundings of its own), move dx by
    r·k·u32 times their means; the rest ~6 roundings of |r|·(|g| + |mean(g)| + |xhat·mean(g·xhat)|). dgamma, dbeta:
    float32 sums down the columns, in order within a chunk's 8 lanes, then the lanes, then the chunks: depth rows + 16
    over the terms' magnitudes, then the dtype's rounding. The partial sums over the chunks add up to dgamma and
    dbeta."""
    x, dy, gamma, mean, rstd = _layer_norm_inputs(rows, cols, dtype, gamma_dtype, seed=4)
    memory = Memory()
    dx, dgamma, dbeta, partials, _ = _layer_norm_grad(emulated, memory, x, dy, gamma, mean, rstd)
    memory.check()
    assert partials.shape[0] == math.ceil(rows / 128)
    x64, dy64, g64, m64, r64 = x.double(), dy.double(), gamma.double(), mean.double(), rstd.double()
    want = torch.ops.aten.native_layer_norm_backward(dy64, x64, [cols], m64, r64, g64,
                                                     torch.zeros(cols, dtype=torch.float64), [True, True, True])
    depth = math.ceil(cols / 32) + 10 + 6  # (each sum's terms: up to 4 roundings; the division)
    g, xhat = dy64 * g64, (x64 - m64) * r64
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    sums = g.abs().mean(-1, keepdim=True) + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True)
    _, roundoff, tiny = _TYPES[dtype]
    bound = roundoff * want[0].abs() + tiny + r64.abs() * FLOAT32 * (
        depth * sums + 6 * (g.abs() + g.mean(-1, keepdim=True).abs() + (xhat * mean_gx).abs()))
    assert _excess(dx, want[0], bound) <= 0
    for got, expected, terms in ((dgamma, want[1], (dy64 * xhat).abs()), (dbeta, want[2], dy64.abs())):
        roundoff, tiny = _TYPES[gamma_dtype][1:]
        bound = roundoff * expected.abs() + tiny + (rows + 16 + 3) * FLOAT32 * terms.sum(0)
        assert _excess(got, expected, bound) <= 0
    if gamma_dtype == torch.float32:
        assert torch.allclose(partials.sum(0).double(), torch.stack([dgamma, dbeta]).double(),
                              rtol=0, atol=float(partials.abs().sum() * 4 * FLOAT32))


@needs_compiler
@pytest.mark.parametrize("dy_dtype, cast", [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
                                            (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float16), (torch.float32, torch.bfloat16)],
                         ids=["add", "add-float16", "add-bfloat16", "add-cast-float16", "add-cast-bfloat16",
                              "to-float16", "to-bfloat16"])
def test_layer_norm_grad_add_and_cast_are_the_gradient_then_add_then_cast_bit_for_bit(emulated, dy_dtype, cast):
    """A float32 LayerNorm's gradient with dy of any dtype: plus a residual (LayerNormGradAdd), the sum is the plain
    launch's dx of dy widened plus the residual (torch's one float32 add); cast (LayerNormGradAddCast,
    LayerNormGradTo*), the sum or dx rounded as torch's cast rounds it; dgamma, dbeta and the partial sums the plain
    launch's, bit for bit."""
    x, dy, gamma, mean, rstd = _layer_norm_inputs(160, 48, torch.float32, torch.float32, seed=5)
    dy = dy.to(dy_dtype)
    residual = None if cast is not None and dy_dtype == torch.float32 else torch.randn(160, 48) * 5
    memory = Memory()
    plain = _layer_norm_grad(emulated, memory, x, dy.float(), gamma, mean, rstd)
    fused = _layer_norm_grad(emulated, memory, x, dy, gamma, mean, rstd, residual, cast)
    memory.check()
    expected = plain[0] if residual is None else residual + plain[0]
    assert torch.equal(fused[0], expected)
    assert all(torch.equal(a, b) for a, b in zip(fused[1:4], plain[1:4]))
    if cast is not None:
        assert torch.equal(fused[4], expected.to(cast))


@needs_compiler
def test_layer_norm_grad_of_no_rows_is_zero_sums(emulated):
    """No rows: no dx, and dgamma and dbeta the sums of nothing, zeros (the partial sums cleared first)."""
    memory = Memory()
    dgamma, dbeta, partials = memory.output((48,)), memory.output((48,)), memory.output((1, 2, 48))
    empty = torch.empty(0, 48)
    emulated["layer_norm_grad"](1, 1, 1, 1, empty, empty, empty, empty, memory.input(torch.ones(48)), None, empty,
                                None, dgamma, dbeta, partials, 0, 48, 1)
    memory.check()
    assert not dgamma.any() and not dbeta.any()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("both", [False, True], ids=["To", "With"])
@pytest.mark.parametrize("rows, cols", [(64, 48), (4, 1100), (8, 769)], ids=["64x48", "4x1100", "8x769"])
def test_layer_norm_forward_is_torchs_and_its_residual_sum_an_add_bit_for_bit(emulated, dtype, both, rows, cols):
    """LayerNormTo* / LayerNormWith* of float32 rows (48 and 1100: 4 columns a thread and step, a warp and 256 threads;
    769: a column, 256 threads, three steps some): mean and rstd against float64 ``native_layer_norm`` (the mean a
    tree of depth k = ⌈cols/32⌉ + 10 (a thread's share at most a warp's): within k·u32 of mean|x|;
    the variance's the same over (x - mean)², and the mean's error in it; rsqrtf 4·u32), y = (x - mean)·r·gamma +
    beta within 8·u32 more of |xhat·gamma| + |beta| and rstd's error times |xhat·gamma|, rounded to the dtype; the
    float32 y (With) rounded to the dtype is the half y. AddLayerNorm*: with a half branch, the sum is x + branch
    (torch's float32 add) and every other output bit for bit the launch's of that sum."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, cols, generator=gen) * 3 + 1
    gamma, beta = torch.randn(cols, generator=gen) + 1, torch.randn(cols, generator=gen)
    branch = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    memory = Memory()

    def launch(values, added=None):
        y, mean, rstd = memory.output((rows, cols), dtype), memory.output((rows,)), memory.output((rows,))
        y32 = memory.output((rows, cols)) if both else None
        total = memory.output((rows, cols)) if added is not None else None
        emulated["layer_norm_cast"](_TYPES[dtype][0], memory.input(values), None if added is None else
                                    memory.input(added), total, memory.input(gamma), memory.input(beta), y, y32, mean,
                                    rstd, rows, cols, 1e-3)
        return y, y32, mean, rstd, total

    y, y32, mean, rstd, _ = launch(x)
    memory.check()
    want_y, want_mean, want_rstd = torch.native_layer_norm(x.double(), [cols], gamma.double(), beta.double(), 1e-3)
    depth = math.ceil(cols / 32) + 10 + 1  # (and the division)
    x64 = x.double()
    assert _excess(mean, want_mean[:, 0], depth * FLOAT32 * x64.abs().mean(-1)) <= 0
    # the variance: its tree over (x - mean)², each term's roundings and the mean's error 2·|x - mean|·δmean
    spread = (x64 - want_mean).abs()
    variance_error = FLOAT32 * ((depth + 3) * (spread ** 2).mean(-1) + 2 * depth * x64.abs().mean(-1)
                                * spread.mean(-1))
    rstd_relative = variance_error / (want_rstd[:, 0] ** -2) + 6 * FLOAT32
    assert _excess(rstd, want_rstd[:, 0], rstd_relative * want_rstd[:, 0].abs()) <= 0
    scaled = ((x64 - want_mean) * want_rstd * gamma.double()).abs()
    y_bound = (scaled * rstd_relative[:, None] + depth * FLOAT32 * x64.abs().mean(-1, keepdim=True) * want_rstd
               * gamma.double().abs() + 8 * FLOAT32 * (scaled + beta.double().abs()))
    assert _excess(y, want_y, _TYPES[dtype][1] * want_y.abs() + _TYPES[dtype][2] + y_bound) <= 0
    if both:
        assert _excess(y32, want_y, y_bound) <= 0 and torch.equal(y, y32.to(dtype))
    fused = launch(x, branch)
    plain = launch(x + branch.float())
    memory.check()
    assert torch.equal(fused[4], x + branch.float())
    assert all(torch.equal(a, b) for a, b in zip(fused[:4], plain[:4]) if a is not None)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("sum_dtype", [torch.float32, "half"])
@pytest.mark.parametrize("addends", [1, 3, 10])
@pytest.mark.parametrize("n", [1224, 1221], ids=["vectors", "scalars"])
def test_add_half_is_casts_then_adds_bit_for_bit(emulated, dtype, sum_dtype, addends, n):
    """sum + x1.float() + ... in order, one float32 add each, bit for bit torch's; ten addends take two launches
    (eight at most a launch), the second adding to the first's output; the xs longer than the sum (padded products)
    read over the sum's length; 4 elements a thread and step (a multiple of 4 elements) or one."""
    sum_dtype = dtype if sum_dtype == "half" else sum_dtype
    gen = torch.Generator().manual_seed(7)
    total = (torch.randn(n, generator=gen) * 1e3).to(sum_dtype)
    xs = [(torch.randn(n + 9 * i, generator=gen) * 7).to(dtype) for i in range(addends)]
    expected = total.float()
    for x in xs:
        expected = expected + x[:n].float()
    memory = Memory()
    placed = [memory.input(x) for x in xs]  # (held: the pointers below do not keep them alive)
    pointers = (ctypes.c_void_p * addends)(*(x.data_ptr() for x in placed))
    out = memory.output((n,))
    emulated["add_half"](_TYPES[dtype][0], _TYPES[sum_dtype][0], memory.input(total), pointers, addends, out, n)
    memory.check()
    assert torch.equal(out, expected)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_copies_round_as_casts_do_bit_for_bit(emulated, dtype):
    """70 float32 tensors rounded to ``dtype`` in two launches (64 tensors at most a launch), bit for bit torch's
    cast: values that round to nearest even, overflow to inf, underflow to subnormals and zero, NaN, -0. Sizes: one of
    several blocks' chunks (20000 values), odd ones, an empty one; a tensor one element off the 16-byte alignment (an
    element a step), others 4 elements a step; some padded with zero rows past their values (0, 3 or 37 elements)."""
    gen = torch.Generator().manual_seed(11)
    specials = torch.tensor([65504.0, 65520.0, 1e6, -1e6, 2.0 ** -25, 2.0 ** -26, 1e-30, float("inf"), float("nan"),
                             -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 3.0e38, 1.0 + 2.0 ** -8])
    sizes = [20000, 7, 1, 0, 768, 2304, 3] + [int(s) for s in torch.randint(1, 300, (63,), generator=gen)]
    memory = Memory()
    xs, ys, wants, pads = [], [], [], []
    for k, n in enumerate(sizes):
        x = torch.cat([specials, torch.randn(n, generator=gen) * 100.0])[:n] if k % 3 == 0 else \
            torch.randn(n, generator=gen) * 4.0
        pad = (0, 3, 37)[k % 3]
        xs.append(memory.input(x, offset=1 if k == 4 else 0))
        ys.append(memory.output((n + pad,), dtype))
        wants.append(torch.cat([x.to(dtype), torch.zeros(pad, dtype=dtype)]))
        pads.append(pad)
    count = len(sizes)
    emulated["half_copies"](_TYPES[dtype][0], (P * count)(*(x.data_ptr() for x in xs)),
                            (P * count)(*(y.data_ptr() for y in ys)), (L * count)(*sizes),
                            (L * count)(*(n + pad for n, pad in zip(sizes, pads))), count)
    memory.check()
    for k, (y, want) in enumerate(zip(ys, wants)):
        # bit for bit (-0 stays -0, +0 in the padded rows), NaN where torch's is (its bits are not one pattern: torch
        # writes bfloat16's NaN as 0x7fc0, a GPU's conversion as 0x7fff)
        nan = want.isnan()
        assert torch.equal(y.isnan(), nan), (k, sizes[k])
        assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16)), (k, sizes[k])


@needs_compiler
def test_device_copy_copies_every_byte_and_no_more(emulated):
    """AliasAfter's copy where ONNX Runtime gives y a buffer of its own (ops.cc): x's bytes bit for bit (NaN's payload,
    -0 and subnormals included), nothing written past them (an odd count of bfloat16 values: 2 bytes a value)."""
    gen = torch.Generator().manual_seed(12)
    x = torch.cat([torch.tensor([float("nan"), -0.0, 1e-40, float("-inf")]), torch.randn(997, generator=gen)])
    x = x.to(torch.bfloat16)
    x[0] = torch.tensor(0x7fc1, dtype=torch.int16).view(torch.bfloat16)  # a NaN of another payload than torch's
    memory = Memory()
    y = memory.output(tuple(x.shape), torch.bfloat16)
    emulated["device_copy"](memory.input(x), y, x.numel() * 2)
    memory.check()
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


@needs_compiler
def test_the_emulation_refuses_a_launch_cuda_would(emulated):
    """A grid past CUDA's limits (here 70000 chunks of the column sums: gridDim.y at most 65535) is the launch's
    error, as cudaGetLastError gives it on a GPU; layer_norm_chunks never asks for more than 64."""
    x, dy, gamma, mean, rstd = _layer_norm_inputs(4, 48, torch.float32, torch.float32, seed=8)
    assert emulated["layer_norm_chunks"](10 ** 9) == 64
    with pytest.raises(RuntimeError, match=r"columns_kernel<T, D>: grid \(2, 70000, 1\)"):
        emulated["layer_norm_grad"](1, 1, 1, 1, dy, x, mean, rstd, gamma, None, torch.empty_like(x), None,
                                    torch.empty(48), torch.empty(48), torch.empty(70000, 2, 48), 4, 48, 70000)


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=_IDS)
@pytest.mark.parametrize("layout", ["vectors", "odd-length", "unaligned"])
def test_seeded_dropout_keeps_the_reference_masks_elements_bit_for_bit(emulated, dtype, layout):
    """SeededDropout's kernel (dropout.cu): the mask is the reference Philox's (test_seeded_dropout.py) for this seed
    and node, bit for bit, and y is x · scale rounded once where kept, x · 0 elsewhere (NaN stays NaN), as the CPU
    kernel writes them; four elements a thread as one vector where aligned, one at a time otherwise and for a last
    block of fewer than four; nothing written past y or the mask. The seed is read from (emulated) device memory."""
    from test_seeded_dropout import reference_mask

    n = {"vectors": 4096 + 8, "odd-length": 4099, "unaligned": 1027}[layout]
    seed, stream, ratio = 0x0123456789ABCDEF, 5, 0.1
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3.0)
    x[:2] = torch.tensor([float("nan"), float("-inf")])
    x = x.to(dtype)
    memory = Memory()
    y = memory.output((n,), dtype)
    band = 64  # guard bytes each side of the mask, which the kernel must leave as they are
    mask_memory = torch.full((n + 2 * band,), 0xA5, dtype=torch.uint8)
    mask = mask_memory[band:band + n]
    threshold = round((1.0 - ratio) * 2.0 ** 32)
    scale = float(torch.tensor(1.0) / (1.0 - torch.tensor(ratio)))
    emulated["seeded_dropout"](_TYPES[dtype][0], memory.input(x, offset=1 if layout == "unaligned" else 0), y, mask,
                               n, torch.tensor([seed], dtype=torch.int64), stream, threshold, scale)
    memory.check()
    assert (mask_memory[:band] == 0xA5).all() and (mask_memory[band + n:] == 0xA5).all()
    want_mask = torch.from_numpy(reference_mask(seed, stream, n, ratio))
    assert torch.equal(mask.bool(), want_mask) and int(mask.max()) == 1
    want = (x.float() * torch.where(want_mask, torch.tensor(scale), torch.tensor(0.0))).to(dtype)
    assert torch.equal(y.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(y[finite].float().view(torch.int32), want[finite].float().view(torch.int32))

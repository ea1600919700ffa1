"""ort_trainer's kernel library (``ort_trainer/kernels``): built here with the C++ compiler (and with nvcc where
one is found), registered with ONNX Runtime, its operators' values against float64, and the errors of a machine
that cannot build or load it.

``GeluGrad`` / ``TanhGeluGrad`` compute ``dy · GELU'(x)`` in float32 and round once to the tensors' dtype.
Against float64 (torch's ``gelu_backward`` on the same rounded inputs): the float32 arithmetic is ~10 roundings
and one ``erf``/``exp`` or ``tanh`` (each within 2 ulp), the tanh form's ``(1 - t)(1 + t)`` carrying the tanh's
absolute error into a term up to ~10 times |dy| for |x| ≤ 12 (measured at most 9·u32·|dy|): bound 64·u32·|dy|.
In float16 and bfloat16 the one rounding of the output adds u·|dx| (u = 2⁻¹¹, 2⁻⁸), or half the subnormals'
spacing where dx is below the normal range (2⁻²⁵ in float16; bfloat16's are far below any value here).
"""

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import kernels

from tolerances import BFLOAT16, FLOAT16, FLOAT32

# dtype: (ONNX type, unit roundoff, half the subnormals' spacing)
_TYPES = {torch.float32: (TensorProto.FLOAT, FLOAT32, 2.0 ** -150),
          torch.float16: (TensorProto.FLOAT16, FLOAT16, 2.0 ** -25),
          torch.bfloat16: (TensorProto.BFLOAT16, BFLOAT16, 2.0 ** -134)}
ARITHMETIC_BOUND = 64 * FLOAT32

needs_compiler = pytest.mark.skipif(kernels._compilers() == (None, None), reason="no C++ compiler or nvcc here")


@pytest.fixture(scope="module")
def cpu_library() -> Path:
    """The C++ compiler's build (no CUDA kernels), into the kernels folder the whole run shares (conftest.py)."""
    return kernels.build(cuda=False)


_INT64 = TensorProto.INT64


def _onnx_type(tensor: torch.Tensor) -> int:
    return _INT64 if tensor.dtype == torch.int64 else _TYPES[tensor.dtype][0]


def _session(library: Path, op: str, inputs: dict, outputs: dict, registered: ort.SessionOptions | None = None,
             provider: str = "CPUExecutionProvider", **attributes):
    """A session (on ``provider``) of one ``op`` node of the kernels' domain, its inputs and outputs ``{name: ONNX
    type}``, the library registered with new options (or with ``registered``, already done)."""
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), list(outputs), domain=kernels.DOMAIN, **attributes)], "kernel",
        [helper.make_tensor_value_info(name, elem, None) for name, elem in inputs.items()],
        [helper.make_tensor_value_info(name, elem, None) for name, elem in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)], ir_version=10)
    options = registered or ort.SessionOptions()
    if registered is None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=[provider])


def _library_on(device: str, cpu_library: Path) -> tuple[Path, str]:
    """The library and provider of a session on ``device``: the CPU build, or on CUDA the library with CUDA
    kernels (``make gpu-check``)."""
    return (cpu_library, "CPUExecutionProvider") if device == "cpu" else (kernels.library(), "CUDAExecutionProvider")


def _bound_run(session, feeds: dict, outputs: dict) -> dict:
    """One run with the tensors bound in place (numpy has no bfloat16), where they lie (CPU or CUDA), writing into
    ``outputs``."""
    if any(tensor.is_cuda for tensor in feeds.values()):
        torch.cuda.synchronize()  # (torch's copies to the GPU done before ONNX Runtime's stream reads them)
    binding = session.io_binding()
    for name, tensor in feeds.items():
        binding.bind_input(name, tensor.device.type, tensor.device.index or 0, _onnx_type(tensor), list(tensor.shape),
                           tensor.data_ptr())
    for name, tensor in outputs.items():
        binding.bind_output(name, tensor.device.type, tensor.device.index or 0, _onnx_type(tensor),
                            list(tensor.shape), tensor.data_ptr())
    session.run_with_iobinding(binding)
    return outputs


def _gradient_session(library: Path, op: str, elem: int, registered: ort.SessionOptions | None = None):
    """A session of ``op(dy, x) -> dx`` (GeluGrad, TanhGeluGrad, SoftmaxGrad: y bound as ``x``)."""
    return _session(library, op, {"dy": elem, "x": elem}, {"dx": elem}, registered)


def _run(session, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _bound_run(session, {"dy": dy, "x": x}, {"dx": torch.empty_like(x)})["dx"]


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("approximate, op", [("none", "GeluGrad"), ("tanh", "TanhGeluGrad")])
def test_the_operators_compute_gelus_derivative_within_one_rounding(cpu_library, approximate, op, dtype,
                                                                    record_property):
    """Every x from -12 to 12 in steps of 1/128, and ±30, ±300, 0 and tiny values, times random dy: within the
    bound of float64 ``gelu_backward`` on the same rounded values; a [3, 5, 7] tensor keeps its shape."""
    grid = np.concatenate([np.arange(-12 * 128, 12 * 128 + 1) / 128, [0.0, -0.0, 1e-6, -1e-6, 30, -30, 300, -300]])
    x = torch.tensor(grid, dtype=dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = _run(_gradient_session(cpu_library, op, _TYPES[dtype][0]), dy, x)
    want = torch.ops.aten.gelu_backward(dy.double(), x.double(), approximate=approximate)
    bound = _TYPES[dtype][1] * want.abs() + _TYPES[dtype][2] + ARITHMETIC_BOUND * dy.double().abs()
    excess = (out.double() - want).abs() - bound
    assert excess.max() <= 0, (float(excess.max()), float(x[excess.argmax()]))
    record_property("error / |dy|", float(((out.double() - want).abs() / dy.double().abs().clamp_min(1e-30)).max()))
    shaped = torch.randn(3, 5, 7).to(dtype)
    assert _run(_gradient_session(cpu_library, op, _TYPES[dtype][0]), shaped, shaped).shape == (3, 5, 7)
    # 2¹⁸ elements: shared among the cores (shares of at least 2¹⁶), the same bound
    x = (torch.randn(4, 2 ** 16, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    dy = torch.randn(4, 2 ** 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = _run(_gradient_session(cpu_library, op, _TYPES[dtype][0]), dy, x)
    want = torch.ops.aten.gelu_backward(dy.double(), x.double(), approximate=approximate)
    bound = _TYPES[dtype][1] * want.abs() + _TYPES[dtype][2] + ARITHMETIC_BOUND * dy.double().abs()
    assert ((out.double() - want).abs() - bound).max() <= 0


@needs_compiler
def test_a_shape_mismatch_fails_the_run_with_the_operators_name(cpu_library):
    """An error inside the kernel reaches the session as a failed run that names the operator."""
    session = _gradient_session(cpu_library, "GeluGrad", TensorProto.FLOAT)
    with pytest.raises(Exception, match="GeluGrad: dy and x must have one shape"):
        session.run(None, {"dy": np.ones(3, np.float32), "x": np.ones(4, np.float32)})


@needs_compiler
def test_register_once_per_options_and_refuse_a_library_without_cuda_kernels_for_a_gpu(cpu_library, monkeypatch):
    """``register`` adds the library to an options object once (a second registration of the domain would fail
    the session); for a GPU session a library built without nvcc is refused, the message naming the fixes."""
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(cpu_library))
    kernels.library.cache_clear()
    try:
        assert not kernels.has_cuda_kernels(cpu_library)
        options = ort.SessionOptions()
        kernels.register(options)
        kernels.register(options)
        out = _run(_gradient_session(cpu_library, "TanhGeluGrad", TensorProto.FLOAT, registered=options),
                   torch.ones(4), torch.zeros(4))
        assert torch.equal(out, torch.full((4,), 0.5))  # GELU'(0) = 1/2
        with pytest.raises(kernels.KernelsUnavailable, match="no CUDA kernels.*nvcc.*fused_gelu_gradient"):
            kernels.register(ort.SessionOptions(), cuda=True)
    finally:
        kernels.library.cache_clear()


def test_without_a_compiler_or_with_a_missing_library_the_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_compilers", lambda: (None, None))
    with pytest.raises(kernels.KernelsUnavailable, match="no C\\+\\+ compiler.*ORT_TRAINER_KERNELS_LIBRARY"):
        kernels.build(tmp_path)
    with pytest.raises(kernels.KernelsUnavailable, match="needs nvcc"):
        kernels.build(tmp_path, cuda=True)
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(tmp_path / "missing.so"))
    kernels.library.cache_clear()
    try:
        with pytest.raises(kernels.KernelsUnavailable, match="not a file.*make kernels"):
            kernels.library()
    finally:
        kernels.library.cache_clear()


@pytest.mark.skipif(kernels._compilers()[0] is None, reason="no nvcc here")
def test_nvcc_builds_cuda_kernels_that_leave_the_cpu_ones_as_they_are():
    """With nvcc the library holds the CUDA kernels (compute capability 8.0 and 9.0, PTX for later) beside the
    CPU ones, links the CUDA runtime and C++'s own in (it loads on a GPU machine it was not built on), and a CPU
    session runs its CPU kernels as the C++ build's do. (The build the other tests use where nvcc is found.)"""
    path = kernels.build(cuda=True)
    assert kernels.has_cuda_kernels(path)
    if shutil.which("ldd"):
        import subprocess

        linked = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout
        assert "libcudart" not in linked and "libstdc++" not in linked, linked
    x = torch.linspace(-6, 6, 97)
    out = _run(_gradient_session(path, "GeluGrad", TensorProto.FLOAT), torch.ones_like(x), x)
    want = torch.ops.aten.gelu_backward(torch.ones_like(x).double(), x.double())
    assert (out.double() - want).abs().max() <= ARITHMETIC_BOUND


# LayerNormGrad's CPU kernel computes in float64 from the tensors' values and rounds each result once to float32,
# then to the output's dtype: within u32 + u of each value (u: the output dtype's), plus half the subnormals'
# spacing; the float32 CUDA kernel's sums are checked through training steps under make gpu-check
# (test_fused_kernels.py)
@needs_compiler
@pytest.mark.parametrize("dtype, gamma_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "float16-weights32", "bfloat16-weights32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [(6, 5), (64, 64)], ids=["30-rows", "4096-rows"])
def test_layer_norm_grad_computes_torchs_backward(cpu_library, dtype, gamma_dtype, rows):
    """dx, dgamma and dbeta of rows of 48 (30, or 4096: shared among the cores, each share's column sums added
    in order) against float64 ``native_layer_norm_backward`` from the same mean and rstd; the fourth output, the
    partial sums, holds dgamma and dbeta's float32 values (one chunk)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(*rows, 48, generator=gen) * 3 + 1).to(dtype)
    dy = torch.randn(*rows, 48, generator=gen).to(dtype)
    gamma = (torch.randn(48, generator=gen) + 1).to(gamma_dtype)
    mean = x.double().mean(-1, keepdim=True).to(dtype)
    rstd = (x.double().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().to(dtype)
    t, g = _TYPES[dtype][0], _TYPES[gamma_dtype][0]
    session = _session(cpu_library, "LayerNormGrad", {"dy": t, "x": t, "mean": t, "rstd": t, "gamma": g},
                       {"dx": t, "dgamma": g, "dbeta": g, "partials": TensorProto.FLOAT})
    outs = _bound_run(session, {"dy": dy, "x": x, "mean": mean, "rstd": rstd, "gamma": gamma},
                      {"dx": torch.empty_like(x), "dgamma": torch.empty_like(gamma), "dbeta": torch.empty_like(gamma),
                       "partials": torch.empty(1, 2, 48)})
    want = torch.ops.aten.native_layer_norm_backward(dy.double(), x.double(), [48], mean.double(), rstd.double(),
                                                     gamma.double(), torch.zeros(48, dtype=torch.float64),
                                                     [True, True, True])
    for name, value, expected in zip(("dx", "dgamma", "dbeta"), (outs["dx"], outs["dgamma"], outs["dbeta"]), want):
        roundoff, tiny = _TYPES[value.dtype][1], _TYPES[value.dtype][2]
        bound = (roundoff + FLOAT32) * expected.abs() + tiny
        excess = (value.double() - expected).abs() - bound
        assert excess.max() <= 0, (name, float(excess.max()))
    assert torch.equal(outs["partials"][0, 0], outs["dgamma"].float()) or gamma_dtype != torch.float32
    assert torch.equal(outs["partials"][0, 1], outs["dbeta"].float()) or gamma_dtype != torch.float32


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_layer_norm_grad_of_an_empty_batch_is_zero_sums(cpu_library, device):
    """No rows: dgamma and dbeta are the sums of nothing, zeros, on either device (ONNX Runtime copies the feeds to
    the device and the outputs back: a tensor of no elements has no address to bind)."""
    library, provider = _library_on(device, cpu_library)
    f32 = TensorProto.FLOAT
    session = _session(library, "LayerNormGrad", {"dy": f32, "x": f32, "mean": f32, "rstd": f32, "gamma": f32},
                       {"dx": f32, "dgamma": f32, "dbeta": f32, "partials": f32}, provider=provider)
    empty, column = np.zeros((0, 48), np.float32), np.zeros((0, 1), np.float32)
    dx, dgamma, dbeta, _ = session.run(None, {"dy": empty, "x": empty, "mean": column, "rstd": column,
                                              "gamma": np.ones(48, np.float32)})
    assert dx.shape == (0, 48) and dgamma.shape == dbeta.shape == (48,)
    assert not dgamma.any() and not dbeta.any()


@needs_compiler
@pytest.mark.parametrize("dy_dtype, cast", [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
                                            (torch.float16, True), (torch.bfloat16, True)],
                         ids=["float32", "float16", "bfloat16", "float16-cast", "bfloat16-cast"])
def test_layer_norm_grad_add_is_the_gradient_then_add_then_cast_bit_for_bit(cpu_library, dy_dtype, cast):
    """LayerNormGradAdd(Cast) of a [4, 16, 48] float32 LayerNorm, dy as a [64, 48] product of any dtype: the sum is
    LayerNormGrad's dx of dy widened to float32 plus the residual (torch's one float32 add), the cast that sum
    rounded to dy's dtype, dgamma, dbeta and the partial sums LayerNormGrad's, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 16, 48, generator=gen) * 3 + 1
    dy = torch.randn(64, 48, generator=gen).to(dy_dtype)
    residual = torch.randn(4, 16, 48, generator=gen) * 5
    gamma = torch.randn(48, generator=gen) + 1
    mean = x.double().mean(-1, keepdim=True).float()
    rstd = (x.double().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float()
    f32, d = TensorProto.FLOAT, _TYPES[dy_dtype][0]
    statistics = {"x": x, "mean": mean, "rstd": rstd, "gamma": gamma}
    sums = {"dgamma": torch.empty(48), "dbeta": torch.empty(48), "partials": torch.empty(1, 2, 48)}
    plain = _bound_run(_session(cpu_library, "LayerNormGrad", {"dy": f32, "x": f32, "mean": f32, "rstd": f32,
                                                                "gamma": f32},
                                {"dx": f32, "dgamma": f32, "dbeta": f32, "partials": f32}),
                       {"dy": dy.float().reshape(x.shape), **statistics},
                       {"dx": torch.empty_like(x), **{k: v.clone() for k, v in sums.items()}})
    op, casts = ("LayerNormGradAddCast", {"sum_cast": d}) if cast else ("LayerNormGradAdd", {})
    fused = _bound_run(_session(cpu_library, op, {"dy": d, "x": f32, "mean": f32, "rstd": f32, "gamma": f32,
                                                  "residual": f32},
                                {"sum": f32, "dgamma": f32, "dbeta": f32, "partials": f32, **casts}),
                       {"dy": dy, **statistics, "residual": residual},
                       {"sum": torch.empty_like(x), **{k: v.clone() for k, v in sums.items()},
                        **({"sum_cast": torch.empty(4, 16, 48, dtype=dy_dtype)} if cast else {})})
    assert torch.equal(fused["sum"], residual + plain["dx"])
    assert all(torch.equal(fused[name], plain[name]) for name in sums)
    if cast:
        assert torch.equal(fused["sum_cast"], fused["sum"].to(dy_dtype))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_layer_norm_grad_cast_is_the_gradient_then_its_cast_bit_for_bit(cpu_library, dtype):
    """LayerNormGradToFloat16 / LayerNormGradToBFloat16 of float32 tensors: LayerNormGrad's four outputs bit for
    bit, and dx rounded to the half dtype as torch's cast rounds it."""
    gen = torch.Generator().manual_seed(6)
    x, dy = torch.randn(64, 48, generator=gen) * 3 + 1, torch.randn(64, 48, generator=gen)
    gamma = torch.randn(48, generator=gen) + 1
    feeds = {"dy": dy, "x": x, "mean": x.double().mean(-1, keepdim=True).float(),
             "rstd": (x.double().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt().float(), "gamma": gamma}
    f32 = TensorProto.FLOAT
    outputs = {"dx": torch.empty_like(x), "dgamma": torch.empty(48), "dbeta": torch.empty(48),
               "partials": torch.empty(1, 2, 48)}
    plain = _bound_run(_session(cpu_library, "LayerNormGrad", dict.fromkeys(feeds, f32), dict.fromkeys(outputs, f32)),
                       feeds, {k: v.clone() for k, v in outputs.items()})
    op = "LayerNormGradToFloat16" if dtype == torch.float16 else "LayerNormGradToBFloat16"
    fused = _bound_run(_session(cpu_library, op, dict.fromkeys(feeds, f32),
                                {**dict.fromkeys(outputs, f32), "dx_cast": _TYPES[dtype][0]}),
                       feeds, {**{k: v.clone() for k, v in outputs.items()},
                               "dx_cast": torch.empty(64, 48, dtype=dtype)})
    assert all(torch.equal(fused[name], plain[name]) for name in outputs)
    assert torch.equal(fused["dx_cast"], plain["dx"].to(dtype))


# LayerNormTo*'s CPU kernel: float64 statistics rounded once to float32 (within u32 of float64's), y computed in
# float64, rounded to float32 and then to the half dtype: within u + u32 of float64's |y| (4 u32: margin), plus half
# the subnormals' spacing;
# LayerNormWith*'s float32 y: within u32 (4 u32: margin), its half y the rounding of that float32 y
@needs_compiler
@pytest.mark.parametrize("both", [False, True], ids=["To", "With"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_layer_norm_to_half_computes_torchs_layer_norm(cpu_library, dtype, both):
    """LayerNormToFloat16 / LayerNormToBFloat16 of [4, 16, 48] float32 rows against float64 ``native_layer_norm``
    with the attribute epsilon: y in the half dtype, mean and rstd float32 of shape [4, 16, 1] (ONNX's).
    LayerNormWithFloat16 / ...BFloat16: y in float32 first, the half y last, bit for bit a cast of the float32 y."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 16, 48, generator=gen) * 3 + 1
    gamma, beta = torch.randn(48, generator=gen) + 1, torch.randn(48, generator=gen)
    name = "Float16" if dtype == torch.float16 else "BFloat16"
    f32 = TensorProto.FLOAT
    outputs = {"y": _TYPES[dtype][0], "mean": f32, "rstd": f32}
    buffers = {"y": torch.empty(4, 16, 48, dtype=dtype), "mean": torch.empty(4, 16, 1), "rstd": torch.empty(4, 16, 1)}
    if both:
        outputs = {"y32": f32, "mean": f32, "rstd": f32, "y": _TYPES[dtype][0]}
        buffers["y32"] = torch.empty(4, 16, 48)
    session = _session(cpu_library, f"LayerNorm{'With' if both else 'To'}{name}",
                       {"x": f32, "gamma": f32, "beta": f32}, outputs, epsilon=1e-3)
    outs = _bound_run(session, {"x": x, "gamma": gamma, "beta": beta}, buffers)
    y, mean, rstd = torch.native_layer_norm(x.double(), [48], gamma.double(), beta.double(), 1e-3)
    roundoff, tiny = _TYPES[dtype][1], _TYPES[dtype][2]
    assert ((outs["y"].double() - y).abs() - ((roundoff + 4 * FLOAT32) * y.abs() + tiny)).max() <= 0
    assert ((outs["mean"].double() - mean).abs() <= FLOAT32 * mean.abs()).all()
    assert ((outs["rstd"].double() - rstd).abs() <= FLOAT32 * rstd.abs()).all()
    if both:
        assert ((outs["y32"].double() - y).abs() <= 4 * FLOAT32 * y.abs()).all()
        assert torch.equal(outs["y"], outs["y32"].to(dtype))


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("both", [False, True], ids=["To", "With"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_add_layer_norm_is_the_layer_norm_of_the_residual_sum(cpu_library, device, dtype, both):
    """AddLayerNormTo* / AddLayerNormWith*(residual, x, gamma, beta): the sum output is ``residual + x.float()``
    bit for bit (one float32 add, as Add and Cast), and every other output bit for bit what LayerNormTo* /
    LayerNormWith* (the same kernel's arithmetic) writes for that sum; on CUDA (``make gpu-check``) its kernel."""
    gen = torch.Generator().manual_seed(11)
    residual = torch.randn(4, 16, 48, generator=gen) * 3 + 1
    x = (torch.randn(4, 16, 48, generator=gen) * 2).to(dtype)
    gamma, beta = torch.randn(48, generator=gen) + 1, torch.randn(48, generator=gen)
    name, f32, half = "Float16" if dtype == torch.float16 else "BFloat16", TensorProto.FLOAT, _TYPES[dtype][0]
    outputs = {"y32": f32, "mean": f32, "rstd": f32, "y": half} if both else {"y": half, "mean": f32, "rstd": f32}
    shapes = {"y32": (4, 16, 48), "y": (4, 16, 48), "mean": (4, 16, 1), "rstd": (4, 16, 1)}

    def buffers(names):
        return {n: torch.empty(shapes.get(n, (4, 16, 48)), dtype=dtype if n == "y" else torch.float32, device=device)
                for n in names}

    library, provider = _library_on(device, cpu_library)
    form = "With" if both else "To"
    fused = _session(library, f"AddLayerNorm{form}{name}", {"residual": f32, "x": half, "gamma": f32, "beta": f32},
                     {**outputs, "sum": f32}, provider=provider, epsilon=1e-3)
    plain = _session(library, f"LayerNorm{form}{name}", {"x": f32, "gamma": f32, "beta": f32}, outputs,
                     provider=provider, epsilon=1e-3)
    feeds = {"residual": residual, "x": x, "gamma": gamma, "beta": beta}
    feeds = {k: v.to(device) for k, v in feeds.items()}
    got = _bound_run(fused, feeds, buffers([*outputs, "sum"]))
    total = residual + x.float()
    assert torch.equal(got["sum"].cpu(), total)
    want = _bound_run(plain, {"x": total.to(device), "gamma": feeds["gamma"], "beta": feeds["beta"]},
                      buffers(outputs))
    assert all(torch.equal(got[n], want[n]) for n in outputs), [n for n in outputs if not torch.equal(got[n], want[n])]


@needs_compiler
def test_add_layer_norm_refuses_a_residual_of_another_shape(cpu_library):
    f32 = TensorProto.FLOAT
    session = _session(cpu_library, "AddLayerNormToFloat16", {"residual": f32, "x": TensorProto.FLOAT16,
                                                              "gamma": f32, "beta": f32},
                       {"y": TensorProto.FLOAT16, "mean": f32, "rstd": f32, "sum": f32})
    with pytest.raises(Exception, match="AddLayerNormToFloat16: residual and x must have one shape"):
        session.run(None, {"residual": np.zeros((2, 4), np.float32), "x": np.zeros((1, 4), np.float16),
                           "gamma": np.ones(4, np.float32), "beta": np.zeros(4, np.float32)})


@needs_compiler
def test_layer_norm_grad_add_refuses_a_residual_of_another_shape(cpu_library):
    f32 = TensorProto.FLOAT
    session = _session(cpu_library, "LayerNormGradAdd", {n: f32 for n in ("dy", "x", "mean", "rstd", "gamma",
                                                                          "residual")},
                       {"sum": f32, "dgamma": f32, "dbeta": f32, "partials": f32})
    zeros = {"dy": np.zeros((2, 4), np.float32), "x": np.zeros((2, 4), np.float32), "mean": np.zeros(2, np.float32),
             "rstd": np.ones(2, np.float32), "gamma": np.ones(4, np.float32), "residual": np.zeros((1, 4), np.float32)}
    with pytest.raises(Exception, match="LayerNormGradAdd: dy and x must have one shape .*the residual x's shape"):
        session.run(None, zeros)


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=["float32", "float16", "bfloat16"])
def test_softmax_grad_computes_torchs_backward(cpu_library, dtype):
    """dx of [3, 4, 7, 33] softmax outputs over the last axis (rows with a zero, as the safe softmax writes for a
    masked row) against float64 ``_softmax_backward_data`` on the same rounded values: the row's sum in float64,
    dx rounded once to float32 and once to the dtype, within (u32 + u)·|dx| plus half the subnormals' spacing and
    the float32 rounding of y·(dy - sum) (u32·|y|·(|dy| + |sum|))."""
    gen = torch.Generator().manual_seed(4)
    y = torch.softmax(torch.randn(3, 4, 7, 33, generator=gen) * 2, -1)
    y[0, 0, 0] = 0.0
    y, dy = y.to(dtype), torch.randn(3, 4, 7, 33, generator=gen).to(dtype)
    out = _run(_gradient_session(cpu_library, "SoftmaxGrad", _TYPES[dtype][0]), dy, y)  # (y bound as the input "x")
    want = torch.ops.aten._softmax_backward_data(dy.double(), y.double(), -1, torch.float64)
    total = (dy.double() * y.double()).sum(-1, keepdim=True)
    bound = ((_TYPES[dtype][1] + FLOAT32) * want.abs() + _TYPES[dtype][2]
             + FLOAT32 * y.double().abs() * (dy.double().abs() + total.abs()))
    excess = (out.double() - want).abs() - bound
    assert excess.max() <= 0, float(excess.max())
    assert torch.equal(out[0, 0, 0], torch.zeros(33, dtype=dtype))



@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=["float32", "float16", "bfloat16"])
def test_safe_softmax_computes_torchs_safe_softmax(cpu_library, dtype):
    """[3, 4, 7, 33] scores with -inf entries, a row of only -inf (zeros out, as torch's ``_safe_softmax``) and a
    row with a NaN (NaN out): against float64 ``_safe_softmax`` of the same rounded values, within (u32 + u)·|y|
    plus half the subnormals' spacing (float64 arithmetic, then two roundings)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 7, 33, generator=gen) * 4
    x[x > 5] = float("-inf")
    x[0, 0, 0] = float("-inf")
    x[0, 0, 1, 3] = float("nan")
    x = x.to(dtype)
    elem = _TYPES[dtype][0]
    out = _bound_run(_session(cpu_library, "SafeSoftmax", {"x": elem}, {"y": elem}), {"x": x},
                     {"y": torch.empty_like(x)})["y"]
    want = torch.ops.aten._safe_softmax(x.double(), -1)
    assert torch.equal(out[0, 0, 0], torch.zeros(33, dtype=dtype)) and out[0, 0, 1].isnan().all()
    finite = ~want.isnan()
    bound = (_TYPES[dtype][1] + FLOAT32) * want.abs() + _TYPES[dtype][2]
    excess = (out.double() - want).abs()[finite] - bound[finite]
    assert excess.max() <= 0, float(excess.max())


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bias_shape", [(3, 1, 7, 33), (3, 1, 1, 33), (33,), (4, 1, 1), (3, 4, 7, 33)],
                         ids=["mask", "padding-mask", "row", "per-head", "whole"])
def test_bias_safe_softmax_is_an_add_then_safe_softmax_bit_for_bit(cpu_library, dtype, bias_shape):
    """``BiasSafeSoftmax(x, bias)`` over [3, 4, 7, 33] scores, the bias broadcast (attention's masks, lower ranks):
    bit-equal to ``SafeSoftmax`` of ``x + bias`` rounded to the dtype (torch's add, one rounding, as ONNX's Add),
    -inf entries, a row the bias fills with -inf (zeros out) and a NaN included."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 4, 7, 33, generator=gen) * 4).to(dtype)
    bias = torch.randn(*bias_shape, generator=gen) * 3
    bias[bias > 4] = float("-inf")
    # -inf over the bias's first row (x's rows reading it give zeros); the first value of a single-row bias
    bias.view(-1)[:33 if bias.numel() > 33 else 1] = float("-inf")
    x[0, 1, 2, 5] = float("nan")
    bias = bias.to(dtype)
    elem = _TYPES[dtype][0]
    fused = _bound_run(_session(cpu_library, "BiasSafeSoftmax", {"x": elem, "bias": elem}, {"y": elem}),
                       {"x": x, "bias": bias}, {"y": torch.empty_like(x)})["y"]
    added = _bound_run(_session(cpu_library, "SafeSoftmax", {"x": elem}, {"y": elem}), {"x": x + bias},
                       {"y": torch.empty_like(x)})["y"]
    assert torch.equal(fused.isnan(), added.isnan()) and fused.isnan().any()
    assert torch.equal(fused.nan_to_num(), added.nan_to_num())
    masked = (x + bias).eq(float("-inf")).all(-1)
    assert masked.any() == (bias.dim() > 1) and not fused[masked].any()


@needs_compiler
def test_bias_safe_softmax_refuses_a_bias_that_does_not_broadcast(cpu_library):
    session = _session(cpu_library, "BiasSafeSoftmax", {"x": TensorProto.FLOAT, "bias": TensorProto.FLOAT},
                       {"y": TensorProto.FLOAT})
    with pytest.raises(Exception, match=r"BiasSafeSoftmax: bias \[2, 33\] does not broadcast to x \[3, 4, 7, 33\]"):
        session.run(None, {"x": np.ones((3, 4, 7, 33), np.float32), "bias": np.ones((2, 33), np.float32)})


@needs_compiler
@pytest.mark.parametrize("dtype", list(_TYPES), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded-rows"])
def test_cross_entropy_and_its_gradient_compute_torchs(cpu_library, dtype, padded):
    """Each row's loss and log-sum-exp of [37, 101] scores (a row ignored, ignore_index -7) against float64
    ``cross_entropy(reduction="none")`` and ``logsumexp`` of the same rounded scores, and dx for a random grad of
    each row against float64 autograd: float64 arithmetic rounded once to float32 (losses, lse: within u32 of
    lse + |x[target]| for cancellation), then dx once more to the dtype (within (u32 + u)·|dx|, plus a u32 of the
    row's grad times (1 + |lse|): the gradient reads lse as stored, in float32, off by u32·|lse|, which moves every
    probability exp(x - lse) by as much relatively; plus half the subnormals' spacing). Padded: the scores are the
    first 101 of rows 128 wide (``classes=101``, an aligned product's), the rest large values that would dominate
    every row if read; dx is 128 wide, exactly zero past 101."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 101, generator=gen) * 3).to(dtype)
    target = torch.randint(0, 101, (37,), generator=gen)
    target[5] = -7
    grad = torch.randn(37, generator=gen)
    elem, f32 = _TYPES[dtype][0], TensorProto.FLOAT
    stored, attributes = x, {"ignore_index": -7}
    if padded:
        stored = torch.cat([x, torch.full((37, 27), 100.0, dtype=dtype)], 1)
        attributes["classes"] = 101
    forward = _session(cpu_library, "CrossEntropy", {"x": elem, "target": _INT64}, {"losses": f32, "lse": f32},
                       **attributes)
    outs = _bound_run(forward, {"x": stored, "target": target}, {"losses": torch.empty(37), "lse": torch.empty(37)})
    backward = _session(cpu_library, "CrossEntropyGrad", {"grad": f32, "x": elem, "target": _INT64, "lse": f32},
                        {"dx": elem}, **attributes)
    outs.update(_bound_run(backward, {"grad": grad, "x": stored, "target": target, "lse": outs["lse"]},
                           {"dx": torch.full_like(stored, float("nan"))}))
    if padded:
        assert torch.equal(outs["dx"][:, 101:], torch.zeros(37, 27, dtype=dtype))
        outs["dx"] = outs["dx"][:, :101]
    x64 = x.double().requires_grad_()
    losses = torch.nn.functional.cross_entropy(x64, target, reduction="none", ignore_index=-7)
    lse = torch.logsumexp(x64, -1)
    (losses * grad.double()).sum().backward()
    picked = x64.detach().gather(1, target.clamp(min=0)[:, None])[:, 0].abs()
    assert ((outs["losses"].double() - losses.detach()).abs() <= FLOAT32 * (lse.detach().abs() + picked) + 1e-30).all()
    assert ((outs["lse"].double() - lse.detach()).abs() <= FLOAT32 * lse.detach().abs()).all()
    assert outs["losses"][5] == 0 and torch.equal(outs["dx"][5], torch.zeros(101, dtype=dtype))
    want = x64.grad
    bound = ((_TYPES[dtype][1] + FLOAT32) * want.abs()
             + FLOAT32 * grad.double().abs()[:, None] * (1 + lse.detach().abs()[:, None]) + _TYPES[dtype][2])
    excess = (outs["dx"].double() - want).abs() - bound
    assert excess.max() <= 0, float(excess.max())


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cross_entropy_of_rows_torch_cannot_score_is_nan_as_torchs(cpu_library, device):
    """Rows of 600 scores in rows 640 wide (``classes=600``; more than one CUDA block's 512 threads, so a thread
    merges several): a NaN first (the first value a thread merges) or last gives lse and loss NaN; a row of -inf
    gives lse -inf (torch's ``logsumexp``) and loss NaN (torch's ``cross_entropy``); a target in the padding is out of
    range: loss NaN, and the padding's gradient stays zeros. The last row is finite: loss as torch's."""
    library, provider = _library_on(device, cpu_library)
    x = torch.randn(5, 640)
    x[0, 0] = x[1, 599] = float("nan")
    x[2, :600] = float("-inf")
    target = torch.tensor([3, 4, 5, 610, 7])
    f32 = TensorProto.FLOAT
    forward = _session(library, "CrossEntropy", {"x": f32, "target": _INT64}, {"losses": f32, "lse": f32},
                       provider=provider, classes=600)
    on = torch.device(device)
    outs = _bound_run(forward, {"x": x.to(on), "target": target.to(on)},
                      {"losses": torch.empty(5, device=on), "lse": torch.empty(5, device=on)})
    backward = _session(library, "CrossEntropyGrad", {"grad": f32, "x": f32, "target": _INT64, "lse": f32},
                        {"dx": f32}, provider=provider, classes=600)
    dx = _bound_run(backward, {"grad": torch.ones(5, device=on), "x": x.to(on), "target": target.to(on),
                               "lse": outs["lse"]}, {"dx": torch.full((5, 640), 7.0, device=on)})["dx"].cpu()
    losses, lse = outs["losses"].cpu(), outs["lse"].cpu()
    assert losses[:4].isnan().all() and lse[:2].isnan().all() and lse[2] == float("-inf")
    assert torch.nn.functional.cross_entropy(x[2:3, :600], target[2:3]).isnan()
    # the finite row: float32 arithmetic (CUDA) or float64 rounded once (CPU), within 600 roundings of its size
    assert abs(float(losses[4]) - float(torch.nn.functional.cross_entropy(x[4:, :600].double(), target[4:]))) <= (
        600 * FLOAT32 * float(x[4, :600].abs().max() + 10))
    assert not dx[:, 600:].any() and not dx[4].isnan().any()


@needs_compiler
def test_cross_entropy_refuses_more_classes_than_a_row_holds(cpu_library):
    session = _session(cpu_library, "CrossEntropy", {"x": TensorProto.FLOAT, "target": _INT64},
                       {"losses": TensorProto.FLOAT, "lse": TensorProto.FLOAT}, classes=9)
    with pytest.raises(Exception, match=r"CrossEntropy: the attribute classes \(9\) must be in \[1, 8\]"):
        session.run(None, {"x": np.zeros((2, 8), np.float32), "target": np.zeros(2, np.int64)})


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("padded", [False, True], ids=["same-size", "padded-rows"])
@pytest.mark.parametrize("addends", [1, 3, 10])
def test_add_half_is_cast_then_add_bit_for_bit(cpu_library, device, dtype, padded, addends):
    """AddHalf(sum, x1, ...) is torch's ``sum + x1.float() + ...`` bit for bit (each x widened exactly, one float32
    add each, in order), over sum's elements; padded: the xs have 9 rows more than sum, and more (padded products),
    only their leading rows are read. On CUDA (``make gpu-check``) ten tensors take two of the kernel's launches."""
    gen = torch.Generator().manual_seed(8)
    total = torch.randn(37, 33, generator=gen) * 1e3
    xs = {f"x{i}": (torch.randn(37 + (9 + i if padded else 0), 33, generator=gen) * 7).to(dtype)
          for i in range(addends)}
    expected = total
    for x in xs.values():
        expected = expected + x[:37].float()
    library, provider = _library_on(device, cpu_library)
    session = _session(library, "AddHalf", {"sum": TensorProto.FLOAT, **{n: _TYPES[dtype][0] for n in xs}},
                       {"y": TensorProto.FLOAT}, provider=provider)
    feeds = {name: t.to(device) for name, t in {"sum": total, **xs}.items()}
    out = _bound_run(session, feeds, {"y": torch.empty_like(total, device=device)})["y"]
    assert torch.equal(out.cpu(), expected)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_add_half_of_two_halves_is_two_casts_then_add_bit_for_bit(cpu_library, dtype):
    """A half sum (the chain's first term) is widened as x is: torch's ``sum.float() + x.float()`` bit for bit, over
    the attribute rows' leading rows of both (two padded products, 9 and 5 rows more)."""
    gen = torch.Generator().manual_seed(9)
    total = (torch.randn(37 + 9, 33, generator=gen) * 1e3).to(dtype)
    x = (torch.randn(37 + 5, 33, generator=gen) * 7).to(dtype)
    t = _TYPES[dtype][0]
    session = _session(cpu_library, "AddHalf", {"sum": t, "x": t}, {"y": TensorProto.FLOAT}, rows=37)
    out = _bound_run(session, {"sum": total, "x": x}, {"y": torch.empty(37, 33)})["y"]
    assert torch.equal(out, total[:37].float() + x[:37].float())


@needs_compiler
def test_add_half_refuses_an_x_smaller_than_the_sum(cpu_library):
    """Any x of fewer elements than y (here the second of two) fails the run, naming the smallest."""
    session = _session(cpu_library, "AddHalf", {"sum": TensorProto.FLOAT, "x": TensorProto.FLOAT16,
                                                "x2": TensorProto.FLOAT16}, {"y": TensorProto.FLOAT})
    with pytest.raises(Exception, match=r"AddHalf: y has 8 elements \(rows 2\), more than sum's 8 or an x's 6"):
        session.run(None, {"sum": np.zeros((2, 4), np.float32), "x": np.zeros((2, 4), np.float16),
                           "x2": np.zeros((2, 3), np.float16)})


@needs_compiler
def test_make_kernels_builds_the_library_and_prints_its_path(_kernels_built_once):
    """``make kernels`` (README): the library built into the kernels cache (here the one where caching is off, which
    the whole run shares: conftest.py), its path the last line printed; the one this process loads."""
    import os
    import subprocess

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["make", "--no-print-directory", "kernels"], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "ORT_TRAINER_CACHE_DIR": "off"})
    assert done.returncode == 0, done.stdout + done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.name == "libort_trainer_kernels.so" and _kernels_built_once in path.parents
    assert path == kernels.build()


def test_processes_that_need_the_library_at_once_build_it_once(tmp_path):
    """Two builders at once (threads here: each opens the lock file itself, as processes do): the second waits for
    the first's build and takes it; a failed build leaves nothing, so the next one builds."""
    from concurrent.futures import ThreadPoolExecutor

    builds = tmp_path / "builds.txt"

    def command(output):
        return ["sh", "-c", f'echo built >> "{builds}"; sleep 1; echo library > "{output}"']

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: kernels._built(tmp_path / "lib" / "x.so", command, "x"), range(2)))
    assert paths == [tmp_path / "lib" / "x.so"] * 2 and paths[0].read_text() == "library\n"
    assert builds.read_text() == "built\n"
    with pytest.raises(kernels.KernelsUnavailable, match="building y failed"):
        kernels._built(tmp_path / "y" / "y.so", lambda output: ["false"], "y")
    assert [p.name for p in (tmp_path / "y").iterdir()] == [".lock"]

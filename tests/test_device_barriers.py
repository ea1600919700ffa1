"""``graph_optimizations.device_barriers`` (``recompute.device_barriers``) and the kernel it writes, ``AliasAfter``.

``activation_recompute`` and ``layer_recompute`` have their copies wait for the backward through ``Reshape(x,
Shape(x) + sum(empty slice of t))``. ONNX Runtime's CUDA Reshape reads its shape on the host, so on a GPU that sum
would be copied from the device every step (a wait for the GPU at each recomputed region, and no CUDA graph
capture); the pass writes each wait as one ``AliasAfter(x, t)`` node of ort_trainer's kernel library instead, on
the device, and the trainer turns it on where the device reads shapes on the host (CUDA) and a library with CUDA
kernels can be had. Here on the CPU the device's switch is forced (``_as_on_a_gpu``): the graph must compute what it
computed before bit for bit, and ONNX Runtime's CUDA placement, as ``benchmarks/cuda_placement.py`` follows it, must
find no copy between the GPU and the host inside it.
"""

import copy
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

pytest.importorskip("onnxscript", reason="the 'torch' gradient source exports with onnxscript")

from ort_trainer import ORTTrainer, devices, kernels  # noqa: E402
from ort_trainer.optim import SGDConfig  # noqa: E402

from test_half_loss import _encoder_case, _gpt2_case  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cuda_placement import host_copies  # noqa: E402

needs_compiler = pytest.mark.skipif(kernels._compilers()[1] is None and not kernels.cuda_kernels_at_hand(),
                                    reason="no C++ compiler to build the kernel library")


@pytest.fixture
def _as_on_a_gpu(monkeypatch):
    """The CPU device's graphs built as a GPU's are (its waits as AliasAfter nodes), their kernel library CPU-only."""
    monkeypatch.setattr(devices.CPUDevice, "device_barriers", True)
    monkeypatch.setattr(kernels, "cuda_kernels_at_hand", lambda: True)


def _steps(case: str, barriers: bool, passes: dict) -> tuple[onnx.ModelProto, list[float], dict]:
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.5), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "device": {"id": "cpu"},
                                  "graph_optimizations": {"device_barriers": barriers, **passes}})
    losses = []
    for _ in range(2):
        out = trainer.train_step(*batch)
        losses.append(float(out[0] if isinstance(out, (list, tuple)) else out))
    return trainer._graphs.gradient, losses, trainer.state_dict(pytorch_format=True)


@needs_compiler
@pytest.mark.parametrize("passes", [{"activation_recompute": True},
                                    {"activation_recompute": True, "layer_recompute": True},
                                    {"activation_recompute": True, "fused_attention": True, "fused_gelu_gradient": True,
                                     "gelu_forward_kernel": True, "torch_products": True}],
                         ids=["activation", "layer", "levers"])
@pytest.mark.parametrize("case", ["gpt2", "encoder"])
def test_the_waits_stay_on_the_device_and_the_steps_are_bit_for_bit(case, passes, _as_on_a_gpu):
    """Two SGD steps of the tiny GPT-2 and the tiny encoder with the recomputations (activations; layers too; with
    kernels that change which values are recomputed): every wait became one AliasAfter node reading a backward
    value, the graph has no copy between the GPU and the host (without the pass, one to the host a wait), and the
    losses and the weights after the steps are the run's without the pass bit for bit (the nodes alias their
    input: no arithmetic changed)."""
    graph, losses, weights = _steps(case, True, passes)
    reference_graph, reference_losses, reference_weights = _steps(case, False, passes)
    waits = [n for n in reference_graph.graph.node if n.op_type == "Reshape" and n.input[1].endswith("/same_shape")]
    aliases = [n for n in graph.graph.node if n.op_type == "AliasAfter" and n.domain == kernels.DOMAIN]
    assert waits and len(aliases) == len(waits)
    assert host_copies(graph) == []
    assert [kind for kind, _, _ in host_copies(reference_graph)] == ["MemcpyToHost"] * len(waits)
    assert losses == reference_losses
    for name, value in reference_weights.items():
        assert torch.equal(weights[name], value), name


@needs_compiler
@pytest.mark.parametrize("levers", ["defaults", "every"])
@pytest.mark.parametrize("case", ["gpt2", "encoder"])
def test_a_gpus_graph_has_no_copy_to_or_from_the_host(case, levers, _as_on_a_gpu):
    """The float16 training graph of the tiny GPT-2 and encoder, with the default switches and with every lever of
    ``benchmarks/gpu_levers.sh``'s first setting, as a GPU's is built: ONNX Runtime's CUDA placement
    (``benchmarks/cuda_placement.py``) would put no copy between the GPU and the host inside it (a copy to the host
    is a wait for the GPU every step, and either kind keeps ``device.cuda_graph`` from capturing the step), nor run
    a floating-point node on the host."""
    from ort_trainer.amp import DynamicLossScaler

    from test_placement import EVERY_LEVER

    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "device": {"id": "cpu"},
                                  "mixed_precision": {"enabled": True,
                                                      "loss_scaler": DynamicLossScaler(loss_scale=1.0)},
                                  "graph_optimizations": dict.fromkeys(EVERY_LEVER if levers == "every" else (),
                                                                       True)})
    trainer.train_step(*batch)
    graph = trainer._graphs.gradient
    assert any(n.op_type == "AliasAfter" for n in graph.graph.node)
    assert host_copies(graph) == []


@pytest.mark.parametrize("reads_on_the_host", [False, True], ids=["cpu", "gpu-without-kernels"])
def test_the_cpu_keeps_its_reshapes_and_a_gpu_without_cuda_kernels_too(reads_on_the_host, monkeypatch, caplog):
    """The switch on (its default): on the CPU (which reads shapes where it computes) the waits stay Reshapes, no
    kernel library needed, nothing said; on a device that reads them on the host but without a library of CUDA
    kernels at hand (no nvcc, no $ORT_TRAINER_KERNELS_LIBRARY), too, with a warning that says what that costs and
    the fixes: the step runs, its waits copied."""
    monkeypatch.setattr(devices.CPUDevice, "device_barriers", reads_on_the_host)
    monkeypatch.setattr(kernels, "cuda_kernels_at_hand", lambda: False)
    with caplog.at_level("WARNING", logger="ort_trainer"):
        graph, losses, _ = _steps("gpt2", True, {"activation_recompute": True})
    warned = [r.getMessage() for r in caplog.records if "device_barriers" in r.getMessage()]
    assert len(warned) == (1 if reads_on_the_host else 0), warned
    assert all("copied to the host" in w and "$ORT_TRAINER_KERNELS_LIBRARY" in w for w in warned)
    assert not any(n.op_type == "AliasAfter" for n in graph.graph.node)
    assert any(n.op_type == "Reshape" and n.input[1].endswith("/same_shape") for n in graph.graph.node)
    assert np.isfinite(losses).all()


def _alias_model(x_type: int, after_type: int, through: bool) -> onnx.ModelProto:
    """``z = Cast(AliasAfter(Cast(x, T), a), float32)`` of a float32 ``x`` (an alias of a value computed in the
    graph), or ``z = AliasAfter(x, a)`` of a ``T`` input straight to the output (``through``: ONNX Runtime gives z a
    buffer of its own, which the kernel fills with a copy)."""
    if through:
        nodes = [helper.make_node("AliasAfter", ["x", "a"], ["z"], domain=kernels.DOMAIN)]
    else:
        nodes = [helper.make_node("Cast", ["x"], ["x2"], to=x_type),
                 helper.make_node("AliasAfter", ["x2", "a"], ["y"], domain=kernels.DOMAIN),
                 helper.make_node("Cast", ["y"], ["z"], to=TensorProto.FLOAT)]
    io_type = x_type if through else TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", io_type, [5, 3]),
                                           helper.make_tensor_value_info("a", after_type, [2])],
                              [helper.make_tensor_value_info("z", io_type, [5, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)], ir_version=9)


def _skip_without_cuda_kernels() -> None:
    """(a ``cuda`` test: conftest skips it where there is no GPU or no CUDA provider)"""
    if not kernels.cuda_kernels_at_hand():
        pytest.skip("needs the kernel library's CUDA kernels (nvcc or $ORT_TRAINER_KERNELS_LIBRARY)")


@needs_compiler
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("through", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_alias_after_gives_its_input_bit_for_bit(dtype, through, device):
    """The CPU and CUDA kernels: y is x, bit for bit (NaN, -0, infinities included), whatever the dtype of ``after``
    (here int64 and float16), as an alias of a value the graph computed and as a copy of the graph's input."""
    if device == "cuda":
        _skip_without_cuda_kernels()
    x_type = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
              torch.bfloat16: TensorProto.BFLOAT16}[dtype]
    values = torch.tensor([float("nan"), -0.0, float("inf"), -3.5, 1e-3] * 3).reshape(5, 3).to(dtype)
    x = (values if through else values.float()).to(device)  # (a float32 input whose cast to dtype is exact)
    options = ort.SessionOptions()
    kernels.register(options, cuda=device == "cuda")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    for after_type, after in ((TensorProto.INT64, np.ones(2, np.int64)), (TensorProto.FLOAT16, np.ones(2, np.float16))):
        session = ort.InferenceSession(_alias_model(x_type, after_type, through).SerializeToString(), options,
                                       providers=providers)
        binding = session.io_binding()
        io_type = x_type if through else TensorProto.FLOAT
        binding.bind_input("x", device, 0, io_type, [5, 3], x.data_ptr())
        binding.bind_ortvalue_input("a", ort.OrtValue.ortvalue_from_numpy(after, device, 0))
        z = torch.empty_like(x)
        binding.bind_output("z", device, 0, io_type, [5, 3], z.data_ptr())
        session.run_with_iobinding(binding)
        x, z = x.cpu(), z.cpu()
        nan = x.isnan()  # (a cast may write its own NaN's bits)
        assert torch.equal(z.isnan(), nan)
        assert torch.equal(z[~nan].view(bits[x.dtype]), x[~nan].view(bits[x.dtype]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_gpu_step_at_the_defaults_copies_nothing_to_the_host(dtype):
    """A mixed-precision step of the tiny GPT-2 on CUDA with the default switches (activation_recompute on): its waits
    are AliasAfter nodes, and ONNX Runtime places every node on the GPU with no copy to the host inside the graph
    (``Sessions.placed_elsewhere``, which counts both)."""
    _skip_without_cuda_kernels()
    from ort_trainer.amp import DynamicLossScaler

    model, desc, batch, _ = _gpt2_case()
    mixed = {"enabled": True, "dtype": dtype,
             **({"loss_scaler": DynamicLossScaler(loss_scale=1.0)} if dtype == "float16" else {})}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={"graph": {"gradient_source": "torch"}, "device": {"id": "cuda"},
                                  "mixed_precision": mixed})
    trainer.train_step(*[t.cuda() for t in batch])
    assert any(n.op_type == "AliasAfter" for n in trainer._graphs.gradient.graph.node)
    assert trainer._engine.sessions.placed_elsewhere == {}

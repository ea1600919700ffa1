"""``Sessions.check_placement``: the nodes ONNX Runtime places off the device's provider are reported.

On a GPU a node whose types have no CUDA kernel (a bfloat16 operator, say) runs on the CPU provider, its inputs and
outputs copied between the GPU and the host every run, and its session cannot be captured (``device.cuda_graph``):
the trainer warns, naming each floating-point node, and counts them by op type (``Sessions.placed_elsewhere``,
which ``benchmarks/gpu_worker.py`` keeps with each row). The check here runs a CPU session as if the device's
provider were CUDA's: every node is then off it. ONNX Runtime's host-side shape computations (integer outputs) are
logged at DEBUG only.
"""

import onnx
import pytest
from onnx import TensorProto, helper

from ort_trainer import devices
from ort_trainer.sessions import Sessions


class _AsIfOnCuda(devices.CPUDevice):
    """The CPU device whose provider would be CUDA's: every node of its sessions is off the device's provider."""

    provider = "CUDAExecutionProvider"


def _model() -> onnx.ModelProto:
    """A float Add and the Shape of its dynamic input (an integer shape computation)."""
    nodes = [helper.make_node("Add", ["x", "x"], ["y"], name="twice"),
             helper.make_node("Shape", ["x"], ["s"], name="dims")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"]),
                               helper.make_tensor_value_info("s", TensorProto.INT64, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _sessions(device: devices.Device) -> Sessions:
    import onnxruntime as ort

    options = ort.SessionOptions()
    device.configure_session(options)
    return Sessions(device, options, device.providers(None, 0, False), [])


def test_a_float_node_off_the_device_is_warned_about_and_counted(caplog):
    sessions = _sessions(_AsIfOnCuda())
    session = sessions.make_session(_model())
    if not hasattr(session, "get_provider_graph_assignment_info"):
        pytest.skip("this ONNX Runtime does not record where each node runs")
    caplog.clear()
    with caplog.at_level("DEBUG", logger="ort_trainer"):
        sessions.make_session(_model())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "1 node(s)" in warnings[0] and "Add 'twice' (CPUExecutionProvider)" in warnings[0]
    assert "dims" not in warnings[0] and "Shape 'dims'" in caplog.text  # (the integer one: DEBUG)
    assert sessions.placed_elsewhere == {"Add": 2}  # (two sessions)


class _Node:
    def __init__(self, op_type: str, name: str):
        self.op_type, self.name, self.domain = op_type, name, ""


class _Subgraph:
    def __init__(self, ep_name: str, nodes: list[_Node]):
        self.ep_name, self._nodes = ep_name, nodes

    def get_nodes(self) -> list[_Node]:
        return self._nodes


class _Session:
    """What a CUDA session of ``_model()`` with its Shape's integer chain on the host and a copy back reports."""

    def get_provider_graph_assignment_info(self) -> list[_Subgraph]:
        return [_Subgraph("CUDAExecutionProvider", [_Node("Add", "twice"), _Node("MemcpyFromHost", "copy0")]),
                _Subgraph("CPUExecutionProvider", [_Node("Shape", "dims")])]


def test_copies_inside_the_graph_are_warned_about_with_the_host_nodes_around_them(caplog):
    """An integer node on the host is no warning by itself; a copy between the device and the host inside the graph
    is (a sync point, and no CUDA graph capture), naming the host nodes."""
    sessions = _sessions(devices.CUDADevice(0))
    with caplog.at_level("WARNING", logger="ort_trainer"):
        sessions.check_placement(_Session(), _model())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "copies 1 tensor(s) between cuda:0 and the host" in warnings[0]
    assert "MemcpyFromHost 'copy0'" in warnings[0] and "Shape 'dims' (CPUExecutionProvider)" in warnings[0]
    assert "device.cuda_graph cannot capture" in warnings[0]
    assert sessions.placed_elsewhere == {"MemcpyFromHost": 1}


def test_nothing_is_reported_where_every_node_runs_on_the_device_or_nothing_is_recorded(caplog):
    """Every node on the device's provider; or session options of the user's own, which do not record where the
    nodes run (ONNX Runtime then refuses to say): nothing reported, the session made."""
    import onnxruntime as ort

    for sessions in (_sessions(devices.CPUDevice()), Sessions(_AsIfOnCuda(), ort.SessionOptions(),
                                                              [("CPUExecutionProvider", {})], [])):
        with caplog.at_level("DEBUG", logger="ort_trainer"):
            sessions.make_session(_model())
        assert sessions.placed_elsewhere == {} and "placed off" not in caplog.text


# every graph lever of benchmarks/gpu_levers.sh's first setting
EVERY_LEVER = ("activation_recompute", "device_barriers", "gelu_forward_kernel", "fused_gelu_gradient",
               "fused_layer_norm_gradient", "fused_softmax_gradient", "fused_safe_softmax", "fused_cross_entropy",
               "half_precision_gelu",
               "bfloat16_softmax_gradient", "aligned_products", "half_precision_loss", "half_precision_bias_gradient",
               "half_precision_transposed_products", "fused_gradient_sums", "fused_layer_norm", "torch_products",
               "fused_attention", "packed_attention", "causal_attention", "loss_pieces", "weight_casts")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["gpt2", "encoder"])
def test_every_node_of_a_mixed_precision_step_runs_on_the_gpu(case, dtype, record_property):
    """A mixed-precision step of the tiny GPT-2 and the tiny encoder on CUDA with every graph lever (the defaults'
    graphs: the baseline rows of ``benchmarks/gpu_levers.sh`` record theirs): no floating-point node of its graphs
    runs off the CUDA provider (what did is recorded either way)."""
    import copy

    import torch

    from ort_trainer import ORTTrainer, _runtime
    from ort_trainer.amp import DynamicLossScaler
    from ort_trainer.optim import SGDConfig

    from test_half_loss import _encoder_case, _gpt2_case

    if not torch.cuda.is_available() or not _runtime.has_onnxscript():
        pytest.skip("needs a GPU and the 'torch' gradient source")
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    mixed = {"enabled": True, "dtype": dtype,
             **({"loss_scaler": DynamicLossScaler(loss_scale=1.0)} if dtype == "float16" else {})}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "device": {"id": "cuda"},
                                  "mixed_precision": mixed,
                                  "graph_optimizations": {name: True for name in EVERY_LEVER}})
    trainer.train_step(*[t.cuda() for t in batch])
    placed = trainer._engine.sessions.placed_elsewhere
    record_property("placed_elsewhere", placed)
    assert placed == {}, placed

"""``device.cuda_graph``: the training step's run captured as a CUDA graph and replayed.

The capture itself needs a GPU (``make gpu-check``: ``test_cuda.py``). Here, on the CPU, the engine's
fixed bindings run as they do around a capture (``_step_io.CapturedIO``: every step input and output
at one address for the whole training, the outputs handed back as copies): the step must train
exactly as the usual bindings do. And what a capture cannot replay rightly is refused before any
run, naming the modules: dropout, shapes that depend on the batch's values, control flow.
"""

import contextlib
import copy

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, mlm_batch, mlm_loss, mlp_batch, tiny_gpt2
from ort_trainer import ORTTrainer, ORTTrainerOptions, devices, sessions
from ort_trainer._step_io import CapturedIO, FreshIO, capture_problems
from ort_trainer.optim import AdamConfig

CE = torch.nn.functional.cross_entropy
MODELS = {
    "mlp": (MLP, MLP_DESC, CE, mlp_batch),
    "encoder": (TinyEncoder, ENCODER_DESC, mlm_loss, mlm_batch),
}


def _options(captured: bool, **groups) -> ORTTrainerOptions:
    """CPU options; ``captured``: ``device.cuda_graph`` set past the options' check, which refuses it
    without a GPU: the engine then binds as it does around a capture, without one."""
    options = ORTTrainerOptions({"device": {"id": "cpu"}, **groups})
    if captured:
        dict.__setitem__(options["device"], "cuda_graph", True)
    return options


def _train(name: str, captured: bool, steps: int = 6, window: int = 1, fetch_loss_only: bool = False):
    make, desc, loss_fn, batch = MODELS[name]
    torch.manual_seed(0)
    trainer = ORTTrainer(make(), desc, AdamConfig(lr=1e-2), loss_fn=loss_fn,
                         options=_options(captured, batch={"gradient_accumulation_steps": window}))
    if fetch_loss_only:
        trainer._train_step_info.fetches = ["loss"]
    generator = torch.Generator().manual_seed(1)
    returned = [trainer.train_step(*batch(generator)) for _ in range(steps)]
    return trainer, returned


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_fixed_bindings_train_bit_for_bit_as_the_usual_ones(name, window):
    """Same kernels on the same values in the same order: losses, logits and weights bit-equal, with
    and without gradient accumulation (a captured step sums its micro-batches on the host, as the
    usual one does where its graph cannot: one float32 addition per micro-batch either way)."""
    usual, usual_out = _train(name, captured=False, window=window)
    fixed, fixed_out = _train(name, captured=True, window=window)
    assert isinstance(fixed._engine._current.training.grad_io[0], CapturedIO)
    assert isinstance(usual._engine._current.training.grad_io[0], FreshIO)
    for ours, theirs in zip(fixed_out, usual_out):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    weights, expected = fixed._engine.weights(), usual._engine.weights()
    assert all(np.array_equal(weights[w], expected[w]) for w in expected)
    batch = MODELS[name][3](torch.Generator().manual_seed(9))
    assert all(torch.equal(a, b) for a, b in zip(fixed.eval_step(*batch), usual.eval_step(*batch)))


def test_a_step_hands_back_copies_that_later_steps_leave_alone():
    """The fixed output buffers are written by every step: what a step returned is a copy of them."""
    trainer, returned = _train("mlp", captured=True, steps=4)
    io = trainer._engine._current.training.grad_io[0]
    losses = [float(loss) for loss, _ in returned]
    assert len(set(losses)) == len(losses)  # four steps, four losses, none overwritten by the next
    assert returned[-1][0].data_ptr() != io.fixed["loss"].data_ptr()
    assert float(io.fixed["loss"]) == losses[-1]
    # the inputs stay where the capture bound them
    pointers = {name: buffer.data_ptr() for name, buffer in io.inputs.items()}
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(5)))
    assert {name: buffer.data_ptr() for name, buffer in io.inputs.items()} == pointers


def test_a_captured_step_projects_every_row_and_accumulates_outside_its_graph():
    """With only the loss fetched, the usual graph projects the labelled rows alone (``sparse_labels``:
    a ``NonZero``, whose count a capture would fix); a captured one projects every row, and its graph
    reads no gradient buffer (its warm-up runs would add into them more than once)."""
    usual, _ = _train("encoder", captured=False, window=2, fetch_loss_only=True)
    fixed, fixed_out = _train("encoder", captured=True, window=2, fetch_loss_only=True)
    assert "NonZero" in {n.op_type for n in usual._graphs.gradient.graph.node}
    gradient = fixed._graphs.gradient
    assert "NonZero" not in {n.op_type for n in gradient.graph.node}
    assert not fixed._engine._current.training.accumulates
    assert fixed._host_accumulation
    assert capture_problems(gradient) == []
    assert all(torch.isfinite(loss) for loss in fixed_out)


def test_dropout_is_refused_before_any_step_naming_its_modules():
    """ONNX Runtime's CUDA Dropout draws its mask when launched: a replay would drop the same elements
    every step. Without ``seeded_dropout`` (``test_seeded_dropout.py``) the refusal comes before any run, and
    leaves the trainer as it was."""
    model, desc = tiny_gpt2(dropout=0.1)
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-3), options=_options(
        True, graph_optimizations={"host_dropout_masks": False, "seeded_dropout": False}))
    before = {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="device.cuda_graph") as info:
        trainer.train_step(ids, torch.ones_like(ids), ids)
    message = str(info.value)
    assert "Dropout draws random numbers" in message and "set the model's dropout probabilities to 0" in message
    assert "transformer.h.0.attn" in message and "Turn device.cuda_graph off" in message
    assert trainer._train_step_info.step == 0
    after = trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _graph(nodes, initializers=(), inputs=("x",)):
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [value(name, TensorProto.FLOAT, [4]) for name in inputs],
                              [value("y", TensorProto.FLOAT, None)], initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _scalar(name, value, dtype):
    return numpy_helper.from_array(np.array(value, dtype), name)


@pytest.mark.parametrize("ratio, training, refused", [
    (0.1, True, True), (0.0, True, False), (0.1, False, False), ("computed", True, True), ("", True, True),
    (0.1, None, False)])
def test_a_dropout_is_refused_only_where_it_draws_a_mask(ratio, training, refused):
    """ONNX Runtime's CUDA Dropout draws nothing when its ratio is 0 or it is not in training mode
    (``cuda/nn/dropout.cc``); a ratio computed in the graph may be anything, and an absent one is 0.5."""
    initializers, inputs, nodes = [], ["x", "", ""], []
    if training is not None:
        initializers.append(_scalar("training", training, np.bool_))
        inputs[2] = "training"
    if isinstance(ratio, float):
        initializers.append(_scalar("ratio", ratio, np.float32))
        inputs[1] = "ratio"
    elif ratio == "computed":
        nodes.append(helper.make_node("ReduceMean", ["x"], ["computed"], keepdims=0))
        inputs[1] = "computed"
    model = _graph(nodes + [helper.make_node("Dropout", inputs, ["y", "mask"], name="drop")], initializers)
    problems = capture_problems(model)
    assert bool(problems) == refused, problems
    if refused:
        assert problems == ["Dropout draws random numbers: a replayed capture would draw the same ones every step "
                            "(dropout: graph_optimizations.seeded_dropout, gradient source 'torch', draws float32, "
                            "float16 and bfloat16 dropouts on the device, with ort_trainer's CUDA kernels: nvcc or "
                            "$ORT_TRAINER_KERNELS_LIBRARY; or set the model's dropout probabilities to 0 to train with "
                            "device.cuda_graph; other draws, a layer drop or SpecAugment's masks: set layerdrop, "
                            "mask_time_prob and mask_feature_prob to 0): drop"]


def test_every_kind_of_node_a_capture_cannot_replay_is_named_once_with_all_its_nodes():
    nodes = [
        helper.make_node("RandomUniformLike", ["x"], ["r"], name="noise"),
        helper.make_node("NonZero", ["x"], ["nz"], name="/model/picker/NonZero"),
        helper.make_node("NonZero", ["r"], ["nz2"], name="/model/other/NonZero"),
        helper.make_node("Add", ["x", "r"], ["y"], name="add"),
    ]
    problems = capture_problems(_graph(nodes))
    assert len(problems) == 2
    assert problems[0].startswith("RandomUniformLike draws random numbers") and problems[0].endswith(": noise")
    assert problems[1] == ("NonZero has an output whose shape depends on the batch's values, which a capture "
                           "fixes: picker, other")


def test_the_options_refuse_a_capture_without_a_gpu_and_enable_cuda_graph_given_by_hand():
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"device": {"id": "cpu", "cuda_graph": True},
                           "provider_options": {"enable_cuda_graph": "1"}})
    message = str(info.value)
    assert "device.cuda_graph: CUDA graphs need a GPU; device.id is 'cpu' (use 'cuda')" in message
    assert "provider_options: enable_cuda_graph needs fixed buffers" in message and "device.cuda_graph=True" in message
    assert ORTTrainerOptions({"device": {"id": "cpu"}}).device.cuda_graph is False


def test_onnx_runtime_refusing_the_capture_says_to_turn_it_off(monkeypatch):
    """ONNX Runtime refuses to make a capturing session where a compute node runs on the host (its own
    check, after partitioning): the error names the option."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    make = sessions.Sessions.make_session

    def refusing(self, model, capture=False):
        if capture:
            raise Fail("This session cannot use the CUDA Graph feature as requested by the user  as all compute "
                       "graph nodes have not been partitioned to the CUDA EP.")
        return make(self, model, capture)

    monkeypatch.setattr(sessions.Sessions, "make_session", refusing)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE, options=_options(True))
    with pytest.raises(ValueError, match=r"device.cuda_graph: ONNX Runtime cannot capture this model's training "
                                         r"step \(.*partitioned to the CUDA EP.*turn device.cuda_graph off"):
        trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert trainer._train_step_info.step == 0


def test_a_shape_past_the_specialised_ones_is_refused_on_the_shared_captured_graph():
    """Past ``max_shape_graphs`` the batch shapes share the symbolic graph, captured for the first of
    them: another shape is refused before it runs, with what to do."""
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE,
                         options=_options(True, graph_optimizations={"max_shape_graphs": 1}))
    generator = torch.Generator().manual_seed(0)
    trainer.train_step(*mlp_batch(generator, batch=8))  # specialised
    trainer.train_step(*mlp_batch(generator, batch=6))  # the symbolic graph, captured for 6 rows
    trainer.train_step(*mlp_batch(generator, batch=6))
    with pytest.raises(ValueError, match=r"device.cuda_graph: input '.*' is \(4, .*where this graph's captured step "
                                         r"took \(6, .*raise max_shape_graphs"):
        trainer.train_step(*mlp_batch(generator, batch=4))
    assert trainer._train_step_info.step == 3
    trainer.train_step(*mlp_batch(generator, batch=8))  # the specialised graph still runs


def test_only_the_capturing_run_allocates_from_the_captures_own_pool(monkeypatch):
    """``Device.capture_memory`` surrounds the one run in which ONNX Runtime captures (a binding's second: the
    first runs uncaptured to learn the outputs), not the first run and not the replays after it."""
    entered = []

    @contextlib.contextmanager
    def counting(device):
        entered.append(len(calls))
        yield

    calls = []
    run = sessions.Sessions.run
    monkeypatch.setattr(sessions.Sessions, "run", lambda self, *args: calls.append(args[-1]) or run(self, *args))
    monkeypatch.setattr(devices.CPUDevice, "capture_memory", counting)
    _train("mlp", captured=True, steps=4)
    assert entered == [1]  # entered before the second training run, once


def test_torch_memory_under_a_capture_is_refused_only_without_a_private_pool(monkeypatch):
    """``fused_attention``, ``torch_products`` and ``torch_allocator`` go with ``device.cuda_graph`` where torch can
    keep a capture's allocations in a pool of their own (``devices.capture_memory_problem``); elsewhere all are refused
    together, naming the torch."""
    both = {"device": {"id": "cpu", "cuda_graph": True, "torch_allocator": True},
            "graph_optimizations": {"fused_attention": True, "torch_products": True}}
    monkeypatch.setattr(devices, "capture_memory_problem", lambda: None)
    with pytest.raises(ValueError) as raised:
        ORTTrainerOptions(both)
    assert "pool of its own" not in str(raised.value)  # only the CPU device's own problems
    monkeypatch.setattr(devices, "capture_memory_problem", lambda: "torch 2.7 cannot give one thread's allocations")
    with pytest.raises(ValueError) as raised:
        ORTTrainerOptions(both)
    message = str(raised.value)
    assert "graph_optimizations.fused_attention: torch's attention kernels allocate" in message
    assert "graph_optimizations.torch_products: torch's products allocate cuBLAS's workspace" in message
    assert "device.torch_allocator: a captured CUDA graph (device.cuda_graph) replays into the memory" in message
    assert message.count("torch 2.7 cannot give one thread's allocations") == 3 and "upgrade torch" in message


# A replay runs the captured kernels on the values the uncaptured run computes, in the same order (float32: only
# atomically added sums, ≤ 64·u a step, through 10 steps: 10 · 64 · 2^-24 = 3.8e-5), held to 1e-4 as test_cuda.py's
CAPTURED_RTOL = 1e-4


@pytest.mark.cuda
@pytest.mark.parametrize("setting", [{"graph_optimizations": {"fused_attention": True}},
                                     {"device": {"torch_allocator": True}}], ids=["fused_attention", "torch_allocator"])
def test_what_torch_allocates_in_a_captured_step_stays_the_graphs(setting):
    """Torch's attention kernels, and ONNX Runtime's tensors from torch's allocator, under a captured step: 10
    captured steps of the tiny GPT-2 equal 10 uncaptured ones, and tensors torch allocates after the capture (in the
    blocks a capture run from torch's shared pool would have freed) keep their values through the replays."""
    model, desc = tiny_gpt2()
    generator = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 50, (4, 8), generator=generator) for _ in range(10)]
    losses, sentinels = {}, []
    for captured in (False, True):
        options = {"graph": {"gradient_source": "torch"}, **setting,
                   "device": {"id": "cuda", "cuda_graph": captured, **setting.get("device", {})}}
        torch.manual_seed(0)
        trainer = ORTTrainer(copy.deepcopy(model), desc, AdamConfig(lr=1e-3), options=options)
        losses[captured] = []
        for step, ids in enumerate(batches):
            losses[captured].append(float(trainer.train_step(ids, torch.ones_like(ids), ids)[0]))
            if captured and step == 1:  # right after the capture: small and large blocks, as a step's tensors
                sentinels = [torch.full((n,), float(i), device="cuda") for i, n in enumerate([64, 4096, 2**18, 2**21])]
        if captured:
            assert isinstance(trainer._engine._current.training.grad_io[0], CapturedIO)
            assert trainer._engine._current.training.grad_io[0].captured
    np.testing.assert_allclose(losses[True], losses[False], rtol=CAPTURED_RTOL)
    for i, tensor in enumerate(sentinels):
        assert bool((tensor == float(i)).all()), f"a tensor of {tensor.numel()} elements was overwritten by a replay"

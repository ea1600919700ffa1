"""The device seam (ort_trainer/devices.py) on the CPU: providers and their options, in-place
bindings, device selection and its errors. The CUDA device's pointer bindings run here too, on host
memory, through the whole engine."""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer, ORTTrainerOptions, _runtime, _signature_sessions, devices
from ort_trainer import engine as engine_module
from ort_trainer.graph.onnx_graph import largest_tensors
from ort_trainer.optim import AdamConfig
from ort_trainer.sessions import Sessions

CE = torch.nn.functional.cross_entropy


def _add_one_session() -> ort.InferenceSession:
    """``y = x + 1`` over float32 [2, 3]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by both runtimes
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


class _PointerBoundCPU(devices.CUDADevice):
    """The CUDA device's pointer bindings, pointed at host memory: ``kind`` is also the device
    name IOBinding gets, so everything but the CUDA memory and stream runs on the CPU."""

    kind = "cpu"

    def providers(self, provider_options, mem_limit, deterministic, torch_allocator=False):
        return [("CPUExecutionProvider", dict(provider_options or {}))]

    def synchronize(self):
        pass

    def inputs_copied_at_binding(self, session):
        return set()


class _CopyingAtBinding(_PointerBoundCPU):
    """Stands for a GPU whose session reads some weights on the CPU: binding them copies their
    value at that moment, as ONNX Runtime's IOBinding does for an input read on another device."""

    copied = {"fc1.weight", "fc2.bias"}

    def __init__(self, reports_copies: bool):
        super().__init__()
        self.reports_copies, self.kept = reports_copies, []

    def bind_input(self, binding, name, tensor):
        if name in self.copied:
            tensor = tensor.clone()
            self.kept.append(tensor)  # a pointer binding does not keep its memory alive
        super().bind_input(binding, name, tensor)

    def inputs_copied_at_binding(self, session):
        return {i.name for i in session.get_inputs()} & self.copied if self.reports_copies else set()


@pytest.mark.parametrize("device", [devices.CPUDevice(), _PointerBoundCPU()], ids=["dlpack", "pointer"])
def test_bound_buffers_are_read_and_written_in_place(device):
    session = _add_one_session()
    storage = torch.zeros(20)
    x, y = storage[2:8].view(2, 3), storage[10:16].view(2, 3)  # views at an offset, as the engine binds
    x.copy_(torch.arange(6.0).view(2, 3))
    binding = session.io_binding()
    device.bind_input(binding, "x", x)
    device.bind_output(binding, "y", y)
    session.run_with_iobinding(binding)
    torch.testing.assert_close(y, torch.arange(6.0).view(2, 3) + 1, rtol=0, atol=0)
    x.mul_(10)  # no rebinding: the session reads the tensor's memory itself
    session.run_with_iobinding(binding)
    torch.testing.assert_close(y, torch.arange(6.0).view(2, 3) * 10 + 1, rtol=0, atol=0)
    assert storage[:2].eq(0).all() and storage[8:10].eq(0).all() and storage[16:].eq(0).all()


def test_fresh_outputs_come_back_as_torch_tensors_on_the_engine_device():
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    loss, logits = trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    engine = trainer._engine
    assert isinstance(engine.placement, devices.CPUDevice) and engine.device == torch.device("cpu")
    assert isinstance(loss, torch.Tensor) and loss.device == engine.device and logits.device == engine.device
    buffers = [*engine.weights_flat, engine.grads_flat, *engine.fixed_tensors.values(),
               *(t for p in (0, 1) for t in engine.states_flat[p].values()),
               *(t for p in (0, 1) for t in engine.buffers[p].values()), *engine.grads.values()]
    assert all(t.device == engine.device for t in buffers)
    # the per-weight tensors are views of the flat buffers, not copies
    assert engine.grads["fc2.bias"].data_ptr() == engine.grads_flat.data_ptr() + 4 * engine.offsets["fc2.bias"]
    assert engine._providers == [("CPUExecutionProvider", {})]


@pytest.mark.parametrize("model_name", ["mlp", "encoder"])
def test_pointer_bindings_train_exactly_like_dlpack_bindings(monkeypatch, model_name):
    """The whole engine through the CUDA device's binding code (pointer, element type, shape of
    every buffer, view and output), on host memory: the same numbers as the CPU device."""
    gen = torch.Generator().manual_seed(5)
    if model_name == "mlp":
        model, desc, loss_fn = MLP(), MLP_DESC, CE
        batches = [mlp_batch(gen) for _ in range(4)]
    else:
        model, desc, loss_fn = TinyEncoder(), ENCODER_DESC, mlm_loss
        batches = [mlm_batch(gen, 2, 6) for _ in range(4)]
    reference = ORTTrainer(clone(model), desc, AdamConfig(lr=1e-2), loss_fn=loss_fn)
    monkeypatch.setattr(engine_module, "make_device", lambda value: _PointerBoundCPU())
    pointer = ORTTrainer(model, desc, AdamConfig(lr=1e-2), loss_fn=loss_fn)
    for batch in batches:
        expected = reference.train_step(*batch)
        got = pointer.train_step(*batch)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(pointer.eval_step(*batches[0])[0], reference.eval_step(*batches[0])[0], rtol=0, atol=0)
    assert isinstance(pointer._engine.placement, _PointerBoundCPU)
    for name, value in reference.state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(pointer.state_dict()["model"]["full_precision"][name], value)


def test_inputs_copied_at_binding_are_bound_again_before_every_run(monkeypatch, caplog):
    gen = torch.Generator().manual_seed(6)
    batches = [mlp_batch(gen) for _ in range(3)]
    model = MLP()
    reference = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    expected = [reference.train_step(*b)[0] for b in batches]
    for reports_copies in (True, False):
        monkeypatch.setattr(engine_module, "make_device", lambda value: _CopyingAtBinding(reports_copies))
        trainer = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
        with caplog.at_level("WARNING", logger="ort_trainer"):
            got = [trainer.train_step(*b)[0] for b in batches]
        if reports_copies:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            assert "ONNX Runtime reads fc1.weight, fc2.bias from another device than cpu" in caplog.text
        else:  # the test can tell: bound once, the copies keep the initial weights
            assert got[0] == expected[0] and got[2] != expected[2]
    session = _add_one_session()
    reported = devices.CUDADevice(0).inputs_copied_at_binding(session)  # a CPU session: read on the host
    assert reported == ({"x"} if hasattr(session, "get_input_memory_infos") else set())


def test_cuda_provider_options():
    torch.set_float32_matmul_precision("highest")
    device = devices.CUDADevice(1)
    assert device.torch_device == torch.device("cuda", 1) and repr(device) == "cuda:1"
    name, options = device.providers({}, 0, False)[0]
    assert name == "CUDAExecutionProvider" and device.providers({}, 0, False)[1] == ("CPUExecutionProvider", {})
    assert options == {"device_id": "1", "arena_extend_strategy": "kSameAsRequested", "use_tf32": "0"}
    _, options = device.providers({"cudnn_conv_use_max_workspace": 0, "arena_extend_strategy": "kNextPowerOfTwo"},
                                  2**30, True)[0]
    assert options["gpu_mem_limit"] == str(2**30) and options["cudnn_conv_algo_search"] == "DEFAULT"
    # the user's options go on top, as strings
    assert options["cudnn_conv_use_max_workspace"] == "0" and options["arena_extend_strategy"] == "kNextPowerOfTwo"
    try:
        torch.set_float32_matmul_precision("high")  # torch allows TF32 matmuls: so does ONNX Runtime
        assert device.providers({}, 0, False)[0][1]["use_tf32"] == "1"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert device.providers({"device_id": 1}, 0, False)[0][1]["device_id"] == "1"
    with pytest.raises(ValueError, match=r"provider_options: device_id 0 contradicts device.id 'cuda:1'.*"
                                         r"device.id='cuda:0'"):
        device.providers({"device_id": 0}, 0, False)


class _RecordingBinding:
    def __init__(self):
        self.calls = []

    def bind_input(self, *args):
        self.calls.append(("input", *args))

    def bind_output(self, *args):
        self.calls.append(("output", *args))


def test_cuda_bindings_pass_the_pointer_type_and_shape():
    device, binding = devices.CUDADevice(2), _RecordingBinding()
    flat = torch.zeros(10)
    device.bind_input(binding, "w", flat[4:10].view(2, 3))
    device.bind_output(binding, "flag", torch.zeros((), dtype=torch.bool))
    device.bind_input(binding, "half", torch.zeros(3, dtype=torch.bfloat16))
    device.bind_fresh_output(binding, "loss")
    kind, name, device_name, index, element_type, shape, pointer = binding.calls[0]
    assert (kind, name, device_name, index, element_type, shape) == ("input", "w", "cuda", 2, np.float32, (2, 3))
    assert pointer == flat.data_ptr() + 16
    assert binding.calls[1][1:6] == ("flag", "cuda", 2, np.bool_, ())
    assert binding.calls[2][4] == onnx.TensorProto.BFLOAT16
    assert binding.calls[3] == ("output", "loss", "cuda", 2)


def test_device_ids_are_parsed():
    assert devices.parse_device_id("cpu") == ("cpu", None)
    assert devices.parse_device_id("cuda") == ("cuda", None)
    assert devices.parse_device_id("cuda:12") == ("cuda", 12)
    for bad in ["gpu", "cpu:0", "cuda:", "cuda:-1", "CUDA", " cuda"]:
        with pytest.raises(ValueError, match=f"expected 'cpu', 'cuda' or 'cuda:N', got {bad!r}"):
            devices.parse_device_id(bad)


def _machine(monkeypatch, provider: bool, cuda_torch: bool = True, gpus: int = 1):
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider else ["CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: providers)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: cuda_torch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H100 #{i}")
    monkeypatch.setattr(torch.version, "cuda", "13.0" if cuda_torch else None)


def test_cuda_without_the_cuda_runtime_says_what_to_install(monkeypatch):
    _machine(monkeypatch, provider=False)
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"device": {"id": "cuda:0"}})
    message = str(info.value)
    assert "device.id: 'cuda:0' was asked for but the installed ONNX Runtime has no CUDA provider" in message
    assert 'pip install "ort_trainer[cuda]"' in message and "device.id='cpu'" in message


def test_cuda_with_a_cpu_build_of_torch_asks_for_a_cuda_torch(monkeypatch):
    _machine(monkeypatch, provider=True, cuda_torch=False)
    with pytest.raises(ValueError, match=r"device.id: 'cuda' needs a CUDA build of torch: .* torch CUDA tensors, and the "
                                         r"installed torch .* is a CPU build\. Install a CUDA 13 build"):
        ORTTrainerOptions({"device": {"id": "cuda"}})
    with pytest.raises(RuntimeError, match="device.id: 'cuda' needs a CUDA build of torch"):
        devices.make_device("cuda")


def test_cuda_without_a_gpu_says_none_is_visible(monkeypatch):
    _machine(monkeypatch, provider=True, gpus=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"device.id: 'cuda': torch .* \(CUDA 13.0\) sees no GPU on this machine "
                                         r"\(CUDA_VISIBLE_DEVICES=''\); run where a GPU is visible, or use device.id='cpu'"):
        ORTTrainerOptions({"device": {"id": "cuda"}})


def test_a_gpu_index_past_the_last_names_the_gpus_that_exist(monkeypatch):
    _machine(monkeypatch, provider=True, gpus=2)
    with pytest.raises(ValueError, match=r"device.id: 'cuda:3': there is no GPU 3; this machine has 2: "
                                         r"cuda:0 \(NVIDIA H100 #0\), cuda:1 \(NVIDIA H100 #1\)"):
        ORTTrainerOptions({"device": {"id": "cuda:3"}})
    assert ORTTrainerOptions({"device": {"id": "cuda:1"}}).device.id == "cuda:1"


def test_an_unusable_device_fails_at_construction_before_any_graph_is_built(monkeypatch):
    _machine(monkeypatch, provider=True, gpus=1)
    built = []
    monkeypatch.setattr(ORTTrainer, "_build", lambda self, *a: built.append(a))
    with pytest.raises(ValueError, match="device.id: 'cuda:1': there is no GPU 1; this machine has 1: cuda:0"):
        ORTTrainer(MLP(), {**MLP_DESC, "inputs": [("x", ["batch", 20], "float32"), ("label", ["batch"], "int64")]},
                   AdamConfig(), loss_fn=CE, options={"device": {"id": "cuda:1"}})
    assert built == []


@pytest.mark.parametrize("provider, cuda_torch, gpus, expected", [
    (True, True, 1, "cuda"), (True, True, 0, "cpu"), (True, False, 0, "cpu"), (False, True, 2, "cpu"),
])
def test_the_default_device_is_cuda_only_where_training_on_it_can_run(monkeypatch, provider, cuda_torch, gpus,
                                                                       expected):
    _machine(monkeypatch, provider=provider, cuda_torch=cuda_torch, gpus=gpus)
    assert devices.default_device_id() == expected
    assert ORTTrainerOptions().device.id == expected
    assert (devices.cuda_missing() is None) == (expected == "cuda")


def test_the_default_device_here():
    usable = ("CUDAExecutionProvider" in ort.get_available_providers() and torch.backends.cuda.is_built()
              and torch.cuda.device_count() > 0)
    assert ORTTrainerOptions().device.id == ("cuda" if usable else "cpu")


def test_cuda_sessions_hold_activations_once_too():
    """The CUDA device's session settings (no GPU needed to make them): no memory pattern, whose
    block came on top of the arena's chunks (on an H200 the ort_trainer process grew 1.68 GB per
    GPT-2 small sample against eager's 0.90), the graph's order, threads that stop spinning, and
    its own GPU arena rather than the CPU sessions' shared one."""
    options = ort.SessionOptions()
    devices.CUDADevice(0).configure_session(options)
    assert options.enable_mem_pattern is False
    assert options.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    with pytest.raises(Exception):  # no shared CPU arena entry: the CUDA provider's arena serves the GPU
        options.get_session_config_entry("session.use_env_allocators")


def test_sessions_the_engine_makes_stop_spinning_and_hold_activations_once():
    """Engine-made CPU sessions: threads stop spinning when a run ends, no memory pattern (it
    allocated a second copy of the activations beside the arena's), nodes in the graph's order
    (the default order ran the GPT-2-like loss's last reader of the log-probabilities after the
    whole backward); the user's own session options are used as given."""
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE)
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    made = trainer._engine._session_options
    assert made.enable_mem_pattern is False
    assert made.get_session_config_entry("session.force_spinning_stop") == "1"
    assert made.get_session_config_entry("session.use_env_allocators") == "1"
    assert made.execution_order == ort.ExecutionOrder.PRIORITY_BASED

    own = ort.SessionOptions()
    trainer = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE,
                         options=ORTTrainerOptions({"session_options": own}))
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert trainer._engine._session_options is own and own.enable_mem_pattern is True
    assert own.execution_order == ort.ExecutionOrder.DEFAULT
    with pytest.raises(Exception):  # no entry was added to the user's options
        own.get_session_config_entry("session.force_spinning_stop")


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from Linux's /proc")
def test_idle_arena_memory_goes_back_to_the_system_and_training_goes_on_exactly():
    """``CPUDevice.release_idle_memory`` (``save_as_onnx`` runs it before an export): the shared
    arena's free regions leave the process's resident memory, and the steps after it compute what
    steps without it compute, bit for bit."""
    def wide():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 9000), torch.nn.ReLU(), torch.nn.Linear(9000, 10))

    desc = {"inputs": [("x", ["batch", 64]), ("label", ["batch"], torch.int64)],
            "outputs": [("loss", [], True), ("logits", ["batch", 10])]}

    def losses(trainer, steps, release_after=None):
        generator, result = torch.Generator().manual_seed(1), []
        for step in range(steps):
            batch = (torch.randn(1024, 64, generator=generator), torch.randint(0, 10, (1024,), generator=generator))
            result.append(float(trainer.train_step(*batch)[0]))
            if step == release_after:
                before = _resident_mb()
                trainer._engine.placement.release_idle_memory()
                result.append(before - _resident_mb())
        return result

    # each [1024, 9000] float32 activation (35 MiB: past glibc's largest mmap threshold, 32 MiB, so its
    # arena region is a mapping of its own) is free between steps; unmapping even one frees 35 MiB
    released = losses(ORTTrainer(wide(), desc, AdamConfig(lr=1e-3), loss_fn=CE), 4, release_after=1)
    assert released[2] >= 30, f"released {released[2]:.1f} MB"
    uninterrupted = losses(ORTTrainer(wide(), desc, AdamConfig(lr=1e-3), loss_fn=CE), 4)
    assert released[:2] + released[3:] == uninterrupted


def test_the_bindings_let_go_of_the_outputs_a_step_returned():
    """A run's bindings hold none of the outputs they returned (each is bound anew at once): an
    output the caller drops goes back to the arena, where it would otherwise keep part of a region
    that the next run of another graph needs whole."""
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE)
    batch = mlp_batch(torch.Generator().manual_seed(0))
    loss, logits = trainer.train_step(*batch)
    eval_loss, eval_logits = trainer.eval_step(*batch)
    current = trainer._engine._current
    bindings = {"training": current.training.grad_bindings, "eval": [io.binding for io in current.evaluation()[1]]}
    for kind, per_parity in bindings.items():
        for binding in per_parity:
            values = binding._iobinding.get_outputs()
            returned = [values[i] for i in range(len(MLP_DESC["outputs"]))]  # bound first: the outputs
            assert not any(value.has_value() for value in returned), kind
    assert torch.isfinite(loss) and torch.isfinite(eval_loss)
    assert logits.shape == eval_logits.shape == (len(batch[0]), 5)


class _WideEval(torch.nn.Module):
    """A classifier that also returns a [batch, 18000] tensor, which a step fetching the loss alone
    never computes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.head = torch.nn.Linear(64, 9000), torch.nn.Linear(9000, 10)

    def forward(self, x, label):
        hidden = torch.relu(self.hidden(x))
        logits = self.head(hidden)
        return CE(logits, label), logits, torch.cat([hidden, hidden], 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from Linux's /proc")
def test_train_and_eval_phases_in_turn_hold_what_training_alone_holds(monkeypatch):
    """Going between training and evaluation (after two runs or more of one), the arena's idle memory
    goes back first: phases in turn, whose eval graph needs 70 MiB blocks that the training graph never
    asks for, leave the process where training alone leaves it; without the release, the eval's
    blocks stay on top. A loop that evaluates after every step keeps its regions (no release)."""
    desc = {"inputs": [("x", ["batch", 64]), ("label", ["batch"], torch.int64)],
            "outputs": [("loss", [], True), ("logits", ["batch", 10]), ("wide", ["batch", 18000])]}
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1024, 64, generator=generator), torch.randint(0, 10, (1024,), generator=generator))
               for _ in range(2)]

    def growth(release: bool) -> tuple[float, int]:
        released = []
        original = devices.CPUDevice.release_idle_memory
        monkeypatch.setattr(devices.CPUDevice, "release_idle_memory",
                            lambda self: released.append(1) or (original(self) if release else None))
        trainer = ORTTrainer(_WideEval(), desc, AdamConfig(lr=1e-3))
        trainer._train_step_info.fetches = ["loss"]
        for batch in batches * 2:
            trainer.train_step(*batch)
        trained = _resident_mb()
        for _ in range(2):  # eval and train phases in turn
            trainer._train_step_info.fetches = []
            for batch in batches:
                trainer.eval_step(*batch)
            trainer._train_step_info.fetches = ["loss"]
            for batch in batches:
                trainer.train_step(*batch)
        grown = _resident_mb() - trained
        for batch in batches * 2:  # evaluating after every step: a release entering it (2 steps before), then none
            trainer.eval_step(*batch)
            trainer.train_step(*batch)
        return grown, len(released)

    # each [1024, 18000] float32 output is 70 MiB, a region of its own in the arena
    kept, changes = growth(release=False)
    assert changes == 5
    if not _runtime.has_training_build():  # the gradient graph from PyTorch's autograd leaves the unfetched output out
        assert kept >= 60, f"without the release: {kept:.1f} MB more than training alone"
    released, changes = growth(release=True)
    assert released <= 20 and changes == 5, f"with the release: {released:.1f} MB more than training alone"


def test_the_step_seed_is_drawn_only_for_graphs_that_draw_random_numbers(monkeypatch):
    """Reseeding costs a SeedSequence per step: graphs without Dropout or random ops skip it,
    graphs with one (also inside an If branch) reseed before every run."""
    drop = helper.make_node("Dropout", ["x", "r", "t"], ["y"])
    plain = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [], [])
    assert not _signature_sessions._draws_random_numbers(plain)
    assert _signature_sessions._draws_random_numbers(helper.make_graph([drop], "g", [], []))
    branch = helper.make_graph([drop], "b", [], [])
    nested = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=plain)
    assert _signature_sessions._draws_random_numbers(helper.make_graph([nested], "g", [], []))

    seeds = []
    monkeypatch.setattr(ort, "set_seed", seeds.append)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE)
    asked = []
    monkeypatch.setattr(trainer, "_step_seed", lambda: asked.append(1) or 7)
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert asked == [] and seeds == []

    # with its masks drawn on the host (the CPU default) the graph has no Dropout left, but the
    # step still asks for the seed: the host draws from it instead of ONNX Runtime
    for host_masks, reseeded in ((False, [7, 7]), (True, [])):
        model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 5))
        trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-3), loss_fn=CE,
                             options={"graph_optimizations": {"host_dropout_masks": host_masks}})
        asked.clear(), seeds.clear()
        monkeypatch.setattr(trainer, "_step_seed", lambda: asked.append(1) or 7)
        for _ in range(2):
            trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
        assert asked == [1, 1] and seeds == reseeded


def _graph_with(shape: list[int]) -> onnx.ModelProto:
    """x -> Expand(x, shape) -> y, every size known: y is as large as ``shape`` says (no memory is made)."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, shape)],
        [helper.make_tensor("shape", TensorProto.INT64, [len(shape)], shape)],
        value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_largest_tensors_lists_every_value_of_known_size_the_largest_first():
    graph = _graph_with([4, 5]).graph
    graph.value_info.append(helper.make_tensor_value_info("unknown", TensorProto.FLOAT, ["batch", 3]))
    assert largest_tensors(graph) == [("y", [4, 5], 20), ("z", [4, 5], 20), ("shape", [2], 2),
                                              ("x", [1], 1)]


def test_a_graph_past_the_cuda_kernels_32_bit_indexing_is_refused_before_its_session(monkeypatch):
    """ONNX Runtime's CUDA kernels index with int32: GPT-2 small at batch 128 × 512 tokens failed in
    an Expand of its 3.3e9-element logits on an H200, and some kernels write wrong values instead.
    The CUDA device names every such tensor and the fix before a session exists; 2^31 - 1 elements
    pass; the CPU device runs anything."""
    logits = [128 * 512, 50257]
    with pytest.raises(ValueError, match=r"2 tensor\(s\) .* more than 2\^31 - 1 elements.*y \[65536, 50257\] "
                                         r"\(3\.29e\+09 elements\); z .*smaller batch.*gradient_accumulation_steps"):
        devices.CUDADevice(0).check_graph(_graph_with(logits))
    devices.CUDADevice(0).check_graph(_graph_with([2**31 - 1]))
    devices.CPUDevice(0).check_graph(_graph_with(logits))

    class Refusing(devices.CPUDevice):
        def check_graph(self, model):
            raise ValueError("refused")

    made = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *args, **kwargs: made.append(args))
    sessions = Sessions(Refusing(0), ort.SessionOptions(), [("CPUExecutionProvider", {})], [])
    with pytest.raises(ValueError, match="refused"):
        sessions.make_session(_graph_with([2, 2]))
    assert made == []  # the engine's sessions ask the device first: none was made

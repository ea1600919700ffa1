"""``graph_optimizations.seeded_dropout`` (``passes/dropout.seeded_dropout``) and its kernel, ``SeededDropout``.

ONNX Runtime's CUDA Dropout hands its generator's seed and offset to the kernel it launches, so a step captured as a
CUDA graph (``device.cuda_graph``) would replay the same masks every step. The pass writes each training Dropout as
one ``SeededDropout(x, seed)`` node of ort_trainer's kernel library: element i of node k is kept where word i % 4 of
the Philox4x32-10 block at counter (i / 4, k, 0) under the key ``seed`` is below round((1 - p) 2^32), and the seed is
a graph input the engine writes each step ((seed, rank, step)'s, as ONNX Runtime's generator is seeded otherwise).

Here, on the CPU, the generator is checked against Random123's known answers through a NumPy reference, the kernel
against that reference bit for bit (the CUDA kernel likewise under the emulation: ``test_cuda_emulated.py``), and a
captured step (its fixed bindings, as ``test_cuda_graph.py`` runs them without a GPU) with the pass forced against
float64 PyTorch given the same masks, and ``layer_recompute``'s copies of sublayers with dropout (the pass runs
before it on a GPU) against the same steps without them. The GPU test trains a captured tiny GPT-2 with dropout
against the same steps on the CPU: a replay that drew the captured masks again would part from them.
"""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

pytest.importorskip("onnxscript", reason="the 'torch' gradient source exports with onnxscript")

from models import tiny_gpt2  # noqa: E402
from test_cuda_graph import _options  # noqa: E402
from ort_trainer import ORTTrainer, ORTTrainerOptions, devices, kernels  # noqa: E402
from ort_trainer._step_io import CapturedIO  # noqa: E402
from ort_trainer.graph.passes.dropout import DROPOUT_SEED_INPUT  # noqa: E402
from ort_trainer.optim import AdamConfig, SGDConfig  # noqa: E402

from tolerances import FLOAT32, steps_bound  # noqa: E402

needs_compiler = pytest.mark.skipif(kernels._compilers()[1] is None and not kernels.cuda_kernels_at_hand(),
                                    reason="no C++ compiler to build the kernel library")

_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> list[np.ndarray]:
    """Random123's Philox4x32-10 in NumPy, elementwise over arrays of counters (four uint32 words) and one key (two)."""
    x = [np.asarray(word, np.uint64) for word in counter]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * x[0], np.uint64(0xCD9E8D57) * x[2]  # 64-bit products of 32-bit words
        x = [(p1 >> np.uint64(32)) ^ x[1] ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ x[3] ^ k1, p0 & _MASK32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _MASK32, (k1 + np.uint64(0xBB67AE85)) & _MASK32
    return [word.astype(np.uint32) for word in x]


def reference_mask(seed: int, stream: int, n: int, ratio: float) -> np.ndarray:
    """The keep mask of n elements of dropout node ``stream`` under ``seed`` (``kernels/csrc/philox.h``'s layout)."""
    groups = np.arange((n + 3) // 4, dtype=np.uint64)
    words = philox4x32_10([groups & _MASK32, groups >> np.uint64(32), np.full_like(groups, stream),
                           np.zeros_like(groups)], [seed & 0xFFFFFFFF, seed >> 32])
    draws = np.stack(words, axis=1).reshape(-1)[:n]
    return draws < np.uint64(min(round((1.0 - ratio) * 2.0 ** 32), 2 ** 32 - 1))


def test_the_reference_generator_gives_random123s_known_answers():
    """Random123's known-answer vectors of Philox4x32-10 (its tests/kat_vectors)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert [int(w) for w in philox4x32_10(counter, key)] == list(want)


_DTYPES = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16, TensorProto.BFLOAT16: torch.bfloat16}


def _session(elem_type: int, n: int, ratio: float, stream: int) -> ort.InferenceSession:
    """One SeededDropout node of ``elem_type`` between Casts from and to float32 (exact for values of that dtype)."""
    nodes = [helper.make_node("Cast", ["x"], ["x_t"], to=elem_type),
             helper.make_node("SeededDropout", ["x_t", "seed"], ["y_t", "mask"], domain=kernels.DOMAIN, ratio=ratio,
                              stream=stream),
             helper.make_node("Cast", ["y_t"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
                                           helper.make_tensor_value_info("seed", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]),
                               helper.make_tensor_value_info("mask", TensorProto.BOOL, [n])])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                   helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)])
    options = ort.SessionOptions()
    kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """y (of x's dtype) and the mask of one run."""
    y, mask = session.run(None, {"x": x.float().numpy(), "seed": np.array([seed], np.int64)})
    return torch.from_numpy(y).to(x.dtype), mask


@needs_compiler
@pytest.mark.parametrize("elem_type", list(_DTYPES), ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n, ratio, stream, seed", [(1001, 0.25, 3, 0x123456789ABCDEF), (4096, 0.1, 0, 7),
                                                    (5, 0.5, 1, 2 ** 63 - 1)])
def test_the_kernel_keeps_the_reference_masks_elements_scaled(elem_type, n, ratio, stream, seed):
    """The CPU kernel's mask is the reference's, bit for bit (odd lengths: a last block drawn in part), and y is
    x · 1/(1 - p) rounded once to the dtype where kept, x · 0 elsewhere (a dropped NaN stays NaN, -x gives -0, as
    torch's x · mask · scale)."""
    dtype = _DTYPES[elem_type]
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    x[:3] = torch.tensor([float("nan"), float("inf"), -2.0])
    x = x.to(dtype)
    y, mask = _run(_session(elem_type, n, ratio, stream), x, seed)
    want_mask = reference_mask(seed, stream, n, ratio)
    np.testing.assert_array_equal(mask, want_mask)
    scale = torch.tensor(1.0, dtype=torch.float32) / (1.0 - torch.tensor(ratio, dtype=torch.float32))
    want = (x.float() * torch.where(torch.from_numpy(want_mask), scale, torch.tensor(0.0))).to(dtype)
    assert torch.equal(y.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(y[finite].float().view(torch.int32), want[finite].float().view(torch.int32))


@needs_compiler
def test_the_masks_keep_their_share_and_are_independent_across_nodes_and_seeds():
    """2^20 elements at p = 0.1: the kept share within 6 standard deviations of 0.9 (sqrt(0.09 / 2^20) = 2.9e-4,
    so 1.8e-3); two nodes' masks under one seed, and one node's under two seeds, agree where independent masks
    would (0.1² + 0.9² = 0.82, within 6 · sqrt(0.82 · 0.18 / 2^20) = 2.3e-3); the same seed and node give the same
    mask."""
    n, ratio = 2 ** 20, 0.1
    x = torch.ones(n)
    session = _session(TensorProto.FLOAT, n, ratio, 0)
    other_node = _session(TensorProto.FLOAT, n, ratio, 1)
    first, again = _run(session, x, 11)[1], _run(session, x, 11)[1]
    np.testing.assert_array_equal(first, again)
    assert abs(first.mean() - 0.9) < 6 * (0.09 / n) ** 0.5
    for other in (_run(other_node, x, 11)[1], _run(session, x, 12)[1]):
        assert abs((first == other).mean() - 0.82) < 6 * (0.82 * 0.18 / n) ** 0.5


class DropNet(torch.nn.Module):
    """Linear, tanh, a dropout of p = 0.5, linear; its mean squared error against y inside."""

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(self.drop(torch.tanh(self.a(x)))), y)


_DROP_DESC = {"inputs": [("x", ["batch", 8]), ("y", ["batch", 4])], "outputs": [("loss", [], True)]}


def _captured_options(**graph_optimizations) -> ORTTrainerOptions:
    """``test_cuda_graph.py``'s captured CPU options (the engine binds as around a capture), the ``torch`` source,
    ONNX Runtime's CPU Dropout kept (no host-drawn masks)."""
    return _options(True, graph={"gradient_source": "torch"},
                    graph_optimizations={"host_dropout_masks": False, **graph_optimizations})


def _as_on_a_gpu(patch) -> None:
    """The CPU device draws repeatable masks as a GPU does (SeededDropout), a library with CUDA kernels as if at hand
    (here its CPU kernels run the nodes)."""
    patch.setattr(devices.CPUDevice, "seeded_dropout", True)
    patch.setattr(kernels, "cuda_kernels_at_hand", lambda: True)


@pytest.fixture
def _kernels_at_hand(monkeypatch):
    _as_on_a_gpu(monkeypatch)


@needs_compiler
def test_captured_steps_with_seeded_masks_are_float64_pytorchs_with_those_masks(_kernels_at_hand):
    """Four SGD steps of DropNet, captured-step bindings, the pass on: one SeededDropout node, the seed an input; each
    step's loss and the weights after it are float64 PyTorch's with the mask the reference draws from that step's
    seed (the trainer's (seed, rank, step) seed), within float32's rounding over the steps (steps_bound)."""
    torch.manual_seed(0)
    model = DropNet()
    reference = copy.deepcopy(model).double()
    trainer = ORTTrainer(model, _DROP_DESC, SGDConfig(lr=0.1), options=_captured_options())
    generator = torch.Generator().manual_seed(3)
    steps = 4
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
        seed = trainer._step_seed()
        loss = float(trainer.train_step(x, y))
        mask = torch.from_numpy(reference_mask(seed, 0, 16 * 32, 0.5).reshape(16, 32)).double()
        hidden = torch.tanh(reference.a(x.double())) * mask * 2.0
        want_loss = torch.nn.functional.mse_loss(reference.b(hidden), y.double())
        reference.zero_grad()
        want_loss.backward()
        want = float(want_loss.detach())
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        bound = steps_bound(step + 1)
        assert abs(loss - want) <= bound * max(abs(want), 1.0), (step, loss, want)
    nodes = [n for n in trainer._graphs.gradient.graph.node if n.op_type in ("Dropout", "SeededDropout")]
    assert [(n.op_type, n.domain) for n in nodes] == [("SeededDropout", kernels.DOMAIN)]
    assert isinstance(trainer._engine._current.training.grad_io[0], CapturedIO)
    weights = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():  # (atol: weights near 0, of magnitude below 1)
        np.testing.assert_allclose(weights[name].double(), value, rtol=steps_bound(steps), atol=steps_bound(steps))


def _gpt2_steps(options, steps: int, resume_at: int | None = None, optimizer=None) -> list[float]:
    """Losses of ``steps`` steps (Adam, or ``optimizer``) of the tiny GPT-2 with dropout 0.1; with ``resume_at``, a
    second trainer takes over the first's state there, as a resumed run would."""
    optimizer = optimizer or AdamConfig(lr=1e-3)
    torch.manual_seed(0)
    model, desc = tiny_gpt2(dropout=0.1)
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 50, (2, 8), generator=generator) for _ in range(steps)]
    trainer = ORTTrainer(copy.deepcopy(model), desc, optimizer, options=options())
    losses = []
    for step, ids in enumerate(batches):
        if step == resume_at:
            state = trainer.state_dict()
            trainer = ORTTrainer(copy.deepcopy(model), desc, optimizer, options=options())
            trainer.load_state_dict(state)
        out = trainer.train_step(ids, torch.ones_like(ids), ids)
        losses.append(float(out[0] if isinstance(out, (list, tuple)) else out))
    return losses


@needs_compiler
def test_a_resumed_captured_run_draws_what_an_uninterrupted_one_does(_kernels_at_hand):
    """The tiny GPT-2 with dropout 0.1 under captured bindings: 4 steps in one trainer and 2 + 2 in two (the state
    handed over) give the same losses (the seed is a function of (seed, rank, step), checkpointed)."""
    uninterrupted = _gpt2_steps(_captured_options, 4)
    # the same graph, the same float32 operations in the same order on state restored bit for bit: no difference
    # (observed: 0); the bound, a few roundings (test_checkpoint.py's RESUME_BOUND), is far under another mask's effect
    np.testing.assert_allclose(_gpt2_steps(_captured_options, 4, resume_at=2), uninterrupted, rtol=16 * FLOAT32)


@needs_compiler
def test_the_eval_graph_and_the_saved_model_run_without_the_nodes(_kernels_at_hand, tmp_path):
    """eval_step and save_as_onnx take the forward with each SeededDropout the identity: no node, no seed input."""
    torch.manual_seed(0)
    trainer = ORTTrainer(DropNet(), _DROP_DESC, SGDConfig(lr=0.1), options=_captured_options())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    trainer.train_step(x, y)
    loss = float(trainer.eval_step(x, y))
    eval_graph = trainer._graphs.eval
    assert eval_graph is not None
    assert not {"Dropout", "SeededDropout"} & {n.op_type for n in eval_graph.graph.node}
    assert DROPOUT_SEED_INPUT not in {i.name for i in eval_graph.graph.input}
    reference = DropNet()
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    reference.eval()
    with torch.no_grad():  # float32 both: two products of at most 32 terms, 64 u = 3.8e-6 apart at worst
        assert loss == pytest.approx(float(reference(x, y)), rel=1e-5)
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path))
    saved = onnx.load(str(path))
    assert not {"Dropout", "SeededDropout"} & {n.op_type for n in saved.graph.node}


def test_without_the_kernels_a_captured_dropout_is_refused_naming_the_fix(monkeypatch):
    """No library with CUDA kernels at hand: the pass stays off and the capture's refusal names it and its needs."""
    monkeypatch.setattr(devices.CPUDevice, "seeded_dropout", True)
    monkeypatch.setattr(kernels, "cuda_kernels_at_hand", lambda: False)
    model, desc = tiny_gpt2(dropout=0.1)
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-3), options=_captured_options())
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="device.cuda_graph") as info:
        trainer.train_step(ids, torch.ones_like(ids), ids)
    assert "graph_optimizations.seeded_dropout" in str(info.value) and "nvcc" in str(info.value)


# a captured GPU step against the CPU's, float32 without TF32 on either side (devices.py): each step's sums (at most
# 256 terms: the tiny GPT-2's 4 x 64-wide MLP) may add in another order, 256 u a step, carried through 4 SGD steps:
# 4 * 256 * 2^-24 = 6.1e-5, held to 1e-4 as test_cuda.py's; a replayed mask instead of a new one moves the loss by
# the dropout's whole effect (percents)
GPU_RTOL = 1e-4


@pytest.mark.cuda
def test_a_captured_gpu_step_draws_new_masks_each_replay():
    """Four captured SGD steps of the tiny GPT-2 with dropout 0.1 on the GPU (the pass on by default there) against
    the same four on the CPU with the pass forced: the same masks (one generator on both), so the same losses within
    float32's rounding; a replay that drew the captured masks again would part from the CPU's at the third step (the
    first replay)."""
    gpu = _gpt2_steps(lambda: ORTTrainerOptions({"graph": {"gradient_source": "torch"},
                                                 "device": {"id": "cuda", "cuda_graph": True}}), 4,
                      optimizer=SGDConfig(lr=0.1))
    with pytest.MonkeyPatch.context() as patch:
        _as_on_a_gpu(patch)
        cpu = _gpt2_steps(_captured_options, 4, optimizer=SGDConfig(lr=0.1))
    np.testing.assert_allclose(gpu, cpu, rtol=GPU_RTOL)


def test_the_engine_feeds_the_seed_as_one_int64():
    """``HostDropoutMasks.draw`` gives a graph with the seed input its seed as ``[seed mod 2^63]`` (an int64), any
    seed it is handed (NumPy's 128-bit entropy where no seed is given), and a graph without it nothing."""
    from ort_trainer.dropout_masks import HostDropoutMasks

    seeded = helper.make_model(helper.make_graph(
        [], "g", [helper.make_tensor_value_info(DROPOUT_SEED_INPUT, TensorProto.INT64, [1])], []))
    masks = HostDropoutMasks(seeded)
    assert masks
    for seed in (0, 2 ** 63 - 1, 2 ** 100 + 5):
        (name, value), = masks.draw(seed).items()
        assert name == DROPOUT_SEED_INPUT and value.dtype == np.int64 and value.tolist() == [seed % 2 ** 63]
    assert not HostDropoutMasks(helper.make_model(helper.make_graph([], "g", [], [])))


@needs_compiler
def test_layer_recompute_copies_seeded_dropouts_which_draw_the_same_masks(monkeypatch):
    """On a GPU, ``layer_recompute`` takes the tiny GPT-2's sublayers with dropout too: their Dropouts are
    SeededDropout nodes (the pass runs before it there), whose copies in the backward draw the forward's masks again.
    Forced on the CPU (the device's switch; the library's CPU kernels), not captured: all four sublayers are copied,
    their SeededDropouts with them, and two SGD steps give the losses and weights of the same seeded steps without
    the copies, bit for bit (the copies compute the same operators on the same values and draws)."""
    from test_layer_recompute import _regions

    _as_on_a_gpu(monkeypatch)
    model, desc = tiny_gpt2(dropout=0.1)
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 50, (2, 8), generator=generator) for _ in range(2)]
    runs = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        # the reference: the same seeded draws without the copies, which only a captured step takes (its bindings
        # compute bit for bit what the usual ones do: test_cuda_graph.py); sparse_labels off in both, as captured
        options = (ORTTrainerOptions({"graph": {"gradient_source": "torch"}, "device": {"id": "cpu"},
                                      "graph_optimizations": {"host_dropout_masks": False, "layer_recompute": True,
                                                              "sparse_labels": False}})
                   if recompute else _captured_options())
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.5), options=options)
        losses = [float(trainer.train_step(ids, torch.ones_like(ids), ids)[0]) for ids in batches]
        graph = trainer._graphs.gradient
        runs[recompute] = losses, trainer.state_dict(pytorch_format=True), graph
    graph = runs[True][2]
    assert len(_regions(graph)) == 4
    copied = [n for n in graph.graph.node if n.op_type == "SeededDropout" and "/layer_recompute" in n.name]
    forward = [n for n in graph.graph.node if n.op_type == "SeededDropout" and "/layer_recompute" not in n.name]
    assert copied and {_stream(n) for n in copied} <= {_stream(n) for n in forward}
    assert not _regions(runs[False][2]) and not [n for n in runs[False][2].graph.node if n.op_type == "Dropout"]
    assert runs[True][0] == runs[False][0]
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name


def _stream(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "stream")

"""The operator-record cache key (``graph/export/op_record.py``): equal exactly when the code computes the same.

A hit by record skips ``torch.export``, so everything the exported graph depends on must change
the record, and what a record cannot see must make it decline (None), leaving the build to the
trace. The integration tests run the ``torch`` gradient source with a fresh cache directory.
"""

import functools
import hashlib
import os
import random
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import (ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch,
                    torch_step)
from ort_trainer import ORTTrainer
from ort_trainer.graph.export import op_record
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig
from tolerances import steps_bound

REPO = Path(__file__).resolve().parent.parent
LR = 0.5
# Losses of 3 SGD steps of the 20-32-5 MLP, ONNX Runtime against eager PyTorch in float32: each side
# may add a dot product (≤ 32 terms, fc2) in another order, 32u of its magnitude per step (Higham's
# bound), carried through the weights once per step: steps_bound(3, length=32) = 5.7e-6 relative.
# (A sigmoid in place of the relu adds a few roundings of u per element, well inside it.) Observed
# at 1 and 2 threads: ≤ 0.013 of the bound, 78x under.
LOSS_BOUND = steps_bound(3, length=32)


def _batch(batch: int = 8):
    return mlp_batch(torch.Generator().manual_seed(0), batch)


_ON_FAKE = [None]  # the mode ``_key`` records in (None: by size); the ``on_fake`` fixture sets it


@pytest.fixture(params=[False, True], ids=["eager", "fake"])
def on_fake(request):
    """Key tests run twice: the record on real tensors (small models) and on fake ones (large)."""
    _ON_FAKE[0] = request.param
    yield request.param
    _ON_FAKE[0] = None


def _key(model, loss_fn=F.cross_entropy, batch=None, desc=MLP_DESC):
    arrays = [t.numpy() if isinstance(t, torch.Tensor) else t for t in (batch or _batch())]
    record = op_record.record(model, loss_fn, parse_model_desc(desc), arrays, op_record.exporting_flags,
                              on_fake=_ON_FAKE[0])
    return None if record is None else record.key


def _seeded(factory, *args, **kwargs):
    torch.manual_seed(0)
    return factory(*args, **kwargs)


# ---- models whose code the tests edit --------------------------------------------------------------
def _helper(h):
    return torch.relu(h)


def _train_only(h):
    return h * 2.0


def _eval_only(h):
    return h * 2.0


class _HelperMLP(MLP):
    def forward(self, x):
        return self.fc2(_helper(self.fc1(x)))


class _Branches(MLP):
    """Code that only training mode runs, and code that only eval mode runs."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            h = _train_only(h)
        if not self.training:
            h = _eval_only(h)
        return self.fc2(h)


class _Swappable(MLP):
    """Its ``forward`` is swapped by the tests (a code edit)."""


def _sigmoid_forward(self, x):
    return self.fc2(torch.sigmoid(self.fc1(x)))


class _Activation(MLP):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Normed(MLP):
    """Dropout and LayerNorm: Python attributes (p, eps) that only show in the operators' arguments."""

    def __init__(self, p: float = 0.1, eps: float = 1e-5):
        super().__init__()
        self.drop = torch.nn.Dropout(p)
        self.norm = torch.nn.LayerNorm(32, eps=eps)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(torch.relu(self.fc1(x)))))


class _Scaled(MLP):
    """A non-persistent buffer: a constant of the graph, not a weight."""

    def __init__(self, value: float = 1.0):
        super().__init__()
        self.register_buffer("scale", torch.full((32,), value), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


class _BatchNormed(MLP):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(32)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class _Cast(MLP):
    """Accepts any floating input dtype (so the dtype alone is what differs)."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.float())))


class _Relu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


class _CustomFunction(MLP):
    def forward(self, x):
        return self.fc2(_Relu.apply(self.fc1(x)))


class _ReadsItem(MLP):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.mean().item() > 1e9:
            h = h * 2
        return self.fc2(h)


class _Counts(MLP):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class _PythonDraw(MLP):
    """A layer kept where a Python draw says so: one forward shows one of its outcomes."""

    def __init__(self, seed=None):
        super().__init__()
        self.seed = seed

    def forward(self, x):
        h = self.fc1(x)
        if self.seed is not None:
            np.random.seed(self.seed)
        if np.random.random() >= 0.0:  # always kept: the record alone cannot tell it from an unconditional relu
            h = torch.relu(h)
        return self.fc2(h)


class _RandomModuleDraw(MLP):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * (1.0 if random.random() < 2.0 else 0.0))


# ---- 1. same code: same key, also in another process ----------------------------------------------
def test_other_weight_values_give_the_same_key(on_fake):
    first, second = _seeded(MLP), MLP()
    assert not torch.equal(first.fc1.weight, second.fc1.weight)
    key = _key(first)
    assert key is not None and len(key) == 64 and int(key, 16) >= 0
    assert _key(second) == key
    with torch.no_grad():
        first.fc2.bias.add_(1.0)
    assert _key(first) == key


KEYS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    import torch
    import torch.nn.functional as F
    from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, mlm_batch, mlm_loss, mlp_batch
    from ort_trainer.graph.export import op_record
    from ort_trainer.model_desc import parse_model_desc
    torch.manual_seed(1)  # other weights than the test process's
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    ids, labels = mlm_batch(torch.Generator().manual_seed(0))
    for model, loss, desc, batch in [(MLP(), F.cross_entropy, MLP_DESC, (x, y)),
                                     (TinyEncoder(dropout=0.1), mlm_loss, ENCODER_DESC, (ids, labels))]:
        print(op_record.record(model, loss, parse_model_desc(desc), [t.numpy() for t in batch],
                               op_record.exporting_flags).key)
""")


def test_the_key_is_the_same_in_a_fresh_process():
    script = KEYS_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    expected = [_key(MLP()), _key(TinyEncoder(dropout=0.1), mlm_loss, mlm_batch(torch.Generator().manual_seed(0)),
                                  ENCODER_DESC)]
    assert None not in expected
    assert done.stdout.split() == expected


# ---- 2. what the graph depends on changes the key ---------------------------------------------------
def _monkeypatched_forward():
    model = MLP()
    model.forward = lambda x: model.fc2(torch.sigmoid(model.fc1(x)))
    return model


def _frozen_bias():
    model = MLP()
    model.fc1.bias.requires_grad_(False)
    return model


def _edit_global(name, value):
    def edit(monkeypatch):
        monkeypatch.setattr(sys.modules[__name__], name, value)
    return edit


def _swap_forward(monkeypatch):
    monkeypatch.setattr(_Swappable, "forward", _sigmoid_forward)


# (name, before, after, edit applied between the two keys); each item of before/after is
# (model factory, loss_fn, batch factory)
_default = (F.cross_entropy, _batch)
CHANGES = [
    ("edited forward method", (_Swappable, *_default), (_Swappable, *_default), _swap_forward),
    ("monkeypatched instance forward", (MLP, *_default), (_monkeypatched_forward, *_default), None),
    ("module-level helper replaced", (_HelperMLP, *_default), (_HelperMLP, *_default),
     _edit_global("_helper", torch.sigmoid)),
    ("training-only branch edited", (_Branches, *_default), (_Branches, *_default),
     _edit_global("_train_only", lambda h: h * 3.0)),
    ("eval-only branch edited", (_Branches, *_default), (_Branches, *_default),
     _edit_global("_eval_only", lambda h: h * 3.0)),
    ("partial's keyword", (lambda: _Activation(functools.partial(F.gelu, approximate="none")), *_default),
     (lambda: _Activation(functools.partial(F.gelu, approximate="tanh")), *_default), None),
    ("dropout p", (lambda: _Normed(p=0.1), *_default), (lambda: _Normed(p=0.2), *_default), None),
    ("layer-norm eps", (lambda: _Normed(eps=1e-5), *_default), (lambda: _Normed(eps=1e-6), *_default), None),
    ("non-persistent buffer value", (lambda: _Scaled(1.0), *_default), (lambda: _Scaled(2.0), *_default), None),
    ("parameter shape", (MLP, *_default), (lambda: MLP(hidden=16), *_default), None),
    ("parameter requires_grad", (MLP, *_default), (_frozen_bias, *_default), None),
    ("input dtype", (_Cast, *_default),
     (_Cast, F.cross_entropy, lambda: (_batch()[0].double(), _batch()[1])), None),
    ("input shape", (MLP, *_default), (MLP, F.cross_entropy, lambda: _batch(4)), None),
    ("loss function", (MLP, *_default), (MLP, functools.partial(F.cross_entropy, reduction="sum"), _batch), None),
    ("loss function (another)", (MLP, *_default), (MLP, F.multi_margin_loss, _batch), None),
]


@pytest.mark.parametrize("before, after, edit", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_change_to_what_is_computed_changes_the_key(before, after, edit, monkeypatch, on_fake):
    model, loss_fn, batch = before
    old = _key(_seeded(model), loss_fn, batch())
    if edit is not None:
        edit(monkeypatch)
    model, loss_fn, batch = after
    new = _key(_seeded(model), loss_fn, batch())
    assert old is not None and new is not None
    assert new != old


def test_a_persistent_buffer_value_keeps_the_key(on_fake):
    model = _seeded(_BatchNormed)
    key = _key(model)
    with torch.no_grad():
        model.bn.running_mean.add_(1.0)
        model.bn.running_var.mul_(3.0)
        model.bn.num_batches_tracked.add_(5)
    assert key is not None and _key(model) == key


# ---- 3. what a record cannot see: no key, and the build traces as without a record ------------------
def _with_forward_hook():
    model = MLP()
    model.fc1.register_forward_hook(lambda module, args, out: out * 2)
    return model


def _with_forward_pre_hook():
    model = MLP()
    model.fc2.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    return model


def _with_full_backward_hook():
    model = MLP()
    model.fc1.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    return model


def _with_parameter_hook():
    model = MLP()
    model.fc1.weight.register_hook(lambda grad: grad * 2)
    return model


@torch.library.custom_op("ort_trainer_tests::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


_double.register_autograd(lambda ctx, grad: grad * 2)


class _CustomOperator(MLP):
    """A custom operator: its backward is Python code the record never runs."""

    def forward(self, x):
        return self.fc2(torch.relu(_double(self.fc1(x))))


class _SavedTensorHooks(MLP):
    """Pack/unpack hooks change what the backward reads; the record never runs the backward."""

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t * 2):
            h = torch.relu(self.fc1(x))
        return self.fc2(h)


DECLINED = {
    "custom operator": _CustomOperator,
    "saved-tensor hooks": _SavedTensorHooks,
    "forward hook": _with_forward_hook,
    "forward pre-hook": _with_forward_pre_hook,
    "full backward hook": _with_full_backward_hook,
    "parameter tensor hook": _with_parameter_hook,
    "custom autograd.Function": _CustomFunction,
    ".item() in forward": _ReadsItem,
    "forward changes an attribute": _Counts,
    "NumPy draw": _PythonDraw,
    "Python random draw": _RandomModuleDraw,
}


@pytest.mark.parametrize("factory", DECLINED.values(), ids=DECLINED.keys())
def test_what_a_record_cannot_see_gives_no_key(factory, on_fake):
    assert _key(_seeded(MLP)) is not None
    assert _key(_seeded(factory)) is None


def test_draws_after_a_seed_with_a_number_are_keyed_by_their_outcome(on_fake):
    """They are the same at every forward (Hugging Face's BigBird seeds NumPy before drawing its blocks)."""
    assert _key(_seeded(_PythonDraw, seed=0)) == _key(_seeded(_PythonDraw, seed=0)) is not None


def _options(**debug):
    return {"graph": {"gradient_source": "torch"}, **({"debug": debug} if debug else {})}


def _train(model, steps: int = 3, options=None) -> tuple[list[float], ORTTrainer]:
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=options or _options())
    gen = torch.Generator().manual_seed(0)
    return [float(trainer.train_step(*mlp_batch(gen))[0]) for _ in range(steps)], trainer


def _outcome(factory) -> tuple[str, object]:
    try:
        losses, _ = _train(_seeded(factory))
    except ExportError as error:
        return "refused", str(error)
    return "trained", losses


def _eager_losses(model, steps: int = 3) -> list[float]:
    reference = clone(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    return [torch_step(reference, optimizer, F.cross_entropy, (x,), y, None)
            for x, y in (mlp_batch(gen) for _ in range(steps))]


class _ExportCalls:
    """Wraps ``torch.export.export``: counts its calls, or refuses them once ``refuse`` is set."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.refuse = False
        self._export = torch.export.export
        monkeypatch.setattr(torch.export, "export", self)

    def __call__(self, *args, **kwargs):
        if self.refuse:
            raise AssertionError("torch.export ran although the graph should come from the cache by record")
        self.calls += 1
        return self._export(*args, **kwargs)


@pytest.fixture(scope="module")
def linked_cache(tmp_path_factory):
    """A cache holding the plain MLP's entry and the link of its record."""
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    root = tmp_path_factory.mktemp("linked_cache")
    saved = os.environ.get("ORT_TRAINER_CACHE_DIR")
    os.environ["ORT_TRAINER_CACHE_DIR"] = str(root)
    try:
        _, trainer = _train(_seeded(MLP))
    finally:
        os.environ["ORT_TRAINER_CACHE_DIR"] = saved
    assert trainer._graphs.from_cache is False and len(list((root / ".links").iterdir())) == 1
    return root


@pytest.mark.parametrize("factory", DECLINED.values(), ids=DECLINED.keys())
def test_without_a_key_the_build_traces_as_before(factory, linked_cache, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    expected = _outcome(factory)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(linked_cache))
    exports = _ExportCalls(monkeypatch)
    assert _outcome(factory) == expected
    assert exports.calls >= 1
    if factory is _CustomFunction:
        assert expected[0] == "refused" and "autograd.Function" in expected[1]


# ---- 4. the record leaves the model as it was -------------------------------------------------------
def _model_state(model):
    return ([(name, m.training) for name, m in model.named_modules()],
            [(name, b.clone()) for name, b in model.named_buffers()],
            [(name, p.requires_grad) for name, p in model.named_parameters()],
            [(name, p.detach().clone()) for name, p in model.named_parameters()])


@pytest.mark.parametrize("factory", [_BatchNormed, lambda: _Normed(p=0.5), _ReadsItem, _CustomFunction],
                         ids=["batchnorm", "dropout", "declined-item", "declined-function"])
def test_the_record_leaves_the_model_untouched(factory):
    model = _seeded(factory)
    model.eval()
    for child in list(model.children())[:1]:
        child.train()  # a mix of modes: each must come back as it was
    model.fc2.bias.requires_grad_(False)
    torch.manual_seed(7)
    before, rng = _model_state(model), torch.get_rng_state()
    _key(model)
    after = _model_state(model)
    assert after[0] == before[0] and after[2] == before[2]
    for (name, got), (_, expected) in zip(after[1] + after[3], before[1] + before[3]):
        assert torch.equal(got, expected), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.compiler.is_exporting() and not torch.compiler.is_compiling()


# ---- 5.-8. the pipeline: hits by record, edits, damaged links, debug dumps ---------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    root = tmp_path / "cache"
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(root))
    return root


def test_a_second_trainer_reuses_the_graph_without_exporting(cache, monkeypatch):
    exports = _ExportCalls(monkeypatch)
    first, trainer = _train(_seeded(MLP))
    assert trainer._graphs.from_cache is False and exports.calls >= 1
    exports.refuse = True
    model = _seeded(MLP)
    expected = _eager_losses(model)
    second, trainer = _train(model)
    assert trainer._graphs.from_cache is True and trainer._graphs.meta["gradient_source"] == "torch"
    assert second == first
    np.testing.assert_allclose(second, expected, rtol=LOSS_BOUND)


def _eval_loss(trainer) -> float:
    return float(trainer.eval_step(*mlp_batch(torch.Generator().manual_seed(1)))[0])


def _eval_differs():
    """BatchNorm: eval mode computes something else (the running statistics), so its graph is traced
    (a model that computes the same in both modes, Dropouts aside, takes the training graph's forward
    part instead: test_eval_from_training.py)."""
    return _BatchNormed()


def test_the_first_step_exports_training_mode_only_and_the_eval_graph_is_found_by_record(cache, monkeypatch):
    """A cold build exports the training-mode program alone (the eval-mode trace waits for the first
    evaluation); a second trainer then finds both graphs by the operator record, with no export."""
    exports = _ExportCalls(monkeypatch)
    losses, trainer = _train(_seeded(_eval_differs), steps=1)
    assert exports.calls == 1 and trainer._graphs.from_cache is False
    evaluated = _eval_loss(trainer)
    assert exports.calls == 2  # the eval-mode trace, on the first evaluation
    exports.refuse = True
    again, second = _train(_seeded(_eval_differs), steps=1)
    assert second._graphs.from_cache and again == losses
    assert _eval_loss(second) == evaluated


def test_an_eval_graph_never_built_is_built_after_a_hit_by_record(cache, monkeypatch):
    """The first process never evaluated: the second one, whose training graph came by record, traces
    the training program (to check the model is unchanged) and the eval program, and then links the
    eval graph to the record for a third."""
    _train(_seeded(_eval_differs), steps=1)
    exports = _ExportCalls(monkeypatch)
    _, second = _train(_seeded(_eval_differs), steps=1)
    assert second._graphs.from_cache and exports.calls == 0
    evaluated = _eval_loss(second)
    assert exports.calls == 2
    exports.refuse = True
    _, third = _train(_seeded(_eval_differs), steps=1)
    assert _eval_loss(third) == evaluated


def _saved_outputs(trainer, path: Path, batch: int) -> list[np.ndarray]:
    import onnxruntime as ort

    trainer.save_as_onnx(path)
    x, label = mlp_batch(torch.Generator().manual_seed(2), batch=batch)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"x": x.numpy(), "label": label.numpy()}
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def test_save_as_onnx_after_a_hit_by_record_loads_the_symbolic_eval_graph_with_no_export(cache, monkeypatch, tmp_path):
    """The symbolic eval graph ``save_as_onnx`` builds is linked to the training graph's operator
    record: a later trainer whose training graph came by record saves with no export either, and its
    file equals the first one's, at another batch size than the training batch's. The arena's idle
    memory is released before the export (``Device.release_idle_memory``), and only there."""
    from ort_trainer import devices

    releases = []
    release = devices.CPUDevice.release_idle_memory
    monkeypatch.setattr(devices.CPUDevice, "release_idle_memory", lambda self: releases.append(release(self)))
    exports = _ExportCalls(monkeypatch)
    _, first = _train(_seeded(MLP), steps=1)
    expected = _saved_outputs(first, tmp_path / "first.onnx", batch=3)
    assert exports.calls == 2  # the training-mode trace, then the symbolic eval-mode trace of the save
    assert len(releases) == 1
    first.save_as_onnx(tmp_path / "again.onnx")  # the graph is kept: no export, no release
    assert exports.calls == 2 and len(releases) == 1
    exports.refuse = True
    _, second = _train(_seeded(MLP), steps=1)
    assert second._graphs.from_cache
    got = _saved_outputs(second, tmp_path / "second.onnx", batch=3)
    assert len(releases) == 1
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)  # the same graph and weights: the same arithmetic, bit for bit


def test_edited_model_code_is_traced_again(cache, monkeypatch):
    exports = _ExportCalls(monkeypatch)
    first, _ = _train(_seeded(_Swappable))
    monkeypatch.setattr(_Swappable, "forward", _sigmoid_forward)
    exports.calls = 0
    model = _seeded(_Swappable)
    expected = _eager_losses(model)
    second, trainer = _train(model)
    assert exports.calls >= 1 and trainer._graphs.from_cache is False
    np.testing.assert_allclose(second, expected, rtol=LOSS_BOUND)
    # the edit changes what is trained: a difference, by far more than LOSS_BOUND (not a tolerance)
    assert abs(second[-1] - first[-1]) > 1e-3


def _delete_entry(entry: Path) -> None:
    for path in entry.iterdir():
        path.unlink()
    entry.rmdir()


def _corrupt_onnx(entry: Path) -> None:
    (entry / "gradient.onnx").write_bytes(b"not an onnx model")


@pytest.mark.parametrize("damage", [_delete_entry, _corrupt_onnx], ids=["entry deleted", "onnx corrupted"])
def test_a_link_to_a_missing_or_damaged_entry_traces_and_links_again(damage, cache, monkeypatch):
    first, _ = _train(_seeded(MLP))
    links = list((cache / ".links").iterdir())
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(links) == 1 and len(entries) == 1 and links[0].read_text() == entries[0].name
    damage(entries[0])
    exports = _ExportCalls(monkeypatch)
    model = _seeded(MLP)
    expected = _eager_losses(model)
    second, trainer = _train(model)
    assert exports.calls >= 1 and trainer._graphs.from_cache is False
    assert second == first
    np.testing.assert_allclose(second, expected, rtol=LOSS_BOUND)
    exports.refuse = True
    third, trainer = _train(_seeded(MLP))
    assert trainer._graphs.from_cache is True and third == first


def test_a_debug_dump_makes_the_hit_trace_and_dump_the_same_graphs(cache, tmp_path, monkeypatch):
    def dump_paths(name):
        folder = tmp_path / name
        folder.mkdir()
        return {p: str(folder / f"{p}.onnx") for p in
                ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
                 "model_with_training_graph_path")}

    def dumps(paths):
        return {name: hashlib.sha256(Path(p).read_bytes()).hexdigest() if Path(p).exists() else None
                for name, p in paths.items()}

    # a build with a dump looks nothing up by record, so the miss leaves an entry and no link
    miss_paths = dump_paths("miss")
    missed, trainer = _train(_seeded(MLP), options=_options(graph_save_paths=miss_paths))
    assert trainer._graphs.from_cache is False and not (cache / ".links").exists()
    linking, trainer = _train(_seeded(MLP))  # a hit by trace: links the record to the entry
    assert trainer._graphs.from_cache is True and len(list((cache / ".links").iterdir())) == 1
    exports = _ExportCalls(monkeypatch)
    hit_paths = dump_paths("hit")
    hit, trainer = _train(_seeded(MLP), options=_options(graph_save_paths=hit_paths))
    assert exports.calls >= 1 and trainer._graphs.from_cache is True
    exports.refuse = True
    by_record, trainer = _train(_seeded(MLP))  # without the dump the same job is a hit by record
    assert trainer._graphs.from_cache is True
    assert hit == missed == linking == by_record
    miss = dumps(miss_paths)
    assert all(miss.values()), miss
    assert dumps(hit_paths) == miss


# ---- code only the trace runs: each pair computes differently under torch.export, so the record
# must tell them apart (it runs eagerly on CPU tensors, grad on in both modes, with the flags the
# trace sets).
class _DeviceBranch(MLP):
    """A branch on the device: the trace's fake tensors are CPU tensors, as the record's are."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.device.type == "cpu":
            h = h * self.scale
        return self.fc2(h)


class _FxTracingBranch(_DeviceBranch):
    """``torch.fx`` tracing is on under the non-strict ``torch.export`` (make_fx), and in the record."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if torch.fx._symbolic_trace.is_fx_tracing():
            h = h * self.scale
        return self.fc2(h)


class _EvalGradBranch(_DeviceBranch):
    """The eval graph is exported with grad mode on; the record's eval forward runs with it on too."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if not self.training and torch.is_grad_enabled():
            h = h * self.scale
        return self.fc2(h)


class _Autocast(_DeviceBranch):
    """CPU autocast applies to the trace's CPU tensors and to the record's."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.scale != 2.0):
            h = torch.relu(self.fc1(x))
        return self.fc2(h.float())


class _IntermediateHook(MLP):
    """A hook on an intermediate tensor: the trace refuses it (ExportError); the record must decline."""

    def forward(self, x):
        h = self.fc1(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 2)
        return self.fc2(torch.relu(h))


GAPS = {
    "device.type branch": (lambda: _DeviceBranch(2.0), lambda: _DeviceBranch(3.0)),
    "is_fx_tracing branch": (lambda: _FxTracingBranch(2.0), lambda: _FxTracingBranch(3.0)),
    "eval-mode is_grad_enabled branch": (lambda: _EvalGradBranch(2.0), lambda: _EvalGradBranch(3.0)),
    "cpu autocast on/off": (lambda: _Autocast(2.0), lambda: _Autocast(3.0)),
}


@pytest.mark.parametrize("pair", GAPS.values(), ids=GAPS.keys())
def test_code_only_the_trace_runs_changes_the_key(pair, on_fake):
    first, second = (_key(_seeded(factory)) for factory in pair)
    assert first is None or first != second


def test_a_hook_on_an_intermediate_tensor_gives_no_key(on_fake):
    assert _key(_seeded(_IntermediateHook)) is None


_KEPT: list[bool] = []  # whether each record forward's autograd kept its intermediate


class _SavesItsInput(MLP):
    """``sin`` saves its input for the backward: an intermediate autograd would keep alive."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        ref = weakref.ref(h)
        out = self.fc2(torch.sin(h))
        del h
        _KEPT.append(ref() is not None)
        return out


def test_the_record_keeps_no_tensors_for_a_backward(on_fake):
    """The record's forward runs with grad enabled, as the trace does, but autograd saves nothing:
    it holds what an inference holds (the GPT-2-like model's peak RSS was this forward's)."""
    _KEPT.clear()
    assert _key(_seeded(_SavesItsInput)) is not None
    assert _KEPT == [False, False]  # train and eval mode
    _KEPT.clear()
    with torch.enable_grad():
        _seeded(_SavesItsInput)(_batch()[0])
    assert _KEPT == [True]  # the model itself: autograd keeps ``h``


class _ScalarConstant(MLP):
    """A non-persistent 0-d buffer: a constant of the graph, keyed by its value."""

    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


def test_a_zero_dimensional_constant_is_keyed_by_its_value(on_fake):
    two, three = _key(_seeded(_ScalarConstant, 2.0)), _key(_seeded(_ScalarConstant, 3.0))
    assert two is not None and three is not None and two != three
    assert _key(_seeded(_ScalarConstant, 2.0)) == two


# ---- 4. the record on fake tensors is the record on real ones -------------------------------------
_SEEN_FAKE: list[bool] = []


class _NotesFake(MLP):
    def forward(self, x):
        h = self.fc1(x)
        _SEEN_FAKE.append(isinstance(h, torch._subclasses.fake_tensor.FakeTensor))
        return self.fc2(torch.relu(h))


@pytest.mark.parametrize("case", [c[1] for c in CHANGES] + [c[2] for c in CHANGES],
                         ids=[f"{c[0]} (before)" for c in CHANGES] + [f"{c[0]} (after)" for c in CHANGES])
def test_a_fake_record_equals_the_eager_one(case):
    """A large model is recorded on fake tensors (no arithmetic); where the cache link was made by
    the other mode the key must still match, so both modes must give the same key."""
    model, loss_fn, batch = case
    arrays = [t.numpy() for t in batch()]
    keys = [op_record.record(_seeded(model), loss_fn, parse_model_desc(MLP_DESC), arrays,
                             op_record.exporting_flags, on_fake=fake) for fake in (False, True)]
    assert keys[0] is not None and keys[0] == keys[1]


def test_a_fake_record_of_the_encoder_equals_the_eager_one():
    ids, labels = mlm_batch(torch.Generator().manual_seed(0))
    keys = [op_record.record(_seeded(TinyEncoder, dropout=0.1), mlm_loss, parse_model_desc(ENCODER_DESC),
                             [ids.numpy(), labels.numpy()], op_record.exporting_flags, on_fake=fake)
            for fake in (False, True)]
    assert keys[0] is not None and keys[0] == keys[1]


def test_models_from_fake_above_weights_are_recorded_on_fake_tensors(monkeypatch):
    weights = sum(t.numel() for t in _NotesFake().state_dict().values())
    for threshold, fake in [(weights + 1, False), (weights, True)]:
        monkeypatch.setattr(op_record, "FAKE_ABOVE", threshold)
        _SEEN_FAKE.clear()
        assert _key(_seeded(_NotesFake)) is not None
        assert _SEEN_FAKE == [fake, fake]  # train and eval mode

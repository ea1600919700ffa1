"""The training graph is built once and reused from the disk cache, also by another process."""

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import onnx
import pytest
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer, _runtime
from ort_trainer._logging import logger
from ort_trainer.graph import cache as graph_cache
from ort_trainer.optim import AdamConfig, SGDConfig
from tolerances import check, steps_bound

JOB = textwrap.dedent("""
    import sys, torch
    import onnxruntime  # (onnxruntime-training imports torch.onnx and sympy itself)
    HEAVY = ("sympy", "torch._functorch.aot_autograd")
    runtime_imports = {{m for m in HEAVY if m in sys.modules}}
    sys.path.insert(0, {tests!r})
    from models import MLP, MLP_DESC, mlp_batch
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        loss = trainer.train_step(*mlp_batch(gen))[0]
    print("loss", repr(loss.item()))
    print("export stack:", sorted(m for m in HEAVY if m in sys.modules and m not in runtime_imports), file=sys.stderr)
""")


def _run_job(cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ORT_TRAINER_CACHE_DIR=str(cache_dir), ORT_TRAINER_LOG_LEVEL="INFO")
    script = JOB.format(tests=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=True)


def test_second_process_reuses_the_cached_graph(tmp_path):
    first = _run_job(tmp_path)
    second = _run_job(tmp_path)
    assert "built the training graph" in first.stderr and "reused" not in first.stderr
    assert "reused the cached training graph" in second.stderr and "built the training graph" not in second.stderr
    assert first.stdout == second.stdout  # same losses from the cached graph
    # a cached graph needs none of torch's export stack (sympy alone holds ~32 MB of the process)
    assert "export stack: []" in second.stderr
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    # the static-shape graph of the one batch shape the job uses (symbolic graphs only when needed)
    assert len(entries) == 1 and all((entry / "meta.json").exists() for entry in entries)


def test_cache_key_covers_what_shapes_the_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    batch = mlp_batch(torch.Generator().manual_seed(0))

    def build(model, config, **options):
        trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy,
                             options=options or None)
        trainer.train_step(*batch)
        return trainer._graphs.from_cache

    assert build(MLP(), AdamConfig(lr=1e-2)) is False
    assert build(MLP(), AdamConfig(lr=5e-2)) is True  # new initial weights are graph inputs
    # the optimizer graph is rebuilt every time (milliseconds); the cached gradient graph is shared
    assert build(MLP(), SGDConfig()) is True
    assert build(MLP(hidden=16), SGDConfig()) is False  # another architecture
    assert build(MLP(), SGDConfig(), utils={"frozen_weights": ["fc1.bias"]}) is False
    assert build(MLP(), SGDConfig(), utils={"frozen_weights": ["fc1.bias"]}) is True


def test_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    batch = mlp_batch(torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=torch.nn.functional.cross_entropy)
        trainer.train_step(*batch)
        assert trainer._graphs.from_cache is False


@pytest.mark.skipif(not _runtime.has_training_build(),
                    reason="the user's forward-graph hook exists only for the 'onnxruntime' gradient source, which "
                           "needs onnxruntime-training")
def test_user_hook_and_debug_graph_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    seen = []

    def hook(model: onnx.ModelProto):
        seen.append(sorted({n.op_type for n in model.graph.node}))
        model.graph.node[0].doc_string = "touched by the user's hook"

    paths = {
        "model_after_graph_transforms_path": str(tmp_path / "forward.onnx"),
        "model_with_gradient_graph_path": str(tmp_path / "gradient.onnx"),
        "model_with_training_graph_path": str(tmp_path / "optimizer.onnx"),
    }
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy,
                         options={"_internal_use": {"extra_postprocess": hook}, "debug": {"graph_save_paths": paths},
                                  "graph_optimizations": {"cross_entropy": False},
                                  "graph": {"gradient_source": "onnxruntime"}})
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    assert seen and "Gemm" in seen[0] and "SoftmaxCrossEntropyLoss" in seen[0]
    forward = onnx.load(paths["model_after_graph_transforms_path"])
    assert forward.graph.node[0].doc_string == "touched by the user's hook"
    sce = [n for n in forward.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"][0]
    assert len(sce.output) == 2  # the trainability pass added log_prob
    gradient = onnx.load(paths["model_with_gradient_graph_path"])
    assert {"fc1.weight_grad", "fc2.bias_grad"} <= {o.name for o in gradient.graph.output}
    optimizer = onnx.load(paths["model_with_training_graph_path"])
    outputs = {o.name for o in optimizer.graph.output}
    assert {"group0[0:837].Moment_1.out", "all_finite", "global_gradient_norm"} <= outputs  # one segment: 837 weights


def test_torch_source_debug_dumps_run_and_refuse_the_forward_hook(tmp_path, monkeypatch):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    import onnxruntime

    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    paths = _dump_paths(tmp_path / "dumps")
    options = {"debug": {"graph_save_paths": paths}, "graph": {"gradient_source": "torch"}}
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy,
                         options=options)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    trainer.train_step(x, y)
    # the forward dump is the eval-mode graph: with the trained weights it gives eval_step's outputs
    weights = trainer.state_dict()["model"]["full_precision"]
    forward = onnx.load(paths["model_after_graph_transforms_path"])
    feeds = {"x": x.numpy(), "label": y.numpy(), **{i.name: weights[i.name] for i in forward.graph.input
                                                    if i.name in weights}}
    session = onnxruntime.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, logits = session.run(["loss", "logits"], feeds)
    expected_loss, expected_logits = trainer.eval_step(x, y)
    # the dump is the graph the eval session runs, on the same weights and batch: the same float32
    # operations, no difference expected (observed at 1 and 2 threads: 0). Were the two sessions to
    # add the MLP's sums (≤ 32 terms) in another order, they could differ by 32u of the loss (≈ ln 5
    # = 1.6) and of the logits (≲ 1): ≈ 3e-6; 1e-6 is kept under that worst case
    check(abs(float(loss) - expected_loss.item()), 1e-6, "loss")
    check(float(abs(logits - expected_logits.numpy()).max()), 1e-6, "logits")
    gradient = onnx.load(paths["model_with_gradient_graph_path"])
    assert {"fc1.weight_grad", "fc2.bias_grad"} <= {o.name for o in gradient.graph.output}
    optimizer = onnx.load(paths["model_with_training_graph_path"])
    assert {"all_finite", "global_gradient_norm"} <= {o.name for o in optimizer.graph.output}
    hooked = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy,
                        options={**options, "_internal_use": {"extra_postprocess": lambda model: None}})
    with pytest.raises(ValueError, match=r"extra_postprocess .*gradient_source='onnxruntime'"):
        hooked.train_step(x, y)


def test_weight_names_are_checked_on_a_cache_hit_too(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    batch = mlp_batch(torch.Generator().manual_seed(0))
    ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=torch.nn.functional.cross_entropy).train_step(*batch)
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(params=[{"params": ["fc9.weight"]}]),
                         loss_fn=torch.nn.functional.cross_entropy)
    try:
        trainer.train_step(*batch)
    except ValueError as error:
        assert "'fc9.weight' is not a weight of the model" in str(error)
    else:
        raise AssertionError("an unknown weight name was accepted")
    assert trainer._graphs.from_cache is True


# ---- the key is what was traced: editing model or loss code can never reuse the old graph --------
def _helper(h):
    return torch.relu(h)


def _loss_helper(logits, label):
    return torch.nn.functional.cross_entropy(logits, label)


def _activation(h):
    return _activation.op(h)


_activation.op = torch.relu


class _HelperMLP(MLP):
    """Calls the module-level ``_helper`` (looked up at call time, as edited source would be)."""

    def forward(self, x):
        return self.fc2(_helper(self.fc1(x)))


class _AttributeMLP(MLP):
    """Its activation is a callable stored as a module attribute."""

    def __init__(self, act=torch.relu):
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _FunctionAttributeMLP(MLP):
    """Calls ``_activation``, whose behaviour is the function attribute ``_activation.op``."""

    def forward(self, x):
        return self.fc2(_activation(self.fc1(x)))


def _train(model, loss_fn, steps: int = 3) -> tuple[list[float], bool]:
    """Losses of a few SGD steps of ``model`` on fixed batches then an eval_step's (the eval graph is
    built, or loaded, on demand), and whether the training graph came from the cache."""
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.5), loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(0)
    losses = [float(trainer.train_step(*mlp_batch(gen))[0]) for _ in range(steps)]
    losses.append(float(trainer.eval_step(*mlp_batch(gen))[0]))
    return losses, trainer._graphs.from_cache


def _fresh(model_factory, loss_fn, monkeypatch, cache_dir) -> list[float]:
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", "off")
    losses, _ = _train(model_factory(), loss_fn)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(cache_dir))
    return losses


def _assert_new_code_trains(old, new, monkeypatch, tmp_path, old_loss=_loss_helper, new_loss=_loss_helper,
                            edit=lambda: None):
    """Train the old code (filling the cache), apply ``edit``, train the new code from the same cache."""
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    old_losses, _ = _train(old(), old_loss)
    edit()
    expected = _fresh(new, new_loss, monkeypatch, tmp_path)
    # the edit changes what is trained: a difference, by far more than rounding (not a tolerance)
    assert max(abs(a - b) for a, b in zip(expected, old_losses)) > 1e-3
    got, _ = _train(new(), new_loss)
    assert got == expected  # the new code's graph, never the old one from the cache


def _seeded(factory):
    """``factory`` with the torch seed reset first, so every model starts from the same weights."""
    def make():
        torch.manual_seed(0)
        return factory()
    return make


def test_editing_a_module_level_helper_called_by_forward_rebuilds(monkeypatch, tmp_path):
    module = sys.modules[__name__]
    _assert_new_code_trains(_seeded(_HelperMLP), _seeded(_HelperMLP), monkeypatch, tmp_path,
                            edit=lambda: monkeypatch.setattr(module, "_helper", torch.sigmoid))


def test_changing_a_callable_stored_as_a_module_attribute_rebuilds(monkeypatch, tmp_path):
    _assert_new_code_trains(_seeded(_AttributeMLP), _seeded(lambda: _AttributeMLP(torch.sigmoid)),
                            monkeypatch, tmp_path)


def test_changing_a_function_attribute_rebuilds(monkeypatch, tmp_path):
    _assert_new_code_trains(_seeded(_FunctionAttributeMLP), _seeded(_FunctionAttributeMLP), monkeypatch, tmp_path,
                            edit=lambda: monkeypatch.setattr(_activation, "op", torch.sigmoid))


def test_an_instance_level_monkeypatched_forward_rebuilds(monkeypatch, tmp_path):
    def patched():
        model = MLP()
        model.forward = lambda x: model.fc2(torch.sigmoid(model.fc1(x)))
        return model

    _assert_new_code_trains(_seeded(MLP), _seeded(patched), monkeypatch, tmp_path)


def test_a_loss_lambda_calling_an_edited_helper_rebuilds(monkeypatch, tmp_path):
    module = sys.modules[__name__]
    loss = lambda logits, label: _loss_helper(logits, label)  # noqa: E731 - the case under test
    _assert_new_code_trains(_seeded(MLP), _seeded(MLP), monkeypatch, tmp_path, old_loss=loss, new_loss=loss,
                            edit=lambda: monkeypatch.setattr(module, "_loss_helper", functools.partial(
                                torch.nn.functional.cross_entropy, reduction="sum")))


def test_a_partial_loss_with_other_keywords_rebuilds(monkeypatch, tmp_path):
    cross_entropy = torch.nn.functional.cross_entropy
    _assert_new_code_trains(_seeded(MLP), _seeded(MLP), monkeypatch, tmp_path,
                            old_loss=functools.partial(cross_entropy, reduction="mean"),
                            new_loss=functools.partial(cross_entropy, reduction="sum"))


# ---- debug dumps, damaged entries and stale temporaries ------------------------------------------
def _dump_paths(folder: Path) -> dict[str, str]:
    folder.mkdir()
    return {name: str(folder / f"{name}.onnx") for name in
            ("model_after_graph_transforms_path", "model_with_gradient_graph_path", "model_with_training_graph_path")}


def test_debug_graph_dumps_are_the_same_on_a_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    batch = mlp_batch(torch.Generator().manual_seed(0))
    dumps = []
    for run in ("miss", "hit"):
        paths = _dump_paths(tmp_path / run)
        trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy,
                             options={"debug": {"graph_save_paths": paths}})
        trainer.train_step(*batch)
        assert trainer._graphs.from_cache is (run == "hit")
        dumps.append({name: Path(path).read_bytes() if Path(path).exists() else None for name, path in paths.items()})
    miss, hit = dumps
    assert all(miss.values())
    assert hit == miss


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# Each tamper edits an entry (a training graph's, with gradient.onnx, or an eval graph's, with
# eval.onnx, which the torch gradient source stores apart) and says whether it applied.
def _drop_a_node(entry: Path) -> bool:
    for name in ("gradient.onnx", "eval.onnx"):
        if (entry / name).exists():
            model = onnx.load(str(entry / name))
            del model.graph.node[len(model.graph.node) // 2]
            onnx.save(model, str(entry / name))
    return True


def _rename_an_input(entry: Path) -> bool:
    if not (entry / "eval.onnx").exists():
        return False
    model = onnx.load(str(entry / "eval.onnx"))
    model.graph.input[0].name = "renamed"
    onnx.save(model, str(entry / "eval.onnx"))
    return True


def _meta_disagrees(entry: Path) -> bool:
    meta = json.loads((entry / "meta.json").read_text())
    if "trained" not in meta:
        return False
    meta["trained"] = meta["trained"][:-1]
    (entry / "meta.json").write_text(json.dumps(meta))
    return True


def _with_checksums_updated(tamper):
    """``tamper``, then the file checksums in meta.json rewritten to match: only the graph checks can tell."""
    def tampered(entry: Path) -> bool:
        if not tamper(entry):
            return False
        meta = json.loads((entry / "meta.json").read_text())
        meta["_files"] = {name: hashlib.sha256((entry / name).read_bytes()).hexdigest() for name in meta["_files"]}
        (entry / "meta.json").write_text(json.dumps(meta))
        return True
    tampered.__name__ = f"{tamper.__name__}_checksums_updated"
    return tampered


@pytest.mark.parametrize("tamper", [_drop_a_node, _rename_an_input, _meta_disagrees,
                                    _with_checksums_updated(_drop_a_node), _with_checksums_updated(_rename_an_input)],
                         ids=lambda tamper: tamper.__name__)
def test_a_damaged_entry_that_still_parses_is_rebuilt_with_a_warning(tamper, tmp_path, monkeypatch):
    # a model whose eval mode computes otherwise, so that its eval graph is traced and cached in an
    # entry of its own (one that computes the same in both modes takes the training graph's forward)
    model = _seeded(_EvalBranchMLP)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    _train(model(), torch.nn.functional.cross_entropy)
    entries = [p for p in sorted(tmp_path.iterdir()) if not p.name.startswith(".") and tamper(p)]
    assert entries
    records = _Records()
    logger.addHandler(records)
    try:
        losses, from_cache = _train(model(), torch.nn.functional.cross_entropy)
    finally:
        logger.removeHandler(records)
    assert from_cache is not any((entry / "gradient.onnx").exists() for entry in entries)  # rebuilt if tampered
    assert losses == _fresh(model, torch.nn.functional.cross_entropy, monkeypatch, tmp_path)
    for entry in entries:
        assert any(str(entry) in m and "rebuilding" in m for m in records.messages), records.messages
    again, from_cache = _train(model(), torch.nn.functional.cross_entropy)
    assert from_cache is True and again == losses  # the entry was overwritten with a good one


WRITER = textwrap.dedent("""
    import os, sys, time
    import onnx
    from onnx import helper, TensorProto
    from ort_trainer.graph import cache
    mode, root = sys.argv[1], sys.argv[2]

    def save(model, path, *args, **kwargs):
        open(path, "wb").write(b"partial")
        if mode == "killed":
            os._exit(9)  # like kill -9 in the middle of a store
        open(os.path.join(root, "writing"), "w").close()
        time.sleep(120)  # a live writer, still busy

    cache.onnx.save = save
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    cache.GraphCache(cache.Path(root)).store(sys.argv[3], {"gradient": helper.make_model(graph)}, {})
""")


def test_stale_temporaries_are_cleaned_up_by_the_next_store(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    live = subprocess.Popen([sys.executable, "-c", WRITER, "live", str(root), "b" * 64])
    try:
        deadline = time.time() + 120
        while not (root / "writing").exists():
            assert live.poll() is None and time.time() < deadline
            time.sleep(0.1)
        left_by_the_live_writer = [p for p in root.iterdir() if p.name.startswith(".")]
        assert len(left_by_the_live_writer) == 1
        killed = subprocess.run([sys.executable, "-c", WRITER, "killed", str(root), "a" * 64], timeout=120)
        assert killed.returncode == 9
        left_by_the_killed_writer = [p for p in root.iterdir() if p.name.startswith(".a")]
        assert len(left_by_the_killed_writer) == 1
        old = root / ".0123456789ab-x1y2z3w4"  # an older version's temporary, untouched for a day
        (old / "gradient.onnx").parent.mkdir()
        (old / "gradient.onnx").write_bytes(b"partial")
        day_ago = time.time() - 86400
        for path in (old / "gradient.onnx", old):
            os.utime(path, (day_ago, day_ago))

        monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(root))
        _train(_seeded(MLP)(), torch.nn.functional.cross_entropy)  # builds, so stores an entry

        assert not left_by_the_killed_writer[0].exists() and not old.exists()
        assert left_by_the_live_writer[0].exists()  # its writer is still busy with it
    finally:
        live.kill()
        live.wait()


def test_a_failed_store_leaves_no_temporary_behind(tmp_path, monkeypatch):
    def disk_full(model, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(graph_cache.onnx, "save", disk_full)
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    losses, _ = _train(_seeded(MLP)(), torch.nn.functional.cross_entropy)
    # ONNX Runtime's optimized graphs (.optimized/, written by ONNX Runtime, not onnx.save) are no graph entry
    assert [p for p in tmp_path.iterdir() if p.name != ".optimized"] == []
    assert losses == _fresh(_seeded(MLP), torch.nn.functional.cross_entropy, monkeypatch, tmp_path)


def _eval_helper(h):
    return torch.relu(h)


class _EvalBranchMLP(MLP):
    """Runs ``_eval_helper`` in eval mode only: the training graph never sees it."""

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h) if self.training else _eval_helper(h))


def test_editing_code_only_eval_mode_runs_rebuilds_the_eval_graph(monkeypatch, tmp_path):
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    batch = mlp_batch(torch.Generator().manual_seed(0))

    def eval_loss():
        torch.manual_seed(0)
        model = _EvalBranchMLP()
        # the torch source traces eval mode separately (the other freezes `self.training` branches)
        trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.5), loss_fn=_loss_helper,
                             options={"graph": {"gradient_source": "torch"}})
        loss = float(trainer.eval_step(*batch)[0])
        model.eval()
        with torch.no_grad():
            expected = float(_loss_helper(model(batch[0]), batch[1]))
        return loss, expected, trainer._graphs.from_cache

    # ONNX Runtime's eval loss against eager PyTorch: one forward of the MLP, whose sums (≤ 32 terms,
    # fc2) each side may add in another order: steps_bound(1, length=32) = 1.9e-6 relative (Higham's
    # bound); the loss's log-sum-exp (5 classes) and mean (8 rows) are shorter sums on top (observed
    # at 1 and 2 threads: ≤ 0.039 of the bound, 26x under)
    bound = steps_bound(1, length=32)
    loss, expected, _ = eval_loss()
    assert loss == pytest.approx(expected, rel=bound, abs=0)
    monkeypatch.setattr(sys.modules[__name__], "_eval_helper", torch.sigmoid)
    loss, expected_after, _ = eval_loss()
    assert abs(expected_after - expected) > 1e-3  # the edit changes what eval computes: a difference, not a tolerance
    assert loss == pytest.approx(expected_after, rel=bound, abs=0)  # the new eval graph, not the cached one
    _, _, from_cache = eval_loss()
    assert from_cache  # an unchanged model still hits the cache

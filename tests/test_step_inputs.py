"""A step's inputs (``ort_trainer/_inputs.py``) and the per-step checks kept short: what a batch of
remembered dtypes and shapes skips, and what it never skips."""

import numpy as np
import pytest
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer._inputs import StepInputs, to_numpy
from ort_trainer.amp.kernels import MissingKernelError, missing_kernels_explained
from ort_trainer.graph.export.index_rules import out_of_range
from ort_trainer.graph.export.input_checks import check_inputs
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig

CE = torch.nn.functional.cross_entropy


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("high", [None, 1, 5, 100])
def test_the_one_comparison_range_check_flags_what_the_two_comparisons_did(dtype, high):
    info = np.iinfo(dtype)
    edges = [info.min, info.min + 1, -1, 0, 1, 4, 5, 6, 99, 100, 101, info.max - 1, info.max]
    values = np.array([v for v in edges if info.min <= v <= info.max], dtype=dtype)
    values = np.concatenate([values, np.random.default_rng(0).integers(info.min, info.max, 200, dtype=dtype,
                                                                       endpoint=True)])
    wide = values.astype(object)  # Python ints: no wrap-around in the reference
    expected = np.array([v < 0 or (high is not None and v >= high) for v in wide])
    np.testing.assert_array_equal(out_of_range(values, 0, high), expected)
    np.testing.assert_array_equal(out_of_range(values.reshape(-1, 1)[::2], 0, high), expected.reshape(-1, 1)[::2])


def test_the_label_check_keeps_ignore_index_and_reports_each_other_value():
    constraints = {"indices": [{"steps": [{"op": "input", "name": "labels"}], "index": 0, "low": 0, "high": 5,
                                "ignore": -100, "what": "cross-entropy"}]}
    fine = {"labels": np.array([0, 4, -100, 3], dtype=np.int64)}
    assert check_inputs(constraints, fine, {}, training=True) == []
    bad = {"labels": np.array([0, -100, -7, 5, 9], dtype=np.int64)}
    [problem] = check_inputs(constraints, bad, {}, training=True)
    assert "value -7 at index [2]" in problem and "(3 invalid value(s) in this batch)" in problem
    assert "or -100 (ignore_index)" in problem


def test_inputs_of_a_remembered_dtype_and_shape_are_still_refused_with_another_dtype():
    inputs = StepInputs(parse_model_desc(MLP_DESC))
    dtypes = {"x": np.dtype(np.float32), "label": np.dtype(np.int64)}
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    feeds = inputs.feeds((x, y), {}, dtypes)
    assert np.shares_memory(feeds["x"], x.numpy())  # a view of the CPU tensor, not a copy
    assert inputs.feeds((x, y), {}, dtypes)["label"].dtype == np.int64  # remembered: the same answer
    with pytest.raises(TypeError, match="input 'label': expected dtype int64, got int32"):
        inputs.feeds((x, y.int()), {}, dtypes)
    with pytest.raises(ValueError, match=r"input 'label': dimension 0 \('batch'\) is 7 but 'batch' is 8"):
        inputs.feeds((x, y[:7]), {}, dtypes)
    # another dtype mapping (the graph was built since) forgets what was checked against the last one
    with pytest.raises(TypeError, match="input 'x': expected dtype float64, got float32"):
        inputs.feeds((x, y), {}, {"x": np.dtype(np.float64), "label": np.dtype(np.int64)})


def test_inputs_by_name_and_unusual_layouts_become_contiguous_arrays():
    inputs = StepInputs(parse_model_desc(MLP_DESC))
    dtypes = {"x": None, "label": None}
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    wide = torch.randn(20, 8).t()  # a transposed view: not C-contiguous
    feeds = inputs.feeds((wide,), {"label": y}, dtypes)
    assert feeds["x"].flags.c_contiguous and np.array_equal(feeds["x"], wide.numpy())
    assert inputs.feeds((x.requires_grad_(),), {"label": y.tolist()}, dtypes)["label"].dtype == np.int64
    assert to_numpy(np.float32(2.0), "s").shape == (1,)  # a 0-d value has one dimension, as before
    with pytest.raises(TypeError, match="input 'x': expected a torch tensor or numpy array, got list"):
        to_numpy([[1, 2], [3]], "x")  # ragged: no array


def test_a_change_of_fetches_is_checked_each_time_it_is_made():
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    assert len(trainer.train_step(x, y)) == 2  # no fetches: every output
    trainer._train_step_info.fetches = ["loss"]
    assert trainer.train_step(x, y).shape == ()
    trainer._train_step_info.fetches.append("logist")  # changed in place
    for _ in range(2):
        with pytest.raises(ValueError, match=r"TrainStepInfo.fetches: \['logist'\] are not outputs"):
            trainer.eval_step(x, y)
    trainer._train_step_info.fetches = ["logits", "loss"]
    logits, loss = trainer.eval_step(x, y)
    assert logits.shape == (8, 5) and loss.shape == ()
    assert trainer._train_step_info.step == 2


def test_fp32_steps_enter_one_shared_no_op_block_and_half_precision_keeps_its_translation():
    assert missing_kernels_explained(None, "cpu") is missing_kernels_explained(None, "cuda")
    with pytest.raises(KeyError):
        with missing_kernels_explained(None, "cpu"):
            raise KeyError("passes through")
    with pytest.raises(MissingKernelError, match="no bfloat16 kernel for MatMul"):
        with missing_kernels_explained("bfloat16", "cpu"):
            raise RuntimeError("NOT_IMPLEMENTED : Could not find an implementation for MatMul(13) node with name 'mm'")


def test_torch_threads_sets_the_count_for_the_block_and_restores_it_even_on_error():
    from ort_trainer.devices import torch_threads

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError):
        with torch_threads(1):
            raise KeyError("x")
    assert torch.get_num_threads() == before
    with torch_threads(0):  # 0: torch's own count, untouched
        assert torch.get_num_threads() == before


def test_the_automatic_host_thread_count_is_one_up_to_the_bound_and_torchs_own_above():
    from ort_trainer.devices import ONE_THREAD_UPDATE_WEIGHTS, host_threads

    assert host_threads(0, 2_100_000) == 1 and host_threads(0, ONE_THREAD_UPDATE_WEIGHTS) == 1
    assert host_threads(0, ONE_THREAD_UPDATE_WEIGHTS + 1) == 0  # 0: torch's own count, untouched
    assert host_threads(3, 10) == 3 and host_threads(1, 10**9) == 1  # a count given is kept


@pytest.mark.parametrize("option, inside", [(0, 1), (1, 1), (3, 3)])
def test_a_training_steps_host_work_runs_on_device_host_threads_torch_threads(option, inside, monkeypatch):
    """The fused update (torch's kernels) sees the option's count (0: one, for this small model);
    torch's own count is back after the step."""
    original_count = torch.get_num_threads()
    torch.set_num_threads(2)  # what a 2-core host gives; the option must win inside the step only
    try:
        trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE, options={"device": {"host_threads": option}})
        x, y = mlp_batch(torch.Generator().manual_seed(0))
        trainer.train_step(x, y)
        update, seen = trainer._engine.update, []
        original = update.step
        monkeypatch.setattr(update, "step", lambda *a, **k: seen.append(torch.get_num_threads()) or original(*a, **k))
        trainer.train_step(x, y)
        assert seen == [inside] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original_count)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_run_with_torchs_kernels_keeps_torchs_thread_count(kind, monkeypatch):
    """A graph with torch's kernels (here a convolution's, on the torch route) runs them on torch's threads: the
    run keeps torch's own count, where a graph of ONNX Runtime's kernels alone runs under the host work's one (so
    that torch's spinning workers leave ONNX Runtime its cores); the update sees one thread either way."""
    from ort_trainer._runtime import has_onnxscript

    if kind == "cnn" and not has_onnxscript():
        pytest.skip("the 'torch' gradient source exports with onnxscript")
    original_count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if kind == "cnn":
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                        torch.nn.Linear(4 * 6 * 6, 5))
            desc = {"inputs": [("x", ["batch", 3, 8, 8]), ("y", ["batch"])],
                    "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
            x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
            options = {"graph": {"gradient_source": "torch"}}
        else:
            model, desc, options = MLP(), MLP_DESC, {}
            x, y = mlp_batch(torch.Generator().manual_seed(0))
        trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=CE, options=options)
        trainer.train_step(x, y)
        engine, seen = trainer._engine, []
        assert engine.sessions.runs_torch_kernels is (kind == "cnn")
        for obj, name in ((engine, "forward_backward"), (engine.update, "step")):
            original = getattr(obj, name)
            monkeypatch.setattr(obj, name,
                                lambda *a, _f=original, **k: seen.append(torch.get_num_threads()) or _f(*a, **k))
        trainer.train_step(x, y)
        assert seen == [2 if kind == "cnn" else 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original_count)

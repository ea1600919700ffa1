"""save_as_onnx writes weights one at a time: inline below 2 GB, as ONNX external data above
(issue 24), the same model either way, and a failed write leaves an earlier save whole."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from models import ENCODER_DESC, TinyEncoder, mlm_batch, mlm_loss
from ort_trainer import ORTTrainer
from ort_trainer import _onnx_files
from ort_trainer.optim import AdamConfig
from tolerances import steps_bound

import ort_trainer.trainer as trainer_module

# eval_step against the saved model: the same graph on the same weights, in sessions that may
# fuse nodes differently, so each sum (at most TinyEncoder's 64 terms) may be added in another
# order: steps_bound(1) = 64u relative (Higham's bound), of the largest logit where logits cancel
# (test_save_as_onnx observes 0 here)
EVAL_BOUND = steps_bound(1)


@pytest.fixture(scope="module")
def trained():
    gen = torch.Generator().manual_seed(3)
    trainer = ORTTrainer(TinyEncoder(dropout=0.1), ENCODER_DESC, AdamConfig(lr=1e-3), loss_fn=mlm_loss)
    for _ in range(3):
        trainer.train_step(*mlm_batch(gen))
    return trainer, mlm_batch(gen, batch=3, seq=10)


def _engine_weights(trainer):
    return {name: tensor.numpy() for name, tensor in trainer._engine.current_tensors().items()}


def _run(path, ids):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids.numpy()})[0]


def test_inline_and_external_saves_hold_the_trained_weights_bit_for_bit(trained, tmp_path):
    trainer, (ids, labels) = trained
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    trainer.save_as_onnx(inline)
    trainer.save_as_onnx(external, external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["external.onnx", "external.onnx.data", "inline.onnx"]

    weights = _engine_weights(trainer)
    for path in (inline, external):
        model = onnx.load(str(path))  # loads the external data from the model's directory
        onnx.checker.check_model(model)
        values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
        read = [name for name in values if name in weights]
        consumed = {name for node in model.graph.node for name in node.input}
        assert read and set(read) == {name for name in weights if name in consumed}
        for name in read:
            np.testing.assert_array_equal(values[name], weights[name])  # written, not recomputed: equal bits

    located = onnx.load(str(external), load_external_data=False)
    stored = [init for init in located.graph.initializer if init.name in weights]
    assert all(init.data_location == onnx.TensorProto.EXTERNAL for init in stored)
    offsets = [int(dict((e.key, e.value) for e in init.external_data)["offset"]) for init in stored]
    assert all(offset % 4096 == 0 for offset in offsets)
    stored_bytes = sum(weights[init.name].nbytes for init in stored)
    assert inline.stat().st_size - external.stat().st_size > 0.95 * stored_bytes  # they are in the data file

    # the same graph and weights in two files: the same session, the same logits bit for bit
    logits = _run(inline, ids)
    np.testing.assert_array_equal(_run(external, ids), logits)
    np.testing.assert_allclose(trainer.eval_step(ids, labels)[1].numpy(), logits, rtol=EVAL_BOUND,
                               atol=EVAL_BOUND * float(np.abs(logits).max()))


def test_a_model_over_the_inline_limit_goes_to_external_data(trained, tmp_path, monkeypatch):
    trainer, (ids, _) = trained
    monkeypatch.setattr(_onnx_files, "INLINE_LIMIT", 10_000)  # the 2 GB rule, at this model's size
    with pytest.raises(ValueError, match="external_data=True"):
        trainer.save_as_onnx(tmp_path / "forced.onnx", external_data=False)
    assert not list(tmp_path.iterdir())
    trainer.save_as_onnx(tmp_path / "auto.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto.onnx", "auto.onnx.data"]
    np.testing.assert_array_equal(_run(tmp_path / "auto.onnx", ids), _run_inline(trainer, tmp_path, ids, monkeypatch))


def _run_inline(trainer, tmp_path, ids, monkeypatch):
    monkeypatch.setattr(_onnx_files, "INLINE_LIMIT", 2**31 - 2**26)
    trainer.save_as_onnx(tmp_path / "inline.onnx", external_data=False)
    return _run(tmp_path / "inline.onnx", ids)


@pytest.mark.parametrize("external", [False, True])
def test_a_failed_save_leaves_the_earlier_one_whole(trained, tmp_path, monkeypatch, external):
    trainer, (ids, labels) = trained
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(path, external_data=external)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    trainer.train_step(ids, labels)  # new weights: a save that went through would change the files

    calls = []

    def failing(tensor):  # the disk fills up on the third weight
        calls.append(tensor)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(tensor)

    real = trainer_module.host_array  # what reads each weight as the file is written
    monkeypatch.setattr(trainer_module, "host_array", failing)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_as_onnx(path, external_data=external)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary left either


def _adder(weights):
    """``y = x + w0 (+ w1...)``: a model reading the named weights, holding none of them."""
    from onnx import TensorProto, helper

    nodes, last = [], "x"
    for i, name in enumerate(weights):
        nodes.append(helper.make_node("Add", [last, name], [f"s{i}"]))
        last = f"s{i}"
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "adder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_the_weights_are_written_while_the_graph_is_built(tmp_path):
    """``save_while_building``: the build waits until the writing thread has read both weights (it
    would wait in vain for a write that began after it); the file is the model with them."""
    import threading

    values = {"w0": np.arange(4, dtype=np.float32), "w1": np.full(4, 10, dtype=np.float32)}
    specs = {name: ((4,), np.float32) for name in values}
    both_read = threading.Barrier(2, timeout=60)
    read = []

    def build():
        both_read.wait()  # released by the writer's read of w1
        return _adder(["w0", "w1"]), ["w0", "w1"]

    def reader(name):
        read.append(name)
        if name == "w1":
            both_read.wait()
        return values[name]

    path = tmp_path / "m.onnx"
    assert _onnx_files.save_while_building(build, path, specs, reader) is False
    assert read == ["w0", "w1"]
    x = np.ones(4, dtype=np.float32)
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(out, x + values["w0"] + values["w1"])
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


@pytest.mark.parametrize("early", [None, ["w0"]], ids=["all early: written again", "the read one early"])
def test_a_model_reading_fewer_weights_than_given_gets_only_those(early, tmp_path, monkeypatch):
    """Weights written early that the model does not read: the file is written again without them.
    Weights left for after the build (``early`` names the others) are written only if read."""
    values = {"w0": np.arange(4, dtype=np.float32), "unused": np.ones(4, dtype=np.float32),
              "late": np.full(4, 3, dtype=np.float32)}
    specs = {name: ((4,), np.float32) for name in values}
    path, again = tmp_path / "m.onnx", []
    real = _onnx_files.save_with_weights
    monkeypatch.setattr(_onnx_files, "save_with_weights",
                        lambda *args, **kwargs: again.append(1) or real(*args, **kwargs))
    read = []
    _onnx_files.save_while_building(lambda: (_adder(["w0", "late"]), ["w0", "late"]), path, specs,
                                    lambda name: read.append(name) or values[name], early=early)
    model = onnx.load(str(path))
    assert sorted(init.name for init in model.graph.initializer) == ["late", "w0"]  # none nobody reads
    onnx.checker.check_model(model)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    assert bool(again) == (early is None) and ("unused" in read) == (early is None)


def test_a_batchnorm_models_save_writes_its_trained_weights_while_building(tmp_path, monkeypatch):
    """A BatchNorm's ``num_batches_tracked`` is a weight of the training graph that eval mode does not
    read: the trained weights go early, the running statistics after the build, the counter not at
    all, and nothing is written twice."""
    from test_batchnorm import SmallCNN, _batch

    torch.manual_seed(0)
    desc = {"inputs": [("images", ["batch", 1, 10, 10]), ("labels", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 4])]}
    trainer = ORTTrainer(SmallCNN(), desc, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    images, labels = _batch(torch.Generator().manual_seed(1))
    trainer.train_step(images, labels)
    again = []
    monkeypatch.setattr(_onnx_files, "save_with_weights", lambda *args, **kwargs: again.append(1))
    trainer.save_as_onnx(tmp_path / "cnn.onnx")
    assert not again
    model = onnx.load(str(tmp_path / "cnn.onnx"))
    onnx.checker.check_model(model)
    names = {init.name for init in model.graph.initializer}
    consumed = {name for node in model.graph.node for name in node.input}
    assert names <= consumed and "bn1.running_mean" in names and "bn1.num_batches_tracked" not in names
    logits = ort.InferenceSession(str(tmp_path / "cnn.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"images": images.numpy()})[0]
    # the same eval graph on the same weights in another session, whose sums (at most fc's 8·3·3 = 72
    # terms) may be added in another order: steps_bound(1, 72) of the largest logit (Higham's bound)
    bound = steps_bound(1, length=72)
    np.testing.assert_allclose(trainer.eval_step(images, labels)[1].numpy(), logits, rtol=bound,
                               atol=bound * float(np.abs(logits).max()))


def test_a_build_that_fails_while_the_weights_are_written_leaves_the_earlier_save_whole(trained, tmp_path,
                                                                                        monkeypatch):
    trainer, _ = trained
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(path)
    before = path.read_bytes()
    monkeypatch.setattr(trainer._shapes, "symbolic_eval_graph",
                        lambda *_: (_ for _ in ()).throw(MemoryError("export")))
    with pytest.raises(MemoryError, match="export"):
        trainer.save_as_onnx(path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"] and path.read_bytes() == before


def test_inline_weights_over_the_limit_are_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(_onnx_files, "INLINE_LIMIT", 10)
    built = []
    with pytest.raises(ValueError, match="external_data=True"):
        _onnx_files.save_while_building(lambda: built.append(1), tmp_path / "m.onnx", {"w": ((4,), np.float32)},
                                        None, external_data=False)
    assert not built and not list(tmp_path.iterdir())

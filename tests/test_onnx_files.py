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

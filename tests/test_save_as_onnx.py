"""save_as_onnx: a deployable inference model equal to eval_step and to PyTorch's eval outputs."""

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from models import ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, mlm_batch, mlm_loss, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.graph.gradient import torch_export
from ort_trainer.optim import AdamConfig
from tolerances import steps_bound

# The exported model, eval_step and eager PyTorch compute one float32 forward on the same weights;
# ONNX Runtime may fold or fuse the exported graph's nodes differently from the eval session's, and
# PyTorch runs other kernels: each dot product may add its terms in another order, at most n·u of
# their magnitude apart for n terms (Higham's bound). The longest sum of TinyEncoder is 64 (its ff2
# layer): steps_bound(1) = 64u = 3.8e-6; the MLP's is 32 (fc2): 1.9e-6. Logits near 0 carry the
# error of the sums that produced them: the absolute part is the bound times the largest logit.
# Observed at 1 and 2 threads: ≤ 0.045 of the bound against PyTorch (22x under), 0 between the
# exported model and eval_step; the loss ≤ 0.061 of ENCODER_BOUND (16x under).
ENCODER_BOUND = steps_bound(1)
MLP_BOUND = steps_bound(1, length=32)


def _train(trainer, batches):
    for inputs in batches:
        trainer.train_step(*inputs)


def test_encoder_with_dropout_exports_an_inference_model(tmp_path, monkeypatch):
    # a cache of its own: where another test saved this model, the symbolic eval graph would be found
    # by the training graph's operator record, with no trace at all
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    gen = torch.Generator().manual_seed(7)
    model = TinyEncoder(dropout=0.1)
    trainer = ORTTrainer(model, ENCODER_DESC, AdamConfig(lr=1e-3), loss_fn=mlm_loss)
    _train(trainer, [mlm_batch(gen) for _ in range(5)])
    path = tmp_path / "encoder.onnx"
    exports = []
    export = torch_export.export_program
    monkeypatch.setattr(torch_export, "export_program", lambda wrapper, *args: exports.append(wrapper.model.training)
                        or export(wrapper, *args))
    trainer.save_as_onnx(path)
    assert exports == [False]  # one symbolic trace, in eval mode: no training-mode trace for an export

    exported = onnx.load(str(path))
    onnx.checker.check_model(exported)
    assert [i.name for i in exported.graph.input] == ["ids"]  # the label is dropped
    assert [o.name for o in exported.graph.output] == ["logits"]  # the loss is not the model's
    assert not [n for n in exported.graph.node if n.op_type == "Dropout"]
    dims = [d.dim_param for d in exported.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq"]

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids, labels = mlm_batch(gen, batch=3, seq=10)
    (onnx_logits,) = session.run(None, {"ids": ids.numpy()})
    eval_loss, eval_logits = trainer.eval_step(ids, labels)
    atol = ENCODER_BOUND * float(np.abs(onnx_logits).max())
    np.testing.assert_allclose(onnx_logits, eval_logits.numpy(), rtol=ENCODER_BOUND, atol=atol)

    trainer.update_torch_model()
    model.eval()
    with torch.no_grad():
        torch_logits = model(ids)
    np.testing.assert_allclose(onnx_logits, torch_logits.numpy(), rtol=ENCODER_BOUND, atol=atol)
    # the loss adds a log-sum-exp over 50 classes and a mean over the labelled positions: sums
    # shorter than the 64 of the bound, on logits within it
    assert eval_loss.item() == pytest.approx(mlm_loss(torch_logits, labels).item(), rel=ENCODER_BOUND)


def test_eval_step_changes_nothing_and_is_deterministic():
    gen = torch.Generator().manual_seed(8)
    trainer = ORTTrainer(TinyEncoder(dropout=0.3), ENCODER_DESC, AdamConfig(lr=1e-3), loss_fn=mlm_loss)
    ids, labels = mlm_batch(gen)
    first = trainer.eval_step(ids, labels)
    before = trainer.state_dict()["model"]["full_precision"]
    second = trainer.eval_step(ids=ids, labels=labels)
    torch.testing.assert_close(first[1], second[1], rtol=0, atol=0)
    after = trainer.state_dict()["model"]["full_precision"]
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    assert trainer._train_step_info.step == 0


def test_mlp_export_and_torch_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(9)
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    _train(trainer, [mlp_batch(gen) for _ in range(10)])
    path = tmp_path / "mlp.onnx"
    trainer.save_as_onnx(str(path))
    x, y = mlp_batch(gen, batch=16)
    (onnx_logits,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})

    fresh = MLP()
    fresh.load_state_dict(trainer.state_dict(pytorch_format=True))
    atol = MLP_BOUND * float(np.abs(onnx_logits).max())
    with torch.no_grad():
        np.testing.assert_allclose(fresh(x).numpy(), onnx_logits, rtol=MLP_BOUND, atol=atol)
    np.testing.assert_allclose(trainer.eval_step(x, y)[1].numpy(), onnx_logits, rtol=MLP_BOUND, atol=atol)


def test_save_as_onnx_into_a_missing_directory_is_an_error(tmp_path):
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    trainer.eval_step(*mlp_batch(torch.Generator().manual_seed(0)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.save_as_onnx(tmp_path / "no" / "such" / "dir" / "m.onnx")


def test_state_dict_before_first_step_returns_initial_weights():
    model = MLP()
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    state = trainer.state_dict(pytorch_format=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    nested = trainer.state_dict()
    assert set(nested["model"]["full_precision"]) == set(model.state_dict())
    assert nested["train_step_info"] == {"step": 0, "optimization_step": 0, "seed": trainer._seed}


_KILLED_EXPORT = """
import sys, time
import onnx, torch
sys.path.insert(0, {tests!r})
from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig
import ort_trainer._onnx_files as onnx_files

trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
trainer.save_as_onnx(sys.argv[1])

def killed_midway(out, name, value):  # part of the file written, then the OOM killer's SIGKILL lands
    out.write(value.tobytes()[:100])
    out.flush()
    print("writing", flush=True)
    time.sleep(120)

onnx_files._write_initializer = killed_midway
trainer.save_as_onnx(sys.argv[1])
"""


def test_a_killed_save_as_onnx_leaves_the_old_file_and_the_next_write_removes_its_temporary(tmp_path):
    """Issue 23: ``save_as_onnx`` killed mid-write left a ``.model.onnx.XXXX.tmp`` for good."""
    target = tmp_path / "model.onnx"
    script = _KILLED_EXPORT.format(tests=str(Path(__file__).parent))
    writer = subprocess.Popen([sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[1] == "model.onnx" and left[0].startswith(".model.onnx.") and left[0].endswith(".tmp")
    onnx.checker.check_model(onnx.load(str(target)))  # the first save, whole: the killed one never replaced it
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    trainer.eval_step(*mlp_batch(torch.Generator().manual_seed(0)))
    trainer.save_as_onnx(tmp_path / "other.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "other.onnx"]


@pytest.mark.parametrize("masked", [True, False], ids=["attention-mask", "no-mask"])
def test_the_eval_program_of_hugging_face_gpt2_translates_without_a_second_trace(tmp_path, monkeypatch, masked):
    """HF GPT-2's eval-mode program has translations for every operator once ``aten.__and__``,
    ``aten.to`` and the export's metadata checks are canonicalized and ``aten.diff`` (called without
    an attention mask) is decomposed alone (``eval_program.forward_program``): ``save_as_onnx`` then
    runs no ``run_decompositions`` (a second trace of the whole program, 13.8 of GPT-2 small's 24.7 s
    save), and the saved model computes the same bits as the one translated after that
    decomposition, which stays the path of any other program."""
    from models import tiny_gpt2
    from ort_trainer.graph.gradient import eval_program

    model, desc = tiny_gpt2(seq=16)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if not masked:
        desc = {**desc, "inputs": [i for i in desc["inputs"] if i[0] != "attention_mask"]}
    decompositions = []
    real = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda self, *a, **k: decompositions.append(1) or real(self, *a, **k))
    outputs = {}
    for as_is in (True, False):
        monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / f"cache_{as_is}"))
        if not as_is:
            monkeypatch.setattr(eval_program, "_node_decompositions", lambda program: None)
        trainer = ORTTrainer(copy.deepcopy(model), desc, AdamConfig(lr=0.0),
                             options={"graph": {"gradient_source": "torch"}})
        trainer.train_step(*((ids, mask, ids) if masked else (ids, ids)))
        del decompositions[:]
        trainer.save_as_onnx(tmp_path / f"gpt2_{as_is}.onnx")
        assert len(decompositions) == (0 if as_is else 1)
        session = ort.InferenceSession(str(tmp_path / f"gpt2_{as_is}.onnx"), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "labels": ids.numpy()}
        if not masked:
            del feeds["attention_mask"]
        outputs[as_is] = session.run(None, feeds)
    for got, expected in zip(outputs[True], outputs[False]):
        np.testing.assert_array_equal(got, expected)


class _Untranslated(torch.nn.Module):
    """Operators the exporter has no translation for: ``torch.diff`` in several forms (``n`` of 1
    and 2, ``prepend`` and ``append``, another dimension, booleans) and ``torch.var_mean`` (a tuple
    read by ``getitem``s); with ``n = 0`` (a copy: ``zeros_like`` + ``copy_``) too when ``copied``."""

    def __init__(self, copied: bool = False):
        super().__init__()
        self.copied = copied

    def forward(self, x):
        first = x[:, :1] - 1
        differences = (torch.diff(x), torch.diff(x, n=2, dim=0), torch.diff(x, prepend=first, append=x[:, -2:]),
                       torch.diff(x > 0, dim=-1))
        if self.copied:
            differences += (torch.diff(x, n=0, dim=1),)
        return *differences, *torch.var_mean(x, dim=1)


@pytest.mark.parametrize("copied", [False, True], ids=["decomposed-alone", "mutating-decomposition"])
def test_an_operator_without_a_translation_is_decomposed_alone_with_symbolic_sizes(copied):
    """``aten.diff`` (HF's packed-sequence check when GPT-2 is called without an attention mask)
    and ``aten.var_mean`` have no translation of their own: ``forward_program`` decomposes each such
    node alone, in place, instead of the whole program, unless a node's decomposition mutates
    (``n = 0``'s ``copy_``): then the whole program is decomposed, as before. Either way torch.diff's
    outputs are the same float64 arithmetic as eager's (two ``slice``s and a ``sub``, concatenated with
    ``prepend`` and ``append``), so equal bit for bit, at sizes other than the traced ones too."""
    from ort_trainer.graph.gradient import eval_program

    batch, length = torch.export.Dim("batch", min=4), torch.export.Dim("length", min=3)
    program = torch.export.export(_Untranslated(copied), (torch.randn(4, 6, dtype=torch.float64),),
                                  dynamic_shapes={"x": {0: batch, 1: length}})
    untranslated = {torch.ops.aten.diff.default, torch.ops.aten.var_mean.dim}
    assert untranslated <= {n.target for n in program.graph.nodes}
    forward = eval_program.forward_program(program)
    assert (forward is program) == (not copied)  # rewritten in place, or decomposed whole
    assert not untranslated & {n.target for n in forward.graph.nodes}
    for shape in ((4, 6), (7, 3), (5, 11)):
        x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))
        *got, variance, mean = forward.module()(x)
        *expected, expected_variance, expected_mean = _Untranslated(copied)(x)
        for value, reference in zip(got, expected, strict=True):
            assert value.dtype == reference.dtype and torch.equal(value, reference)
        # the decomposition's sums of at most 11 float64 terms, in another order than eager's
        # kernel: apart by a few n·u = 11 · 1.1e-16 (Higham) relative; 1e-12 is a wide margin
        torch.testing.assert_close(variance, expected_variance, rtol=1e-12, atol=0)
        torch.testing.assert_close(mean, expected_mean, rtol=1e-12, atol=1e-15)


class _TokensAndLabels(torch.nn.Module):
    """A token classifier whose loss flattens its logits and its labels: their lengths must be one."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, tokens, labels):
        return torch.nn.functional.cross_entropy(self.head(self.embedding(tokens)).flatten(0, 1), labels.flatten())


class _FixedImage(torch.nn.Module):
    """A classifier that checks its image size, as Hugging Face's ViT and CLIP do."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3 * 4 * 4, 3)

    def forward(self, images, labels):
        if images.shape[2] * images.shape[3] != 16:
            raise ValueError(f"Input image size ({images.shape[2]}*{images.shape[3]}) doesn't match model (4*4).")
        return torch.nn.functional.cross_entropy(self.head(images.flatten(1)), labels)


@pytest.mark.parametrize("make, shapes, batch, named", [
    (_TokensAndLabels, (["batch", "seq"], ["batch", "label_length"]),
     (torch.randint(0, 10, (2, 6)), torch.randint(0, 10, (2, 6))),
     ["(tokens[0] ('batch')*tokens[1] ('seq'))", "labels[1] ('label_length')"]),
    (_FixedImage, (["batch", 3, "height", "width"], ["batch"]), (torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2,))),
     ["Input image size (images[2] ('height')*images[3] ('width')) doesn't match model (4*4)"]),
])
def test_a_model_that_ties_dimensions_model_desc_names_apart_is_refused_naming_them(make, shapes, batch, named,
                                                                                  capfd):
    """A model that requires two dimensions model_desc names differently to be equal (or one to be a given size)
    trains at the first batch's sizes, but the symbolic export of ``save_as_onnx`` traces each name at a size of
    its own: torch's error wrote ``s21*s41``; it names the inputs' dimensions and model_desc's names, with the fix.
    torch's own log of the failed operator stays off stderr. (The 'onnxruntime' source's TorchScript export traces
    the sample's values and raises nothing.)"""
    from ort_trainer.graph.export.torchscript import ExportError

    desc = {"inputs": [("tokens" if make is _TokensAndLabels else "images", shapes[0]), ("labels", shapes[1])],
            "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(make(), desc, AdamConfig(lr=1e-3), options={"graph": {"gradient_source": "torch"}})
    trainer.train_step(*batch)
    capfd.readouterr()
    with pytest.raises(ExportError) as info:
        trainer.save_as_onnx(os.devnull)
    for text in [*named, "give them one name in model_desc", "declare that size as an int"]:
        assert text in str(info.value)
    assert "fake_tensor" not in capfd.readouterr().err

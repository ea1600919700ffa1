"""Bad input gets a clear error naming the problem and the fix, before any work is lost."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import IODescription, ModelDescription, ORTTrainer, _runtime
from ort_trainer.graph.export.torchscript import ExportError
from ort_trainer.graph.gradient.ort_builder import GradientBuildError
from ort_trainer.optim import AdamConfig, SGDConfig
from tolerances import FLOAT32

CE = torch.nn.functional.cross_entropy


@pytest.fixture(params=["onnxruntime", "torch"])
def source(request):
    """A gradient source, for errors each route raises its own way (skipped where not installed)."""
    if request.param == "onnxruntime" and not _runtime.has_training_build():
        pytest.skip("the 'onnxruntime' gradient source needs the onnxruntime-training 1.19.2 build")
    if request.param == "torch" and not _runtime.has_onnxscript():
        pytest.skip("the 'torch' gradient source exports with onnxscript")
    return request.param


def _on(source):
    return {"graph": {"gradient_source": source}}


@pytest.fixture
def trainer():
    return ORTTrainer(MLP(), MLP_DESC, SGDConfig(lr=0.1), loss_fn=CE)


@pytest.fixture
def batch():
    return mlp_batch(torch.Generator().manual_seed(0))


def test_too_many_positional_inputs(trainer, batch):
    with pytest.raises(ValueError, match=r"got 3 positional inputs but model_desc declares 2: \['x', 'label'\]"):
        trainer.train_step(*batch, batch[1])


def test_missing_input(trainer, batch):
    with pytest.raises(ValueError, match=r"missing input\(s\) \['label'\]"):
        trainer.train_step(batch[0])


def test_unknown_input_name(trainer, batch):
    with pytest.raises(ValueError, match=r"input 'lable' is not in model_desc.inputs \['x', 'label'\]"):
        trainer.train_step(batch[0], lable=batch[1])


def test_input_given_twice(trainer, batch):
    with pytest.raises(ValueError, match="'x' was given both positionally and by name"):
        trainer.train_step(batch[0], batch[1], x=batch[0])


def test_static_dimension_mismatch(trainer, batch):
    with pytest.raises(ValueError, match=r"input 'x': dimension 1 must be 20, got 19 \(shape \[8, 19\]\)"):
        trainer.train_step(batch[0][:, :19], batch[1])


def test_rank_mismatch(trainer, batch):
    with pytest.raises(ValueError, match=r"input 'x': expected 2 dimensions \['batch', 20\], got shape \[160\]"):
        trainer.train_step(batch[0].reshape(-1), batch[1])


def test_symbolic_dimension_disagreement(trainer, batch):
    with pytest.raises(ValueError, match=r"input 'label': dimension 0 \('batch'\) is 7 but 'batch' is 8 in input 'x'"):
        trainer.train_step(batch[0], batch[1][:7])


def test_wrong_dtype_after_the_graph_is_built(trainer, batch):
    trainer.train_step(*batch)
    with pytest.raises(TypeError, match="input 'x': expected dtype float32, got float64"):
        trainer.train_step(batch[0].double(), batch[1])
    with pytest.raises(TypeError, match="input 'label': expected dtype int64, got int32"):
        trainer.eval_step(batch[0], batch[1].int())


def test_wrong_dtype_against_the_description():
    desc = {"inputs": [("x", ["batch", 20], torch.float32), ("label", ["batch"], np.int64)],
            "outputs": [("loss", [], True), ("logits", ["batch", 5])]}
    trainer = ORTTrainer(MLP(), desc, SGDConfig(), loss_fn=CE)
    assert trainer._engine is not None  # all dtypes known: built at construction
    with pytest.raises(TypeError, match="input 'x': expected dtype float32, got float16"):
        trainer.train_step(torch.zeros(2, 20, dtype=torch.float16), torch.zeros(2, dtype=torch.int64))


class _Diff(torch.nn.Module):
    def forward(self, x):
        return torch.diff(x, dim=1)


class _WithDiff(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.differences = _Diff()

    def forward(self, x):
        return self.differences(self.fc(x)).sum()


class _Sign(torch.nn.Module):
    def forward(self, x):
        return torch.sign(x) * x


class _WithSign(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.signs = _Sign()

    def forward(self, x):
        return self.signs(self.fc(x)).sum()


class _Cummax(torch.nn.Module):
    def forward(self, x):
        return torch.cummax(x, dim=1)[0]


class _WithCummax(_WithDiff):
    def __init__(self):
        super().__init__()
        self.differences = _Cummax()


class _Mode(torch.nn.Module):
    def forward(self, x):
        return x * torch.mode(x.round(), dim=1)[0][:, None]


class _WithMode(_WithDiff):
    def __init__(self):
        super().__init__()
        self.differences = _Mode()


class _Pool(torch.nn.Module):
    """Average pooling: its forward translates; its backward operator (``avg_pool2d_backward``) does only through
    ort_trainer's decomposition, which the test takes away."""

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(x.reshape(-1, 1, 2, 2), 2)


class _WithPool(_WithDiff):
    def __init__(self):
        super().__init__()
        self.differences = _Pool()


class _ComplexRotary(torch.nn.Module):
    """A rotation as Meta's Llama code writes its rotary embedding: pairs of features as complex numbers,
    rotated (here by angles the input gives)."""

    def forward(self, x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotation = torch.polar(torch.ones_like(x[..., :2]), x[..., 2:])
        return torch.view_as_real(pairs * rotation).flatten(-2)


class _WithComplexRotary(_WithDiff):
    def __init__(self):
        super().__init__()
        self.differences = _ComplexRotary()


class _Igamma(torch.nn.Module):
    def forward(self, x):
        return torch.igamma(x.abs() + 1.0, torch.ones_like(x))


class _WithIgamma(_WithSign):
    def __init__(self):
        super().__init__()
        self.signs = _Igamma()


LOSS_ONLY = {"inputs": [("x", ["batch", 4])], "outputs": [("loss", [])]}


def test_unexportable_op_names_the_op_and_the_module(capfd, source):
    if source == "torch":  # torch.export traces aten::diff; torch's ONNX exporter has no mode
        trainer = ORTTrainer(_WithMode(), LOSS_ONLY, SGDConfig(), options=_on(source))
        with pytest.raises(ExportError, match=r"no translation for aten\.mode\.default.*"
                                              r"pip install .*\(in module differences \(_Mode\)\)"):
            trainer.train_step(torch.randn(2, 4))
        return
    trainer = ORTTrainer(_WithCummax(), LOSS_ONLY, SGDConfig(), options=_on(source))
    with pytest.raises(ExportError, match=r"operator aten::cummax in module differences \(_Cummax\) cannot be "
                                          r"exported"):
        trainer.train_step(torch.randn(2, 4))
    assert "Torch IR graph" not in capfd.readouterr().out  # the exporter's dump stays out of stdout


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_a_backward_operator_without_translation_names_the_module_whose_backward_uses_it(monkeypatch):
    """An operator only the backward uses is not in the traced forward: the joint program's node carries the
    module of the forward node it differentiates."""
    from ort_trainer.graph.gradient import backward_decompositions, joint_onnx

    monkeypatch.delitem(backward_decompositions.DECOMPOSITIONS, torch.ops.aten.avg_pool2d_backward.default)
    joint_onnx._registry_and_tables.cache_clear()
    try:
        trainer = ORTTrainer(_WithPool(), LOSS_ONLY, SGDConfig(), options=_on("torch"))
        with pytest.raises(ExportError, match=r"no translation for aten\.avg_pool2d_backward\.default.*"
                                              r"\(in module differences \(_Pool\)'s backward\)"):
            trainer.train_step(torch.randn(2, 4))
    finally:
        monkeypatch.undo()
        joint_onnx._registry_and_tables.cache_clear()


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_complex_tensors_the_exporter_cannot_translate_are_named_with_their_module():
    """torch's exporter fails on complex tensors in a training graph with an operator that says little
    (``prims.convert_element_type``, ``aten.alias``): the error names the modules computing complex values."""
    trainer = ORTTrainer(_WithComplexRotary(), LOSS_ONLY, SGDConfig(), options=_on("torch"))
    with pytest.raises(ExportError, match=r"no translation for .*the model computes with complex tensors \(in module "
                                          r"differences \(_ComplexRotary\)\).*rotate_half"):
        trainer.train_step(torch.randn(2, 4))


# An operator whose output's size comes from its input's values and which has no fake implementation to size it
# (torch's own such operators, F.ctc_loss's kernel, now have one; ort_trainer/graph/export/ctc.py)
torch.library.define("ort_trainer_tests::positives", "(Tensor x) -> Tensor", tags=(torch.Tag.dynamic_output_shape,))
torch.library.impl("ort_trainer_tests::positives", "CPU", lambda x: x[x > 0])


class _Alignment(torch.nn.Module):
    """A sum over the positive values, by an operator torch's fake tensors cannot size before the step."""

    def forward(self, x):
        return torch.ops.ort_trainer_tests.positives(x).sum()


class _WithAlignment(_WithSign):
    def __init__(self):
        super().__init__()
        self.signs = _Alignment()


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_an_operator_whose_output_is_sized_by_its_values_is_named_with_its_line_and_module():
    trainer = ORTTrainer(_WithAlignment(), LOSS_ONLY, SGDConfig(), options=_on("torch"))
    with pytest.raises(ExportError, match=r"Operator ort_trainer_tests\.positives\.default \(called in module signs "
                                          r"\(_Alignment\) at .*test_errors\.py:\d+ \(return torch\.ops\.ort_tr.*\) "
                                          r"returns a tensor whose shape depends on its inputs' values"):
        trainer.train_step(torch.randn(6, 4))


class _Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 3, batch_first=True)

    def forward(self, x):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([3, 2]), batch_first=True)
        return self.rnn(packed)[1][0].sum()


@pytest.mark.skipif(not _runtime.has_training_build(), reason="the 'onnxruntime' gradient source needs the "
                    "onnxruntime-training 1.19.2 build")
def test_a_packed_sequence_is_refused_on_the_torchscript_route_naming_the_line_and_the_fix():
    """The TorchScript exporter stopped with "vector::_M_range_check"; the 'torch' source trains packed sequences
    (test_packed_sequences.py)."""
    trainer = ORTTrainer(_Packed(), {"inputs": [("x", [2, 3, 4])], "outputs": [("loss", [])]}, SGDConfig(),
                         options=_on("onnxruntime"))
    with pytest.raises(ExportError, match=r"nn\.utils\.rnn\.pack_padded_sequence in module <top-level forward> "
                                          r"\(_Packed\) at .*test_errors\.py:\d+ \(packed = .*\): .*the sum of "
                                          r"the lengths' values.*gradient_source='torch'.*masked by the lengths"):
        trainer.train_step(torch.randn(2, 3, 4))


class _LUFactor(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.lu_factor(x[:4, :4] @ x[:4, :4].T + 4 * torch.eye(4)).LU.sum()


class _WithLUFactor(_WithSign):
    def __init__(self):
        super().__init__()
        self.signs = _LUFactor()


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_a_linalg_operator_autograd_fails_on_is_named_with_its_module():
    """torch's own joint trace fails on torch.linalg's LU factorisation (an IndexError of its retrace): the error
    names it and its module (inverses, solves, determinants: test_linalg.py, and Cholesky factorisations and
    triangular solves: test_cholesky.py, train)."""
    trainer = ORTTrainer(_WithLUFactor(), LOSS_ONLY, SGDConfig(), options=_on("torch"))
    with pytest.raises(ExportError, match=r"(torch\.linalg operators, which the export cannot differentiate or "
                                          r"translate: |no translation for )aten\.linalg_lu_factor(_ex)?\.default.*"
                                          r"\(in module signs \(_LUFactor\)\)"):
        trainer.train_step(torch.randn(6, 4))


def test_op_without_gradient_names_the_op_and_the_module(source):
    if source == "onnxruntime":
        trainer = ORTTrainer(_WithSign(), LOSS_ONLY, SGDConfig(), options=_on(source))
        with pytest.raises(GradientBuildError, match=r"no gradient for operator Sign \(in module signs\)"):
            trainer.train_step(torch.randn(2, 4))
        return
    # autograd has Sign's gradient (zero), so the torch route trains it exactly as PyTorch does ...
    torch.manual_seed(0)
    model, x = _WithSign(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, LOSS_ONLY, SGDConfig(lr=0.5), options=_on(source))
    trainer.train_step(x)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(x).backward()
    optimizer.step()
    got = trainer.state_dict(pytorch_format=True)
    # w − 0.5 · Σ sign(h)·x over the 3 rows: the sum rounds twice (relative to Σ|x|), the product by
    # 0.5 is exact, the subtraction rounds once: 3 roundings of u per side on magnitudes
    # |w| + 0.5·Σ|x| ≤ 2 (here ≤ 1.9, the bias ≤ 0.34 + 0.5·3): 2 · 3 · u · 2 = 7.2e-7 apart
    # (observed at 1 and 2 threads: 0)
    atol = 2 * 3 * FLOAT32 * 2.0
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=atol)
    # ... and refuses, naming operator and module, what PyTorch has no gradient for either
    trainer = ORTTrainer(_WithIgamma(), LOSS_ONLY, SGDConfig(), options=_on(source))
    with pytest.raises(ExportError, match=r"could not differentiate the traced model \(in module signs \(_Igamma\)\): "
                                          r"the derivative for 'igamma: input' is not implemented"):
        trainer.train_step(torch.randn(2, 4))


def test_output_count_mismatch_is_explained():
    desc = {"inputs": MLP_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", 5]), ("extra", [])]}
    trainer = ORTTrainer(MLP(), desc, SGDConfig(), loss_fn=CE)
    with pytest.raises(ExportError, match=r"are 2 tensor\(s\) but model_desc.outputs declares 3"):
        trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))


def test_cuda_without_the_cuda_build(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])  # as on a CPU-only install
    with pytest.raises(ValueError, match=r"device.id: 'cuda' was asked for but the installed ONNX Runtime has no CUDA "
                                         r"provider .*pip install \"ort_trainer\[cuda\]\""):
        ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=CE, options={"device": {"id": "cuda"}})


def test_bad_arguments_at_construction():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module or an onnx.ModelProto, got str"):
        ORTTrainer("model.pt", MLP_DESC, SGDConfig())
    with pytest.raises(TypeError, match="optim_config: expected SGDConfig, AdamConfig or LambConfig, got dict"):
        ORTTrainer(MLP(), MLP_DESC, {"lr": 0.1})
    with pytest.raises(ValueError, match="loss_fn must be None when model is an ONNX model"):
        ORTTrainer(onnx.ModelProto(), MLP_DESC, SGDConfig(), loss_fn=CE)


def test_model_description_errors_name_every_field():
    bad = {"inputs": [("x", ["batch", -3]), ("x", "batch")], "outputs": [("loss", [], True), ("y", [1.5], True)]}
    with pytest.raises(ValueError) as info:
        ORTTrainer(MLP(), bad, SGDConfig())
    message = str(info.value)
    assert "model_desc.inputs[0].shape[1]: a static dimension must be >= 0, got -3" in message
    assert "model_desc.inputs[1].shape: expected a list of int or str dimensions, got 'batch'" in message
    assert "model_desc.outputs[1].shape[0]: expected an int or a str, got 1.5" in message
    with pytest.raises(ValueError, match=r"exactly one output may have is_loss=True, got \['loss', 'y'\]"):
        ModelDescription([IODescription("x", [2])], [IODescription("loss", [], is_loss=True),
                                                     IODescription("y", [], is_loss=True)]).validate()
    with pytest.raises(ValueError, match=r"model_desc: unknown keys \['output'\]"):
        ORTTrainer(MLP(), {"inputs": [], "output": []}, SGDConfig())


def test_unknown_weight_names_in_groups_and_frozen_weights(batch):
    config = AdamConfig(params=[{"params": ["fc1.wieght"], "lambda_coef": 0.0}])
    trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=CE, options={"utils": {"frozen_weights": ["fc3.bias"]}})
    with pytest.raises(ValueError) as info:
        trainer.train_step(*batch)
    assert "AdamConfig.params[0]: 'fc1.wieght' is not a weight of the model" in str(info.value)
    assert "utils.frozen_weights: 'fc3.bias' is not a weight of the model" in str(info.value)
    assert "known weights: fc1.bias, fc1.weight, fc2.bias, fc2.weight" in str(info.value)


def test_check_model_export_names_the_diverging_output(source, monkeypatch, tmp_path):
    from ort_trainer.graph.export.torchscript import ExportMismatchError

    def corrupt(model):  # a broken graph transform: the logits pick up a constant (the loss, being
        # shift-invariant, still matches: the check must name logits)
        import onnx.helper as h
        import onnx.numpy_helper as nh

        graph = model.graph
        producer = next(n for n in graph.node if "logits" in n.output)
        producer.output[list(producer.output).index("logits")] = "logits_before"
        graph.initializer.append(nh.from_array(np.array(0.5, np.float32), "half"))
        graph.node.append(h.make_node("Add", ["logits_before", "half"], ["logits"]))

    options = {"debug": {"check_model_export": True}, **_on(source)}
    if source == "torch":  # no forward graph to post-process: corrupt the eval graph the source built
        from ort_trainer.graph.gradient.torch import TorchGradientSource

        built = TorchGradientSource.build_eval

        def corrupted(self, *args, **kwargs):
            result = built(self, *args, **kwargs)
            corrupt(result)
            return result

        monkeypatch.setattr(TorchGradientSource, "build_eval", corrupted)
        # the eval graph of a model that computes the same in both modes: the gradient graph's forward part
        from ort_trainer.graph import eval_graphs

        part = eval_graphs.eval_part

        def corrupted_part(*args, **kwargs):
            result = part(*args, **kwargs)
            corrupt(result)
            return result

        monkeypatch.setattr(eval_graphs, "eval_part", corrupted_part)
        monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))  # the corrupted graphs stay out of the cache
    else:
        options["_internal_use"] = {"extra_postprocess": corrupt}
    trainer = ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=CE, options=options)
    with pytest.raises(ExportMismatchError, match="output 'logits' of the exported model differs from PyTorch .max abs difference 0.5"):
        trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    monkeypatch.undo()
    healthy = ORTTrainer(MLP(), MLP_DESC, SGDConfig(), loss_fn=CE,
                         options={"debug": {"check_model_export": True}, **_on(source)})
    healthy.train_step(*mlp_batch(torch.Generator().manual_seed(0)))  # a faithful export passes the check

"""The "torch" source's passes of ``graph/_graph.py`` (dropout_gradient, sequences, output_reshape)
and the Dropout keeper: each against float64 PyTorch gradients, with its effect on the graph."""

import copy
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.passes import copies, dropout, embedding, forward, tied_embedding
from ort_trainer.graph import passes
from ort_trainer.graph.onnx_graph import drop_dead_nodes
from ort_trainer.optim import SGDConfig
from tolerances import FLOAT32, FLOAT64, check

from models import tiny_gpt2

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

VOCAB, HIDDEN, HEADS, P = 40, 16, 2, 0.3
PASSES = ("dropout_gradient", "sequences", "output_reshape", "column_sums", "tied_embedding_gradient")
ALL_OFF = {"shape_specialization": False, "sparse_labels": False, "cross_entropy": False, "embedding_gradient": False,
           "fast_gelu_gradient": False, "integer_powers": False, "host_dropout_masks": False,
           **{name: False for name in PASSES}}


class TinyDecoder(torch.nn.Module):
    """An attention block whose q/k/v come from one projection split in three, dropout on the attention
    probabilities and on the residual branch, and an output head without bias (a matrix product).
    Returns the dropped tensors too, so that the test reads the masks ONNX Runtime drew."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.2)
        self.masks = None  # the float64 reference multiplies by these instead of drawing
        self.scale = 1 / (1 - P)  # and scales by this

    def _drop(self, x, which):
        if self.masks is None:
            return F.dropout(x, P, self.training)
        return x * self.masks[which] * self.scale

    def forward(self, ids, labels):
        x = self.embed(ids)
        batch, seq, width = x.shape
        q, k, v = (t.reshape(batch, seq, HEADS, width // HEADS).transpose(1, 2)
                   for t in self.qkv(x).split(HIDDEN, dim=2))
        probs = self._drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // HEADS), dim=-1), 0)
        branch = self._drop(self.proj((probs @ v).transpose(1, 2).reshape(batch, seq, width)), 1)
        logits = self.norm(x + branch) @ self.head.T
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits, probs, branch


DESC = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB]), ("probs", ["batch", HEADS, "seq", "seq"]),
                    ("branch", ["batch", "seq", HIDDEN])]}


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (3, 10), generator=gen), torch.randint(0, VOCAB, (3, 10), generator=gen)


def _train_step(model, batch, **passes):
    """One step (lr 0) with only ``passes`` on: the trainer, its gradients and its outputs."""
    torch.manual_seed(0)  # the trainer's dropout seed: every trainer here draws the same masks
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0),
                         options={"graph_optimizations": {**ALL_OFF, **passes}, "graph": {"gradient_source": "torch"}})
    outputs = trainer.train_step(*batch)
    return trainer, {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}, outputs


def _reference_grads(model, batch, masks, scale=1 / (1 - P)):
    """float64 PyTorch gradients with the masks ONNX Runtime drew."""
    double = copy.deepcopy(model).double()
    double.masks, double.scale = [m.double() for m in masks], scale
    double(*(b.double() if b.is_floating_point() else b for b in batch))[0].backward()
    return {name: p.grad.numpy() for name, p in double.named_parameters()}


# ONNX Runtime's float32 gradients of one step against float64 PyTorch's on the same masks: the step
# chains some 20 sums, forward and backward, of ≤ 40 terms (the vocabulary's log-sum-exp: 40; each
# weight gradient over batch × seq = 30 positions; the 16-wide products; the attention's 10), each
# within n·u of its terms' magnitude (Higham's bound) and adding up along the chain: ≤ 20 · 40u =
# 4.8e-5 at worst; the float64 side's own rounding is 2^-29 of that. Kept at 1e-5 (observed at 1 and
# 2 threads: ≤ 2.6e-7, 38x under).
REFERENCE_BOUND = 1e-5


def _assert_close(got, expected, rtol=REFERENCE_BOUND):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        error = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12)
        check(error, rtol, f"{name}: relative error {error:.2e}")


def _count(trainer, op_type):
    return sum(n.op_type == op_type for n in trainer._graphs.gradient.graph.node)


def _checked_step(model, batch, scale=1 / (1 - P), **passes):
    """A step with ``passes`` on whose gradients match float64 PyTorch on the masks it drew."""
    trainer, grads, (_, logits, probs, branch) = _train_step(model, batch, **passes)
    masks = [probs != 0, branch != 0]
    assert 0 < sum(int((~m).sum()) for m in masks) < sum(m.numel() for m in masks) / 2  # dropout really dropped
    _assert_close(grads, _reference_grads(model, batch, masks, scale))
    return trainer, grads, logits


def _unread_masks(model: onnx.ModelProto) -> list[str]:
    read = {name for node in model.graph.node for name in node.input}
    return [n.name for n in model.graph.node
            if n.op_type == "Dropout" and (len(n.output) < 2 or n.output[1] not in read)]


def _dropouts_after_onnxruntime(model: onnx.ModelProto, tmp_path) -> int:
    """Dropout nodes left once ONNX Runtime has optimised ``model`` for a session."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sum(n.op_type == "Dropout" for n in onnx.load(options.optimized_model_filepath).graph.node)


def test_dropout_gradient_matches_float64_pytorch(tmp_path):
    """The attention dropout's backward (Cast, Mul by the scale, Mul by the gradient, then Mul by the
    probabilities) becomes one Mul of the gradient and the dropped probabilities; the residual
    dropout's scaled mask, Cast + Mul by the scale, becomes a uint8 Cast + DequantizeLinear. Both
    Dropouts survive ONNX Runtime's optimisation (the first one's mask is read by a no-op Reshape)."""
    model, batch = TinyDecoder(), _batch()
    off, _, _ = _checked_step(model, batch)
    on, _, _ = _checked_step(model, batch, dropout_gradient=True)
    assert _count(on, "Dropout") == _count(off, "Dropout") == 2
    assert _count(off, "Cast") - _count(on, "Cast") == 1
    assert _count(off, "Mul") - _count(on, "Mul") == 3
    assert _count(on, "DequantizeLinear") == 1 and _count(off, "DequantizeLinear") == 0
    assert not _unread_masks(on._graphs.gradient)
    assert _dropouts_after_onnxruntime(on._graphs.gradient, tmp_path) == 2


def test_host_dropout_masks_match_float64_pytorch():
    """With static shapes each Dropout becomes ``x · m``, ``m`` an input the engine fills from NumPy
    (``dropout_masks``): the attention dropout's backward reads the dropped probabilities, the
    residual one's reads ``m``; gradients equal float64 PyTorch's on the masks drawn, scaled by the
    reciprocal of the keep probability actually drawn (P = 0.3: 45875 / 2**16)."""
    from ort_trainer import ORTTrainerOptions
    from ort_trainer.dropout_masks import keep_threshold

    assert ORTTrainerOptions({}).graph_optimizations.host_dropout_masks  # on by default (CPU graphs)
    model, batch = TinyDecoder(), _batch()
    bits, threshold = keep_threshold(P)
    assert (bits, threshold) == (16, 45875)
    on, _, _ = _checked_step(model, batch, scale=2.0 ** bits / threshold, shape_specialization=True,
                             host_dropout_masks=True)
    graph = on._graphs.gradient.graph
    assert _count(on, "Dropout") == 0 and _count(on, "DequantizeLinear") == 0
    masks = [i.name for i in graph.input if i.name.startswith("ort_trainer/dropout_mask/")]
    assert len(masks) == 2 and all(i.type.tensor_type.shape.dim[0].dim_value == 3  # static: the batch of 3
                                   for i in graph.input if i.name in masks)
    off, _, _ = _checked_step(model, batch, shape_specialization=True, host_dropout_masks=False)
    assert _count(off, "Dropout") == 2
    # symbolic shapes: the engine could not size the masks, ONNX Runtime's Dropout stays
    symbolic, _, _ = _checked_step(model, batch, host_dropout_masks=True)
    assert _count(symbolic, "Dropout") == 2


def test_host_dropout_masks_come_from_the_cache_and_resume_exactly(tmp_path, caplog):
    """A second trainer reuses the cached graph with its mask inputs (a first version rejected it as
    damaged and rebuilt it every run), and a run resumed from a checkpoint draws the masks the
    uninterrupted run drew: the same losses, bit for bit."""
    model, batch = TinyDecoder(), _batch()
    options = {"graph_optimizations": {**ALL_OFF, "shape_specialization": True, "host_dropout_masks": True},
               "graph": {"gradient_source": "torch"}}

    def trainer(source):
        torch.manual_seed(0)  # the dropout seed
        return ORTTrainer(copy.deepcopy(source), DESC, SGDConfig(lr=0.1), options=options)

    whole = trainer(model)
    losses = [whole.train_step(*batch)[0].item() for _ in range(4)]
    assert len(set(losses)) == 4
    first = trainer(model)
    with caplog.at_level("WARNING", logger="ort_trainer"):
        assert [first.train_step(*batch)[0].item() for _ in range(2)] == losses[:2]
    assert "damaged" not in caplog.text and _count(first, "Dropout") == 0
    first.save_checkpoint(tmp_path / "half.h5")
    resumed = trainer(TinyDecoder())
    resumed.load_checkpoint(tmp_path / "half.h5")
    assert [resumed.train_step(*batch)[0].item() for _ in range(2)] == losses[2:]


def test_host_dropout_masks_draw_from_the_seed_alone():
    from ort_trainer.dropout_masks import HostDropoutMasks, keep_threshold

    assert keep_threshold(0.1) == (16, 58982) and keep_threshold(0.5) == (16, 32768)
    assert keep_threshold(0.01)[0] == 32  # 16 bits would put the drop probability 5.5e-4 (relative) off
    assert keep_threshold(0.0) == (16, 65536)
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [], "g", [onnx.helper.make_tensor_value_info("ort_trainer/dropout_mask/0", onnx.TensorProto.FLOAT, [1000, 1000]),
                  onnx.helper.make_tensor_value_info("ort_trainer/dropout_mask/1", onnx.TensorProto.FLOAT, [7])], []))
    model.metadata_props.add(key="ort_trainer.host_dropout_masks",
                             value='{"ort_trainer/dropout_mask/0": 0.1, "ort_trainer/dropout_mask/1": 0.0}')
    masks = HostDropoutMasks(model)
    first = {k: v.copy() for k, v in masks.draw(5).items()}
    big = first["ort_trainer/dropout_mask/0"]
    scale = np.float32(65536 / 58982)
    assert set(np.unique(big)) == {0.0, scale}
    # statistics of 1e6 draws, not roundings: the kept fraction has standard deviation
    # √(p(1 − p)/1e6) = 3.0e-4 (p = 0.9): 3e-3 is 10 of them; the mean, scale times that fraction, has
    # expected value 1 (the output's expectation is the input; the float32 scale is u off) and
    # standard deviation 3.3e-4: 4e-3 is 12 of them
    assert abs(float((big != 0).mean()) - 58982 / 65536) < 3e-3
    assert abs(float(big.mean()) - 1.0) < 4e-3
    np.testing.assert_array_equal(first["ort_trainer/dropout_mask/1"], np.ones(7, np.float32))
    again = masks.draw(5)
    np.testing.assert_array_equal(again["ort_trainer/dropout_mask/0"], big)  # a function of the seed alone
    assert not np.array_equal(masks.draw(6)["ort_trainer/dropout_mask/0"], big)
    assert not HostDropoutMasks(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])))


@pytest.mark.parametrize("after", ["x", "z"], ids=["times-input", "elsewhere"])
def test_dropout_gradient_keeps_nan_and_inf_where_the_decomposition_has_them(after):
    """Unit check on the decomposition's own pattern, its product multiplied by the Dropout's input
    (rewritten to g · y) or by another tensor (the scaled mask as DequantizeLinear): the same elements
    are NaN or inf (a NaN or inf gradient times a dropped element is NaN in both); the others differ by
    a few ulps after the first rewrite and not at all after the second."""
    shape = [64, 64]
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"]),
             helper.make_node("Cast", ["mask"], ["c"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["c", "scale"], ["cs"]),
             helper.make_node("Mul", ["g", "cs"], ["gin"]),
             helper.make_node("Mul", ["gin", after], ["out"])]
    graph = helper.make_graph(
        nodes, "dropout_backward",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "g", "z")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("y", "out")],
        [numpy_helper.from_array(np.array(P, np.float32), "ratio"), numpy_helper.from_array(np.array(True), "training"),
         numpy_helper.from_array(np.array(1 / (1 - P), np.float32), "scale")])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(original, full_check=True)
    rewritten = copy.deepcopy(original)
    assert dropout.dropout_gradient(rewritten) == 1
    onnx.checker.check_model(rewritten, full_check=True)
    expected = ["Dropout", "Reshape", "Mul"] if after == "x" else ["Dropout", "Cast", "DequantizeLinear", "Mul", "Mul"]
    assert [n.op_type for n in rewritten.graph.node] == expected
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name in ("x", "g", "z")}
    feeds["g"][0, :8], feeds["g"][1, :8], feeds["x"][2, :8] = np.inf, np.nan, -np.inf
    results = []
    for model in (original, rewritten):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ort.set_seed(7)
        results.append(session.run(None, feeds))
    (y0, out0), (y1, out1) = results
    np.testing.assert_array_equal(y0, y1)  # same mask
    assert np.isnan(out0).any() and np.isinf(out0).any()
    np.testing.assert_array_equal(np.isnan(out0), np.isnan(out1))
    np.testing.assert_array_equal(np.isinf(out0), np.isinf(out1))
    if after == "x":
        finite = np.isfinite(out0)
        # g·mask·scale·x multiplied in another association: three roundings of u per side, 6u at
        # worst; 60u states a 10x margin (observed: 2.4u)
        np.testing.assert_allclose(out1[finite], out0[finite], rtol=60 * FLOAT32, atol=0)
    else:
        np.testing.assert_array_equal(out1.view(np.uint32), out0.view(np.uint32))


@pytest.mark.parametrize("host_masks", [False, True], ids=["onnxruntime-dropout", "host-masks"])
def test_dropout_after_frozen_layers_is_applied(tmp_path, host_masks):
    """A Dropout whose mask the backward never reads (everything before it frozen) is kept: ONNX
    Runtime 1.31 would remove it as unused and train without that dropout. With the masks drawn on
    the host, the product by the mask input stays."""
    class FrozenFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(12, 12)
            self.last = torch.nn.Linear(12, 4)
            self.masks = None

        def forward(self, x, labels):
            h = self.first(x)
            dropped = F.dropout(h, 0.5, self.training) if self.masks is None else h * self.masks[0] / 0.5
            return F.cross_entropy(self.last(dropped), labels), dropped

    model = FrozenFirst()
    batch = (torch.randn(8, 12), torch.randint(0, 4, (8,)))
    torch.manual_seed(0)
    trainer = ORTTrainer(model, {"inputs": [("x", ["batch", 12]), ("labels", ["batch"])],
                                 "outputs": [("loss", [], True), ("dropped", ["batch", 12])]},
                         SGDConfig(lr=0.0), options={"graph": {"gradient_source": "torch"},
                                                     "graph_optimizations": {"host_dropout_masks": host_masks},
                                                     "utils": {"frozen_weights": ["first.weight", "first.bias"]}})
    _, dropped = trainer.train_step(*batch)
    mask = dropped != 0
    assert 0 < int((~mask).sum()) < mask.numel()
    grads = {w: g.numpy() for w, g in trainer._engine.grads.items()}
    expected = _reference_grads(model, batch, [mask])
    _assert_close(grads, {name: expected[name] for name in ("last.weight", "last.bias")})
    assert _dropouts_after_onnxruntime(trainer._graphs.gradient, tmp_path) == (0 if host_masks else 1)
    read = {name for node in onnx.load(tmp_path / "optimized.onnx").graph.node for name in node.input}
    assert ("ort_trainer/dropout_mask/0" in read) == host_masks


def test_sequences_read_split_outputs_directly():
    """q/k/v of one split projection: Split -> SequenceConstruct -> SequenceAt (torchlib's aten_getitem)
    becomes Split alone; the unused sequence and function go."""
    model, batch = TinyDecoder(), _batch()
    off, _, _ = _checked_step(model, batch)
    on, _, _ = _checked_step(model, batch, sequences=True)
    getters = {f.name for f in off._graphs.gradient.functions if f.node[0].op_type == "SequenceAt"}
    assert _count(off, "SequenceConstruct") == 1 and sum(_count(off, name) for name in getters) == 3
    assert _count(on, "SequenceConstruct") == 0 and sum(_count(on, name) for name in getters) == 0
    assert not any(f.node[0].op_type == "SequenceAt" for f in on._graphs.gradient.functions)
    assert _count(on, "Split") == _count(off, "Split") == 1
    # the sequence and its three getters, and the index constants only they read (one; torch 2.11's exporter writes
    # two), which drop_dead_nodes prunes (as it would any node nothing reads: off ran no pass, and has none)
    assert drop_dead_nodes(copy.deepcopy(off._graphs.gradient)) == 0
    readers: dict[str, set[str]] = {}
    for node in off._graphs.gradient.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    indices = [node for node in off._graphs.gradient.graph.node
               if node.op_type == "Constant" and readers.get(node.output[0], {""}) <= getters]
    assert len(indices) >= 1
    assert len(on._graphs.gradient.graph.node) == len(off._graphs.gradient.graph.node) - 4 - len(indices)


def test_small_table_gradients_are_one_hot_products():
    """The embedding table (40 rows, at most SMALL_TABLE_ROWS) gets its gradient from OneHot and one
    Gemm instead of ScatterElements(add) into zeros; gradients match float64 PyTorch."""
    assert VOCAB <= embedding.SMALL_TABLE_ROWS
    model, batch = TinyDecoder(), _batch()
    off, _, _ = _checked_step(model, batch)
    on, _, _ = _checked_step(model, batch, embedding_gradient=True)
    assert _count(off, "OneHot") == 0 and _count(on, "OneHot") == 1
    assert _count(on, "ScatterElements") == _count(off, "ScatterElements") - 1


def _tied(model: TinyDecoder) -> TinyDecoder:
    """``model`` with its output head tied to its embedding table (GPT-2's and BERT's LM heads)."""
    model.head = model.embed.weight
    return model


def test_tied_embedding_gradient_adds_the_rows_on_the_host():
    """A table both looked up and multiplied by: the graph writes the product's gradient into the
    gradient buffer and returns the lookup's rows, which the engine adds in place; no scatter into a
    zero table remains. The batch repeats tokens (30 positions, 40 rows), so rows add up. Gradients
    match float64 PyTorch's; the outputs the user sees are the description's."""
    model, batch = _tied(TinyDecoder()), _batch()
    assert len(set(batch[0].flatten().tolist())) < batch[0].numel()  # repeated rows
    off, _, _ = _checked_step(model, batch)
    on, _, logits = _checked_step(model, batch, tied_embedding_gradient=True)
    assert _count(off, "ScatterElements") - _count(on, "ScatterElements") == 1
    assert tied_embedding.host_table_rows(on._graphs.gradient).keys() == {"head_grad"}  # the first name of the table
    assert logits.shape == (3, 10, VOCAB)
    # an untied table has no product to add to: its scatter stays
    untied, _, _ = _checked_step(TinyDecoder(), batch, tied_embedding_gradient=True)
    assert not tied_embedding.host_table_rows(untied._graphs.gradient)


def test_tied_embedding_gradient_comes_from_the_cache(caplog):
    """A second trainer reuses the cached graph with its row outputs (the cache's check of a graph's
    outputs knows them: a first version rejected it as damaged and rebuilt it every run) and its
    gradients are the first one's, bit for bit."""
    model, batch = _tied(TinyDecoder()), _batch()
    first, grads, _ = _train_step(model, batch, tied_embedding_gradient=True)
    with caplog.at_level("WARNING", logger="ort_trainer"):
        second, again, _ = _train_step(model, batch, tied_embedding_gradient=True)
    assert "damaged" not in caplog.text and second._graphs.from_cache
    assert tied_embedding.host_table_rows(second._graphs.gradient) == tied_embedding.host_table_rows(
        first._graphs.gradient) != {}
    for name, value in grads.items():
        np.testing.assert_array_equal(again[name], value)


@pytest.mark.parametrize("tied_pass", [False, True])
def test_tied_embedding_gradient_accumulates_in_the_buffer(tied_pass):
    """With two micro-batches per window the graph adds each micro-batch's gradient into the buffer
    and the engine adds the lookup's rows after each run: the buffer holds the float64 sum of both
    halves' gradients on the masks each drew, and in the second window (the buffer zeroed at its
    start) that window's sum alone. No second gradient buffer exists."""
    model, batch = _tied(TinyDecoder()), _batch()
    torch.manual_seed(0)
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0),
                         options={"graph_optimizations": {**ALL_OFF, "tied_embedding_gradient": tied_pass},
                                  "graph": {"gradient_source": "torch"}, "batch": {"gradient_accumulation_steps": 2}})
    for window in range(2):
        expected = {}
        halves = (tuple(b[:, :5] for b in batch), tuple(b[:, 5:] for b in batch))
        for half in halves if window == 0 else halves[::-1]:
            _, _, probs, branch = trainer.train_step(*half)
            for name, value in _reference_grads(model, half, [probs != 0, branch != 0]).items():
                expected[name] = expected.get(name, 0) + value
        _assert_close({w: g.numpy().copy() for w, g in trainer._engine.accumulated.items()}, expected)
    assert bool(tied_embedding.host_table_rows(trainer._graphs.gradient)) == tied_pass
    assert trainer._engine.accumulated_flat is trainer._engine.grads_flat


@pytest.mark.parametrize("index_type", [np.int64, np.int32])
def test_small_table_gradients_unit(index_type):
    """Hand-made graph: a non-zero table (the product is added to it), negative and repeated
    indices, against numpy's unbuffered add; a table of more rows than SMALL_TABLE_ROWS is left.
    int32 indices (the gradient of ``Tensor.unfold``'s windows) are widened for ONNX Runtime's CPU
    OneHot, which has no int32-index, int64-depth kernel."""
    rng = np.random.default_rng(0)
    rows = embedding.SMALL_TABLE_ROWS
    index = np.array([[0], [2], [-1], [0], [2]], index_type)
    updates = rng.standard_normal((5, 4)).astype(np.float32)
    nodes, outputs, inits = [], [], []
    for name, table_rows in (("small", 3), ("large", rows + 1)):
        table = rng.standard_normal((table_rows, 4)).astype(np.float32)
        inits.append(numpy_helper.from_array(table, f"{name}_table"))
        nodes += [helper.make_node("Expand", ["index", "update_shape"], [f"{name}_index"]),
                  helper.make_node("ScatterElements", [f"{name}_table", f"{name}_index", "updates"], [name],
                                   axis=0, reduction="add")]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [table_rows, 4]))
    inits.append(numpy_helper.from_array(np.array([5, 4], np.int64), "update_shape"))
    index_proto = helper.np_dtype_to_tensor_dtype(np.dtype(index_type))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("index", index_proto, [5, 1]),
                                           helper.make_tensor_value_info("updates", TensorProto.FLOAT, [5, 4])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    expected = {}
    for init in inits[:2]:
        table = numpy_helper.to_array(init).copy()
        np.add.at(table, index[:, 0], updates)
        expected[init.name.split("_")[0]] = table
    assert embedding.small_table_gradients(model) == 1
    assert [n.op_type for n in model.graph.node].count("ScatterElements") == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    small, large = session.run(None, {"index": index, "updates": updates})
    np.testing.assert_allclose(small, expected["small"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(large, expected["large"], rtol=1e-6, atol=1e-6)


class _Windows(torch.nn.Module):
    """A learned filter bank applied to a signal's sliding windows (``Tensor.unfold``), as a framing front end does;
    the windows of the filters themselves are penalised, so the gradient of ``unfold`` reaches a weight."""

    def __init__(self):
        super().__init__()
        self.filters = torch.nn.Parameter(torch.randn(4, 8) / 8 ** 0.5)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, signal, y):
        frames = signal.unfold(-1, 8, 4)  # [batch, frames, 8]
        features = torch.tanh(frames @ self.filters.T).mean(1)
        smooth = self.filters.unfold(1, 2, 1).diff(dim=-1).pow(2).sum()
        return F.cross_entropy(self.head(features), y) + 0.01 * smooth


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_the_gradient_of_tensor_unfold_trains_as_pytorch():
    """unfold's backward scatters with int32 indices into a table small enough for small_table_gradients, whose
    OneHot then had no ONNX Runtime CPU kernel (int32 index, int64 depth): the session was refused."""
    from models import classified_batches, sgd_steps_as_pytorch
    from tolerances import steps_bound

    torch.manual_seed(0)
    batches = classified_batches(3, rows=5, features=32, seed=1)
    desc = {"inputs": [("signal", ["batch", 32]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 8 terms (a window's product), carried through the weights
    sgd_steps_as_pytorch(_Windows(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=8),
                         {"graph": {"gradient_source": "torch"}})


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_column_sums_are_matrix_products_by_ones(static):
    """Bias and LayerNorm weight gradients (sums over the batch and sequence axes) become a MatMul by
    ones of the tensor's 2-D view where the shape is static; the symbolic graph keeps its ReduceSums.
    Gradients match float64 PyTorch either way."""
    model, batch = TinyDecoder(), _batch()
    off, grads_off, _ = _checked_step(model, batch, shape_specialization=static)
    on, grads_on, _ = _checked_step(model, batch, shape_specialization=static, column_sums=True)
    rewritten = [n for n in on._graphs.gradient.graph.node if "/column_sums/" in n.name and n.op_type == "MatMul"]
    if not static:
        assert not rewritten and _count(on, "ReduceSum") == _count(off, "ReduceSum")
        return
    # qkv, proj and the LayerNorm's weight and bias: 4 sums over [batch, seq, features] (at least)
    assert len(rewritten) >= 4 and _count(off, "ReduceSum") - _count(on, "ReduceSum") == len(rewritten)
    # only those sums differ: 30 positions (batch 3 × seq 10) added in another order, each side within
    # 30u of the terms' magnitude (Higham's bound), 2 · 30 · u = 3.6e-6 apart; the other gradients are
    # the same operations. The largest entry of a gradient stands for the magnitude of its terms.
    # Observed at 1 and 2 threads: ≤ 0.048 of the bound, 21x under.
    bound = 2 * 30 * FLOAT32
    for name, value in grads_off.items():
        np.testing.assert_allclose(grads_on[name], value, rtol=bound, atol=bound * float(np.abs(value).max()))


def test_column_sums_unit():
    """Hand-made graph: sums over leading axes with and without keepdims, and sums the pass leaves
    (a trailing axis, every axis), equal to numpy's in float64."""
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float64)
    cases = [([0], 1), ([0, 1], 0), ([1, 0], 1), ([-3], 0), ([2], 1), ([0, 1, 2], 0)]
    nodes, outputs, inits = [], [], []
    for i, (axes, keep) in enumerate(cases):
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"axes{i}"))
        nodes.append(helper.make_node("ReduceSum", ["x", f"axes{i}"], [f"y{i}"], keepdims=keep))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.DOUBLE, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4, 5])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    assert copies.column_sums(model) == 4
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    # float64 sums of ≤ 60 terms (3·4·5) added in other orders by ONNX Runtime (its ReduceSum or the
    # pass's MatMul by ones) and numpy (pairwise): each within 60·u64 of the terms' magnitude Σ|x|
    # (Higham's bound, u64 = 2^-53), 2 · 60 · u64 = 1.3e-14 of it apart. Observed at 1 and 2 threads:
    # ≤ 1.2 u64 of it, 100x under.
    bound = 2 * 60 * FLOAT64
    for (axes, keep), value in zip(cases, got):
        magnitude = float(np.abs(x).sum(axis=tuple(axes), keepdims=bool(keep)).max())
        np.testing.assert_allclose(value, x.sum(axis=tuple(axes), keepdims=bool(keep)), rtol=0, atol=bound * magnitude)


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_output_reshape_computes_the_output_in_its_shape(static):
    """The logits (a graph output) come from the MatMul itself instead of a copying Reshape, in the
    static graph and in the symbolic one (whose target shape is computed at run time); the values
    are the same bits."""
    model, batch = TinyDecoder(), _batch()
    off, _, logits_off = _checked_step(model, batch, shape_specialization=static)
    on, _, logits_on = _checked_step(model, batch, shape_specialization=static, output_reshape=True)

    def producer(trainer):
        return next(n.op_type for n in trainer._graphs.gradient.graph.node if "logits" in n.output)

    assert producer(off) == "Reshape" and producer(on) == "MatMul"
    np.testing.assert_array_equal(logits_on.numpy(), logits_off.numpy())


@pytest.mark.parametrize("producer", ["MatMul", "Gemm"])
def test_output_reshape_unit(producer):
    """Hand-made graphs: the product as MatMul or as Gemm(transB=1) without bias, also read in 2-D by
    another node (which then reads a Reshape of the output back); the outputs are the same bits."""
    b_shape = [5, 7] if producer == "Gemm" else [7, 5]
    nodes = [helper.make_node("Reshape", ["h", "flat"], ["h2"]),
             helper.make_node(producer, ["h2", "w"], ["product"], **({"transB": 1} if producer == "Gemm" else {})),
             helper.make_node("Reshape", ["product", "shape"], ["out"], allowzero=1),
             helper.make_node("ReduceSum", ["product"], ["total"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "output_reshape", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 3, 7]),
                                  helper.make_tensor_value_info("w", TensorProto.FLOAT, b_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3, 5]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array([6, 7], np.int64), "flat"),
         numpy_helper.from_array(np.array([2, 3, 5], np.int64), "shape")],
        value_info=[helper.make_tensor_value_info("h2", TensorProto.FLOAT, [6, 7]),
                    helper.make_tensor_value_info("product", TensorProto.FLOAT, [6, 5])])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rewritten = copy.deepcopy(original)
    assert copies.output_reshapes(rewritten) == 1
    onnx.checker.check_model(rewritten, full_check=True)
    producers = {out: n.op_type for n in rewritten.graph.node for out in n.output}
    assert producers["out"] == "MatMul" and producers["product"] == "Reshape"
    rng = np.random.default_rng(0)
    feeds = {"h": rng.standard_normal([2, 3, 7]).astype(np.float32),
             "w": rng.standard_normal(b_shape).astype(np.float32)}
    results = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
               for m in (original, rewritten)]
    for before, after in zip(*results):
        np.testing.assert_array_equal(before, after)


def test_passes_apply_to_hugging_face_gpt2():
    """GPT-2's graph has the patterns: an attention dropout and a q/k/v split per layer, dropouts on
    the embeddings and the residual branches, the logits from a reshaped product. With dropout on,
    the passes' gradients equal those without them (same masks: the trainers share the seed) to
    float32 rounding."""
    model, desc = tiny_gpt2(dropout=0.1)
    ids = torch.randint(0, 50, (2, 8))
    results = {}
    for on in (False, True):
        torch.manual_seed(0)
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph_optimizations": {**{name: on for name in PASSES},
                                                              "host_dropout_masks": False},
                                      "graph": {"gradient_source": "torch"}})
        loss, _ = trainer.train_step(ids, torch.ones_like(ids), ids)
        results[on] = (trainer, loss.item(), {w: g.numpy().copy() for w, g in trainer._engine.grads.items()})
    counts = passes.apply_joint_passes(copy.deepcopy(results[False][0]._graphs.gradient),
                                               {name: True for name in PASSES})
    # 7 dropouts (embeddings, and per layer attention, attention output, MLP output), 2 of them attention;
    # 19 sums over leading axes: per layer 4 biases and 2 LayerNorms (weight, bias), the final LayerNorm,
    # and the position embedding's sum over the batch
    # the tied embedding of 50 rows is a small table (embedding_gradient): a one-hot product, no scatter
    assert counts == {"dropout_gradient": 7, "sequences": 6, "output_reshape": 1, "column_sums": 19,
                      "tied_embedding_gradient": 0}
    graph = results[True][0]._graphs.gradient.graph
    assert sum(n.op_type == "DequantizeLinear" for n in graph.node) == 5
    assert results[True][1] == results[False][1]  # same masks, same forward
    # the gradients with the passes and without, both float32: the column sums add 16 positions (batch
    # 2 × seq 8) in another order, 2 · 16u apart (Higham's bound); each of the 7 dropout backwards
    # multiplies g·mask·scale in another association, ≤ 6u apart per element (the unit test
    # above), and carries that through the rest of the backward; the sequence and reshape passes do
    # no arithmetic: (2 · 16 + 7 · 6)u = 4.4e-6. Observed at 1 and 2 threads: ≤ 1.5e-7, 29x under.
    _assert_close(results[True][2], results[False][2], rtol=(2 * 16 + 7 * 6) * FLOAT32)


def test_every_pass_of_the_torch_source_is_a_switch_the_trainer_hands_on():
    """A pass the trainer does not hand its ``graph_optimizations`` switch to never runs (``_run_passes`` reads
    a missing name as off): every joint and eval pass is an option, and the job carries its value."""
    model, desc = tiny_gpt2(n_layer=1)
    names = set(passes.JOINT_PASSES) | set(passes.EVAL_PASSES)
    everything_off = {name: False for name in names}
    for options in ({}, {"graph_optimizations": everything_off}):
        trainer = ORTTrainer(model, desc, SGDConfig(lr=0.0), options=options)
        wanted = {name: trainer.options.graph_optimizations[name] for name in names}
        # (switches the device gates: host_dropout_masks a CPU's, device_barriers a GPU's with CUDA kernels at hand,
        # seeded_dropout a captured GPU step's likewise)
        for gated in ("host_dropout_masks", "device_barriers", "seeded_dropout"):
            wanted[gated] = wanted[gated] and trainer._job.passes[gated]
        assert {name: trainer._job.passes.get(name) for name in names} == wanted
    assert not any(trainer._job.passes.get(name) for name in names)  # the last one: all off
    assert names <= set(forward.ALL_PASSES)  # the list tests turn everything off with


def test_a_pass_that_writes_a_graph_out_of_order_is_named():
    """A pass that leaves a node before what defines its input fails the build, naming the pass and
    the switch that turns it off (the graph cache would refuse the graph: every later process
    would rebuild it)."""
    from onnx import TensorProto, helper

    from ort_trainer.graph import passes

    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "z")]
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Neg", ["y"], ["z"])],
                              "two", info[:1], info[1:])
    model = helper.make_model(graph)

    def swapped(m):
        first, second = (copy.deepcopy(n) for n in m.graph.node)
        del m.graph.node[:]
        m.graph.node.extend([second, first])
        return 1

    with pytest.raises(RuntimeError, match=r"'swapped' wrote a graph out of order \(1 problem\(s\): node 'Neg' reads "
                                           r"\['y'\].*'swapped': False"):
        passes._run_passes(model, {"swapped": True}, (("swapped", swapped),))


def test_nodes_nothing_reads_are_pruned_but_a_dropout_keeper_stays():
    """drop_dead_nodes: a chain no output needs goes with the initializer only it read; a training Dropout's
    keeper (a Reshape of its otherwise unread mask, read by nothing on purpose) stays, and with it the
    Dropout; the graph's inputs and what the outputs need stay."""
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Expand", ["zero", "shape"], ["zeros"], name="dead_expand"),
             helper.make_node("Add", ["zeros", "x"], ["dead_sum"], name="dead_add"),
             helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], name="drop"),
             helper.make_node("Reshape", ["mask", "flat"], ["mask/kept"], name="mask" + dropout.KEEPER_SUFFIX),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f32, [2, 3])], [helper.make_tensor_value_info("out", f32, [2, 3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), numpy_helper.from_array(np.array([2, 3]), "shape"),
         numpy_helper.from_array(np.array(0.5, np.float32), "ratio"), numpy_helper.from_array(np.array(True), "training"),
         numpy_helper.from_array(np.array([-1]), "flat")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert drop_dead_nodes(model) == 2
    assert [n.name for n in model.graph.node] == ["drop", "mask/keep_dropout", "relu"]
    assert sorted(i.name for i in model.graph.initializer) == ["flat", "ratio", "training"]
    assert drop_dead_nodes(model) == 0


def _pad_model(pads, value, axes=None, dtype=TensorProto.INT64, shape=(3, 5), mode="constant", opset=18):
    inputs = ["x", "pads", "value"] + (["axes"] if axes is not None else [])
    inits = [numpy_helper.from_array(np.array(pads, np.int64), "pads"),
             numpy_helper.from_array(np.array(value, helper.tensor_dtype_to_np_dtype(dtype)), "value")]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    graph = helper.make_graph([helper.make_node("Pad", inputs, ["y"], mode=mode)], "pad",
                              [helper.make_tensor_value_info("x", dtype, list(shape) if shape is not None else None)],
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def test_integer_pads_unit():
    """A constant-mode integer Pad as Concats with constant fills, every pads / axes case equal to ONNX Runtime's
    Pad (integers: bit for bit); a float Pad, another mode and an unknown shape are left."""
    from ort_trainer.graph.passes.joint import integer_pads

    x = np.random.default_rng(0).integers(-50, 50, (3, 5)).astype(np.int64)
    cases = [([0, 0, 0, 1], -100, None, 1), ([1, 2, 3, 0], 7, None, 2), ([2, 1], -1, [1], 1),
             ([1, 0, 0, 2], 0, [-1, 0], 2), ([0, 0, 0, 0], 5, None, 0)]  # (pads, value, axes, Concat nodes)
    for pads, value, axes, concats in cases:
        model = _pad_model(pads, value, axes)
        expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        assert integer_pads(model) == 1
        assert [n.op_type for n in model.graph.node] == (["Concat"] * concats or ["Identity"])
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        assert got.dtype == expected.dtype and np.array_equal(got, expected), (pads, axes)
    for model in (_pad_model([0, 0, 0, 1], 0.5, dtype=TensorProto.FLOAT), _pad_model([0, 0, 0, 1], 0, mode="edge"),
                  _pad_model([0, 0, 0, 1], 0, shape=("batch", 5), opset=14), _pad_model([0, 0, 0, 1], 0, shape=None)):
        assert integer_pads(model) == 0


@pytest.mark.parametrize("shape", [("batch", 5), (3, "n"), ("batch", "n")])
def test_integer_pads_of_a_symbolic_shape(shape):
    """A symbolic dim (a graph past its static-shape signatures): the fill is a ConstantOfShape of the shape read at
    run time (Shape nodes, which ONNX Runtime keeps on the host), and every pads / axes case gives ONNX Runtime's Pad
    bit for bit at several input shapes, one graph for all of them."""
    from ort_trainer.graph.passes.joint import integer_pads

    rng = np.random.default_rng(1)
    for pads, value, axes in (([0, 0, 0, 1], -100, None), ([1, 2, 3, 0], 7, None), ([2, 1], -1, [1]),
                              ([1, 0, 0, 2], 0, [-1, 0])):
        model = _pad_model(pads, value, axes, shape=shape)
        expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert integer_pads(model) == 1
        ops = [n.op_type for n in model.graph.node]
        assert "Pad" not in ops and (shape[0] != "batch" or "ConstantOfShape" in ops)  # (a fill of a batch's rows)
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for rows, cols in ((3, 5), (1, 5), (3, 2), (4, 1)):
            if any(isinstance(d, int) and d != n for d, n in zip(shape, (rows, cols))):
                continue
            x = rng.integers(-50, 50, (rows, cols)).astype(np.int64)
            want, have = expected.run(None, {"x": x})[0], got.run(None, {"x": x})[0]
            assert have.dtype == want.dtype and np.array_equal(have, want), (pads, axes, rows, cols)


@pytest.mark.parametrize("static", [True, False], ids=["static", "symbolic"])
def test_integer_pads_take_gpt2s_label_pad_out_of_the_graph(static):
    """Hugging Face GPT-2's loss pads its labels (int64) before shifting them: with the pass (on by default) no Pad is
    left in the training or the eval graph, static-shape or symbolic (shape_specialization off), and the loss and every
    gradient are bit for bit those without it."""
    model, desc = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    results = {}
    for on in (False, True):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph_optimizations": {"integer_pads": on, "shape_specialization": static},
                                      "graph": {"gradient_source": "torch"}})
        loss, _ = trainer.train_step(ids, torch.ones_like(ids), ids)
        eval_loss = trainer.eval_step(ids, torch.ones_like(ids), ids)[0]
        pads = [sum(n.op_type == "Pad" for n in graph.graph.node)
                for graph in (trainer._graphs.gradient, trainer._graphs.eval) if graph is not None]
        grads = {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}
        results[on] = (loss.item(), eval_loss.item(), pads, grads)
    assert all(results[False][2]) and not any(results[True][2]), (results[False][2], results[True][2])
    assert len(results[False][2]) == 2  # (the training and the eval graph)
    assert results[True][:2] == results[False][:2]
    for name, grad in results[False][3].items():
        assert np.array_equal(results[True][3][name], grad), name

"""The ``loss_pieces`` pass (``graph/gradient/loss_pieces.py``): a language-model loss computed in pieces of
rows when the logits are not fetched. Losses and gradients equal float64 PyTorch's with and without it
(float32 and float16 mixed precision, static and symbolic graphs, rows the pieces do not divide evenly);
each piece's backward comes right after its forward in the graph; it applies only where it should."""

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.optim import SGDConfig
from test_rewrites_sparse_labels import VOCAB, MaskedLM
from tolerances import BFLOAT16, FLOAT16, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")

BATCH, SEQ = 4, 12  # 48 rows x VOCAB (40) classes = 1920 logits elements
# pieces of at most 700 elements: ceil(1920 / 700) = 3 pieces of 16 rows; the pass keeps >= 64 rows a
# piece at real sizes, so the tests lower that floor too (_MIN_ROWS)
PIECE = 700
PIECES = 3
# float32 one step against float64 PyTorch, as tests/test_rewrites_sparse_labels.py derives it for the
# same model: a chain of ≈ 200 rounded operations forward (embeddings, dense 17, back 33, LayerNorm, head
# 17, log-softmax 40, the mean's 48) and twice that back: gradients within 2·200·u32 = 2.4e-5 of each
# weight's largest element, the loss within 200·u32 = 1.2e-5; kept at 1e-5 both (observed ≤ 5e-7, 20x under).
# The pieces change the order of the loss's sum only (three partial sums of 16 rows each, then their sum).
TOLERANCE = 1e-5
# float16 mixed precision against float64 PyTorch: 24 float16 roundings along the longest chain (the sparse
# labels test's count for this model: forward 6, backward 18), relative to each gradient's largest element.
HALF_BOUND = 24 * FLOAT16


class CausalLM(MaskedLM):
    """``MaskedLM``'s embeddings, GELU block, LayerNorm and LM head (tied matmul + bias, or a Linear) with a
    Hugging Face style loss: the logits cast to float32 and flattened, labels shifted, ignore_index -100."""

    def __init__(self, linear_head: bool = False, reduction: str = "mean"):
        super().__init__(linear_head)
        self.reduction = reduction

    def forward(self, ids, labels):
        logits = self.logits(ids)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), shifted.reshape(-1), ignore_index=-100,
                               reduction=self.reduction)
        return loss, logits


DESC = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    from ort_trainer.graph.gradient import loss_pieces

    monkeypatch.setattr(loss_pieces, "_MIN_ROWS", 1)


def _batch(seed: int = 0, batch: int = BATCH, unlabelled: float = 0.2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    labels = ids.clone()
    labels[torch.rand(batch, SEQ, generator=gen) < unlabelled] = -100
    return ids, labels


def _reference(model, batch):
    double = copy.deepcopy(model).double()
    loss, _ = double(*batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in double.named_parameters() if p.grad is not None}


def _trainer(model, pieces: bool, **options):
    options = {"graph_optimizations": {"loss_pieces": pieces, "loss_piece_elements": PIECE,
                                       **options.pop("graph_optimizations", {})},
               "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False}, **options}
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0), options=options)
    trainer._train_step_info.fetches = ["loss"]
    return trainer


def _step(trainer, batch):
    loss = trainer.train_step(*batch)
    return float(loss), {w: g.detach().cpu().numpy().copy() for w, g in trainer._engine.grads.items()}


def _errors(loss, grads, expected_loss, expected) -> dict:
    return {"loss": abs(loss - expected_loss) / abs(expected_loss), **{
        name: float(np.abs(grads[name] - value).max()) / max(float(np.abs(value).max()), 1e-12)
        for name, value in expected.items()}}


def _graph(trainer) -> onnx.ModelProto:
    """The gradient graph the loss-only steps run."""
    (key,) = [k for k in trainer._engine._session_sets if k is not None and k[1] == ()]
    return trainer._shapes.graphs_for(key)[0]()


def _log_softmaxes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "LogSoftmax"]


@pytest.mark.parametrize("linear_head", [False, True], ids=["tied-matmul-head", "linear-head"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_losses_and_gradients_match_float64_pytorch_with_and_without_pieces(linear_head, reduction):
    model, batch = CausalLM(linear_head, reduction), _batch(1)
    expected_loss, expected = _reference(model, batch)
    for pieces in (False, True):
        trainer = _trainer(copy.deepcopy(model), pieces)
        for name, error in _errors(*_step(trainer, batch), expected_loss, expected).items():
            check(error, TOLERANCE, f"pieces={pieces} {name}")
        assert len(_log_softmaxes(_graph(trainer))) == (PIECES if pieces else 1)


def test_each_piece_backward_follows_its_forward():
    """In the graph's node order (the order ONNX Runtime's PRIORITY_BASED executor takes ready nodes in),
    the last reader of each piece's log-probabilities comes before the next piece's log-softmax: one piece's
    vocabulary-sized tensors are alive at a time."""
    trainer = _trainer(CausalLM(), True)
    _step(trainer, _batch(1))
    model = _graph(trainer)
    nodes = list(model.graph.node)
    last_reader = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            last_reader[name] = i
    positions = [i for i, n in enumerate(nodes) if n.op_type == "LogSoftmax"]
    assert len(positions) == PIECES
    for this, following in zip(positions, positions[1:]):
        assert last_reader[nodes[this].output[0]] < following


def test_pieces_only_where_logits_are_not_fetched_and_large():
    model, batch = CausalLM(), _batch(1)
    trainer = _trainer(copy.deepcopy(model), True)
    trainer._train_step_info.fetches = []
    loss, logits = trainer.train_step(*batch)  # the logits are returned: one projection
    assert tuple(logits.shape) == (BATCH, SEQ, VOCAB)
    assert len(_log_softmaxes(trainer._shapes.graphs_for(None)[0]())) == 1
    # logits within the limit: left alone
    small = _trainer(copy.deepcopy(model), True, graph_optimizations={"loss_piece_elements": BATCH * SEQ * VOCAB})
    _step(small, batch)
    assert len(_log_softmaxes(_graph(small))) == 1


def test_uneven_rows_on_a_symbolic_graph():
    """Without shape specialisation the pieces' sizes are computed in the graph from the row count: batches
    of other sizes (rows the three pieces do not divide evenly, the last piece the largest) still match."""
    model = CausalLM()
    trainer = _trainer(copy.deepcopy(model), True, graph_optimizations={"shape_specialization": False})
    for seed, batch in ((1, 4), (2, 3), (3, 5)):  # 48, 36 and 60 rows
        data = _batch(seed, batch)
        expected_loss, expected = _reference(model, data)
        for name, error in _errors(*_step(trainer, data), expected_loss, expected).items():
            check(error, TOLERANCE, f"batch {batch} {name}")
    # the pieces are counted on the traced sample, which a symbolic trace takes one row and one position
    # short of the first batch (export/program.trace_inputs): 3 x 11 rows x 40 classes, two pieces of 700
    assert len(_log_softmaxes(_graph(trainer))) == 2
    assert not any(d.HasField("dim_value") for d in _graph(trainer).graph.input[0].type.tensor_type.shape.dim)


def test_a_symbolic_graph_serves_fewer_rows_than_pieces():
    """Pieces of 100 elements on the symbolic trace's 33 rows x 40 classes: 14 pieces. A batch of 12 rows then
    has 13 empty pieces (ONNX Runtime multiplies and reduces zero rows) and one of 12, and still matches."""
    model = CausalLM()
    trainer = _trainer(copy.deepcopy(model), True, graph_optimizations={"shape_specialization": False,
                                                                        "loss_piece_elements": 100})
    for seed, batch in ((1, 4), (2, 1)):
        data = _batch(seed, batch)
        expected_loss, expected = _reference(model, data)
        for name, error in _errors(*_step(trainer, data), expected_loss, expected).items():
            check(error, TOLERANCE, f"batch {batch} {name}")
    assert len(_log_softmaxes(_graph(trainer))) == 14


def test_gradient_accumulation_adds_the_pieces_gradients():
    """Two windows of two micro-batches (in-graph accumulation into the gradient buffers), SGD at lr 0.5: the
    weights equal float64 PyTorch's summing each window's two backward passes and stepping with their mean
    (the trainer divides the sum by the window, docs/usage.md)."""
    from ort_trainer import ORTTrainer

    model, lr = CausalLM(), 0.5
    trainer = ORTTrainer(copy.deepcopy(model), DESC, SGDConfig(lr=lr), options={
        "graph_optimizations": {"loss_pieces": True, "loss_piece_elements": PIECE},
        "batch": {"gradient_accumulation_steps": 2}, "utils": {"grad_norm_clip": False}})
    trainer._train_step_info.fetches = ["loss"]
    double = copy.deepcopy(model).double()
    bound = 0.0
    for window in range(2):
        for param in double.parameters():
            param.grad = None
        for micro in range(2):
            trainer.train_step(*_batch(2 * window + micro))
            double(*_batch(2 * window + micro))[0].backward()
        with torch.no_grad():
            for param in double.parameters():
                if param.grad is not None:
                    # each micro-batch's gradient within TOLERANCE of its largest element (the first test), the
                    # window's mean within that of the sum's largest: the step moves a weight at most lr times
                    # as far; the bound adds each window's (the second window's gradient is taken at weights
                    # already that close, a second-order change), over every weight alike
                    bound += lr * TOLERANCE * float(param.grad.abs().max())
                    param -= lr * param.grad / 2
    assert len(_log_softmaxes(_graph(trainer))) == PIECES
    ours = trainer.state_dict(pytorch_format=True)
    for name, value in double.state_dict().items():
        mine = ours[name]
        mine = mine.detach().cpu().numpy() if isinstance(mine, torch.Tensor) else np.asarray(mine)
        check(float(np.abs(mine - value.numpy()).max()), bound, name)


def test_no_labelled_row_gives_pytorchs_nan_loss():
    model, (ids, labels) = CausalLM(), _batch(1)
    labels[:] = -100
    with torch.no_grad():
        expected = float(model(ids, labels)[0])
    loss, _ = _step(_trainer(copy.deepcopy(model), True), (ids, labels))
    assert np.isnan(expected) and np.isnan(loss)


def test_with_sparse_labels_each_piece_projects_its_labelled_rows():
    """A masked-LM style loss (a flattened projection straight into the cross-entropy) is cut in pieces with
    ``sparse_labels`` on or off; with it on, each piece projects only its labelled rows (a NonZero of its
    labels each); with the pieces off, ``sparse_labels`` projects the whole batch's labelled rows once. The
    losses and gradients equal float64 PyTorch's in all three."""
    from test_rewrites_sparse_labels import DESC as MLM_DESC, _batch as mlm_batch

    model, batch = MaskedLM(), mlm_batch(1, labelled=0.6)
    expected_loss, expected = _reference(model, batch)
    for sparse, pieces in ((True, True), (False, True), (True, False)):
        options = {"graph_optimizations": {"loss_pieces": pieces, "loss_piece_elements": PIECE,
                                           "sparse_labels": sparse}, "graph": {"gradient_source": "torch"}}
        trainer = ORTTrainer(copy.deepcopy(model), MLM_DESC, SGDConfig(lr=0.0), options=options)
        trainer._train_step_info.fetches = ["loss"]
        for name, error in _errors(*_step(trainer, batch), expected_loss, expected).items():
            check(error, TOLERANCE, f"sparse_labels={sparse}, pieces={pieces} {name}")
        graph = _graph(trainer)
        assert len(_log_softmaxes(graph)) == (PIECES if pieces else 1)
        # a selection has two NonZeros: the labelled rows, and the first of them up to the bucket's size
        selections = 0 if not sparse else PIECES if pieces else 1
        assert sum(n.op_type == "NonZero" for n in graph.graph.node) == 2 * selections


def test_labelled_rows_of_pieces_under_mixed_precision():
    """float16: the pieces' labelled rows are selected in float32 and cast back (``labelled_rows``), inside the
    autocast region; the loss and gradients within HALF_BOUND of float64 PyTorch's."""
    from ort_trainer.amp import DynamicLossScaler
    from test_rewrites_sparse_labels import DESC as MLM_DESC, _batch as mlm_batch

    model, batch = MaskedLM(), mlm_batch(1, labelled=0.6)
    expected_loss, expected = _reference(model, batch)
    options = {"graph_optimizations": {"loss_pieces": True, "loss_piece_elements": PIECE},
               "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "mixed_precision": {"enabled": True, "dtype": "float16",
                                   "loss_scaler": DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)}}
    trainer = ORTTrainer(copy.deepcopy(model), MLM_DESC, SGDConfig(lr=0.0), options=options)
    trainer._train_step_info.fetches = ["loss"]
    for name, error in _errors(*_step(trainer, batch), expected_loss, expected).items():
        check(error, HALF_BOUND, name)
    graph = _graph(trainer)
    assert len(_log_softmaxes(graph)) == PIECES
    assert sum(n.op_type == "NonZero" for n in graph.graph.node) == 2 * PIECES


def test_eval_step_gets_the_pieces_too():
    model, batch = CausalLM(), _batch(4)
    with torch.no_grad():
        expected = float(copy.deepcopy(model).double().eval()(*batch)[0])
    trainer = _trainer(copy.deepcopy(model), True)
    loss = trainer.eval_step(*batch)
    check(abs(float(loss) - expected) / abs(expected), TOLERANCE, "eval loss")
    (key,) = [k for k in trainer._engine._session_sets if k is not None and k[1] == ()]
    assert len(_log_softmaxes(trainer._shapes.graphs_for(key)[1]())) == PIECES


@pytest.mark.parametrize("linear_head", [False, True], ids=["tied-matmul-head", "linear-head"])
def test_mixed_precision_matches_float64_pytorch(linear_head):
    """float16 (the model traced under autocast): the pieces are cut inside the autocast region, and the
    loss and gradients, pieces on and off, are within HALF_BOUND of float64 PyTorch's."""
    from ort_trainer.amp import DynamicLossScaler

    model, batch = CausalLM(linear_head), _batch(1)
    expected_loss, expected = _reference(model, batch)
    for pieces in (True, False):
        trainer = _trainer(copy.deepcopy(model), pieces, mixed_precision={
            "enabled": True, "dtype": "float16",
            "loss_scaler": DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)})
        for name, error in _errors(*_step(trainer, batch), expected_loss, expected).items():
            check(error, HALF_BOUND, f"pieces={pieces} {name}")
        assert len(_log_softmaxes(_graph(trainer))) == (PIECES if pieces else 1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_pieces_with_the_cross_entropy_kernel(reduction, half):
    """``fused_cross_entropy`` on the pieces: each piece's loss is one ``CrossEntropy`` node and its gradient one
    ``CrossEntropyGrad`` (ort_trainer's kernel library), reading the float16 scores themselves under mixed
    precision (no float32 copy); each piece's kernel gradient comes before the next piece's forward, the loss
    and gradients within the bound of float64 PyTorch's (float32: TOLERANCE; float16: HALF_BOUND), and a batch
    without a labelled row gives PyTorch's NaN."""
    from ort_trainer.amp import DynamicLossScaler
    from ort_trainer.kernels import DOMAIN

    model, batch = CausalLM(True, reduction), _batch(1)
    expected_loss, expected = _reference(model, batch)
    mixed = {"enabled": True, "dtype": "float16", "loss_scaler": DynamicLossScaler(loss_scale=1.0)} if half else {}
    trainer = _trainer(copy.deepcopy(model), True, mixed_precision=mixed or {"enabled": False},
                       graph_optimizations={"fused_cross_entropy": True})
    for name, error in _errors(*_step(trainer, batch), expected_loss, expected).items():
        check(error, HALF_BOUND if half else TOLERANCE, f"{reduction} {name}")
    nodes = list(_graph(trainer).graph.node)
    kernels = [(i, n.op_type) for i, n in enumerate(nodes) if n.domain == DOMAIN]
    assert [kind for _, kind in kernels].count("CrossEntropy") == PIECES, kernels
    forwards = [i for i, kind in kernels if kind == "CrossEntropy"]
    backwards = [i for i, kind in kernels if kind == "CrossEntropyGrad"]
    assert all(b < f for b, f in zip(backwards, forwards[1:])), kernels  # each piece's backward before the next
    assert not _log_softmaxes(_graph(trainer))
    if half:
        scores = {n.input[0] for n in nodes if n.op_type == "CrossEntropy"}
        casts = [n for n in nodes if n.op_type == "Cast" and n.output[0] in scores]
        assert not casts, [n.name for n in casts]
    ids, labels = batch
    loss, _ = _step(trainer, (ids, torch.full_like(labels, -100)))
    assert np.isnan(loss) or reduction == "sum"


# bfloat16 against float64 PyTorch: the same 24 roundings along the longest chain, each u_bf16 of its value.
BFLOAT16_BOUND = 24 * BFLOAT16


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pieces_on_a_gpu_match_float64_pytorch(dtype, record_property):
    """On CUDA (``make gpu-check``), in float16 and bfloat16 with the half-precision levers on: three pieces, each
    piece's log-probabilities dead before the next piece's log-softmax, the loss and gradients within the bound
    of float64 PyTorch's. The CPU runs no bfloat16 product: this is the pieces' only bfloat16 check."""
    from ort_trainer.amp import DynamicLossScaler

    model, batch = CausalLM(True), _batch(1)
    expected_loss, expected = _reference(model, batch)
    mixed = {"enabled": True, "dtype": dtype}
    if dtype == "float16":
        mixed["loss_scaler"] = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)
    levers = dict.fromkeys(["half_precision_loss", "half_precision_bias_gradient", "half_precision_transposed_products",
                            "gelu_forward_kernel", "bfloat16_softmax_gradient", "aligned_products"], True)
    trainer = _trainer(copy.deepcopy(model), True, device={"id": "cuda"}, mixed_precision=mixed,
                       graph_optimizations=levers)
    errors = _errors(*_step(trainer, batch), expected_loss, expected)
    record_property("worst", max(errors.values()))
    for name, error in errors.items():
        check(error, HALF_BOUND if dtype == "float16" else BFLOAT16_BOUND, f"{dtype} {name}")
    assert len(_log_softmaxes(_graph(trainer))) == PIECES

"""The ``aligned_products`` pass (``graph/passes/aligned.py``): products whose unaligned dimensions
(a 50257-word vocabulary's) are computed on operands padded with zeros, the result sliced back.

Checked on single products of every form it rewrites against NumPy in float64, and on a Hugging Face
GPT-2 whose vocabulary is 1031 words (prime, past ``MIN_DIMENSION``): the loss, the logits and every
gradient against float64 PyTorch, with the pass on and off, in float32 and under float16 mixed precision.
"""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.graph.passes import aligned
from ort_trainer.optim import SGDConfig

from models import tiny_bert_mlm, tiny_gpt2
from tolerances import FLOAT32, FLOAT64, check

VOCAB = 1031  # prime and ≥ aligned.MIN_DIMENSION: padded to 1088


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["Y"], feeds)[0]


def _product_graph(form: str, a_shape, b_shape, trans_a=0, trans_b=0, a_transposes=0, b_transposes=0,
                   elem=TensorProto.DOUBLE):
    """One product reading ``A`` and ``B`` through ``*_transposes`` 2-D Transposes each."""
    nodes, names = [], {}
    for name, count in (("A", a_transposes), ("B", b_transposes)):
        names[name] = name
        for i in range(count):
            nodes.append(helper.make_node("Transpose", [names[name]], [f"{name}_t{i}"], perm=[1, 0]))
            names[name] = f"{name}_t{i}"
    # the graph's inputs, before the transposes
    stored = {"A": a_shape if a_transposes % 2 == 0 else a_shape[::-1],
              "B": b_shape if b_transposes % 2 == 0 else b_shape[::-1]}
    opsets = [helper.make_opsetid("", 17)]
    if form == "MatMul":
        nodes.append(helper.make_node("MatMul", [names["A"], names["B"]], ["Y"]))
    elif form == "Gemm":
        nodes.append(helper.make_node("Gemm", [names["A"], names["B"]], ["Y"], transA=trans_a, transB=trans_b))
    else:
        nodes.append(helper.make_node("FusedMatMul", [names["A"], names["B"]], ["Y"], domain="com.microsoft",
                                      transA=trans_a, transB=trans_b, alpha=1.0))
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info(n, elem, stored[n]) for n in "AB"],
                              [helper.make_tensor_value_info("Y", elem, [*a_shape[:-2], a_shape[-1] if trans_a else
                                                                          a_shape[-2], b_shape[0] if trans_b else b_shape[1]])])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


# (form, A's shape as the node stores it, B's, transA, transB, transposes before A, before B, rewritten)
CASES = [
    ("MatMul", [2, 3, 16], [16, 1031], 0, 0, 0, 0, 1),      # the forward head: N unaligned, A of rank 3
    ("MatMul", [1031, 24], [24, 16], 0, 0, 1, 0, 1),        # dYᵀ · x through a Transpose: M unaligned
    ("MatMul", [24, 1031], [1031, 16], 0, 0, 0, 2, 1),      # dY · W: K unaligned, B through two Transposes
    ("Gemm", [24, 1031], [16, 1031], 0, 1, 0, 0, 1),        # Gemm(transB): K on both contiguous axes
    ("Gemm", [24, 1031], [24, 16], 1, 0, 0, 0, 1),          # Gemm(transA): M on A's contiguous axis
    ("Gemm", [1031, 24], [1031, 16], 1, 0, 0, 0, 0),        # K unaligned but on no contiguous axis: left
    ("Gemm", [1100, 1030], [1030, 1500], 0, 0, 0, 0, 1),    # every dimension unaligned
    ("FusedMatMul", [24, 1031], [16, 1031], 0, 1, 0, 0, 1),
    ("MatMul", [24, 1032], [1032, 16], 0, 0, 0, 0, 0),      # aligned: left alone
    ("MatMul", [24, 1000], [1000, 16], 0, 0, 0, 0, 0),      # under MIN_DIMENSION: left alone
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{'x'.join(map(str, c[2]))}"
                         f"-t{c[3]}{c[4]}-c{c[5]}{c[6]}")
def test_a_padded_product_is_the_product(case):
    """Every form the pass rewrites computes, in float64, what NumPy does, within a sum's rounding
    (the padding adds exact zeros; the kernel's blocking may change the order: K·u64 of |A|·|B|);
    every product left reads and writes rows whose widths are multiples of ALIGNMENT or under MIN_DIMENSION."""
    form, a_shape, b_shape, trans_a, trans_b, a_t, b_t, rewritten_count = case
    elem = TensorProto.FLOAT if form == "FusedMatMul" else TensorProto.DOUBLE  # FusedMatMul: float32 kernels only
    dtype = np.float32 if elem == TensorProto.FLOAT else np.float64
    model = _product_graph(form, a_shape, b_shape, trans_a, trans_b, a_t, b_t, elem)
    rng = np.random.default_rng(0)
    stored_a = a_shape if a_t % 2 == 0 else a_shape[::-1]
    stored_b = b_shape if b_t % 2 == 0 else b_shape[::-1]
    feeds = {"A": rng.standard_normal(stored_a).astype(dtype), "B": rng.standard_normal(stored_b).astype(dtype)}
    a = feeds["A"].T if a_t % 2 else feeds["A"]
    b = feeds["B"].T if b_t % 2 else feeds["B"]
    expected = np.matmul(a.swapaxes(-1, -2) if trans_a else a, b.T if trans_b else b).astype(np.float64)
    rewritten = copy.deepcopy(model)
    changed = aligned.aligned_products(rewritten)
    assert changed == rewritten_count
    got = _run(rewritten, feeds).astype(np.float64)
    assert got.shape == expected.shape
    k = a_shape[-2] if trans_a else a_shape[-1]
    unit = FLOAT32 if dtype == np.float32 else FLOAT64
    # each element a sum of K products of N(0, 1) values: |A|·|B| ≤ K · max² per element
    bound = k * unit * k * float(np.abs(feeds["A"]).max() * np.abs(feeds["B"]).max())
    check(float(np.abs(got - expected).max()), bound, form)
    onnx.checker.check_model(rewritten)
    inferred = onnx.shape_inference.infer_shapes(rewritten).graph
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    product = next(n for n in rewritten.graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul"))
    for name in [*product.input, *product.output]:
        width = shapes[name][-1]
        assert width % aligned.ALIGNMENT == 0 or width < aligned.MIN_DIMENSION, (name, shapes[name])
    assert shapes["Y"] == list(expected.shape)


@pytest.mark.parametrize("trans_a", [0, 1], ids=["K", "M"])
def test_an_operand_with_rows_known_at_run_time_is_padded(trans_a):
    """A loss that keeps only the labelled rows (BERT's masked words) gives the head's ``dY`` a row count
    known only at run time: its zeros are a zero expanded to the run-time shape (``dY · W``: K padded on
    both operands; ``dYᵀ · x`` as a Gemm(transA): M padded), and the product is NumPy's within a sum's
    rounding, at two row counts."""
    elem = TensorProto.DOUBLE
    a_input = helper.make_tensor_value_info("A", elem, ["rows", 1031])
    b_shape = [1031, 16] if not trans_a else ["rows", 16]
    node = (helper.make_node("MatMul", ["A", "B"], ["Y"]) if not trans_a
            else helper.make_node("Gemm", ["A", "B"], ["Y"], transA=1))
    graph = helper.make_graph([node], "dynamic_rows", [a_input, helper.make_tensor_value_info("B", elem, b_shape)],
                              [helper.make_tensor_value_info("Y", elem, ["rows", 16] if not trans_a else [1031, 16])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                                                ir_version=8))
    assert aligned.aligned_products(model) == 1
    assert any(n.op_type == "Expand" for n in model.graph.node)
    onnx.checker.check_model(model)
    rng = np.random.default_rng(2)
    for rows in (24, 7):
        feeds = {"A": rng.standard_normal((rows, 1031)),
                 "B": rng.standard_normal((1031, 16) if not trans_a else (rows, 16))}
        expected = feeds["A"].T @ feeds["B"] if trans_a else feeds["A"] @ feeds["B"]
        got = _run(model, feeds)
        assert got.shape == expected.shape
        k = rows if trans_a else 1031
        # sums of K float64 products of N(0, 1) values in another blocking: ≤ K·u64 of K · max²
        bound = k * FLOAT64 * k * float(np.abs(feeds["A"]).max() * np.abs(feeds["B"]).max())
        check(float(np.abs(got - expected).max()), bound, f"{rows} rows")


def test_one_tensor_read_by_two_products_is_padded_once():
    """The head's ``dY`` is read by ``dY · W`` and ``dYᵀ · x``: one padded copy serves both (and their
    transposes are rebuilt on the padded copy, so ONNX Runtime can still fold them)."""
    elem = TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["dY"], ["dYt"], perm=[1, 0]),
             helper.make_node("MatMul", ["dYt", "x"], ["dW"]),
             helper.make_node("MatMul", ["dY", "W"], ["dX"])]
    graph = helper.make_graph(nodes, "head_backward",
                              [helper.make_tensor_value_info("dY", elem, [24, 1031]),
                               helper.make_tensor_value_info("x", elem, [24, 16]),
                               helper.make_tensor_value_info("W", elem, [1031, 16])],
                              [helper.make_tensor_value_info("dW", elem, [1031, 16]),
                               helper.make_tensor_value_info("dX", elem, [24, 16])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                                ir_version=8))
    rng = np.random.default_rng(1)
    feeds = {"dY": rng.standard_normal((24, 1031)).astype(np.float32),
             "x": rng.standard_normal((24, 16)).astype(np.float32),
             "W": rng.standard_normal((1031, 16)).astype(np.float32)}
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert aligned.aligned_products(model) == 2
    pads = [n for n in model.graph.node if n.op_type == "Concat"]
    assert [n.input[0] for n in pads] == ["dY", "W"]  # dY once for both; W for dX's K
    assert not any(n.output[0] == "dYt" for n in model.graph.node)  # the unpadded transpose is gone
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, expected in zip(after, before):
        # sums of 24 (dW) or 1031 (dX) float32 products in another blocking: ≤ K·u32 of the sum of |terms|
        check(float(np.abs(got - expected).max()), 1031 * FLOAT32 * 1031 * 16, "head backward")


pytestmark_torch = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                      reason="the 'torch' gradient source exports with onnxscript")


def _step(model, desc, batch, on: bool, half: bool):
    options = {"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "graph_optimizations": {"aligned_products": on}}
    if half:
        options["mixed_precision"] = {"enabled": True, "dtype": "float16", "loss_scaler":
                                      DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    loss, logits = trainer.train_step(*batch)
    grads = {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}
    return trainer, float(loss), logits.double().numpy(), grads


def _relative(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


@pytestmark_torch
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_gpt2_with_an_unaligned_vocabulary_trains_as_float64_pytorch(half):
    """One step of a Hugging Face GPT-2 with a 1031-word vocabulary, with the pass on and off: the
    loss, the logits and every gradient against float64 PyTorch; the head's three products are padded
    to 1088 columns. Float32: the pass changes no value but the products' summation order; float16:
    the same bound as test_half_attention.py's (1e-2: ~20 roundings to float16 along the longest chain)."""
    model, desc = tiny_gpt2(vocab=VOCAB)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    batch = (ids, torch.ones_like(ids), ids)
    double = copy.deepcopy(model).double()
    out = double(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    out.loss.backward()
    expected_loss = float(out.loss.detach())
    expected = {name: p.grad.numpy() for name, p in double.named_parameters()}
    results = {on: _step(model, desc, batch, on, half) for on in (False, True)}
    # float32: ~10 roundings along the longest chain (embedding, 2 layers of LayerNorm, attention and MLP,
    # the head and the loss), each ≤ the length of its sum (≤ 1031 terms in the head) · u32, and a 10x margin:
    # 10 · 1031 · 10 · u32 = 6e-3 of a tensor's norm
    bound = 1e-2 if half else 10 * VOCAB * 10 * FLOAT32
    for on, (trainer, loss, logits, grads) in results.items():
        check(abs(loss - expected_loss) / abs(expected_loss), bound, f"loss, pass {on}")
        check(_relative(logits, out.logits.detach().numpy()), bound, f"logits, pass {on}")
        for name, grad in grads.items():
            check(_relative(grad, expected[name]), bound, f"{name}, pass {on}")
    graph = results[True][0]._graphs.gradient.graph
    pads = [n for n in graph.node if n.op_type == "Concat" and n.name.endswith(
        (f"aligned_pad_{1088 - VOCAB}_0", f"aligned_pad_0_{1088 - VOCAB}"))]
    assert len(pads) == 2  # the head's weight (its rows) and the logits' gradient (its columns)
    assert sum(n.op_type == "Slice" and n.name.endswith("aligned_slice") for n in graph.node) == 2  # logits, dW
    if not half:
        # float32: padding adds exact zeros, so only the products' blocking may differ (none observed)
        for name in results[False][3]:
            check(_relative(results[True][3][name], results[False][3][name]), VOCAB * FLOAT32, name)


@pytestmark_torch
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_the_fused_cross_entropy_reads_the_padded_scores(monkeypatch, kind, half, device):
    """With ``fused_cross_entropy`` and the loss in pieces (the logits not fetched), each piece's
    ``CrossEntropy`` and ``CrossEntropyGrad`` read the padded product with ``classes=1031`` instead of a sliced
    copy, and the head's backward products read the gradient as written (zeros past the classes) instead of a
    padded copy: no Slice of the scores, no Concat of their gradient. GPT-2's head is a product (the tied
    embedding); BERT's a Gemm with a bias (padded with zeros too) over the rows kept for their labels, known at
    run time. The loss and every gradient against float64 PyTorch within the bound of
    ``test_gpt2_with_an_unaligned_vocabulary_trains_as_float64_pytorch``. On CUDA (``make gpu-check``) the
    kernels' CUDA forms."""
    from ort_trainer.graph.gradient import loss_pieces

    monkeypatch.setattr(loss_pieces, "_MIN_ROWS", 1)
    model, desc = tiny_gpt2(vocab=VOCAB) if kind == "gpt2" else tiny_bert_mlm(VOCAB)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    labels = ids if kind == "gpt2" else torch.where(torch.rand(2, 8, generator=generator) < 0.5, ids, -100)
    batch = (ids, torch.ones_like(ids), labels)
    double = copy.deepcopy(model).double()
    out = double(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    out.loss.backward()
    expected = {name: p.grad.numpy() for name, p in double.named_parameters() if p.grad is not None}
    options = {"device": {"id": device}, "graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
               "graph_optimizations": {"aligned_products": True, "fused_cross_entropy": True, "loss_pieces": True,
                                       "loss_piece_elements": 6 * VOCAB}}
    if half:
        options["mixed_precision"] = {"enabled": True, "dtype": "float16", "loss_scaler":
                                      DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)}
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=options)
    trainer._train_step_info.fetches = ["loss"]
    loss = float(trainer.train_step(*[t.to(device) for t in batch]).cpu())
    bound = 1e-2 if half else 10 * VOCAB * 10 * FLOAT32  # as the test above derives them
    expected_loss = float(out.loss.detach())
    check(abs(loss - expected_loss) / abs(expected_loss), bound, "loss")
    for name, grad in trainer._engine.grads.items():
        if name.endswith("key.bias"):  # zero in exact arithmetic (a softmax ignores a shift): roundoff only
            continue
        if half and kind == "bert" and (".attention.self.query." in name or ".attention.self.key." in name):
            # at initialisation these are ~100x smaller than the terms summed into them: float16 mixed precision
            # is 3-5% off float64 on them with the pass or without it (4.7% both), which is not this pass's
            # arithmetic; the float32 case checks it on them
            continue
        check(_relative(grad.float().cpu().numpy().astype(np.float64), expected[name]), bound, name)
    (key,) = [k for k in trainer._engine._session_sets if k is not None and k[1] == ()]
    graph = trainer._shapes.graphs_for(key)[0]().graph
    losses = [n for n in graph.node if n.op_type in ("CrossEntropy", "CrossEntropyGrad")]
    assert len(losses) >= 4  # two pieces or more, forward and backward
    producers = {o: n for n in graph.node for o in n.output}
    for node in losses:
        assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "classes")) == VOCAB
        scores = producers[node.input[1 if node.op_type == "CrossEntropyGrad" else 0]]
        assert scores.op_type in ("Gemm", "MatMul", "FusedMatMul"), scores.op_type
    assert not [n.name for n in graph.node if n.op_type == "Concat" and "cross_entropy_grad" in n.input[0]]
    assert not [n.name for n in graph.node if n.op_type == "Slice" and n.output[0] in
                {name for node in losses for name in node.input}]

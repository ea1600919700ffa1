"""Graph rewrites for speed. Each pass computes the same values as the graph it replaces.

Every pass has a name (the key under ``graph_optimizations`` in ``ORTTrainerOptions``), can be
turned off, and is checked by ``tests/test_rewrites.py`` to give the same gradients with and
without it (against float64 PyTorch). Measured effects are in ``docs/benchmarks.md``.

Forward passes run on the forward graph before the gradient builder:

- ``sparse_labels``: when the logits are not fetched (``TrainStepInfo.fetches`` leaves them
  out) and the loss ignores labelled-out positions (``ignore_index``, e.g. masked-LM), the output
  projection feeding the cross-entropy runs only on the rows whose label counts: a masked-LM
  head with 15% of the positions labelled does 15% of its largest matrix products. The loss and
  every gradient are unchanged (ignored rows contribute exactly zero to both).
- ``cross_entropy``: ``SoftmaxCrossEntropyLoss`` (whose CPU kernels are slow for a large
  vocabulary) becomes ``LogSoftmax`` + ``GatherElements`` + a masked mean.

The ``"torch"`` gradient source's joint graph has its own passes (``passes/joint.py``), and
``gelu`` (``gradient/gelu.py``), which computes each GELU's forward and backward together. An eval
graph taken from that joint graph's forward part (``eval_graphs.eval_graph_of``) gets its GELUs
back as one ``FastGelu`` each (``sigmoid_gelu_forward``, under the same ``gelu`` name): without a
backward, the forward need not keep what the backward reads.

Gradient passes run on the gradient graph, replacing ONNX Runtime's gradient kernels with
equivalent standard operators:

- ``cross_entropy``: ``LogSoftmaxGrad`` -> ``dY - exp(Y) · sum(dY)``.
- ``embedding_gradient``: ``GatherGrad`` on axis 0 of a 2-D table (an embedding) -> one
  ``ScatterElements(reduction="add")``. The CPU ``GatherGrad`` parallelises over the rows of the
  gradient and serialises on a lock when they hit the same table row (every token of a position
  or token-type embedding does); the scatter is a single sequential pass.
- ``fast_gelu_gradient``: ``FastGeluGrad`` (tanh-approximated GELU, as in GPT-2) -> its closed
  form in elementwise operators, about 3× faster than the CPU kernel.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._graph import _Graph, _elem_types, _import_domain, _keep, _other, _sole_consumer

MS_DOMAIN = "com.microsoft"

FORWARD_PASSES = ("sparse_labels", "cross_entropy")
GRADIENT_PASSES = ("cross_entropy", "embedding_gradient", "fast_gelu_gradient", "integer_powers", "gelu",
                   "half_precision_gelu")
ALL_PASSES = ("shape_specialization", "sparse_labels", "cross_entropy", "embedding_gradient", "fast_gelu_gradient",
              "integer_powers", "gelu", "half_precision_gelu")
# the "torch" source's passes over dropout masks (drawn on the host: host_dropout_masks), tensor sequences, output
# copies and sums over leading axes (passes/), the safe-softmax guard of attention and a float16 softmax's gradient
# (passes/softmax.py), a mixed-precision cross-entropy in the half dtype (passes/loss.py), activations recomputed in the
# backward (passes/recompute.py), a GELU's forward as one kernel (passes/gelu_kernel.py), products on aligned operands
# (passes/aligned.py), float32 sums of half gradients as one kernel (passes/gradient_sums.py), a LayerNorm writing
# its half output (passes/layer_norm_forward.py), the fused attention on packed q, k, v (passes/packed_attention.py),
# its causal mask in the kernel (passes/causal_attention.py), torch's choice of its kernel
# (passes/attention_backend.py),
# the products by torch's BLAS (passes/torch_products.py), the weights' half copies in one node
# (passes/weight_casts.py), the recomputations' waits on the device (passes/recompute.py), Dropouts seeded on the
# device (passes/dropout.py)
JOINT_COPY_PASSES = ("tied_embedding_gradient", "integer_pads", "host_dropout_masks", "dropout_gradient", "sequences",
                     "output_reshape", "safe_softmax", "half_precision_softmax_gradient", "bfloat16_softmax_gradient",
                     "half_precision_loss",
                     "half_precision_bias_gradient", "column_sums", "transposed_products",
                     "half_precision_transposed_products", "seeded_dropout", "layer_recompute", "activation_recompute",
                     "gelu_forward_kernel",
                     "packed_attention", "causal_attention", "torch_attention_choice", "aligned_products",
                     "fused_gradient_sums", "fused_layer_norm", "torch_products", "weight_casts", "device_barriers")
# the "torch" source's rewrites of the traced program before autograd (gradient/attention.py, gradient/loss_pieces.py;
# loss_pieces' piece size, graph_optimizations.loss_piece_elements, reaches the job beside the switches)
TRACE_PASSES = ("half_precision_attention", "loss_pieces", "fused_gelu_gradient", "fused_layer_norm_gradient",
                "fused_softmax_gradient", "fused_safe_softmax", "fused_cross_entropy", "fused_attention")
GRADIENT_PASSES += JOINT_COPY_PASSES + TRACE_PASSES
ALL_PASSES += JOINT_COPY_PASSES + TRACE_PASSES


class _Editor:
    """Builds replacement nodes with unique names next to a graph."""

    def __init__(self, graph: onnx.GraphProto, prefix: str):
        self.graph = graph
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], output: str | None = None, domain: str = "", **attrs) -> str:
        """Add a replacement node; returns its output name (``output`` when given)."""
        self._count += 1
        name = f"{self.prefix}/{op_type}_{self._count}"
        out = output or f"{name}_out"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, domain=domain, **attrs))
        return out

    def const(self, value, dtype=np.float32) -> str:
        """Add a constant initializer to the graph; returns its name."""
        self._count += 1
        name = f"{self.prefix}/const_{self._count}"
        self.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name


def _replace(graph: onnx.GraphProto, replacements: dict[int, list[onnx.NodeProto]]) -> None:
    """Swap nodes (by index) for lists of nodes, keeping the order."""
    if not replacements:
        return
    nodes = []
    for index, node in enumerate(graph.node):
        nodes.extend(replacements.get(index, [node]))
    del graph.node[:]
    graph.node.extend(nodes)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# ---- forward --------------------------------------------------------------------------------------
def cross_entropy_forward(model: onnx.ModelProto) -> int:
    """``SoftmaxCrossEntropyLoss`` over [N, C] scores -> LogSoftmax + GatherElements; returns the count.

    Handles ``reduction`` mean/sum/none and ``ignore_index``; nodes with class weights, or scores
    of another rank or of unknown type, are left alone.
    """
    graph = model.graph
    replacements = {}
    ranks, types = _ranks(model, with_types=True)
    for index, node in enumerate(graph.node):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx") or len(node.input) > 2:
            continue
        if ranks.get(node.input[0]) != 2 or not types.get(node.input[0]):
            continue
        attrs = _attrs(node)
        reduction = attrs.get("reduction", b"mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        e = _Editor(graph, f"{node.name or 'sce' + str(index)}/as_log_softmax")
        scores, labels = node.input[0], node.input[1]
        log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else None
        log_prob = e.op("LogSoftmax", [scores], log_prob, axis=1)
        if "ignore_index" in attrs:
            ignore = e.const(attrs["ignore_index"], np.int64)
            valid = e.op("Not", [e.op("Equal", [labels, e.op("Cast", [ignore], to=onnx.TensorProto.INT64)])])
            safe = e.op("Where", [valid, labels, e.const(0, np.int64)])
            weight = e.op("Cast", [valid], to=types[node.input[0]])
        else:
            safe, weight = labels, None
        picked = e.op("GatherElements", [log_prob, e.op("Unsqueeze", [safe, e.const([1], np.int64)])], axis=1)
        nll = e.op("Neg", [e.op("Squeeze", [picked, e.const([1], np.int64)])])
        if weight is not None:
            nll = e.op("Mul", [nll, weight])
        if reduction == "none":
            e.op("Identity", [nll], node.output[0])
        elif reduction == "sum":
            e.op("ReduceSum", [nll], node.output[0], keepdims=0)
        else:
            count = e.op("ReduceSum", [weight], keepdims=0) if weight is not None else e.op(
                "Cast", [e.op("Size", [labels])], to=types[node.input[0]])
            e.op("Div", [e.op("ReduceSum", [nll], keepdims=0), count], node.output[0])
        replacements[index] = e.nodes
    _replace(graph, replacements)
    return len(replacements)


def sparse_labels_forward(model: onnx.ModelProto) -> int:
    """Run the projection before a cross-entropy only on rows whose label is not ``ignore_index``.

    Pattern: ``SoftmaxCrossEntropyLoss(Reshape(Add(bias, MatMul(h, W))), labels)`` (the Add is
    optional) where the MatMul/Add results are not graph outputs and feed nothing else. Becomes
    ``SoftmaxCrossEntropyLoss(Add(bias, MatMul(Gather(h_rows, rows), W)), [*Gather(labels, kept),
    ignore_index])`` with ``kept = NonZero(labels != ignore_index)`` and ``rows = [*kept, 0]`` (the
    extra row, ignored, keeps the loss off an empty input). Returns the number of rewrites.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    ranks = _ranks(model)
    count = 0
    for sce in [n for n in graph.node if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in ("", "ai.onnx")]:
        attrs = _attrs(sce)
        if "ignore_index" not in attrs or len(sce.input) != 2 or ranks.get(sce.input[0]) != 2:
            continue
        reshape = producers.get(sce.input[0])
        if reshape is None or reshape.op_type != "Reshape":
            continue
        chain = [reshape]
        node = producers.get(reshape.input[0])
        bias_add = None
        if node is not None and node.op_type == "Add":
            bias_add = node
            chain.append(node)
            node = next((producers.get(i) for i in node.input if producers.get(i) is not None
                         and producers[i].op_type == "MatMul"), None)
        if node is None or node.op_type != "MatMul" or ranks.get(node.input[1]) != 2:
            continue
        matmul = node
        chain.append(matmul)
        if any(n.output[0] in outputs or consumers.get(n.output[0], 0) != 1 for n in chain[1:]):
            continue
        e = _Editor(graph, f"{sce.name or 'sce'}/sparse_labels")
        labels = sce.input[1]
        ignore = e.const([attrs["ignore_index"]], np.int64)
        ignore_label = e.op("Cast", [ignore], to=onnx.TensorProto.INT64)
        kept = e.op("Not", [e.op("Equal", [labels, ignore_label])])
        labelled = e.op("Squeeze", [e.op("NonZero", [kept]), e.const([0], np.int64)])
        # One more row, row 0 labelled ignore_index: it adds nothing to the loss or any gradient,
        # and keeps the loss off zero rows (ONNX Runtime 1.19.2's CPU SoftmaxCrossEntropyLoss dies
        # of SIGFPE on an empty input: a batch with no labelled position).
        rows = e.op("Concat", [labelled, e.const([0], np.int64)], axis=0)
        hidden = matmul.input[0]
        width = e.op("Slice", [e.op("Shape", [hidden]), e.const([-1], np.int64), e.const([2**62], np.int64)])
        flat = e.op("Reshape", [hidden, e.op("Concat", [e.const([-1], np.int64), width], axis=0)])
        scores = e.op("MatMul", [e.op("Gather", [flat, rows], axis=0), matmul.input[1]])
        if bias_add is not None:
            inputs = [scores if i == matmul.output[0] else i for i in bias_add.input]
            scores = e.op("Add", inputs)
        new_labels = e.op("Concat", [e.op("Gather", [labels, labelled], axis=0), ignore_label], axis=0)
        # the new nodes go just before the loss; the old chain is dropped
        index = list(graph.node).index(sce)
        dead = {id(n) for n in chain}
        kept_nodes = [n for i, n in enumerate(graph.node) if id(n) not in dead and i < index]
        rest = [n for i, n in enumerate(graph.node) if id(n) not in dead and i >= index]
        sce.input[0], sce.input[1] = scores, new_labels
        del graph.node[:]
        graph.node.extend(kept_nodes + e.nodes + rest)
        count += 1
    return count


# ``x · sigmoid(x · (A·x² + B))`` is the tanh GELU ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``
_GELU_A = 2.0 * math.sqrt(2.0 / math.pi) * 0.044715
_GELU_B = 2.0 * math.sqrt(2.0 / math.pi)


def sigmoid_gelu_forward(model: onnx.ModelProto) -> int:
    """Each tanh GELU written as the joint ``gelu`` pass writes its forward, ``y = x · sigmoid(x ·
    (A·x² + B))`` (``gradient/gelu.py``: six nodes, each a pass over the activations, whose values
    the backward reads), as one ``com.microsoft`` ``FastGelu(x)``, in place: for an eval graph taken from a
    training graph's forward part, where no backward reads them. Float32 values only, every
    intermediate read by the next node alone; ``FastGelu`` computes the same function (tanh form),
    rounded otherwise by a few ulps. Returns the number of GELUs rewritten."""
    g, types = _Graph(model), _elem_types(model)
    dead: set[int] = set()
    replaced: dict[int, list[onnx.NodeProto]] = {}

    def near(name: str, value: float) -> bool:
        const = g.const(name)
        return const is not None and const.size == 1 and abs(float(const.flat[0]) - value) <= 1e-6 * value

    for sigmoid in [n for n in model.graph.node if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")]:
        inner = g.producer.get(sigmoid.input[0])
        output = _sole_consumer(g, sigmoid.output[0])
        if inner is None or inner.op_type != "Mul" or output is None or output.op_type != "Mul":
            continue
        x = _other(output, sigmoid.output[0])
        if x not in inner.input or types.get(x) != onnx.TensorProto.FLOAT:
            continue
        poly = g.producer.get(_other(inner, x))
        scaled = None if poly is None or poly.op_type != "Add" else next(
            (g.producer.get(name) for name in poly.input if near(_other(poly, name), _GELU_B)), None)
        square = None if scaled is None or scaled.op_type != "Mul" else next(
            (g.producer.get(name) for name in scaled.input if near(_other(scaled, name), _GELU_A)), None)
        if square is None or square.op_type != "Mul" or list(square.input) != [x, x]:
            continue
        chain = [square, scaled, poly, inner, sigmoid]
        if not all(_sole_consumer(g, node.output[0]) is after for node, after in zip(chain, [*chain[1:], output])):
            continue
        dead |= {id(node) for node in [*chain, output]}
        replaced[id(output)] = [helper.make_node("FastGelu", [x], [output.output[0]], name=f"{output.name}/fast_gelu",
                                                 domain=MS_DOMAIN)]
    if replaced:
        _keep(model, dead, before=replaced)
        _import_domain(model, MS_DOMAIN, 1)
    return len(replaced)


def _ranks(model: onnx.ModelProto, with_types: bool = False):
    """``{value: rank}`` from ONNX shape inference; with ``with_types``, also ``{value: element type}``."""
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    if not with_types:
        return ranks
    return ranks, {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}


# ---- gradient -------------------------------------------------------------------------------------
def log_softmax_grad(model: onnx.ModelProto) -> int:
    """``LogSoftmaxGrad(dY, Y)`` -> ``dY - exp(Y) · ReduceSum(dY, axis)``; returns the count."""
    graph = model.graph
    replacements = {}
    for index, node in enumerate(graph.node):
        if not node.op_type.startswith("LogSoftmaxGrad") or node.domain != MS_DOMAIN:
            continue
        axis = _attrs(node).get("axis", -1)
        e = _Editor(graph, node.name or f"log_softmax_grad{index}")
        d_y, y = node.input[0], node.input[1]
        total = e.op("ReduceSum", [d_y, e.const([axis], np.int64)], keepdims=1)
        e.op("Sub", [d_y, e.op("Mul", [e.op("Exp", [y]), total])], node.output[0])
        replacements[index] = e.nodes
    _replace(graph, replacements)
    return len(replacements)


def embedding_grad(model: onnx.ModelProto, table_ranks: dict[str, int]) -> int:
    """``GatherGrad`` on axis 0 of a 2-D table -> ``ScatterElements(add)``; returns the count.

    Args:
        table_ranks: rank of each forward Gather's data input, by the gradient's output name is
            not known here, so the caller passes ranks of the tables (weights) by name.
    """
    graph = model.graph
    replacements = {}
    for index, node in enumerate(graph.node):
        if node.op_type != "GatherGrad" or node.domain != MS_DOMAIN or _attrs(node).get("axis", 0) != 0:
            continue
        if table_ranks.get(_table_of(node)) != 2:
            continue
        e = _Editor(graph, node.name or f"gather_grad{index}")
        shape, indices, d_y = node.input
        width = e.op("Slice", [shape, e.const([1], np.int64), e.const([2], np.int64)])
        rows = e.op("Reshape", [d_y, e.op("Concat", [e.const([-1], np.int64), width], axis=0)])
        flat_indices = e.op("Reshape", [indices, e.const([-1, 1], np.int64)])
        spread = e.op("Expand", [flat_indices, e.op("Shape", [rows])])
        zeros = e.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        e.op("ScatterElements", [zeros, spread, rows], node.output[0], axis=0, reduction="add")
        replacements[index] = e.nodes
    _replace(graph, replacements)
    return len(replacements)


def _table_of(node: onnx.NodeProto) -> str:
    """The weight a GatherGrad's output is the gradient of (``<weight>_grad`` or ``_grad_<n>``)."""
    name = node.output[0]
    head, _, tail = name.rpartition("_grad")
    return head if not tail or tail.lstrip("_").isdigit() else name


def fast_gelu_grad(model: onnx.ModelProto) -> int:
    """``FastGeluGrad(dY, X)`` -> the closed-form derivative of tanh-GELU; returns the count.

    ``gelu(x) = ½x(1 + tanh(u))``, ``u = k(x + c·x³)``, ``k = √(2/π)``, ``c = 0.044715``:
    ``gelu'(x) = ½(1 + t) + ½x(1 - t²)·k(1 + 3c·x²)`` with ``t = tanh(u)``.
    """
    graph = model.graph
    replacements = {}
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    for index, node in enumerate(graph.node):
        if node.op_type != "FastGeluGrad" or node.domain != MS_DOMAIN or len(node.input) != 2:
            continue
        e = _Editor(graph, node.name or f"fast_gelu_grad{index}")
        d_y, x = node.input
        x2 = e.op("Mul", [x, x])
        u = e.op("Mul", [x, e.op("Add", [e.op("Mul", [x2, e.const(k * c)]), e.const(k)])])
        half_t = e.op("Mul", [e.op("Tanh", [u]), e.const(0.5)])  # t/2
        left = e.op("Add", [half_t, e.const(0.5)])  # (1 + t)/2
        # (1 - t²)/2 = 0.5 - 2·(t/2)²
        sech = e.op("Sub", [e.const(0.5), e.op("Mul", [e.op("Mul", [half_t, half_t]), e.const(2.0)])])
        inner = e.op("Add", [e.op("Mul", [x2, e.const(3.0 * c * k)]), e.const(k)])
        right = e.op("Mul", [e.op("Mul", [x, sech]), inner])
        e.op("Mul", [d_y, e.op("Add", [left, right])], node.output[0])
        replacements[index] = e.nodes
    _replace(graph, replacements)
    return len(replacements)


def mask_padding_rows(model: onnx.ModelProto, padding: dict[str, int]) -> int:
    """Zero the embedding gradient at each table's ``padding_idx``, as ``torch.nn.Embedding`` does.

    Not a speed pass but semantics: an exported Gather knows nothing of ``padding_idx``. Each
    ``GatherGrad`` of a table in ``padding`` gets its incoming gradient multiplied by
    ``indices != padding_idx``. Returns the number of gradients masked.
    """
    graph = model.graph
    count = 0
    for node in list(graph.node):
        if node.op_type != "GatherGrad" or node.domain != MS_DOMAIN:
            continue
        table = _table_of(node)
        if table not in padding:
            continue
        e = _Editor(graph, f"{node.name or 'gather_grad'}/padding_idx")
        indices, d_y = node.input[1], node.input[2]
        keep = e.op("Cast", [e.op("Not", [e.op("Equal", [indices, e.const(padding[table], np.int64)])])],
                    to=onnx.TensorProto.FLOAT)
        node.input[2] = e.op("Mul", [d_y, e.op("Unsqueeze", [keep, e.const([-1], np.int64)])])
        index = list(graph.node).index(node)
        for offset, new in enumerate(e.nodes):
            graph.node.insert(index + offset, new)
        count += 1
    return count


def apply_gradient_passes(model: onnx.ModelProto, enabled: dict[str, bool], table_ranks: dict[str, int]) -> dict:
    """Run the enabled gradient passes in place; returns ``{pass: nodes rewritten}``."""
    counts = {}
    if enabled.get("cross_entropy"):
        counts["cross_entropy"] = log_softmax_grad(model)
    if enabled.get("embedding_gradient"):
        counts["embedding_gradient"] = embedding_grad(model, table_ranks)
    if enabled.get("fast_gelu_gradient"):
        counts["fast_gelu_gradient"] = fast_gelu_grad(model)
    if any(counts.values()) and not any(o.domain == "" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", 17))
    return counts

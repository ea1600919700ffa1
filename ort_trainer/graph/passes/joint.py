"""Joint-graph passes on the cross-entropy backward, embedding lookups, integer powers and integer pads.

- ``cross_entropy``: the decomposed ``nll_loss`` + ``log_softmax`` backward builds a one-hot
  ``[N, C]`` tensor (zeros, ``ScatterElements`` of -1, times the per-row weight), sums it per row
  and computes ``dY - exp(Y) · sum(dY)``: five passes over the ``[N, vocabulary]`` scores.
  Since ``sum(dY) = -w`` per row it becomes ``exp(Y) · w`` with ``-w`` scattered (added) at the
  label: two passes and a scatter of ``N`` values (30 -> 15 ms for 1024 x 8000 scores, bit-equal).
- ``embedding_gradient``: the decompositions of ``aten.index`` (the embedding lookup) and
  ``aten.index_put`` (its gradient) move the indexed axes to the front with ``Transpose`` nodes,
  which for an embedding are identity permutations that ONNX Runtime still runs, as copies of
  the table (of its gradient, of a zero table). They are dropped. (The exporter's
  ``ScatterND(add)`` itself is always rewritten to ``ScatterElements(add)`` when the graph is
  built, for correctness: ``joint_onnx.scatter_nd_add_to_scatter_elements``.) A table of a few rows
  (BERT's token types) gets its gradient as a one-hot product instead
  (``embedding.small_table_gradients``).
- ``integer_powers``: ``Pow(x, 2)`` and ``Pow(x, 3)`` (tanh-GELU's cube and its derivative's
  square) as multiplications, a little cheaper than the CPU ``Pow`` kernel. With the ``gelu``
  pass on (``gradient/gelu.py``) a written-out GELU has no ``Pow`` left; other powers still get it.
- ``integer_pads``: a constant-mode ``Pad`` of an integer tensor of known rank (Hugging Face's causal-LM loss pads
  the labels with -100 before it shifts them) as a ``Concat`` with tensors of the fill value, constants where the
  shape is static, else a ``ConstantOfShape`` of a shape read at run time (a symbolic-shape graph's): ONNX Runtime's
  CUDA provider has no integer ``Pad`` kernel, so that node ran on the host, the labels copied to it and the padded
  labels back inside every run (a sync point, and no ``device.cuda_graph`` capture). The same values.

``fast_gelu_gradient`` has nothing to do here: autograd spells the GELU derivative in
elementwise operators already. ``dropout_gradient``, ``sequences``, ``output_reshape`` and
``column_sums`` are in ``passes/``, ``safe_softmax`` in ``passes/softmax.py``.

The eval graph (the eval-mode trace, translated without autograd) gets the passes that act on a
forward graph (``apply_eval_passes``): ``cross_entropy`` there is the forward rewrite of
``passes/forward.py`` (the translation writes ``F.cross_entropy`` as one ``SoftmaxCrossEntropyLoss``,
which ONNX Runtime runs as its ONNX function body: 80-85 ms against 3-4 ms for ``LogSoftmax`` and a
gather on 1024 x 8000 scores, in 1.19.2 and 1.31.1 alike), ``sequences``, ``output_reshape``,
``safe_softmax`` (whose eval spelling is another, ``passes/softmax.py``) and ``gelu`` (the erf-GELU
in the order ONNX Runtime fuses, ``copies.erf_gelu_order``).


Each has a name under ``graph_optimizations`` and is checked against float64 PyTorch gradients
(``tests/test_joint_passes.py``, ``tests/test_rewrites.py``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..onnx_graph import onnx_opset
from ._graph import _Graph, _attrs, _elem_types, _is, _other, _replace_nodes, _static


def cross_entropy_backward(model: onnx.ModelProto) -> int:
    """The decomposed log-softmax + NLL backward as ``ScatterElements(add)`` into ``exp(Y) · w``.

    Pattern (the names are the decomposition's): ``onehot = ScatterElements(zeros, target,
    -1, axis)``, ``dY = onehot · w`` (``w`` the per-row weight, one value per row; the ``Mul``
    may be absent), ``S = ReduceSum(dY, axis, keepdims)``, ``grad = dY - exp(Y) · S``, where
    the one-hot, ``dY`` and ``S`` feed nothing else. Becomes ``grad =
    ScatterElements(exp(Y) · w, target, -1 · w, axis, reduction="add")``: equal, since each
    row of ``dY`` has its one non-zero, ``-w``, at the target, so ``S = -w``.

    Returns:
        The number of rewrites.
    """
    g = _Graph(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dead: set[int] = set()
    for sub in [n for n in model.graph.node if n.op_type == "Sub" and n.domain in ("", "ai.onnx")]:
        found = _match_cross_entropy(g, sub)
        if found is None:
            continue
        onehot, weighting, total, scaled, exp = found
        axis = _attrs(onehot)["axis"]
        _, target, updates = onehot.input
        weight = _other(weighting, onehot.output[0]) if weighting is not None else None
        prefix = f"{sub.name or 'sub'}/cross_entropy"
        new: list[onnx.NodeProto] = []
        if weight is None:
            base, spread = exp.output[0], updates
        else:
            base, spread = prefix + "/exp_times_weight", prefix + "/minus_weight"
            new += [helper.make_node("Mul", [exp.output[0], weight], [base], name=prefix + "/Mul_exp"),
                    helper.make_node("Mul", [updates, weight], [spread], name=prefix + "/Mul_updates")]
        new.append(helper.make_node("ScatterElements", [base, target, spread], [sub.output[0]],
                                    name=prefix + "/ScatterElements", axis=axis, reduction="add"))
        nodes = list(model.graph.node)
        replaced[next(i for i, n in enumerate(nodes) if n is sub)] = new
        dead |= {id(n) for n in (onehot, weighting, total, scaled) if n is not None}
    if not replaced:
        return 0
    nodes = []
    for index, node in enumerate(model.graph.node):
        if id(node) in dead:
            continue
        nodes.extend(replaced.get(index, [node]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(replaced)


def _match_cross_entropy(g: _Graph, sub: onnx.NodeProto) -> tuple | None:
    """``(onehot, weighting Mul or None, ReduceSum, Mul(exp, S), Exp)`` of the pattern at ``sub``."""
    d_y, scaled = g.producer.get(sub.input[0]), g.producer.get(sub.input[1])
    if d_y is None or scaled is None or scaled.op_type != "Mul":
        return None
    exp = total = None
    for first, second in ((scaled.input[0], scaled.input[1]), (scaled.input[1], scaled.input[0])):
        e, s = g.producer.get(first), g.producer.get(second)
        if e is not None and s is not None and e.op_type == "Exp" and s.op_type == "ReduceSum":
            exp, total = e, s
    if exp is None or total.input[0] != sub.input[0]:
        return None
    if d_y.op_type == "ScatterElements":
        onehot, weighting = d_y, None
    elif d_y.op_type == "Mul":
        weighting = d_y
        onehot = next((g.producer[i] for i in d_y.input if i in g.producer
                       and g.producer[i].op_type == "ScatterElements"), None)
        if onehot is None:
            return None
    else:
        return None
    attrs = _attrs(onehot)
    if attrs.get("reduction", b"none") not in (b"none", "none"):
        return None
    shape = g.shapes.get(onehot.output[0])
    if shape is None:
        return None
    rank = len(shape)
    axis = attrs.get("axis", 0) % rank
    if g.shapes.get(exp.output[0]) != shape or g.shapes.get(sub.output[0]) != shape:
        return None  # the scores are the one-hot's shape (no broadcasting folded in)
    if g.fill_value(onehot.input[0]) != 0.0 or g.fill_value(onehot.input[2]) != -1.0:
        return None
    axes = g.const(total.input[1]) if len(total.input) > 1 else None
    if axes is None or [int(a) % rank for a in axes.reshape(-1)] != [axis] or _attrs(total).get("keepdims", 1) != 1:
        return None
    index_shape = g.shapes.get(onehot.input[1])
    if index_shape is None or len(index_shape) != rank or index_shape[axis] != 1:
        return None  # one target per row
    if weighting is not None:
        weight_shape = g.shapes.get(_other(weighting, onehot.output[0]))
        offset = rank - len(weight_shape) if weight_shape is not None else -1
        if offset < 0 or (axis >= offset and weight_shape[axis - offset] != 1):
            return None  # not one weight per row
        if not g.only_used_by(onehot.output[0], weighting):
            return None
    if not (g.only_used_by(d_y.output[0], total, sub) and g.only_used_by(total.output[0], scaled)
            and g.only_used_by(scaled.output[0], sub)):
        return None
    return onehot, weighting, total, scaled, exp


def integer_powers(model: onnx.ModelProto) -> int:
    """``Pow(x, 2)`` -> ``x · x`` and ``Pow(x, 3)`` -> ``x · x · x`` (constant exponents); returns the count."""
    g = _Graph(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(model.graph.node):
        if node.op_type != "Pow" or node.domain not in ("", "ai.onnx"):
            continue
        exponent = g.const(node.input[1])
        if exponent is None or exponent.size != 1 or float(exponent.flat[0]) not in (2.0, 3.0):
            continue
        base_shape = g.shapes.get(node.input[0])
        if exponent.ndim and (base_shape is None or len(base_shape) < exponent.ndim):
            continue  # a shaped exponent could broadcast the result beyond x's shape
        x, name = node.input[0], node.name or f"pow{index}"
        if float(exponent.flat[0]) == 2.0:
            replaced[index] = [helper.make_node("Mul", [x, x], [node.output[0]], name=name + "/as_Mul")]
        else:
            square = name + "/square"
            replaced[index] = [helper.make_node("Mul", [x, x], [square], name=name + "/as_Mul_square"),
                               helper.make_node("Mul", [square, x], [node.output[0]], name=name + "/as_Mul_cube")]
    if replaced:
        nodes = []
        for index, node in enumerate(model.graph.node):
            nodes.extend(replaced.get(index, [node]))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return len(replaced)


_INTEGERS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
             onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


def integer_pads(model: onnx.ModelProto) -> int:
    """Each constant-mode ``Pad`` of an integer tensor of known rank, with constant non-negative pads, fill value and
    axes, as ``Concat`` nodes with tensors of the fill value (module docstring): constants where the shape is static,
    a ``ConstantOfShape`` of the shape read at run time where a dim is symbolic (opset 15 on); returns the count."""
    g = _Graph(model)
    types = _elem_types(model)
    opset = onnx_opset(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if not _is(node, "Pad") or _attrs(node).get("mode", b"constant") not in (b"constant", "constant"):
            continue
        x, shape, elem = node.input[0], g.shapes.get(node.input[0]), types.get(node.input[0])
        pads = g.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if elem not in _INTEGERS or pads is None or not shape or any(
                isinstance(d, int) and d <= 0 for d in shape) or (not _static(shape) and opset < 15):
            continue  # (a symbolic dim is read at run time by Shape's start / end, which opset 15 gave it)
        value = g.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64)
        axes = (g.const(node.input[3]) if len(node.input) > 3 and node.input[3]
                else np.arange(len(shape)))
        if value is None or value.size != 1 or axes is None or pads.size != 2 * axes.size or np.any(pads < 0):
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
        nodes, current, dims = [], x, list(shape)
        for i, axis in enumerate(int(a) % len(shape) for a in axes.flat):
            before, after = int(pads.flat[i]), int(pads.flat[axes.size + i])
            if not before and not after:
                continue
            parts = []
            for side, count in (("before", before), ("after", after)):
                if count:
                    fill_dims = dims[:axis] + [count] + dims[axis + 1:]
                    fill = f"{node.output[0]}/pad_{side}_{axis}"
                    if _static(fill_dims):
                        model.graph.initializer.append(numpy_helper.from_array(
                            np.full(fill_dims, value.flat[0], dtype=dtype), fill))
                    else:
                        nodes.extend(_fill_like(current, axis, count, np.array(value.flat[:1], dtype), fill))
                    parts.append(fill)
            parts.insert(1 if before else 0, current)
            dims[axis] = dims[axis] + before + after if isinstance(dims[axis], int) else None
            current = f"{node.output[0]}/padded_{axis}"
            nodes.append(helper.make_node("Concat", parts, [current], axis=axis, name=current))
        if not nodes:
            nodes = [helper.make_node("Identity", [x], [node.output[0]], name=f"{node.output[0]}/unpadded")]
        else:
            nodes[-1].output[0] = node.output[0]
        replaced[id(node)] = nodes
    return _replace_nodes(model, replaced, {})


def _fill_like(x: str, axis: int, count: int, value: np.ndarray, name: str) -> list[onnx.NodeProto]:
    """Nodes giving ``name``: ``value`` (one element) over ``x``'s shape with ``count`` along ``axis``, the other dims
    read from ``x`` at run time (shape computations, which ONNX Runtime runs on the host without a copy)."""
    count_name = f"{name}/count"
    return [helper.make_node("Shape", [x], [f"{name}/before"], end=axis, name=f"{name}/before"),
            helper.make_node("Shape", [x], [f"{name}/after"], start=axis + 1, name=f"{name}/after"),
            helper.make_node("Constant", [], [count_name], value=numpy_helper.from_array(np.array([count], np.int64)),
                             name=count_name),
            helper.make_node("Concat", [f"{name}/before", count_name, f"{name}/after"], [f"{name}/shape"], axis=0,
                             name=f"{name}/shape"),
            helper.make_node("ConstantOfShape", [f"{name}/shape"], [name], value=numpy_helper.from_array(value),
                             name=name)]


def identity_transposes(model: onnx.ModelProto) -> int:
    """Drop every ``Transpose`` whose ``perm`` leaves the axes in place; returns the count.

    Its consumers read its input instead; one whose output is a graph output, or any in a graph
    with subgraphs (whose nodes may read it by name), becomes an ``Identity``.
    """
    graph = model.graph
    outputs = {o.name for o in graph.output}
    nested = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
                 for a in n.attribute)
    renamed: dict[str, str] = {}
    nodes, count = [], 0
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        perm = _attrs(node).get("perm") if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if perm is None or list(perm) != list(range(len(perm))):
            nodes.append(node)
            continue
        count += 1
        if nested or node.output[0] in outputs:
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name + "/identity"))
        else:
            renamed[node.output[0]] = node.input[0]
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
    return count


__all__ = ["cross_entropy_backward", "identity_transposes", "integer_powers"]

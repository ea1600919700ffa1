"""Joint- and eval-graph passes that remove copies and extra passes over memory.

- ``sequences``: torch's exporter translates ``split`` / ``split_with_sizes`` (GPT-2's q/k/v) to a
  tensor sequence: ``Split`` -> ``SequenceConstruct`` -> ``SequenceAt(i)`` (inside torchlib's
  ``aten_getitem`` function), and ONNX Runtime's ``SequenceConstruct`` and ``SequenceAt`` each copy
  every tensor. A ``SequenceAt`` with a constant index reads the ``Split`` output directly.
- ``output_reshape``: a ``Reshape`` whose output is a graph output copies (ONNX Runtime plans graph
  outputs as buffers of their own, ``AllocKind::kAllocateOutput``, so the kernel's alias cannot
  apply): GPT-2's logits, ``Reshape(MatMul(h[1024, 256], W) -> [1024, 8000], [8, 128, 8000])``,
  copied 32 MB per step. The product is computed in the output's shape instead (``MatMul`` of a
  rank-3 input and a matrix is the same single GEMM in ONNX Runtime); readers of the 2-D product
  get a ``Reshape`` of the output, which aliases it. Bit-equal.
- ``column_sums``: ``ReduceSum`` over the leading axes of a tensor (every bias and LayerNorm weight
  gradient: ``[8, 128, 1024] -> [1024]``) as ``MatMul(ones[1, K], x[K, N])`` on the 2-D view of
  ``x`` (a ``Reshape``, an alias): ONNX Runtime's CPU ``ReduceSum`` over leading axes took 0.22 ms
  for [1024, 1024] and 0.05 ms for [1024, 256] where the product took 0.12 and 0.025 ms (1.31.1, 2
  threads, alone); the GPT-2-like step has 34 such sums, 7 ms of kernel time. Static shapes only
  (the ones' length is fixed). Another summation order: equal to float32 rounding.
- ``half_precision_bias_gradient``: under mixed precision a half-precision product's bias gradient
  (the sum over rows of its half output's gradient) comes out of torch's decomposition as
  ``Cast(ReduceSum(Cast(dy, float32), leading axes), half)``: a float32 copy of ``dy`` written and
  read (GPT-2 small at 8 x 512: four per layer, 113 MB a layer) for a result rounded back to the half
  dtype. It becomes ``MatMul(ones[1, K], dy[K, N])`` in the half dtype: cuBLAS (and MLAS) accumulate a
  half product in float32 and round it once, the rounding the cast back made. Static shapes only.
- ``gelu`` on the eval graph (``erf_gelu_order``): the eval graph is translated without the joint
  graph's GELU rewrite, and torchlib writes ``aten.gelu`` (BERT's) as ``x · ((erf(x / √2) + 1) ·
  0.5)``, an order that ONNX Runtime's ``GeluFusion`` does not match (1.19.2 and 1.31.1), so five
  elementwise kernels run. ``(x · (erf(x / √2) + 1)) · 0.5`` is fused into one ``Gelu``: 1.2 ->
  0.6 ms on [1024, 1024]. Before the fusion the two orders are bit-equal (a product by 0.5 is
  exact); ONNX Runtime's ``Gelu`` kernel differs from the unfused operators by about 1 ulp.


Each has a name under ``graph_optimizations`` and is checked against float64 PyTorch gradients
(``tests/test_joint_passes.py``, ``tests/test_rewrites.py``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._graph import (_Graph, _all_nodes, _attrs, _elem_types, _is, _keep, _other, _redirect, _replace_nodes,
                     _shared_constants, _sole_consumer)


# ---- sequences -------------------------------------------------------------------------------
def sequence_reads(model: onnx.ModelProto) -> int:
    """``SequenceAt(SequenceConstruct(t0, ..., tn), i)``, ``i`` constant -> ``ti``; returns the count.

    ``SequenceAt`` may be torchlib's ``aten_getitem`` (a model-local function whose body is that one
    node). Sequences nobody reads any more, and functions nobody calls, are dropped.
    """
    graph = model.graph
    g = _Graph(model)
    getters = {(f.domain, f.name) for f in model.functions if _is_sequence_at(f)}
    constructs = {n.output[0]: n for n in graph.node if _is(n, "SequenceConstruct")}
    renamed: dict[str, str] = {}
    getter_nodes: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        if not (_is(node, "SequenceAt") or (node.domain, node.op_type) in getters):
            continue
        construct = constructs.get(node.input[0])
        index = g.const(node.input[1]) if len(node.input) > 1 else None
        if construct is None or index is None or index.size != 1:
            continue
        position = int(index.flat[0])
        if not -len(construct.input) <= position < len(construct.input):
            continue
        renamed[node.output[0]] = construct.input[position]
        getter_nodes[node.output[0]] = node
    if not getter_nodes:
        return 0
    removed = {id(n) for n in getter_nodes.values()}
    identities = _redirect(model, renamed, removed)
    read = {name for n in _all_nodes(graph) if id(n) not in removed for name in n.input}
    removed |= {id(n) for n in constructs.values() if n.output[0] not in read and n.output[0] not in g.outputs}
    _keep(model, removed, {id(getter_nodes[old]): [node] for old, node in identities.items()})
    called = {(n.domain, n.op_type) for n in _all_nodes(graph)}
    called |= {(n.domain, n.op_type) for f in model.functions for n in f.node}
    kept = [f for f in model.functions if (f.domain, f.name) not in getters or (f.domain, f.name) in called]
    del model.functions[:]
    model.functions.extend(kept)
    return len(getter_nodes)


def _is_sequence_at(function: onnx.FunctionProto) -> bool:
    """The function is ``SequenceAt(input 0, input 1)`` and nothing else."""
    if len(function.node) != 1 or len(function.input) != 2 or len(function.output) != 1 or function.attribute:
        return False
    node = function.node[0]
    return (_is(node, "SequenceAt") and list(node.input) == list(function.input)
            and list(node.output) == list(function.output))


# ---- output_reshape --------------------------------------------------------------------------
def output_reshapes(model: onnx.ModelProto) -> int:
    """``Reshape(MatMul(a, B), shape)`` that is a graph output -> ``MatMul(Reshape(a), B)``.

    ``a`` is ``[M, K]``, ``B`` a ``[K, N]`` matrix (or ``Gemm`` without bias, ``alpha`` 1, ``a`` not
    transposed) and the output ``[..., N]``: ``a`` is reshaped to ``[..., K]`` instead (an alias)
    and the product lands in the output's own buffer. A ``shape`` computed at run time (symbolic
    dimensions) gets its last entry replaced by ``K`` at run time. Other readers of the 2-D product
    read a ``Reshape`` of the output back.

    Returns:
        The number of graph outputs that no longer need a copy.
    """
    graph = model.graph
    g = _Graph(model)
    dead: set[int] = set()
    added: dict[int, list[onnx.NodeProto]] = {}
    initializers = []
    order = {id(n): i for i, n in enumerate(graph.node)}
    for reshape in [n for n in graph.node if _is(n, "Reshape") and n.output[0] in g.outputs]:
        product = reshape.input[0]
        found = _match_output_product(g, reshape)
        if found is None:
            continue
        producer, a, b, transposed, n_out = found
        # after the product and a shape computed at run time, before the product's other readers
        anchor = max([producer, g.producer.get(reshape.input[1], producer)], key=lambda n: order[id(n)])
        if any(order[id(c)] <= order[id(anchor)] for c in g.consumers.get(product, []) if c is not reshape):
            continue
        k = g.shapes[a][1]
        prefix = f"{reshape.name or reshape.output[0]}/output_reshape"
        new = []
        target = g.const(reshape.input[1])
        if target is not None:
            a_shape = numpy_helper.from_array(np.array([*target.reshape(-1)[:-1], k], np.int64), prefix + "/a_shape")
            initializers.append(a_shape)
            a_shape = a_shape.name
        else:  # [*shape[:-1], K], computed next to the product
            consts = [numpy_helper.from_array(np.array(v, np.int64), f"{prefix}/{name}")
                      for name, v in (("zero", [0]), ("minus_one", [-1]), ("k", [k]))]
            initializers.extend(consts)
            a_shape = prefix + "/a_shape"
            new += [helper.make_node("Slice", [reshape.input[1], consts[0].name, consts[1].name], [prefix + "/lead"],
                                     name=prefix + "/Slice_lead"),
                    helper.make_node("Concat", [prefix + "/lead", consts[2].name], [a_shape], name=prefix + "/Concat",
                                     axis=0)]
        new.append(helper.make_node("Reshape", [a, a_shape], [prefix + "/a"], name=prefix + "/Reshape_a",
                                    allowzero=_attrs(reshape).get("allowzero", 0)))
        if transposed:
            new.append(helper.make_node("Transpose", [b], [prefix + "/b"], name=prefix + "/Transpose_b", perm=[1, 0]))
            b = prefix + "/b"
        new.append(helper.make_node("MatMul", [prefix + "/a", b], [reshape.output[0]], name=prefix + "/MatMul"))
        if any(c is not reshape for c in g.consumers.get(product, [])):
            flat = numpy_helper.from_array(np.array([-1, n_out], np.int64), prefix + "/flat_shape")
            initializers.append(flat)
            new.append(helper.make_node("Reshape", [reshape.output[0], flat.name], [product],
                                        name=prefix + "/Reshape_back"))
        added.setdefault(id(anchor), []).extend(new)
        dead |= {id(producer), id(reshape)}
    if not dead:
        return 0
    _keep(model, dead, after=added)
    graph.initializer.extend(initializers)
    return len(dead) // 2


def _match_output_product(g: _Graph, reshape: onnx.NodeProto) -> tuple | None:
    """``(producer, a, B, B transposed, N)`` of the pattern at ``reshape``, or None."""
    product = reshape.input[0]
    producer = g.producer.get(product)
    if producer is None or product in g.outputs:
        return None
    if _is(producer, "MatMul"):
        transposed = False
    elif _is(producer, "Gemm") and len([i for i in producer.input if i]) == 2:
        attrs = _attrs(producer)
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            return None
        transposed = bool(attrs.get("transB", 0))
    else:
        return None
    a, b = producer.input[0], producer.input[1]
    a_shape, b_shape, out_shape = g.shapes.get(a), g.shapes.get(b), g.shapes.get(reshape.output[0])
    if a_shape is None or b_shape is None or len(a_shape) != 2 or len(b_shape) != 2 or not isinstance(a_shape[1], int):
        return None
    n_out = b_shape[0] if transposed else b_shape[1]
    if not isinstance(n_out, int) or not out_shape or len(out_shape) < 2 or out_shape[-1] != n_out:
        return None
    target = g.const(reshape.input[1])
    if target is not None:
        target = [int(v) for v in target.reshape(-1)]
        if len(target) != len(out_shape) or 0 in target or target[-1] not in (n_out, -1):
            return None  # a 0 copies an input dimension, which is not the same one for ``a``
    elif not _attrs(reshape).get("allowzero", 0):
        return None  # without allowzero a 0 at run time would copy a dimension of the product
    return producer, a, b, transposed, n_out


def erf_gelu_order(model: onnx.ModelProto) -> int:
    """``Mul(x, Mul(Add(Erf(Div(x, √2)), 1), 0.5))`` -> ``Mul(Mul(x, Add(...)), 0.5)``; returns the count.

    The two ``Mul`` nodes are rewired in place (operands in either order, ``Div`` by √2 or
    ``Mul`` by 1/√2); the intermediates must have no other reader.
    """
    g = _Graph(model)
    count = 0

    def constant(name: str, value: float) -> bool:
        found = g.const(name)
        return found is not None and found.size == 1 and abs(float(found.reshape(-1)[0]) - value) <= 1e-6 * value

    def producer(name: str, op_type: str, reader: onnx.NodeProto) -> onnx.NodeProto | None:
        node = g.producer.get(name)
        return node if node is not None and _is(node, op_type) and _sole_consumer(g, name) is reader else None

    for out in [n for n in model.graph.node if _is(n, "Mul")]:
        for x, half_name in ((out.input[0], out.input[1]), (out.input[1], out.input[0])):
            half = producer(half_name, "Mul", out)
            if half is None:
                continue
            plus_one = next((p for a, c in ((half.input[0], half.input[1]), (half.input[1], half.input[0]))
                             if constant(c, 0.5) and (p := producer(a, "Add", half)) is not None), None)
            erf_out = None if plus_one is None else next(
                (a for a, c in ((plus_one.input[0], plus_one.input[1]), (plus_one.input[1], plus_one.input[0]))
                 if constant(c, 1.0)), None)
            erf = None if erf_out is None else producer(erf_out, "Erf", plus_one)
            scaled = None if erf is None else g.producer.get(erf.input[0])
            if scaled is None or _sole_consumer(g, erf.input[0]) is not erf or not (
                    (_is(scaled, "Div") and scaled.input[0] == x and constant(scaled.input[1], math.sqrt(2.0)))
                    or (_is(scaled, "Mul") and x in scaled.input
                        and constant(_other(scaled, x), math.sqrt(0.5)))):
                continue
            half_value = next(c for c in half.input if c != plus_one.output[0])
            del half.input[:]
            half.input.extend([x, plus_one.output[0]])
            del out.input[:]
            out.input.extend([half.output[0], half_value])
            count += 1
            break
    return count


def column_sums(model: onnx.ModelProto) -> int:
    """``ReduceSum(x, leading axes)`` of a float tensor with static shape -> ``MatMul`` by ones; returns the count.

    ``x`` of shape ``[d0, ..., dn]`` summed over axes ``0..j-1`` (``j <= n``) becomes
    ``Reshape(MatMul(ones[1, K], Reshape(x, [K, N])), out shape)`` with ``K = d0·...·d(j-1)`` and
    ``N = dj·...·dn``; the last ``Reshape`` is left out when the output is ``[1, N]`` already.
    """
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        if not _is(node, "ReduceSum") or not node.output[0]:
            continue
        x = node.input[0]
        shape, elem_type = g.shapes.get(x), types.get(x)
        reduced = _leading_axes(g, node, shape)
        if elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE) or reduced is None:
            continue
        replaced[id(node)] = _sum_by_ones(g, initializers, x, shape, reduced, _attrs(node).get("keepdims", 1),
                                          elem_type, node.output[0], f"{node.name or node.output[0]}/column_sums")
    return _replace_nodes(model, replaced, initializers)


def _leading_axes(g: _Graph, node: onnx.NodeProto, shape: list | None) -> int | None:
    """How many leading axes of ``shape`` (static, of the ``ReduceSum`` ``node``'s input) the node sums:
    None unless its constant axes are the first few, and not all of them."""
    axes = g.const(node.input[1]) if len(node.input) == 2 else None
    if shape is None or axes is None or axes.size == 0 or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    reduced = sorted(int(a) % len(shape) for a in axes.reshape(-1))
    if reduced != list(range(len(reduced))) or len(reduced) == len(shape):
        return None
    return len(reduced)


def _sum_by_ones(g: _Graph, initializers: dict[str, onnx.TensorProto], x: str, shape: list, reduced: int,
                 keepdims: int, elem_type: int, output: str, prefix: str) -> list[onnx.NodeProto]:
    """The nodes ``output = Reshape(MatMul(ones[1, K], Reshape(x, [K, N])), out shape)`` (the last Reshape
    left out when the output is ``[1, N]``), ``x`` of static ``shape`` summed over its ``reduced``
    leading axes; the constants, shared by name, are queued in ``initializers``."""
    k, n = int(np.prod(shape[:reduced])), int(np.prod(shape[reduced:]))
    out_shape = [1] * reduced + shape[reduced:] if keepdims else shape[reduced:]
    if elem_type == TensorProto.BFLOAT16:  # no NumPy dtype: written from floats
        ones = f"ort_trainer/column_sums/ones_{k}_bfloat16"
        if ones not in g.initializers and ones not in initializers:
            initializers[ones] = helper.make_tensor(ones, elem_type, [1, k], [1.0] * k)
    else:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        ones = f"ort_trainer/column_sums/ones_{k}_{dtype.name}"
        _shared_constants(g, initializers, [(ones, np.ones((1, k), dtype))])
    view, out = f"ort_trainer/column_sums/shape_{k}_{n}", "ort_trainer/column_sums/shape_" + "_".join(map(str, out_shape))
    _shared_constants(g, initializers, [(view, np.array([k, n], np.int64)), (out, np.array(out_shape, np.int64))])
    total = output if out_shape == [1, n] else prefix + "/sum"
    nodes = [helper.make_node("Reshape", [x, view], [prefix + "/view"], name=prefix + "/Reshape_in"),
             helper.make_node("MatMul", [ones, prefix + "/view"], [total], name=prefix + "/MatMul")]
    if total != output:
        nodes.append(helper.make_node("Reshape", [total, out], [output], name=prefix + "/Reshape_out"))
    return nodes


_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def half_column_sums(model: onnx.ModelProto) -> int:
    """``Cast(ReduceSum(Cast(dy, float32), leading axes), half)`` of a half ``dy`` -> ``MatMul(ones, dy)``
    in the half dtype (``half_precision_bias_gradient``); returns the count.

    Each cast must be read inside the pattern only, ``dy``'s shape static; the output keeps the narrowing
    cast's name (and ``keepdims``' shape).
    """
    g = _Graph(model)
    types = _elem_types(model)
    before: dict[int, list[onnx.NodeProto]] = {}
    dead: set[int] = set()
    initializers: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        found = _half_sum(g, types, node)
        if found is None:
            continue
        widen, narrow, reduced = found
        half = widen.input[0]
        before[id(node)] = _sum_by_ones(g, initializers, half, g.shapes[half], reduced, _attrs(node).get("keepdims", 1),
                                        types[half], narrow.output[0], f"{node.name or node.output[0]}/half_column_sums")
        dead |= {id(widen), id(node), id(narrow)}
    if before:
        _keep(model, dead, before=before)
        model.graph.initializer.extend(initializers.values())
    return len(before)


def _half_sum(g: _Graph, types: dict[str, int], node: onnx.NodeProto) -> tuple | None:
    """``(widening Cast, narrowing Cast, number of leading axes summed)`` of the pattern at the
    ``ReduceSum`` ``node``, or None."""
    if not _is(node, "ReduceSum") or _attrs(node).get("noop_with_empty_axes", 0):
        return None
    widen, narrow = g.producer.get(node.input[0]), _sole_consumer(g, node.output[0])
    if widen is None or narrow is None or not _is(widen, "Cast") or not _is(narrow, "Cast") \
            or _sole_consumer(g, widen.output[0]) is not node:
        return None
    dtype = types.get(widen.input[0])
    if dtype not in _HALF or _attrs(widen).get("to") != TensorProto.FLOAT or _attrs(narrow).get("to") != dtype:
        return None
    reduced = _leading_axes(g, node, g.shapes.get(widen.input[0]))
    return None if reduced is None else (widen, narrow, reduced)


__all__ = ["column_sums", "erf_gelu_order", "half_column_sums", "output_reshapes", "sequence_reads"]

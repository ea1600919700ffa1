"""Joint-graph passes that remove passes over memory and copies ONNX Runtime would make.

Run by ``joint_rewrites.apply_joint_passes``; each has a name under ``graph_optimizations`` and
``tests/test_joint_passes.py`` checks it against float64 PyTorch gradients.

- ``dropout_gradient``: the decomposition of ``native_dropout_backward`` is ``g · (Cast(mask) ·
  s)``, three passes over the tensor. Where that product only feeds ``· x``, ``x`` the Dropout's
  own input (the softmax backward of an attention dropout: ``t = g_y · p`` with ``p`` the
  attention probabilities), it becomes ``g · y`` with ``y = Dropout(x)`` the forward output,
  which the backward keeps alive anyway (the gradient of ``V`` reads it): the three passes and the
  mask's float copy disappear. ``y`` is ONNX Runtime's ``mask · x / (1 - ratio)``, so the product
  is rounded in another order: elements differ by at most a few float32 ulps, and NaN or inf in
  ``g`` or ``x`` propagate to the same elements as before. The other dropouts get ``Cast(mask) · s``
  as one ``DequantizeLinear`` of the mask cast to bytes (bit-equal). (``Where(mask, g · s, 0)``
  is slower on the CPU: its kernel took 0.7 ms where ``Cast`` + ``Mul`` took 0.3 on a [8, 4, 128,
  128] mask, and it would hide a NaN in ``g`` that PyTorch propagates.)
- ``host_dropout_masks`` (CPU graphs only, ``Device.host_dropout_masks``): each
  static-shape training Dropout as ``x · m`` with ``m`` a graph input the engine fills from the
  host every step (``ort_trainer/dropout_masks.py``); runs before ``dropout_gradient``, whose
  backward forms it writes itself.
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
- ``embedding_gradient`` (with ``joint_rewrites.identity_transposes``): the gradient of a table of
  at most ``SMALL_TABLE_ROWS`` rows (BERT's token types: 2) as ``Gemm(OneHot(index), updates,
  transA=1)`` instead of ``ScatterElements(add)`` into zeros, whose CPU kernel adds one element at
  a time on one thread: 1.8 ms per BERT-like step for 1024 x 256 updates into 2 rows (the product
  is 2·V·N·D flops, 0.5 M here). Another summation order: equal to float32 rounding.
- ``gelu`` on the eval graph (``erf_gelu_order``): the eval graph is translated without the joint
  graph's GELU rewrite, and torchlib writes ``aten.gelu`` (BERT's) as ``x · ((erf(x / √2) + 1) ·
  0.5)``, an order that ONNX Runtime's ``GeluFusion`` does not match (1.19.2 and 1.31.1), so five
  elementwise kernels run. ``(x · (erf(x / √2) + 1)) · 0.5`` is fused into one ``Gelu``: 1.2 ->
  0.6 ms on [1024, 1024]. Before the fusion the two orders are bit-equal (a product by 0.5 is
  exact); ONNX Runtime's ``Gelu`` kernel differs from the unfused operators by about 1 ulp.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .joint_rewrites import _Graph, _attrs, _other

_ONNX_DOMAINS = ("", "ai.onnx")


def _is(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in _ONNX_DOMAINS


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {info.name: info.type.tensor_type.elem_type for info in [*graph.input, *graph.value_info, *graph.output]
             if info.type.HasField("tensor_type")}
    types.update({init.name: init.data_type for init in graph.initializer})
    return types


def _all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its subgraphs, at any depth."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _all_nodes(sub)


def _keep(model: onnx.ModelProto, dead: set[int], before: dict[int, list[onnx.NodeProto]] | None = None,
          after: dict[int, list[onnx.NodeProto]] | None = None) -> None:
    """Drop the nodes whose ids are in ``dead``; put ``before[id(node)]`` right before ``node`` and
    ``after[id(node)]`` right after it."""
    nodes = []
    for node in model.graph.node:
        nodes.extend((before or {}).get(id(node), []))
        if id(node) not in dead:
            nodes.append(node)
        nodes.extend((after or {}).get(id(node), []))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _shared_constants(g: _Graph, pending: dict[str, onnx.TensorProto], constants) -> None:
    """Queue each ``(name, value)`` of ``constants`` as an initializer unless the graph or
    ``pending`` has it already (passes name their constants by value, so equal ones are shared)."""
    for name, value in constants:
        if name not in g.initializers and name not in pending:
            pending[name] = numpy_helper.from_array(value, name)


def _replace_nodes(model: onnx.ModelProto, replaced: dict[int, list[onnx.NodeProto]],
                   initializers: dict[str, onnx.TensorProto]) -> int:
    """Put ``replaced[id(node)]`` in place of each such node, add ``initializers``; returns the count."""
    if replaced:
        _keep(model, set(replaced), before=replaced)
        model.graph.initializer.extend(initializers.values())
    return len(replaced)


def _redirect(model: onnx.ModelProto, renamed: dict[str, str], removed: set[int]) -> dict[str, onnx.NodeProto]:
    """Make readers of each ``old`` name read ``renamed[old]`` instead (the nodes in ``removed``,
    which produced the old names, are skipped: the caller drops them). A graph output, and every
    name in a graph with subgraphs (whose nodes may read it by name), keeps its name through an
    ``Identity``: returned by old name, for the caller to put where the old producer was."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    nested = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
                 for a in n.attribute)
    identities = {}
    for old, new in list(renamed.items()):
        if nested or old in outputs:
            identities[old] = helper.make_node("Identity", [new], [old], name=f"{old}/identity")
            del renamed[old]
    for node in graph.node:
        if id(node) not in removed:
            node.input[:] = [renamed.get(name, name) for name in node.input]
    kept = [info for info in graph.value_info if info.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return identities


# ---- dropout_gradient ------------------------------------------------------------------------
def dropout_gradient(model: onnx.ModelProto) -> int:
    """The decomposed dropout backward ``Mul(g, Mul(Cast(mask), s))`` in fewer passes.

    Where the product feeds nothing but one multiplication with the Dropout's input ``x`` (an
    attention dropout followed by the softmax backward), ``Mul(Mul(g, cs), x)`` becomes ``Mul(g, y)``
    with ``y, mask = Dropout(x)``; the mask, read by nothing then, gets a no-op reader
    (``keep_dropouts``), else ONNX Runtime would drop the Dropout. Elsewhere the float mask scaled by
    ``s`` comes from ``DequantizeLinear(Cast(mask, uint8), s)``: one byte per element written by the
    Cast instead of four, and no separate pass for the scale (bit-equal).

    Returns:
        The number of Dropout backwards rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    count = 0
    zero_point = "ort_trainer/dropout_gradient/zero_point"
    for drop in [n for n in model.graph.node if _is(n, "Dropout")]:
        found = _match_dropout_backward(g, types, drop)
        if found is None:
            continue
        count += 1
        cast, scale_mul, grad_mul, through = found
        if through is not None:
            dead |= _gradient_times_output(found, drop)
            continue
        scale = _other(scale_mul, cast.output[0])
        next(a for a in cast.attribute if a.name == "to").i = TensorProto.UINT8
        scale_mul.op_type = "DequantizeLinear"
        scale_mul.input[:] = [cast.output[0], scale, zero_point]
        for info in model.graph.value_info:
            if info.name == cast.output[0]:
                info.type.tensor_type.elem_type = TensorProto.UINT8
    if count > len(dead) // 3 and zero_point not in g.initializers:
        model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.uint8), zero_point))
    if dead:
        _keep(model, dead)
        keep_dropouts(model)
    return count


def _training_ratio(g: _Graph, drop: onnx.NodeProto) -> float | None:
    """The drop probability of a Dropout that always runs in training mode with a constant ratio;
    None for any other (one that may run in inference mode returns x itself, not mask · x · scale)."""
    if len(drop.input) < 3 or not drop.input[1] or not drop.input[2]:
        return None
    training, ratio = g.const(drop.input[2]), g.const(drop.input[1])
    if training is None or training.size != 1 or not bool(training.flat[0]) or ratio is None or ratio.size != 1:
        return None
    return float(ratio.flat[0])


def _gradient_times_output(found: tuple, drop: onnx.NodeProto) -> set[int]:
    """Rewrite the attention dropout's ``Mul(Mul(g, Cast(mask) · s), x)`` (``found``, from
    ``_match_dropout_backward``, with its last element) as ``Mul(g, y)``, ``y`` the Dropout's
    output; returns the ids of the nodes that become dead."""
    cast, scale_mul, grad_mul, through = found
    through.input[:] = [_other(grad_mul, scale_mul.output[0]), drop.output[0]]
    return {id(cast), id(scale_mul), id(grad_mul)}


def _match_dropout_backward(g: _Graph, types: dict[str, int], drop: onnx.NodeProto) -> tuple | None:
    """``(Cast, Mul(cast, s), Mul(g, cs), Mul(gin, x) or None)`` of the pattern at ``drop``, or None."""
    if len(drop.output) != 2 or not drop.output[1] or drop.output[1] in g.outputs:
        return None
    x, mask = drop.input[0], drop.output[1]
    ratio = _training_ratio(g, drop)
    if ratio is None:
        return None
    if types.get(x) != TensorProto.FLOAT or types.get(drop.output[0]) != TensorProto.FLOAT:
        return None
    cast = _sole_consumer(g, mask)
    if cast is None or not _is(cast, "Cast") or _attrs(cast).get("to") != TensorProto.FLOAT:
        return None
    scale_mul = _sole_consumer(g, cast.output[0])
    if scale_mul is None or not _is(scale_mul, "Mul"):
        return None
    scale = g.const(_other(scale_mul, cast.output[0]))
    if (scale is None or scale.shape != () or scale.dtype != np.float32
            or abs(float(scale) * (1.0 - ratio) - 1.0) > 1e-6):
        return None  # not this Dropout's 1 / (1 - ratio) as a float scalar
    grad_mul = _sole_consumer(g, scale_mul.output[0])
    if grad_mul is None or not _is(grad_mul, "Mul"):
        return cast, scale_mul, None, None
    through = _sole_consumer(g, grad_mul.output[0])
    grad = _other(grad_mul, scale_mul.output[0])
    shape = g.shapes.get(x)
    if (through is None or not _is(through, "Mul") or _other(through, grad_mul.output[0]) != x
            or shape is None or None in shape or g.shapes.get(grad) != shape or types.get(grad) != TensorProto.FLOAT):
        return cast, scale_mul, grad_mul, None  # g · y must have the shape and type of the product it replaces
    return cast, scale_mul, grad_mul, through


def _sole_consumer(g: _Graph, name: str) -> onnx.NodeProto | None:
    readers = g.consumers.get(name, [])
    if len(readers) != 1 or name in g.outputs or list(readers[0].input).count(name) != 1:
        return None
    return readers[0]


def keep_dropouts(model: onnx.ModelProto) -> int:
    """Give every training-mode Dropout whose mask nothing reads a reader: a ``Reshape`` of the mask
    (an alias: no copy) whose output nothing reads.

    ONNX Runtime builds without training code (1.31) remove a Dropout whose mask output is unused
    (``EliminateDropout``, which ignores ``training_mode`` there), so the step would silently train
    without that dropout: one after frozen layers (the backward never reads its mask), or one whose
    mask ``dropout_gradient`` no longer reads. ONNX Runtime keeps a node whose output is unused.

    Returns:
        The number of Dropouts given a reader.
    """
    graph = model.graph
    g = _Graph(model)
    shape_name = "ort_trainer/keep_dropout/shape"
    added: dict[int, list[onnx.NodeProto]] = {}
    for index, drop in enumerate(graph.node):
        if not _is(drop, "Dropout") or len(drop.input) < 3 or not drop.input[2]:
            continue  # without training_mode the Dropout is the identity, rightly removable
        training = g.const(drop.input[2])
        if training is not None and not bool(training.flat[0]):
            continue
        if len(drop.output) < 2 or not drop.output[1]:
            del drop.output[1:]
            drop.output.append(f"{drop.output[0]}/mask")
        mask = drop.output[1]
        if mask in g.outputs or g.consumers.get(mask):
            continue
        added[index] = [helper.make_node("Reshape", [mask, shape_name], [f"{mask}/kept"], name=f"{mask}/keep_dropout")]
    if not added:
        return 0
    nodes = []
    for index, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(added.get(index, []))
    del graph.node[:]
    graph.node.extend(nodes)
    if shape_name not in g.initializers:
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), shape_name))
    return len(added)


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
        if not _is(node, "ReduceSum") or len(node.input) != 2 or not node.output[0]:
            continue
        x = node.input[0]
        shape, elem_type = g.shapes.get(x), types.get(x)
        axes = g.const(node.input[1])
        if (shape is None or elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE) or axes is None or axes.size == 0
                or not all(isinstance(d, int) and d > 0 for d in shape)):
            continue
        rank = len(shape)
        reduced = sorted(int(a) % rank for a in axes.reshape(-1))
        if reduced != list(range(len(reduced))) or len(reduced) == rank:
            continue
        keep = _attrs(node).get("keepdims", 1)
        k, n = int(np.prod(shape[:len(reduced)])), int(np.prod(shape[len(reduced):]))
        out_shape = [1] * len(reduced) + shape[len(reduced):] if keep else shape[len(reduced):]
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        prefix = f"{node.name or node.output[0]}/column_sums"
        names = {"ones": f"ort_trainer/column_sums/ones_{k}_{np.dtype(dtype).name}",
                 "view": f"ort_trainer/column_sums/shape_{k}_{n}", "out": f"ort_trainer/column_sums/shape_" +
                 "_".join(map(str, out_shape))}
        _shared_constants(g, initializers, [(names["ones"], np.ones((1, k), dtype)),
                                            (names["view"], np.array([k, n], np.int64)),
                                            (names["out"], np.array(out_shape, np.int64))])
        nodes = [helper.make_node("Reshape", [x, names["view"]], [prefix + "/view"], name=prefix + "/Reshape_in")]
        if out_shape == [1, n]:
            nodes.append(helper.make_node("MatMul", [names["ones"], prefix + "/view"], [node.output[0]],
                                          name=prefix + "/MatMul"))
        else:
            nodes += [helper.make_node("MatMul", [names["ones"], prefix + "/view"], [prefix + "/sum"],
                                       name=prefix + "/MatMul"),
                      helper.make_node("Reshape", [prefix + "/sum", names["out"]], [node.output[0]],
                                       name=prefix + "/Reshape_out")]
        replaced[id(node)] = nodes
    return _replace_nodes(model, replaced, initializers)


SMALL_TABLE_ROWS = 64  # up to here a one-hot product beats the scatter (~7 ns per added element)


def small_table_gradients(model: onnx.ModelProto) -> int:
    """``ScatterElements(zeros[V, D], Expand(index[N, 1]), updates[N, D], axis=0, add)`` with a static
    ``V <= SMALL_TABLE_ROWS`` -> ``Gemm(OneHot(index, V), updates, transA=1)``; returns the count.

    A ``data`` that is not a constant zero is added to the product. float32 tables only (ONNX
    Runtime's CPU ``OneHot`` has no float64 output).
    """
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        expand = lookup_scatter(g, node)
        if expand is None:
            continue
        data, _, updates = node.input
        shape, elem_type = g.shapes.get(data), types.get(data)
        if (shape is None or len(shape) != 2 or not isinstance(shape[0], int) or not 0 < shape[0] <= SMALL_TABLE_ROWS
                or elem_type != TensorProto.FLOAT):
            continue  # (updates have data's rank, 2, by ScatterElements' definition)
        rows = shape[0]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        prefix = f"{node.name or node.output[0]}/small_table"
        names = {"flat": "ort_trainer/small_table/flat", "depth": f"ort_trainer/small_table/depth_{rows}",
                 "values": f"ort_trainer/small_table/values_{dtype.name}"}
        _shared_constants(g, initializers, [(names["flat"], np.array([-1], np.int64)),
                                            (names["depth"], np.array(rows, np.int64)),
                                            (names["values"], np.array([0, 1], dtype))])
        zero = g.fill_value(data) == 0.0
        product = node.output[0] if zero else prefix + "/product"
        nodes = [helper.make_node("Reshape", [expand.input[0], names["flat"]], [prefix + "/index"],
                                  name=prefix + "/Reshape"),
                 helper.make_node("OneHot", [prefix + "/index", names["depth"], names["values"]], [prefix + "/onehot"],
                                  name=prefix + "/OneHot", axis=-1),
                 helper.make_node("Gemm", [prefix + "/onehot", updates], [product], name=prefix + "/Gemm", transA=1)]
        if not zero:
            nodes.append(helper.make_node("Add", [data, product], [node.output[0]], name=prefix + "/Add"))
        replaced[id(node)] = nodes
    return _replace_nodes(model, replaced, initializers)


def lookup_scatter(g: _Graph, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The ``Expand`` of ``node`` when it is an embedding lookup's gradient, ``ScatterElements(table,
    Expand(index[N, 1]), rows[N, D], axis=0, reduction="add")``, else None."""
    if not _is(node, "ScatterElements") or len(node.input) != 3:
        return None
    attrs = _attrs(node)
    reduction = attrs.get("reduction", b"none")
    if (reduction.decode() if isinstance(reduction, bytes) else reduction) != "add" or attrs.get("axis", 0) != 0:
        return None
    expand = g.producer.get(node.input[1])
    if expand is None or not _is(expand, "Expand") or not _column_of_indices(g, expand.input[0]):
        return None
    return expand


def _column_of_indices(g: _Graph, name: str) -> bool:
    """``name`` is an ``[N, 1]`` tensor: so its shape says, or a ``Reshape`` to ``[-1, 1]`` makes it."""
    shape = g.shapes.get(name)
    if shape is not None:
        return len(shape) == 2 and shape[1] == 1
    producer = g.producer.get(name)
    target = g.const(producer.input[1]) if producer is not None and _is(producer, "Reshape") else None
    return target is not None and target.reshape(-1).tolist() == [-1, 1]


#: metadata key of a graph whose Dropouts take their masks as inputs: JSON ``{input: drop probability}``
HOST_DROPOUT_MASKS = "ort_trainer.host_dropout_masks"
_MASK_INPUT = "ort_trainer/dropout_mask/"


def host_mask_inputs(model: onnx.ModelProto) -> dict[str, float]:
    """``{input name: drop probability}`` of the mask inputs ``host_dropout_masks`` gave ``model``."""
    entry = next((e.value for e in model.metadata_props if e.key == HOST_DROPOUT_MASKS), None)
    return json.loads(entry) if entry else {}


def host_dropout_masks(model: onnx.ModelProto) -> int:
    """Each training-mode float32 Dropout of a static shape as ``x · m``, ``m`` a graph input the
    engine fills every step with a scaled keep mask drawn on the host (``dropout_masks.draw``).

    ONNX Runtime's CPU Dropout draws one float per element from a Mersenne Twister on one thread:
    4.6 ns per element, 20-25 ms of the GPT-2-like and BERT-like steps (4.46 M elements each); the
    host draws 16-bit integers from NumPy's PCG64 at about 1.5 ns per element, mask included. The
    backward's ``g · (Cast(mask) · s)`` reads ``m`` directly, the attention dropout's ``g · y`` as
    ``dropout_gradient`` would write it; any other reader of the mask gets ``Cast(m, bool)``.
    The inputs and their drop probabilities are listed in the model's metadata under
    ``HOST_DROPOUT_MASKS``. Returns the number of Dropouts rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    replaced: dict[int, list[onnx.NodeProto]] = {}
    masks: dict[str, float] = {}
    for drop in [n for n in model.graph.node if _is(n, "Dropout")]:
        ratio = _training_ratio(g, drop)
        x, shape = drop.input[0], g.shapes.get(drop.input[0])
        if (ratio is None or not 0.0 <= ratio < 1.0 or types.get(x) != TensorProto.FLOAT
                or shape is None or not all(isinstance(d, int) and d > 0 for d in shape)):
            continue  # symbolic shapes: the engine could not size the mask before the run
        name = f"{_MASK_INPUT}{len(masks)}"
        masks[name] = ratio
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        nodes = [helper.make_node("Mul", [x, name], [drop.output[0]], name=f"{name}/apply")]
        mask = drop.output[1] if len(drop.output) > 1 else ""
        found = _match_dropout_backward(g, types, drop) if mask else None
        if found is not None and found[3] is not None:  # the attention dropout: g · y
            dead |= _gradient_times_output(found, drop)
        elif found is not None and found[1].output[0] not in g.outputs:  # g · (Cast(mask) · s) -> g · m
            cast, scale_mul = found[0], found[1]
            for reader in g.consumers.get(scale_mul.output[0], []):
                reader.input[:] = [name if i == scale_mul.output[0] else i for i in reader.input]
            dead |= {id(cast), id(scale_mul)}
        elif mask and (g.consumers.get(mask) or mask in g.outputs):
            nodes.append(helper.make_node("Cast", [name], [mask], to=TensorProto.BOOL, name=f"{name}/as_mask"))
        replaced[id(drop)] = nodes
        dead.add(id(drop))
    if not masks:
        return 0
    _keep(model, dead, after=replaced)
    model.metadata_props.append(onnx.StringStringEntryProto(key=HOST_DROPOUT_MASKS, value=json.dumps(masks)))
    return len(masks)


__all__ = ["HOST_DROPOUT_MASKS", "SMALL_TABLE_ROWS", "column_sums", "dropout_gradient", "erf_gelu_order",
           "host_dropout_masks", "host_mask_inputs", "keep_dropouts", "lookup_scatter", "output_reshapes",
           "sequence_reads", "small_table_gradients"]

"""The ``activation_recompute`` joint-graph pass: the values of an activation that the backward
reads are recomputed there from the activation's input, so that the forward keeps one tensor per
activation from the forward to the backward instead of up to three.

The ``gelu`` pass (``gradient/gelu.py``) has each GELU's forward keep what its backward reads: the
erf form ``a = x / √2``, ``Φ`` and the output ``y`` (which the next layer's weight gradient reads
too), the tanh form ``x²``, ``s`` and ``y``. That is three ``[batch, seq, 4 × hidden]`` tensors per
layer alive at the end of the forward, where the graph holds the most; eager PyTorch keeps two
(the GELU's input for ``gelu_backward``, its output for the next ``Linear``). Measured on BERT-base
(B4 × S128, the graph ONNX Runtime optimizes, each value's life from its producer to its last
reader in the node list's order): 216 of the 467 MB alive at that point were GELU values.

Here each region of elementwise nodes computed from one tensor ``x`` and scalar constants, with an
``Erf``, ``Sigmoid`` or ``Tanh`` among them (a GELU's forward, SiLU's...), and read by the
backward, is copied into the backward just before its first reader there, and the backward reads
the copies: the forward keeps ``x`` alone. The copies re-run the region's elementwise nodes once
per step (five per erf-GELU, seven per tanh-GELU, each one pass over the activation).

The copies compute the same operators on the same values as the forward, so their values are
bit-equal to the forward's. Two things would undo them. Common subexpression elimination (the
translation's ran before this pass; ONNX Runtime's runs when a session is made) merges a node
with another of the same operator and inputs; and ONNX Runtime runs a node as soon as it is the
first ready one in the node list, so copies that read forward values only would run in the
forward. So the copies read ``x`` through ``Reshape(x, Shape(x) + sum(empty slice of t))``, ``t``
a backward value the region's first backward reader reads (the gradient arriving there): the
same buffer (a Reshape aliases its input), a name no optimizer can equate with ``x`` or fold, and
a value ONNX Runtime can compute only once the backward has reached that layer.

``transposed_products`` (same module, run before it) matters as much: it keeps ONNX Runtime from
running every weight gradient at the end of the backward, which would hold the copies (and every
layer's input) until then.

Each attention's probabilities are recomputed the same way (``_attention_plan``): the chain from
the scores' product ``MatMul(q, k)`` through scale, mask and ``Softmax`` to the safe softmax's
``Where`` (or through ort_trainer's ``SafeSoftmax`` or ``BiasSafeSoftmax`` kernel, ``fused_safe_softmax``) is
copied before its first backward reader, reading ``q`` through the same no-op ``Reshape`` and ``k`` as it is
(the backward keeps both for their own gradients). The forward then keeps no ``[batch, heads, seq, seq]``
tensor, as eager PyTorch's fused attention keeps none; the copy costs one batched product and a softmax per
layer. Side inputs of the chain (the mask, one flag per row) stay alive to the backward, so a chain with one as
large as the probabilities is left alone.

The backward is the part of the node list from the first node that reads the loss scale (the
gradient seed) on: the joint graph lists the forward first.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...kernels import DOMAIN as KERNELS_DOMAIN, OPSET as KERNELS_OPSET
from ..names import LOSS_SCALE_INPUT
from ._graph import (_ONNX_DOMAINS, _Graph, _drop_unread_transposes, _elem_types, _import_domain, _is, _keep, _op,
                     _op_types, _replace_nodes)

_ELEMENTWISE = {"Mul", "Add", "Sub", "Div", "Neg", "Erf", "Sigmoid", "Tanh"}
_TRANSCENDENTAL = {"Erf", "Sigmoid", "Tanh"}
_SUFFIX = "/recompute"
# between an attention's scores product and its probabilities: scale, mask, safe softmax, reshapes, casts
_ATTENTION_CHAIN = {"Mul", "Div", "Add", "Sub", "Where", "Reshape", "Cast"}
_GEMM_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
# ort_trainer's safe softmax kernels (fused_safe_softmax), BiasSafeSoftmax adding its second input (the mask)
_SAFE_SOFTMAX_KERNELS = {(KERNELS_DOMAIN, "SafeSoftmax"), (KERNELS_DOMAIN, "BiasSafeSoftmax")}
_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_KERNEL_TYPES = (onnx.TensorProto.FLOAT, *_HALF_TYPES)  # AliasAfter's x


def activation_recompute(model: onnx.ModelProto) -> int:
    """Recompute in the backward the activation values it reads (see the module docstring), in place.

    Returns:
        How many regions (activations) are recomputed.
    """
    graph = model.graph
    seed = backward_start(model)
    if seed is None:
        return 0
    g = _Graph(model)
    index = {id(n): i for i, n in enumerate(graph.node)}
    op_of = _op_types(model)
    plans = []
    taken: set[int] = set()
    found = itertools.chain(
        (_plan(root, g, op_of, index, seed) for root in _roots(graph.node[:seed], g, op_of)),
        (_attention_plan(n, g, op_of, index, seed) for n in graph.node[:seed] if _op(n, op_of) == "Softmax"
         or (n.domain, n.op_type) in _SAFE_SOFTMAX_KERNELS))
    for plan in found:
        if plan is not None and not taken & {id(n) for n in plan[0]}:
            taken |= {id(n) for n in plan[0]}
            plans.append(plan)
    return _place(model, seed, plans)


def backward_start(model: onnx.ModelProto) -> int | None:
    """The index of the backward's first node in a joint graph (the first that reads the loss scale, the gradient
    seed: the joint graph lists the forward first), or None in a graph with no gradient seed."""
    return next((i for i, n in enumerate(model.graph.node) if LOSS_SCALE_INPUT in n.input), None)


def backward_readers(values: list[str], g: _Graph, index: dict, seed: int) -> list[onnx.NodeProto]:
    """The backward's nodes (from index ``seed`` on) that read any of ``values``, each once, first first."""
    readers = {id(r): r for name in values for r in g.consumers.get(name, []) if index[id(r)] >= seed}
    return sorted(readers.values(), key=lambda r: index[id(r)])


def _place(model: onnx.ModelProto, seed: int, plans: list) -> int:
    """Put each plan's copies right before its first backward reader and have the backward (the nodes from
    ``seed`` on) read the copies; ``plans``: ``(copies, {forward value: its copy the backward reads}, first backward
    reader, {forward value: its copy or alias})``, the last naming every value a copy gives (each copy takes its
    value's type and shape: a later pass, as ``gelu_forward_kernel``, rewrites only values of known type).
    Returns how many plans there were."""
    graph = model.graph
    before: dict[int, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    infos = {info.name: info for info in graph.value_info}
    for copies, names, first_reader, typed in plans:
        before.setdefault(id(first_reader), []).extend(copies)
        renamed.update(names)
        for old, new in typed.items():
            if old in infos:
                info = graph.value_info.add()
                info.CopyFrom(infos[old])
                info.name = new
    for node in graph.node[seed:]:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    if plans:
        _keep(model, set(), before=before)
    return len(plans)


def _copy_nodes(members: list[onnx.NodeProto], inputs: dict[str, str], suffix: str
                ) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """Copies of ``members`` (in order), each output named with ``suffix``, reading ``inputs[name]`` for an input
    ``name`` given there and each other's copies; ``(copies, {member output: its copy's})``."""
    names = {name: name + suffix for m in members for name in m.output}
    copies = []
    for member in members:
        copy = onnx.NodeProto()
        copy.CopyFrom(member)
        copy.name = (member.name or member.output[0]) + suffix
        copy.input[:] = [inputs.get(name, names.get(name, name)) for name in member.input]
        copy.output[:] = [names[name] for name in member.output]
        copies.append(copy)
    return copies, names


def transposed_products(model: onnx.ModelProto, matmul_types: tuple = _GEMM_TYPES) -> int:
    """Fold each 2-D ``Transpose`` that a ``MatMul`` (of ``matmul_types``) or ``Gemm`` reads into the
    product (``Gemm``'s ``transA`` / ``transB``), in place; returns how many products changed.

    ONNX Runtime makes the same fusion (``FusedMatMul``, ``GemmTransposeFusion``), but its fused
    nodes come last in the order its sessions run nodes in (``ExecutionOrder.PRIORITY_BASED``: the
    ready node first in the node list, and nodes an optimizer adds are appended to it): a weight's
    gradient ``MatMul(Transpose(dY), x)``, which nothing else waits for, then ran at the very end
    of the backward, and every layer's input ``x`` stayed alive until then. Written as ``Gemm`` here
    they run where the backward reaches them. A product of a tensor of another rank, or a ``MatMul``
    of another type than float32 / float64, is left alone (``half_transposed_products`` takes the half
    ones).
    """
    graph = model.graph
    g = _Graph(model)
    types = _elem_types(model)

    def untransposed(name: str) -> tuple[str, int] | None:
        """The tensor ``name`` transposes (through any chain of 2-D Transposes) and how many."""
        count = 0
        while True:
            node = g.producer.get(name)
            perm = None if node is None or not _is(node, "Transpose") else next(
                (list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm != [1, 0]:
                return (name, count) if count else None
            name, count = node.input[0], count + 1

    count = 0
    for node in graph.node:
        if node.domain not in _ONNX_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
            continue
        sources = [untransposed(name) for name in node.input[:2]]
        if sources == [None, None]:
            continue
        if node.op_type == "MatMul":
            if any(len(g.shapes.get(name) or ()) != 2 or types.get(name) not in matmul_types for name in node.input):
                continue  # a batched product, a type left to another call, or ranks unknown
            flags = {"transA": 0, "transB": 0}
        elif matmul_types is _HALF_TYPES:
            continue  # the float32 call's (transposed_products): it folds every Gemm
        else:
            flags = {a.name: a.i for a in node.attribute if a.name in ("transA", "transB")}
        for position, (source, flag) in enumerate(zip(sources, ("transA", "transB"))):
            if source is not None:
                node.input[position] = source[0]
                flags[flag] = (flags.get(flag, 0) + source[1]) % 2
        kept = [a for a in node.attribute if a.name not in ("transA", "transB")]
        del node.attribute[:]
        node.attribute.extend([*kept, *(helper.make_attribute(k, v) for k, v in sorted(flags.items()) if v)])
        node.op_type = "Gemm"
        count += 1
    if count:
        _drop_unread_transposes(model, g.outputs)
    return count


def half_transposed_products(model: onnx.ModelProto) -> int:
    """``transposed_products`` for the float16 and bfloat16 ``MatMul`` nodes of a mixed-precision graph
    (``half_precision_transposed_products``); returns how many products changed.

    ONNX Runtime's CUDA provider fuses a ``Transpose`` read by a ``MatMul`` into a ``FusedMatMul`` too,
    and its fused node runs last as on the CPU: every weight gradient of the half backward waited for
    the end of the step, and with it every layer's input it reads. ``Gemm`` has float16 kernels on the
    CPU and CUDA and bfloat16 ones on CUDA (the CPU multiplies no bfloat16 at all).
    """
    return transposed_products(model, _HALF_TYPES)


def _scalar(g: _Graph, name: str) -> bool:
    value = g.const(name)
    return value is not None and value.size == 1


def _roots(forward: list[onnx.NodeProto], g: _Graph, op_of: dict) -> list[str]:
    """Values that elementwise nodes of the forward read and that no elementwise node computes
    (a matrix product's output, a reshape of it...), in order."""
    roots: dict[str, None] = {}
    for node in forward:
        if _op(node, op_of) not in _ELEMENTWISE:
            continue
        for name in node.input:
            producer = g.producer.get(name)
            if name and not _scalar(g, name) and (producer is None or _op(producer, op_of) not in _ELEMENTWISE):
                roots.setdefault(name)
    return list(roots)


def _plan(root: str, g: _Graph, op_of: dict, index: dict, seed: int):
    """``(copies, {forward value: its copy}, first backward reader)`` for the region of ``root``, or
    None where it has no transcendental node, nothing to gain, or no backward value to wait for."""
    members: list[onnx.NodeProto] = []
    member_ids: set[int] = set()
    known, queue = {root}, [root]
    while queue:
        for node in g.consumers.get(queue.pop(), []):
            if index[id(node)] >= seed or id(node) in member_ids:
                continue
            op = _op(node, op_of)
            inside = (op in _ELEMENTWISE and all(n in known or _scalar(g, n) for n in node.input)) or (
                op == "Reshape" and node.input[0] in known)
            if inside:
                members.append(node)
                member_ids.add(id(node))
                known.update(node.output)
                queue.extend(node.output)
    if not any(_op(n, op_of) in _TRANSCENDENTAL for n in members):
        return None
    members.sort(key=lambda n: index[id(n)])
    readers = {name: [r for r in g.consumers.get(name, []) if index[id(r)] >= seed]
               for m in members for name in m.output}
    saved = [name for name, rs in readers.items() if rs]
    if not saved or any(name in g.outputs for m in members for name in m.output):
        return None
    # each Reshape's output shares its input's buffer: count the buffers the forward keeps
    producer = {name: m for m in members for name in m.output}
    buffers = {_owner(name, producer, op_of) for name in saved}
    root_read = any(index[id(r)] >= seed for r in g.consumers.get(root, []))
    if len(buffers) - (0 if root_read else 1) <= 0:
        return None
    return _copied(members, saved, root, root + _SUFFIX, g, index, seed)


def _attention_plan(softmax: onnx.NodeProto, g: _Graph, op_of: dict, index: dict, seed: int):
    """``_plan``'s result for an attention's probabilities: the nodes from the scores' product
    ``MatMul(q, k)`` through the ``Softmax`` to the probabilities the backward reads (scale, mask,
    the safe softmax's ``Where``, reshapes between), copied into the backward, which keeps q and k
    for their own gradients anyway; or None where the chain has another shape, a side input (a
    mask...) as large as the probabilities, a product that is not of two activations of rank 3 or
    more (a weight's), or q or k not read by the backward.

    Eager PyTorch's fused attention keeps no probabilities either; the copy costs one batched
    product and a softmax per layer (BERT-base B4 × S128: 12 × [4, 12, 128, 128], 38 MB kept less).
    """
    def chain_input(node: onnx.NodeProto) -> str | None:
        """The input of ``node`` the size of its output; the others must be constants or smaller
        (they stay alive to the backward: a mask, one flag per row)."""
        size = _numel(g.shapes.get(node.output[0]))
        if size is None:
            return None
        same = [n for n in node.input if _numel(g.shapes.get(n)) == size and g.const(n) is None]
        others = [n for n in node.input if n and n not in same]
        if len(same) != 1 or any(g.const(n) is None and (_numel(g.shapes.get(n)) or size) >= size for n in others):
            return None
        return same[0]

    members, value = [softmax], softmax.input[0]
    if len(softmax.input) > 1 and chain_input(softmax) != value:
        return None  # BiasSafeSoftmax with a bias as large as the scores (it would stay alive to the backward)
    while True:  # up to the scores' product
        node = g.producer.get(value)
        if node is None or index[id(node)] >= seed:
            return None
        op = _op(node, op_of)
        if op == "MatMul":
            product = node
            # of two activations of rank 3 or more, as q·kᵀ is: not a product with a weight (a
            # softmax over a vocabulary would recompute the whole head)
            if any(g.producer.get(name) is None or len(g.shapes.get(name) or ()) < 3 for name in node.input):
                return None
            break
        value = chain_input(node) if op in _ATTENTION_CHAIN else None
        if value is None:
            return None
        members.append(node)
    members.append(product)
    values = [softmax.output[0]]
    while values:  # down to the probabilities the products read
        for node in g.consumers.get(values.pop(), []):
            if index[id(node)] < seed and _op(node, op_of) in _ATTENTION_CHAIN and chain_input(node) in \
                    {o for m in members for o in m.output}:
                members.append(node)
                values.extend(node.output)
    members.sort(key=lambda n: index[id(n)])

    def backward_readers(name: str) -> list[onnx.NodeProto]:
        return [r for r in g.consumers.get(name, []) if index[id(r)] >= seed]

    producer = {name: m for m in members for name in m.output}
    if any(not backward_readers(name) and not backward_readers(_owner(name, g.producer, op_of))
           for name in product.input):
        return None  # the copy would keep q or k alive longer than the backward does
    saved = [name for m in members for name in m.output if backward_readers(name)]
    if not saved or any(name in g.outputs for name in producer):
        return None
    query = product.input[0]
    return _copied(members, saved, query, f"{product.output[0]}/{query}{_SUFFIX}", g, index, seed)


def _copied(members: list[onnx.NodeProto], saved: list[str], root: str, start: str, g: _Graph, index: dict,
            seed: int):
    """The plan of a region (``members``, in node order) whose values ``saved`` the backward reads:
    ``(copies, {saved value: its copy}, first backward reader)``, the copies of the members those
    values are computed from reading ``root`` as ``start`` (``_alias_after``, waiting for a backward
    value); None where there is no backward value to wait for. The plan's last item names the value of each
    copy and of the alias (``_place``)."""
    readers = backward_readers(saved, g, index, seed)
    after = _barrier_value(readers, g, index, seed)
    if after is None:
        return None
    needed = _ancestors(saved, {name: m for m in members for name in m.output})
    copies, names = _copy_nodes([m for m in members if id(m) in needed], {root: start}, _SUFFIX)
    return _alias_after(root, after, start) + copies, {n: names[n] for n in saved}, readers[0], {**names, root: start}


def _numel(shape: list | None) -> int | None:
    """Elements of a static shape, None when unknown or symbolic."""
    if shape is None or any(not isinstance(d, int) or d <= 0 for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


def _barrier_value(readers: list[onnx.NodeProto], g: _Graph, index: dict, seed: int) -> str | None:
    """A backward value computed before the first of ``readers`` (the backward's readers of the
    region, first first; the copies go right before it) and not from what they compute, so the
    copies can wait for it: an input of the readers (a GELU's: the gradient arriving there), else of
    the nodes reading their outputs (an attention's first reader, the transpose of the
    probabilities, reads nothing else; its product reads the gradient arriving there), the latest
    computed; None where there is none."""
    tainted: set[str] = set()
    queue = [name for reader in readers for name in reader.output]
    while queue:
        name = queue.pop()
        if name not in tainted:
            tainted.add(name)
            queue.extend(o for consumer in g.consumers.get(name, []) for o in consumer.output)
    first = index[id(readers[0])]

    def usable(name: str) -> bool:
        producer = g.producer.get(name)
        return name not in tainted and producer is not None and seed <= index[id(producer)] < first

    for reader in readers:
        for name in reader.input:
            if usable(name):
                return name
    later = [name for reader in readers for out in reader.output for consumer in g.consumers.get(out, [])
             for name in consumer.input if usable(name)]
    return max(later, key=lambda name: index[id(g.producer[name])], default=None)


def _alias_after(root: str, after: str, out: str) -> list[onnx.NodeProto]:
    """Nodes giving ``out``: ``root`` itself (a Reshape to its own shape, which aliases it) that ONNX
    Runtime can compute only once ``after`` is: the shape is ``Shape(root)`` plus the sum of an
    empty slice of ``after`` (0 whatever ``after`` holds, NaNs included), a value no optimizer can fold.
    ``after`` is sliced flattened (``Reshape(after, [-1])``, an alias): it may be a scalar, the gradient of a
    sum arriving at the region's reader.
    """
    def name(part: str) -> str:
        return f"{out}/{part}"

    return [
        helper.make_node("Constant", [], [name("zero")], value=numpy_helper.from_array(np.zeros(1, np.int64)),
                         name=name("zero")),
        helper.make_node("Constant", [], [name("flat_shape")], value=numpy_helper.from_array(np.array([-1], np.int64)),
                         name=name("flat_shape")),
        helper.make_node("Reshape", [after, name("flat_shape")], [name("flat")], name=name("flat")),
        helper.make_node("Slice", [name("flat"), name("zero"), name("zero"), name("zero")], [name("empty")],
                         name=name("empty")),
        helper.make_node("Cast", [name("empty")], [name("empty_float")], to=onnx.TensorProto.FLOAT,
                         name=name("empty_float")),
        helper.make_node("ReduceSum", [name("empty_float")], [name("sum")], keepdims=0, name=name("sum")),
        helper.make_node("Cast", [name("sum")], [name("nothing")], to=onnx.TensorProto.INT64, name=name("nothing")),
        helper.make_node("Shape", [root], [name("shape")], name=name("shape")),
        helper.make_node("Add", [name("shape"), name("nothing")], [name("same_shape")], name=name("same_shape")),
        helper.make_node("Reshape", [root, name("same_shape")], [out], name=out),
    ]


def device_barriers(model: onnx.ModelProto) -> int:
    """Each wait ``_alias_after`` wrote for ``activation_recompute`` and ``layer_recompute`` (``Reshape(x, Shape(x)
    + sum(empty slice of t))``) as one ``AliasAfter(x, t)`` node of ort_trainer's kernel library: ``x`` itself (an
    alias of its buffer, no copy), once ``t`` is computed, in place. A Reshape reads its shape on the host, so on a
    GPU ONNX Runtime copies the sum from the device every step: a wait for the GPU at each recomputed region and a
    graph that cannot be captured (``device.cuda_graph``); the kernel's node keeps the wait on the device. A wait of
    an ``x`` of a dtype the kernel lacks (float64) is left as it is. Returns how many waits were rewritten."""
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        after = _waited_for(node, g) if _is(node, "Reshape") else None
        if after is not None and types.get(node.input[0]) in _KERNEL_TYPES:
            replaced[id(node)] = [helper.make_node("AliasAfter", [node.input[0], after], list(node.output),
                                                   name=node.name, domain=KERNELS_DOMAIN)]
    if replaced:
        _import_domain(model, KERNELS_DOMAIN, KERNELS_OPSET)
    return _replace_nodes(model, replaced, {})


def _waited_for(reshape: onnx.NodeProto, g: _Graph) -> str | None:
    """``t`` where ``reshape`` is ``_alias_after``'s ``Reshape(x, Shape(x) + Cast(ReduceSum(Cast(Slice(t, 0, 0,
    0)))))``, else None."""
    def producer(node: onnx.NodeProto | None, op_type: str, index: int = 0) -> onnx.NodeProto | None:
        return g.producer.get(node.input[index]) if node is not None and _is(node, op_type) else None

    add = g.producer.get(reshape.input[1])
    shape, cast = producer(add, "Add", 0), producer(add, "Add", 1)
    widened = producer(producer(cast, "Cast"), "ReduceSum")
    empty = producer(widened, "Cast")
    if (empty is None or not _is(empty, "Slice") or len(empty.input) != 4 or shape is None or not _is(shape, "Shape")
            or shape.attribute or shape.input[0] != reshape.input[0]):
        return None
    zeros = [g.const(name) for name in empty.input[1:]]
    if not all(z is not None and z.shape == (1,) and z[0] == 0 for z in zeros):
        return None
    flat = g.producer.get(empty.input[0])  # (t flattened: waiting for it is waiting for t)
    shape = g.const(flat.input[1]) if flat is not None and _is(flat, "Reshape") else None
    return flat.input[0] if shape is not None and list(shape) == [-1] else empty.input[0]


def _owner(name: str, producer: dict, op_of: dict) -> str:
    """The value whose buffer ``name`` is (through Reshapes, which alias their input)."""
    node = producer.get(name)
    while node is not None and _op(node, op_of) == "Reshape":
        name = node.input[0]
        node = producer.get(name)
    return name


def _ancestors(saved: list[str], producer: dict) -> set[int]:
    """Ids of the region's nodes that the ``saved`` values are computed from (themselves included)."""
    found: set[int] = set()
    stack = [producer[name] for name in saved]
    while stack:
        node = stack.pop()
        if id(node) in found:
            continue
        found.add(id(node))
        stack.extend(producer[name] for name in node.input if name in producer)
    return found


__all__ = ["activation_recompute", "transposed_products"]

"""``aligned_products``: matrix products on operands padded to aligned widths.

A GPT-2 vocabulary is 50257 words wide and BERT's 30522: the language-model head's three products
(the forward ``x · Wᵀ``, the backward ``dY · W`` and ``dYᵀ · x``) read or write a matrix whose rows
are 100514 (60044) bytes apart in half precision, not a multiple of 16. Hopper's tensor-core kernels
(TMA) need 16-byte aligned rows; cuBLAS then falls back to older kernels (the ``cutlass_75 …
s1688gemm`` kernels of the GPU profile, in eager PyTorch as in ONNX Runtime). nanoGPT pads its
vocabulary to 50304 for this; inductor pads the operands of each product (``pad_mm``).

Here each product's dimensions are padded as inductor does, inside the graph: a dimension M, K or N
of at least ``MIN_DIMENSION`` elements that is not a multiple of ``ALIGNMENT`` and that some operand
(or the result) holds as its contiguous axis is padded with zeros to a multiple of ``PAD_TO``:

- K (the summed one): both operands padded; the extra products are zeros, the result unchanged;
- N: ``B`` padded, the result's extra columns sliced off;
- M (only where ``A`` is transposed, as in ``dYᵀ · x``: its contiguous axis): ``A`` padded, the
  result's extra rows sliced off.

The zeros are concatenated (``Concat`` with a constant of zeros: ``Concat`` and ``Slice`` have CUDA
kernels for every type, where the CUDA ``Pad`` read in ONNX Runtime's sources registers float32, float64
and float16 only) to the tensor a chain of 2-D ``Transpose`` nodes starts from (its axes permuted),
below the transposes, so that ONNX Runtime's ``MatmulTransposeFusion`` still folds them into the
product; one tensor padded alike for several products is padded once (the head's ``dY``, read by both
of its backward products, and the weight, read by the forward and ``dY · W``). The values the user
sees are unchanged: every padded element multiplies a zero, every sliced-off one is dropped. The cost:
a padded copy of the head's weight and of ``dY`` per step, and the logits sliced out of the wider product.

``MatMul`` (``A`` of any rank ≥ 2, ``B`` a matrix), ``Gemm`` without a bias input or with a bias vector
over the result's columns (BERT's head: padded with zeros as ``B`` is) and ``com.microsoft.FusedMatMul`` of
2-D operands are rewritten; products with dynamic M, K or N or a batched ``B`` are left alone. An operand's
other dimensions may be dynamic (the rows a loss keeps for its labels): its zeros are then a zero
``Expand``-ed to its run-time shape.

Where the fused cross-entropy (``graph_optimizations.fused_cross_entropy``, ``CrossEntropy`` and
``CrossEntropyGrad`` of ort_trainer's kernels) reads a result sliced back on its columns, it reads the padded
product instead, told how many of a row's values are scores (the attribute ``classes``), and writes the
gradient as wide as the product, zeros past the scores: the backward products read it as it is, so the
sliced copy of the logits and the padded copy of their gradient both go.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ._graph import (_ONNX_DOMAINS, _Graph, _attrs, _drop_unread_transposes, _elem_types, _is, _keep, _redirect,
                     _value_info_like)

ALIGNMENT = 8  # 16 bytes of float16 / bfloat16 (32 of float32)
PAD_TO = 64
MIN_DIMENSION = 1024  # padding costs at most 64 / 1024 = 6 % more work; smaller products are left alone
_ITEM_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
               onnx.TensorProto.DOUBLE: 8}
_FLOATS = tuple(_ITEM_BYTES)


def _padded(size) -> int | None:
    """The padded size of a dimension that needs it, else None."""
    if not isinstance(size, int) or size < MIN_DIMENSION or size % ALIGNMENT == 0:
        return None
    return -(-size // PAD_TO) * PAD_TO


def _product(node: onnx.NodeProto, g: _Graph) -> tuple[bool, bool] | None:
    """``(transA, transB)`` of a product this pass rewrites, else None."""
    if node.domain in _ONNX_DOMAINS and node.op_type == "MatMul":
        flags = (False, False)
    elif node.domain in _ONNX_DOMAINS and node.op_type == "Gemm" and (len(node.input) == 2 or _bias(node, g)):
        attrs = _attrs(node)
        flags = (bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0)))
    elif node.domain == "com.microsoft" and node.op_type == "FusedMatMul":
        attrs = _attrs(node)
        if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
            return None
        flags = (bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0)))
    else:
        return None
    a, b = (g.shapes.get(name) for name in node.input[:2])
    out = g.shapes.get(node.output[0])
    if a is None and b is not None and out is not None and node.op_type == "MatMul" and len(b) == 2:
        a = g.shapes[node.input[0]] = [*out[:-1], b[0]]  # a value a pass made (output_reshape's view)
    if a is None or b is None or len(b) != 2 or len(a) < 2 or (len(a) != 2 and (node.op_type != "MatMul")):
        return None
    return flags


def _bias(node: onnx.NodeProto, g: _Graph) -> bool:
    """A ``Gemm``'s C is a vector over the result's columns (a head's bias: padded with N)."""
    c, out = g.shapes.get(node.input[2]), g.shapes.get(node.output[0])
    return c is not None and out is not None and len(c) == 1 and isinstance(c[0], int) and c[0] == out[-1] != 1


def aligned_products(model: onnx.ModelProto) -> int:
    """Pad the unaligned dimensions of every product (see the module docstring), in place; returns
    how many products changed."""
    graph = model.graph
    g = _Graph(model)
    types = _elem_types(model)
    before: dict[int, list[onnx.NodeProto]] = {}
    columns: dict[str, tuple[str, int, int]] = {}  # a result sliced back on its columns: (padded, width, padded)
    after: dict[int, list[onnx.NodeProto]] = {}
    pads: dict[tuple, str] = {}  # (tensor, pads) -> its padded copy; (transposed copy, depth) -> itself
    count = 0
    for node in graph.node:
        flags = _product(node, g)
        if flags is None or types.get(node.output[0]) not in _FLOATS:
            continue
        trans_a, trans_b = flags
        a_shape, b_shape = g.shapes[node.input[0]], g.shapes[node.input[1]]
        m = a_shape[-1] if trans_a else a_shape[-2]
        k = a_shape[-2] if trans_a else a_shape[-1]
        n = b_shape[0] if trans_b else b_shape[1]
        # how each operand lies in memory once ONNX Runtime folds the transposes that feed the product
        stored_a = trans_a != (len(_transposes(node.input[0], g)) % 2 == 1)
        stored_b = trans_b != (len(_transposes(node.input[1], g)) % 2 == 1)
        # the contiguous axis of A is K (M when stored transposed), of B N (K when stored transposed), of
        # the result N
        new_m = _padded(m) if stored_a and len(a_shape) == 2 else None
        new_k = _padded(k) if (not stored_a or stored_b) else None
        new_n = _padded(n)
        if not (new_m or new_k or new_n):
            continue
        a_extra, b_extra = [0] * len(a_shape), [0, 0]
        if new_k:
            a_extra[-2 if trans_a else -1] = new_k - k
            b_extra[1 if trans_b else 0] = new_k - k
        if new_m:
            a_extra[-1 if trans_a else -2] = new_m - m
        if new_n:
            b_extra[0 if trans_b else 1] = new_n - n
        elem = types[node.output[0]]
        node.input[0], node.input[1] = (
            _pad(name, shape, elem, extra, g, pads, before.setdefault(id(node), [])) if any(extra) else name
            for name, shape, extra in ((node.input[0], a_shape, a_extra), (node.input[1], b_shape, b_extra)))
        if len(node.input) == 3 and new_n:  # Gemm's bias vector: zeros under the padded columns
            node.input[2] = _pad(node.input[2], [n], elem, [new_n - n], g, pads, before.setdefault(id(node), []))
        slices = ([(len(a_shape) - 1, n)] if new_n else []) + ([(0, m)] if new_m else [])
        if slices:
            after[id(node)] = _slice_back(node, slices)
            if not new_m and len(a_shape) == 2:
                columns[node.output[0].removesuffix("/aligned")] = (node.output[0], n, new_n)
        count += 1
    if count:
        _keep(model, set(), before=before, after=after)
        _scores_read_padded(model, columns, pads)
        _drop_unread_transposes(model, g.outputs)
    return count


def _scores_read_padded(model: onnx.ModelProto, columns: dict[str, tuple[str, int, int]], pads: dict) -> None:
    """The fused cross-entropy reads a padded product's scores where they lie: each ``CrossEntropy`` and
    ``CrossEntropyGrad`` (``ort_trainer`` domain) of a sliced result (``columns``: ``{result: (padded product,
    classes, padded width)}``) reads the padded one with the attribute ``classes`` (the row's first ``classes``
    scores; the gradient zero in the rest). The slice goes where nothing else reads it, and so does the gradient's
    padded copy (``pads``) that the head's backward products read: they read the gradient itself."""
    g = _Graph(model)
    dead, after, renamed = {}, {}, {}
    for node in model.graph.node:
        if node.domain != _KERNELS_DOMAIN or node.op_type not in ("CrossEntropy", "CrossEntropyGrad"):
            continue
        x = 1 if node.op_type == "CrossEntropyGrad" else 0
        if node.input[x] not in columns or any(a.name == "classes" for a in node.attribute):
            continue
        padded, classes, width = columns[node.input[x]]
        node.input[x] = padded
        node.attribute.append(helper.make_attribute("classes", classes))
        if node.op_type == "CrossEntropy":
            continue
        dx = node.output[0]
        node.output[0] = f"{dx}/padded"
        shape = g.shapes.get(dx)  # the gradient's shape, for the passes after this one and shape inference
        _value_info_like(model, dx, node.output[0], [*shape[:-1], width] if shape else None)
        copy = pads.get((dx, (0, width - classes)))
        if copy is not None:  # the products read the gradient as it comes
            renamed[copy] = node.output[0]
            dead[id(g.producer[copy])] = g.producer[copy]
        # its readers but the padded copy's nodes (its Concat, the run-time shape of its zeros)
        readers = [r for r in g.consumers.get(dx, []) if not all("/aligned_pad_" in name for name in r.output)]
        if readers or dx in g.outputs:
            after[id(node)] = _slicing(node.output[0], dx, [(1, classes)])
    identities = _redirect(model, renamed, set(dead))  # (in a graph with subgraphs: an Identity where the copy was)
    before = {key: [identities[copy.output[0]]] for key, copy in dead.items() if copy.output[0] in identities}
    _keep(model, set(dead), before=before, after=after)
    # this pass's nodes that nothing reads any more: the slices, the padded copies' zeros (and their constants)
    while True:
        read = {name for n in model.graph.node for name in n.input} | g.outputs
        unread = [n for n in model.graph.node  # (held: the ids stay theirs)
                  if all("/aligned_" in name and name not in read for name in n.output)]
        if not unread:
            return
        _keep(model, {id(n) for n in unread})


def _transposes(name: str, g: _Graph) -> list[onnx.NodeProto]:
    """The chain of 2-D ``Transpose`` nodes that ``name`` comes out of, the last one first."""
    chain = []
    while True:
        producer = g.producer.get(name)
        if producer is None or not _is(producer, "Transpose") or _attrs(producer).get("perm") != [1, 0]:
            return chain
        chain.append(producer)
        name = producer.input[0]


def _pad(name: str, shape: list[int], elem: int, extra: list[int], g: _Graph, pads: dict,
         nodes: list[onnx.NodeProto]) -> str:
    """``name`` (of ``shape`` and element type ``elem``) with ``extra`` zeros after the end of each axis: a
    ``Concat`` with zeros on the tensor its chain of 2-D transposes starts from (see the module docstring),
    the transposes repeated on the padded copy (new nodes appended to ``nodes``; a tensor padded alike
    before is reused); returns the padded tensor's name."""
    chain = _transposes(name, g)
    source = chain[-1].input[0] if chain else name
    odd = len(chain) % 2
    source_extra = tuple(extra[::-1] if odd else extra)
    padded = pads.get((source, source_extra))
    if padded is None:
        padded = pads[(source, source_extra)] = f"{source}/aligned_pad_{'_'.join(map(str, source_extra))}"
        current, current_shape = source, list(shape[::-1] if odd else shape)
        for axis, amount in enumerate(source_extra):
            if not amount:
                continue
            zeros = f"{padded}/zeros{axis}"
            nodes.extend(_zeros(zeros, elem, current, current_shape, axis, amount))
            current_shape[axis] += amount
            out = padded if sum(1 for a in source_extra[axis + 1:] if a) == 0 else f"{padded}/axis{axis}"
            nodes.append(helper.make_node("Concat", [current, zeros], [out], axis=axis, name=out))
            current = out
    for depth in range(1, len(chain) + 1):  # the transposes again, on the padded copy (once per copy)
        transposed = f"{padded}/transposed{depth}"
        if (transposed, depth) not in pads:
            pads[(transposed, depth)] = transposed
            nodes.append(helper.make_node("Transpose", [padded], [transposed], perm=[1, 0], name=transposed))
        padded = transposed
    return padded


def _zeros(name: str, elem: int, source: str, shape: list, axis: int, amount: int) -> list[onnx.NodeProto]:
    """The nodes that make ``name``: zeros of ``source``'s ``shape`` but ``amount`` long on ``axis``. A constant
    where every other dimension is static; else (a dimension only known at run time, as the rows a loss keeps) a
    zero expanded to ``source``'s run-time shape with ``axis`` replaced (``Expand`` runs on CUDA for every type)."""
    zeros_shape = [*shape[:axis], amount, *shape[axis + 1:]]
    if all(isinstance(size, int) for size in zeros_shape):
        return [helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, elem, zeros_shape, b"\0" * (_ITEM_BYTES[elem] * math.prod(zeros_shape)), raw=True))]
    rank = len(shape)
    nodes = [helper.make_node("Constant", [], [f"{name}/zero"], value=helper.make_tensor(
                 f"{name}/zero", elem, [1] * rank, b"\0" * _ITEM_BYTES[elem], raw=True)),
             helper.make_node("Constant", [], [f"{name}/amount"], value=helper.make_tensor(
                 f"{name}/amount", onnx.TensorProto.INT64, [1], [amount]))]
    parts = [f"{name}/amount"]  # the zeros' shape: source's dims before axis, amount, source's dims after it
    if axis > 0:
        nodes.append(helper.make_node("Shape", [source], [f"{name}/before"], end=axis))
        parts.insert(0, f"{name}/before")
    if axis + 1 < rank:
        nodes.append(helper.make_node("Shape", [source], [f"{name}/after"], start=axis + 1))
        parts.append(f"{name}/after")
    return [*nodes, helper.make_node("Concat", parts, [f"{name}/shape"], axis=0),
            helper.make_node("Expand", [f"{name}/zero", f"{name}/shape"], [name], name=name)]


def _slice_back(node: onnx.NodeProto, slices: list[tuple[int, int]]) -> list[onnx.NodeProto]:
    """The product now writes ``<output>/aligned``; the nodes that slice ``<output>`` out of it (each
    ``(axis, size)`` of ``slices`` cut back to ``size``)."""
    result = node.output[0]
    node.output[0] = f"{result}/aligned"
    return _slicing(node.output[0], result, slices)


def _slicing(source: str, result: str, slices: list[tuple[int, int]]) -> list[onnx.NodeProto]:
    """The nodes that slice ``result`` out of ``source`` (see ``_slice_back``)."""
    name = f"{result}/aligned_slice"
    axes, ends = zip(*slices)
    constants = [helper.make_node("Constant", [], [f"{name}/{what}"], value=helper.make_tensor(
        f"{name}/{what}", onnx.TensorProto.INT64, [len(axes)], values))
        for what, values in (("starts", [0] * len(axes)), ("ends", list(ends)), ("axes", list(axes)))]
    return [*constants, helper.make_node("Slice", [source, *(c.output[0] for c in constants)], [result], name=name)]


__all__ = ["aligned_products"]

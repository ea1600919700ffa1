"""The softmax passes on the ``"torch"`` source's joint graph: ``safe_softmax`` (the guard of
fully masked rows) and ``half_precision_softmax_gradient`` (a float16 softmax's gradient in float16).

``scaled_dot_product_attention`` (HF GPT-2's and BERT's ``sdpa`` attention) computes its softmax
as ``aten._safe_softmax``, whose decomposition (``torch/_decomp/decompositions.py``) zeroes the
rows that are entirely ``-inf`` (fully masked), where a plain softmax gives NaN::

    out = softmax(x, dim)
    masked_rows = all(x == -inf, dim, keepdim=True)
    return where(masked_rows, zeros_like(out), out)

``all`` comes out of the core-ATen decomposition as ``not(any(not(...)))`` and torchlib's ``any``
as ``Cast(ReduceMax(Cast(..., int64)), bool)``, so the graph holds ``Equal(x, -inf)``, ``Not``,
``Cast`` to int64 (8 bytes per element), ``ReduceMax``, ``Cast``, ``Not`` and a
``Where(rows, zeros, out)`` whose ``zeros`` is a full-size constant: five passes over the
``[B, H, S, S]`` scores and a Where that ONNX Runtime runs as two selections into temporaries of
the output's size and a merge (``where_op.cc``). Per attention layer of the GPT-2-like model,
~1.7 ms of kernel time besides the softmax.

The pass computes the same rows from two reductions of ``x`` (``[B, H, S, 1]`` results) and
keeps one ``Where`` with a scalar zero: a row is entirely ``-inf`` iff its maximum is ``-inf``
and its sum is not NaN. The sum is needed because ONNX Runtime's ``ReduceMax`` skips NaN (1.19
and 1.31, measured: ``[NaN, -inf, ...]`` has maximum ``-inf``), while torch's ``x == -inf`` is
false at a NaN, so such a row is not masked and its softmax, NaN, is kept; a NaN or a ``+inf``
makes the sum NaN. Rows holding ``+inf`` have maximum ``+inf`` and are not masked either, as in
torch. The output is bit-equal: the same Softmax on the same input, the same selection.

The backward has nothing of the guard: ``_safe_softmax``'s derivative is
``_softmax_backward_data(grad, result)``, which reads the guarded output and no mask.

The eval graph (the eval-mode trace translated without decomposition) spells the guard as
torchlib's ``aten__safe_softmax`` does: ``Where(IsNaN(out), 0, out)``, two more passes over the
scores (0.8-0.9 ms per GPT-2-like layer). That zeroes every row whose softmax is NaN, where torch
zeroes only the fully masked ones: the pass gives torch's values there too, so rows holding a NaN
or a ``+inf`` stay NaN, as in eager PyTorch; rows of finite values and ``-inf`` are bit-equal to
the replaced spelling. torchlib also fills a boolean mask with the dtype's lowest value, not
``-inf``, so its fully masked rows came out uniform instead of zero; the pass fills them with
``-inf`` (``_mask_with_minus_inf``), and eval_step matches eager PyTorch there too.

Half-precision scores (``gradient/attention.py``) reach the guard as ``Cast(x, float32) == -inf``
(torch compares in float32): the widening is exact, so the pass reads ``x`` itself. bfloat16
scores are reduced through a float32 cast: ONNX Runtime's CUDA provider has no bfloat16
``ReduceMax`` (1.31.1).

``half_precision_softmax_gradient``: torch decomposes ``_softmax_backward_data`` of a float16
softmax ``y`` (the half-precision attention's) in float32, ``y·dy − y·Σ(y·dy)`` between casts::

    Cast(Sub(Mul(c_dy, c_y), Mul(c_y, ReduceSum(Mul(c_dy, c_y)))), float16)
    with c_dy = Cast(dy, float32), c_y = Cast(y, float32)

seven kernels over the ``[B, H, S, S]`` probabilities reading and writing ~54 bytes per element
(the casts write float32 copies of ``y`` and ``dy``). The pass computes the same formula in
float16, ``Sub(Mul(dy, y), Mul(y, ReduceSum(Mul(dy, y))))``: four kernels, ~18 bytes per element.
The row sum still accumulates in float32 (ONNX Runtime's float16 ``ReduceSum`` reduces in float32
on CUDA: cuDNN with a float32 compute type, ``reduction_ops.cc``); what it adds is float16's
rounding of the product, the sum and the two results (2⁻¹¹ relative each), the rounding the
forward's float16 scores and probabilities already carry. ``bfloat16_softmax_gradient`` does the
same for bfloat16 softmaxes (the row sum a product by a column of ones: ONNX Runtime's CUDA provider
has no bfloat16 ``ReduceSum``), adding bfloat16's roundings (2⁻⁸), again the size of those its
scores and probabilities carry.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..onnx_graph import onnx_opset
from ._graph import (_Graph, _all_nodes, _attrs, _elem_types, _is, _keep, _other, _shared_constants,
                     _sole_consumer)

_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_BFLOAT16_LOWEST = -float.fromhex("0x1.fep127")  # NumPy's finfo knows no bfloat16


def safe_softmax(model: onnx.ModelProto) -> int:
    """Rewrite each decomposed ``_safe_softmax`` guard into two row reductions and one ``Where``.

    Pattern: ``Where(all_rows, zeros, Softmax(x, axis))`` with ``all_rows`` one of torchlib's
    spellings of ``all(Equal(x, -inf), axis, keepdim=True)`` (``Not(Cast(ReduceMax(Cast(Not(eq),
    int64)), bool))`` or ``Cast(ReduceMin(Cast(eq, int64)), bool)``, identity casts allowed), or
    ``IsNaN`` of the softmax (the eval graph's spelling), and ``zeros`` a constant 0 no larger
    than ``x``. Becomes ``Where(And(ReduceMax(x) == -inf,
    ReduceSum(x) == ReduceSum(x)), 0, Softmax(x, axis))`` over ``axis`` with ``keepdims``.

    Args:
        model: a joint or eval graph of the ``"torch"`` source, rewritten in place.

    Returns:
        The number of guards rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    opset = onnx_opset(model)
    if opset < 18:
        return 0  # ReduceMax takes its axes as an input from opset 18 on
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    replaced_zeros: set[str] = set()
    guarded: dict[str, int] = {}  # softmax input -> element type, for the IsNaN spelling
    for where in [n for n in model.graph.node if _is(n, "Where")]:
        found = _match(g, types, where)
        if found is None:
            continue
        x, axes, axis, elem_type, zeros, chain = found
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        minus_inf, zero = _minus_inf_name(elem_type), f"ort_trainer/safe_softmax/zero_{np.dtype(dtype).name}"
        constants = [(minus_inf, np.array(-np.inf, dtype)), (zero, np.array(0.0, dtype))]
        if axes is None:  # the IsNaN spelling has no reduction whose axes could be reused
            guarded[x] = elem_type
            axes = f"ort_trainer/safe_softmax/axes_{axis}"
            constants.append((axes, np.array([axis], np.int64)))
        prefix = f"{where.name or where.output[0]}/safe_softmax"
        widen = []
        if elem_type == TensorProto.BFLOAT16:
            # ONNX Runtime's CUDA provider has no bfloat16 ReduceMax (1.31.1; the session fails to assign
            # it): the guard's reductions read a float32 copy of the scores, exact for -inf, NaN and sums' NaN
            minus_inf = _minus_inf_name(TensorProto.FLOAT)
            constants.append((minus_inf, np.array(-np.inf, np.float32)))
            widen = [helper.make_node("Cast", [x], [prefix + "/float"], name=prefix + "/Cast", to=TensorProto.FLOAT)]
        _shared_constants(g, initializers, constants)
        reduced = widen[0].output[0] if widen else x
        before[id(where)] = [
            *widen,
            helper.make_node("ReduceMax", [reduced, axes], [prefix + "/max"], name=prefix + "/ReduceMax", keepdims=1),
            helper.make_node("ReduceSum", [reduced, axes], [prefix + "/sum"], name=prefix + "/ReduceSum", keepdims=1),
            helper.make_node("Equal", [prefix + "/max", minus_inf], [prefix + "/max_is_minus_inf"],
                             name=prefix + "/Equal_max"),
            helper.make_node("Equal", [prefix + "/sum", prefix + "/sum"], [prefix + "/no_nan"],
                             name=prefix + "/Equal_sum"),
            helper.make_node("And", [prefix + "/max_is_minus_inf", prefix + "/no_nan"], [prefix + "/masked"],
                             name=prefix + "/And"),
        ]
        where.input[0], where.input[1] = prefix + "/masked", zero
        shape = g.shapes.get(x)
        if shape is not None:  # [..., 1, ...]: one flag per row (activation_recompute reads its size)
            shape = [1 if i == axis % len(shape) else d for i, d in enumerate(shape)]
            model.graph.value_info.append(helper.make_tensor_value_info(prefix + "/masked", TensorProto.BOOL, shape))
        dead |= {id(n) for n in chain}
        replaced_zeros.add(zeros)
    if not before:
        return 0
    _mask_with_minus_inf(g, guarded)
    _keep(model, dead, before=before)
    model.graph.initializer.extend(initializers.values())
    read = {name for node in _all_nodes(model.graph) for name in node.input} | g.outputs
    kept = [init for init in model.graph.initializer if init.name not in replaced_zeros or init.name in read]
    if len(kept) != len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return len(before)



def bfloat16_gradient(model: onnx.ModelProto) -> int:
    """``half_precision_gradient`` for bfloat16 softmaxes (``bfloat16_softmax_gradient``): the same
    formula in bfloat16, the row sum as a ``MatMul`` by a ``[S, 1]`` column of ones (ONNX Runtime's
    CUDA provider has no bfloat16 ``ReduceSum``; its products accumulate in float32), where the
    softmax axis is the last one and its length static. Returns the number rewritten."""
    return half_precision_gradient(model, TensorProto.BFLOAT16)


def half_precision_gradient(model: onnx.ModelProto, elem_type: int = TensorProto.FLOAT16) -> int:
    """Compute each float16 softmax's gradient, decomposed in float32 by torch, in float16.

    Pattern (the decomposition of ``_softmax_backward_data``; either operand order of each
    ``Mul``): ``Cast(Sub(p, Mul(c_y, ReduceSum(p, axes, keepdims=1))), float16)`` with
    ``p = Mul(Cast(dy, float32), c_y)``, ``c_y = Cast(y, float32)``, ``y`` and ``dy`` float16,
    every intermediate read only inside the pattern. Becomes ``Sub(Mul(dy, y), Mul(y,
    ReduceSum(Mul(dy, y), axes, keepdims=1)))`` in float16 under the output's name; a cast that
    something else still reads stays.

    Args:
        model: a joint graph of the ``"torch"`` source, rewritten in place.
        elem_type: the half type whose softmaxes are rewritten (``bfloat16_gradient`` passes bfloat16).

    Returns:
        The number of softmax gradients rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    for narrow in [n for n in model.graph.node if _is(n, "Cast") and _attrs(n).get("to") == elem_type]:
        found = _softmax_gradient(g, types, narrow, elem_type)
        if found is None:
            continue
        dy, y, axes, chain, widened = found
        prefix = f"{narrow.name or narrow.output[0]}/half_softmax_gradient"
        if elem_type == TensorProto.FLOAT16:
            row_sum = helper.make_node("ReduceSum", [prefix + "/product", axes], [prefix + "/sum"],
                                       name=prefix + "/ReduceSum", keepdims=1)
        else:
            ones = _ones_column(g, initializers, y, axes, elem_type)
            if ones is None:
                continue
            row_sum = helper.make_node("MatMul", [prefix + "/product", ones], [prefix + "/sum"],
                                       name=prefix + "/MatMul_sum")
        before[id(narrow)] = [
            helper.make_node("Mul", [dy, y], [prefix + "/product"], name=prefix + "/Mul_product"),
            row_sum,
            helper.make_node("Mul", [y, prefix + "/sum"], [prefix + "/scaled"], name=prefix + "/Mul_sum"),
            helper.make_node("Sub", [prefix + "/product", prefix + "/scaled"], [narrow.output[0]],
                             name=prefix + "/Sub"),
        ]
        dead |= {id(n) for n in chain}
        dead |= {id(cast) for cast in widened if all(id(r) in dead for r in g.consumers.get(cast.output[0], []))
                 and cast.output[0] not in g.outputs}
    if before:
        _keep(model, dead, before=before)
        model.graph.initializer.extend(initializers.values())
    return len(before)


def _ones_column(g: _Graph, initializers: dict[str, onnx.TensorProto], y: str, axes: str,
                 elem_type: int) -> str | None:
    """The name of a ``[S, 1]`` column of ones of ``elem_type`` (queued in ``initializers``, shared by name) that
    sums ``y``'s rows by a product, where ``axes`` is ``y``'s last axis alone and its length ``S`` static."""
    shape, reduced = g.shapes.get(y), g.const(axes)
    if not shape or reduced is None or reduced.size != 1 or int(reduced.flat[0]) % len(shape) != len(shape) - 1:
        return None
    length = shape[-1]
    if not isinstance(length, int) or length <= 0:
        return None
    dtype = "bfloat16" if elem_type == TensorProto.BFLOAT16 else np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    name = f"ort_trainer/softmax_gradient/ones_{length}_{dtype}"
    if name not in g.initializers and name not in initializers:
        initializers[name] = helper.make_tensor(name, elem_type, [length, 1], [1.0] * length)  # bfloat16: from floats
    return name


def _softmax_gradient(g: _Graph, types: dict[str, int], narrow: onnx.NodeProto,
                      elem_type: int = TensorProto.FLOAT16) -> tuple | None:
    """``(dy, y, axes name, the pattern's nodes but its input casts, those casts)`` of the half (``elem_type``)
    softmax gradient cast to that type by ``narrow``, or None."""
    sub = _read_once_producer(g, narrow.input[0], narrow)
    if sub is None or not _is(sub, "Sub"):
        return None
    product_name, scaled_name = sub.input
    scaled = _read_once_producer(g, scaled_name, sub)
    product = g.producer.get(product_name)
    if scaled is None or not _is(scaled, "Mul") or product is None or not _is(product, "Mul"):
        return None
    for c_y, sum_name in ((scaled.input[0], scaled.input[1]), (scaled.input[1], scaled.input[0])):
        reduce = _read_once_producer(g, sum_name, scaled)
        if reduce is not None and _is(reduce, "ReduceSum"):
            break
    else:
        return None
    if (reduce.input[0] != product_name or len(reduce.input) < 2 or _attrs(reduce).get("keepdims", 1) != 1
            or _attrs(reduce).get("noop_with_empty_axes", 0) != 0 or not g.only_used_by(product_name, reduce, sub)
            or c_y not in product.input or list(product.input).count(c_y) != 1):
        return None
    c_dy = _other(product, c_y)
    casts = [g.producer.get(c_dy), g.producer.get(c_y)]
    if any(c is None or not _is(c, "Cast") or _attrs(c).get("to") != TensorProto.FLOAT
           or types.get(c.input[0]) != elem_type for c in casts):
        return None
    return casts[0].input[0], casts[1].input[0], reduce.input[1], [narrow, sub, scaled, reduce, product], casts


def _minus_inf_name(elem_type: int) -> str:
    """The name of the pass's ``-inf`` initializer of that element type."""
    return f"ort_trainer/safe_softmax/minus_inf_{np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name}"


def _mask_with_minus_inf(g: _Graph, guarded: dict[str, int]) -> int:
    """Fill torchlib's boolean attention masks with ``-inf`` instead of the dtype's lowest value.

    torchlib turns ``scaled_dot_product_attention``'s boolean mask into ``Where(mask, 0, lowest)``
    added to the scores, so a fully masked row is finite, and its softmax uniform, where torch
    (``-inf``, then ``_safe_softmax``) gives zeros. A bias whose every reader is an ``Add`` into a
    guarded softmax input gets ``-inf``: fully masked rows become zeros, as in eager PyTorch; other
    rows are bit-equal (``exp`` of either fill underflows to 0). Returns the count of masks.
    """
    filled: set[int] = set()
    for x, elem_type in guarded.items():
        add = g.producer.get(x)
        if add is None or not _is(add, "Add"):
            continue
        for bias in add.input:
            fill = g.producer.get(bias)
            if fill is None or not _is(fill, "Where") or len(fill.input) != 3:
                continue
            lowest = _BFLOAT16_LOWEST if elem_type == TensorProto.BFLOAT16 else \
                np.finfo(helper.tensor_dtype_to_np_dtype(elem_type)).min
            if g.fill_value(fill.input[1]) != 0.0 or g.fill_value(fill.input[2]) != lowest:
                continue
            readers = g.consumers.get(bias, [])
            if bias in g.outputs or not all(_is(r, "Add") and r.output[0] in guarded for r in readers):
                continue
            fill.input[2] = _minus_inf_name(elem_type)  # made by safe_softmax for this element type
            filled.add(id(fill))
    return len(filled)


def _match(g: _Graph, types: dict[str, int], where: onnx.NodeProto) -> tuple | None:
    """``(x, axes name or None, axis, element type, zeros name, guard nodes)`` of the pattern at
    ``where``, or None."""
    if len(where.input) != 3:
        return None
    condition, zeros, probabilities = where.input
    softmax = g.producer.get(probabilities)
    if softmax is None or not _is(softmax, "Softmax"):
        return None
    x = softmax.input[0]
    shape, elem_type = g.shapes.get(x), types.get(x)
    if shape is None or elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE, *_HALF):
        return None
    rank = len(shape)
    axis = _attrs(softmax).get("axis", -1) % max(rank, 1)
    if g.fill_value(zeros) != 0.0 or not _fits(g.shapes.get(zeros), shape):
        return None  # a larger zeros tensor would broadcast the output beyond x's shape
    is_nan = _read_once_producer(g, condition, where)
    if is_nan is not None and _is(is_nan, "IsNaN") and is_nan.input[0] == probabilities:
        return x, None, axis, elem_type, zeros, [is_nan]
    found = _all_equal_minus_inf(g, types, condition, where)
    if found is None:
        return None
    compared, reduce, chain = found
    axes = g.const(reduce.input[1]) if len(reduce.input) > 1 else None
    if compared != x or axes is None or [int(a) % rank for a in axes.reshape(-1)] != [axis]:
        return None
    if _attrs(reduce).get("keepdims", 1) != 1:
        return None
    return x, reduce.input[1], axis, elem_type, zeros, chain


def _fits(shape: list | None, target: list) -> bool:
    """A tensor of ``shape`` broadcasts into ``target`` without enlarging it."""
    if shape is None or len(shape) > len(target):
        return False
    return all(d == 1 or (d is not None and d == t) for d, t in zip(reversed(shape), reversed(target)))


def _all_equal_minus_inf(g: _Graph, types: dict[str, int], name: str, where: onnx.NodeProto) -> tuple | None:
    """``(x, the Reduce node, the nodes of the chain)`` if ``name``, read by ``where`` only, is ``all(x == -inf)`` spelled as
    ``Not(any(Not(eq)))`` or ``ReduceMin`` of the int64 cast, each intermediate read once; else None."""
    chain: list[onnx.NodeProto] = []
    node = _producer_skipping_bool_casts(g, name, chain, reader=where)
    negated = node is not None and _is(node, "Not")
    if negated:
        chain.append(node)
        node = _producer_skipping_bool_casts(g, node.input[0], chain, reader=node)
    if node is None or not _is(node, "Cast") or _attrs(node).get("to") != TensorProto.BOOL:
        return None
    chain.append(node)
    reduce = _read_once_producer(g, node.input[0], node)
    if reduce is None or not _is(reduce, "ReduceMax" if negated else "ReduceMin"):
        return None
    chain.append(reduce)
    widen = _read_once_producer(g, reduce.input[0], reduce)
    if widen is None or not _is(widen, "Cast") or _attrs(widen).get("to") not in (TensorProto.INT64, TensorProto.INT32):
        return None
    chain.append(widen)
    node = _producer_skipping_bool_casts(g, widen.input[0], chain, reader=widen)
    if negated:
        if node is None or not _is(node, "Not"):
            return None
        chain.append(node)
        node = _producer_skipping_bool_casts(g, node.input[0], chain, reader=node)
    if node is None or not _is(node, "Equal"):
        return None
    chain.append(node)
    for compared, constant in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        value = g.const(constant)
        if value is not None and value.size == 1 and np.isneginf(value.reshape(-1)[0]):
            return _unwidened(g, types, compared, node, chain), reduce, chain
    return None


def _unwidened(g: _Graph, types: dict[str, int], name: str, reader: onnx.NodeProto, chain: list) -> str:
    """``name``, or the half-precision value it is a float32 cast of when ``reader`` alone reads that
    cast (added to ``chain``): a half-precision attention's guard compares ``Cast(x, float32)`` with
    ``-inf`` (torch computes the comparison in float32), which is exact, so the same as ``x``'s."""
    cast = _read_once_producer(g, name, reader)
    if cast is None or not _is(cast, "Cast") or _attrs(cast).get("to") != TensorProto.FLOAT \
            or types.get(cast.input[0]) not in _HALF:
        return name
    chain.append(cast)
    return cast.input[0]


def _read_once_producer(g: _Graph, name: str, reader: onnx.NodeProto) -> onnx.NodeProto | None:
    """The producer of ``name`` if ``reader`` is its only reader (so the producer can go)."""
    if _sole_consumer(g, name) is not reader:
        return None
    return g.producer.get(name)


def _producer_skipping_bool_casts(g: _Graph, name: str, chain: list, reader: onnx.NodeProto | None = None):
    """The producer of ``name``, looking through ``Cast(to=bool)`` of bool values (adding them to
    ``chain``); None if an intermediate has other readers."""
    node = g.producer.get(name) if reader is None else _read_once_producer(g, name, reader)
    while (node is not None and _is(node, "Cast") and _attrs(node).get("to") == TensorProto.BOOL
           and _bool_valued(g, node.input[0])):
        chain.append(node)
        node = _read_once_producer(g, node.input[0], node)
    return node


def _bool_valued(g: _Graph, name: str) -> bool:
    producer = g.producer.get(name)
    return producer is not None and producer.op_type in ("Not", "Equal", "And", "Or", "Cast") and (
        producer.op_type != "Cast" or _attrs(producer).get("to") == TensorProto.BOOL)


__all__ = ["bfloat16_gradient", "half_precision_gradient", "safe_softmax"]

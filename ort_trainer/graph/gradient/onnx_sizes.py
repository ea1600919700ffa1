"""Values known while ``torch.export`` traces an ONNX graph, and the shape arithmetic on them.

Exporters write ``x.view(batch, seq, heads, -1)`` as ``Shape -> Gather -> Unsqueeze -> Concat ->
Reshape``. Run on int64 tensors, as onnx2fx runs it, those sizes are values ``torch.export`` cannot
read (a data-dependent error), even when they are static. Here they stay numpy arrays of Python
ints or ``torch.SymInt`` (``StaticValue``): ``STATIC_OPS`` compute on them, ``SIZE_OPS`` read sizes
off tensors and shape tensors with them. A node they do not cover raises ``NotStatic`` and runs on
tensors instead.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np
import onnx
import torch
from onnx import numpy_helper

STATIC_LIMIT = 4096  # static values (constants, sizes, what is computed from them) up to this many elements
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.float16): torch.float16, np.dtype(np.int64): torch.int64,
                np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16, np.dtype(np.int8): torch.int8,
                np.dtype(np.uint8): torch.uint8, np.dtype(np.bool_): torch.bool}
SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class StaticValue:
    """A value known while tracing: a small constant, or sizes and what is computed from them.

    ``array`` is a numpy array, numeric, or of dtype object holding Python numbers and
    ``torch.SymInt`` (sizes ``torch.export`` keeps symbolic); ``dtype`` is the ONNX value's numpy
    dtype; ``attr`` the name of the module constant holding the same value as a tensor, if any.
    """

    __slots__ = ("array", "dtype", "attr")

    def __init__(self, array: Any, dtype: Any, attr: str | None = None):
        self.dtype = np.dtype(dtype)
        array = np.asarray(array, dtype=object if _has_symbols(array) else self.dtype)
        self.array = array
        self.attr = attr

    @property
    def symbolic(self) -> bool:
        return self.array.dtype == object

    def numbers(self) -> np.ndarray:
        """The values as a numeric array; raises ``NotStatic`` when some are symbolic."""
        if self.symbolic:
            raise NotStatic
        return self.array


class NotStatic(Exception):
    """The shape arithmetic does not cover this node; the node runs on tensors instead."""


def _has_symbols(array: Any) -> bool:
    if isinstance(array, np.ndarray) and array.dtype != object:
        return False
    return any(isinstance(v, SYMBOLIC) for v in np.asarray(array, dtype=object).flat)


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The node's attribute ``name`` as a Python value (strings decoded), or ``default``."""
    for proto in node.attribute:
        if proto.name == name:
            value = onnx.helper.get_attribute_value(proto)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _python(value: Any) -> Any:
    """numpy scalars to Python numbers; SymInts and Python numbers as they are."""
    return value.item() if isinstance(value, np.generic) else value


def flat_sizes(static: StaticValue) -> list:
    """The values as a flat list of Python numbers and SymInts."""
    return [_python(v) for v in static.array.reshape(-1)]


ToTensor = Callable[[StaticValue], torch.Tensor]


def _static(array: Any, dtype: Any) -> StaticValue:
    array = np.asarray(array, dtype=object if _has_symbols(array) else dtype)
    if array.size > STATIC_LIMIT:
        raise NotStatic
    return StaticValue(array, dtype)


def _axes(node: onnx.NodeProto, inputs: list, index: int, rank: int | None = None) -> list[int] | None:
    """An ``axes`` attribute or (newer opsets) input, normalised against ``rank`` when given."""
    axes = attribute(node, "axes")
    if axes is None and len(inputs) > index and inputs[index] is not None:
        axes = [int(a) for a in inputs[index].numbers().reshape(-1)]
    if axes is None:
        return None
    return [a % rank if rank is not None else a for a in axes]


def _elementwise(function: Callable, dtype: Any = None) -> Callable:
    """A static op applying ``function`` element by element (numpy broadcasting), on numbers and
    SymInts alike; the result has the first input's dtype unless ``dtype`` is given."""
    def run(node: onnx.NodeProto, inputs: list) -> StaticValue:
        try:
            result = np.frompyfunc(function, len(inputs), 1)(*(v.array for v in inputs))
        except ZeroDivisionError:
            raise NotStatic from None
        return _static(result, dtype or inputs[0].dtype)
    return run


def _extreme(pick: Callable, symbolic: Callable) -> Callable:
    """Variadic Min/Max; ``torch.sym_min``/``sym_max`` on sizes, which adds no guard."""
    def run(*values: Any) -> Any:
        return functools.reduce(lambda a, b: symbolic(a, b) if isinstance(a, SYMBOLIC) or isinstance(b, SYMBOLIC)
                                else pick(a, b), values)
    return run


def _modulo(node: onnx.NodeProto, inputs: list) -> StaticValue:
    fmod = attribute(node, "fmod", 0)
    return _elementwise(math.fmod if fmod else (lambda a, b: a % b))(node, inputs)


def _divide(a: Any, b: Any) -> Any:
    if isinstance(a, (float, np.floating, torch.SymFloat)) or isinstance(b, (float, np.floating, torch.SymFloat)):
        return a / b
    return a // b if (a >= 0) == (b > 0) else -((-a) // b)  # ONNX integer division truncates


def _cast(node: onnx.NodeProto, inputs: list) -> StaticValue:
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(attribute(node, "to")))
    if dtype not in TORCH_DTYPES:
        raise NotStatic
    source = inputs[0]
    if not source.symbolic:
        return _static(source.array.astype(dtype), dtype)
    if dtype.kind == "f":
        convert = torch.sym_float
    elif dtype.kind == "b":
        convert = bool
    else:
        convert = torch.sym_int
    return _static(np.frompyfunc(convert, 1, 1)(source.array), dtype)


def _gather(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data, indices = inputs
    return _static(np.take(data.array, indices.numbers().astype(np.int64), axis=attribute(node, "axis", 0)),
                   data.dtype)


def _unsqueeze(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data = inputs[0]
    axes = _axes(node, inputs, 1)
    rank = data.array.ndim + len(axes)
    return _static(np.expand_dims(data.array, tuple(sorted(a % rank for a in axes))), data.dtype)


def _squeeze(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data = inputs[0]
    axes = _axes(node, inputs, 1, data.array.ndim)
    return _static(np.squeeze(data.array, axis=None if axes is None else tuple(axes)), data.dtype)


def _concat(node: onnx.NodeProto, inputs: list) -> StaticValue:
    present = [v for v in inputs if v is not None]
    arrays = [v.array.astype(object) if any(p.symbolic for p in present) else v.array for v in present]
    return _static(np.concatenate(arrays, axis=attribute(node, "axis")), present[0].dtype)


def _slices(node: onnx.NodeProto, inputs: list, rank: int, negative_steps: bool = False) -> tuple:
    """Python slices per axis for Slice (starts, ends, axes, steps from inputs since opset 10)."""
    if len(inputs) > 1:
        starts, ends = flat_sizes(inputs[1]), flat_sizes(inputs[2])
        axes = _axes(node, inputs, 3, rank) if len(inputs) > 3 and inputs[3] is not None else None
        steps = [int(s) for s in inputs[4].numbers()] if len(inputs) > 4 and inputs[4] is not None else None
    else:
        starts, ends, axes, steps = (attribute(node, "starts"), attribute(node, "ends"),
                                     attribute(node, "axes"), None)
    axes = [a % rank for a in axes] if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    if any(s < 0 for s in steps) and not negative_steps:
        raise NotStatic  # torch slicing has no negative steps: onnx2fx's handler flips instead
    index = [slice(None)] * rank
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[axis] = slice(start, end, step)
    return tuple(index)


def _slice(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data = inputs[0]
    if any(v is not None and v.symbolic for v in inputs[1:]):
        raise NotStatic
    return _static(data.array[_slices(node, inputs, data.array.ndim, negative_steps=True)], data.dtype)


def _transpose(node: onnx.NodeProto, inputs: list) -> StaticValue:
    return _static(np.transpose(inputs[0].array, attribute(node, "perm")), inputs[0].dtype)


def _reshape_sizes(shape: StaticValue, current: Any, allowzero: int) -> list:
    sizes = flat_sizes(shape)
    if not allowzero:
        sizes = [current[i] if isinstance(s, int) and s == 0 else s for i, s in enumerate(sizes)]
    return sizes


def _static_reshape(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data, shape = inputs
    sizes = _reshape_sizes(shape, data.array.shape, attribute(node, "allowzero", 0))
    if any(isinstance(s, SYMBOLIC) for s in sizes):
        raise NotStatic
    return _static(data.array.reshape([int(s) for s in sizes]), data.dtype)


def _reduce(function: Callable) -> Callable:
    def run(node: onnx.NodeProto, inputs: list) -> StaticValue:
        data = inputs[0]
        axes = _axes(node, inputs, 1, data.array.ndim)
        if not axes and attribute(node, "noop_with_empty_axes", 0):
            return data
        keep = bool(attribute(node, "keepdims", 1))
        return _static(function(data.array, axis=None if not axes else tuple(axes), keepdims=keep), data.dtype)
    return run


def _where(node: onnx.NodeProto, inputs: list) -> StaticValue:
    condition, a, b = inputs
    return _static(np.where(condition.numbers().astype(bool), a.array, b.array), a.dtype)


def _range(node: onnx.NodeProto, inputs: list) -> StaticValue:
    start, limit, delta = (v.numbers().item() for v in inputs)
    return _static(np.arange(start, limit, delta, dtype=inputs[0].dtype), inputs[0].dtype)


def _fill_value(node: onnx.NodeProto) -> np.ndarray:
    value = attribute(node, "value")
    return numpy_helper.to_array(value).reshape(-1) if value is not None else np.zeros(1, np.float32)


def _constant_of_shape(node: onnx.NodeProto, inputs: list) -> StaticValue:
    value = _fill_value(node)
    sizes = [int(s) for s in inputs[0].numbers()]
    if math.prod(sizes) > STATIC_LIMIT:
        raise NotStatic
    return _static(np.full(sizes, value[0], value.dtype), value.dtype)


def _expand(node: onnx.NodeProto, inputs: list) -> StaticValue:
    data, shape = inputs
    target = np.broadcast_shapes(data.array.shape, tuple(int(s) for s in shape.numbers()))
    return _static(np.broadcast_to(data.array, target), data.dtype)


def _identity(node: onnx.NodeProto, inputs: list) -> StaticValue:
    return inputs[0]


STATIC_OPS: dict[str, Callable[[onnx.NodeProto, list], StaticValue]] = {
    "Identity": _identity,
    "Cast": _cast,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": _concat,
    "Slice": _slice,
    "Reshape": _static_reshape,
    "Transpose": _transpose,
    "Add": _elementwise(lambda a, b: a + b),
    "Sub": _elementwise(lambda a, b: a - b),
    "Mul": _elementwise(lambda a, b: a * b),
    "Div": _elementwise(_divide),
    "Neg": _elementwise(lambda a: -a),
    "Abs": _elementwise(abs),
    "Mod": _modulo,
    "Min": _elementwise(_extreme(min, torch.sym_min)),
    "Max": _elementwise(_extreme(max, torch.sym_max)),
    "Equal": _elementwise(lambda a, b: bool(a == b), np.bool_),
    "Less": _elementwise(lambda a, b: bool(a < b), np.bool_),
    "Greater": _elementwise(lambda a, b: bool(a > b), np.bool_),
    "LessOrEqual": _elementwise(lambda a, b: bool(a <= b), np.bool_),
    "GreaterOrEqual": _elementwise(lambda a, b: bool(a >= b), np.bool_),
    "Not": _elementwise(lambda a: not a, np.bool_),
    "And": _elementwise(lambda a, b: bool(a and b), np.bool_),
    "Or": _elementwise(lambda a, b: bool(a or b), np.bool_),
    "Where": _where,
    "ReduceProd": _reduce(np.prod),
    "ReduceSum": _reduce(np.sum),
    "Range": _range,
    "ConstantOfShape": _constant_of_shape,
    "Expand": _expand,
}


# ---- nodes reading sizes, or shaping tensors with static sizes ------------------------------------
def _shape(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> StaticValue:
    data = inputs[0]
    sizes = list(data.array.shape) if isinstance(data, StaticValue) else list(data.shape)
    start, end = attribute(node, "start", 0), attribute(node, "end")
    return StaticValue(np.asarray(sizes[start:end], dtype=object), np.int64)


def _size(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> StaticValue:
    data = inputs[0]
    return StaticValue(np.asarray(data.array.size if isinstance(data, StaticValue) else data.numel(), dtype=object),
                   np.int64)


def _tensor_and_static(inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    """The data input as a tensor when the other inputs are all static, else ``NotStatic``."""
    if any(v is not None and not isinstance(v, StaticValue) for v in inputs[1:]):
        raise NotStatic
    data = inputs[0]
    return to_tensor(data) if isinstance(data, StaticValue) else data


def _tensor_reshape(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    data = _tensor_and_static(inputs, to_tensor)
    return data.reshape(_reshape_sizes(inputs[1], data.shape, attribute(node, "allowzero", 0)))


def _tensor_expand(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    data = _tensor_and_static(inputs, to_tensor)
    sizes = flat_sizes(inputs[1])
    rank = max(len(sizes), data.dim())
    sizes = [1] * (rank - len(sizes)) + sizes
    current = [1] * (rank - data.dim()) + list(data.shape)
    target = [c if isinstance(s, int) and s == 1 else s for s, c in zip(sizes, current)]
    return data.reshape(current).expand(target)


def _tensor_slice(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    data = _tensor_and_static(inputs, to_tensor)
    return data[_slices(node, inputs, data.dim())]


def _tensor_unsqueeze(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    data = _tensor_and_static(inputs, to_tensor)
    axes = _axes(node, inputs, 1)
    rank = data.dim() + len(axes)
    for axis in sorted(a % rank for a in axes):
        data = data.unsqueeze(axis)
    return data


def _tensor_squeeze(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    data = _tensor_and_static(inputs, to_tensor)
    axes = _axes(node, inputs, 1, data.dim())
    return data.squeeze() if axes is None else data.squeeze(tuple(axes))


def _tensor_constant_of_shape(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    if not isinstance(inputs[0], StaticValue):
        raise NotStatic
    value = _fill_value(node)
    return torch.full(flat_sizes(inputs[0]), value[0].item(), dtype=TORCH_DTYPES[value.dtype])


def _tensor_range(node: onnx.NodeProto, inputs: list, to_tensor: ToTensor) -> torch.Tensor:
    if not all(isinstance(v, StaticValue) for v in inputs):
        raise NotStatic
    start, limit, delta = (_python(v.array.reshape(-1)[0]) for v in inputs)
    return torch.arange(start, limit, delta, dtype=TORCH_DTYPES[inputs[0].dtype])


SIZE_OPS: dict[str, Callable[[onnx.NodeProto, list, ToTensor], Any]] = {
    "Shape": _shape,
    "Size": _size,
    "Reshape": _tensor_reshape,
    "Expand": _tensor_expand,
    "Slice": _tensor_slice,
    "Unsqueeze": _tensor_unsqueeze,
    "Squeeze": _tensor_squeeze,
    "ConstantOfShape": _tensor_constant_of_shape,
    "Range": _tensor_range,
}

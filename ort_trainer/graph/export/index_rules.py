"""Index rules: the values an index operand of the graph takes, computed from a batch on the host.

ONNX operators accept indices PyTorch refuses: ``Gather`` and ``GatherElements`` count a
negative index from the end, so label −5 trains as class C−5. A graph does not always index with
an input as it comes: a causal LM pads its labels with the ignore index and shifts them, a model
masks labels with ``where``, positions are an ``arange`` of the sequence length. So a rule does
not name an input: it carries the little computation from the batch to the index operand, read
off the graph (``program_checks`` for a ``torch.export`` program, ``input_checks`` for an ONNX
graph), as JSON-able ``steps`` that NumPy evaluates in microseconds. Checking a batch evaluates
them and compares the result with the operand's valid range, exactly as the op would see it.

A step is ``{"op": name, ...}``; its operands are literals, or ``{"ref": k}`` for the value of
step ``k``. Ops: ``input`` (``name``), ``const`` (``value``, ``dtype``), ``shape`` (``x``),
``size`` (``x``, ``dim``), ``vector`` (``items``: scalars), ``arange`` (``start``, ``end``,
``step``), ``pad`` (``x``, ``pads``: a ``[before, after]`` pair per dimension, or ONNX's flat
list with ``layout: "onnx"``; negative crops; ``value``), ``slice`` (``x``, ``axes``, ``starts``,
``ends``, ``steps``: Python slicing per axis), ``take`` (``x``, ``indices``, ``axis``),
``reshape`` (``x``, ``shape``: -1 inferred; ``zeros_copy``: ONNX's 0), ``flatten`` (``x``,
``axis``: two dimensions, ONNX's), ``transpose`` (``x``, ``perm``), ``expand`` (``x``,
``shape``: broadcast both ways), ``squeeze`` / ``unsqueeze`` (``x``, ``axes``), ``cast`` (``x``,
``dtype``), ``where`` (``cond``, ``x``, ``y``), ``binary`` (``fn``, ``a``, ``b``), ``unary``
(``fn``, ``x``), ``concat`` (``xs``, ``axis``), ``full`` (``shape``, ``value``, ``dtype``).

A rule is ``{"what", "steps", "index", "low", "high", "ignore"}`` (and ``shapes`` when it holds
for a static trace's shapes only): valid values of step ``index`` are ``low <= v < high`` or
``v == ignore``; ``low`` is 0 or ``"-high"`` (an index that may count from the end), ``high`` an
int, an operand (a ``size`` step: a symbolic dimension) or None (unbounded above). When a value
is out of range, the steps run again on the positions of the inputs' elements instead of their
values (``provenance``), so the report names the input and the element the bad value came from.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

_BINARY: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "floor_divide": np.floor_divide,
    "remainder": np.remainder, "maximum": np.maximum, "minimum": np.minimum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor,
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
}
_UNARY: dict[str, Callable] = {"neg": np.negative, "abs": np.abs, "not": np.logical_not, "bitwise_not": np.invert}
# results that hold no element of an input (a mask, a comparison): no position to report
_PREDICATES = {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "not"}
NO_SOURCE = -1  # the provenance of an element the graph made itself (a pad value, an arange)
INLINE_CONSTANT_ELEMENTS = 1 << 16  # integer constants up to this size (BERT's position ids) go into a rule


class Untranslatable(Exception):
    """A graph computes an index with something ``steps`` cannot express: that index goes unchecked."""


def operand_refs(step: dict) -> list[int]:
    """The steps a step reads."""
    refs = []

    def visit(value: Any) -> None:
        if isinstance(value, dict) and "ref" in value:
            refs.append(value["ref"])
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for key, value in step.items():
        if key != "op":
            visit(value)
    return refs


class _Run:
    """One evaluation of a rule's steps: on values, or on element positions (``provenance``)."""

    def __init__(self, steps: list[dict], feeds: dict[str, np.ndarray], provenance: bool):
        self.steps, self.feeds = steps, feeds
        self.values: list[Any] = []
        self.positions: list[np.ndarray | None] | None = [] if provenance else None
        self.offsets: dict[str, int] = {}
        if provenance:  # each input's elements numbered apart: input i's start at the sum of the sizes before it
            total = 0
            for step in steps:
                if step["op"] == "input" and step["name"] not in self.offsets:
                    self.offsets[step["name"]] = total
                    total += feeds[step["name"]].size

    def value(self, operand: Any) -> Any:
        if isinstance(operand, dict) and "ref" in operand:
            return self.values[operand["ref"]]
        if isinstance(operand, list):
            return [self.value(item) for item in operand]
        return operand

    def where_from(self, operand: Any) -> np.ndarray | None:
        if isinstance(operand, dict) and "ref" in operand:
            return self.positions[operand["ref"]]
        return None

    def run(self) -> Any:
        for step in self.steps:
            value, position = self.evaluate(step)
            self.values.append(value)
            if self.positions is not None:
                self.positions.append(position)
        return self.values[-1]

    def evaluate(self, step: dict) -> tuple[Any, np.ndarray | None]:
        op, v = step["op"], self.value
        track = self.positions is not None

        def same(function: Callable[[np.ndarray], np.ndarray]) -> tuple[Any, Any]:
            """``function`` applied to the values of ``x`` and, when tracked, to their positions."""
            result = function(np.asarray(v(step["x"])))
            if not track:
                return result, None
            where = self.where_from(step["x"])
            return result, (function(where) if where is not None else None)

        if op == "input":
            array = self.feeds[step["name"]]
            if not track:
                return array, None
            return array, np.arange(array.size, dtype=np.int64).reshape(array.shape) + self.offsets[step["name"]]
        if op == "const":
            return np.asarray(step["value"], dtype=step.get("dtype")), None
        if op == "shape":
            return np.asarray(np.shape(v(step["x"])), dtype=np.int64), None
        if op == "size":
            return np.int64(np.shape(v(step["x"]))[step["dim"]]), None
        if op == "vector":
            return np.asarray([int(item) for item in v(step["items"])], dtype=np.int64), None
        if op == "arange":
            return np.arange(int(v(step["start"])), int(v(step["end"])), int(v(step.get("step", 1))),
                             dtype=np.int64), None
        if op == "full":
            return np.full(_ints(v(step["shape"])), v(step["value"]), dtype=step.get("dtype")), None
        if op == "pad":
            pads = v(step["pads"])
            if step.get("layout") == "onnx":  # [begin of each dimension..., end of each dimension...]
                flat = _ints(pads)
                pads = list(zip(flat[: len(flat) // 2], flat[len(flat) // 2:]))
            pads = [(int(a), int(b)) for a, b in pads]
            value, where = same(lambda a: _pad(a, pads, v(step["value"])))
            if where is not None:  # the pad's own elements come from no input
                where = _pad(self.where_from(step["x"]), pads, NO_SOURCE)
            return value, where
        if op == "slice":
            index = _slices(v(step["axes"]), v(step["starts"]), v(step["ends"]), v(step.get("steps")))
            return same(lambda a: a[_index_for(a, index)])
        if op == "take":
            indices, axis = np.asarray(v(step["indices"])).astype(np.int64, copy=False), int(step["axis"])
            return same(lambda a: np.take(a, indices, axis=axis))
        if op == "reshape":
            shape = _ints(v(step["shape"]))
            if step.get("zeros_copy"):  # ONNX Reshape: a 0 keeps the input's size of that dimension
                source = np.shape(v(step["x"]))
                shape = [source[i] if size == 0 else size for i, size in enumerate(shape)]
            return same(lambda a: a.reshape(shape))
        if op == "flatten":
            axis = int(step["axis"])
            return same(lambda a: a.reshape(int(np.prod(a.shape[:axis])), -1))
        if op == "transpose":
            return same(lambda a: np.transpose(a, step.get("perm")))
        if op == "expand":
            shape = _ints(v(step["shape"]))
            return same(lambda a: np.broadcast_to(a, np.broadcast_shapes(a.shape, tuple(shape))))
        if op == "squeeze":
            axes = step.get("axes")
            return same(lambda a: np.squeeze(a, axis=tuple(d for d in axes if a.shape[d] == 1)
                                             if axes is not None else None))
        if op == "unsqueeze":
            return same(lambda a: np.expand_dims(a, tuple(step["axes"])))
        if op == "cast":
            value, where = same(lambda a: a)
            return value.astype(step["dtype"]), where
        if op == "where":
            condition = np.asarray(v(step["cond"]), dtype=bool)
            value = np.where(condition, v(step["x"]), v(step["y"]))
            if not track:
                return value, None
            x, y = (self._positions_like(step[k], value.shape) for k in ("x", "y"))
            return value, np.where(condition, x, y)
        if op == "binary":
            a, b = v(step["a"]), v(step["b"])
            value = _BINARY[step["fn"]](a, b)
            if not track or step["fn"] in _PREDICATES:
                return value, None
            source = step["a"] if self.where_from(step["a"]) is not None else step["b"]
            where = self.where_from(source)
            return value, (None if where is None else np.broadcast_to(where, np.shape(value)))
        if op == "unary":
            value = _UNARY[step["fn"]](np.asarray(v(step["x"])))
            return value, (None if not track or step["fn"] in _PREDICATES else self.where_from(step["x"]))
        if op == "concat":
            parts, axis = [np.asarray(v(x)) for x in step["xs"]], int(step["axis"])
            value = np.concatenate(parts, axis=axis)
            if not track:
                return value, None
            return value, np.concatenate([self._positions_like(x, part.shape) for x, part in zip(step["xs"], parts)],
                                         axis=axis)
        raise Untranslatable(f"unknown index-rule op {op!r}")

    def _positions_like(self, operand: Any, shape: tuple) -> np.ndarray:
        where = self.where_from(operand)
        if where is None:
            return np.full(shape, NO_SOURCE, dtype=np.int64)
        return np.broadcast_to(where, shape)


def _ints(values: Any) -> list[int]:
    return [int(x) for x in np.asarray(values).reshape(-1)]


def _pad(array: np.ndarray, pads: list[tuple[int, int]], value: Any) -> np.ndarray:
    """Constant padding where a negative amount crops, as ``torch.constant_pad_nd`` and ONNX ``Pad``."""
    crop = tuple(slice(max(-a, 0), array.shape[d] - max(-b, 0)) for d, (a, b) in enumerate(pads))
    array = array[crop]
    grow = [(max(a, 0), max(b, 0)) for a, b in pads]
    result = np.full([n + a + b for n, (a, b) in zip(array.shape, grow)], value, dtype=array.dtype)
    result[tuple(slice(a, a + n) for n, (a, _) in zip(array.shape, grow))] = array  # np.pad is 10x slower
    return result


def _slices(axes: Any, starts: Any, ends: Any, steps: Any) -> list[tuple[int, slice]]:
    axes, starts, ends = _ints(axes), _ints(starts), _ints(ends)
    steps = _ints(steps) if steps is not None else [1] * len(axes)
    return [(axis, slice(start, end, step)) for axis, start, end, step in zip(axes, starts, ends, steps)]


def _index_for(array: np.ndarray, slices: list[tuple[int, slice]]) -> tuple:
    index = [slice(None)] * array.ndim
    for axis, window in slices:
        index[axis] = window
    return tuple(index)


def evaluate(steps: list[dict], feeds: dict[str, np.ndarray], at: int = -1) -> np.ndarray:
    """The value of step ``at`` (the last by default) for this batch."""
    run = _Run(steps[: at + 1] if at >= 0 else steps, feeds, provenance=False)
    run.run()
    return np.asarray(run.values[-1])


def compact(rule: dict) -> dict:
    """``rule`` with every step that reads no input folded into a constant, and the steps that
    neither the index nor ``high`` reads dropped (an exported graph computes shapes in long
    chains of constants: the TorchScript exporter's padding amounts take ten steps)."""
    steps, index, high = rule["steps"], rule["index"], rule.get("high")
    variable: set[int] = set()
    for i, step in enumerate(steps):
        if step["op"] == "input" or any(ref in variable for ref in operand_refs(step)):
            variable.add(i)
    run = _Run(steps, {}, provenance=False)  # evaluates the constant steps one by one, in order
    folded = []
    for i, step in enumerate(steps):
        if i in variable:
            folded.append(step)
            run.values.append(None)
            continue
        value, _ = run.evaluate(step)
        run.values.append(value)
        array = np.asarray(value)
        folded.append({"op": "const", "value": array.tolist(), "dtype": str(array.dtype)})
    needed, stack = set(), [index] + ([high["ref"]] if isinstance(high, dict) else [])
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            stack.extend(operand_refs(folded[i]) if i in variable else [])
    order = sorted(needed)
    renumber = {old: new for new, old in enumerate(order)}

    def moved(value: Any) -> Any:
        if isinstance(value, dict) and "ref" in value:
            return {"ref": renumber[value["ref"]]}
        if isinstance(value, list):
            return [moved(item) for item in value]
        return value

    result = dict(rule, steps=[{k: moved(v) for k, v in folded[i].items()} for i in order], index=renumber[index])
    if isinstance(high, dict):
        result["high"] = {"ref": renumber[high["ref"]]}
    return result


# the operands whose values make the size of a step's result (the others' shapes do)
_SIZE_OPERANDS = {"shape", "starts", "ends", "steps", "axes", "pads", "start", "end", "step", "items"}


def reads_values(rule: dict) -> bool:
    """Whether a rule reads an input's values, not only its shape (else one check per shape serves):
    the index needs its steps' values; a ``shape`` or ``size`` step needs only its operand's shape,
    and a shape needs the values of the operands that size it (a reshape's target) and the shapes
    of the others."""
    steps = rule["steps"]
    values, shapes, stack = set(), set(), [(rule["index"], True)]
    while stack:
        i, value = stack.pop()
        if i in values or (not value and i in shapes):
            continue
        (values if value else shapes).add(i)
        step = steps[i]
        for key, operand in step.items():
            for ref in operand_refs({key: operand}) if key != "op" else []:
                if step["op"] in ("shape", "size"):
                    stack.append((ref, False))
                else:
                    stack.append((ref, value or key in _SIZE_OPERANDS))
    return any(steps[i]["op"] == "input" for i in values)


def out_of_range(values: np.ndarray, low: int, high: int | None) -> np.ndarray:
    """Where integer ``values`` are below ``low`` (0 or −high), or ``high`` or more: one comparison for
    the common rule ``0 <= v < high``, as a negative value read unsigned is above any index (every
    step checks its labels; each NumPy call costs microseconds on a batch of labels)."""
    if low != 0:
        return (values < low) | (values >= high) if high is not None else values < low
    if high is None:
        return values < 0
    if values.dtype.kind == "i":
        values = values.view(values.dtype.str.replace("i", "u"))  # "<i8" -> "<u8"
    return values >= high


def violations(rule: dict, feeds: dict[str, np.ndarray]) -> str | None:
    """What is wrong with this batch under ``rule`` (None when nothing is).

    Raises:
        Exception: whatever NumPy raises for a batch the steps cannot serve (the caller logs it).
    """
    high, steps = rule.get("high"), rule["steps"]
    if len(steps) == 1 and not isinstance(high, dict):  # the common rule: an input as it comes
        values = feeds[steps[0]["name"]]
    else:
        run = _Run(steps[: max(rule["index"], high["ref"] if isinstance(high, dict) else 0) + 1], feeds,
                   provenance=False)
        run.run()
        values = np.asarray(run.values[rule["index"]])
        if isinstance(high, dict):  # a symbolic dimension: this batch's size
            high = int(run.values[high["ref"]])
    if values.size == 0 or values.dtype.kind not in "iub":
        return None
    low = -high if rule.get("low") == "-high" and high is not None else 0
    bad = out_of_range(values, low, high)
    if not np.count_nonzero(bad):  # the common case: one comparison, one count
        return None
    ignore = rule.get("ignore")
    if ignore is not None:
        bad &= values != ignore
        if not np.count_nonzero(bad):
            return None
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    value = int(values[first])
    valid = f"{low}..{high - 1}" if high is not None else "non-negative"
    if ignore is not None:
        valid += f", or {ignore} (ignore_index)"
    count = int(np.count_nonzero(bad))
    source = _source(rule, feeds, first)
    if source is not None:
        name, position = source
        return (f"input {name!r}: value {value} at index {position} is out of range for the {rule['what']}: valid "
                f"values are {valid} ({count} invalid value(s) in this batch); PyTorch raises for these too: fix or "
                "filter the batch")
    if reads_values(rule):
        return (f"the model computes index {value} from this batch's values for the {rule['what']} (valid values "
                f"are {valid}); PyTorch raises for it too: check what the model does with the inputs")
    shapes = ", ".join(f"{name} {list(np.shape(feeds[name]))}" for name in _inputs_read(rule["steps"]))
    return (f"inputs of these shapes ({shapes}) make the model compute index {value} for the {rule['what']}, whose "
            f"valid values are {valid}; PyTorch raises for them too: use inputs no larger than the model takes "
            "(a sequence no longer than its position table)")


def _inputs_read(steps: list[dict]) -> list[str]:
    return list(dict.fromkeys(step["name"] for step in steps if step["op"] == "input"))


def _source(rule: dict, feeds: dict[str, np.ndarray], first: tuple) -> tuple[str, list[int]] | None:
    """The input and the element the value at ``first`` came from, or None (the model made it)."""
    run = _Run(rule["steps"][: rule["index"] + 1], feeds, provenance=True)
    run.run()
    where = run.positions[-1]
    source = int(where[first]) if where is not None else NO_SOURCE
    for name, start in sorted(run.offsets.items(), key=lambda item: -item[1]):
        if source >= start:
            return name, [int(i) for i in np.unravel_index(source - start, feeds[name].shape)]
    return None


__all__ = ["INLINE_CONSTANT_ELEMENTS", "NO_SOURCE", "Untranslatable", "compact", "evaluate", "operand_refs",
           "out_of_range", "reads_values", "violations"]

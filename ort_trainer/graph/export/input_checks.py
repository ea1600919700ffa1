"""Input checks PyTorch would make, read off the graph once and applied to every batch.

ONNX operators accept inputs that PyTorch rejects: ``Gather`` takes a negative index as counting
from the end, so label −3 trains as class C−3 and token id −1 as the last embedding row; a
training-mode ``BatchNormalization`` over one value per channel divides by zero and leaves the
running variance NaN for good. PyTorch raises for both. The rules come from the graph: for every
operator that indexes with an integer tensor, the computation from the batch to that index
(``index_rules``); for every training-mode BatchNorm, its input shape in terms of the
description's symbols. ``BatchChecks`` then tests a batch against them in microseconds and
returns every violation, before any state changes.

``find_input_constraints`` reads them off an ONNX forward graph (the ``onnxruntime`` gradient
source's export, or an ONNX model with its loss); ``program_checks.find_program_constraints``
off the ``torch`` source's ``torch.export`` program, in the same format.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..._logging import logger
from ..onnx_graph import module_of
from . import index_rules
from .index_rules import Untranslatable

_LOSSES = {"SoftmaxCrossEntropyLoss": "cross-entropy", "NegativeLogLikelihoodLoss": "negative log-likelihood loss"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Equal": "eq", "Less": "lt", "LessOrEqual": "le",
           "Greater": "gt", "GreaterOrEqual": "ge", "And": "and", "Or": "or", "Xor": "xor", "Max": "maximum",
           "Min": "minimum", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor"}
_UNARY = {"Neg": "neg", "Abs": "abs", "Not": "not", "BitwiseNot": "bitwise_not"}


def _dims(value_info: onnx.ValueInfoProto) -> list | None:
    if not value_info.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


def _attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


class _Graph:
    """What every rule of one ONNX graph needs: producers, constants, shapes and symbols."""

    def __init__(self, model: onnx.ModelProto, data_inputs: list[str]):
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # shape inference only sharpens the checks
            inferred = model
        graph = inferred.graph
        self.graph = graph
        self.data_inputs = [i.name for i in graph.input if i.name in data_inputs]
        self.shapes = {v.name: _dims(v) for v in [*graph.input, *graph.value_info, *graph.output]}
        self.types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
        self.shapes.update({i.name: list(i.dims) for i in graph.initializer})
        self.initializers = {i.name: i for i in graph.initializer}
        self.weights = set(self.initializers) | {i.name for i in graph.input if i.name not in data_inputs}
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.symbol_at: dict[str, tuple[str, int]] = {}
        for name in self.data_inputs:
            for axis, dim in enumerate(self.shapes.get(name) or []):
                if isinstance(dim, str):
                    self.symbol_at.setdefault(dim, (name, axis))


_INTEGER_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                  onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
# ops that only move or repeat values: the last of an index's chain leave the values checked unchanged
_LAYOUT = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand"}


def _checked_value(graph: _Graph, name: str) -> str:
    """The value whose elements are those of index ``name``, before the layout ops and integer casts
    that end its chain."""
    while True:
        node = graph.producer.get(name)
        if node is None or not (node.op_type in _LAYOUT or (
                node.op_type == "Cast" and graph.types.get(node.input[0]) in _INTEGER_TYPES
                and _attribute(node, "to") in _INTEGER_TYPES)):
            return name
        name = node.input[0]


class _Rule:
    """The steps of one rule, built back from its index operand."""

    def __init__(self, graph: _Graph):
        self.g = graph
        self.steps: list[dict] = []
        self._done: dict[str, dict] = {}

    def add(self, step: dict) -> dict:
        self.steps.append(step)
        return {"ref": len(self.steps) - 1}

    def size(self, dim: Any) -> Any:
        """An operand for a dimension of shape inference: a number, a symbol's size, or None."""
        if isinstance(dim, int) or dim is None:
            return dim
        if dim not in self.g.symbol_at:
            return None
        source, axis = self.g.symbol_at[dim]
        return self.add({"op": "size", "x": self.value(source), "dim": axis})

    def constant(self, name: str) -> np.ndarray:
        """The value of ``name`` when the graph fixes it (an initializer or a ``Constant``)."""
        if name in self.g.initializers and name not in self.g.data_inputs:
            return numpy_helper.to_array(self.g.initializers[name])
        node = self.g.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return _constant_value(node)
        raise Untranslatable(f"{name!r} is not a constant")

    def shape(self, name: str) -> dict:
        """The shape of ``name`` as a 1-D operand: read off the value where the steps compute it,
        else from shape inference's sizes, else through an embedding lookup (``Gather`` of a
        table: the indices' shape and the row's)."""
        try:
            return self.add({"op": "shape", "x": self.value(name)})
        except Untranslatable:
            dims = [self.size(d) for d in self.g.shapes.get(name) or [None]]
            if all(d is not None for d in dims):
                return self.add({"op": "vector", "items": dims})
            node = self.g.producer.get(name)
            table = self.g.shapes.get(node.input[0]) if node is not None and node.op_type == "Gather" else None
            if not table or node.input[0] not in self.g.weights or not all(isinstance(d, int) for d in table):
                raise
            axis = int(_attribute(node, "axis", 0) or 0) % len(table)
            parts = [self.add({"op": "const", "value": table[:axis], "dtype": "int64"}), self.shape(node.input[1]),
                     self.add({"op": "const", "value": table[axis + 1:], "dtype": "int64"})]
            return self.add({"op": "concat", "xs": parts, "axis": 0})

    def value(self, name: str) -> dict:
        if name not in self._done:
            self._done[name] = self._value(name)
        return self._done[name]

    def _value(self, name: str) -> dict:
        g = self.g
        if name in g.data_inputs:
            return self.add({"op": "input", "name": name})
        if name in g.initializers:
            array = numpy_helper.to_array(g.initializers[name])
            if array.dtype.kind not in "iub" or array.size > index_rules.INLINE_CONSTANT_ELEMENTS:
                raise Untranslatable(f"{name!r} (a weight)")
            return self.add({"op": "const", "value": array.tolist(), "dtype": str(array.dtype)})
        node = g.producer.get(name)
        if node is None:
            raise Untranslatable(f"{name!r} (a weight)")
        op, ins = node.op_type, list(node.input)
        if op == "Constant":
            array = _constant_value(node)
            return self.add({"op": "const", "value": array.tolist(), "dtype": str(array.dtype)})
        if op == "Identity":
            return self.value(ins[0])
        if op == "Cast":
            dtype = onnx.helper.tensor_dtype_to_np_dtype(_attribute(node, "to"))
            return self.add({"op": "cast", "x": self.value(ins[0]), "dtype": str(dtype)})
        if op == "Reshape":
            return self.add({"op": "reshape", "x": self.value(ins[0]), "shape": self.value(ins[1]),
                             "zeros_copy": not _attribute(node, "allowzero", 0)})
        if op == "Flatten":
            return self.add({"op": "flatten", "x": self.value(ins[0]), "axis": _attribute(node, "axis", 1)})
        if op in ("Squeeze", "Unsqueeze"):
            axes = _attribute(node, "axes")
            axes = [int(a) for a in (self.constant(ins[1]).reshape(-1) if len(ins) > 1 and ins[1] else axes or [])]
            rank = len(g.shapes.get(node.output[0] if op == "Unsqueeze" else ins[0]) or [])
            if any(a < 0 for a in axes) and not rank:
                raise Untranslatable(f"{op} of unknown rank")
            axes = [a % rank if a < 0 else a for a in axes]
            return self.add({"op": op.lower(), "x": self.value(ins[0]), "axes": axes or None})
        if op == "Transpose":
            perm = _attribute(node, "perm")
            return self.add({"op": "transpose", "x": self.value(ins[0]), "perm": list(perm) if perm else None})
        if op == "Expand":
            return self.add({"op": "expand", "x": self.value(ins[0]), "shape": self.value(ins[1])})
        if op == "Slice":
            axes = self.value(ins[3]) if len(ins) > 3 and ins[3] else list(range(len(self.constant(ins[1]))))
            steps = self.value(ins[4]) if len(ins) > 4 and ins[4] else None
            return self.add({"op": "slice", "x": self.value(ins[0]), "axes": axes, "starts": self.value(ins[1]),
                             "ends": self.value(ins[2]), "steps": steps})
        if op == "Gather":
            return self.add({"op": "take", "x": self.value(ins[0]), "indices": self.value(ins[1]),
                             "axis": int(_attribute(node, "axis", 0))})
        if op == "Pad":
            if _attribute(node, "mode", b"constant") not in (b"constant", "constant") or (len(ins) > 3 and ins[3]):
                raise Untranslatable("Pad other than constant padding of every axis")
            value = self.value(ins[2]) if len(ins) > 2 and ins[2] else 0
            return self.add({"op": "pad", "x": self.value(ins[0]), "pads": self.value(ins[1]), "layout": "onnx",
                             "value": value})
        if op == "Where":
            return self.add({"op": "where", "cond": self.value(ins[0]), "x": self.value(ins[1]),
                             "y": self.value(ins[2])})
        if op in _BINARY and len(ins) == 2:
            return self.add({"op": "binary", "fn": _BINARY[op], "a": self.value(ins[0]), "b": self.value(ins[1])})
        if op == "Mod" and not _attribute(node, "fmod", 0):
            return self.add({"op": "binary", "fn": "remainder", "a": self.value(ins[0]), "b": self.value(ins[1])})
        if op in _UNARY:
            return self.add({"op": "unary", "fn": _UNARY[op], "x": self.value(ins[0])})
        if op == "Concat":
            return self.add({"op": "concat", "xs": [self.value(i) for i in ins], "axis": _attribute(node, "axis")})
        if op == "Shape":
            shape = self.shape(ins[0])
            start, end = _attribute(node, "start", 0), _attribute(node, "end")
            if start == 0 and end is None:
                return shape
            return self.add({"op": "slice", "x": shape, "axes": [0], "starts": [start],
                             "ends": [2**63 - 1 if end is None else end]})
        if op == "ConstantOfShape":
            fill = _attribute(node, "value")
            array = numpy_helper.to_array(fill) if fill is not None else np.zeros(1, np.float32)
            return self.add({"op": "full", "shape": self.value(ins[0]), "value": array.reshape(-1)[0].item(),
                             "dtype": str(array.dtype)})
        if op == "Range":
            return self.add({"op": "arange", "start": self.value(ins[0]), "end": self.value(ins[1]),
                             "step": self.value(ins[2])})
        raise Untranslatable(f"{op} node {node.name!r}")


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name in ("value_int", "value_ints"):
            return np.asarray(onnx.helper.get_attribute_value(attr), dtype=np.int64)
    raise Untranslatable(f"Constant node {node.name!r}")


def _index_operands(node: onnx.NodeProto, graph: _Graph) -> list[dict]:
    """What ``node`` indexes with: ``[{"index", "high", "low", "ignore", "what"}]`` (empty: nothing)."""
    module, shapes = module_of(node.name), graph.shapes
    if node.op_type == "Gather" and len(node.input) > 1:
        axis = int(_attribute(node, "axis", 0) or 0)
        table = shapes.get(node.input[0]) or []
        high = table[axis] if len(table) > axis else None
        if node.input[0] in graph.weights:
            return [{"index": node.input[1], "high": high if isinstance(high, int) else None, "low": 0,
                     "ignore": None, "what": f"rows of {node.input[0]!r} (embedding lookup in {module})"}]
        return [{"index": node.input[1], "high": high, "low": "-high", "ignore": None,
                 "what": f"positions along dimension {axis} of a Gather in {module}"}]
    if node.op_type in ("GatherElements", "ScatterElements") and len(node.input) > 1:
        axis = int(_attribute(node, "axis", 0) or 0)
        data = shapes.get(node.input[0]) or []
        return [{"index": node.input[1], "high": data[axis] if len(data) > axis else None, "low": "-high",
                 "ignore": None, "what": f"positions along dimension {axis} of a {node.op_type} in {module}"}]
    if node.op_type in _LOSSES and len(node.input) > 1:
        scores = shapes.get(node.input[0]) or []
        classes = scores[1] if len(scores) > 1 else None
        ignore = _attribute(node, "ignore_index")
        return [{"index": node.input[1], "high": classes if isinstance(classes, int) else None, "low": 0,
                 "ignore": None if ignore is None else int(ignore),
                 "what": f"classes of the {_LOSSES[node.op_type]} in {module}"}]
    return []


def find_input_constraints(model: onnx.ModelProto, data_inputs: list[str]) -> dict[str, Any]:
    """What each batch must satisfy to be valid for PyTorch, from an ONNX forward graph.

    Args:
        model: the forward graph (weights as initializers or graph inputs, with shapes).
        data_inputs: names of the description's inputs.

    Returns:
        A JSON-able dict: ``indices``, a list of ``index_rules`` rules, and ``batchnorm``
        ``[{"module", "shape"}]`` (the input shape of each training-mode BatchNorm, a dimension
        being an int, a description symbol, or None when unknown).
    """
    graph = _Graph(model, data_inputs)
    rules, seen = [], set()
    for node in graph.graph.node:
        for operand in _index_operands(node, graph):
            rule = _Rule(graph)
            try:
                high = rule.size(operand["high"]) if operand["high"] is not None else None
                index = rule.value(_checked_value(graph, operand["index"]))
            except (Untranslatable, TypeError, ValueError, IndexError, KeyError) as exc:
                logger.debug("the %s goes unchecked: its index is computed by %s", operand["what"], exc)
                continue
            if not any(step["op"] == "input" for step in rule.steps):
                continue  # indices the graph fixes itself
            if operand["low"] == "-high" and high is None:
                continue  # any value may count from an end of unknown size
            found = index_rules.compact({"what": operand["what"], "steps": rule.steps, "index": index["ref"],
                                         "low": operand["low"], "high": high, "ignore": operand["ignore"]})
            key = json.dumps(found, sort_keys=True)
            if key not in seen:
                seen.add(key)
                rules.append(found)
    batchnorm = [{"module": module_of(node.name), "shape": graph.shapes.get(node.input[0])}
                 for node in graph.graph.node
                 if node.op_type == "BatchNormalization" and _attribute(node, "training_mode", 0) == 1]
    return {"indices": rules, "batchnorm": batchnorm}


class BatchChecks:
    """The checks of one set of constraints, ready to run on every batch.

    A rule that reads only the inputs' shapes (positions made by ``arange``) is checked once per
    set of shapes. A rule of a static trace that holds for its traced shapes only (``shapes``) is
    skipped for others: the graphs of another shape come from a trace of their own, whose rules
    are checked before they are built. A rule that cannot be evaluated for a batch is skipped with
    a log line, once: the check is a guard, never a reason to stop.

    Args:
        constraints: ``find_input_constraints``'s or ``find_program_constraints``'s result.
    """

    def __init__(self, constraints: dict[str, Any]):
        rules = constraints.get("indices") or []
        if isinstance(rules, dict):  # a graph cache entry of an earlier format
            rules = []
        self.value_rules, self.shape_rules = [], []
        self._direct, self._evaluated = [], []  # the value rules, split by how a step checks them
        for r in rules:
            if not index_rules.reads_values(r):
                self.shape_rules.append(r)
                continue
            self.value_rules.append(r)
            if len(r["steps"]) == 1 and not isinstance(r.get("high"), dict) and "shapes" not in r:
                # the common rule, an input as it comes with fixed bounds: one comparison per step
                low = -r["high"] if r.get("low") == "-high" and r["high"] is not None else 0  # as ``violations``
                self._direct.append((r["steps"][0]["name"], low, r["high"], r))
            else:
                self._evaluated.append(r)
        self.batchnorm = constraints.get("batchnorm") or []
        self._by_shapes: dict[tuple, list[str]] = {}
        self._failed: set[str] = set()

    @property
    def needs_symbols(self) -> bool:
        """Whether ``problems`` reads the symbol sizes (BatchNorm's rule)."""
        return bool(self.batchnorm)

    @staticmethod
    def _holds(rule: dict, feeds: dict[str, np.ndarray]) -> bool:
        """Whether ``rule`` serves a batch of these shapes (``shapes``: those of its trace only)."""
        shapes = rule.get("shapes")
        return shapes is None or all(list(np.shape(feeds.get(n))) == s for n, s in shapes.items())

    def _violations(self, rule: dict, feeds: dict[str, np.ndarray]) -> str | None:
        try:
            return index_rules.violations(rule, feeds)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run must not stop training
            if rule["what"] not in self._failed:
                self._failed.add(rule["what"])
                logger.info("could not check the %s for inputs of shapes %s (%s); it goes unchecked", rule["what"],
                            {n: list(a.shape) for n, a in feeds.items()}, exc)
            return None

    def problems(self, feeds: dict[str, np.ndarray], symbols: dict[str, int], training: bool) -> list[str]:
        """Every way these inputs break the constraints (empty when they are valid).

        Args:
            feeds: the batch, by input name.
            symbols: the size of each symbolic dimension in this batch (read by BatchNorm's rule).
            training: check the training-only rules too (BatchNorm's more-than-one-value rule).
        """
        found = []
        for name, low, high, rule in self._direct:
            values = feeds.get(name)
            if values is not None and values.dtype.kind in "iu" and np.count_nonzero(
                    index_rules.out_of_range(values, low, high)):
                found.append(self._violations(rule, feeds))  # the ignore index may explain them all
        found += [self._violations(rule, feeds) for rule in self._evaluated if self._holds(rule, feeds)]
        found = [p for p in found if p]
        if self.shape_rules:
            shapes = tuple((name, array.shape) for name, array in feeds.items())
            if shapes not in self._by_shapes:
                self._by_shapes[shapes] = [p for p in (self._violations(r, feeds) for r in self.shape_rules
                                                       if self._holds(r, feeds)) if p]
            found += self._by_shapes[shapes]
        problems = found
        if training:
            problems += _batchnorm_problems(self.batchnorm, symbols)
        return problems


def _batchnorm_problems(batchnorm: list[dict], symbols: dict[str, int]) -> list[str]:
    problems = []
    for bn in batchnorm:
        shape = bn["shape"]
        if not shape or len(shape) < 2:
            continue
        resolved = [symbols.get(d) if isinstance(d, str) else d for d in shape]
        if any(d is None for d in [resolved[0], *resolved[2:]]):
            continue
        count = int(np.prod([resolved[0], *resolved[2:]]))
        if count <= 1:
            problems.append(
                f"BatchNorm in module {bn['module']} gets {count} value per channel (input shape {resolved}): "
                "PyTorch refuses this in training ('Expected more than 1 value per channel') because the "
                "batch variance is undefined; use a batch of at least 2, or drop the last incomplete batch")
    return problems


def check_inputs(constraints: dict[str, Any], feeds: dict[str, np.ndarray], symbols: dict[str, int],
                 training: bool) -> list[str]:
    """Every way these inputs break the constraints (empty when they are valid): ``BatchChecks``
    made for one batch."""
    return BatchChecks(constraints).problems(feeds, symbols, training)


__all__ = ["BatchChecks", "check_inputs", "find_input_constraints"]

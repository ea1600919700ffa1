"""Input checks PyTorch would make, read off the forward graph once and applied to every batch.

ONNX operators accept inputs that PyTorch rejects: ``Gather`` takes a negative index as counting
from the end, so label −3 trains as class C−3 and token id −1 as the last embedding row; a
training-mode ``BatchNormalization`` over one value per channel divides by zero and leaves the
running variance NaN for good. PyTorch raises for both. ``find_input_constraints`` records, from
the forward graph before any rewrite, which integer inputs index what (embedding rows, classes of
a cross-entropy) and the shape of every training-mode BatchNorm input in terms of the
description's symbols; ``check_inputs`` then tests a batch against them in microseconds and
returns every violation, before any state changes.

The torch gradient source has no forward ONNX graph: ``find_program_constraints`` reads the same
facts off its ``torch.export`` program (``aten.embedding`` indices, ``aten.cross_entropy_loss`` /
``nll_loss`` targets, training-mode ``aten.batch_norm`` inputs), in the same format.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ..onnx_graph import module_of

# ops whose output holds (a subset of) the index values of input 0, unchanged
_PASS_THROUGH = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Slice",
                 "Gather", "Cast"}
_LOSSES = {"SoftmaxCrossEntropyLoss": "cross-entropy", "NegativeLogLikelihoodLoss": "negative log-likelihood loss"}


def _dims(value_info: onnx.ValueInfoProto) -> list | None:
    if not value_info.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value_info.type.tensor_type.shape.dim]


def _int_attr(node: onnx.NodeProto, name: str) -> int | None:
    for attr in node.attribute:
        if attr.name == name:
            return int(onnx.helper.get_attribute_value(attr))
    return None


def find_input_constraints(model: onnx.ModelProto, data_inputs: list[str]) -> dict[str, Any]:
    """What each batch must satisfy to be valid for PyTorch, from the forward graph.

    Args:
        model: the forward graph (weights as initializers or graph inputs, with shapes).
        data_inputs: names of the description's inputs.

    Returns:
        A JSON-able dict: ``indices`` ``{input: [{"high", "ignore", "what"}]}`` (valid values are
        ``0 <= v < high``, or ``v == ignore``; ``high`` None when unknown) and ``batchnorm``
        ``[{"module", "shape"}]`` (the input shape of each training-mode BatchNorm, a dimension
        being an int, a description symbol, or None when unknown).
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # shape inference only sharpens the checks
        inferred = model
    graph = inferred.graph
    shapes = {v.name: _dims(v) for v in [*graph.input, *graph.value_info, *graph.output]}
    shapes.update({i.name: list(i.dims) for i in graph.initializer})
    weights = {i.name for i in graph.initializer} | {i.name for i in graph.input if i.name not in data_inputs}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    indices: dict[str, list[dict]] = {}
    for source in data_inputs:
        found: list[dict] = []
        frontier, seen = [source], {source}
        while frontier:
            value = frontier.pop()
            for node in consumers.get(value, []):
                slot = list(node.input).index(value)
                if node.op_type == "Gather" and slot == 1 and node.input[0] in weights:
                    axis = _int_attr(node, "axis") or 0
                    table = shapes.get(node.input[0]) or []
                    high = table[axis] if len(table) > axis and isinstance(table[axis], int) else None
                    found.append({"high": high, "ignore": None,
                                  "what": f"rows of {node.input[0]!r} (embedding lookup in {module_of(node.name)})"})
                elif node.op_type in _LOSSES and slot == 1:
                    scores = shapes.get(node.input[0]) or []
                    high = scores[1] if len(scores) > 1 and isinstance(scores[1], int) else None
                    found.append({"high": high, "ignore": _int_attr(node, "ignore_index"),
                                  "what": f"classes of the {_LOSSES[node.op_type]} in {module_of(node.name)}"})
                elif node.op_type in _PASS_THROUGH and slot == 0:
                    for out in node.output:
                        if out and out not in seen:
                            seen.add(out)
                            frontier.append(out)
        if found:
            indices[source] = found

    batchnorm = []
    for node in graph.node:
        if node.op_type == "BatchNormalization" and _int_attr(node, "training_mode") == 1:
            batchnorm.append({"module": module_of(node.name), "shape": shapes.get(node.input[0])})
    return {"indices": indices, "batchnorm": batchnorm}


def _out_of_range(values: np.ndarray, high: int | None) -> np.ndarray:
    """Where integer ``values`` are negative, or ``high`` or more: one comparison where there is a
    bound, as a negative value read unsigned is above any index (every step checks its labels; each
    NumPy call costs microseconds on a batch of labels)."""
    if high is None:
        return values < 0
    if values.dtype.kind == "i":
        values = values.view(values.dtype.str.replace("i", "u"))  # "<i8" -> "<u8"
    return values >= high


def check_inputs(constraints: dict[str, Any], feeds: dict[str, np.ndarray], symbols: dict[str, int],
                 training: bool) -> list[str]:
    """Every way these inputs break the constraints (empty when they are valid).

    Args:
        constraints: ``find_input_constraints``'s result.
        feeds: the batch, by input name.
        symbols: the size of each symbolic dimension in this batch.
        training: check the training-only rules too (BatchNorm's more-than-one-value rule).
    """
    problems = []
    for name, rules in (constraints.get("indices") or {}).items():
        values = feeds.get(name)
        if values is None or values.size == 0 or values.dtype.kind not in "iu":
            continue
        for rule in rules:
            high, ignore = rule["high"], rule["ignore"]
            bad = _out_of_range(values, high)
            if not np.count_nonzero(bad):  # the common case: one comparison, one count
                continue
            if ignore is not None:
                bad &= values != ignore
                if not np.count_nonzero(bad):
                    continue
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            valid = f"0..{high - 1}" if high is not None else "non-negative"
            if ignore is not None:
                valid += f", or {ignore} (ignore_index)"
            problems.append(
                f"input {name!r}: value {int(values[where])} at index {list(where)} is out of range for the "
                f"{rule['what']}: valid values are {valid} ({int(bad.sum())} invalid value(s) in this batch); "
                "PyTorch raises for these too: fix or filter the batch")
    if training:
        for bn in constraints.get("batchnorm") or []:
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


# ATen ops whose output holds (a subset of) the values of argument 0, unchanged
_FX_PASS_THROUGH = {"view", "reshape", "_unsafe_view", "flatten", "squeeze", "unsqueeze", "permute", "transpose",
                    "t", "expand", "slice", "select", "clone", "contiguous", "alias", "detach", "_to_copy", "to",
                    "lift_fresh_copy", "index_select", "index", "narrow", "repeat", "unflatten", "movedim"}
# loss ops: (what, position of the target, position of ignore_index, its default)
_FX_LOSSES = {"cross_entropy_loss": ("cross-entropy", 1, 4, -100),
              **{op: ("negative log-likelihood loss", 1, 4, -100)
                 for op in ("nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward")}}
# batch-norm ops: position of the ``training`` flag
_FX_BATCH_NORMS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                   "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5, "_batch_norm_impl_index": 5}


def _op_name(node: Any) -> str | None:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if node.op == "call_function" else None


def _fx_module(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    if path == "model":
        return "<top-level forward>"
    return path[len("model."):] if path.startswith("model.") else "the loss function"


def _argument(node: Any, position: int, name: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def find_program_constraints(program: Any, data_inputs: list[str], weight_of: dict[str, str],
                             symbols: dict[str, list], dims: dict[str, int] | None = None) -> dict[str, Any]:
    """``find_input_constraints`` for a ``torch.export`` program (training mode, before decomposition).

    Args:
        program: the ``ExportedProgram``; its user inputs are the description's inputs, in order
            (a trailing extra input, such as the loss scale, is ignored).
        data_inputs: names of the description's inputs.
        weight_of: ``{parameter or buffer fqn: weight name}`` as the graphs name weights.
        symbols: ``{input: description shape}``: symbolic sizes of the traced shapes are named by
            these symbols.
        dims: the symbol sizes of a static trace (None for a symbolic one). The checks serve
            every batch shape, so a BatchNorm input size equal to exactly one symbol's size is
            taken as that symbol, and one equal to several as unknown.

    Returns:
        The same dict as ``find_input_constraints``.
    """
    import torch
    from torch.export.graph_signature import InputKind

    specs = program.graph_signature.input_specs
    users = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    weight_nodes = {s.arg.name: weight_of.get(s.target, s.target) for s in specs
                    if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    named: dict[str, str] = {}  # sympy expression of a traced size -> description symbol
    for input_name, placeholder in zip(data_inputs, users):
        value = placeholders[placeholder].meta.get("val")
        for dim, size in zip(symbols.get(input_name, []), getattr(value, "shape", [])):
            if isinstance(dim, str) and isinstance(size, torch.SymInt):
                named.setdefault(str(size.node.expr), dim)

    def shape_of(node: Any) -> list | None:
        value = node.meta.get("val") if hasattr(node, "meta") else None
        if not isinstance(value, torch.Tensor):
            return None
        return [named.get(str(size.node.expr)) if isinstance(size, torch.SymInt) else int(size)
                for size in value.shape]

    def symbolic_shape_of(node: Any) -> list | None:
        shape = shape_of(node)
        if shape is None or not dims:
            return shape
        result = []
        for size in shape:
            matches = [symbol for symbol, value in dims.items() if value == size]
            result.append(size if not matches else matches[0] if len(matches) == 1 else None)
        return result

    indices: dict[str, list[dict]] = {}
    for input_name, placeholder in zip(data_inputs, users):
        found: list[dict] = []
        frontier, seen = [placeholders[placeholder]], {placeholders[placeholder]}
        while frontier:
            value = frontier.pop()
            for node in value.users:
                op = _op_name(node)
                if op == "embedding" and len(node.args) > 1 and node.args[1] is value:
                    table = node.args[0]
                    rows = (shape_of(table) or [None])[0]
                    weight = weight_nodes.get(getattr(table, "name", None), getattr(table, "name", "?"))
                    found.append({"high": rows if isinstance(rows, int) else None, "ignore": None,
                                  "what": f"rows of {weight!r} (embedding lookup in {_fx_module(node)})"})
                elif op in _FX_LOSSES and len(node.args) > _FX_LOSSES[op][1] and node.args[_FX_LOSSES[op][1]] is value:
                    what, _, position, default = _FX_LOSSES[op]
                    scores = shape_of(node.args[0]) or []
                    classes = scores[1] if len(scores) > 1 else (scores[0] if len(scores) == 1 else None)
                    ignore = _argument(node, position, "ignore_index", default)
                    found.append({"high": classes if isinstance(classes, int) else None,
                                  "ignore": int(ignore) if isinstance(ignore, int) else None,
                                  "what": f"classes of the {what} in {_fx_module(node)}"})
                elif op in _FX_PASS_THROUGH and node.args and node.args[0] is value and node not in seen:
                    seen.add(node)
                    frontier.append(node)
        if found:
            indices[input_name] = found

    batchnorm = []
    for node in program.graph.nodes:
        op = _op_name(node)
        if op in _FX_BATCH_NORMS and _argument(node, _FX_BATCH_NORMS[op], "training", False) is True:
            batchnorm.append({"module": _fx_module(node), "shape": symbolic_shape_of(node.args[0])})
    return {"indices": indices, "batchnorm": batchnorm}


__all__ = ["check_inputs", "find_input_constraints", "find_program_constraints"]

"""A ``torch.export`` program's computation of an index, translated into ``index_rules`` steps.

``index_rule`` walks back from an index operand (the target of a cross-entropy, the indices of
an embedding) through the program to the description's inputs, and writes each operator on the
way as a step NumPy evaluates: views, casts, pads, slices, ``where`` and ``masked_fill``,
arithmetic, ``arange`` of a size, small integer buffers (BERT's position ids) as constants. An
operator it does not know, or a weight on the way, raises ``Untranslatable``: that index goes
unchecked. The layout operators that end the chain are left out (the check reads the values, not
where they sit).

A static trace (the default: graphs of each batch's exact shapes) holds sizes as numbers; a size
equal to exactly one description symbol's size in the traced batch is read as that symbol, so the
rules serve every shape, and a rule holding a number that may have been computed from a size is
marked to hold for the traced shapes only.
"""

from __future__ import annotations

import operator
from typing import Any

from . import index_rules
from .index_rules import Untranslatable

_INT64_MAX = 2**63 - 1

# ops that only move or repeat values: the last of an index's chain leave the values checked unchanged
_LAYOUT = {"view", "reshape", "_unsafe_view", "view_copy", "flatten", "unflatten", "squeeze", "unsqueeze",
           "permute", "transpose", "t", "expand", "expand_as", "movedim", "clone", "contiguous", "alias",
           "detach", "lift_fresh_copy", "repeat"}
_SAME = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_assert_tensor_metadata"}
_CASTS = {"to", "_to_copy", "type_as"}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "floor_divide": "floor_divide", "remainder": "remainder",
           "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "logical_and": "and",
           "logical_or": "or", "logical_xor": "xor", "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or",
           "bitwise_xor": "bitwise_xor", "__and__": "bitwise_and", "__or__": "bitwise_or",
           "__xor__": "bitwise_xor", "maximum": "maximum", "minimum": "minimum"}
_UNARY = {"neg": "neg", "abs": "abs", "logical_not": "not", "bitwise_not": "bitwise_not"}
_PYTHON = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floor_divide",
           operator.mod: "remainder"}


def op_name(node: Any) -> str | None:
    """The ATen operator of an FX node (``"embedding"``), ``"python.add"`` for SymInt arithmetic, or None."""
    if node.op != "call_function":
        return None
    if node.target in _PYTHON:
        return "python." + _PYTHON[node.target]
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None)


def argument(node: Any, position: int, name: str, default: Any) -> Any:
    """Argument ``name`` of an FX node, given by position or keyword, else ``default``."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def is_node(value: Any) -> bool:
    """Whether an argument is an FX node (not a literal)."""
    return hasattr(value, "op") and hasattr(value, "users")


def is_integer(dtype: Any) -> bool:
    """Whether a torch dtype holds integers (an index; not a boolean mask)."""
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"


class ProgramFacts:
    """What every rule of one program needs: its inputs, constants and the symbols of its sizes."""

    def __init__(self, program: Any, data_inputs: list[str], symbols: dict[str, list], dims: dict[str, int] | None):
        import torch
        from torch.export.graph_signature import InputKind

        self.torch = torch
        specs = program.graph_signature.input_specs
        users = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
        self.inputs = dict(zip(users, data_inputs))  # placeholder name -> description input
        self.placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        tensors = {**program.state_dict, **program.constants}
        self.constants = {s.arg.name: tensors[s.target] for s in specs
                          if s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) and s.target in tensors}
        self.parameters = {s.arg.name: s.target for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
        self.dims = dims
        # where each description symbol can be read: the first input and dimension that has it
        self.symbol_at: dict[str, tuple[str, int]] = {}
        for name in data_inputs:
            for axis, dim in enumerate(symbols.get(name, [])):
                if isinstance(dim, str):
                    self.symbol_at.setdefault(dim, (name, axis))
        # the inputs' shapes in a static trace: a rule with numbers that may stand for sizes holds for them only
        self.traced_shapes = {name: [int(d) for d in self.placeholders[placeholder].meta["val"].shape]
                              for placeholder, name in self.inputs.items()} if dims else None
        self.named: dict[str, str] = {}  # sympy expression of a traced size -> description symbol
        for placeholder, name in self.inputs.items():
            value = self.placeholders[placeholder].meta.get("val")
            for dim, size in zip(symbols.get(name, []), getattr(value, "shape", [])):
                if isinstance(dim, str) and isinstance(size, torch.SymInt):
                    self.named.setdefault(str(size.node.expr), dim)

    def placeholder_of(self, name: str) -> Any:
        """The placeholder of description input ``name``."""
        for placeholder, input_name in self.inputs.items():
            if input_name == name:
                return self.placeholders[placeholder]
        raise Untranslatable(f"input {name}")

    def shape(self, node: Any) -> list | None:
        value = node.meta.get("val") if hasattr(node, "meta") else None
        return list(value.shape) if isinstance(value, self.torch.Tensor) else None

    def dtype(self, node: Any) -> Any:
        value = node.meta.get("val") if hasattr(node, "meta") else None
        return value.dtype if isinstance(value, self.torch.Tensor) else None


class _Steps:
    """The steps of one rule, built back from its index operand."""

    def __init__(self, program: ProgramFacts):
        self.p = program
        self.steps: list[dict] = []
        self._done: dict[Any, Any] = {}
        self.shape_specific = False  # a number of a static trace that may stand for a size: see ``size``

    def add(self, step: dict) -> dict:
        self.steps.append(step)
        return {"ref": len(self.steps) - 1}

    # ---- sizes ----------------------------------------------------------------------------------
    def symbol(self, name: str) -> dict:
        key = ("symbol", name)
        if key not in self._done:
            source, axis = self.p.symbol_at[name]
            self._done[key] = self.add({"op": "size", "x": self.value(self.p.placeholder_of(source)), "dim": axis})
        return self._done[key]

    def size(self, size: Any, kind: str = "dim") -> Any:
        """An operand for a traced size: a number, or the batch's size of the symbol it stands for.

        ``kind`` says what the number is: ``"dim"`` a dimension, read as the symbol of its size in
        a static trace; ``"offset"`` a position (a slice's start), never a symbol; ``"table"`` the
        size of a weight or of the classes, fixed by the model. A static trace writes every Python
        int the model computed from a size as a number: a dimension or an offset beyond 0 and ±1
        that no symbol explains may be one (``seq - 3``), so the rule then holds for the traced
        shapes only (``shape_specific``).
        """
        torch = self.p.torch
        if isinstance(size, torch.SymInt):
            return self.expression(size.node.expr)
        if is_node(size):
            return self.value(size)
        size = int(size)
        if kind == "table" or not self.p.dims or abs(size) <= 1:
            return size
        matches = [symbol for symbol, value in self.p.dims.items() if value == size and symbol in self.p.symbol_at]
        if kind in ("dim", "view") and len(matches) > 1:
            raise Untranslatable(f"size {size} of a static trace could be any of the symbols {matches}")
        if kind in ("dim", "view") and matches:
            return self.symbol(matches[0])
        if kind != "view":  # a view's own caller decides (``_target_shape``)
            self.shape_specific = True
        return size

    def expression(self, expr: Any) -> Any:
        """A sympy size expression of a symbolic trace (sums and products of symbols)."""
        import sympy

        if expr.is_Integer:
            return int(expr)
        if expr.is_Symbol:
            if str(expr) not in self.p.named:
                raise Untranslatable(f"size {expr} is no description symbol")
            return self.symbol(self.p.named[str(expr)])
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            terms = [self.expression(term) for term in expr.args]
            fn = "add" if isinstance(expr, sympy.Add) else "mul"
            result = terms[0]
            for term in terms[1:]:
                result = self.add({"op": "binary", "fn": fn, "a": result, "b": term})
            return result
        raise Untranslatable(f"size expression {expr}")

    def shape_of(self, node: Any) -> list:
        """The output shape of ``node`` as operands, -1 for the one size that has none."""
        shape = self.p.shape(node)
        if shape is None:
            raise Untranslatable(f"{node.name} has no traced shape")
        result, unknown = [], 0
        for size in shape:
            try:
                result.append(self.size(size))
            except Untranslatable:
                unknown += 1
                result.append(-1)
        if unknown > 1:
            raise Untranslatable(f"the shape of {node.name}")
        return result

    # ---- values ---------------------------------------------------------------------------------
    def value(self, arg: Any) -> Any:
        """The operand of a node argument (a literal, a list of operands, or a step)."""
        if isinstance(arg, (list, tuple)):
            return [self.value(a) for a in arg]
        if isinstance(arg, self.p.torch.SymInt):
            return self.size(arg)
        if not is_node(arg):
            if isinstance(arg, (bool, int, float)) or arg is None:
                return arg
            raise Untranslatable(f"argument {arg!r}")
        if arg not in self._done:
            self._done[arg] = self._node(arg)
        return self._done[arg]

    def _node(self, node: Any) -> Any:
        p = self.p
        if node.op == "placeholder":
            if node.name in p.inputs:
                return self.add({"op": "input", "name": p.inputs[node.name]})
            tensor = p.constants.get(node.name)
            if tensor is None or tensor.dtype.is_floating_point or \
                    tensor.numel() > index_rules.INLINE_CONSTANT_ELEMENTS:
                raise Untranslatable(f"{p.parameters.get(node.name, node.name)} (a weight or a large buffer)")
            return self.add({"op": "const", "value": tensor.tolist(), "dtype": str(tensor.dtype).split(".")[-1]})
        op = op_name(node)
        args = node.args
        if op in _SAME:
            return self.value(args[0])
        if op in _CASTS:
            return self.add({"op": "cast", "x": self.value(args[0]), "dtype": _numpy_dtype(p.dtype(node))})
        if op in ("view", "reshape", "_unsafe_view", "view_copy"):
            return self.add({"op": "reshape", "x": self.value(args[0]), "shape": self._target_shape(args[1])})
        if op in ("flatten", "unflatten", "expand_as"):
            return self.add({"op": "reshape", "x": self.value(args[0]), "shape": self.shape_of(node)})
        if op == "expand":
            return self.add({"op": "expand", "x": self.value(args[0]), "shape": self.shape_of(node)})
        if op == "unsqueeze":
            rank = len(p.shape(node))
            return self.add({"op": "unsqueeze", "x": self.value(args[0]), "axes": [int(args[1]) % rank]})
        if op == "squeeze":
            rank = len(p.shape(args[0]))
            axes = None if len(args) < 2 else [int(d) % rank for d in (args[1] if isinstance(args[1], (list, tuple))
                                                                         else [args[1]])]
            return self.add({"op": "squeeze", "x": self.value(args[0]), "axes": axes})
        if op in ("permute", "transpose", "t", "movedim"):
            return self.add({"op": "transpose", "x": self.value(args[0]), "perm": _permutation(op, node, p)})
        if op in ("constant_pad_nd", "pad"):
            mode = argument(node, 2, "mode", "constant") if op == "pad" else "constant"
            value = argument(node, 3 if op == "pad" else 2, "value", 0)
            if mode != "constant":
                raise Untranslatable(f"{mode} padding")
            rank, flat = len(p.shape(args[0])), [self.size(a, "offset") for a in args[1]]
            if not all(isinstance(a, int) for a in flat):
                raise Untranslatable("padding by a symbolic size")
            pads = [[0, 0] for _ in range(rank)]
            for i in range(len(flat) // 2):  # torch lists the last dimension's pair first
                pads[rank - 1 - i] = [flat[2 * i], flat[2 * i + 1]]
            return self.add({"op": "pad", "x": self.value(args[0]), "pads": pads,
                             "value": 0 if value is None else value})
        if op in ("slice", "narrow"):
            return self._slice(node, op)
        if op == "select":
            return self.add({"op": "take", "x": self.value(args[0]), "indices": self.size(args[2], "offset"),
                             "axis": int(args[1]) % len(p.shape(args[0]))})
        if op == "index_select":
            return self.add({"op": "take", "x": self.value(args[0]), "indices": self.value(args[2]),
                             "axis": int(args[1]) % len(p.shape(args[0]))})
        if op == "where":
            return self.add({"op": "where", "cond": self.value(args[0]), "x": self.value(args[1]),
                             "y": self.value(args[2])})
        if op == "masked_fill":
            return self.add({"op": "where", "cond": self.value(args[1]), "x": self.value(args[2]),
                             "y": self.value(args[0])})
        if op in ("full_like", "zeros_like", "ones_like", "full", "zeros", "ones", "new_full", "new_zeros",
                  "new_ones", "scalar_tensor"):
            fill = {"zeros": 0, "ones": 1}.get(op.replace("new_", "").replace("_like", ""))
            if fill is None:
                fill = args[0] if op == "scalar_tensor" else args[-1]
            return self.add({"op": "full", "shape": self.shape_of(node), "value": self.value(fill),
                             "dtype": _numpy_dtype(p.dtype(node))})
        if op == "arange":
            bounds = [self.size(a) for a in args]
            start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds[:2], bounds[2] if len(bounds) > 2
                                                                             else 1)
            return self.add({"op": "arange", "start": start, "end": end, "step": step})
        if op == "sym_size":
            source = args[0]
            if source.op == "placeholder" and source.name in p.inputs:
                return self.add({"op": "size", "x": self.value(source), "dim": int(args[1])})
            return self.size(p.shape(source)[int(args[1])])
        if op in _BINARY or op == "rsub" or (op or "").startswith("python.") or op == "div":
            return self._binary(node, op)
        if op in _UNARY:
            return self.add({"op": "unary", "fn": _UNARY[op], "x": self.value(args[0])})
        if op in ("cat", "concat"):
            rank = len(p.shape(node))
            axis = int(argument(node, 1, "dim", 0)) % rank
            return self.add({"op": "concat", "xs": self.value(args[0]), "axis": axis})
        raise Untranslatable(f"operator {node.target} ({node.name})")

    def _target_shape(self, shape: Any) -> list:
        """A view's target shape as operands: symbols where the static trace's numbers match one; a
        number no symbol explains (a product of sizes) becomes the inferred -1 when the shape has
        none."""
        result = [self.size(s, "view") if not (isinstance(s, int) and s == -1) else -1 for s in shape]
        unexplained = [i for i, s in enumerate(result) if isinstance(s, int) and abs(s) > 1]
        if len(unexplained) == 1 and -1 not in result:
            result[unexplained[0]] = -1
        elif unexplained:
            self.shape_specific = True
        return result

    def _slice(self, node: Any, op: str) -> dict:
        args, p = node.args, self.p
        rank = len(p.shape(args[0]))
        axis = int(argument(node, 1, "dim", 0)) % rank
        if op == "narrow":
            start = self.size(args[2], "offset")
            end = self.add({"op": "binary", "fn": "add", "a": start, "b": self.size(args[3], "offset")})
            step = 1
        else:
            start = argument(node, 2, "start", None)
            end = argument(node, 3, "end", None)
            step = int(argument(node, 4, "step", 1))
            traced = p.shape(args[0])[axis]
            start = 0 if start is None else self.size(start, "offset")
            if end is None or (isinstance(end, int) and not isinstance(traced, p.torch.SymInt) and end >= int(traced)):
                end = _INT64_MAX  # to the end, whatever the size: a static trace writes the size it saw
            else:
                end = self.size(end, "offset")
        return self.add({"op": "slice", "x": self.value(args[0]), "axes": [axis], "starts": [start], "ends": [end],
                         "steps": [step]})

    def _binary(self, node: Any, op: str) -> dict:
        args = node.args
        if op.startswith("python."):
            fn = op[len("python."):]
        elif op == "div":
            if node.kwargs.get("rounding_mode", args[2] if len(args) > 2 else None) != "floor":
                raise Untranslatable("true division of an index")
            fn = "floor_divide"
        else:
            fn = "sub" if op == "rsub" else _BINARY[op]
        if node.kwargs.get("alpha", args[2] if op in ("add", "sub", "rsub") and len(args) > 2 else 1) != 1:
            raise Untranslatable(f"{op} with alpha")
        a, b = self.value(args[0]), self.value(args[1])
        if op == "rsub":
            a, b = b, a
        return self.add({"op": "binary", "fn": fn, "a": a, "b": b})


def _permutation(op: str, node: Any, program: ProgramFacts) -> list[int]:
    rank = len(program.shape(node.args[0]))
    if op == "permute":
        return [int(d) % rank for d in node.args[1]]
    if op == "t":
        return list(range(rank))[::-1]
    if op == "movedim":
        source, destination = node.args[1], node.args[2]
        source = [source] if isinstance(source, int) else list(source)
        destination = [destination] if isinstance(destination, int) else list(destination)
        order = [d for d in range(rank) if d not in [s % rank for s in source]]
        for s, d in sorted(zip(destination, source), key=lambda pair: pair[0] % rank):
            order.insert(s % rank, d % rank)
        return order
    perm = list(range(rank))
    a, b = int(node.args[1]) % rank, int(node.args[2]) % rank
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _numpy_dtype(dtype: Any) -> str:
    if dtype is None:
        raise Untranslatable("a value of unknown dtype")
    return str(dtype).split(".")[-1]


def index_rule(program: ProgramFacts, operand: dict) -> dict | None:
    """The rule of one index operand (``{"index", "high", "low", "ignore", "what", "sized"}``: the
    FX node it indexes with, its bounds, and whether ``high`` is a dimension that follows the
    batch), or None when its index is no integer or comes from no input (a constant).

    Raises:
        Untranslatable: the index is computed by something the steps cannot express.
    """
    index = operand["index"]
    if not is_integer(program.dtype(index)):
        return None  # class probabilities, a boolean mask: nothing indexes
    while op_name(index) in _LAYOUT | _SAME or (
            op_name(index) in _CASTS and is_integer(program.dtype(index.args[0]))):
        index = index.args[0]  # the values are checked, not where they sit
    rule = _Steps(program)
    high = operand["high"]
    if high is not None:
        # a sized dimension of an activation follows the batch's symbols; a table's or the scores' rows do not
        high = rule.size(high, "dim" if operand.get("sized") else "table")
    index = rule.value(index)
    if not any(step["op"] == "input" for step in rule.steps):
        return None
    found = index_rules.compact({"what": operand["what"], "steps": rule.steps, "index": index["ref"],
                                 "low": operand["low"], "high": high, "ignore": operand["ignore"]})
    if rule.shape_specific:
        found["shapes"] = program.traced_shapes
    return found


__all__ = ["ProgramFacts", "argument", "index_rule", "is_integer", "is_node", "op_name"]

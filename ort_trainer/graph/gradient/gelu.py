"""The ``gelu`` pass of the torch-autograd gradient source: GELU's forward and backward in the
fewest passes over memory.

Without it, GPT-2's GELU (Hugging Face ``NewGELUActivation``: the tanh approximation written out in
Python) reaches the joint graph as autograd's derivative of each of its ten operations, 21 ONNX
nodes per layer, each one pass over the ``[batch, seq, 4 × hidden]`` activations; ``F.gelu``
(BERT) is translated by torch's exporter into five nodes forward and ``gelu_backward`` decomposed
into eleven more, which compute ``erf`` a second time. Two steps:

1. Before autograd (``rewrite_formulas``, on the ``torch.export`` program): a GELU written out
   as arithmetic, ``0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`` or
   ``0.5 · x · (1 + erf(x / √2))`` in any association and spelling (``pow``/``mul``/``div``...,
   the coefficients equal to 1e-6), becomes ``aten.gelu(x, approximate="tanh"/"none")``.
2. After autograd (``rewrite_joint``, on the joint program, traced with ``gelu_backward`` left
   undecomposed: ``KEPT``): each forward ``gelu`` and its ``gelu_backward`` become one
   computation whose forward keeps what the backward needs:

   - tanh: ``s = sigmoid(x · (B + A·x²))`` (= ½(1 + tanh(u)), ``A = 2√(2/π)·0.044715``,
     ``B = 2√(2/π)``), ``y = x · s``; backward ``dx = dy · (s + m · (1 - s))`` with
     ``m = y · (B + 3A·x²)``: 6 + 7 nodes, ``x²``, ``s`` and ``y`` kept from the forward.
   - erf: ``a = x / √2``, ``Φ = ½(1 + erf(a))``, ``y = x · Φ``; backward
     ``dx = dy · (Φ + (a / exp(a²)) / √π)``: 5 + 6 nodes, ``a`` and ``Φ`` kept (``x`` is not
     needed after the forward). ``a / exp(a²)`` goes to exactly 0 where ``exp`` overflows.

Measured on ``[8, 128, 1024]`` float32 with ONNX Runtime 1.31 on 2 threads (kernel ms of one
forward and backward, medians of 60 interleaved runs): tanh 5.4 -> 3.4, erf 4.0 -> 2.9. The
``com.microsoft`` ``FastGelu``/``Gelu`` kernels for the forward (one node, but each costs two
elementwise passes, and the backward then recomputes the activation) gave 4.0 and 3.1; ONNX
Runtime's own Gelu fusions do not fire on these graphs.

Float16 and bfloat16 values (mixed precision) are computed the same way in their own dtype where
``rewrite_joint`` is asked to (``half=True``: ``graph_optimizations.half_precision_gelu``), the tanh
form as ``t = (x·A)·x``, ``s = sigmoid(x · (t + B))``, ``y = x · s`` and ``dx = dy · (s + (y · (1 -
s)) · (B + 3t))``: in float16 ``t`` is finite up to |x| = 957 (``x²`` alone overflows at 256), and
``y · (1 - s)`` is exactly 0 where the sigmoid saturates, so the product stays finite wherever ``B +
3t`` is (|x| < 553). Otherwise their forward is left as traced and their backward is the same
arithmetic in float32 after casts, as torch's own decomposition computes it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ..._logging import logger
from . import kernel_ops
from .fx_nodes import Builder as _Builder, retarget as _retarget, rewrite_graphs as _rewrite_graphs

_aten = torch.ops.aten
KEPT = (_aten.gelu_backward.default,)  # what the joint trace leaves undecomposed for ``rewrite_joint``


def kept(on: bool) -> tuple:
    """``KEPT`` where the pass is ``on``, else nothing."""
    return KEPT if on else ()


_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
_A, _B = 2.0 * _K * _C, 2.0 * _K
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_RSQRT_PI = 1.0 / math.sqrt(math.pi)
_TOLERANCE = 1e-6
_FUSED_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)

# {function after the formula's inner polynomial: (that polynomial, gelu's approximate)}; a
# polynomial is {(power of x, power of the function's value): coefficient}
_FORMULAS = {
    _aten.tanh.default: ({(1, 0): _K, (3, 0): _K * _C}, "tanh"),
    _aten.erf.default: ({(1, 0): _SQRT1_2}, "none"),
}
_OUTER = {(1, 0): 0.5, (1, 1): 0.5}  # 0.5·x + 0.5·x·f = 0.5·x·(1 + f)
_MAX_DEGREE = 3
_MAX_STEPS = 8  # arithmetic nodes between the function and the formula's result


def _gelu_calls(graph: torch.fx.Graph) -> int:
    found = 0
    for function in [n for n in graph.nodes if n.op == "call_function" and n.target in _FORMULAS]:
        match = _match_formula(function)
        if match is None:
            continue
        x, result, members, approximate = match
        result.target, result.args = _aten.gelu.default, (x,)
        result.kwargs = {"approximate": approximate} if approximate != "none" else {}
        for node in reversed([n for n in graph.nodes if n in members]):
            if not node.users:
                graph.erase_node(node)
        found += 1
    return found


def rewrite_formulas(program: Any) -> int:
    """Replace every GELU written out as arithmetic in ``program`` by ``aten.gelu``, in place.

    A formula is matched on the values it computes, not on one spelling: the arithmetic nodes
    (``mul``, ``add``, ``sub``, ``div`` by a number, ``neg``, ``pow`` by 2 or 3) between one
    tensor ``x``, numbers and one ``tanh``/``erf`` node are evaluated as polynomials in ``x`` and
    that node's value. A formula is left alone when one of its intermediate values has a reader
    outside it (it is computed anyway), or ``x`` is not floating point. Formulas inside the
    program's submodules (the regions ``torch.export`` traced under autocast) are found too.

    Args:
        program: a ``torch.export`` program before autograd (``autograd.trace``).

    Returns:
        How many formulas were replaced.
    """
    count = _rewrite_graphs(program, _gelu_calls)
    if count:
        logger.debug("gelu: %d GELU formula(s) written out in arithmetic now call aten.gelu", count)
    return count


def rewrite_joint(program: Any, half: bool = False, kernel: bool = False) -> int:
    """Compute each ``gelu`` / ``gelu_backward`` pair of a joint program as one, in place (see
    the module docstring); every ``gelu_backward`` is replaced.

    Args:
        program: the joint forward/backward program, traced with ``KEPT`` undecomposed.
        half: a float16 or bfloat16 GELU (mixed precision) too is computed as one, in its own dtype
            (``half_precision_gelu``), rather than its backward in float32 after its own forward.
        kernel: each backward of a float32, float16 or bfloat16 GELU becomes one node of ort_trainer's
            kernel library (``kernel_ops.gelu_grad``: ``graph_optimizations.fused_gelu_gradient``), which
            reads ``dy`` and ``x`` once and writes ``dx``, where the arithmetic is 6 or 7 nodes; the
            forward is rewritten as without it.

    Returns:
        How many ``gelu_backward`` nodes were replaced.
    """
    graph = program.graph
    fused = _FUSED_DTYPES + (_HALF_DTYPES if half else ())
    forwards: dict[tuple, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target == _aten.gelu.default:
            forwards.setdefault((node.args[0], _approximate(node, 1)), node)
    kept: dict[tuple, dict] = {}
    backwards = [n for n in graph.nodes if n.op == "call_function" and n.target == _aten.gelu_backward.default]
    for backward in backwards:
        d_y, x = backward.args[:2]
        key = (x, _approximate(backward, 2))
        forward = forwards.get(key)
        if kernel and _value(x).dtype in kernel_ops.KERNEL_DTYPES and _value(d_y).dtype == _value(x).dtype:
            if forward is not None and key not in kept and _value(x).dtype in fused:
                kept[key] = _forward(graph, forward, x, key[1])
            _retarget(backward, torch.ops.ort_trainer.gelu_grad.default, (d_y, x, key[1]))
            continue
        if forward is not None and _value(x).dtype in fused:
            if key not in kept:
                kept[key] = _forward(graph, forward, x, key[1])
            saved, cast = kept[key], None
        else:  # no forward to share: the backward recomputes what it needs, in float32 where torch does
            cast = None if _value(x).dtype in fused else _value(x).dtype
            with graph.inserting_before(backward):
                build = _Builder(graph, backward)
                if cast is not None:
                    x = build(_aten._to_copy.default, x, dtype=torch.float32)
                    d_y = build(_aten._to_copy.default, d_y, dtype=torch.float32)
                saved = _forward(graph, None, x, key[1], build)
        with graph.inserting_before(backward):
            build = _Builder(graph, backward)
            if key[1] == "tanh" and "t" in saved:
                derivative = _half_tanh_derivative(build, saved)
            elif key[1] == "tanh":
                slope = build(_aten.add.Tensor, build(_aten.mul.Tensor, saved["x2"], 3.0 * _A), _B)
                m = build(_aten.mul.Tensor, saved["y"], slope)
                one_minus_s = build(_aten.sub.Tensor, 1.0, saved["s"])
                derivative = build(_aten.add.Tensor, build(_aten.mul.Tensor, m, one_minus_s), saved["s"])
            else:
                a = saved["a"]
                ratio = build(_aten.div.Tensor, a, build(_aten.exp.default, build(_aten.mul.Tensor, a, a)))
                derivative = build(_aten.add.Tensor, build(_aten.mul.Tensor, ratio, _RSQRT_PI), saved["phi"])
            if cast is None:
                _retarget(backward, _aten.mul.Tensor, (derivative, d_y))
            else:
                _retarget(backward, _aten._to_copy.default, (build(_aten.mul.Tensor, derivative, d_y),),
                          {"dtype": cast})
    if backwards:
        graph.lint()
        program.graph_module.recompile()
        logger.debug("gelu: %d GELU backward(s) rewritten, %d sharing the forward's values", len(backwards),
                     len(kept))
    return len(backwards)


def _forward(graph: torch.fx.Graph, forward: torch.fx.Node | None, x: torch.fx.Node, approximate: str,
             build: "_Builder | None" = None) -> dict:
    """The forward values the backward reads; ``forward`` (the ``gelu`` node, kept in place with
    its name, which the program's outputs may refer to) becomes the product ``y``. Without
    ``forward`` (the backward's own recomputation) they are built with ``build`` where it inserts."""
    context = graph.inserting_before(forward) if forward is not None else contextlib.nullcontext()
    with context:
        build = build or _Builder(graph, forward)
        if approximate == "tanh" and _value(x).dtype in _HALF_DTYPES:
            # t = A·x² as (x·A)·x: finite up to |x| = 957 in float16 (x² alone overflows at 256)
            t = build(_aten.mul.Tensor, build(_aten.mul.Tensor, x, _A), x)
            s = build(_aten.sigmoid.default, build(_aten.mul.Tensor, x, build(_aten.add.Tensor, t, _B)))
            saved = {"t": t, "s": s}
            product = (x, s)
        elif approximate == "tanh":
            x2 = build(_aten.mul.Tensor, x, x)
            inner = build(_aten.mul.Tensor, x, build(_aten.add.Tensor, build(_aten.mul.Tensor, x2, _A), _B))
            s = build(_aten.sigmoid.default, inner)
            saved = {"x2": x2, "s": s}
            product = (x, s)
        else:
            a = build(_aten.mul.Tensor, x, _SQRT1_2)
            phi = build(_aten.mul.Tensor, build(_aten.add.Tensor, build(_aten.erf.default, a), 1.0), 0.5)
            saved = {"a": a, "phi": phi}
            product = (x, phi)
        if forward is not None:
            _retarget(forward, _aten.mul.Tensor, product)
            saved["y"] = forward
        elif approximate == "tanh":  # the only derivative that reads the output
            saved["y"] = build(_aten.mul.Tensor, *product)
    return saved


def _half_tanh_derivative(build: "_Builder", saved: dict) -> torch.fx.Node:
    """The tanh-GELU's derivative in a half dtype, ``s + (y · (1 - s)) · (B + 3t)`` (``t = A·x²``),
    in that order: ``y · (1 - s)`` is exactly 0 where the sigmoid saturates (x above ~6 or below
    ~-10 in float16), so the product stays finite and right wherever ``B + 3t`` is (|x| < 553 in
    float16; eager PyTorch's GELU written out in Python under autocast overflows from 256 on)."""
    s = saved["s"]
    slope = build(_aten.add.Tensor, build(_aten.mul.Tensor, saved["t"], 3.0), _B)
    spread = build(_aten.mul.Tensor, saved["y"], build(_aten.sub.Tensor, 1.0, s))
    return build(_aten.add.Tensor, build(_aten.mul.Tensor, spread, slope), s)


def _approximate(node: torch.fx.Node, position: int) -> str:
    return node.kwargs.get("approximate", node.args[position] if len(node.args) > position else "none")


def _value(node: Any) -> Any:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


# ---- matching a formula ---------------------------------------------------------------------------
_ARITHMETIC = {
    _aten.mul.Tensor, _aten.mul.Scalar, _aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar,
    _aten.rsub.Scalar, _aten.rsub.Tensor, _aten.div.Tensor, _aten.div.Scalar, _aten.neg.default,
    _aten.pow.Tensor_Scalar,
}


def _match_formula(function: torch.fx.Node) -> tuple | None:
    """``(x, result node, nodes the formula replaces, approximate)`` for the GELU formula around
    ``function`` (a ``tanh``/``erf`` node), or None."""
    expected, approximate = _FORMULAS[function.target]
    if len(function.args) != 1 or function.kwargs:
        return None
    # x is the value the polynomial is in: the nearest one to the function for which it is the
    # expected one (x may itself be arithmetic, e.g. the GELU of 3·h)
    for x in _operands(function.args[0]):
        inner_members: dict = {}
        inner = _polynomial(function.args[0], {x: (1, 0)}, inner_members)
        if inner is not None and _equal(inner, expected):
            break
    else:
        return None
    if _value(x) is None or not _value(x).dtype.is_floating_point:
        return None
    current = function
    for _ in range(_MAX_STEPS):
        if len(current.users) != 1:
            return None
        user = next(iter(current.users))
        if user.op != "call_function" or user.target not in _ARITHMETIC:
            return None
        outer_members: dict = {}
        outer = _polynomial(user, {x: (1, 0), function: (0, 1)}, outer_members)
        if outer is None:
            return None
        if _equal(outer, _OUTER):
            members = {*inner_members, *outer_members, function}
            members.discard(user)
            if any(u not in members and u is not user for n in members for u in n.users):
                return None  # an intermediate value is read elsewhere: the formula is computed anyway
            return x, user, members, approximate
        current = user
    return None


def _operands(node: Any) -> list:
    """The nodes an arithmetic expression reads, directly or through its arithmetic, nearest first."""
    found: list = []
    queue = [node]
    while queue and len(found) < 4 * _MAX_STEPS:
        current = queue.pop(0)
        if not isinstance(current, torch.fx.Node) or current in found:
            continue
        found.append(current)
        if current.op == "call_function" and current.target in _ARITHMETIC:
            queue.extend(current.args)
    return found


def _polynomial(node: Any, variables: dict, members: dict) -> dict | None:
    """``node``'s value as ``{(i, j): c}`` (``c · v0^i · v1^j`` of the two ``variables``), the
    arithmetic nodes it reads recorded in ``members`` (``{node: its polynomial}``); None for
    anything else, or for an expression larger than a GELU formula."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return {(0, 0): float(node)}
    if not isinstance(node, torch.fx.Node):
        return None
    if node in variables:
        return {variables[node]: 1.0}
    if node in members:  # read twice (x·x...): once evaluated
        return members[node]
    if node.op != "call_function" or node.target not in _ARITHMETIC or len(members) >= 4 * _MAX_STEPS:
        return None
    members[node] = None
    members[node] = result = _evaluate(node, variables, members)
    return result


def _evaluate(node: torch.fx.Node, variables: dict, members: dict) -> dict | None:
    """One arithmetic node's polynomial, from its operands' (``_polynomial``)."""
    target, args, kwargs = node.target, node.args, node.kwargs
    alpha = kwargs.get("alpha", 1)
    if set(kwargs) - {"alpha"} or not isinstance(alpha, (int, float)):
        return None
    operands = [_polynomial(a, variables, members) for a in args[:2]]
    if any(o is None for o in operands):
        return None
    if target in (_aten.mul.Tensor, _aten.mul.Scalar):
        return _product(*operands)
    if target in (_aten.add.Tensor, _aten.add.Scalar):
        return _sum(operands[0], operands[1], alpha)
    if target in (_aten.sub.Tensor, _aten.sub.Scalar):
        return _sum(operands[0], operands[1], -alpha)
    if target in (_aten.rsub.Tensor, _aten.rsub.Scalar):
        return _sum(operands[1], operands[0], -alpha)
    if target == _aten.neg.default:
        return {k: -c for k, c in operands[0].items()}
    if target in (_aten.div.Tensor, _aten.div.Scalar):
        divisor = operands[1]
        if set(divisor) != {(0, 0)} or divisor[(0, 0)] == 0 or "rounding_mode" in kwargs:
            return None
        return {k: c / divisor[(0, 0)] for k, c in operands[0].items()}
    exponent = operands[1]  # pow.Tensor_Scalar
    if set(exponent) != {(0, 0)} or exponent[(0, 0)] not in (1.0, 2.0, 3.0):
        return None
    result = {(0, 0): 1.0}
    for _ in range(int(exponent[(0, 0)])):
        result = _product(result, operands[0])
        if result is None:
            return None
    return result


def _product(left: dict | None, right: dict | None) -> dict | None:
    if left is None or right is None:
        return None
    result: dict = {}
    for (i, j), c in left.items():
        for (k, m), d in right.items():
            if i + k > _MAX_DEGREE or j + m > 1:
                return None
            result[(i + k, j + m)] = result.get((i + k, j + m), 0.0) + c * d
    return result


def _sum(left: dict, right: dict, scale: float) -> dict:
    result = dict(left)
    for key, c in right.items():
        result[key] = result.get(key, 0.0) + scale * c
    return result


def _equal(found: dict, expected: dict) -> bool:
    terms = {k: c for k, c in found.items() if c != 0.0}
    return set(terms) == set(expected) and all(
        math.isclose(terms[k], expected[k], rel_tol=_TOLERANCE) for k in expected)


__all__ = ["KEPT", "kept", "rewrite_formulas", "rewrite_joint"]

"""The ``gelu_forward_kernel`` joint-graph pass: a GELU's forward as one ONNX Runtime kernel.

The ``gelu`` pass (``gradient/gelu.py``) writes each GELU's forward as element-wise nodes whose
values its backward reads: the tanh form ``y = x · σ(x · (B + A·x²))`` (six nodes in float16,
``t = (x·A)·x`` first), the erf form ``y = x · ½(1 + erf(x / √2))`` (five). Once
``activation_recompute`` has given the backward its own copies of those values, the forward's
nodes compute ``y`` alone: one pass over the ``[batch, seq, 4 × hidden]`` activations each, the
largest share of a GPU step's element-wise bytes after the attention (GPT-2 small in float16 at
8 × 512: ~4 GB a step of the 63 GB its graph moves). Here such a region becomes one
``com.microsoft`` node, ``FastGelu`` (tanh) or ``BiasGelu`` with a zero bias (erf: ONNX Runtime's CUDA
``Gelu`` has no bfloat16 kernel), whose CUDA kernels (float32, float16, bfloat16 in the standard
onnxruntime-gpu build: ``contrib_ops/cuda/bert/fast_gelu.cc``, ``contrib_ops/cuda/math/bias_gelu.cc``)
read ``x`` once and write ``y`` once.

A region is the element-wise nodes (``Mul``, ``Add``, ``Sub``, ``Div``, ``Neg`` and one ``Sigmoid``,
``Tanh`` or ``Erf``, or a call of the model's function made of one, as the exporter's ``aten_special_erf``)
computed from one tensor ``x`` and scalar constants, of which only the last
value ``y`` is read outside. It is rewritten only where it computes GELU: evaluated in float64 on
points from -5 to 5 with its own constants, it must be within 64 roundings of its dtype of the
GELU its transcendental names (tanh for ``Sigmoid``/``Tanh``, erf for ``Erf``; the constants of a
half-precision graph are rounded to its dtype). The kernel computes the same function; its values
differ from the nodes' by the rounding of a different sequence of operations (checked against a
float64 reference in ``tests/test_gelu_kernel.py``). Off by default: on the CPU, ONNX Runtime's
``FastGelu`` took longer than the element-wise nodes (``gradient/gelu.py``), and no GPU has
measured it.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ._graph import _Graph, _elem_types, _import_domain, _keep, _op, _op_types, _shared_constants

_BINARY = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Div": np.divide}
_UNARY = {"Neg": np.negative, "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "Tanh": np.tanh,
          "Erf": np.vectorize(math.erf)}
_TRANSCENDENTAL = {"Sigmoid": "FastGelu", "Tanh": "FastGelu", "Erf": "BiasGelu"}
_PROBE = np.linspace(-5.0, 5.0, 81)
_ROUNDING = {onnx.TensorProto.FLOAT: 2.0 ** -24, onnx.TensorProto.DOUBLE: 2.0 ** -53,
             onnx.TensorProto.FLOAT16: 2.0 ** -11, onnx.TensorProto.BFLOAT16: 2.0 ** -8}
_DOMAIN = "com.microsoft"


def _gelu(kernel: str, x: np.ndarray) -> np.ndarray:
    """GELU in float64, in forms without cancellation in the tails: ``x · σ(2u)`` for ½x(1 + tanh(u)),
    ``x · ½erfc(-x/√2)`` for ½x(1 + erf(x/√2))."""
    if kernel == "FastGelu":
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
        return x / (1.0 + np.exp(-2.0 * u))
    return x * 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2.0))


def _scalar(g: _Graph, name: str) -> float | None:
    value = g.const(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _elementwise_op(node: onnx.NodeProto, op_of: dict) -> str | None:
    """The element-wise operator ``node`` computes (a call of a one-node function counts as its body's), or None."""
    op = _op(node, op_of)
    return op if op in _BINARY or op in _UNARY else None


def _sources(g: _Graph, op_of: dict, name: str) -> set[str]:
    """The tensors (not scalar constants) that ``name`` is computed from through element-wise nodes."""
    found, stack, seen = set(), [name], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        node = g.producer.get(value)
        if node is not None and _elementwise_op(node, op_of):
            stack.extend(i for i in node.input if _scalar(g, i) is None)
        else:
            found.add(value)
    return found


def _region(g: _Graph, op_of: dict, x: str) -> tuple[list[onnx.NodeProto], str] | None:
    """The element-wise nodes computed from ``x`` and scalars, and the one value of them read
    elsewhere; None when there is not exactly one such value, or not one transcendental."""
    values, nodes, frontier = {x}, {}, [x]
    while frontier:
        for node in g.consumers.get(frontier.pop(), []):
            if id(node) in nodes or not _elementwise_op(node, op_of):
                continue
            if all(i in values or _scalar(g, i) is not None for i in node.input):
                nodes[id(node)] = node
                values.add(node.output[0])
                frontier.append(node.output[0])
    read_outside = [n.output[0] for n in nodes.values() if n.output[0] in g.outputs
                    or any(id(c) not in nodes for c in g.consumers.get(n.output[0], []))]
    if len(read_outside) != 1 or sum(_op(n, op_of) in _TRANSCENDENTAL for n in nodes.values()) != 1:
        return None
    return list(nodes.values()), read_outside[0]


def _evaluate(g: _Graph, op_of: dict, nodes: list[onnx.NodeProto], x: str, y: str) -> np.ndarray:
    """``y`` computed by ``nodes`` from ``x`` = the probe points, in float64 with their constants."""
    env, pending = {x: _PROBE}, list(nodes)
    while pending:  # in dependency order (the graph's order may interleave other nodes)
        node = next(n for n in pending if all(i in env or _scalar(g, i) is not None for i in n.input))
        pending.remove(node)
        args = [env[i] if i in env else _scalar(g, i) for i in node.input]
        op = _op(node, op_of)
        function = _BINARY.get(op) or _UNARY[op]
        with np.errstate(all="ignore"):
            env[node.output[0]] = np.asarray(function(*args), dtype=np.float64) * np.ones_like(_PROBE)
    return env[y]


def gelu_forward_kernel(model: onnx.ModelProto) -> int:
    """Replace each GELU forward region of a joint graph by one ``FastGelu`` or ``BiasGelu`` node (see
    the module docstring), in place; returns how many were replaced."""
    g, op_of = _Graph(model), _op_types(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    dead: set[int] = set()
    typed: dict[str, tuple] = {}  # y: (element type, shape)
    for node in model.graph.node:
        if _op(node, op_of) not in _TRANSCENDENTAL or id(node) in dead:
            continue
        sources = _sources(g, op_of, node.input[0])
        found = _region(g, op_of, next(iter(sources))) if len(sources) == 1 else None
        if found is None:
            continue
        x, (nodes, y) = next(iter(sources)), found
        kernel, rounding = _TRANSCENDENTAL[_op(node, op_of)], _ROUNDING.get(types.get(x))
        if rounding is None:
            continue
        # 64 roundings of the dtype: its constants' (A = 0.0713... is 2^-11 off in float16), the
        # float64 evaluation's, and room; QuickGELU's x·σ(1.702x) is 5x off at x = -3
        expected = _gelu(kernel, _PROBE)
        if not np.all(np.abs(_evaluate(g, op_of, nodes, x, y) - expected) <= 64 * rounding * (np.abs(expected) + 1e-4)):
            continue
        inputs = [x]
        if kernel == "BiasGelu":  # erf GELU of x + 0: ONNX Runtime's CUDA Gelu has no bfloat16 kernel, BiasGelu has
            width = (g.shapes.get(x) or [None])[-1]
            if not isinstance(width, int) or width <= 0:
                continue
            inputs.append(f"ort_trainer/gelu_kernel/zero_bias_{width}_{types[x]}")
            zeros = np.zeros(width, helper.tensor_dtype_to_np_dtype(types[x]))
            _shared_constants(g, initializers, [(inputs[1], zeros)])
        dead |= {id(n) for n in nodes}
        typed[y] = (types[x], g.shapes.get(x))  # for shape inference, which knows no com.microsoft schema
        # in place of the node that computed y: its readers follow it, x comes before it
        replaced[id(g.producer[y])] = [helper.make_node(kernel, inputs, [y], name=f"{y}/{kernel}", domain=_DOMAIN)]
    if not replaced:
        return 0
    _keep(model, dead, before=replaced)
    model.graph.initializer.extend(initializers.values())
    known = {v.name for v in model.graph.value_info}
    model.graph.value_info.extend(helper.make_tensor_value_info(y, elem_type, shape)
                                  for y, (elem_type, shape) in typed.items() if y not in known)
    _import_domain(model, _DOMAIN, 1)
    return len(replaced)


__all__ = ["gelu_forward_kernel"]

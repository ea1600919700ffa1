"""``torch_products``: the graph's matrix products run by torch's BLAS, inside ONNX Runtime.

ONNX Runtime's CUDA ``Gemm`` writes a bias into its output first (a broadcast kernel over the whole output) and then
calls cuBLAS with ``beta = 1``, which reads it back: a forward product with a bias moves its output three times
(GPT-2 small at 8 × 512 in float16: ~1.4 GB a step over its 48 biased products; BERT-base's profile on an H200
shows the broadcast among its longest kernels). torch's ``addmm`` hands a bias vector to cuBLASLt's epilogue, which
adds it as the product is stored. Here each float32, float16 or bfloat16 ``Gemm`` becomes an ``ort_trainer.torch``
``Gemm`` (no ``C``) or ``BiasGemm`` node with the same attributes, and each ``MatMul`` an ``ort_trainer.torch``
``MatMul``, whose ``transA`` / ``transB`` take a ``Transpose`` of an operand's last two axes in (torch reads the
transpose in place: ONNX Runtime folds such a ``Transpose`` into its own ``FusedMatMul``, which the custom node would
no longer get). The nodes keep their outputs' names, so the graph
around them is unchanged (``kernels/csrc/torch_ops.cc``; the same products, summed in torch's BLAS's order).

Under mixed precision a half weight gradient is widened for the float32 gradient buffer: a ``Cast`` to float32 reads
the product (a weight's, or a bias's column sum, through a ``Reshape``), a half tensor written and read back to be
written again in float32. A half ``Gemm`` (no ``C``) or ``MatMul`` that such a ``Cast`` alone reads becomes a
``GemmToFloat`` / ``MatMulToFloat`` node that writes float32 itself (cuBLAS's float32 output of half operands): the
half tensor and the ``Cast`` go (GPT-2 small: 100 nodes a step), and the gradient is the float32 sum, not rounded to
the half dtype on the way. Where the ``Cast`` reads the product through two ``Transpose`` nodes that undo each other
(BERT's every weight gradient: torch's ``t()`` of ``t()`` of the product), they go with it: 146 nodes and two copies
of each half weight gradient a step.

Last, the products read and write the ``[..., features]`` tensors that flattening ``Reshape`` nodes around them
viewed as 2-D, and those nodes go (``product_views.py``).

On the CPU torch's BLAS is MKL, whose products alone run faster than ONNX Runtime's MLAS on some processors and at
about half its speed on others (docs/performance.md), and whose threads contend with ONNX Runtime's inside a run:
GPT-2 small's CPU step is slower with the switch (docs/gpu.md). It is a lever for the GPU.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import TORCH_OPS_DOMAIN
from ._graph import (_Graph, _attrs, _elem_types, _import_domain, _is, _keep, _sole_consumer, _undone_pair,
                     _value_info_like)
from .product_views import product_views

_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def torch_products(model: onnx.ModelProto) -> int:
    """Rewrite each eligible product (module docstring) in place; returns how many."""
    g = _Graph(model)
    products = [n for n in model.graph.node if n.domain in ("", "ai.onnx") and n.op_type in ("Gemm", "MatMul")]
    types = _elem_types(model)
    if any(name not in types for node in products for name in node.output):  # (values passes made, untyped)
        types.update(_elem_types(onnx.shape_inference.infer_shapes(model)))
    count = 0
    for node in products:
        if types.get(node.output[0]) in _TYPES:
            node.CopyFrom(_gemm(node) if node.op_type == "Gemm" else _matmul(g, node))
            count += 1
    if count:
        _import_domain(model, TORCH_OPS_DOMAIN, 1)
        _widen(model, types)
        product_views(model)
    return count


def _widen(model: onnx.ModelProto, types: dict[str, int]) -> int:
    """Each half product of this domain (no ``C``) that a ``Cast`` to float32 alone reads, directly or through a
    ``Reshape`` only the ``Cast`` reads, or through two ``Transpose`` nodes that undo each other, as its ``...ToFloat``
    form writing float32 (the module docstring); returns how many."""
    g = _Graph(model)
    dead: set[int] = set()
    gone: set[str] = set()  # the half values that are no more
    widened = 0
    for node in model.graph.node:
        if (node.domain != TORCH_OPS_DOMAIN or node.op_type not in ("Gemm", "MatMul")
                or types.get(node.output[0]) not in _HALF):
            continue
        reader, reshape = _sole_consumer(g, node.output[0]), None
        if reader is not None and _is(reader, "Reshape") and reader.input[0] == node.output[0]:
            reshape, reader = reader, _sole_consumer(g, reader.output[0])
        pair = _undone_pair(g, node.output[0]) if reshape is None else None
        if pair is not None:  # (the product's values, in its layout)
            reader = _sole_consumer(g, pair[1].output[0])
        if reader is None or not _is(reader, "Cast") or _attrs(reader).get("to") != onnx.TensorProto.FLOAT:
            continue
        gone.add(node.output[0])
        if pair is not None:
            dead.update(id(transpose) for transpose in pair)
            gone.update(transpose.output[0] for transpose in pair)
        if reshape is None:
            node.output[0] = reader.output[0]
        else:  # the product's float32 output, then the Reshape (a view) writes what the Cast wrote
            wide = f"{node.output[0]}/float32"
            _value_info_like(model, node.output[0], wide)
            for info in model.graph.value_info:
                if info.name == wide:
                    info.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            gone.add(reshape.output[0])
            reshape.input[0], reshape.output[0] = wide, reader.output[0]
            node.output[0] = wide
        node.op_type += "ToFloat"
        dead.add(id(reader))
        widened += 1
    if dead:
        _keep(model, dead)
        kept = [info for info in model.graph.value_info if info.name not in gone]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return widened


def _gemm(node: onnx.NodeProto) -> onnx.NodeProto:
    attrs = _attrs(node)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    biased = len(node.input) > 2 and bool(node.input[2]) and beta != 0.0  # (beta 0: C is not read)
    return helper.make_node("BiasGemm" if biased else "Gemm", list(node.input[:3 if biased else 2]),
                            list(node.output), name=node.name, domain=TORCH_OPS_DOMAIN,
                            transA=int(attrs.get("transA", 0)), transB=int(attrs.get("transB", 0)),
                            alpha=alpha, beta=beta)


def _matmul(g: _Graph, node: onnx.NodeProto) -> onnx.NodeProto:
    operands, transposed = [], []
    for name in node.input:
        source, swapped = _last_axes_swapped(g, name)
        operands.append(source)
        transposed.append(int(swapped))
    return helper.make_node("MatMul", operands, list(node.output), name=node.name, domain=TORCH_OPS_DOMAIN,
                            transA=transposed[0], transB=transposed[1])


def _last_axes_swapped(g: _Graph, name: str) -> tuple[str, bool]:
    """``(x, True)`` where ``name`` is a ``Transpose`` of ``x`` that swaps the last two axes alone, else
    ``(name, False)``."""
    producer = g.producer.get(name)
    if producer is None or not _is(producer, "Transpose"):
        return name, False
    perm = list(_attrs(producer).get("perm", []))
    if not perm and len(g.shapes.get(producer.input[0]) or ()) == 2:
        perm = [1, 0]  # (no perm: the axes reversed)
    rank = len(perm)
    if rank < 2 or perm != [*range(rank - 2), rank - 1, rank - 2]:
        return name, False
    return producer.input[0], True


__all__ = ["torch_products"]

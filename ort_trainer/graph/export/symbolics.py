"""ONNX translations the TorchScript exporter lacks, registered for the ``onnxruntime`` route's export only.

``torch.diff`` (``aten::diff``) has none at any opset, and Hugging Face's masking code calls it on the
position ids whenever a decoder runs without a key/value cache (``use_cache=False``, which gradient
checkpointing sets): ``find_packed_sequence_indices``. It is the difference of two slices along the dim,
``n`` times, after ``prepend`` and ``append`` are concatenated; ONNX Runtime's gradient builder
differentiates ``Slice``, ``Concat`` and ``Sub``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.onnx import symbolic_helper

_LAST = 2**63 - 1  # Slice's end for "to the end"


@symbolic_helper.parse_args("v", "i", "i", "v", "v")
def _diff(g, values, n, dim, prepend, append):
    pieces = [p for p in (prepend, values, append) if not symbolic_helper._is_none(p)]
    if len(pieces) > 1:
        values = g.op("Concat", *pieces, axis_i=dim)
    for _ in range(n):
        later = symbolic_helper._slice_helper(g, values, axes=[dim], starts=[1], ends=[_LAST])
        earlier = symbolic_helper._slice_helper(g, values, axes=[dim], starts=[0], ends=[-1])
        values = g.op("Sub", later, earlier)
    return values


_SYMBOLICS = {"aten::diff": _diff}


@contextlib.contextmanager
def registered(opset: int) -> Iterator[None]:
    """Within: the translations of ``_SYMBOLICS`` at ``opset``, each taken out again afterwards."""
    for name, function in _SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, function, opset)
    try:
        yield
    finally:
        for name in _SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


__all__ = ["registered"]

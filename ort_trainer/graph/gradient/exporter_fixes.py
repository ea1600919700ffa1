"""Translations that replace torchlib's where its own translate an operator wrongly, or where it has none.

``aten.copy(self, src)`` is what ``torch.export``'s functionalization makes of an assignment into a
view, ``x[:, 0] = 2`` or ``x[:] = row``: the value of ``self`` with ``src`` written into it, ``src``
cast to ``self``'s dtype and broadcast to its shape. torchlib translates it as ``CastLike(src, self)``
alone, so a ``src`` of another shape keeps its own: the scalar of ``shifted[:, 0] = start_token``
(Hugging Face's ``shift_tokens_right``, how BART, T5 and the other encoder-decoder models make their
decoder's inputs from the labels) stays a scalar where the program says ``[batch]``, and the build
stopped in ONNX's shape inference ("Inferred shape and existing shape differ in rank"); a ``[1]`` that
the next node happens to broadcast gave the right values by chance. ``copy`` here broadcasts
``src`` to ``self``'s shape (an ``Expand`` to ``Shape(self)``) unless the two shapes are known equal.

``aten.masked_select(self, mask)`` has no translation: it is ``Compress`` of both broadcast and flattened, as
many values as the mask has ``True`` elements (a loss over the values a mask keeps; before autograd the
training program indexes instead, ``before_autograd._masked_selects_as_indexes``).
"""

from __future__ import annotations

import torch


def _same_shape(a, b) -> bool:
    """Whether two traced ONNX values are known to have the same shape (dims equal, symbolic dims by name)."""
    return a.shape is not None and b.shape is not None and a.shape == b.shape


def register_translations(registry) -> None:
    """Put this module's translations before torchlib's in the exporter's registry (``joint_onnx``)."""
    from onnxscript.onnx_opset import opset18 as op

    def copy_onnx(self, src, non_blocking: bool = False):
        cast = op.CastLike(src, self)
        return cast if _same_shape(src, self) else op.Expand(cast, op.Shape(self))

    registry.register_op(torch.ops.aten.copy.default, copy_onnx)

    def masked_select_onnx(self, mask):
        values, keep = op.Expand(self, op.Shape(mask)), op.Expand(mask, op.Shape(self))  # broadcast both
        return op.Compress(op.Reshape(values, op.Constant(value_ints=[-1])),
                           op.Reshape(keep, op.Constant(value_ints=[-1])))

    registry.register_op(torch.ops.aten.masked_select.default, masked_select_onnx)


__all__ = ["register_translations"]

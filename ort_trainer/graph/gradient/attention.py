"""The ``half_precision_attention`` pass of the torch-autograd gradient source: under mixed
precision, ``scaled_dot_product_attention`` computed in the half dtype, not upcast to float32.

The trace takes the math attention (``joint_onnx``: the CPU flash kernel's backward has no ONNX
translation), and ``at::_scaled_dot_product_attention_math`` casts float16/bfloat16 queries, keys
and values to float32 "for accuracy" and its result back: every ``[B, H, S, S]`` tensor of the
attention (scores, mask added, softmax, its guard, and their gradients) is float32 and its two
products per direction are float32 GEMMs. On an H100 that made GPT-2 small's float16 step 0.67×
autocast's (float32 ``sm80_xmma_gemm_f32`` products and float32 element-wise passes over the
scores; the profile is in commit 6f68135), where eager runs one fused half-precision kernel.

``half_precision`` makes each such call (before autograd, on the ``torch.export`` program)
compute what the math attention computes, in the inputs' dtype, as the attention written out in
Python computes under autocast::

    scores = (q · √scale) @ (k · √scale)ᵀ + mask     # float16 products, float32 accumulation
    out = dropout(_safe_softmax(scores)) @ v

The boolean mask becomes ``0`` / ``-inf`` in the half dtype, as the math attention makes it; a
float mask is added in the half dtype, so float32's lowest value becomes ``-inf`` there and a row it
masks entirely gives zeros, as a row of ``-inf`` does (the math attention averages such a row);
``is_causal`` is a lower-triangular boolean mask; ``enable_gqa`` repeats the keys' and values'
heads. Autograd then differentiates these operators as for any written-out attention (its softmax
backward is computed in float32 and rounded once: torch's decomposition of
``_softmax_backward_data``). The rounding this adds is float16's (2⁻¹¹ relative per stored score
and probability), what PyTorch's own float16 attention kernels store between their products.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from .fx_nodes import rewrite_graphs

logger = logging.getLogger(__name__)
_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def half_precision(program: Any) -> int:
    """Compute every half-precision ``scaled_dot_product_attention`` of ``program`` in its dtype, in place.

    A call is rewritten when its query is float16 or bfloat16 (the model traced under autocast,
    or in half precision); float32 and float64 calls are left to the math attention. Calls inside
    the program's submodules (the regions ``torch.export`` traced under autocast) are found too.

    Args:
        program: a ``torch.export`` program before autograd (``autograd.trace``), or the eval-mode
            program before its decomposition.

    Returns:
        How many calls were rewritten.
    """
    count = retarget(program, _is_half, attention)
    if count:
        logger.debug("half_precision_attention: %d attention call(s) computed in half precision", count)
    return count


def _is_half(node: torch.fx.Node) -> bool:
    query = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(query, torch.Tensor) and query.dtype in _HALF


def retarget(program: Any, accept: Callable[[torch.fx.Node], bool], target: Callable) -> int:
    """Have each ``scaled_dot_product_attention`` call of ``program`` (its submodules', the regions ``torch.export``
    traced under autocast, too) that ``accept(node)`` takes compute ``target`` (same arguments), in place; returns
    how many. The joint trace then traces ``target``'s operators."""
    def retarget_calls(graph: torch.fx.Graph) -> int:
        found = 0
        for node in graph.nodes:
            if node.op == "call_function" and node.target is _aten.scaled_dot_product_attention.default \
                    and accept(node):
                node.target = target
                found += 1
        return found

    return rewrite_graphs(program, retarget_calls)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask as what is added to the scores, in ``dtype``: a boolean one as ``0`` where it keeps and
    ``-inf`` where it masks (as the math attention makes it), a float one cast."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                           torch.full((), -math.inf, dtype=dtype, device=mask.device))
    return mask.to(dtype)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as the math attention computes it, in the inputs' dtype.

    Arguments as ``torch.nn.functional.scaled_dot_product_attention``'s. The query and key are each
    scaled by ``√scale`` before their product (as the math attention does, so the scores stay in
    range); rows of the scores that are entirely ``-inf`` give zeros (``_safe_softmax``).
    """
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    root = math.sqrt(scale)
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    scores = (query * root) @ (key * root).transpose(-2, -1)
    if attn_mask is not None:
        scores = scores + additive_mask(attn_mask, scores.dtype)
    weights = _aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, dropout_p, training=True)
    return weights @ value


__all__ = ["additive_mask", "attention", "half_precision", "retarget"]

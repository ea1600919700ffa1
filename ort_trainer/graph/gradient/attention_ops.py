"""The ``fused_attention`` pass of the torch-autograd gradient source: each ``scaled_dot_product_attention`` as one
fused attention node forward and one backward, torch's own attention kernels run inside ONNX Runtime
(``kernels/torch_ops.py``), where the trace spells it out as the math attention (two products, the mask added, a
safe softmax, and their gradients: each a pass over a ``[batch, heads, seq_q, seq_k]`` tensor).

``fused_attention`` (before autograd, on the ``torch.export`` program and the autocast regions in it) has each
eligible call compute ``ort_trainer::attention(q, k, v, bias, scale, causal)``, whose registered autograd is
``ort_trainer::attention_grad``; the exporter translates them into ``Attention`` / ``BiasAttention`` and
``AttentionGrad`` / ``BiasAttentionGrad`` nodes of the domain ``torch_ops.DOMAIN``. A call is eligible where q, k
and v are 4-D of one dtype (float32, float16, bfloat16), q's heads are k's (no grouped-query repeat) and it draws
no dropout (``dropout_p`` 0, as in evaluation or a model configured without attention dropout); a boolean mask
becomes ``0`` / ``-inf`` in q's dtype (as the math attention makes it), a float mask is added in q's dtype. A mask
that is trained (computed from a weight) gets its gradient from torch's arithmetic over the recomputed
probabilities (``[batch, heads, seq_q, seq_k]`` again: that case only).

The operators' torch implementations (what an eager call and the exporter's fake values see) compute the attention
in float32 and round once, as torch's fused kernels do.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...kernels import TORCH_OPS_DOMAIN as DOMAIN
from . import onnx_schemas
from .attention import additive_mask, retarget

_aten = torch.ops.aten
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _scores(q, k, bias, scale: float, causal: bool) -> torch.Tensor:
    """The float32 scores q·kᵀ·scale + bias, -inf above the diagonal where causal (torch's top-left alignment)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse), zeros on a row of only -inf (whose lse is -inf)."""
    return torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)


@torch.library.custom_op("ort_trainer::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale + bias) · v over [batch, heads, seq, dim] (rows of only -inf give zeros) in float32,
    rounded once to q's dtype, and each row's log-sum-exp of the scores (float32 [batch, heads, seq_q])."""
    scores = _scores(q, k, bias, scale, causal)
    lse = torch.logsumexp(scores, -1)
    return (_probabilities(scores, lse) @ v.float()).to(q.dtype), lse


@attention.register_fake
def _attention_fake(q, k, v, bias, scale, causal):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("ort_trainer::attention_grad", mutates_args=())
def attention_grad(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, lse: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention``'s gradients (dq, dk, dv) from its out and lse, in float32, rounded once to the dtype."""
    probabilities = _probabilities(_scores(q, k, bias, scale, causal), lse)
    ds = _score_gradient(dout, v, out, probabilities)
    dv = probabilities.transpose(-2, -1) @ dout.float()
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-2, -1) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@attention_grad.register_fake
def _attention_grad_fake(dout, q, k, v, bias, out, lse, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _score_gradient(dout, v, out, probabilities: torch.Tensor) -> torch.Tensor:
    """The gradient of the scores (float32 [batch, heads, seq_q, seq_k]) from the probabilities P:
    P · (dP - rowsum(dout · out))."""
    dp = dout.float() @ v.float().transpose(-2, -1)
    return probabilities * (dp - (dout.float() * out.float()).sum(-1, keepdim=True))


def _setup(ctx, inputs, output):
    q, k, v, bias, scale, causal = inputs
    ctx.save_for_backward(q, k, v, bias, output[0], output[1])
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.ort_trainer.attention_grad(dout, q, k, v, bias, out, lse, ctx.scale, ctx.causal)
    dbias = None
    if bias is not None and ctx.needs_input_grad[3]:  # a trained bias: torch's arithmetic, [seq_q, seq_k] again
        ds = _score_gradient(dout, v, out, _probabilities(_scores(q, k, bias, ctx.scale, ctx.causal), lse))
        dims = [i for i in range(ds.dim()) if i < ds.dim() - bias.dim() or bias.size(i - ds.dim() + bias.dim()) == 1]
        dbias = ds.sum(dims, keepdim=True).reshape(bias.shape).to(bias.dtype)
    return dq, dk, dv, dbias, None, None


attention.register_autograd(_backward, setup_context=_setup)


def fused(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
          enable_gqa: bool = False):
    """``scaled_dot_product_attention`` as ``ort_trainer::attention`` (what an eligible call computes once
    ``fused_attention`` retargeted it): a boolean mask as ``0`` / ``-inf`` in q's dtype, a float one in q's dtype."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    bias = None if attn_mask is None else additive_mask(attn_mask, query.dtype)
    return torch.ops.ort_trainer.attention(query, key, value, bias, float(scale), bool(is_causal))[0]


def _eligible(node: torch.fx.Node) -> bool:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    tensors = [values[n].meta.get("val") if isinstance(values.get(n), torch.fx.Node) else None for n in names[:3]]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype != tensors[0].dtype for t in tensors):
        return False
    q, k, _ = tensors
    return (q.dtype in KERNEL_DTYPES and values.get("dropout_p", 0.0) == 0.0
            and not isinstance(values.get("dropout_p", 0.0), torch.fx.Node)
            and (not values.get("enable_gqa", False) or q.shape[1] == k.shape[1])
            and not isinstance(values.get("is_causal", False), torch.fx.Node)
            and not isinstance(values.get("scale"), torch.fx.Node))


def fused_attention(program: Any) -> int:
    """Retarget each eligible ``scaled_dot_product_attention`` of ``program`` (its submodules too) to ``fused``, in
    place (module docstring); returns how many."""
    return retarget(program, _eligible, fused)


# each operator's ONNX inputs, outputs and attributes; T: q's dtype, U: float32. Attributes: scale (float), causal,
# layout (1: [batch, seq, heads, dim] tensors, graph/passes/attention_layout.py)
_ATTRIBUTES = ("scale", "causal", "layout")
_SCHEMAS = {
    "Attention": ([("q", "T"), ("k", "T"), ("v", "T")], [("out", "T"), ("lse", "U")], _ATTRIBUTES),
    "BiasAttention": ([("q", "T"), ("k", "T"), ("v", "T"), ("bias", "T")], [("out", "T"), ("lse", "U")],
                      _ATTRIBUTES),
    "AttentionGrad": ([("dout", "T"), ("q", "T"), ("k", "T"), ("v", "T"), ("out", "T"), ("lse", "U")],
                      [("dq", "T"), ("dk", "T"), ("dv", "T")], _ATTRIBUTES),
    "BiasAttentionGrad": ([("dout", "T"), ("q", "T"), ("k", "T"), ("v", "T"), ("bias", "T"), ("out", "T"),
                           ("lse", "U")], [("dq", "T"), ("dk", "T"), ("dv", "T")], _ATTRIBUTES),
}
_TYPES = {"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "U": ["tensor(float)"]}


def _register_schemas() -> None:
    """ONNX schemas of the operators (what onnxscript reads to emit their nodes), once per process."""
    import onnx

    onnx_schemas.register(DOMAIN, 1, "ort_trainer's torch operators", _SCHEMAS, _TYPES,
                          {"scale": onnx.defs.OpSchema.AttrType.FLOAT})


def register_translations(registry) -> None:
    """Add the translations of ``attention`` and ``attention_grad`` to the exporter's registry (``joint_onnx``)."""
    import onnxscript

    _register_schemas()
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def attention_onnx(q, k, v, bias=None, scale: float = 1.0, causal: bool = False):
        if bias is None:
            out, lse = opset.Attention(q, k, v, scale=scale, causal=int(causal))
        else:
            out, lse = opset.BiasAttention(q, k, v, bias, scale=scale, causal=int(causal))
        return out, lse

    def attention_grad_onnx(dout, q, k, v, bias, out, lse, scale: float = 1.0, causal: bool = False):
        if bias is None:
            dq, dk, dv = opset.AttentionGrad(dout, q, k, v, out, lse, scale=scale, causal=int(causal))
        else:
            dq, dk, dv = opset.BiasAttentionGrad(dout, q, k, v, bias, out, lse, scale=scale, causal=int(causal))
        return dq, dk, dv

    registry.register_op(torch.ops.ort_trainer.attention.default, attention_onnx)
    registry.register_op(torch.ops.ort_trainer.attention_grad.default, attention_grad_onnx)


__all__ = ["attention", "attention_grad", "fused_attention", "register_translations"]

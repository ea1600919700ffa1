"""Graph passes: rewrites of a graph into one that computes the same values with fewer passes
over memory (and, for a few, the semantics PyTorch needs: ``padding_idx``, Dropout masks).

Each pass has a name under ``graph_optimizations`` and is checked against float64 PyTorch
(``tests/test_rewrites.py``, ``tests/test_joint_passes.py``). By the graph they act on:

- the forward graph of the ``"onnxruntime"`` source, before ONNX Runtime differentiates it:
  ``forward.py`` (``FORWARD_PASSES``, ``GRADIENT_PASSES``), ``trainable.py`` (the optional outputs
  the gradient builder reads), ``buffers.py`` (BatchNorm's running statistics as outputs);
- the joint forward + backward graph of the ``"torch"`` source (``JOINT_PASSES``, run by
  ``apply_joint_passes``): ``joint.py`` (cross-entropy backward, identity transposes, integer
  powers and pads), ``embedding.py`` (small tables' gradients), ``tied_embedding.py`` (a tied table's
  gradient written in place), ``dropout.py``, ``copies.py`` (tensor sequences, output reshapes,
  column sums, half-precision bias gradients), ``softmax.py`` (masked softmax, a float16 softmax's
  gradient), ``loss.py`` (a mixed-precision cross-entropy in the half dtype), ``recompute.py``
  (2-D transposes folded into Gemm, then activations' values recomputed in the backward; they read
  the others' graph), ``layer_recompute.py`` (each sublayer recomputed from its LayerNorm's input, before
  ``activation_recompute``), ``attention_layout.py`` (``fused_attention``'s nodes on the heads as the projections
  lay them), ``packed_attention.py`` (those nodes on q, k and v packed in one projection's output),
  ``causal_attention.py`` (their causal mask computed in the kernel), ``attention_backend.py`` (on CUDA, the kernel
  torch would pick), ``aligned.py`` (products on operands padded to aligned widths), ``gradient_sums.py`` (a
  float32 sum of a half gradient in one kernel node), ``layer_norm_sums.py`` (a LayerNorm's gradient added into the
  residual's in its kernel, ``fused_layer_norm_gradient``'s joint part), ``layer_norm_forward.py`` (a LayerNorm
  that writes its half output itself), ``order.py`` (the loss pieces' backward early), ``torch_products.py``
  (every product by torch's BLAS; after the others but one: they read ONNX's ``Gemm`` and ``MatMul``),
  ``weight_casts.py`` (the weights' half copies in one kernel node; last: the passes before it read their ``Cast``
  nodes and ``aligned_products``' pads);
- the eval graph of the ``"torch"`` source (``EVAL_PASSES``, ``apply_eval_passes``): those of the
  above that act on a forward graph, with ``forward.cross_entropy_forward`` for ``cross_entropy``
  (the translation writes ``F.cross_entropy`` as one ``SoftmaxCrossEntropyLoss``, which ONNX
  Runtime runs as its ONNX function body: 80-85 ms against 3-4 ms for ``LogSoftmax`` and a gather
  on 1024 x 8000 scores), ``loss.half_precision_loss`` (its forward half) and ``copies.erf_gelu_order``
  for ``gelu``.

``_graph.py`` holds what they share (``_Graph``: producers, consumers, constants, shapes). The
passes know ONNX and the graphs' naming conventions (``graph/names.py``) only: the gradient
sources call them, never the other way round.
"""

from __future__ import annotations

import onnx

from ..onnx_graph import dangling_names, drop_dead_nodes
from . import (aligned, attention_backend, attention_layout, causal_attention, copies, dropout, embedding, forward,
               gelu_kernel, gradient_sums, layer_norm_forward, layer_norm_sums, layer_recompute, loss, order,
               packed_attention, recompute, softmax, tied_embedding, torch_products, weight_casts)
from .joint import cross_entropy_backward, identity_transposes, integer_pads, integer_powers


def _embedding_gradient(graph: onnx.ModelProto) -> int:
    return identity_transposes(graph) + embedding.small_table_gradients(graph)


# the joint graph's passes, in the order they run; their names are the ``graph_optimizations`` switches
_JOINT = (
    ("cross_entropy", cross_entropy_backward), ("embedding_gradient", _embedding_gradient),
    ("tied_embedding_gradient", tied_embedding.tied_embedding_gradients),
    ("integer_powers", integer_powers), ("integer_pads", integer_pads),
    ("host_dropout_masks", dropout.host_dropout_masks),
    ("dropout_gradient", dropout.dropout_gradient),
    ("sequences", copies.sequence_reads), ("output_reshape", copies.output_reshapes),
    ("safe_softmax", softmax.safe_softmax), ("half_precision_softmax_gradient", softmax.half_precision_gradient),
    ("bfloat16_softmax_gradient", softmax.bfloat16_gradient),
    ("half_precision_loss", loss.half_precision_loss),
    ("half_precision_bias_gradient", copies.half_column_sums), ("column_sums", copies.column_sums),
    ("transposed_products", recompute.transposed_products),
    ("half_precision_transposed_products", recompute.half_transposed_products),
    ("seeded_dropout", dropout.seeded_dropout),
    ("layer_recompute", layer_recompute.layer_recompute), ("activation_recompute", recompute.activation_recompute),
    ("gelu_forward_kernel", gelu_kernel.gelu_forward_kernel), ("fused_attention", attention_layout.attention_layout),
    ("packed_attention", packed_attention.packed_attention), ("causal_attention", causal_attention.causal_attention),
    ("torch_attention_choice", attention_backend.torch_attention_choice),
    ("aligned_products", aligned.aligned_products), ("fused_gradient_sums", gradient_sums.fused_gradient_sums),
    ("fused_layer_norm_gradient", layer_norm_sums.layer_norm_residual_sums),
    ("fused_layer_norm", layer_norm_forward.fused_layer_norm),
    ("loss_pieces", order.piece_gradients_early), ("torch_products", torch_products.torch_products),
    ("weight_casts", weight_casts.weight_casts), ("device_barriers", recompute.device_barriers))
JOINT_PASSES = tuple(name for name, _ in _JOINT)
# the eval graph's: those that act on a forward graph
_EVAL = (("cross_entropy", forward.cross_entropy_forward), ("half_precision_loss", loss.half_precision_loss),
         ("integer_pads", integer_pads),
         ("sequences", copies.sequence_reads),
         ("output_reshape", copies.output_reshapes), ("safe_softmax", softmax.safe_softmax),
         ("gelu", copies.erf_gelu_order))
EVAL_PASSES = tuple(name for name, _ in _EVAL)


def apply_joint_passes(model: onnx.ModelProto, enabled: dict[str, bool]) -> dict[str, int]:
    """Run the enabled passes on a joint graph in place.

    Args:
        model: a gradient graph of the ``"torch"`` source (``gradient/autograd.py``'s ``build``).
        enabled: ``{pass name: on}`` (``graph_optimizations``); missing names are off.

    Returns:
        ``{pass name: nodes rewritten}`` of the passes that ran.
    """
    return _run_passes(model, enabled, _JOINT)


def apply_eval_passes(model: onnx.ModelProto, enabled: dict[str, bool]) -> dict[str, int]:
    """Run the enabled passes that act on a forward graph (``EVAL_PASSES``) on an eval graph in place.

    Args:
        model: an eval graph of the ``"torch"`` source (``gradient/autograd.py``'s ``build_eval``).
        enabled: ``{pass name: on}`` (``graph_optimizations``); missing names are off.

    Returns:
        ``{pass name: nodes rewritten}`` of the passes that ran.
    """
    if not any(enabled.get(name) for name in EVAL_PASSES):
        return {}
    # the passes read shapes and types, which the translation gives only some values of here
    known = {info.name for info in model.graph.value_info}
    model.graph.value_info.extend(info for info in onnx.shape_inference.infer_shapes(model).graph.value_info
                                  if info.name not in known)
    return _run_passes(model, enabled, _EVAL)


def _run_passes(model: onnx.ModelProto, enabled: dict[str, bool], passes) -> dict[str, int]:
    """``{name: run(model)}`` for each ``(name, run)`` of ``passes`` that ``enabled`` turns on, in order.

    Raises:
        RuntimeError: a pass left a node before what defines its inputs (a bug of that pass: ONNX
            Runtime may still run such a graph, but the graph cache refuses it, so every later
            process would rebuild it), naming the pass and the switch that turns it off.
    """
    counts = {}
    for name, run in passes:
        if enabled.get(name):
            counts[name] = run(model)
            problems = dangling_names(model.graph) if counts[name] else []
            if problems:
                raise RuntimeError(
                    f"ort_trainer's graph pass {name!r} wrote a graph out of order ({len(problems)} problem(s): "
                    f"{'; '.join(problems[:3])}); please report it. To go on, turn it off: "
                    f"options={{'graph_optimizations': {{'{name}': False}}}}")
    if any(counts.values()):
        drop_dead_nodes(model)  # what a pass left unread (ONNX Runtime would run it, or fold it when made)
    return counts


__all__ = ["EVAL_PASSES", "JOINT_PASSES", "apply_eval_passes", "apply_joint_passes"]

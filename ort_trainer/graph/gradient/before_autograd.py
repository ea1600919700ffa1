"""Operators written out before autograd differentiates the training program, where the exporter
translates the operator but not its backward.

``grid_sample``'s backward (``aten.grid_sampler_2d_backward``) has no translation and no torch
decomposition, nor has ``replication_pad1d_backward`` (and its 2-d and 3-d twins: ``F.pad``'s
``"replicate"`` mode). Their forwards have decompositions (indexing at computed or clamped
positions, ``floor``, ``where`` and products: what ``torch.compile`` runs), whose operators the
exporter translates and autograd differentiates: the input's gradient is then an ``index_put`` that
adds (a scatter-add), the grid's that of the interpolation weights. So each such forward node is
replaced by its decomposition, traced on its operands' fake values (``eval_program._decomposition``),
before the joint trace; a node whose decomposition fails is left as it is (the build then names the
backward operator and the module whose backward uses it).

In nearest mode the grid reaches the output only through rounded integer positions, where the
kernel's backward gives the grid a zero gradient: a zero that reads the grid (a ``where`` that picks
none of it) is added to the output, so that the weights before the grid get zeros, as in PyTorch,
rather than no gradient. The reflection padding's decomposition counts its reflections in int8,
which ONNX Runtime 1.19.2 cannot compare (no int8 ``Equal``): they are counted in int64, as the
kernel counts them in an ``int``. Weight normalisation (``nn.utils.parametrizations.weight_norm``: wav2vec2's
positional convolution, HuBERT's, vocoders') is its norm and products too, its fused backward
(``_weight_norm_interface_backward``) having no translation. ``nn.EmbeddingBag`` (whose backward has no
translation) is an embedding and a sum, mean or maximum into each bag. ``masked_select`` is the boolean index of
its broadcast operands, whose backward keeps a symbolic batch (``masked_select``'s reads it as an int).

``F.multilabel_margin_loss`` is ATen's kernel's arithmetic (``backward_decompositions``): autograd would otherwise
trace torch's own decomposition, which adds the terms of a target's entries after its first -1 too.

``searchsorted`` (no translation) counts the sorted values below each value; ``index_reduce`` (no translation)
is the ``scatter_reduce`` it is, its index spread over the source's other dims.

Global average pooling (``adaptive_avg_pool1d/2d/3d`` to one element a channel) becomes the ``mean``
over the pooled dims it is. ATen's composite computes that mean and then restrides it (``as_strided_``)
where the input's layout looks channels-last, as an ``AdaptiveAvgPool1d`` of a transposed ``[batch, seq,
channels]`` tensor does (Swin's pooler); that restriding's backward is an ``as_strided_scatter``, which
the exporter cannot translate. In ONNX, where tensors have no strides, the mean is all that counts.

An in-place change of an output its backward reads (a softmax's, inside a Function taken for its forward) is
taken out of place (``out_of_place.py``).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch

from ..._logging import logger
from .backward_decompositions import EMBEDDING_BAGS, WRITTEN_OUT, embedding_bag
from .eval_program import _decomposition, _inline, bags_alone
from .fx_nodes import rewrite_graphs
from .joint_onnx import _registry_and_tables
from .out_of_place import out_of_place

_aten = torch.ops.aten
# the decompositions that write the operators out (``grid_sampler`` and ``pad``, which ``torch.export``
# keeps, dispatch to these)
_DECOMPOSED = (_aten.grid_sampler_2d.default, _aten.replication_pad1d.default, _aten.replication_pad2d.default,
               _aten.replication_pad3d.default)
_GRID_SAMPLERS = (_aten.grid_sampler.default, _aten.grid_sampler_2d.default)
BEFORE_AUTOGRAD = (_aten.grid_sampler.default, _aten.pad.default, _aten._weight_norm.default, *EMBEDDING_BAGS,
                   *_DECOMPOSED, *WRITTEN_OUT)
_PERMUTES = (_aten.permute.default, _aten.transpose.int, _aten.t.default)
_GLOBAL_POOLS = {_aten.adaptive_avg_pool1d.default: 1, _aten.adaptive_avg_pool2d.default: 2,
                 _aten.adaptive_avg_pool3d.default: 3}  # operator: pooled dims


def _written_out(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in BEFORE_AUTOGRAD:
        return False
    if node.target is _aten.pad.default:  # replicate mode only (reflect and circular have translated backwards)
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        return mode == "replicate"
    if node.target in EMBEDDING_BAGS:  # the bags alone: the other outputs (offset2bag...) are torch's bookkeeping
        return bags_alone(node)
    return True


def decompose(program: Any) -> int:
    """Replace each node of ``program`` (a ``torch.export`` program before autograd, submodules
    included) whose operator is in ``BEFORE_AUTOGRAD`` by its decomposition, in place.

    Returns:
        How many nodes were replaced.
    """
    count = (rewrite_graphs(program, _write_out) + rewrite_graphs(program, _global_pools_as_means)
             + rewrite_graphs(program, _masked_selects_as_indexes) + rewrite_graphs(program, out_of_place)
             + rewrite_graphs(program, _views_of_permutes_as_reshapes))
    if count:
        logger.debug("before autograd: %d node(s) decomposed (their backward has no translation)", count)
    return count


def _write_out(graph: torch.fx.Graph) -> int:
    found, table = 0, None
    for node in [n for n in graph.nodes if _written_out(n)]:
        table = table or _table()
        traced = _decomposition(node, table, _function(node))
        if traced is None:
            continue
        _widen_int8(traced, node)
        _inline(graph, node, traced)
        found += 1
    return found


def _views_of_permutes_as_reshapes(graph: torch.fx.Graph) -> int:
    """Each ``view`` of a ``permute`` or ``transpose`` of ``graph`` as a ``reshape`` (the same values: the program
    mutates nothing), in place; returns how many. torch 2.11's export drops the ``contiguous()`` between them where
    a symbolic size left the permuted tensor's layout undecided (``F.multi_head_attention_forward`` of a batch-first
    ``nn.TransformerEncoderLayer``), and the joint trace's view of the real strides then failed."""
    found = 0
    for node in graph.nodes:
        source = node.args[0] if node.op == "call_function" and node.target is _aten.view.default else None
        if isinstance(source, torch.fx.Node) and source.target in _PERMUTES:
            node.target = _aten.reshape.default
            found += 1
    return found


def _global_pools_as_means(graph: torch.fx.Graph) -> int:
    """Each adaptive average pool of ``graph`` to one element a channel as the mean over its pooled dims
    (kept), in place; returns how many."""
    found = 0
    for node in graph.nodes:
        dims = _GLOBAL_POOLS.get(node.target) if node.op == "call_function" else None
        if dims and len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
                and all(size == 1 for size in node.args[1]):
            node.target = _aten.mean.dim
            node.args = (node.args[0], list(range(-dims, 0)), True)
            found += 1
    return found


def _masked_selects_as_indexes(graph: torch.fx.Graph) -> int:
    """Each ``masked_select`` of ``graph`` as the boolean index of its operands broadcast, in place; returns
    how many. The index keeps the node's value (its size unknown until run) and whatever reads it."""
    from torch._guards import detect_fake_mode

    found = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.masked_select.default]:
        operands = [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args]
        if len(operands) != 2 or not all(isinstance(v, torch.Tensor) for v in operands):
            continue
        with detect_fake_mode(operands) or contextlib.nullcontext():
            broadcast = torch.broadcast_tensors(*operands)
        with graph.inserting_before(node):
            both = graph.call_function(_aten.broadcast_tensors.default, (list(node.args),))
            values, mask = (graph.call_function(operator.getitem, (both, i)) for i in range(2))
            # a mask of its own: torch counts a mask's elements once and reuses the count for the same mask
            # indexed again (``h[keep]`` beside ``masked_select(h, keep)``), where this node's size is a new one
            own_mask = graph.call_function(_aten.clone.default, (mask,))
            index = graph.call_function(_aten.index.Tensor, (values, [own_mask]))
        both.meta["val"] = list(broadcast)
        values.meta["val"], mask.meta["val"] = broadcast
        own_mask.meta["val"] = broadcast[1]
        index.meta.update(node.meta)
        node.replace_all_uses_with(index)
        graph.erase_node(node)
        found += 1
    return found


def _function(node: torch.fx.Node):
    """What ``node`` is written out as where it is not its operator's decomposition in ``_table()``."""
    if node.target in _GRID_SAMPLERS and len(node.args) > 2 and node.args[2] == 1:  # nearest mode
        return _with_zero_grid_gradient(node.target)
    if node.target is _aten._weight_norm.default:
        return _weight_norm
    if node.target in EMBEDDING_BAGS:
        return embedding_bag
    return WRITTEN_OUT.get(node.target)


def _weight_norm(v, g, dim=0):
    """``aten._weight_norm`` (``nn.utils.parametrizations.weight_norm``): ``v · g / ‖v‖``, the norm over every dim
    but ``dim``, as torch's decomposition of the fused ``_weight_norm_interface`` computes it."""
    from torch._decomp import decomposition_table

    return decomposition_table[_aten._weight_norm_interface.default](v, g, dim)[0]


def _table() -> dict:
    """The exporter's decomposition table with torch's decompositions of ``_DECOMPOSED``."""
    from torch._decomp import decomposition_table

    return {**_registry_and_tables()[1], **{op: decomposition_table[op] for op in _DECOMPOSED}}


def _with_zero_grid_gradient(op):
    """``op`` (a grid sampler) with a zero added that autograd differentiates to a zero gradient of
    the grid (NaN and infinite grid values included)."""

    def sample(input, grid, *args):
        zero = torch.where(torch.zeros_like(grid, dtype=torch.bool), grid, 0.0).sum()
        return op(input, grid, *args) + zero.to(input.dtype)

    return sample


def _widen_int8(traced: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Cast to int64 where ``traced`` (``node``'s decomposition) casts to int8, its values' metadata
    propagated again."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    casts = [sub for sub in traced.graph.nodes
             if sub.target is _aten._to_copy.default and sub.kwargs.get("dtype") is torch.int8]
    if not casts:
        return
    for cast in casts:
        cast.kwargs = {**cast.kwargs, "dtype": torch.int64}
    traced.recompile()
    values = [n.meta["val"] for n in node.all_input_nodes]
    FakeTensorProp(traced, mode=detect_fake_mode(values)).propagate_dont_convert_inputs(*values)

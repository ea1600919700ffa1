"""The ``loss_pieces`` pass of the torch-autograd gradient source, on the ``torch.export`` program.

A language-model head's logits are the largest tensors of a step: GPT-2 small at 8 × 512 tokens
projects 4096 rows onto 50257 words, 206 M elements, and its loss keeps several tensors of that
size (the logits, their float32 copy under mixed precision, the log-probabilities the backward
reads, the gradient). At 128 × 512 a single one passes 2³¹ elements, past what ONNX Runtime's CUDA
kernels index. When the logits are not fetched, this pass computes the loss in pieces of rows:

    linear(h, W, b) [-> _to_copy] -> view/reshape [-1, C] -> cross_entropy_loss(scores, labels, ignore_index=i)

becomes (``K`` pieces, ``n`` rows)

    count = sum(labels != i)                                   (a mean only)
    h_k, labels_k = split_with_sizes(h.reshape(-1, H), [q] * (K - 1) + [n - (K - 1) q]), likewise
    loss = (Σ_k cross_entropy_loss(linear(h_k, W, b) [-> _to_copy], labels_k, reduction="sum")) / count

``q = n // K``. The rewrite runs before autograd, so the backward is autograd's of the pieces:
each piece's gradient is the same arithmetic on its own rows (the loss's gradient, ``scale /
count``, is computed before any piece), and the rows' gradients are joined by the split's backward
(a concatenation). Only the order of the loss's sum changes (PyTorch's mean adds every row's loss
and divides by the count; here each piece's sum is added to the others'), a float32 rounding.

Each piece's backward reads only its own forward values and the seed, so the graph's order (and
ONNX Runtime's ``PRIORITY_BASED`` executor) runs it right after that piece's forward: one piece's
vocabulary-sized tensors are alive at a time instead of the whole batch's.

``K`` is the fewest pieces with at most ``limit`` logits elements each (``rows × classes``, the rows
of the traced sample), and pieces of at least ``_MIN_ROWS`` rows; a loss whose logits fit in
``limit`` is left alone. Under mixed precision the pass looks inside the autocast region as
``sparse_labels`` does. The pieces apply to per-position logits (a projection of a rank-3 ``h``) only,
and run before ``sparse_labels``: where that pass is on and the loss is its pattern too (no cast between
the projection and the loss), each piece projects only its labelled rows (``labelled_rows``, padded to a
bucket per piece), and ``sparse_labels`` then takes the losses left whole.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from ..._logging import logger
from .sparse_labels import _MEAN, _SUM, _losses, _match, _value, erase_unread, labelled_rows, readers, recompile

_aten = torch.ops.aten
_MIN_ROWS = 64  # a piece's product keeps at least this many rows (and no piece is empty)


def pieces(program: Any, limit: int) -> int:
    """How many pieces ``loss_pieces`` would cut the largest matching loss of ``program`` into (1:
    none), from the traced sample's sizes; reads the program without changing it. Whether the
    logits are fetched is not asked: the count keys a trace (``TorchGradientSource.trace``)."""
    counts = [_pieces_of(match, limit) for loss in _losses(program)
              if (match := _match(loss, lambda node: 1, casts=True)) is not None]
    return max(counts, default=1)


def applies(program: Any, uses: Callable[[torch.fx.Node], int], limit: int) -> bool:
    """Whether ``loss_pieces`` would rewrite a loss of ``program`` given ``uses`` (each node's readers
    once the unfetched outputs are gone: ``sparse_labels.live_uses``)."""
    return any((match := _match(loss, uses, casts=True)) is not None and _pieces_of(match, limit) > 1
               for loss in _losses(program))


def loss_pieces(program: Any, limit: int, sparse: bool = False) -> int:
    """Compute each matching loss of ``program`` in pieces (see the module docstring), in place;
    returns how many losses were rewritten.

    Args:
        program: a ``torch.export`` program whose unfetched outputs are already dropped
            (``sparse_labels.drop_outputs``): a projection with another reader is left alone.
        limit: the most logits elements (rows × classes) a piece may have.
        sparse: where the loss is also ``sparse_labels``'s (no cast between the projection and the
            loss), each piece projects only its labelled rows (``sparse_labels.labelled_rows``).
    """
    count, changed = 0, set()
    for loss in _losses(program):
        match = _match(loss, readers, casts=True)
        if match is None or (k := _pieces_of(match, limit)) < 2:
            continue
        hidden, projection, views, ignore_index = match
        graph = loss.graph
        changed.add(graph)
        call = graph.call_function
        args = list(loss.args) + [None] * (6 - len(loss.args))
        reduction = loss.kwargs.get("reduction", args[3] if args[3] is not None else _MEAN)
        labels, value = loss.args[1], _value(loss)
        dtype = value.dtype if value is not None else torch.float32
        width = _value(hidden).shape[-1]
        casts = [n for n in reversed(views) if n.target in (_aten._to_copy.default, _aten.to.dtype)]
        selected = sparse and _match(loss, readers) is not None  # sparse_labels' own pattern: no cast
        with graph.inserting_before(loss):
            # the count first: each piece's gradient (scale / count) is then ready once its forward is
            denominator = None
            if reduction == _MEAN:
                denominator = call(_aten.sum.dim_IntList, (call(_aten.ne.Scalar, (labels, ignore_index)), [0]),
                                   {"dtype": dtype})
            flat = call(_aten.reshape.default, (hidden, [-1, width]))
            sizes = _sizes(graph, flat, _value(hidden).shape[:-1], k)
            rows = call(_aten.split_with_sizes.default, (flat, sizes))
            piece_labels = call(_aten.split_with_sizes.default, (labels, sizes))
            total = None
            for piece in range(k):
                piece_rows = call(operator.getitem, (rows, piece))
                labels_k = call(operator.getitem, (piece_labels, piece))
                if selected:
                    scores, labels_k = labelled_rows(graph, hidden, projection, labels_k, ignore_index, width,
                                                     _value(hidden).dtype, rows_of=piece_rows)
                else:
                    env = {hidden: piece_rows}
                    for node in projection:  # the product, then its bias adds
                        env[node] = call(node.target, *torch.fx.node.map_arg((node.args, node.kwargs),
                                                                             lambda a: env.get(a, a)))
                    scores = env[projection[-1]]
                for cast in casts:  # such as ``.float()`` (the views only flattened the rows)
                    scores = call(cast.target, (scores, *cast.args[1:]), dict(cast.kwargs))
                part = call(loss.target, (scores, labels_k, None, _SUM, ignore_index))
                total = part if total is None else call(_aten.add.Tensor, (total, part))
            result = total if denominator is None else call(_aten.div.Tensor, (total, denominator))
        loss.replace_all_uses_with(result)
        graph.erase_node(loss)
        erase_unread(graph, [*views, *reversed(projection)])
        count += 1
    if count:
        recompile(program, changed)
        logger.debug("loss_pieces: %d cross-entropy loss(es) computed in pieces of rows", count)
    return count


def _pieces_of(match: tuple, limit: int) -> int:
    """The pieces for a matched loss: ceil(rows × classes / limit), at most rows / _MIN_ROWS."""
    hidden, projection, views, _ = match
    shape = _value(hidden).shape
    rows = math.prod(_hint(s) for s in shape[:-1])
    classes = _hint(_value(views[0] if views else projection[-1]).shape[-1])
    if limit <= 0 or rows * classes <= limit:
        return 1
    return max(1, min(-(-rows * classes // limit), rows // _MIN_ROWS))


def _hint(size: Any) -> int:
    """A size's value in the traced sample (a symbolic size's hint)."""
    if isinstance(size, int):
        return size
    hint = size.node.maybe_as_int() if hasattr(size.node, "maybe_as_int") else None
    if hint is None:
        hint = size.node.hint
    return int(hint)


def _sizes(graph: torch.fx.Graph, flat: torch.fx.Node, leading: Any, k: int) -> list:
    """``[q] * (k - 1) + [n - (k - 1) q]`` for ``n`` rows, ``q = n // k``: ints for a static trace,
    size nodes for a symbolic one (the rows are the product of ``leading``)."""
    if all(isinstance(s, int) for s in leading):
        n = math.prod(leading)
        q = n // k
        return [q] * (k - 1) + [n - (k - 1) * q]
    call = graph.call_function
    n = call(torch.ops.aten.sym_size.int, (flat, 0))
    q = call(operator.floordiv, (n, k))
    return [q] * (k - 1) + [call(operator.sub, (n, call(operator.mul, (q, k - 1))))]


__all__ = ["applies", "loss_pieces", "pieces"]

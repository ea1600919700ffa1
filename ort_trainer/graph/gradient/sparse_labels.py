"""The ``sparse_labels`` pass of the torch-autograd gradient source, on the ``torch.export`` program.

When the logits are not fetched and the loss ignores labelled-out positions (``ignore_index``,
e.g. a masked-LM head with 15% of the positions labelled), the output projection feeding the
cross-entropy runs only on the rows whose label counts:

    linear(h, W, b) -> view/reshape [-1, C] -> cross_entropy_loss(scores, labels, ignore_index=i)

(``h`` of rank 3 or more: labels per position, as in a language-model head)

becomes

    rows = [*nonzero(labels != i), 0]; linear(index_select(h.reshape(-1, H), rows), W, b)
        -> cross_entropy_loss(scores, [*labels[rows[:-1]], i], ignore_index=i)

The rewrite runs before autograd, so the backward is autograd's of the rewritten program: ignored
rows contribute exactly zero to the loss and to every gradient, and the mean divides by the same
count of labelled rows, so loss and gradients are unchanged (PyTorch's by construction). The row
count is data-dependent: the graph carries it as a runtime size (ONNX ``NonZero``).

Under mixed precision the model and loss are traced as one ``wrap_with_autocast`` call whose
submodule holds them: the pass looks inside it (``_autocast_regions``), and ``drop_outputs`` returns
an empty tensor from the region in place of an output nothing reads any more, so the logits are no
longer the region's output. Half-precision rows are selected in float32 and cast back (exact both
ways): the selection's gradient is a scatter-add, which ONNX Runtime has no float16 CPU kernel for
and runs for bfloat16 on CUDA with its float16 kernel (chosen by element size), adding wrong values.

The rows are padded further (row 0 again, labelled ``ignore_index``) to ``bucket_rows(n + 1)``:
four sizes per power of two. ONNX Runtime's arena grows by a new region whenever a tensor is
larger than any free block, and keeps it; with one size per labelled count, the vocabulary-sized
tensors grew BERT-base's process (B4 × S128, 30522 words) by ~22 MB at each new largest count: 89 MB
over 40 batches of random 15% masks, and more over a longer run. At most 25% more rows (12% on
average) are projected, the largest sizes repeat, and the growth stops after a few buckets.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch

from ..._logging import logger

_aten = torch.ops.aten
# reshapes that only flatten leading dimensions (checked on their shapes)
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_PASS_THROUGH = {_aten.contiguous.default, _aten.clone.default}
_MEAN, _SUM = 1, 2  # torch.nn._reduction values


def unreturned(program: Any, output_names: Sequence[str], returned: Sequence[str], first: int = 1) -> list[int]:
    """Positions, among all outputs of a ``autograd.trace`` program (buffer mutations come
    first, then the scaled loss, then the description outputs ``output_names``), of the
    description outputs not in ``returned``. ``first``: user outputs before the description's (1,
    the scaled loss, in a training trace; 0 in the eval-mode trace)."""
    from torch.export.graph_signature import OutputKind

    users = [i for i, spec in enumerate(program.graph_signature.output_specs)
             if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    return [users[first + i] for i, name in enumerate(output_names) if name not in returned]


def drop_outputs(program: Any, positions: Sequence[int]) -> None:
    """Stop returning the user outputs at ``positions`` (indices into the program's outputs), in place.

    Each becomes an empty float tensor, so output positions (and the description's output order)
    stay as traced while whatever only those outputs read becomes dead code.
    """
    graph = program.graph
    output = graph.output_node()
    values = list(output.args[0])
    specs = program.graph_signature.output_specs
    for position in positions:
        old = values[position]
        with graph.inserting_before(output):
            empty = graph.call_function(_aten.zeros.default, ([0],), {"dtype": torch.float32})
        empty.meta["val"] = torch.empty(0)
        values[position] = empty
        specs[position].arg.name = empty.name
        output.args = (tuple(values),)
        _erase_dead(graph, old)
    for region, module in _autocast_regions(program):
        _drop_unread_region_outputs(region, module)


def live_uses(program: Any, dropped: Sequence[int]) -> Callable[[torch.fx.Node], int]:
    """Each node's readers (a returned position counting as one) once the user outputs at positions
    ``dropped`` are gone (``drop_outputs``), without changing the program: what a pass's match asks."""
    output = program.graph.output_node()
    kept = [v for i, v in enumerate(output.args[0]) if i not in set(dropped) and isinstance(v, torch.fx.Node)]
    live: set[torch.fx.Node] = set()
    outputs: dict[torch.fx.Node, int] = {}  # each returned position counts as a use

    def returned(values: list) -> None:
        """Mark ``values`` returned, and live with everything they read."""
        stack = []
        for value in values:
            outputs[value] = outputs.get(value, 0) + 1
            if value not in live:
                live.add(value)
                stack.append(value)
        while stack:
            for source in stack.pop().all_input_nodes:
                if source not in live:
                    live.add(source)
                    stack.append(source)

    returned(kept)
    for region, module in _autocast_regions(program):
        if region in live:  # inside: what the region's read outputs need
            read = {u.args[1] for u in region.users if u in live and u.target is operator.getitem}
            returned([v for i, v in enumerate(module.graph.output_node().args[0])
                      if i in read and isinstance(v, torch.fx.Node)])
    return lambda node: sum(1 for u in node.users if u in live) + outputs.get(node, 0)


def applies(program: Any, dropped: Sequence[int]) -> bool:
    """Whether ``sparse_labels`` would rewrite ``program`` once the user outputs at positions
    ``dropped`` are gone (``drop_outputs``); reads the program without changing it."""
    uses = live_uses(program, dropped)
    return any(_match(loss, uses) is not None for loss in _losses(program))


def sparse_labels(program: Any) -> int:
    """Rewrite every matching projection + cross-entropy of ``program`` in place (see the module
    docstring); returns how many were rewritten.

    A projection is ``linear(h, W[, b])`` or ``matmul(h, B)`` with ``B`` 2-D, optionally followed
    by adds of a bias of at most one dimension. A pattern is left alone when any intermediate value
    has another user (a fetched output, a second loss), the cross-entropy has class weights, label
    smoothing or ``reduction="none"``, or the view does more than flatten the projection's leading
    dimensions.
    """
    count, changed = 0, set()
    for loss in _losses(program):
        match = _match(loss, lambda node: len(node.users))
        if match is None:
            continue
        graph = loss.graph
        changed.add(graph)
        hidden, projection, views, ignore_index = match
        with graph.inserting_before(loss):
            scores, picked_labels = labelled_rows(graph, hidden, projection, loss.args[1], ignore_index,
                                                  _value(hidden).shape[-1], _value(hidden).dtype)
        loss.args = (scores, picked_labels, *loss.args[2:])
        erase_unread(graph, [*views, *reversed(projection)])
        count += 1
    if count:
        recompile(program, changed)
        logger.debug("sparse_labels: %d projection(s) before a cross-entropy now run on the labelled rows only",
                     count)
    return count


def erase_unread(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase each of ``nodes`` (consumers first: each is dead once its reader is gone) that nothing
    reads any more but its metadata checks (``_assert_tensor_metadata``, erased with it)."""
    for node in nodes:
        if not readers(node):
            for check in list(node.users):
                graph.erase_node(check)
            graph.erase_node(node)


def recompile(program: Any, changed: set) -> None:
    """Recompile ``program`` after edits of its graphs ``changed`` (its own, its autocast regions')."""
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule) and module.graph in changed:
            module.graph.lint()
            module.recompile()
    program.graph_module.recompile()


def labelled_rows(graph: torch.fx.Graph, hidden: torch.fx.Node, projection: list[torch.fx.Node],
                  labels: torch.fx.Node, ignore_index: int, width: int, dtype: torch.dtype,
                  rows_of: torch.fx.Node | None = None) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Nodes ``(scores, their labels)``: ``projection`` (the product, then its bias adds, reading
    ``hidden``) replayed on the rows of ``rows_of`` (default ``hidden``; ``width`` wide, of ``dtype``)
    whose label is not ``ignore_index``, padded to a bucket; inserted at the graph's insertion point."""
    call = graph.call_function
    kept = call(_aten.ne.Scalar, (labels, ignore_index))
    rows = call(_aten.view.default, (call(_aten.nonzero.default, (kept,)), [-1]))
    # extra rows (row 0, labelled ignore_index: each adds exactly zero to the loss, its count and every
    # gradient): at least one, so no product has zero rows (ONNX Runtime 1.19.2's Gemm refuses K = 0),
    # and up to bucket_rows(n + 1) in all
    padded, picked_labels = _padded_to_bucket(graph, rows, kept, labels, ignore_index)
    flat = call(_aten.reshape.default, (hidden if rows_of is None else rows_of, [-1, width]))
    half = dtype if dtype in (torch.float16, torch.bfloat16) else None
    if half is not None:
        # selected in float32, then cast back: the selection's gradient is a scatter-add, which ONNX
        # Runtime runs in float16 on no CPU and runs bfloat16 as float16 on CUDA (its kernel is picked
        # by element size); the casts are exact both ways
        flat = call(_aten._to_copy.default, (flat,), {"dtype": torch.float32})
    selected = call(_aten.index_select.default, (flat, 0, padded))
    if half is not None:
        selected = call(_aten._to_copy.default, (selected,), {"dtype": half})
    env = {hidden: selected}
    for node in projection:  # matmul first, then the bias adds
        env[node] = call(node.target, *torch.fx.node.map_arg((node.args, node.kwargs),
                                                             lambda value: env.get(value, value)))
    return env[projection[-1]], picked_labels


def bucket_rows(count: int) -> int:
    """The rows ``sparse_labels`` projects for ``count`` rows (the labelled ones and one more):
    ``count`` rounded up to a multiple of ``2^(floor(log2(count)) - 2)`` (at least 1), i.e. four
    sizes per power of two: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40..."""
    step = 2 ** max(count.bit_length() - 3, 0)
    return -(-count // step) * step


def _padded_to_bucket(graph: torch.fx.Graph, rows: torch.fx.Node, kept: torch.fx.Node, labels: torch.fx.Node,
                      ignore_index: int) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Nodes ``(row indices, their labels)``: ``rows`` and their labels, then row 0 labelled
    ``ignore_index`` up to ``bucket_rows(len(rows) + 1)`` entries (computed in the graph: the count
    is known at run time only). Everything is taken from tensors of the labels' length (no size
    arithmetic), so it serves symbolic shapes too."""
    call = graph.call_function
    count = call(_aten.add.Scalar, (call(_aten.sum.dim_IntList, (kept, [0]), {"dtype": torch.int64}), 1))
    real = call(_aten._to_copy.default, (count,), {"dtype": torch.float32})  # exact up to 2^24 rows
    exponent = call(_aten.clamp_min.default, (call(_aten.sub.Scalar, (call(_aten.floor.default, (
        call(_aten.log2.default, (real,)),)), 2)), 0))
    step = call(_aten.exp2.default, (exponent,))
    target = call(_aten.mul.Tensor, (call(_aten.ceil.default, (call(_aten.div.Tensor, (real, step)),)), step))
    # rows then len(labels) zeros, labels of rows then as many ignore_index: longer than the
    # target (bucket_rows(n + 1) ≤ n + (n + 1) / 4 + 1 ≤ n + len(labels)), whose first entries are taken
    extended_rows = call(_aten.cat.default, ([rows, call(_aten.zeros_like.default, (labels,),
                                                         {"dtype": torch.int64})], 0))
    extended_labels = call(_aten.cat.default, ([call(_aten.index_select.default, (labels, 0, rows)),
                                                call(_aten.full_like.default, (labels, ignore_index))], 0))
    positions = call(_aten.cumsum.default, (call(_aten.ones_like.default, (extended_rows,)), 0))  # 1, 2, ...
    first = call(_aten.view.default, (call(_aten.nonzero.default, (
        call(_aten.lt.Tensor, (positions, target)),)), [-1]))
    # the last row appended apart: a size of (runtime count) + 1, which torch knows is not 0
    return (call(_aten.cat.default, ([call(_aten.index_select.default, (extended_rows, 0, first)),
                                      call(_aten.new_zeros.default, (rows, [1]))], 0)),
            call(_aten.cat.default, ([call(_aten.index_select.default, (extended_labels, 0, first)),
                                      call(_aten.new_full.default, (labels, [1], ignore_index))], 0)))


def _match(loss: torch.fx.Node, uses: Callable[[torch.fx.Node], int], casts: bool = False
           ) -> tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node], int] | None:
    """``(hidden, projection nodes in execution order, views from the loss back, ignore_index)``
    or None; ``uses(node)`` counts the node's readers. ``casts``: the views may include casts to
    another floating dtype (``_to_copy``, a ``logits.float()``)."""
    args = list(loss.args) + [None] * (6 - len(loss.args))
    kwargs = loss.kwargs
    weight = kwargs.get("weight", args[2])
    reduction = kwargs.get("reduction", args[3] if args[3] is not None else _MEAN)
    ignore_index = kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    smoothing = kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
    if weight is not None or reduction not in (_MEAN, _SUM) or smoothing != 0.0:
        return None
    scores, labels = loss.args[0], loss.args[1]
    if not isinstance(scores, torch.fx.Node) or not isinstance(labels, torch.fx.Node):
        return None
    score_value, label_value = _value(scores), _value(labels)
    if score_value is None or label_value is None or score_value.dim() != 2 or label_value.dim() != 1:
        return None
    views, node = [], scores
    while _is_call(node) and (node.target in _VIEWS or node.target in _PASS_THROUGH
                              or (casts and _is_float_cast(node))):
        views.append(node)
        node = node.args[0]
    projection = []
    while _is_call(node) and node.target == _aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        onward = [a for a in node.args if isinstance(a, torch.fx.Node) and _value(a) is not None
                  and _value(a).dim() >= 2]
        other = [a for a in node.args if a not in onward]
        if len(onward) != 1 or len(other) != 1 or (isinstance(other[0], torch.fx.Node)
                                                    and (_value(other[0]) is None or _value(other[0]).dim() > 1)):
            return None
        projection.append(node)
        node = onward[0]
    if not _is_call(node):
        return None
    if node.target == _aten.linear.default:
        pass
    elif node.target in (_aten.matmul.default, _aten.mm.default) and isinstance(node.args[1], torch.fx.Node) \
            and _value(node.args[1]) is not None and _value(node.args[1]).dim() == 2:
        pass
    else:
        return None
    projection.append(node)
    if any(uses(n) != 1 for n in [*views, *projection]):
        return None
    hidden, out = node.args[0], _value(views[-1].args[0] if views else scores)
    # Per-position labels only (a [batch, seq, hidden] projection flattened for the loss, as in a
    # language-model head, where ignore_index marks unlabelled positions): a plain classifier's
    # labels all count, and selecting its rows would only add work.
    if not isinstance(hidden, torch.fx.Node) or _value(hidden) is None or _value(hidden).dim() < 3 \
            or out is None or out.shape[-1] != score_value.shape[-1]:
        return None  # the view must keep the class dimension last and flatten the rest
    return hidden, projection[::-1], views, int(ignore_index)


def _is_float_cast(node: torch.fx.Node) -> bool:
    """A ``_to_copy`` or ``to.dtype`` that only changes a floating tensor's floating dtype (no device,
    layout or memory format)."""
    value, source = _value(node), node.args[0] if node.args else None
    if node.target == _aten._to_copy.default:
        plain = len(node.args) == 1 and set(node.kwargs) <= {"dtype"}
    else:
        plain = node.target == _aten.to.dtype and all(a in (False, None) for a in [*node.args[2:],
                                                                                    *node.kwargs.values()])
    return (plain and value is not None and isinstance(source, torch.fx.Node) and _value(source) is not None
            and value.dtype.is_floating_point and _value(source).dtype.is_floating_point)


def readers(node: torch.fx.Node) -> int:
    """``node``'s readers, its metadata checks (``_assert_tensor_metadata``, which ``.to()`` leaves) aside."""
    return sum(1 for user in node.users if user.target != _aten._assert_tensor_metadata.default)


def _losses(program: Any) -> list[torch.fx.Node]:
    """The cross-entropy calls of the program and of its autocast regions (a model traced under
    ``torch.autocast`` is one ``wrap_with_autocast`` call whose submodule holds the model and loss)."""
    graphs = [program.graph, *(module.graph for _, module in _autocast_regions(program))]
    return [n for graph in graphs for n in graph.nodes
            if n.op == "call_function" and n.target == _aten.cross_entropy_loss.default]


def _autocast_regions(program: Any) -> list[tuple[torch.fx.Node, torch.fx.GraphModule]]:
    """``(call, submodule)`` of each ``wrap_with_autocast`` call of the program's top graph."""
    regions = []
    for node in program.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_autocast" \
                and len(node.args) > 4 and isinstance(node.args[4], torch.fx.Node) and node.args[4].op == "get_attr":
            module = getattr(program.graph_module, node.args[4].target, None)
            if isinstance(module, torch.fx.GraphModule):
                regions.append((node, module))
    return regions


def _drop_unread_region_outputs(region: torch.fx.Node, module: torch.fx.GraphModule) -> None:
    """Return an empty tensor in place of each output of an autocast region that nothing reads any
    more (``drop_outputs`` left its ``getitem`` without readers), so that what only it needed becomes
    dead code inside the region, as ``drop_outputs`` does outside."""
    unread = [u for u in list(region.users) if u.target is operator.getitem and not u.users]
    if not unread:
        return
    graph = module.graph
    output = graph.output_node()
    values = list(output.args[0])
    old_values = []
    for getter in unread:
        position = getter.args[1]
        with graph.inserting_before(output):
            empty = graph.call_function(_aten.zeros.default, ([0],), {"dtype": torch.float32})
        empty.meta["val"] = torch.empty(0)
        old_values.append(values[position])
        values[position] = empty
        region.graph.erase_node(getter)
    output.args = (tuple(values),)
    for old in old_values:
        _erase_dead(graph, old)
    graph.lint()
    module.recompile()


def _is_call(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function"


def _value(node: torch.fx.Node) -> Any:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _erase_dead(graph: torch.fx.Graph, node: Any) -> None:
    """Erase ``node`` and then whatever only it read, while they have no users (pure ops only)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, torch.fx.Node) or current.users or current.op != "call_function":
            continue
        if current.target not in (_aten.detach.default, *_VIEWS, *_PASS_THROUGH, _aten.linear.default):
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        stack.extend(inputs)


__all__ = ["applies", "bucket_rows", "drop_outputs", "erase_unread", "labelled_rows", "live_uses", "readers",
           "recompile", "sparse_labels", "unreturned"]

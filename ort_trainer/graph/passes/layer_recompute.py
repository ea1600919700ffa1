"""The ``layer_recompute`` joint-graph pass: each sublayer of a transformer recomputed in the backward from
the input of its LayerNorm, so that the forward keeps two tensors a layer instead of every activation the
backward reads (checkpointing, as ``torch.utils.checkpoint`` or ONNX Runtime's ORTModule memory optimizer
do it): the step computes the layers' forward twice, for a fraction of the memory.

The checkpoints are the inputs of the forward's ``LayerNormalization`` nodes: the residual stream before
each sublayer of a pre-LN transformer (GPT-2: a block's input, and the sum after its attention), the sum
before each LayerNorm of a post-LN one (BERT). A forward value the backward reads is recomputed where

- it is computed from checkpoints (a value computed from weights, constants and inputs alone, such as a
  weight's half-precision copy or an attention mask, is read where the forward left it), and
- it leads to a checkpoint (it lies inside a sublayer: the head and the loss after the last LayerNorm, and
  the embeddings before the first, are left as they are);

the values computed from the same checkpoints are one region, copied once into the backward, reading its
checkpoints through ``recompute._alias_after``'s no-op ``Reshape`` that waits for the gradient arriving at
the region's first backward reader: the copies run when the backward reaches that sublayer, and the
backward reads them in place of the forward's values. A region with a node that draws random numbers (ONNX
Runtime's training Dropout: the copy would draw another mask) is left as it is; a ``SeededDropout`` (the
``seeded_dropout`` pass, which runs before this one on a GPU) draws the same mask again in the copy (its draws are a
function of the step's seed, its number and the element alone). The copies compute the forward's operators on the
same values: the same values, bit for bit.

``activation_recompute`` (run after this pass) then finds nothing left to do in the sublayers this pass
took: their GELU and attention values are read by the copies alone.
"""

from __future__ import annotations

import onnx

from ..onnx_graph import RANDOM_OPS
from ._graph import _Graph, _op, _op_types
from .recompute import (_alias_after, _ancestors, _barrier_value, _copy_nodes, _place, backward_readers,
                        backward_start)

_SUFFIX = "/layer_recompute"


def layer_recompute(model: onnx.ModelProto) -> int:
    """Recompute each sublayer's values in the backward from its checkpoints (module docstring), in place.

    Returns:
        How many regions (sublayers) are recomputed.
    """
    seed = backward_start(model)
    if seed is None:
        return 0
    graph, op_of = model.graph, _op_types(model)
    forward = list(graph.node[:seed])
    checkpoints = {n.input[0] for n in forward if _op(n, op_of) == "LayerNormalization"}
    if len(checkpoints) < 2:
        return 0
    g = _Graph(model)
    index = {id(n): i for i, n in enumerate(graph.node)}
    roots = _roots(forward, checkpoints)
    inside = _leading_to(forward, checkpoints)
    regions: dict[frozenset, list[str]] = {}
    for node in forward:
        for name in node.output:
            if name in checkpoints or not roots.get(name) or name not in inside or name in g.outputs:
                continue
            if any(index[id(r)] >= seed for r in g.consumers.get(name, [])):
                regions.setdefault(roots[name], []).append(name)
    producer = {o: n for n in forward for o in n.output}
    plans = []
    for number, (region_roots, saved) in enumerate(regions.items()):
        # back to the checkpoints and to what no checkpoint computes (read where the forward left it)
        needed = _ancestors(saved, {name: node for name, node in producer.items()
                                    if name not in checkpoints and roots.get(name)})
        members = sorted((n for n in forward if id(n) in needed), key=lambda n: index[id(n)])
        if any(_op(m, op_of) in RANDOM_OPS or m.op_type in RANDOM_OPS for m in members):
            continue
        readers = backward_readers(saved, g, index, seed)
        after = _barrier_value(readers, g, index, seed)
        if after is None:
            continue
        tag = f"{_SUFFIX}{number}"
        aliases = {root: f"{root}{tag}" for root in sorted(region_roots)}
        copies, names = _copy_nodes(members, aliases, tag)
        waits = [node for root, alias in aliases.items() for node in _alias_after(root, after, alias)]
        plans.append((waits + copies, {name: names[name] for name in saved}, readers[0], {**names, **aliases}))
    return _place(model, seed, plans)


def _roots(forward: list[onnx.NodeProto], checkpoints: set[str]) -> dict[str, frozenset]:
    """``{value: the checkpoints it is computed from}``, stopping at checkpoints (a checkpoint's own: itself);
    values computed from none (weights, constants, inputs, what only they give) are absent."""
    roots: dict[str, frozenset] = {}
    for node in forward:
        found = frozenset().union(*(roots.get(name, frozenset()) for name in node.input))
        for name in node.output:
            if name in checkpoints:
                roots[name] = frozenset({name})
            elif found:
                roots[name] = found
    for name in checkpoints:  # a checkpoint that is a graph input
        roots.setdefault(name, frozenset({name}))
    return roots


def _leading_to(forward: list[onnx.NodeProto], checkpoints: set[str]) -> set[str]:
    """Values, checkpoints aside, from which a checkpoint is computed (those inside a sublayer)."""
    leading: set[str] = set(checkpoints)
    for node in reversed(forward):
        if any(name in leading for name in node.output):
            leading.update(name for name in node.input if name)
    return leading - checkpoints


__all__ = ["layer_recompute"]

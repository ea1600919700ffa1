"""The ``loss_pieces`` joint-graph pass: each piece of a loss computed in pieces (``gradient/loss_pieces.py``)
has its backward run right after its forward.

A piece's backward (its logits' gradient, the gradients of its rows and of the head's weight) reads only
that piece's forward values and the gradient seed (``scale / count``, computed before any piece). ONNX
Runtime's ``PRIORITY_BASED`` executor takes the ready node that comes first in the node list, and the joint
graph lists the whole forward first: every piece's vocabulary-sized log-probabilities would then stay
alive until the backward, as many bytes as without pieces. Here each gradient node (a node that reads the
seed, or reads one that does) is listed right after the last node it waits for, and the backward nodes
such a node needs that do not depend on the seed come just before it; so a piece's backward follows its
forward and frees its tensors before the next piece's forward.

The backward proper (gradient nodes that wait for the last piece, i.e. for everything the gradients wait
for) stays after the whole forward, in its order: hoisting it would keep the forward's last values (the
last piece's loss reads) alive through it. Only the node list's order changes: every value is computed as
before, by the same node.
"""

from __future__ import annotations

import onnx

from ..names import LOSS_SCALE_INPUT


def piece_gradients_early(model: onnx.ModelProto) -> int:
    """Reorder the joint graph's nodes as the module docstring says, in place.

    Returns:
        How many backward nodes now come before the end of the forward.
    """
    graph = model.graph
    nodes = list(graph.node)
    seed = next((i for i, n in enumerate(nodes) if LOSS_SCALE_INPUT in n.input), None)
    if seed is None:  # no gradient seed: not a joint graph of the torch source
        return 0
    producer = {name: i for i, n in enumerate(nodes) for name in n.output if name}
    sources = [sorted({producer[name] for name in n.input if name in producer}) for n in nodes]
    readers: list[list[int]] = [[] for _ in nodes]
    for i, parents in enumerate(sources):
        for parent in parents:
            readers[parent].append(i)
    # earliest: right after the latest node a node waits for (forward nodes keep their place)
    gradient = [False] * len(nodes)
    earliest = list(range(len(nodes)))
    for i in range(seed, len(nodes)):
        gradient[i] = LOSS_SCALE_INPUT in nodes[i].input or any(gradient[p] for p in sources[i] if p >= seed)
        earliest[i] = max((earliest[p] for p in sources[i]), default=-1)
    last = max((earliest[i] for i in range(seed, len(nodes)) if gradient[i]), default=seed)
    # gradient nodes that wait for the last piece are the backward proper: after the forward, as listed;
    # those that wait for no node (the seed's own arithmetic) move with their first reader, so the first
    # reader of the seed still begins the backward (the recompute pass and its tests read it so)
    early = [gradient[i] and 0 <= e < last for i, e in enumerate(earliest)]
    slot = [e if i < seed or early[i] else seed for i, e in enumerate(earliest)]
    for i in range(len(nodes) - 1, seed - 1, -1):
        if not early[i]:  # no earlier than its first reader needs it
            slot[i] = max(earliest[i], min((slot[r] for r in readers[i]), default=seed))
    order = sorted(range(len(nodes)), key=lambda i: (slot[i], i >= seed, i))
    if order == list(range(len(nodes))):
        return 0
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)
    return sum(1 for position, i in enumerate(order) if i >= seed and position < seed)


__all__ = ["piece_gradients_early"]

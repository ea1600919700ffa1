"""``tied_embedding_gradient``: a tied embedding's lookup rows added into its gradient on the host.

A table that is both looked up (an embedding) and multiplied by (the output projection of GPT-2's
and BERT's language-model heads) has a gradient of two parts: the product's dense ``[V, D]``
matrix, and the lookup's rows, which the decomposition of ``embedding_dense_backward`` scatters
(``ScatterElements(axis=0, reduction="add")``) into a table of zeros; an ``Add`` then sums the two
into the gradient output. An ONNX graph is out of place, so that sum holds two temporaries the
size of the table besides the output (GPT-2 small: [50257, 768], 154 MB each), at the end of the
backward, where ONNX Runtime's arena is at its fullest. PyTorch's ``AccumulateGrad`` adds each part
into ``.grad`` in place.

The pass makes the graph write the product straight into the gradient output and return the
lookup's rows and their row indices as two outputs of their own; the engine adds them into the
gradient buffer after the run (``index_add_``, ``Engine.forward_backward``), before anything
reads the gradients. The rows are a few MB (``batch · seq · D``). Gradient outputs so rewritten
are listed in the model's metadata under ``HOST_TABLE_ROWS``. The rows are summed in another order
than the scatter's (``index_add_`` adds them in index order into the product, the scatter into
zeros and then the product): equal to float32 rounding.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..names import GRAD_SUFFIX
from ._graph import _Graph, _elem_types, _is, _keep
from .embedding import lookup_scatter
from .joint import identity_transposes

#: metadata key: JSON ``{gradient output: [row index output, rows output]}``
HOST_TABLE_ROWS = "ort_trainer.host_table_rows"
_FLAT = "ort_trainer/table_rows/flat"

__all__ = ["HOST_TABLE_ROWS", "host_table_rows", "tied_embedding_gradients"]


def host_table_rows(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """``{gradient output: (row index output, rows output)}`` that ``tied_embedding_gradients``
    gave ``model`` (empty for any other graph)."""
    entry = next((e.value for e in model.metadata_props if e.key == HOST_TABLE_ROWS), None)
    return {name: tuple(pair) for name, pair in json.loads(entry).items()} if entry else {}


def tied_embedding_gradients(model: onnx.ModelProto) -> int:
    """Each gradient output ``Add(dense, ScatterElements(zeros[V, D], Expand(index[N, 1]), rows[N, D],
    axis=0, add))`` becomes ``dense``, written as the output, with ``index`` (flattened to ``[N]``)
    and ``rows`` as new graph outputs; returns the number rewritten. A ``dense`` that is a graph
    input, an initializer or another output is left as it is, and so is a sum of two scatters.
    Identity ``Transpose``s are dropped first (``index_put``'s decomposition puts one after the
    scatter; ``embedding_gradient`` drops them too)."""
    identity_transposes(model)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return 0  # a subgraph may read the renamed value by name
    g = _Graph(model)
    types = _elem_types(model)
    found = {}
    for add in graph.node:
        if not (_is(add, "Add") and add.output[0] in g.outputs and add.output[0].endswith(GRAD_SUFFIX)):
            continue
        scatters = [(i, g.producer[name]) for i, name in enumerate(add.input) if _is_lookup_scatter(g, name)]
        if len(scatters) != 1:
            continue
        position, scatter = scatters[0]
        dense = add.input[1 - position]
        producer = g.producer.get(dense)
        if (producer is None or dense in g.outputs or not g.only_used_by(scatter.output[0], add)
                or producer.op_type == "Constant" or add.output[0] not in types):
            continue
        found[add.output[0]] = (add, scatter, dense)
    if not found:
        return 0
    dead, renamed, rows, index_types = set(), {}, {}, {}
    new_nodes = []
    for output, (add, scatter, dense) in found.items():
        expand = g.producer[scatter.input[1]]
        index = f"{output}/row_index"
        new_nodes.append(helper.make_node("Reshape", [expand.input[0], _FLAT], [index], name=f"{output}/row_index"))
        rows[output] = (index, scatter.input[2])
        index_types[index] = types.get(expand.input[0], TensorProto.INT64)
        renamed[dense] = output
        dead |= {id(add), id(scatter)}
        if g.only_used_by(scatter.input[1], scatter):
            dead.add(id(expand))
    for node in graph.node:  # the dense part is written as the gradient output itself
        node.output[:] = [renamed.get(name, name) for name in node.output]
        if id(node) not in dead:
            node.input[:] = [renamed.get(name, name) for name in node.input]
    _keep(model, dead)
    graph.node.extend(new_nodes)
    kept_info = [info for info in graph.value_info if info.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    if _FLAT not in g.initializers:
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), _FLAT))
    for output, (index, updates) in rows.items():
        graph.output.append(helper.make_tensor_value_info(index, index_types[index], None))
        # the rows have the type of the scatter's table, so of the sum and the output
        graph.output.append(helper.make_tensor_value_info(updates, types[output], None))
    model.metadata_props.append(onnx.StringStringEntryProto(key=HOST_TABLE_ROWS, value=json.dumps(rows)))
    return len(found)


def _is_lookup_scatter(g: _Graph, name: str) -> bool:
    """``name`` is an embedding lookup's gradient scattered into a zero table (``lookup_scatter``)."""
    node = g.producer.get(name)
    if node is None or lookup_scatter(g, node) is None:
        return False
    shape = g.shapes.get(node.input[0])
    return (shape is None or len(shape) == 2) and g.fill_value(node.input[0]) == 0.0

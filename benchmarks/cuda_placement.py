"""Where ONNX Runtime's CUDA provider would copy tensors between the GPU and the host inside a training graph (and
which floating-point nodes it would run on the host), told on a machine without a GPU (``graph_traffic.py`` prints the count; ``tests/test_device_barriers.py`` checks the graphs).

It follows ONNX Runtime's own placement, read from its sources: constant folding first (nodes of constant inputs; a
``Shape`` of a static shape), then ``GetCpuPreferredNodes`` (``core/framework/fallback_cpu_capability.cc``): from the
consumers of a CPU output (``Shape``, ``Size``), a node goes to the host where every input is a CPU output, a small
initializer (100 elements at most) or a graph input, none is float16 or bfloat16, and none is one its CUDA kernel
reads on the host anyway; then a copy wherever a value's side differs from its reader's (a ``MemcpyToHost``: a wait
for the GPU; a ``MemcpyFromHost``). The CUDA kernels' host inputs (``OrtMemTypeCPUInput`` in their registrations) are
listed in ``HOST_INPUTS``. It assumes every node has a CUDA kernel for its types (``Sessions.check_placement`` names
those that do not, on a GPU).
"""

from __future__ import annotations

import heapq

import numpy as np
import onnx

# the inputs each CUDA kernel reads on the host: a shape, axes, starts and ends, a count
HOST_INPUTS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,),
               "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2), "Split": (1,), "ReduceSum": (1,),
               "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "Pad": (1, 2, 3), "TopK": (1,),
               "OneHot": (1,), "CumSum": (1,), "Trilu": (1,), "Clip": (1, 2), "Dropout": (1, 2),
               "Resize": (1, 2, 3)}
_HOST_OUTPUTS = {"Shape", "Size"}  # (their CUDA kernels write the dims on the host)
_HALF = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, *_HALF}
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"}
_SMALL = 100  # ONNX Runtime's kSmallInitializerThreshold


def _onnx(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def host_copies(model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """The copies ONNX Runtime's CUDA provider would put inside ``model``: ``(kind, reader, value)``, kind
    ``"MemcpyToHost"`` (the device waits: a sync point, no CUDA graph capture) or ``"MemcpyFromHost"``, reader the
    reading node's ``op_type 'name'``; and ``("HostFloats", node, output)`` for a node it would run on the host that
    computes floating-point values (one that reads a graph input and a shape, say: that input is then copied to the
    host at every binding, and the node runs on the CPU)."""
    graph = model.graph
    sizes = {i.name: int(np.prod(i.dims)) for i in graph.initializer}
    inputs = {i.name for i in graph.input}
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    static = {v.name for v in [*graph.value_info, *graph.input] if v.type.tensor_type.HasField("shape")
              and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
    nodes = []
    for node in graph.node:  # constant folding
        if _onnx(node) and node.op_type == "Constant":
            value = node.attribute[0]
            sizes[node.output[0]] = int(np.prod(value.t.dims)) if value.name == "value" else 1
        elif _onnx(node) and node.op_type not in _RANDOM and all(i in sizes for i in node.input if i):
            sizes.update(dict.fromkeys(node.output, 0))
        elif _onnx(node) and node.op_type == "Shape" and node.input[0] in static:
            sizes[node.output[0]] = 0
        else:
            nodes.append(node)
    order = {id(n): i for i, n in enumerate(nodes)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    host_values, queue, on_host = set(), [], set()

    def push(names) -> None:
        for name in names:
            for reader in readers.get(name, []):
                heapq.heappush(queue, (order[id(reader)], id(reader), reader))

    for node in nodes:
        if _onnx(node) and node.op_type in _HOST_OUTPUTS:
            host_values.update(node.output)
            push(node.output)
    seen = set()
    while queue:  # GetCpuPreferredNodes, in topological order
        _, key, node = heapq.heappop(queue)
        if key in seen:
            continue
        seen.add(key)
        host_reads = HOST_INPUTS.get(node.op_type, ()) if _onnx(node) else ()
        if all(not name or (types.get(name) not in _HALF and (
                sizes.get(name, _SMALL + 1) <= _SMALL or name in inputs
                or (name in host_values and index not in host_reads)))
               for index, name in enumerate(node.input)):
            on_host.add(key)
            host_values.update(node.output)
            push(node.output)
    copies = [("HostFloats", f"{node.op_type} {node.name!r}", name) for node in nodes if id(node) in on_host
              for name in node.output if types.get(name) in _FLOATS]
    for node in nodes:
        host_reads = HOST_INPUTS.get(node.op_type, ()) if _onnx(node) else ()
        for index, name in enumerate(node.input):
            if not name or name in sizes or name in inputs:
                continue  # (initializers are placed where read; inputs are copied at binding, not in the graph)
            wants_host = id(node) in on_host or index in host_reads
            if wants_host != (name in host_values):
                copies.append(("MemcpyToHost" if wants_host else "MemcpyFromHost", f"{node.op_type} {node.name!r}",
                               name))
    return copies

"""Helpers on ONNX graphs that more than one stage needs: signatures, fixed sizes, pruning."""

from __future__ import annotations

import copy
import math
from typing import Collection

import onnx
from onnx import helper

from ..kernels import DOMAIN as KERNELS_DOMAIN
from ..kernels import TORCH_OPS_DOMAIN
from ..kernels.standard_ctc import standard_ctc
from ..kernels.standard_lstm import standard_lstm
from .names import KEEPER_SUFFIX

#: nodes that may draw from ONNX Runtime's random generator: a replayed CUDA graph would draw what its capture
#: drew, every step (their CUDA kernels draw at launch), and a recomputed copy would draw other numbers
RANDOM_OPS = frozenset({"Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                        "Bernoulli", "Multinomial", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout"})
ONNX_DOMAINS = ("", "ai.onnx")  # the names of ONNX's own operator set


def onnx_opset(model: onnx.ModelProto) -> int:
    """The version of ONNX's own operator set ``model`` imports (0: none)."""
    return next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 0)


def specialize(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose symbolic input/output dims named in ``dims`` are fixed."""
    result = copy.deepcopy(model)
    for value_info in [*result.graph.input, *result.graph.output]:
        for dim in value_info.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in dims:
                dim.dim_value = dims[dim.dim_param]
    return result


def compacted(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in fresh memory, for a graph that passes have edited and that is kept.

    The ``upb`` protobuf runtime under ``onnx`` allocates a model's messages in one arena that only
    grows: what a pass removes or rewrites (nodes, repeated fields assigned anew) stays allocated
    until the whole model is freed. A copy holds what the model holds now and nothing more: BERT-base's
    gradient graph after the joint passes (4 MB serialized) held ~60 MB of such memory for as long as
    the trainer lived.
    """
    return copy.deepcopy(model)


def drop_outputs(model: onnx.ModelProto, unwanted: set[str]) -> int:
    """Remove the graph outputs named in ``unwanted``, in place, and what only they needed.

    A value that is a graph output gets a buffer of its own from ONNX Runtime's allocation planner
    (it cannot share one with the run's intermediates, and a Reshape into it copies): a 32 MB
    logits tensor returned and dropped every step when the loop fetches only the loss.

    Returns:
        The number of nodes removed.
    """
    graph = model.graph
    kept = [o for o in graph.output if o.name not in unwanted]
    if len(kept) == len(graph.output):
        return 0
    dropped = [o for o in graph.output if o.name in unwanted]
    del graph.output[:]
    graph.output.extend(kept)
    # a dropped output still computed (the logits the loss reads) keeps its type, as a value info:
    # ``eval_part`` can return it again
    return _keep_live(graph, dropped)


def drop_dead_nodes(model: onnx.ModelProto) -> int:
    """Remove, in place, the nodes no graph output needs (what a pass left unread: a full-size
    zero tensor whose reader it rewrote), with the initializers and value infos only they used.

    ONNX Runtime runs a node nobody reads, or folds it at session creation when its inputs are
    constants (GPT-2 small at 8 x 512: a [4096, 50257] float32 tensor, 823 MB, and twelve [8, 12,
    512, 512] ones). Returns the number of nodes removed."""
    return _keep_live(model.graph)


def drop_unread_inputs(model: onnx.ModelProto, kept: Collection[str]) -> list[str]:
    """Remove the graph inputs that no node reads, but those named in ``kept``, in place; returns the names removed.

    A weight that only a value nothing needs reads (SqueezeBERT's pooler under a masked-LM head) stays a graph input
    of the translated eval-mode trace after its nodes are gone, while the gradient graph has none: the engine, which
    binds the gradient graph's weights, has nothing to give it."""
    read = _outer_names(model.graph) | {o.name for o in model.graph.output}
    unread = [i.name for i in model.graph.input if i.name not in read and i.name not in kept]
    if unread:
        inputs = [i for i in model.graph.input if i.name not in unread]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
    return unread


def _keep_live(graph: onnx.GraphProto, dropped_outputs: Collection = ()) -> int:
    """Keep the nodes, initializers and value infos that the graph's outputs need (and the value
    infos of ``dropped_outputs`` still computed); returns the number of nodes removed."""
    # the graph's outputs, and the keepers' (``names.KEEPER_SUFFIX``): read by nothing on purpose
    needed = {o.name for o in graph.output} | {n.output[0] for n in graph.node if n.name.endswith(KEEPER_SUFFIX)}
    live = _live_nodes(graph.node, needed)
    removed = len(graph.node) - len(live)
    if removed == 0 and not dropped_outputs:
        return 0
    del graph.node[:]
    graph.node.extend(live)
    inputs = {i.name for i in graph.input}
    initializers = [i for i in graph.initializer if i.name in needed or i.name in inputs]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    value_info = [v for v in [*graph.value_info, *dropped_outputs] if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(value_info)
    return removed


def eval_part(model: onnx.ModelProto, outputs: list[str], mask_inputs: Collection[str] = ()) -> onnx.ModelProto:
    """A new model computing only ``outputs`` of the training graph ``model`` (graph outputs, or
    values with a type in its ``value_info``) as eval mode does: from the nodes, inputs,
    initializers and value infos they need — its forward part, without its gradients and the
    activations it keeps for them — with its Dropouts the identity: each ``Dropout`` node, and each
    ``Mul(x, m)`` with ``m`` one of ``mask_inputs`` (a mask the host draws,
    ``passes/dropout.host_dropout_masks``), gives ``x`` itself. ``model`` is left as it is."""
    graph = model.graph
    rename = _dropout_bypasses(graph.node, set(mask_inputs))
    nodes = []
    for node in graph.node:
        if node.output and node.output[0] in rename:
            continue
        if any(name in rename for name in node.input):
            renamed = onnx.NodeProto()
            renamed.CopyFrom(node)  # ``model`` keeps its own
            renamed.input[:] = [_source(name, rename) for name in node.input]
            node = renamed
        nodes.append(node)
    nodes += _output_identities(outputs, rename)
    by_name = {v.name: v for v in [*graph.value_info, *graph.output]}
    needed = set(outputs)
    live = _live_nodes(nodes, needed)
    part = helper.make_graph(  # copies what it is given: ``model`` is not shared
        live, graph.name, [i for i in graph.input if i.name in needed], [by_name[name] for name in outputs],
        [i for i in graph.initializer if i.name in needed],
        value_info=[v for v in graph.value_info if v.name in needed and v.name not in set(outputs)])
    result = helper.make_model(part, opset_imports=model.opset_import, ir_version=model.ir_version,
                               producer_name=model.producer_name, producer_version=model.producer_version)
    result.functions.extend(model.functions)
    return result


def sum_into_inputs(model: onnx.ModelProto, accumulators: dict[str, str]) -> int:
    """Make each output ``name`` of ``accumulators`` return its accumulator input plus its value, in place.

    ``{output: input}``: every input is new, of its output's type and shape. Bound to the same buffer
    as its output, each input makes a run add into that buffer. A value that a ``Gemm`` without
    ``C`` computes (through ``Identity`` nodes and ``Transpose`` pairs that cancel, read by nothing
    else) takes the input as its ``C`` (``beta`` 1): the product is added into the buffer with no
    temporary of the weight's size. Any other value is renamed ``name + ".summand"`` (in subgraphs
    too) and an ``Add`` of the input and it returns the output. ONNX Runtime's kernels read each
    element of ``C`` or of the ``Add``'s operands before they write it (its CPU ``Gemm`` copies ``C``
    into ``Y``, a copy onto itself here, then adds the product; the CUDA one likewise with cuBLAS),
    so sharing the buffer is sound. Returns how many went into a ``Gemm``.
    """
    graph = model.graph
    inputs = {i.name for i in graph.input}
    refused = sorted(name for name in accumulators if name in inputs)
    if refused:
        raise ValueError(f"outputs {refused} are graph inputs: there is no value to add to their accumulators")
    outputs = {o.name: o for o in graph.output}
    for name, accumulator in accumulators.items():
        added = copy.deepcopy(outputs[name])
        added.name = accumulator
        graph.input.append(added)
    folded = _fold_into_products(graph, accumulators)
    rest = {name: accumulator for name, accumulator in accumulators.items() if name not in folded}
    renamed = {name: name + ".summand" for name in rest}
    _rename_values(graph, renamed)
    for entry in [*graph.initializer, *graph.value_info]:
        entry.name = renamed.get(entry.name, entry.name)
    graph.node.extend(helper.make_node("Add", [accumulator, renamed[name]], [name], name=f"accumulate_{name}")
                      for name, accumulator in rest.items())
    return len(folded)


def _fold_into_products(graph: onnx.GraphProto, accumulators: dict[str, str]) -> set[str]:
    """Give each output of ``accumulators`` that a ``Gemm`` without ``C`` computes (see
    ``sum_into_inputs``) its accumulator as ``C``; returns those outputs."""
    nodes = list(graph.node)  # one set of message objects: nodes are told apart by identity below
    producer = {out: node for node in nodes for out in node.output}
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for name in _outer_names(graph) - set(readers):
        readers[name] = 1  # read by a subgraph only
    graph_outputs = {o.name for o in graph.output}

    def private(value: str) -> bool:  # read by one node alone, and not returned
        return readers.get(value, 0) == 1 and value not in graph_outputs

    folded, dropped, gone = set(), set(), set()  # gone: the names of values no longer computed
    for name, accumulator in accumulators.items():
        if readers.get(name):
            continue  # the graph reads the value itself: it must stay the micro-batch's own
        chain, value, transposes = [], name, 0
        while value in producer and producer[value].op_type in ("Identity", "Transpose"):
            node = producer[value]
            if node.op_type == "Transpose":
                perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
                if perm != [1, 0]:
                    break
                transposes += 1
            chain.append(node)
            value = node.input[0]
            if not private(value):
                break
        gemm = producer.get(value)
        if (gemm is None or (gemm.domain, gemm.op_type) not in (("", "Gemm"), ("ai.onnx", "Gemm"))
                or any(gemm.input[2:]) or transposes % 2 or (chain and not private(value))):
            continue
        del gemm.input[2:]
        gemm.input.append(accumulator)
        kept = [a for a in gemm.attribute if a.name != "beta"]
        del gemm.attribute[:]
        gemm.attribute.extend([*kept, helper.make_attribute("beta", 1.0)])
        gone.update(node.output[0] for node in chain)
        gone.add(gemm.output[0])
        gemm.output[0] = name
        dropped.update(id(node) for node in chain)
        folded.add(name)
    kept = [node for node in nodes if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    annotations = [info for info in graph.value_info if info.name not in gone - folded]
    del graph.value_info[:]
    graph.value_info.extend(annotations)
    return folded


def _rename_values(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Rename what nodes of ``graph`` and of its subgraphs read and write, in place."""
    for node in graph.node:
        for field in (node.input, node.output):
            for i, name in enumerate(field):
                if name in renamed:
                    field[i] = renamed[name]
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _rename_values(sub, renamed)


def _dropout_bypasses(nodes, mask_inputs: set[str]) -> dict[str, str]:
    """``{output: input}`` of what is the identity in eval mode: every ``Dropout`` and ``SeededDropout`` (its
    first output is its input) and every ``Mul`` of a value by one of ``mask_inputs``."""
    rename = {}
    for node in nodes:
        if node.op_type == "Dropout" or (node.op_type == "SeededDropout" and node.domain == KERNELS_DOMAIN):
            rename[node.output[0]] = node.input[0]
        elif node.op_type == "Mul" and len(node.input) == 2 and len(mask_inputs.intersection(node.input)) == 1:
            rename[node.output[0]] = next(name for name in node.input if name not in mask_inputs)
    return rename


def _source(name: str, rename: dict[str, str]) -> str:
    """What ``name`` is once the bypassed nodes are gone (a chain of them followed to its start)."""
    while name in rename:
        name = rename[name]
    return name


def _output_identities(outputs: Collection[str], rename: dict[str, str]) -> list[onnx.NodeProto]:
    """An ``Identity`` for each of ``outputs`` that a bypassed node computed: the name stays."""
    return [helper.make_node("Identity", [_source(name, rename)], [name], name=f"{name}_identity")
            for name in outputs if name in rename]


def module_of(node_name: str) -> str:
    """The torch module path of an exported node name (``/model/enc/layers.0/Gemm`` -> ``enc.layers.0``)."""
    parts = [p for p in node_name.split("/") if p][:-1]
    if parts and parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts) or "<top-level forward>"


def build_inference_graph(
    eval_model: onnx.ModelProto, keep_inputs: list[str], keep_outputs: list[str], weights: Collection[str]
) -> tuple[onnx.ModelProto, list[str]]:
    """A deployable model: Dropout removed, only the wanted inputs/outputs, weights no longer inputs.

    Inputs outside ``keep_inputs`` (a label read only by the loss) are dropped when nothing the
    kept outputs need reads them.

    Returns:
        The model, and the names of ``weights`` it reads: they are to become its initializers
        (``_onnx_files.save_with_weights`` adds them one at a time as it writes the file); the
        model holds none of their values.
    """
    model = copy.deepcopy(eval_model)
    graph = model.graph
    rename = _dropout_bypasses(graph.node, set())
    nodes = [node for node in graph.node if not (node.output and node.output[0] in rename)]
    for node in nodes:
        node.input[:] = [_source(name, rename) for name in node.input]
    outputs = [o for o in graph.output if o.name in keep_outputs]
    nodes += _output_identities([o.name for o in outputs], rename)
    needed = set(o.name for o in outputs)
    live = _live_nodes(nodes, needed)
    for node in live:  # trim optional outputs (LayerNorm stats, Dropout masks) nobody reads
        while len(node.output) > 1 and node.output[-1] not in needed and node.op_type in (
            "LayerNormalization", "BatchNormalization"
        ):
            node.output.pop()
    values = [*graph.input, *graph.value_info, *graph.output]
    # (a stock InferenceSession has no ort_trainer operators)
    live = standard_ctc(live, {v.name: v.type.tensor_type.elem_type for v in values})
    live = standard_lstm(live, {v.name: _shape(v.type.tensor_type) for v in values}, onnx_opset(model))
    del graph.node[:]
    graph.node.extend(live)
    used = {node.domain for node in live}
    kept_opsets = [o for o in model.opset_import if o.domain != TORCH_OPS_DOMAIN or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept_opsets)
    # the wanted inputs, and any other data input the kept outputs still read; weights become initializers
    new_inputs = [i for i in graph.input if i.name in keep_inputs or (i.name in needed and i.name not in weights)]
    del graph.input[:]
    graph.input.extend(new_inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    kept_inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    del graph.value_info[:]
    return model, [name for name in weights if name in needed]


def _live_nodes(nodes, needed: set[str]) -> list[onnx.NodeProto]:
    """The nodes (in order) that compute a name in ``needed``, directly or through each other;
    ``needed`` grows by every name they read."""
    live = []
    for node in reversed(list(nodes)):
        if any(o in needed for o in node.output if o):
            live.append(node)
            needed.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraphs (If/Loop) read outer names too
                if attr.type == onnx.AttributeProto.GRAPH:
                    needed |= _outer_names(attr.g)
    live.reverse()
    return live


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    names = set()
    for node in graph.node:
        names.update(i for i in node.input if i)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= _outer_names(attr.g)
    return names


def _shape(tensor_type) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]


def value_info(info: onnx.ValueInfoProto) -> list:
    """``[shape, numpy dtype name]`` of a graph input or output (symbolic dims by name)."""
    tensor_type = info.type.tensor_type
    return [_shape(tensor_type), str(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))]


def largest_tensors(graph: onnx.GraphProto) -> list[tuple[str, list[int], int]]:
    """``(name, shape, elements)`` of every value of ``graph`` whose shape is fully known (inputs,
    annotated intermediates, outputs, initializers), the largest first."""
    shapes = {info.name: _shape(info.type.tensor_type) for info in [*graph.input, *graph.value_info, *graph.output]
              if info.type.tensor_type.HasField("shape")}
    shapes.update({init.name: list(init.dims) for init in graph.initializer})
    known = [(name, shape, math.prod(shape)) for name, shape in shapes.items() if all(isinstance(d, int) for d in shape)]
    return sorted(known, key=lambda t: -t[2])


def io_signature(graph: onnx.GraphProto) -> tuple[list, list]:
    """A graph's inputs and outputs as ``[[name, shape, dtype], ...]`` lists."""
    return ([[i.name, *value_info(i)] for i in graph.input], [[o.name, *value_info(o)] for o in graph.output])


def dangling_names(graph: onnx.GraphProto, outer: Collection[str] = ()) -> list[str]:
    """What ``graph`` reads before anything defines it (ONNX lists nodes in an order that runs them),
    one problem per node, and outputs no node gives (``outer``: names of enclosing graphs)."""
    defined = set(outer) | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {i.values.name for i in graph.sparse_initializer}
    problems = []
    for node in graph.node:
        missing = [name for name in node.input if name and name not in defined]
        if missing:
            problems.append(f"node {node.name or node.op_type!r} reads {missing}, which nothing defines before it")
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                problems += dangling_names(sub, defined)
        defined.update(node.output)
    problems += [f"output {o.name!r} is produced by no node" for o in graph.output if o.name not in defined]
    return problems


__all__ = ["RANDOM_OPS", "build_inference_graph", "compacted", "dangling_names", "drop_dead_nodes", "drop_outputs",
           "eval_part", "io_signature", "largest_tensors", "module_of", "specialize", "sum_into_inputs", "value_info"]

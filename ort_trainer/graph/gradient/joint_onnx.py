"""The ONNX side of the torch-autograd gradient source: an ATen program to a standard ONNX graph.

Every use of private torch APIs (``torch.export``'s joint tracing, the ONNX exporter's
translator) is in the two functions ``joint_program`` and ``program_to_onnx`` (with
``joint_flatten``, which ``joint_program`` uses, and the exporter's operator tables, which
``eval_program`` reads too); torch is pinned and
``tests/test_torch_autograd.py`` exercises both on every model it checks.

Why not ``torch.onnx.export`` of a module wrapping the joint graph: that traces the program two
more times (``torch.export`` of the wrapper, then ``run_decompositions`` with the exporter's
table), which took 40+ s for the BERT-like benchmark model. Here the exporter's decomposition
table is applied during the one joint trace, and the traced program goes straight to the
exporter's FX-to-ONNX translation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from typing import Collection, Iterator, Sequence

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ..export.torchscript import ExportError
from ..onnx_graph import compacted
from ..passes.dropout import keep_dropouts
from .backward_decompositions import DECOMPOSITIONS, FORWARD
from . import attention_ops, batch_norm_ops, conv_ops, ctc_ops, exporter_fixes, kernel_ops, linalg_ops, lstm_ops
from .joint_flatten import flattened_in_place
from .promotion import insert_type_promotions
from .torch_export import without_stack_traces

ONNX_OPSET = 18  # what torchlib emits; onnxruntime 1.19.2 reads opsets <= 21
ONNX_IR_VERSION = 10  # onnxruntime 1.19.2 reads IR versions <= 10
_TEMPORARY_ATTRIBUTE = "_ort_trainer_node_id"


class UnsupportedOperatorError(ExportError):
    """An operator of the joint program has no ONNX translation; the message names it."""


@functools.lru_cache(maxsize=1)
def _registry_and_tables() -> tuple:
    """The exporter's op registry (``exporter_registry``: signatures inferred on demand); its
    decomposition table (ops it has no translation for); that table on top of core ATen's (once per
    process)."""
    from torch._decomp import core_aten_decompositions, decomposition_table
    from torch.onnx._internal.exporter import _decomp

    from .exporter_registry import lazy_torchlib_registry

    with _quiet_exporter():
        registry = lazy_torchlib_registry()
    exporter_fixes.register_translations(registry)  # where torchlib's own translate wrongly (aten.copy)
    kernel_ops.register_translations(registry)  # the operators of ort_trainer's own kernels
    attention_ops.register_translations(registry)  # torch's attention kernels (kernels/torch_ops.py)
    ctc_ops.register_translations(registry)  # torch's CTC kernels (kernels/torch_ops.py)
    lstm_ops.register_translations(registry)  # oneDNN's LSTM kernels (kernels/torch_ops.py)
    conv_ops.register_translations(registry)  # a convolution's backward by torch's kernels (kernels/torch_ops.py)
    batch_norm_ops.register_translations(registry)  # training-mode batch norm by torch's kernels (the same)
    linalg_ops.register_translations(registry)  # inverses and determinants (export/linalg.py)
    onnx_table = _decomp.create_onnx_friendly_decomposition_table(set(_decomp.get_onnx_implemented_overloads(registry)))
    # torchlib translates training-mode batch norm in inference mode (running statistics, never
    # updated): decompose it into the batch-statistics arithmetic torch itself runs
    aten = torch.ops.aten
    onnx_table.update({op: decomposition_table[op] for op in (
        aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats, aten.native_batch_norm.default)})
    onnx_table.update({op: DECOMPOSITIONS[op] for op in FORWARD})  # ``cumprod`` without ``prims.prod``
    return registry, onnx_table, {**core_aten_decompositions(), **onnx_table, **DECOMPOSITIONS}


def joint_program(program: torch.export.ExportedProgram, loss_index: int,
                  keep: Collection = ()) -> torch.export.ExportedProgram:
    """Forward + backward of ``program`` (autograd through the loss output ``loss_index``).

    What ``torch.export.experimental._export_forward_backward`` does, with the decomposition table
    extended by the exporter's own (so the result needs no second decomposition pass before ONNX
    translation), without its defensive copy of the graph, and without the second trace of the
    joint graph that only flattens its calling convention (``joint_flatten``). Operators in ``keep``
    stay undecomposed, for a pass that rewrites them before translation (``torch_gelu.KEPT``).
    """
    from torch.export.exported_program import _decompose_exported_program
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The math attention: autograd then differentiates matmuls and a softmax, where the CPU flash
    # kernel's backward has no ONNX translation (and its strides broke GPT-2's views when traced).
    with sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings(), flattened_in_place(), without_stack_traces():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own use of its deprecated pytree API
        table = _registry_and_tables()[2]
        if keep:
            table = {op: decomposition for op, decomposition in table.items() if op not in keep}
        return _decompose_exported_program(program, cia_to_decomp={}, python_decomp_table=table,
                                           joint_loss_index=loss_index, decompose_custom_triton_ops=False)


def program_to_onnx(
    program: torch.export.ExportedProgram,
    inputs: dict[str, str],
    constants: dict[str, torch.Tensor],
    outputs: Sequence[tuple[str, str]],
    input_dims: dict[str, Sequence],
    optimize: bool,
) -> onnx.ModelProto:
    """Translate a decomposed program to ONNX with every placeholder a graph input or constant.

    Args:
        program: a program whose operators all have ONNX translations (``joint_program``,
            ``eval_program.forward_program``). Its graph is edited in place.
        inputs: ``{placeholder name: ONNX input name}``, in the order of the ONNX inputs; a
            placeholder in neither ``inputs`` nor ``constants`` must be unused (it is dropped).
        constants: ``{placeholder name: value}`` of placeholders that become initializers.
        outputs: ``(FX node name, ONNX output name)`` per ONNX output, in order; the rest of the
            program's outputs, and what only they need, are dropped.
        input_dims: ``{ONNX input: description shape}``: the exporter's symbols (s0, s1...) on
            those inputs take the description's names, everywhere in the graph.
        optimize: run onnxscript's whole optimizer (its rewriter takes seconds) instead of constant
            folding and common-subexpression elimination only.

    Returns:
        The ONNX model (opset ``ONNX_OPSET``, IR version ``ONNX_IR_VERSION``), ScatterND(add)
        rewritten (``scatter_nd_add_to_scatter_elements``), every training-mode Dropout's mask read
        (``dropout.keep_dropouts``: ONNX Runtime 1.31 removes a Dropout whose mask is unread).
    """
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                              TensorArgument)
    from torch.onnx._internal.exporter import _core, _fx_passes

    registry = _registry_and_tables()[0]
    gm = program.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    gm.graph.output_node().args = (tuple(nodes[source] for source, _ in outputs),)
    gm.graph.eliminate_dead_code()
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        if not node.users and node.name not in inputs:
            gm.graph.erase_node(node)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    specs = [InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name), f"__const.{name}") if name in constants
             else InputSpec(InputKind.USER_INPUT, TensorArgument(name), None) for name in placeholders]
    signature = ExportGraphSignature(specs, [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(n.name), None)
                                             for n in gm.graph.output_node().args[0]])
    flat = torch.export.ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=signature, state_dict={},
        range_constraints=program.range_constraints, module_call_graph=[],
        constants={f"__const.{name}": value for name, value in constants.items() if name in placeholders})
    with _quiet_exporter(), _one_signature_per_schema():
        insert_type_promotions(flat.graph_module)
        flat._graph_module = _fx_passes.remove_assertion_nodes(flat.graph_module)
        try:
            model = _core._exported_program_to_onnx_program(flat, registry=registry, lower="at_conversion").model
        except Exception as exc:  # the exporter's errors name the FX node; say which operator and what to do
            missing = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>",
                                f"{exc} {exc.__cause__}")
            if missing is None:
                raise
            raise UnsupportedOperatorError(
                f"torch's ONNX exporter has no translation for {missing.group(1)}.{missing.group(2)}, which the "
                "model's forward or backward uses; rewrite that part of the model with other torch operations, "
                "or use the gradient source of the onnxruntime-training 1.19.2 build (pip install -e "
                "'.[training]')") from exc
    _name_inputs_and_outputs(model, inputs, [name for _, name in outputs], input_dims)
    _layer_norms_in_the_weights_type(model)
    _optimize(model, full=optimize)
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)
    proto.ir_version = ONNX_IR_VERSION
    scatter_nd_add_to_scatter_elements(proto)
    keep_dropouts(proto)
    return compacted(proto)  # kept by the trace for later builds (onnx_graph.compacted)


def _layer_norms_in_the_weights_type(model) -> int:
    """Give every ``LayerNormalization`` whose input type differs from its scale's (mixed precision:
    a half-precision input, float32 weights) an input cast to the scale's type and its output cast
    back, in place; returns how many.

    torch's layer norm takes such a pair as it is: it computes in float32 with the float32 weights
    and returns the input's type (under autocast, e.g. a LayerNorm straight after a float16 GELU,
    the BERT masked-LM head). torchlib writes one ``LayerNormalization`` of both types, which ONNX
    does not allow (one type T for X, Scale and B): ONNX Runtime refuses the graph. The casts are
    torch's computation: float32 normalisation and affine, rounded once to the input's type.
    """
    import onnx_ir as ir

    changed = 0
    for node in list(model.graph):
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        x, scale = node.inputs[0], node.inputs[1]
        if x is None or scale is None or x.dtype is None or scale.dtype is None or x.dtype == scale.dtype:
            continue
        cast_in = ir.node("Cast", [x], {"to": scale.dtype}, name=f"{node.name}_input_cast")
        cast_in.outputs[0].dtype, cast_in.outputs[0].shape = scale.dtype, x.shape
        cast_in.outputs[0].name = f"{x.name}_as_{scale.dtype.name.lower()}"
        node.replace_input_with(0, cast_in.outputs[0])
        model.graph.insert_before(node, cast_in)
        stash = node.attributes.get_int("stash_type", 1)
        produced = [scale.dtype] + [ir.DataType(stash)] * (len(node.outputs) - 1)
        for value, dtype in zip(node.outputs, produced):  # each output back to the type torch gives it
            if value.dtype is None or value.dtype == dtype:
                continue
            users = list(value.uses())
            cast_out = ir.node("Cast", [value], {"to": value.dtype}, name=f"{value.name}_cast")
            result = cast_out.outputs[0]
            result.dtype, result.shape = value.dtype, value.shape
            for user, index in users:
                user.replace_input_with(index, result)
            model.graph.outputs[:] = [result if output is value else output for output in model.graph.outputs]
            result.name, value.name = value.name, f"{value.name}_{dtype.name.lower()}"
            value.dtype = dtype
            model.graph.insert_after(node, cast_out)
        changed += 1
    return changed


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter warns about optional packages (torchvision) and initializers on every call, and onnx_ir
    about an empty list attribute it takes for the integers it is (torchlib's index_put)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _one_signature_per_schema() -> Iterator[None]:
    """The exporter's translation converts the ONNX schema of every node it emits into an
    ``onnx_ir`` signature anew (5443 conversions for GPT-2 small's joint graph: its translation took
    2.7 s with them and 2.0 s without); the conversion depends on the schema alone, so one per
    operator version serves every node. The translated graph is the same, byte for byte, the exporter's per-node
    stack-trace metadata aside (``test_torch_autograd.py``)."""
    from onnx_ir import schemas

    descriptor = schemas.OpSignature.__dict__["from_op_schema"]
    convert = schemas.OpSignature.from_op_schema
    made = {}

    def from_op_schema(schema):
        key = (schema.domain, schema.name, schema.since_version)
        if key not in made:
            made[key] = convert(schema)
        return made[key]

    schemas.OpSignature.from_op_schema = staticmethod(from_op_schema)
    try:
        yield
    finally:
        schemas.OpSignature.from_op_schema = descriptor


def _name_inputs_and_outputs(model, inputs: dict[str, str], outputs: list[str],
                             input_dims: dict[str, Sequence]) -> None:
    """Give the ONNX inputs and outputs their names, in order; symbolic dims their names."""
    import onnx_ir as ir

    graph = model.graph
    wanted = set(inputs.values()) | set(outputs)
    by_placeholder = {v.name: v for v in graph.inputs}
    graph_inputs = [by_placeholder[p] for p in inputs if p in by_placeholder]
    taken = {id(v) for v in graph_inputs}
    # internal values that happen to carry a wanted name make room first
    internal = [v for node in graph for v in node.outputs] + list(graph.initializers.values())
    for index, value in enumerate(internal):
        if value.name in wanted and id(value) not in taken:
            value.name = f"{value.name}__{index}"
    for initializer in list(graph.initializers):
        value = graph.initializers[initializer]
        if value.name != initializer:
            graph.initializers.pop(initializer)
            graph.initializers[value.name] = value
    for placeholder, value in zip([p for p in inputs if p in by_placeholder], graph_inputs):
        value.name = inputs[placeholder]
    graph.inputs.clear()
    graph.inputs.extend(graph_inputs)
    seen: set[int] = set(taken)
    for index, (value, name) in enumerate(zip(list(graph.outputs), outputs)):
        if id(value) in seen or value.is_initializer() or value.name in {o.name for o in graph_inputs}:
            # one value under two names (an input returned as is, an output listed twice)
            copy = ir.Value(name=name, type=value.type, shape=value.shape)
            graph.append(ir.node("Identity", inputs=[value], outputs=[copy]))
            graph.outputs[index] = copy
        else:
            value.name = name
            seen.add(id(value))
    dim_names = {}
    for value in graph_inputs:
        for dim, wanted_dim in zip(value.shape or (), input_dims.get(value.name, ())):
            if isinstance(dim, ir.SymbolicDim) and dim.value and isinstance(wanted_dim, str):
                dim_names.setdefault(dim.value, wanted_dim)
    if dim_names:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(dim_names, key=len, reverse=True))) + r")\b")
        for value in [*graph.inputs, *(v for node in graph for v in node.outputs)]:
            if value.shape is None:
                continue
            dims = [ir.SymbolicDim(pattern.sub(lambda m: dim_names[m.group(1)], d.value))
                    if isinstance(d, ir.SymbolicDim) and d.value else d for d in value.shape]
            value.shape = ir.Shape(dims)


def _optimize(model, full: bool) -> None:
    """Fold constants and merge common subexpressions (no two Dropouts: each draws its own mask)."""
    import onnx_ir as ir
    from onnx_ir.passes import common as common_passes
    from onnxscript import optimizer
    from onnxscript.optimizer import _constant_folding

    dropouts = [node for node in model.graph if node.op_type == "Dropout"]
    for index, node in enumerate(dropouts):  # CSE compares attributes: keep every Dropout distinct
        node.attributes[_TEMPORARY_ATTRIBUTE] = ir.AttrInt64(_TEMPORARY_ATTRIBUTE, index)
    with _quiet_exporter():
        if full:
            optimizer.optimize_ir(model)
        else:
            ir.passes.PassManager([
                _constant_folding.FoldConstantsPass(
                    shape_inference=False, input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                    should_fold=functools.partial(_unless_expanded_past,
                                                  _constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT)),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.CommonSubexpressionEliminationPass(),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1024),
            ])(model)
    for node in model.graph:
        if node.op_type == "Dropout":
            node.attributes.pop(_TEMPORARY_ATTRIBUTE, None)


def _unless_expanded_past(limit: int, node) -> bool | None:
    """``False`` (not folded) for an ``Expand`` of constants whose result has more than ``limit``
    elements, else ``None`` (the folder's own rules). The folder would evaluate it and then drop the
    result for its size (``_prepare_folded_tensor``): 17 such expansions of GPT-2 small's joint
    graph (zero and one tensors the size of the logits or a weight) took ~0.6 s of its cold build."""
    if node.op_type != "Expand" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    data, shape = (value.const_value if value is not None else None for value in node.inputs)
    if data is None or shape is None:
        return None
    try:
        size = int(np.prod(np.broadcast_shapes(tuple(data.shape), tuple(int(d) for d in shape.numpy().reshape(-1)))))
    except ValueError:  # not broadcastable: the folder's evaluation reports it
        return None
    # the folder keeps a large result only where it replaces inputs as large, read by this node alone
    replaced = sum(v.const_value.size for v in node.inputs if v is not None and len(v.uses()) == 1)
    return False if size > limit and size > replaced else None


def scatter_nd_add_to_scatter_elements(model: onnx.ModelProto) -> int:
    """Rewrite every ``ScatterND(reduction="add")`` as ``ScatterElements(axis=0, reduction="add")``, in place.

    ONNX Runtime's multi-threaded CPU ScatterND(add) races on duplicate indices (wrong embedding
    gradients now and then, in 1.19.2 and 1.31.1 alike); ScatterElements(add) does not. The index
    tuple of the first ``K`` axes becomes one linear index into ``data`` reshaped to
    ``[-1, *data.shape[K:]]``, expanded over the row it adds.

    Returns:
        How many nodes were rewritten.
    """
    targets = [n for n in model.graph.node if n.op_type == "ScatterND"
               and any(a.name == "reduction" and a.s == b"add" for a in n.attribute)]
    if not targets:
        return 0
    ranks = _ranks(model, [name for node in targets for name in node.input[:2]])
    nodes = list(model.graph.node)
    initializers = []
    for count, node in enumerate(targets):
        data, indices, updates = node.input
        rank, index_shape = ranks.get(data), ranks.get(f"{indices}#shape")
        if rank is None or not index_shape or not isinstance(index_shape[-1], int):
            raise RuntimeError(f"cannot rewrite ScatterND node {node.name!r}: the rank of {data!r} or the last "
                               f"dimension of {indices!r} is unknown")
        k = index_shape[-1]
        p = f"{node.name or 'scatter_nd'}/{count}/"
        new, consts = _scatter_elements_nodes(p, data, indices, updates, node.output[0], rank, k,
                                              ranks.get(f"{data}#shape"))
        initializers.extend(consts)
        at = nodes.index(node)
        nodes[at:at + 1] = new
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(initializers)
    return len(targets)


def _scatter_elements_nodes(p: str, data: str, indices: str, updates: str, output: str, rank: int,
                            k: int, dims: list | None = None) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    def const(name: str, values: list[int]) -> str:
        consts.append(numpy_helper.from_array(np.array(values, dtype=np.int64), p + name))
        return p + name

    consts: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    flat_data, flat_rank = data, rank
    if k == 1:
        linear = p + "linear"
        nodes.append(helper.make_node("Reshape", [indices, const("index_shape", [-1] + [1] * (rank - 1))], [linear]))
    else:
        # index (..., k) -> sum_j index_j * stride_j, negatives wrapped per axis as ScatterND does
        lead = p + "lead"
        nodes += [
            helper.make_node("Shape", [data], [p + "data_shape"]),
            helper.make_node("Slice", [p + "data_shape", const("zero", [0]), const("k", [k])], [lead]),
            helper.make_node("Less", [indices, const("zero_scalar", [0])], [p + "negative"]),
            helper.make_node("Cast", [p + "negative"], [p + "negative_i"], to=onnx.TensorProto.INT64),
            helper.make_node("Mul", [p + "negative_i", lead], [p + "wrap"]),
            helper.make_node("Add", [indices, p + "wrap"], [p + "wrapped"]),
        ]
        strides = []
        for j in range(k):
            if j == k - 1:
                strides.append(const("one", [1]))
                continue
            tail = p + f"tail{j}"
            nodes += [helper.make_node("Slice", [lead, const(f"from{j}", [j + 1]), const(f"to{j}", [k])], [tail]),
                      helper.make_node("ReduceProd", [tail], [p + f"stride{j}"], keepdims=1)]
            strides.append(p + f"stride{j}")
        nodes += [helper.make_node("Concat", strides, [p + "strides"], axis=0),
                  helper.make_node("Mul", [p + "wrapped", p + "strides"], [p + "scaled"]),
                  helper.make_node("ReduceSum", [p + "scaled", const("last", [-1])], [p + "linear_index"], keepdims=1)]
        flat_rank = rank - k + 1
        flat_data = p + "flat_data"
        nodes += [helper.make_node("Shape", [data], [p + "rest"], start=k),
                  helper.make_node("Concat", [const("minus_one", [-1]), p + "rest"], [p + "flat_shape"], axis=0),
                  helper.make_node("Reshape", [data, p + "flat_shape"], [flat_data])]
        linear = p + "linear"
        index_shape = const("index_shape", [-1] + [1] * (flat_rank - 1))
        nodes.append(helper.make_node("Reshape", [p + "linear_index", index_shape], [linear]))
    # a row's dims: data's after the k indexed ones, a constant where they are static (a Shape would keep data, a
    # zero table as large as the embedding's, alive for its dims alone once tied_embedding_gradient takes the sum)
    if dims and all(isinstance(size, int) for size in dims[k:]):
        row_shape = const("row_shape", list(dims[k:]))
    else:
        row_shape = p + "row_shape"
        nodes.append(helper.make_node("Shape", [flat_data], [row_shape], start=1))
    nodes += [
        helper.make_node("Concat", [const("minus_one_u", [-1]), row_shape], [p + "update_shape"], axis=0),
        helper.make_node("Reshape", [updates, p + "update_shape"], [p + "flat_updates"]),
        helper.make_node("Shape", [p + "flat_updates"], [p + "expanded_shape"]),
        helper.make_node("Expand", [linear, p + "expanded_shape"], [p + "expanded_index"]),
    ]
    scattered = output if k == 1 else p + "scattered"
    nodes.append(helper.make_node("ScatterElements", [flat_data, p + "expanded_index", p + "flat_updates"],
                                  [scattered], name=p + "ScatterElements", axis=0, reduction="add"))
    if k > 1:
        nodes.append(helper.make_node("Reshape", [scattered, p + "data_shape"], [output]))
    return nodes, consts


def _ranks(model: onnx.ModelProto, names: list[str]) -> dict:
    """``{name: rank, name + "#shape": dims}`` of the named values, from value_info (or shape inference)."""
    def collect(graph: onnx.GraphProto) -> dict:
        found = {}
        for info in [*graph.input, *graph.value_info, *graph.output]:
            if info.name in names and info.type.tensor_type.HasField("shape"):
                shape = info.type.tensor_type.shape
                dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in shape.dim]
                found[info.name], found[info.name + "#shape"] = len(dims), dims
        for init in graph.initializer:
            if init.name in names:
                found[init.name], found[init.name + "#shape"] = len(init.dims), list(init.dims)
        return found

    found = collect(model.graph)
    if any(n not in found for n in names):
        found.update(collect(onnx.shape_inference.infer_shapes(model).graph))
    return found

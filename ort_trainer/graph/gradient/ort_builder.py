"""The gradient graph of ONNX Runtime's GradientGraphBuilder, and the eval/inference graphs.

All weights become graph inputs, so the graphs hold no weight values: the engine binds the
weights it owns, and the cached graphs are independent of the initial weights.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ..._logging import logger, ort_severity
from ..export.guard import STOP_GRADIENT_DOMAIN, STOP_GRADIENT_OP
from ..names import ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, GRAD_SUFFIX, LOSS_SCALE_INPUT, RESET_INPUT
from ..onnx_graph import _outer_names, module_of


class GradientBuildError(RuntimeError):
    """ONNX Runtime could not build the backward graph; the message names the op and module."""


def weights_to_inputs(model: onnx.ModelProto, weight_names: list[str]) -> dict[str, np.ndarray]:
    """Move the named initializers to graph inputs, in place; return their values."""
    wanted = set(weight_names)
    values, kept = {}, []
    for init in model.graph.initializer:
        if init.name in wanted:
            values[init.name] = numpy_helper.to_array(init)
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return values


def _session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = ort_severity()
    return options


def build_gradient_graph(
    forward: onnx.ModelProto, trainable: list[str], loss_name: str, output_names: list[str],
    extra_outputs: list[str] = (),
) -> tuple[onnx.ModelProto, list[str]]:
    """Build forward + backward from a forward graph whose weights are inputs.

    The backward pass starts from ``loss * __loss_scale`` (a scalar input: the loss scaler's
    value, 1.0 without one); the ``loss`` output itself stays unscaled. No gradient flows through
    a ``StopGradient`` marker (``detach``/``no_grad`` in the torch model); in the result the
    markers are ``Identity`` nodes. Weights the loss does not reach are left out.

    Returns:
        The gradient model, with outputs ``[*output_names, *(w + "_grad" for w in has_grad),
        *extra_outputs]``, and ``has_grad``: the trainable weights the loss depends on, in
        ``trainable`` order.

    Raises:
        GradientBuildError: naming the op (and module) the gradient builder cannot handle.
    """
    # only the 1.19.2 training build has the builder (gradient source "onnxruntime")
    from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

    options = _session_options()
    scaled = copy.deepcopy(forward)
    scaled_loss = f"{loss_name}.scaled"
    scaled.graph.input.append(helper.make_tensor_value_info(LOSS_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    scaled.graph.node.append(helper.make_node("Mul", [loss_name, LOSS_SCALE_INPUT], [scaled_loss], name="loss_scaling"))
    scaled.graph.output.append(helper.make_tensor_value_info(scaled_loss, onnx.TensorProto.FLOAT, []))
    cuts = _cut_stop_gradients(scaled)
    reached = _inputs_reaching(scaled.graph, scaled_loss)
    candidates = [w for w in trainable if w in reached]
    _refuse_reduced_scatters(scaled.graph, reached, set(candidates))
    _reversed_slices_before_a_trailing_pair(scaled.graph, reached)
    while True:
        try:
            optimized = get_optimized_model(scaled.SerializeToString(), set(candidates), options)
            builder = GradientGraphBuilder(optimized, {scaled_loss}, set(candidates), scaled_loss, options)
            builder.build()
            break
        except Exception as exc:  # pybind raises RuntimeError/Fail subclasses
            unreachable = re.search(r"partial derivative for '(.+?)' as it's unreachable", str(exc))
            if unreachable is None or unreachable.group(1) not in candidates:
                raise GradientBuildError(_explain_gradient_failure(str(exc), forward)) from exc
            # reachable through edges that carry no gradient (a Shape, an index): no gradient either
            candidates.remove(unreachable.group(1))
    model = onnx.load_from_string(builder.get_model())
    _reconnect_cuts(model, cuts)
    produced = {o.name: o for o in model.graph.output}
    has_grad = [w for w in trainable if w + GRAD_SUFFIX in produced]
    ordered = [produced[n] for n in [*output_names, *(w + GRAD_SUFFIX for w in has_grad), *extra_outputs]]
    del model.graph.output[:]
    model.graph.output.extend(ordered)
    return model, has_grad


def stop_gradients_to_identity(model: onnx.ModelProto) -> int:
    """Turn every ``StopGradient`` marker of ``model`` into ``Identity``, in place; returns how many."""
    count = 0
    for node in model.graph.node:
        if _is_stop_gradient(node):
            node.op_type, node.domain = "Identity", ""
            del node.attribute[:]
            count += 1
    kept = [o for o in model.opset_import if o.domain != STOP_GRADIENT_DOMAIN]
    if len(kept) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return count


def _is_stop_gradient(node: onnx.NodeProto) -> bool:
    return node.domain == STOP_GRADIENT_DOMAIN and node.op_type == STOP_GRADIENT_OP


def _cut_stop_gradients(model: onnx.ModelProto) -> dict[str, str]:
    """Remove the markers: each output becomes a graph input, so no gradient flows through it.

    The marker's input becomes an extra graph output so the optimizer keeps it under its name.
    Returns ``{marker output: marker input}`` for ``_reconnect_cuts``.
    """
    markers = [n for n in model.graph.node if _is_stop_gradient(n)]
    if not markers:
        return {}
    probe = copy.deepcopy(model)
    stop_gradients_to_identity(probe)
    del probe.graph.value_info[:]
    inferred = onnx.shape_inference.infer_shapes(probe)
    types = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    graph_inputs = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    cuts = {}
    for node in markers:
        source, target = node.input[0], node.output[0]
        cuts[target] = source
        known = types.get(target) or types.get(source)
        value = copy.deepcopy(known) if known is not None else helper.make_empty_tensor_value_info(target)
        value.name = target
        model.graph.input.append(value)
        if source not in graph_inputs and source not in outputs:
            kept = copy.deepcopy(known) if known is not None else helper.make_empty_tensor_value_info(source)
            kept.name = source
            model.graph.output.append(kept)
            outputs.add(source)
    kept_nodes = [n for n in model.graph.node if not _is_stop_gradient(n)]
    del model.graph.node[:]
    model.graph.node.extend(kept_nodes)
    logger.debug("gradient stops (detach / no_grad) at: %s", sorted(cuts.values()))
    return cuts


def _reconnect_cuts(model: onnx.ModelProto, cuts: dict[str, str]) -> None:
    """Feed each cut from its source again with an ``Identity``, in place; nodes re-sorted."""
    if not cuts:
        return
    inputs = [i for i in model.graph.input if i.name not in cuts]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.node.extend(helper.make_node("Identity", [source], [target], name=f"{target}/stop_gradient")
                            for target, source in cuts.items())
    _sort_nodes(model.graph)


def _refuse_reduced_scatters(graph: onnx.GraphProto, reached: set[str], trained: set[str]) -> None:
    """Raise where the loss's gradient would pass a ``ScatterElements`` / ``ScatterND`` with a reduction
    (``scatter_add``, ``index_add``, ``scatter_reduce``): ONNX Runtime's gradient of them is the plain scatter's,
    which ignores the reduction (its input's gradient zeroed where updates land), so training would go wrong
    silently (a loss 0.7-2.4% off PyTorch's within 3 steps)."""
    modules = set()
    for node in graph.node:
        reduction = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "reduction"), b"none")
        if node.op_type not in ("ScatterElements", "ScatterND") or reduction in (b"none", "none") \
                or node.output[0] not in reached:
            continue
        if any(trained & _inputs_reaching(graph, node.input[i]) for i in (0, 2) if len(node.input) > i):
            modules.add(f"{module_of(node.name)} ({node.op_type}, reduction {reduction.decode()})")
    if modules:
        raise GradientBuildError(
            f"ONNX Runtime's gradient of a scatter with a reduction ignores the reduction, so training would be "
            f"wrong (in module {', '.join(sorted(modules))}: scatter_add, index_add, scatter_reduce). Train this "
            "model with graph.gradient_source='torch' (PyTorch's autograd), or freeze the weights that feed it "
            "(utils.frozen_weights).")


def _reversed_slices_before_a_trailing_pair(graph: onnx.GraphProto, reached: set[str]) -> None:
    """Slice each ``Slice`` with a constant negative step that the loss's gradient passes off a trailing pair of
    copies, in place.

    ONNX Runtime's ``SliceGrad`` fails inside the step ("narrowing_error") where a negative step is on an axis
    followed only by axes of size 1, as TorchScript's ``torch.flip(x, [-1])`` (a ``Slice`` from -1 by step -1).
    Sliced as ``Squeeze(Slice(Slice(Expand(Unsqueeze(x, -1), [2])), 0:1 on the last axis), -1)`` instead, negative
    axes one further from the end: the same values, and the gradient through the unused copy is zero (a sum with
    0, exact). The flipped tensor is held twice within the step, on this gradient source only."""
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    nodes = []
    for node in graph.node:
        steps = constants.get(node.input[4]) if node.op_type == "Slice" and len(node.input) > 4 else None
        axes = constants.get(node.input[3]) if steps is not None and node.input[3] else np.arange(len(steps or ()))
        if steps is None or (steps > 0).all() or axes is None or node.output[0] not in reached:
            nodes.append(node)
            continue
        name = node.name
        values = {"last_axis": [-1], "two": [2], "zero": [0], "one": [1],
                  "axes": np.where(axes < 0, axes - 1, axes)}
        const = {key: f"{name}/{key}" for key in values}
        sliced = copy.deepcopy(node)
        sliced.input[0], sliced.output[0] = f"{name}/pair", f"{name}/sliced"
        if node.input[3]:
            sliced.input[3] = const["axes"]
        nodes += [helper.make_node("Constant", [], [const[key]], name=const[key],
                                   value=numpy_helper.from_array(np.asarray(value, np.int64)))
                  for key, value in values.items()]
        nodes += [helper.make_node("Unsqueeze", [node.input[0], const["last_axis"]], [f"{name}/unsqueezed"],
                                   name=f"{name}/Unsqueeze"),
                  helper.make_node("Expand", [f"{name}/unsqueezed", const["two"]], [f"{name}/pair"],
                                   name=f"{name}/Expand"),
                  sliced,
                  helper.make_node("Slice", [f"{name}/sliced", const["zero"], const["one"], const["last_axis"]],
                                   [f"{name}/first"], name=f"{name}/first"),
                  helper.make_node("Squeeze", [f"{name}/first", const["last_axis"]], [node.output[0]],
                                   name=f"{name}/Squeeze")]
    del graph.node[:]
    graph.node.extend(nodes)


def _inputs_reaching(graph: onnx.GraphProto, output: str) -> set[str]:
    """Names of graph inputs (and initializers) that ``output`` is computed from."""
    producer = {name: node for node in graph.node for name in node.output if name}
    seen, stack = set(), [output]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            continue
        stack.extend(i for i in node.input if i)
        for attr in node.attribute:  # subgraphs (If/Loop) read outer names too
            if attr.type == onnx.AttributeProto.GRAPH:
                stack.extend(_outer_names(attr.g))
    return seen


def _sort_nodes(graph: onnx.GraphProto) -> None:
    """Order ``graph.node`` topologically (stable: nodes keep their order where they can)."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    needs = []
    for node in graph.node:
        names = [i for i in node.input if i]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names.extend(_outer_names(attr.g))
        needs.append({producer[n] for n in names if n in producer})
    order, placed, visiting = [], set(), set()
    for start in range(len(graph.node)):
        stack = [(start, False)]
        while stack:
            index, expanded = stack.pop()
            if index in placed:
                continue
            if expanded:
                placed.add(index)
                order.append(index)
                continue
            if index in visiting:
                continue
            visiting.add(index)
            stack.append((index, True))
            stack.extend((d, False) for d in sorted(needs[index], reverse=True) if d not in placed)
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)


def add_gradient_accumulation(model: onnx.ModelProto, trained: list[str]) -> None:
    """Accumulate each gradient into a buffer input instead of returning it, in place.

    Every ``w_grad`` output is replaced by an ``InPlaceAccumulatorV2`` that adds it into the
    input ``w_grad.accumulation.buffer`` (overwriting instead when the bool input
    ``__lazy_reset_grad`` is true, on the first micro-batch of a window); the node's flag output
    ``w_grad.accumulation.out`` takes the gradient's place among the outputs.
    """
    grads = {w + GRAD_SUFFIX: w for w in trained}
    outputs = []
    for output in model.graph.output:
        weight = grads.get(output.name)
        if weight is None:
            outputs.append(output)
            continue
        buffer = copy.deepcopy(output)
        buffer.name = weight + ACCUMULATOR_SUFFIX
        model.graph.input.append(buffer)
        flag = weight + ACCUMULATED_FLAG_SUFFIX
        model.graph.node.append(helper.make_node(
            "InPlaceAccumulatorV2", [buffer.name, output.name, RESET_INPUT], [flag],
            name=f"accumulate_{weight}", domain="com.microsoft",
        ))
        outputs.append(helper.make_tensor_value_info(flag, onnx.TensorProto.BOOL, [1]))
    model.graph.input.append(helper.make_tensor_value_info(RESET_INPUT, onnx.TensorProto.BOOL, [1]))
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _explain_gradient_failure(message: str, forward: onnx.ModelProto) -> str:
    loop = re.search(r'\("([^"]*)", Loop,', message)
    if loop:  # the builder's graph check fails on a Loop whose body reads a weight
        return (f"ONNX Runtime's gradient builder cannot differentiate the Loop of module {module_of(loop.group(1))} "
                "(the TorchScript export writes nn.EmbeddingBag, and some operators over a sequence, as a Loop). Train "
                "this model with graph.gradient_source='torch' (PyTorch's autograd), or freeze the weights that feed "
                "it (utils.frozen_weights).")
    repeated = re.search(r"Duplicate definition of name \((.+?)_grad\)", message)
    if repeated:  # one node reading a value twice (torch.cat([zeros, x, zeros])), its only reader
        readers = [n for n in forward.graph.node if list(n.input).count(repeated.group(1)) > 1]
        where = f" (in module {', '.join(sorted({module_of(n.name) for n in readers}))})" if readers else ""
        return (f"ONNX Runtime's gradient builder fails on a node that reads the same value twice{where}, as "
                "torch.cat([zeros, x, zeros]) does (also with two torch.zeros calls, which its optimizer merges); "
                "train this model with graph.gradient_source='torch' (PyTorch's autograd), or pad with "
                "torch.nn.functional.pad, which trains here.")
    registered = re.search(r"has not been registered: (\w+) for node (\S+)", message)
    if registered:
        op, node = registered.group(1), registered.group(2).rstrip(".")
        modules = [module_of(node)]
    else:
        op = next((n.op_type for n in forward.graph.node if re.search(rf"\b{n.op_type}\b", message)), None)
        modules = sorted({module_of(n.name) for n in forward.graph.node if n.op_type == op}) if op else []
    if op is None:
        first = message.strip().splitlines()[0] if message.strip() else "unknown error"
        return f"ONNX Runtime could not build the gradient graph: {first}"
    return (
        f"ONNX Runtime has no gradient for operator {op} (in module {', '.join(modules)}). "
        "Rewrite that part of the model with differentiable operations, freeze the weights that feed it "
        "(utils.frozen_weights), or register a gradient with onnxruntime's register_gradient_definition."
    )


def build_eval_graph(forward: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``forward`` with Dropout off, BatchNormalization in inference mode, no gradient markers."""
    model = copy.deepcopy(forward)
    stop_gradients_to_identity(model)
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
        elif node.op_type == "BatchNormalization":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
            del node.output[1:]
    return model


__all__ = ["GradientBuildError", "add_gradient_accumulation", "build_eval_graph", "build_gradient_graph",
           "stop_gradients_to_identity", "weights_to_inputs"]

"""The graph pipeline: model -> forward -> trainable -> user hook -> gradient + optimizer graphs.

``build_training_graphs`` exports the model on every build and keys the graph cache on a hash of
that exported forward graph, so a hit can never be a graph of other code; a hit skips only the
gradient and eval graph building.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .._logging import logger
from ..model_desc import ModelDescription
from ..optim.config import LambConfig, _OptimizerConfig
from . import cache as graph_cache
from . import rewrites
from .buffers import expose_running_statistics
from .export import export_order, export_torch
from .gradient import (ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, GRAD_SUFFIX, LOSS_SCALE_INPUT, RESET_INPUT,
                       add_gradient_accumulation, build_eval_graph, build_gradient_graph, specialize,
                       stop_gradients_to_identity, weights_to_inputs)
from .input_checks import find_input_constraints
from .optimizer import Segment, build_optimizer_graph, layout_order, make_segments, plan
from .trainable import make_trainable


@dataclass
class TrainingGraphs:
    """Everything the engine needs, independent of weight values.

    Attributes:
        gradient: forward + loss + backward; inputs: data, weights and ``__loss_scale``; outputs:
            the description's outputs in order, then ``<weight>_grad`` for each trained weight
            (with accumulation: the gradients are added into ``<weight>_grad.accumulation.buffer``
            inputs instead, see ``gradient.add_gradient_accumulation``).
        eval: forward only, Dropout off, BatchNorm in inference mode; weights are inputs.
        meta: ``weights`` ({name: [shape, dtype]} of every weight input), ``trained`` (weights
            the optimizer updates, in order), ``torch_keys`` ({weight: [torch state_dict keys]}),
            ``inputs`` ({name: dtype} of the data inputs the graph reads), ``buffer_updates``
            ({buffer: gradient-graph output with its new value}, e.g. BatchNorm statistics).
        from_cache: True when loaded from the graph cache.
        forward: ``(forward graph with weights as inputs, torch_keys, trainable, padding)`` as
            traced, before specialisation; in memory only, so shape specialisations of the same
            job skip the export.

    The optimizer graph is not part of it: ``build_optimizer`` makes it in milliseconds.
    """

    gradient: onnx.ModelProto
    eval: onnx.ModelProto
    meta: dict
    from_cache: bool = False
    forward: tuple | None = None


@dataclass
class GraphJob:
    """The inputs of the pipeline."""

    model: torch.nn.Module | onnx.ModelProto
    loss_fn: Callable | None
    desc: ModelDescription
    optim_config: _OptimizerConfig
    frozen_weights: list[str]
    grad_norm_clip: bool
    opset: int
    extra_postprocess: Callable | None
    save_paths: dict[str, str]
    accumulate: bool = False
    passes: dict = None  # graph_optimizations flags: {pass name: enabled}

    def cache_key(self, forward: tuple, input_dtypes: dict[str, str], dims: dict[str, int] | None,
                  outputs: tuple | None = None) -> str:
        """Hash of the traced forward graph and of everything that shapes the graphs built from it.

        Args:
            forward: ``(graph, torch_keys, trainable, padding)`` from ``_traced_forward``; the
                graph already went through the trainability pass and the user's hook, and its
                weights are graph inputs, so weight values never enter the key.
            input_dtypes: ``{input name: numpy dtype name}`` of the data inputs.
            dims, outputs: as in ``build_training_graphs``.

        Returns:
            The hex SHA-256 key.
        """
        graph, torch_keys, trainable, padding = forward
        return graph_cache.make_key(
            {
                "forward": graph_cache.fingerprint_graph(graph),
                "torch_keys": torch_keys,
                "trainable": list(trainable),
                "padding": sorted(padding.items()),
                "desc": self.desc.fingerprint(),
                "input_dtypes": input_dtypes,
                "frozen": sorted(self.frozen_weights),
                "opset": self.opset,
                "dims": sorted((dims or {}).items()),
                "outputs": list(outputs) if outputs is not None else None,
                "accumulate": self.accumulate,
                "passes": sorted((self.passes or {}).items()),
            }
        )


def build_training_graphs(
    job: GraphJob,
    sample_inputs: Sequence[np.ndarray],
    dims: dict[str, int] | None = None,
    graph_cache_store: graph_cache.GraphCache | None = None,
    forward: tuple | None = None,
    outputs: tuple | None = None,
) -> TrainingGraphs:
    """Build (or load from the cache) the training graphs of ``job``.

    Args:
        job: the model, loss, description, optimizer and graph-shaping options.
        sample_inputs: one array per description input (dtype fixes the graph's input dtype;
            values are used to trace the torch model).
        dims: concrete values of symbolic dimensions to specialise the graphs to (None: keep
            them symbolic).
        graph_cache_store: the cache (default: ``GraphCache()``).
        forward: ``TrainingGraphs.forward`` of an earlier build of the same job, to skip the
            export when specialising shapes (None: export now).
        outputs: the description outputs this graph returns besides the loss (None: all). Leaving
            outputs out lets passes such as ``sparse_labels`` skip work nobody reads.

    Returns:
        The graphs, loaded from the cache when an entry for exactly this traced forward graph
        and these options exists and passes its checks, else built (and stored).

    Raises:
        ExportError, GradientBuildError: when the model cannot be exported or differentiated.
    """
    store = graph_cache_store or graph_cache.GraphCache()
    input_dtypes = {d.name: str(np.asarray(a).dtype) for d, a in zip(job.desc.inputs, sample_inputs)}
    started = time.perf_counter()
    traced = forward if forward is not None else _traced_forward(job, sample_inputs)
    key = job.cache_key(traced, input_dtypes, dims, outputs)
    source, torch_keys, trainable, padding = traced
    all_weights = list(torch_keys)
    frozen = set(job.frozen_weights)
    trainable = [w for w in trainable if w not in frozen]

    forward, returned = _transform_forward(job, source, dims, outputs)
    if job.save_paths.get("model_after_graph_transforms_path"):
        dump = copy.deepcopy(forward)  # loadable by ONNX Runtime: gradient markers become Identity
        stop_gradients_to_identity(dump)
        onnx.save(dump, job.save_paths["model_after_graph_transforms_path"])
    weight_info = {i.name: _value_info(i) for i in forward.graph.input if i.name in torch_keys}
    graph_inputs = {i.name for i in forward.graph.input}
    expected = {"weights": weight_info, "torch_keys": torch_keys, "outputs": returned,
                "inputs": {n: dt for n, dt in input_dtypes.items() if n in graph_inputs}}
    cached = store.load(key, validate=lambda models, meta: _entry_problems(models, meta, forward, expected,
                                                                           trainable, job.accumulate))
    if cached is not None:
        models, meta = cached
        _warn_untrained(trainable, meta["trained"])
        if job.save_paths.get("model_with_gradient_graph_path"):
            onnx.save(models["gradient"], job.save_paths["model_with_gradient_graph_path"])
        logger.info("reused the cached training graph %s (%.2f s, export included) from %s", key[:16],
                    time.perf_counter() - started, store.root)
        return TrainingGraphs(models["gradient"], models["eval"], meta, from_cache=True, forward=traced)

    # what PyTorch would refuse in a batch, read off the graph before any rewrite
    constraints = find_input_constraints(source, job.desc.input_names)

    eval_model = build_eval_graph(forward)
    buffer_updates = expose_running_statistics(forward, set(all_weights) - set(trainable))
    gradient, trained = build_gradient_graph(forward, trainable, job.desc.loss_name, returned,
                                             list(buffer_updates.values()))
    rewrites.mask_padding_rows(gradient, padding)  # semantics, not speed: always
    rewritten = rewrites.apply_gradient_passes(gradient, job.passes or {},
                                               {w: len(info[0]) for w, info in weight_info.items()})
    logger.debug("gradient graph rewrites: %s", rewritten)
    _warn_untrained(trainable, trained)
    if job.accumulate:
        add_gradient_accumulation(gradient, trained)
    if job.save_paths.get("model_with_gradient_graph_path"):
        onnx.save(gradient, job.save_paths["model_with_gradient_graph_path"])

    meta = {
        "weights": weight_info,
        "trained": trained,
        "torch_keys": torch_keys,
        "inputs": expected["inputs"],
        "buffer_updates": buffer_updates,
        "outputs": returned,
        "input_constraints": constraints,
    }
    entry = store.store(key, {"gradient": gradient, "eval": eval_model}, meta)
    logger.info("built the training graph %s in %.2f s%s", key[:16], time.perf_counter() - started,
                f"; cached in {entry}" if entry else "")
    return TrainingGraphs(gradient, eval_model, meta, forward=traced)


def _warn_untrained(trainable: list[str], trained: list[str]) -> None:
    skipped = [w for w in trainable if w not in trained]
    if skipped:
        logger.warning("weights with no gradient from the loss are not trained: %s", skipped)


def _traced_forward(job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> tuple[onnx.ModelProto, dict, list, dict]:
    """``_forward_graph`` with every weight moved to a graph input: what the cache key hashes."""
    forward, torch_keys, trainable, padding = _forward_graph(job, sample_inputs)
    weights_to_inputs(forward, list(torch_keys))
    return forward, torch_keys, trainable, padding


def _transform_forward(job: GraphJob, source: onnx.ModelProto, dims: dict[str, int] | None,
                       outputs: tuple | None) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of the traced forward graph, specialised, trimmed to ``outputs`` and rewritten by the
    forward passes; and the description outputs it returns."""
    forward = specialize(source, dims) if dims else copy.deepcopy(source)
    returned = [n for n in job.desc.output_names if outputs is None or n in outputs or n == job.desc.loss_name]
    if outputs is not None:
        kept = [o for o in forward.graph.output if o.name in returned]
        del forward.graph.output[:]
        forward.graph.output.extend(kept)
    passes = job.passes or {}
    if passes.get("sparse_labels") and outputs is not None:
        rewrites.sparse_labels_forward(forward)
    if passes.get("cross_entropy"):
        rewrites.cross_entropy_forward(forward)
    return forward, returned


def _io(graph: onnx.GraphProto) -> tuple[list, list]:
    return ([[i.name, *_value_info(i)] for i in graph.input], [[o.name, *_value_info(o)] for o in graph.output])


def _entry_problems(models: dict[str, onnx.ModelProto], meta: dict, forward: onnx.ModelProto, expected: dict,
                    trainable: list[str], accumulate: bool) -> list[str]:
    """What makes a cache entry unusable for the forward graph just traced (empty when it is sound).

    ``expected`` holds the metadata fields the traced graph determines; the graphs' inputs and
    outputs must be those the pipeline derives from it.
    """
    if sorted(models) != ["eval", "gradient"]:
        return [f"it holds the graphs {sorted(models)}, not eval and gradient"]
    problems = [f"meta.json's {field!r} disagrees with the traced model"
                for field, value in expected.items() if meta.get(field) != value]
    trained, updates = meta.get("trained"), meta.get("buffer_updates")
    if not isinstance(trained, list) or [w for w in trainable if w in trained] != trained:
        return [*problems, "meta.json's 'trained' is not a list of trainable weights in order"]
    buffers = set(expected["weights"]) - set(trainable)
    if not (isinstance(updates, dict) and set(updates) <= buffers
            and all(isinstance(v, str) for v in updates.values())):
        return [*problems, "meta.json's 'buffer_updates' does not map buffers to outputs"]
    if _io(models["eval"].graph) != _io(forward.graph):
        problems.append("eval.onnx's inputs or outputs differ from the traced forward graph")
    # the gradient graph may only read what the engine feeds, with the traced graph's types
    inputs = {i.name: _value_info(i) for i in forward.graph.input}
    inputs[LOSS_SCALE_INPUT] = [[], "float32"]
    suffix, fed = GRAD_SUFFIX, set(inputs)
    if accumulate:
        suffix, fed = ACCUMULATED_FLAG_SUFFIX, fed | {w + ACCUMULATOR_SUFFIX for w in trained} | {RESET_INPUT}
    gradient = models["gradient"].graph
    wrong = sorted(i.name for i in gradient.input
                   if i.name not in fed or (i.name in inputs and _value_info(i) != inputs[i.name]))
    if wrong:
        problems.append(f"gradient.onnx has inputs the traced forward graph does not have ({', '.join(wrong)})")
    outputs = [*expected["outputs"], *(w + suffix for w in trained), *updates.values()]
    if [o.name for o in gradient.output] != outputs:
        problems.append("gradient.onnx's outputs are not the description's outputs, the trained weights' "
                        "gradients and the buffer updates that meta.json lists")
    return problems


@dataclass
class OptimizerSpec:
    """The optimizer graph and the flat layout it works on.

    Attributes:
        graph: the optimizer step (``graph.optimizer.build_optimizer_graph``).
        layout: trained weights in flat-buffer order (group by group).
        segments: what this process updates.
        begin, end: the layout range this process updates (all of it without ZeRO).
        counts: elements each rank updates (ZeRO), else None.
    """

    graph: onnx.ModelProto
    layout: list[str]
    segments: list[Segment]
    begin: int
    end: int
    counts: list[int] | None


def build_optimizer(job: GraphJob, meta: dict, world_size: int = 1, rank: int = 0,
                    zero: bool = False) -> OptimizerSpec:
    """The optimizer graph for ``job`` (milliseconds to build, so never cached).

    Args:
        job: the job (optimizer config, frozen weights, clipping).
        meta: ``TrainingGraphs.meta`` of the gradient graph it follows.
        world_size, rank, zero: with ZeRO stage 1 this rank updates only its share of the layout.

    Raises:
        ValueError: when a parameter group or ``utils.frozen_weights`` names an unknown weight.
    """
    trained = meta["trained"]
    opt_plan = plan(job.optim_config, trained, job.frozen_weights, list(meta["weights"]))
    layout = layout_order(trained, opt_plan.group_of)
    sizes = {w: int(np.prod(meta["weights"][w][0])) for w in trained}
    total = sum(sizes.values())
    whole_tensors = isinstance(job.optim_config, LambConfig)  # the trust ratio needs whole-tensor norms
    begin, end, counts = 0, total, None
    if zero and world_size > 1:
        ranges = zero_ranges([sizes[w] for w in layout], world_size, whole_tensors)
        counts = [b - a for a, b in ranges]
        begin, end = ranges[rank]
    segments = make_segments(layout, sizes, opt_plan.group_of, whole_tensors, begin, end)
    graph = build_optimizer_graph(job.optim_config, opt_plan.groups, segments, total, job.grad_norm_clip)
    if job.save_paths.get("model_with_training_graph_path"):
        onnx.save(graph, job.save_paths["model_with_training_graph_path"])
    return OptimizerSpec(graph, layout, segments, begin, end, counts)


def zero_ranges(sizes: list[int], world_size: int, whole_tensors: bool) -> list[tuple[int, int]]:
    """Each rank's ``[begin, end)`` of a flat layout of tensors with these sizes.

    Equal element counts; with ``whole_tensors`` the boundaries fall between tensors instead,
    as evenly as they can.
    """
    total = sum(sizes)
    if not whole_tensors:
        edges = [total * r // world_size for r in range(world_size + 1)]
        return list(zip(edges[:-1], edges[1:]))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    ranges, start, running = [], 0, 0
    for r in range(world_size):
        target = total * (r + 1) / world_size
        stop = start
        while stop < len(sizes) and (r == world_size - 1 or running + sizes[stop] / 2 <= target):
            running += sizes[stop]
            stop += 1
        ranges.append((int(offsets[start]), int(offsets[stop])))
        start = stop
    return ranges


def _value_info(value_info: onnx.ValueInfoProto) -> list:
    tensor_type = value_info.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]
    return [shape, str(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))]


def _forward_graph(job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> tuple[onnx.ModelProto, dict, list, dict]:
    """Export (or copy) the forward graph, make it trainable and run the user's hook.

    Returns the graph, ``{weight: torch keys}``, the trainable weights and ``{weight: padding_idx}``.
    """
    padding: dict[str, int] = {}
    if isinstance(job.model, onnx.ModelProto):
        forward = copy.deepcopy(job.model)
        _check_onnx_io(forward, job.desc)
        weights = [i.name for i in forward.graph.initializer if i.data_type in _FLOAT_TYPES]
        torch_keys = {w: [w] for w in weights}
        trainable = list(weights)
    else:
        exported = export_torch(job.model, job.loss_fn, job.desc, sample_inputs, job.opset)
        forward, torch_keys, trainable, padding = (exported.model, exported.torch_keys, exported.trainable,
                                                   exported.padding)
    make_trainable(forward)
    if job.extra_postprocess is not None:
        returned = job.extra_postprocess(forward)
        if isinstance(returned, onnx.ModelProto):
            forward = returned
    return forward, torch_keys, trainable, padding


_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _check_onnx_io(model: onnx.ModelProto, desc: ModelDescription) -> None:
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i.name for i in model.graph.input if i.name not in initializers]
    graph_outputs = [o.name for o in model.graph.output]
    problems = []
    for name in desc.input_names:
        if name not in graph_inputs:
            problems.append(f"model_desc input {name!r} is not an input of the ONNX model (inputs: {graph_inputs})")
    for name in graph_inputs:
        if name not in desc.input_names:
            problems.append(f"the ONNX model's input {name!r} is missing from model_desc.inputs")
    for name in desc.output_names:
        if name not in graph_outputs:
            problems.append(f"model_desc output {name!r} is not an output of the ONNX model (outputs: {graph_outputs})")
    if problems:
        raise ValueError("the ONNX model does not match the model description:\n  " + "\n  ".join(problems))


def initial_weights(
    model: torch.nn.Module | onnx.ModelProto, meta: dict
) -> dict[str, np.ndarray]:
    """Current values of every weight input, read from the torch module or ONNX initializers."""
    if isinstance(model, onnx.ModelProto):
        values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        return {w: np.ascontiguousarray(values[w]) for w in meta["weights"]}
    state = model.state_dict(keep_vars=True)
    out = {}
    for weight, keys in meta["torch_keys"].items():
        if weight in meta["weights"]:
            out[weight] = state[keys[0]].detach().cpu().numpy().copy()
    return out


__all__ = ["GraphJob", "OptimizerSpec", "TrainingGraphs", "build_optimizer", "build_training_graphs",
           "export_order", "initial_weights", "zero_ranges"]

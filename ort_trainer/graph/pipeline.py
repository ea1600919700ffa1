"""The graph pipeline: model -> traced program -> gradient + eval graphs (cached) -> optimizer graph.

``build_training_graphs`` asks the job's gradient source (``sources.py``) to trace the model on
every build and keys the graph cache on a hash of what it traced, so a hit can never be a graph
of other code; a hit skips only the building of the gradient and eval graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .._logging import logger
from ..model_desc import ModelDescription
from ..optim.config import LambConfig, _OptimizerConfig
from . import cache as graph_cache
from .export import export_order
from .gradient import ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, GRAD_SUFFIX, RESET_INPUT
from .optimizer import Segment, build_optimizer_graph, layout_order, make_segments, plan
from .source_onnxruntime import OnnxRuntimeGradientSource
from .sources import GradientSource, Prepared, Traced, io_signature, value_info


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
        forward: the gradient source's ``Traced`` program, before specialisation; in memory
            only, so shape specialisations of the same job skip the trace where it serves them.
        dims: the symbol sizes the graphs have fixed (None: symbolic).

    The optimizer graph is not part of it: ``build_optimizer`` makes it in milliseconds.
    """

    gradient: onnx.ModelProto
    eval: onnx.ModelProto
    meta: dict
    from_cache: bool = False
    forward: Traced | None = None
    dims: dict[str, int] | None = None


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
    source: GradientSource = field(default_factory=OnnxRuntimeGradientSource)

    def cache_key(self, traced: Traced, input_dtypes: dict[str, str], dims: dict[str, int] | None,
                  outputs: tuple | None = None) -> str:
        """Hash of the traced program and of everything that shapes the graphs built from it.

        Args:
            traced: what the gradient source traced (for the ONNX Runtime source, the forward graph
                after the trainability pass and the user's hook); weights enter it by name, shape
                and dtype only, never by value.
            input_dtypes: ``{input name: numpy dtype name}`` of the data inputs.
            dims, outputs: as in ``build_training_graphs``.

        Returns:
            The hex SHA-256 key.
        """
        return graph_cache.make_key(
            {
                "source": self.source.name,
                "forward": traced.fingerprint,
                "torch_keys": traced.torch_keys,
                "trainable": list(traced.trainable),
                "padding": sorted(traced.padding.items()),
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
    forward: Traced | None = None,
    outputs: tuple | None = None,
) -> TrainingGraphs:
    """Build (or load from the cache) the training graphs of ``job``.

    Args:
        job: the model, loss, description, optimizer, gradient source and graph-shaping options.
        sample_inputs: one array per description input (dtype fixes the graph's input dtype;
            values are used to trace the torch model).
        dims: concrete values of symbolic dimensions to specialise the graphs to (None: keep
            them symbolic).
        graph_cache_store: the cache (default: ``GraphCache()``).
        forward: ``TrainingGraphs.forward`` of an earlier build of the same job, to skip the
            trace where it serves ``dims`` (None, or a static trace of other sizes: trace now).
        outputs: the description outputs this graph returns besides the loss (None: all). Leaving
            outputs out lets passes such as ``sparse_labels`` skip work nobody reads.

    Returns:
        The graphs, loaded from the cache when an entry for exactly this traced program and these
        options exists and passes its checks, else built (and stored).

    Raises:
        ExportError, GradientBuildError: when the model cannot be exported or differentiated.
    """
    store = graph_cache_store or graph_cache.GraphCache()
    source = job.source
    input_dtypes = {d.name: str(np.asarray(a).dtype) for d, a in zip(job.desc.inputs, sample_inputs)}
    started = time.perf_counter()
    dims = dims or None
    traced = forward if forward is not None and forward.serves(dims) else source.trace(job, sample_inputs, dims)
    key = job.cache_key(traced, input_dtypes, dims, outputs)
    trainable = [w for w in traced.trainable if w not in set(job.frozen_weights)]
    prepared = source.prepare(job, traced, dims, outputs, input_dtypes)
    accumulate = job.accumulate and source.accumulates_in_graph
    cached = store.load(key, validate=lambda models, meta: _entry_problems(models, meta, prepared, trainable,
                                                                           accumulate))
    if cached is not None:
        models, meta = cached
        _warn_untrained(trainable, meta["trained"])
        if job.save_paths.get("model_with_gradient_graph_path"):
            onnx.save(models["gradient"], job.save_paths["model_with_gradient_graph_path"])
        logger.info("reused the cached training graph %s (%.2f s, trace included) from %s", key[:16],
                    time.perf_counter() - started, store.root)
        return TrainingGraphs(models["gradient"], models["eval"], meta, from_cache=True, forward=traced, dims=dims)

    built = source.build(job, traced, prepared)
    _warn_untrained(trainable, built.trained)
    if job.save_paths.get("model_with_gradient_graph_path"):
        onnx.save(built.gradient, job.save_paths["model_with_gradient_graph_path"])
    meta = {
        "weights": built.weights,
        "torch_keys": built.torch_keys,
        **prepared.expected,
        "trained": built.trained,
        "buffer_updates": built.buffer_updates,
        "input_constraints": built.input_constraints,
        "gradient_source": source.name,
    }
    entry = store.store(key, {"gradient": built.gradient, "eval": built.eval}, meta)
    logger.info("built the training graph %s with the %s gradient source in %.2f s%s", key[:16], source.name,
                time.perf_counter() - started, f"; cached in {entry}" if entry else "")
    return TrainingGraphs(built.gradient, built.eval, meta, forward=traced, dims=dims)


def _warn_untrained(trainable: list[str], trained: list[str]) -> None:
    skipped = [w for w in trainable if w not in trained]
    if skipped:
        logger.warning("weights with no gradient from the loss are not trained: %s", skipped)


def _entry_problems(models: dict[str, onnx.ModelProto], meta: dict, prepared: Prepared, trainable: list[str],
                    accumulate: bool) -> list[str]:
    """What makes a cache entry unusable for the program just traced (empty when it is sound).

    ``prepared.expected`` holds the metadata fields the traced program determines; the graphs'
    inputs and outputs must be those the source derives from it.
    """
    if sorted(models) != ["eval", "gradient"]:
        return [f"it holds the graphs {sorted(models)}, not eval and gradient"]
    expected = prepared.expected
    problems = [f"meta.json's {field!r} disagrees with the traced model"
                for field, value in expected.items() if meta.get(field) != value]
    trained, updates = meta.get("trained"), meta.get("buffer_updates")
    if not isinstance(trained, list) or [w for w in trainable if w in trained] != trained:
        return [*problems, "meta.json's 'trained' is not a list of trainable weights in order"]
    buffers = set(expected.get("weights", meta.get("weights")) or ()) - set(trainable)
    if not (isinstance(updates, dict) and set(updates) <= buffers
            and all(isinstance(v, str) for v in updates.values())):
        return [*problems, "meta.json's 'buffer_updates' does not map buffers to outputs"]
    eval_io = io_signature(models["eval"].graph)
    if prepared.eval_io is not None:
        if eval_io != prepared.eval_io:
            problems.append("eval.onnx's inputs or outputs differ from the traced forward graph")
    elif [o[0] for o in eval_io[1]] != expected["outputs"]:
        problems.append("eval.onnx's outputs are not the description's outputs")
    # the gradient graph may only read what the engine feeds, with the traced program's types
    inputs = prepared.gradient_inputs
    suffix, fed = GRAD_SUFFIX, set(inputs)
    if accumulate:
        suffix, fed = ACCUMULATED_FLAG_SUFFIX, fed | {w + ACCUMULATOR_SUFFIX for w in trained} | {RESET_INPUT}
    graphs = [models["gradient"].graph] + ([models["eval"].graph] if prepared.eval_io is None else [])
    wrong = sorted({i.name for graph in graphs for i in graph.input
                    if i.name not in fed or (inputs.get(i.name) is not None and value_info(i) != inputs[i.name])})
    if wrong:
        problems.append(f"the cached graphs have inputs the traced program does not have ({', '.join(wrong)})")
    outputs = [*expected["outputs"], *(w + suffix for w in trained), *updates.values()]
    if [o.name for o in models["gradient"].graph.output] != outputs:
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

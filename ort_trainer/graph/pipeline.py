"""The graph pipeline: model -> traced program -> gradient + eval graphs (cached) -> optimizer graph.

``build_training_graphs`` keys the graph cache on a hash of what the job's gradient source
(``job.py``) traced, so a hit can never be a graph of other code. Where the source has a
cheaper record of what the model computes (``op_record.py``: the operators one eager forward
runs), a hit is first looked up by that record, linked to the entry by an earlier trace that saw
the same record, and skips the trace as well as the building.
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
from .._temporaries import save_model
from ..optim.config import LambConfig
from . import cache as graph_cache
from .export.torchscript import export_order
from .job import GradientSource, GraphJob, Prepared, Traced
from .names import GRAD_SUFFIX, LOSS_SCALE_INPUT
from .onnx_graph import io_signature, value_info
from .optimizer import Segment, build_optimizer_graph, layout_order, make_segments, plan
from .passes.dropout import DROPOUT_SEED_INPUT, host_mask_inputs
from .passes.tied_embedding import host_table_rows


@dataclass
class TrainingGraphs:
    """Everything the engine needs, independent of weight values.

    Attributes:
        gradient: forward + loss + backward; inputs: data, weights and ``__loss_scale``; outputs:
            the description's outputs in order, then ``<weight>_grad`` for each trained weight
            (with accumulation: the gradients are added into ``<weight>_grad.accumulation.buffer``
            inputs instead, see ``gradient.add_gradient_accumulation``).
        eval: forward only, Dropout off, BatchNorm in inference mode; weights are inputs. None
            until ``build_eval_graph`` makes it, for a source that builds it only on demand.
        meta: ``weights`` ({name: [shape, dtype]} of every weight input), ``trained`` (weights
            the optimizer updates, in order), ``torch_keys`` ({weight: [torch state_dict keys]}),
            ``inputs`` ({name: dtype} of the data inputs the graph reads), ``buffer_updates``
            ({buffer: gradient-graph output with its new value}, e.g. BatchNorm statistics).
        from_cache: True when loaded from the graph cache.
        forward: the gradient source's ``Traced`` program, before specialisation; in memory
            only, so shape specialisations of the same job skip the trace where it serves them.
        dims: the symbol sizes the graphs have fixed (None: symbolic).
        outputs: the description outputs asked for (None: all); ``meta["outputs"]`` says which
            the graphs return.
        key: the cache key of the gradient graph (the eval graph's entry is keyed on it).
        sample_inputs: the arrays the graphs were built for (a later eval build traces them).
        record: the operator record key (``GraphJob.record_cache_key``) the graphs were found by or
            linked to, or None; it covers eval mode too, so the eval graph is linked to it as well.
        eval_is_training: the operator record found that eval mode runs the operators training mode
            runs, Dropouts aside (``OpRecord.eval_is_training``): the eval graph is then the
            gradient graph's forward part without its Dropouts, with no eval-mode trace.

    The optimizer graph is not part of it: ``build_optimizer`` makes it in milliseconds.
    """

    gradient: onnx.ModelProto
    eval: onnx.ModelProto | None
    meta: dict
    from_cache: bool = False
    forward: Traced | None = None
    dims: dict[str, int] | None = None
    outputs: tuple | None = None
    key: str = ""
    sample_inputs: list = field(default_factory=list, repr=False)
    record: str | None = None
    eval_is_training: bool = False


def sample_dtypes(job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> dict[str, str]:
    """``{input name: numpy dtype name}`` of the sample, as the cache keys record them."""
    return {d.name: str(np.asarray(a).dtype) for d, a in zip(job.desc.inputs, sample_inputs)}


def build_training_graphs(
    job: GraphJob,
    sample_inputs: Sequence[np.ndarray],
    dims: dict[str, int] | None = None,
    graph_cache_store: graph_cache.GraphCache | None = None,
    forward: Traced | None = None,
    outputs: tuple | None = None,
    check_batch: Callable[[dict], None] | None = None,
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
        check_batch: called with the graphs' input constraints (``export.input_checks``) as soon as
            they are known: after the trace and before the build, or on a cache hit; it raises to
            refuse the batch the graphs are built for, before seconds of building.

    Returns:
        The graphs, loaded from the cache when an entry for exactly this traced program and these
        options exists and passes its checks, else built (and stored).

    Raises:
        ExportError, GradientBuildError: when the model cannot be exported or differentiated.
    """
    store = graph_cache_store or graph_cache.GraphCache()
    source = job.source
    input_dtypes = sample_dtypes(job, sample_inputs)
    started = time.perf_counter()
    dims = dims or None
    # the source whose accumulation interface the graphs have, or None (they accumulate nothing)
    accumulating = source if job.accumulate and source.accumulates_in_graph else None
    traced = forward if forward is not None and forward.serves(dims) else None
    op_record = None
    symbolic = dims is None and any(isinstance(d, str) for io in job.desc.inputs for d in io.shape)
    if traced is None and store.root is not None and not symbolic and not any(job.save_paths.values()):
        # a record runs the sample's sizes only: symbolic graphs, and debug dumps (they come from
        # the trace), trace on a hit too
        op_record = source.record(job, sample_inputs)
    record = None if op_record is None else job.record_cache_key(op_record.key, input_dtypes, dims, outputs)
    eval_is_training = op_record is not None and op_record.eval_is_training
    if record is not None:
        linked = _load_linked(store, record, job, input_dtypes, accumulating)
        if linked is not None:
            key, models, meta = linked
            if check_batch is not None:
                check_batch(meta.get("input_constraints") or {})
            _warn_untrained(meta.get("trainable", meta["trained"]), meta["trained"])
            logger.info("reused the cached training graph %s (%.2f s, found by its operator record: no export) "
                        "from %s", key[:16], time.perf_counter() - started, store.root)
            return TrainingGraphs(models["gradient"], models.get("eval"), meta, from_cache=True, dims=dims,
                                  outputs=outputs, key=key, sample_inputs=list(sample_inputs), record=record,
                                  eval_is_training=eval_is_training)
    if traced is None:
        traced = source.trace(job, sample_inputs, dims)
        traced.eval_is_training = eval_is_training
    constraints = source.input_constraints(job, traced)
    if check_batch is not None:
        check_batch(constraints)
    key = job.cache_key(traced, input_dtypes, dims, outputs)
    trainable = [w for w in traced.trainable if w not in set(job.frozen_weights)]
    prepared = source.prepare(job, traced, dims, outputs, input_dtypes)
    cached = store.load(key, validate=lambda models, meta: _entry_problems(models, meta, prepared, trainable,
                                                                           accumulating))
    if cached is not None:
        models, meta = cached
        if record is not None:
            store.link(record, key)
        _warn_untrained(trainable, meta["trained"])
        if job.save_paths.get("model_with_gradient_graph_path"):
            save_model(models["gradient"], job.save_paths["model_with_gradient_graph_path"])
        logger.info("reused the cached training graph %s (%.2f s, trace included) from %s", key[:16],
                    time.perf_counter() - started, store.root)
        return TrainingGraphs(models["gradient"], models.get("eval"), meta, from_cache=True, forward=traced,
                              dims=dims, outputs=outputs, key=key, sample_inputs=list(sample_inputs), record=record,
                              eval_is_training=eval_is_training)

    built = source.build(job, traced, prepared)
    _warn_untrained(trainable, built.trained)
    if job.save_paths.get("model_with_gradient_graph_path"):
        save_model(built.gradient, job.save_paths["model_with_gradient_graph_path"])
    meta = {
        "weights": built.weights,
        "torch_keys": built.torch_keys,
        **prepared.expected,
        "trained": built.trained,
        "buffer_updates": built.buffer_updates,
        "input_constraints": constraints,
        "gradient_source": source.name,
        "trainable": trainable,
    }
    entry = store.store(key, {"gradient": built.gradient, **({"eval": built.eval} if built.eval else {})}, meta)
    if entry is not None and record is not None:
        store.link(record, key)
    logger.info("built the training graph %s with the %s gradient source in %.2f s%s", key[:16], source.name,
                time.perf_counter() - started, f"; cached in {entry}" if entry else "")
    return TrainingGraphs(built.gradient, built.eval, meta, forward=traced, dims=dims, outputs=outputs, key=key,
                          sample_inputs=list(sample_inputs), record=record if entry is not None else None,
                          eval_is_training=eval_is_training)


def _load_linked(store: graph_cache.GraphCache, record: str, job: GraphJob, input_dtypes: dict[str, str],
                 accumulating: GradientSource | None) -> tuple[str, dict[str, onnx.ModelProto], dict] | None:
    """The entry a trace linked to ``record`` (a ``GraphJob.record_cache_key``), checked as a hit
    by trace is, against its own metadata; None when there is none (the caller then traces)."""
    key = store.linked(record)
    if key is None:
        return None

    def problems(models: dict[str, onnx.ModelProto], meta: dict) -> list[str]:
        if not all(isinstance(meta.get(f), (list, dict)) for f in ("outputs", "weights", "trained")):
            return ["meta.json lacks the outputs, weights or trained weights"]
        if meta.get("inputs") != {n: input_dtypes[n] for n in job.desc.input_names}:
            return ["meta.json's 'inputs' disagrees with the batch"]
        readable = {name: None for name in [*meta["weights"], *job.desc.input_names, LOSS_SCALE_INPUT]}
        prepared = Prepared({"outputs": meta["outputs"], "inputs": meta["inputs"]}, readable)
        return _entry_problems(models, meta, prepared, meta.get("trainable", meta["trained"]), accumulating)

    cached = store.load(key, validate=problems)
    return None if cached is None else (key, *cached)


def _warn_untrained(trainable: list[str], trained: list[str]) -> None:
    skipped = [w for w in trainable if w not in trained]
    if skipped:
        logger.warning("weights with no gradient from the loss are not trained: %s", skipped)


def _entry_problems(models: dict[str, onnx.ModelProto], meta: dict, prepared: Prepared, trainable: list[str],
                    accumulating: GradientSource | None) -> list[str]:
    """What makes a cache entry unusable for the program just traced (empty when it is sound).

    ``prepared.expected`` holds the metadata fields the traced program determines; the graphs'
    inputs and outputs must be those the source derives from it (with ``accumulating``'s
    ``accumulation_io`` where the graphs accumulate).
    """
    if sorted(models) not in (["eval", "gradient"], ["gradient"]):
        return [f"it holds the graphs {sorted(models)}, not gradient (and eval)"]
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
    eval_io = io_signature(models["eval"].graph) if "eval" in models else None
    if eval_io is None:
        pass  # built on demand, into an entry of its own (``build_eval_graph``)
    elif prepared.eval_io is not None:
        if eval_io != prepared.eval_io:
            problems.append("eval.onnx's inputs or outputs differ from the traced forward graph")
    elif [o[0] for o in eval_io[1]] != expected["outputs"]:
        problems.append("eval.onnx's outputs are not the description's outputs")
    # the gradient graph may only read what the engine feeds, with the traced program's types
    inputs = prepared.gradient_inputs
    suffix, fed = GRAD_SUFFIX, set(inputs) | set(host_mask_inputs(models["gradient"])) | {DROPOUT_SEED_INPUT}
    if accumulating is not None:
        added, suffix = accumulating.accumulation_io(trained)
        fed |= added
    graphs = [models["gradient"].graph] + ([models["eval"].graph] if eval_io and prepared.eval_io is None else [])
    wrong = sorted({i.name for graph in graphs for i in graph.input
                    if i.name not in fed or (inputs.get(i.name) is not None and value_info(i) != inputs[i.name])})
    if wrong:
        problems.append(f"the cached graphs have inputs the traced program does not have ({', '.join(wrong)})")
    rows = host_table_rows(models["gradient"])  # the tied_embedding_gradient pass's outputs
    outputs = [*expected["outputs"], *(w + suffix for w in trained), *updates.values(),
               *(name for pair in rows.values() for name in pair)]
    if [o.name for o in models["gradient"].graph.output] != outputs or not set(rows) <= {w + suffix for w in trained}:
        problems.append("gradient.onnx's outputs are not the description's outputs, the trained weights' "
                        "gradients, the buffer updates that meta.json lists and the rows of tied embeddings")
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
        save_model(graph, job.save_paths["model_with_training_graph_path"])
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
    """Current values of every weight input, read from the torch module or ONNX initializers.

    A module's weights on the CPU come back as NumPy views of its own memory, not copies: the
    engine copies them into its buffers once (a copy here would hold every weight a third time
    while the engine is made).
    """
    if isinstance(model, onnx.ModelProto):
        values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        return {w: np.ascontiguousarray(values[w]) for w in meta["weights"]}
    state = model.state_dict(keep_vars=True)
    out = {}
    for weight, keys in meta["torch_keys"].items():
        if weight in meta["weights"]:
            out[weight] = state[keys[0]].detach().cpu().numpy()
    return out


__all__ = ["OptimizerSpec", "TrainingGraphs", "build_optimizer", "build_training_graphs", "export_order",
           "initial_weights", "sample_dtypes", "zero_ranges"]

"""Eval graphs: the forward of the training graphs in eval mode, for ``eval_step`` and ``save_as_onnx``.

``build_eval_graph`` gives the eval graph of built training graphs: the gradient graph's forward part
where the operator record found that eval mode computes what training mode computes, Dropouts aside
(``eval_graph_of``), else a graph translated from an eval-mode trace, cached and linked to the
record. ``build_eval_graph_alone`` builds one without training graphs: with symbolic dimensions for
``save_as_onnx``, or for a signature that is only evaluated.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import onnx

from .._logging import logger
from . import cache as graph_cache
from .export.torchscript import ExportError
from .job import GraphJob, Traced
from .onnx_graph import eval_part, io_signature
from .passes.dropout import host_mask_inputs
from .passes.forward import sigmoid_gelu_forward
from .pipeline import TrainingGraphs, sample_dtypes


def build_eval_graph(job: GraphJob, graphs: TrainingGraphs,
                     graph_cache_store: graph_cache.GraphCache | None = None) -> onnx.ModelProto:
    """The eval graph of ``graphs`` (built there already, or from its own cache entry, or now).

    Where the operator record found that eval mode runs what training mode runs, Dropouts aside
    (``graphs.eval_is_training``: no BatchNorm, no branch on ``self.training``), it is the gradient
    graph's forward part with each Dropout the identity (``eval_graph_of``): no trace, no
    translation. Otherwise a source that builds the eval graph only on demand (``Built.eval`` None)
    is asked here, on the first ``eval_step`` or ``save_as_onnx`` that needs it; cached under a key
    of the gradient graph's and the source's ``eval_fingerprint`` (its eval-mode trace), linked to
    the graphs' operator record (which covers eval mode: a later process finds it with no trace),
    kept in ``graphs.eval``.

    Raises:
        ExportError: when the eval graph reads a weight the gradient graph does not (the engine
            holds the weights the gradient graph reads).
        RuntimeError: when the model no longer traces to the program the gradient graph was
            built from (its code or its weights changed since).
    """
    if graphs.eval is not None:
        return graphs.eval
    started = time.perf_counter()
    model = eval_graph_of(job, graphs, graphs.meta["outputs"])
    if model is not None:
        logger.info("took the eval graph from the training graph's forward part in %.2f s (eval mode runs the "
                    "operators training mode runs, Dropouts aside)", time.perf_counter() - started)
        graphs.eval = model
        return model
    store = graph_cache_store or graph_cache.GraphCache()
    validate = lambda models, meta: _eval_problems(models, graphs.meta, job)  # noqa: E731
    record, key, cached = _linked_eval(store, graphs.record, validate)
    traced = None
    if cached is None:  # no eval graph linked to the record: trace
        input_dtypes = sample_dtypes(job, graphs.sample_inputs)
        traced = graphs.forward
        if traced is None or not traced.serves(graphs.dims):
            traced = job.source.trace(job, graphs.sample_inputs, graphs.dims)
        if job.cache_key(traced, input_dtypes, graphs.dims, graphs.outputs) != graphs.key:
            raise RuntimeError("the model no longer traces to the program its training graph was built from (its "
                               "code, its weights' shapes or requires_grad flags changed after the first step); "
                               "create a new ORTTrainer for the changed model")
        key = graph_cache.make_key({"eval_of": graphs.key, "eval": job.source.eval_fingerprint(traced)})
        cached = store.load(key, validate=validate)
    if cached is not None:
        model = cached[0]["eval"]
        logger.info("reused the cached eval graph %s%s", key[:16], "" if traced else " (found by its operator record)")
    else:
        prepared = job.source.prepare(job, traced, graphs.dims, graphs.outputs, input_dtypes)
        model = job.source.build_eval(job, traced, prepared)
        problems = _eval_problems({"eval": model}, graphs.meta, job)
        if problems:
            raise ExportError(f"the eval graph cannot run on the training graph's weights: {'; '.join(problems)}. "
                              "A weight that only eval mode reads is not supported: use it in training mode too, "
                              "or make it a constant (a non-persistent buffer)")
        if store.store(key, {"eval": model}, {"eval_of": graphs.key}) is None:
            record = None  # nothing to link to
        logger.info("built the eval graph in %.2f s", time.perf_counter() - started)
    if record is not None:
        store.link(record, key)
    graphs.eval = model
    return model


def build_eval_graph_alone(job: GraphJob, sample_inputs: Sequence[np.ndarray], meta: dict,
                           dims: dict[str, int] | None = None, outputs: tuple | None = None,
                           forward: Traced | None = None,
                           graph_cache_store: graph_cache.GraphCache | None = None,
                           record: str | None = None,
                           before_export: Callable[[], None] | None = None) -> onnx.ModelProto:
    """An eval graph without the gradient graph that ``build_training_graphs`` would build first:
    with the description's symbolic dimensions and every output for ``save_as_onnx`` (a GPT-2 small
    gradient graph took minutes), or for a signature that is only evaluated.

    Args:
        sample_inputs: one array per description input, with the dtypes the graph reads (and the
            sizes ``dims`` gives).
        meta: ``TrainingGraphs.meta`` of the graphs the engine runs: the eval graph must read
            their weights.
        dims, outputs: as ``build_training_graphs``: the symbol sizes fixed (None: symbolic) and
            the outputs returned besides the loss (None: all).
        forward: an earlier trace of the job, used where it serves ``dims``.
        record: ``TrainingGraphs.record`` of those graphs (their operator record, which covers eval
            mode): the graph built here is linked to it, and a later process whose record matches
            loads it without the eval-mode trace (4 s of GPT-2 small's save, its symbolic
            decomposition 8 s more when nothing was cached).
        before_export: called where the graph is not found in the cache, before the model is traced.

    Raises:
        ExportError: as ``build_eval_graph``.
    """
    store = graph_cache_store or graph_cache.GraphCache()
    source = job.source
    if record is None:
        link = None
    elif dims is None and outputs is None:
        link = graph_cache.make_key({"symbolic_eval_of_record": record})
    else:
        link = graph_cache.make_key({"eval_alone_of_record": record, "dims": sorted((dims or {}).items()),
                                     "outputs": None if outputs is None else list(outputs)})
    expected = {**meta, "outputs": job.returned_outputs(outputs)}
    _, key, cached = _linked_eval(store, link, lambda models, _: _eval_problems(models, expected, job))
    if cached is not None:
        logger.info("reused the cached eval graph %s (found by its operator record: no export)", key[:16])
        return cached[0]["eval"]
    input_dtypes = sample_dtypes(job, sample_inputs)
    if before_export is not None:
        before_export()
    traced = forward if forward is not None and forward.serves(dims) else source.trace_eval(job, sample_inputs, dims)
    prepared = source.prepare(job, traced, dims, outputs, input_dtypes)
    graphs = TrainingGraphs(None, None, {**meta, **prepared.expected}, forward=traced, dims=dims, outputs=outputs,
                            key=job.cache_key(traced, input_dtypes, dims, outputs), sample_inputs=list(sample_inputs),
                            record=link)
    return build_eval_graph(job, graphs, store)


def eval_graph_of(job: GraphJob, graphs: TrainingGraphs, outputs: list[str]) -> onnx.ModelProto | None:
    """The eval graph returning ``outputs`` taken from ``graphs``' gradient graph, which may return
    fewer (a loop that fetched the loss alone still computes the logits it reads), where the operator
    record found that eval mode computes what training mode computes, Dropouts aside: the forward
    part with each Dropout the identity (``onnx_graph.eval_part``). None where the record did not find
    that, or where the gradient graph does not compute every one of ``outputs`` (``sparse_labels``
    left the logits out) or the part reads something besides the batch and the weights."""
    if not graphs.eval_is_training or graphs.gradient is None:
        return None
    graph = graphs.gradient.graph
    typed = {v.name for v in [*graph.output, *graph.value_info] if v.type.tensor_type.elem_type}
    # a name the graph computes: a value_info entry alone may outlive its node (GPT2ForSequenceClassification's
    # returned `logits`, a gather of the classifier's scores, kept no node of that name once unfetched)
    produced = {name for node in graph.node for name in node.output} | {o.name for o in graph.output}
    if not set(outputs) <= typed & produced:
        return None
    model = eval_part(graphs.gradient, outputs, host_mask_inputs(graphs.gradient))
    if (job.passes or {}).get("gelu"):  # its forward kept what the backward reads: one kernel now
        sigmoid_gelu_forward(model)
    return None if _eval_problems({"eval": model}, {**graphs.meta, "outputs": outputs}, job) else model


def _linked_eval(store: graph_cache.GraphCache, record: str | None,
                 validate: graph_cache.Validator) -> tuple[str | None, str | None, tuple | None]:
    """``(link, key, cached)``: the link of the eval graph of the graphs found by or linked to
    ``record`` (``TrainingGraphs.record``), the entry it names and that entry loaded and validated;
    None where there is no record, no link, or no sound entry."""
    link = None if record is None else graph_cache.make_key({"eval_of_record": record})
    key = None if link is None else store.linked(link)
    return link, key, None if key is None else store.load(key, validate=validate)


def _eval_problems(models: dict[str, onnx.ModelProto], meta: dict, job: GraphJob) -> list[str]:
    """What makes an eval graph unusable beside the gradient graph described by ``meta``."""
    if sorted(models) != ["eval"]:
        return [f"it holds the graphs {sorted(models)}, not eval"]
    inputs, outputs = io_signature(models["eval"].graph)
    if [o[0] for o in outputs] != meta["outputs"]:
        return ["eval.onnx's outputs are not the training graph's outputs"]
    weights, data = meta["weights"], set(job.desc.input_names)
    wrong = [name for name, *info in inputs if name not in data and (name not in weights or info != weights[name])]
    return [f"eval.onnx reads {', '.join(wrong)}, which the training graph does not"] if wrong else []


__all__ = ["build_eval_graph", "build_eval_graph_alone", "eval_graph_of"]

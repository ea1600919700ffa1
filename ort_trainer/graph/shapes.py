"""Which graphs serve which inputs: one job's graphs by shape signature.

A signature is ``(shape, outputs)``: ``shape`` a sorted tuple of ``(symbol, size)`` pairs whose
graphs have those dimensions fixed (ONNX Runtime then plans memory and picks kernels for static
shapes), or None; ``outputs`` the fetched outputs besides the loss, or None for all of them. The
signature None stands for the symbolic graphs with every output.

With ``graph_optimizations.shape_specialization`` the first ``max_shape_graphs`` distinct shapes
each get static-shape graphs; any later new shape runs on the symbolic graphs, so a job with many
sequence lengths builds a bounded number of graphs. Graphs are built through the pipeline
(``pipeline.py``) from a trace that serves them where one exists.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx

from .._logging import logger
from ..model_desc import ModelDescription
from .job import GraphJob, Traced
from .eval_graphs import build_eval_graph, build_eval_graph_alone, eval_graph_of
from .pipeline import TrainingGraphs, build_training_graphs


class ShapeGraphs:
    """The graphs of ``job`` for each shape signature the trainer meets.

    Args:
        job: what to build.
        specialize: ``graph_optimizations.shape_specialization``.
        max_graphs: ``graph_optimizations.max_shape_graphs``.
        check_batch: called with the input constraints of graphs about to be built (the first ones,
            or those of a new shape) between their trace and their build (``build_training_graphs``);
            it raises to refuse the batch they are for.

    Attributes:
        first: the first graphs built (the engine's layout comes from them), or None.
        symbolic: the symbolic-shape graphs with every output, once built.
        specialised: the shapes that have static-shape graphs.
    """

    def __init__(self, job: GraphJob, specialize: bool, max_graphs: int,
                 check_batch: Callable[[dict], None] | None = None):
        self.job = job
        self.desc: ModelDescription = job.desc
        self.specialize = specialize
        self.max_graphs = max_graphs
        self.first: TrainingGraphs | None = None
        self.symbolic: TrainingGraphs | None = None
        self.specialised: set[tuple] = set()
        self._symbolic_eval: onnx.ModelProto | None = None  # the symbolic eval graph alone (save_as_onnx)
        self._traces: dict[tuple, Traced | None] = {}  # the gradient source's traces by the shape they fixed
        self._first_signature: tuple | None = None
        self._sample_inputs: list[np.ndarray] = []
        self._fallback_logged = False
        self._by_signature: dict[tuple | None, TrainingGraphs] = {}  # the training graphs built, by signature
        # the input constraints of each traced shape (``()``: symbolic), exact for the batches its graphs run
        self._constraints: dict[tuple, dict] = {}
        self._check_batch = check_batch

    def synthetic_inputs(self, dtypes: dict[str, np.dtype] | None = None,
                         sizes: dict[str, int] | None = None) -> list[np.ndarray]:
        """Trace inputs from the description: symbols get ``sizes`` or else distinct sizes > 1,
        ints are zeros."""
        sizes = dict(sizes or {})
        arrays = []
        for d in self.desc.inputs:
            shape = [dim if isinstance(dim, int) else sizes.setdefault(dim, 2 + len(sizes)) for dim in d.shape]
            dtype = (dtypes or {}).get(d.name, d.numpy_dtype)
            if np.issubdtype(dtype, np.floating):
                arrays.append(np.random.default_rng(0).standard_normal(shape).astype(dtype))
            else:
                arrays.append(np.zeros(shape, dtype=dtype))
        return arrays

    def symbol_sizes(self, feeds: dict[str, np.ndarray]) -> tuple:
        """``((symbol, size), ...)`` of the symbolic dimensions in these inputs, sorted."""
        sizes = {}
        for d in self.desc.inputs:
            for dim, size in zip(d.shape, feeds[d.name].shape):
                if isinstance(dim, str):
                    sizes[dim] = int(size)
        return tuple(sorted(sizes.items()))

    def build_first(self, sample_inputs: Sequence[np.ndarray], outputs: tuple | None) -> TrainingGraphs:
        """Build (or load) the first graphs: those of the sample's shapes with ``specialize`` (static
        graphs build several times faster than symbolic ones on the torch source), else symbolic;
        the symbolic graphs are built only when something needs them."""
        feeds = dict(zip(self.desc.input_names, sample_inputs))
        shape = self.symbol_sizes(feeds) if self.specialize else ()
        graphs = build_training_graphs(self.job, sample_inputs, dims=dict(shape) or None, outputs=outputs,
                                       check_batch=self._check_batch)
        self.first = graphs
        self._constraints[shape] = graphs.meta.get("input_constraints") or {}
        self._first_signature = (shape, outputs)
        self._sample_inputs = list(sample_inputs)
        self._traces[shape] = graphs.forward
        if shape:
            self.specialised.add(shape)
        elif outputs is None:
            self.symbolic = graphs
        return graphs

    def graphs_for(self, signature: tuple | None) -> tuple[Callable[[], onnx.ModelProto],
                                                           Callable[[], onnx.ModelProto]]:
        """Gradient-graph and eval-graph makers for a signature, each asked for on the first step
        that needs it: a signature that is only evaluated builds no gradient graph where the
        source builds its eval graph apart, nor where the gradient graph of the first graphs' sizes
        already computes what it returns."""
        return (lambda: self._graphs(signature).gradient), (lambda: self._eval_graph(signature))

    def _graphs(self, signature: tuple | None) -> TrainingGraphs:
        """The training graphs of a signature, built once."""
        if signature not in self._by_signature:
            shape, outputs = signature or (None, None)
            if (shape or (), outputs) == self._first_signature:
                graphs = self.first
            elif shape is None and outputs is None:
                graphs = self.symbolic_graphs()
            else:
                graphs = self._build_for(shape or (), outputs)
            self._by_signature[signature] = graphs
        return self._by_signature[signature]

    def _eval_graph(self, signature: tuple | None) -> onnx.ModelProto:
        """The eval graph of a signature: its training graphs' where they exist, else one that needs
        no gradient graph (``eval_graph_of`` the first graphs at their sizes, or one built alone)."""
        shape, outputs = signature or (None, None)
        graphs = self._by_signature.get(signature)
        if graphs is None and (shape or (), outputs) == self._first_signature:
            graphs = self.first
        if graphs is not None or not self.job.source.builds_eval_apart:
            return build_eval_graph(self.job, graphs or self._graphs(signature))
        if signature is None:
            return self.symbolic_eval_graph()
        wanted = self.job.returned_outputs(outputs)
        same_sizes = bool(shape) and dict(shape) == self.first.dims
        model = eval_graph_of(self.job, self.first, wanted) if same_sizes else None
        if model is not None:
            logger.info("took the eval graph of outputs %s from the first training graph's forward part", wanted)
            return model
        dtypes = {name: array.dtype for name, array in zip(self.desc.input_names, self._sample_inputs)}
        samples = self._sample_inputs if same_sizes or not shape else self.synthetic_inputs(dtypes, dict(shape))
        return build_eval_graph_alone(self.job, samples, self.first.meta, dims=dict(shape or ()) or None,
                                      outputs=outputs, forward=self._traces.get(shape or ()),
                                      record=self.first.record if same_sizes else None)

    def symbolic_graphs(self) -> TrainingGraphs:
        """The graphs with the description's symbolic dimensions kept symbolic, every output returned."""
        if self.symbolic is None:
            self.symbolic = self._build_for((), None)
        return self.symbolic

    def _build_for(self, shape: tuple, outputs: tuple | None) -> TrainingGraphs:
        """Graphs with the symbol sizes ``shape`` fixed (``()``: symbolic) returning ``outputs``,
        from a trace that serves them when there is one."""
        forward = self._traces.get(shape) or self._traces.get(())
        if forward is None and self.first.forward is not None and self.first.forward.serves(dict(shape) or None):
            forward = self.first.forward
        dtypes = {name: array.dtype for name, array in zip(self.desc.input_names, self._sample_inputs)}
        samples = self.synthetic_inputs(dtypes, dict(shape)) if shape else self._sample_inputs
        graphs = build_training_graphs(self.job, samples, dims=dict(shape) or None, forward=forward, outputs=outputs,
                                       check_batch=self._check_batch)
        self._constraints.setdefault(shape, graphs.meta.get("input_constraints") or {})
        if graphs.forward is not None:  # None: found in the cache without a trace
            self._traces.setdefault(shape if graphs.forward.dims else (), graphs.forward)
        if graphs.meta["trained"] != self.first.meta["trained"]:
            raise RuntimeError("graphs of another input shape train different weights than the first graphs")
        if shape and dict(shape) == self.first.dims and graphs.outputs != self.first.outputs:
            # other outputs of the first graphs' sizes: the same forward, so the first record's
            # verdict on eval mode holds (a reused trace takes no record of its own)
            graphs.eval_is_training = graphs.eval_is_training or self.first.eval_is_training
        return graphs

    def constraints_for(self, feeds: dict[str, np.ndarray]) -> dict | None:
        """The input constraints that hold for these inputs: those of the graphs of their shape once
        traced (exact for it), else of the symbolic graphs, else the first graphs' (whose rules
        that hold for their own shapes only are then skipped: ``BatchChecks``); None before any."""
        if len(self._constraints) <= 1:
            return next(iter(self._constraints.values()), None)
        shape = self.symbol_sizes(feeds) if self.specialize else ()
        found = self._constraints.get(shape) or self._constraints.get(())
        return found if found is not None else self.first.meta.get("input_constraints")

    def full_signature(self, feeds: dict[str, np.ndarray]) -> tuple | None:
        """The signature of graphs returning every output for these inputs' shapes."""
        shape = self.symbol_sizes(feeds) if self.specialize else ()
        return (shape, None) if shape in self.specialised else None

    def signature(self, feeds: dict[str, np.ndarray], outputs: tuple | None) -> tuple | None:
        """The shape signature whose graphs run these inputs returning ``outputs`` (None: the
        symbolic graph). A new shape gets static graphs while fewer than ``max_graphs`` have them."""
        shape = self.symbol_sizes(feeds) if self.specialize else ()
        if shape and shape not in self.specialised:
            if len(self.specialised) < self.max_graphs:
                self.specialised.add(shape)
            else:
                if not self._fallback_logged:
                    logger.info("more than %d input-shape signatures: new ones run on the symbolic graph",
                                self.max_graphs)
                    self._fallback_logged = True
                shape = ()
        if not shape and outputs is None:
            return None
        return (shape or None, outputs)

    def symbolic_eval_graph(self, before_export: Callable[[], None] | None = None) -> onnx.ModelProto:
        """The eval graph with symbolic dimensions and every output: that of the symbolic training
        graphs where they exist, else built alone (no gradient graph) and kept; ``before_export`` runs
        where that means exporting the model (not found in the graph cache)."""
        if self.symbolic is not None:
            return build_eval_graph(self.job, self.symbolic)
        if self._symbolic_eval is None:
            self._symbolic_eval = build_eval_graph_alone(self.job, self._sample_inputs, self.first.meta,
                                                         forward=self._traces.get(()), record=self.first.record,
                                                         before_export=before_export)
        return self._symbolic_eval


__all__ = ["ShapeGraphs"]

"""Gradient source ``"onnxruntime"``: ONNX Runtime's gradient builder (the 1.19.2 training build).

The model is exported with the TorchScript exporter (or taken as given, for an ONNX model with
its loss inside), made trainable, passed through the user's ``extra_postprocess`` hook, and
differentiated by ``GradientGraphBuilder``; gradient accumulation happens inside the graph
(``InPlaceAccumulatorV2``).
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import onnx

from ..._logging import logger
from ..._temporaries import save_model
from ...model_desc import ModelDescription
from .. import cache as graph_cache
from ..export.input_checks import find_input_constraints
from ..export.torchscript import export_torch
from ..job import Built, GradientSource, GraphJob, Prepared, Traced
from ..names import ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, LOSS_SCALE_INPUT, RESET_INPUT
from ..onnx_graph import io_signature, specialize, value_info
from ..passes import forward as rewrites
from ..passes.buffers import expose_running_statistics, frozen_batch_norms_as_arithmetic
from ..passes.trainable import make_trainable
from .ort_builder import (add_gradient_accumulation, build_eval_graph, build_gradient_graph, stop_gradients_to_identity,
                          weights_to_inputs)


_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


class OnnxRuntimeGradientSource(GradientSource):
    """The forward ONNX graph, differentiated by ONNX Runtime's ``GradientGraphBuilder``."""

    name = "onnxruntime"
    accumulates_in_graph = True

    def accumulation_io(self, trained: list[str]) -> tuple[set[str], str]:
        """``InPlaceAccumulatorV2`` adds into each ``ACCUMULATOR_SUFFIX`` input and returns a flag
        (``ACCUMULATED_FLAG_SUFFIX``); ``RESET_INPUT`` makes it overwrite instead
        (``ort_builder.add_gradient_accumulation``)."""
        return {w + ACCUMULATOR_SUFFIX for w in trained} | {RESET_INPUT}, ACCUMULATED_FLAG_SUFFIX

    def trace(self, job: GraphJob, sample_inputs: Sequence[np.ndarray], dims: dict[str, int] | None) -> Traced:
        """Export (or copy) the forward graph, make it trainable, run the user's hook, and move
        every weight to a graph input: that graph is what the cache key hashes. The export is
        symbolic whatever ``dims`` are: ``prepare`` specialises it."""
        forward, torch_keys, trainable, padding = _forward_graph(job, sample_inputs)
        weights_to_inputs(forward, list(torch_keys))
        return Traced(graph_cache.fingerprint_graph(forward), torch_keys, trainable, padding, forward)

    def prepare(self, job: GraphJob, traced: Traced, dims: dict[str, int] | None, outputs: tuple | None,
                input_dtypes: dict[str, str]) -> Prepared:
        """Specialise and rewrite the forward graph; what the cached graphs must then look like."""
        forward, returned = _transform_forward(job, traced.program, dims, outputs)
        if job.save_paths.get("model_after_graph_transforms_path"):
            dump = copy.deepcopy(forward)  # loadable by ONNX Runtime: gradient markers become Identity
            stop_gradients_to_identity(dump)
            save_model(dump, job.save_paths["model_after_graph_transforms_path"])
        weights = {i.name: value_info(i) for i in forward.graph.input if i.name in traced.torch_keys}
        inputs = {i.name: value_info(i) for i in forward.graph.input}
        expected = {"weights": weights, "torch_keys": traced.torch_keys, "outputs": returned,
                    "inputs": {n: dt for n, dt in input_dtypes.items() if n in inputs}}
        inputs[LOSS_SCALE_INPUT] = [[], "float32"]
        return Prepared(expected, inputs, io_signature(forward.graph), forward)

    def input_constraints(self, job: GraphJob, traced: Traced) -> dict:
        """Read off the exported forward graph, before any rewrite."""
        return find_input_constraints(traced.program, job.desc.input_names)

    def build(self, job: GraphJob, traced: Traced, prepared: Prepared) -> Built:
        """Eval graph, BatchNorm statistics as outputs, the builder's backward, the gradient rewrites."""
        forward = prepared.state
        trainable = [w for w in traced.trainable if w not in set(job.frozen_weights)]
        eval_model = build_eval_graph(forward)
        buffer_updates = expose_running_statistics(forward, set(traced.torch_keys) - set(trainable))
        frozen_batch_norms_as_arithmetic(forward)  # the builder would train them in training mode
        gradient, trained = build_gradient_graph(forward, trainable, job.desc.loss_name, prepared.expected["outputs"],
                                                 list(buffer_updates.values()))
        rewrites.mask_padding_rows(gradient, traced.padding)  # semantics, not speed: always
        ranks = {w: len(info[0]) for w, info in prepared.expected["weights"].items()}
        logger.debug("gradient graph rewrites: %s", rewrites.apply_gradient_passes(gradient, job.passes or {}, ranks))
        if job.accumulate:
            add_gradient_accumulation(gradient, trained)
        return Built(gradient, eval_model, trained, buffer_updates)


def _forward_graph(job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> tuple[onnx.ModelProto, dict, list, dict]:
    """Export (or copy) the forward graph, make it trainable and run the user's hook.

    Returns the graph, ``{weight: torch keys}``, the trainable weights and ``{weight: padding_idx}``.
    """
    padding: dict[str, int] = {}
    if isinstance(job.model, onnx.ModelProto):
        forward = copy.deepcopy(job.model)
        check_onnx_io(forward, job.desc)
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


def check_onnx_io(model: onnx.ModelProto, desc: ModelDescription) -> None:
    """Check that an ONNX model's inputs and outputs are the description's.

    Raises:
        ValueError: listing every input or output that does not match.
    """
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


__all__ = ["OnnxRuntimeGradientSource", "check_onnx_io"]

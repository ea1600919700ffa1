"""Gradient source ``"torch"``: PyTorch's autograd, exported with the forward as one ONNX graph.

``torch.export`` traces the model with its loss; autograd gives the joint forward/backward
program, which becomes one graph of standard ONNX operators (``torch_autograd.py``), so the
gradients are PyTorch's by construction and any current ONNX Runtime runs them. An ONNX model
with its loss inside is first turned into an equivalent module (``onnx_to_torch.py``).

The graph cannot add micro-batch gradients into buffers in place (that is a training-build
operator), so with gradient accumulation the engine sums them (``accumulates_in_graph`` False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import onnx

from . import torch_autograd
from .gradient import LOSS_SCALE_INPUT, specialize
from .input_checks import find_input_constraints
from .sources import Built, GradientSource, Prepared, Traced

if TYPE_CHECKING:
    from .pipeline import GraphJob


class TorchGradientSource(GradientSource):
    """PyTorch's autograd, exported to standard ONNX."""

    name = "torch"
    accumulates_in_graph = False

    def trace(self, job: "GraphJob", sample_inputs: Sequence[np.ndarray]) -> Traced:
        """``torch.export`` of the model (an ONNX model converted first) with its loss."""
        if job.extra_postprocess is not None:
            raise ValueError(
                "_internal_use.extra_postprocess edits the forward ONNX graph that ONNX Runtime's gradient builder "
                "differentiates; the 'torch' gradient source differentiates in PyTorch and has no such graph: set "
                "graph.gradient_source='onnxruntime' (needs pip install \"ort_trainer[training]\") or drop the hook")
        model, renamed = job.model, None
        if isinstance(model, onnx.ModelProto):
            from .onnx_to_torch import onnx_to_module

            model, renamed = onnx_to_module(model, job.desc)
        traced = torch_autograd.trace(model, job.loss_fn, job.desc, sample_inputs, job.frozen_weights)
        return Traced(traced.fingerprint, traced.torch_keys, traced.trainable, {},
                      program={"traced": traced, "built": None, "renamed": renamed})

    def prepare(self, job: "GraphJob", traced: Traced, dims: dict[str, int] | None, outputs: tuple | None,
                input_dtypes: dict[str, str]) -> Prepared:
        """The graphs return every description output (fetch-specific graphs are the other source's)."""
        expected = {"outputs": list(job.desc.output_names),
                    "inputs": {n: input_dtypes[n] for n in job.desc.input_names}}
        readable = {name: None for name in [*traced.torch_keys, *job.desc.input_names, LOSS_SCALE_INPUT]}
        return Prepared(expected, readable, None, dims)

    def build(self, job: "GraphJob", traced: Traced, prepared: Prepared) -> Built:
        """The joint graph (built once per trace; a shape specialisation fixes its input dims)."""
        program = traced.program
        if program["built"] is None:  # building consumes the trace: keep the graphs for specialisations
            program["built"] = torch_autograd.build(program["traced"])
        joint = program["built"]
        # copies: the joint graphs stay as built for later specialisations
        dims = prepared.state or {}
        gradient, eval_model = specialize(joint.gradient, dims), specialize(joint.eval, dims)
        if job.save_paths.get("model_after_graph_transforms_path"):
            onnx.save(eval_model, job.save_paths["model_after_graph_transforms_path"])
        meta = joint.meta
        constraints = find_input_constraints(gradient, job.desc.input_names)
        return Built(gradient, eval_model, list(meta["trained"]), dict(meta["buffer_updates"]), constraints,
                     weights=dict(meta["weights"]), torch_keys=dict(meta["torch_keys"]))


__all__ = ["TorchGradientSource"]

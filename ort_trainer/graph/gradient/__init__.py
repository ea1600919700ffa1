"""The gradient-source seam: who turns the model into a forward + backward graph.

Two implementations stand behind one small interface, and the pipeline calls only the interface:

- ``OnnxRuntimeGradientSource`` (``onnxruntime.py``): the TorchScript exporter's forward
  graph, differentiated by ONNX Runtime's ``GradientGraphBuilder`` (the 1.19.2 training build).
- ``TorchGradientSource`` (``torch.py``): PyTorch's autograd, exported with the forward
  as one standard-ONNX graph that any current ONNX Runtime runs.

Both produce graphs of one shape (``Built``): the gradient graph reads the data inputs, the
weights (graph inputs named by their torch ``state_dict`` key) and ``__loss_scale``, and returns
the description's outputs, ``<weight>_grad`` per trained weight (or, where the source
accumulates in the graph, the accumulator flags) and ``<buffer>.updated`` per forward-updated
buffer; the eval graph reads data and weights and returns the description's outputs.
"""

from __future__ import annotations

from ..job import GradientSource
from .onnxruntime import OnnxRuntimeGradientSource
from .torch import TorchGradientSource


def make_gradient_source(name: str) -> GradientSource:
    """The source for a resolved ``graph.gradient_source`` value (``"onnxruntime"`` or ``"torch"``).

    Raises:
        ValueError: for another name.
    """
    if name == "onnxruntime":
        return OnnxRuntimeGradientSource()
    if name == "torch":
        return TorchGradientSource()
    raise ValueError(f"graph.gradient_source: unknown source {name!r}; expected 'onnxruntime' or 'torch'")


__all__ = ["OnnxRuntimeGradientSource", "TorchGradientSource", "make_gradient_source"]

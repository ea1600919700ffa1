"""The gradient-source seam: who turns the model into a forward + backward graph.

Two implementations stand behind one small interface, and the pipeline calls only the interface:

- ``OnnxRuntimeGradientSource`` (``source_onnxruntime.py``): the TorchScript exporter's forward
  graph, differentiated by ONNX Runtime's ``GradientGraphBuilder`` (the 1.19.2 training build).
- ``TorchGradientSource`` (``source_torch.py``): PyTorch's autograd, exported with the forward
  as one standard-ONNX graph that any current ONNX Runtime runs.

Both produce graphs of one shape (``Built``): the gradient graph reads the data inputs, the
weights (graph inputs named by their torch ``state_dict`` key) and ``__loss_scale``, and returns
the description's outputs, ``<weight>_grad`` per trained weight (or, where the source
accumulates in the graph, the accumulator flags) and ``<buffer>.updated`` per forward-updated
buffer; the eval graph reads data and weights and returns the description's outputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import onnx

if TYPE_CHECKING:  # the pipeline imports this module
    from .pipeline import GraphJob


@dataclass
class Traced:
    """What a source traced of the model: the cache key hashes it.

    Attributes:
        fingerprint: hash of the traced program, with weights by name, shape and dtype only.
        torch_keys: ``{weight: [torch state_dict keys]}`` of every weight the graphs read.
        trainable: weights that require grad, in model order.
        padding: ``{weight: padding_idx}`` of embedding tables (for sources that need it).
        program: the source's own traced artefact (a forward ONNX graph, an ExportedProgram).
        dims: the symbol sizes the trace fixed (a static trace serves only graphs of those
            sizes), or None when the symbolic dimensions stayed symbolic (it serves any sizes).
    """

    fingerprint: str
    torch_keys: dict[str, list[str]]
    trainable: list[str]
    padding: dict[str, int] = field(default_factory=dict)
    program: Any = None
    dims: dict[str, int] | None = None

    def serves(self, dims: dict[str, int] | None) -> bool:
        """Whether graphs for symbol sizes ``dims`` (None: symbolic) can be built from this trace."""
        return self.dims is None or self.dims == (dims or None)


@dataclass
class Prepared:
    """What the traced program determines before any graph is built, for one specialisation.

    Attributes:
        expected: metadata fields a cache entry must carry exactly (``weights``, ``torch_keys``,
            ``outputs``, ``inputs``).
        gradient_inputs: ``{name: [shape, dtype]}`` that the graphs may read (``None`` for a type
            only building tells).
        eval_io: the eval graph's ``(inputs, outputs)`` as ``[[name, shape, dtype], ...]``, or
            None when only the names are fixed.
        state: the source's own intermediate (e.g. the transformed forward graph).
    """

    expected: dict
    gradient_inputs: dict[str, list]
    eval_io: tuple | None = None
    state: Any = None


@dataclass
class Built:
    """The graphs a source built, and what the pipeline records about them."""

    gradient: onnx.ModelProto
    #: None when the source builds it only on demand (``GradientSource.build_eval``)
    eval: onnx.ModelProto | None
    trained: list[str]
    buffer_updates: dict[str, str]
    input_constraints: dict
    #: ``{weight: [shape, dtype]}`` and ``{weight: [torch keys]}`` of the weights the graphs read,
    #: where only building tells (else ``Prepared.expected`` has them)
    weights: dict | None = None
    torch_keys: dict | None = None


class GradientSource(ABC):
    """How the forward + backward graph is made."""

    #: the value of ``graph.gradient_source`` that selects it
    name: str = ""
    #: gradient accumulation happens inside the gradient graph (else the engine sums micro-batches)
    accumulates_in_graph: bool = False

    @abstractmethod
    def trace(self, job: "GraphJob", sample_inputs: Sequence[np.ndarray], dims: dict[str, int] | None) -> Traced:
        """Trace the model (cheaply enough to run on every build: a cache hit still traces).

        ``dims`` are the symbol sizes the graphs will be specialised to (None: symbolic); a source
        may trace exactly those shapes (``sample_inputs`` then has them), which is faster to
        build, or ignore them and trace symbolically.
        """

    def trace_eval(self, job: "GraphJob", sample_inputs: Sequence[np.ndarray]) -> Traced:
        """A symbolic trace that ``build_eval`` can take, and no more (``save_as_onnx``: no
        gradient graph is built from it); by default the whole ``trace``."""
        return self.trace(job, sample_inputs, None)

    def record_key(self, job: "GraphJob", sample_inputs: Sequence[np.ndarray]) -> str | None:
        """A key of what the model computes on the sample that is much cheaper than ``trace``
        (``op_record.py``), or None when this source has none: the pipeline then finds cache
        entries by tracing. The pipeline links a record key to an entry only after a trace."""
        return None

    @abstractmethod
    def prepare(self, job: "GraphJob", traced: Traced, dims: dict[str, int] | None, outputs: tuple | None,
                input_dtypes: dict[str, str]) -> Prepared:
        """What the graphs for this specialisation must look like; writes the forward debug dump."""

    @abstractmethod
    def build(self, job: "GraphJob", traced: Traced, prepared: Prepared) -> Built:
        """Build the gradient graph, and the eval graph where that is cheap (else ``Built.eval``
        is None and ``build_eval`` makes it when an evaluation or an export first needs it)."""

    def build_eval(self, job: "GraphJob", traced: Traced, prepared: Prepared) -> onnx.ModelProto:
        """The eval graph alone (for a source whose ``build`` leaves ``Built.eval`` None; by
        default the whole build again)."""
        return self.build(job, traced, prepared).eval

    def eval_fingerprint(self, traced: Traced) -> str:
        """What keys the eval graph beyond ``traced``'s own fingerprint (the training graph's key):
        a source that traces eval mode apart, and only when an evaluation first needs it, returns
        the fingerprint of that trace, so that an edit of code only eval mode runs rebuilds the
        eval graph and not the training graph. By default nothing (``trace`` covers both modes)."""
        return ""


def value_info(info: onnx.ValueInfoProto) -> list:
    """``[shape, numpy dtype name]`` of a graph input or output (symbolic dims by name)."""
    tensor_type = info.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]
    return [shape, str(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))]


def io_signature(graph: onnx.GraphProto) -> tuple[list, list]:
    """A graph's inputs and outputs as ``[[name, shape, dtype], ...]`` lists."""
    return ([[i.name, *value_info(i)] for i in graph.input], [[o.name, *value_info(o)] for o in graph.output])


def make_gradient_source(name: str) -> GradientSource:
    """The source for a resolved ``graph.gradient_source`` value (``"onnxruntime"`` or ``"torch"``).

    Raises:
        ValueError: for another name.
    """
    if name == "onnxruntime":
        from .source_onnxruntime import OnnxRuntimeGradientSource

        return OnnxRuntimeGradientSource()
    if name == "torch":
        from .source_torch import TorchGradientSource

        return TorchGradientSource()
    raise ValueError(f"graph.gradient_source: unknown source {name!r}; expected 'onnxruntime' or 'torch'")


__all__ = ["Built", "GradientSource", "Prepared", "Traced", "io_signature", "make_gradient_source", "value_info"]

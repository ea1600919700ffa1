"""What flows between the graph stages, below all of them.

``GraphJob`` is what the pipeline is asked to build: the model, loss, description, options and
gradient source, and the cache keys they give. ``GradientSource`` is the interface of the
gradient-source seam (``graph/gradient/``: one class per source behind it); ``Traced``,
``Prepared`` and ``Built`` are what a source hands back at each of its steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import onnx
import torch

from ..model_desc import ModelDescription
from ..optim.config import _OptimizerConfig
from . import cache as graph_cache


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
    source: GradientSource = None  # the gradient source (graph/gradient/); the trainer always gives one
    #: mixed precision: "float16" or "bfloat16" traces the forward under torch.autocast (None: fp32)
    autocast: str | None = None

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
                "forward": traced.fingerprint,
                "torch_keys": traced.torch_keys,
                "trainable": list(traced.trainable),
                "padding": sorted(traced.padding.items()),
                **self._shaping(input_dtypes, dims, outputs),
            }
        )

    def returned_outputs(self, outputs: tuple | None) -> list[str]:
        """The description's outputs that graphs built for ``outputs`` (the fetched outputs besides
        the loss; None: all) return, in description order: the loss and those."""
        desc = self.desc
        return [n for n in desc.output_names if outputs is None or n in outputs or n == desc.loss_name]

    def record_cache_key(self, record: str, input_dtypes: dict[str, str], dims: dict[str, int] | None,
                         outputs: tuple | None = None) -> str:
        """The key a record (``GradientSource.record``'s ``key``) links to an entry by: the record and
        the same options as ``cache_key``."""
        return graph_cache.make_key({"record": record, **self._shaping(input_dtypes, dims, outputs)})

    def _shaping(self, input_dtypes: dict[str, str], dims: dict[str, int] | None, outputs: tuple | None) -> dict:
        """What shapes the graphs besides the traced program."""
        return {
            "source": self.source.name,
            "desc": self.desc.fingerprint(),
            "input_dtypes": input_dtypes,
            "frozen": sorted(self.frozen_weights),
            "opset": self.opset,
            "dims": sorted((dims or {}).items()),
            "outputs": list(outputs) if outputs is not None else None,
            "accumulate": self.accumulate,
            "passes": sorted((self.passes or {}).items()),
            # only when set, so that fp32 keys stay those of earlier versions
            **({"autocast": self.autocast} if self.autocast else {}),
        }


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
        eval_is_training: the operator record taken beside the trace found that eval mode runs
            the operators training mode runs, Dropouts aside (``OpRecord.eval_is_training``): a
            source may make the eval-mode program of the training program instead of tracing it.
    """

    fingerprint: str
    torch_keys: dict[str, list[str]]
    trainable: list[str]
    padding: dict[str, int] = field(default_factory=dict)
    program: Any = None
    dims: dict[str, int] | None = None
    eval_is_training: bool = False

    def serves(self, dims: dict[str, int] | None) -> bool:
        """Whether graphs for symbol sizes ``dims`` (None: symbolic) can be built from this trace."""
        return self.dims is None or self.dims == (dims or None)


@dataclass(frozen=True)
class OpRecord:
    """What a source's cheap record of the model on a sample says (``GradientSource.record``).

    Attributes:
        key: a hash of the operators the forward runs in training and in eval mode, with their
            arguments and where their tensors come from: the graph cache links it to the entry a
            trace built (``GraphJob.record_cache_key``).
        eval_is_training: eval mode runs the very operators training mode runs, each Dropout
            taken for the identity (no BatchNorm, no branch on ``self.training`` that changes
            anything else, no Dropout that draws in eval mode too), so the eval graph is the
            training graph's forward part with its Dropouts removed.
    """

    key: str
    eval_is_training: bool = False


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
    #: ``{weight: [shape, dtype]}`` and ``{weight: [torch keys]}`` of the weights the graphs read,
    #: where only building tells (else ``Prepared.expected`` has them)
    weights: dict | None = None
    torch_keys: dict | None = None


class GradientSource(ABC):
    """How the forward + backward graph is made."""

    #: the value of ``graph.gradient_source`` that selects it
    name: str = ""
    #: gradient accumulation happens inside the gradient graph (else the engine sums micro-batches
    #: in a buffer of their own); ``accumulation_io`` says how the graph's interface changes
    accumulates_in_graph: bool = False
    #: the eval graph comes from a trace of its own, built only when needed (``build_eval``), so a
    #: signature that is only evaluated needs no gradient graph (else ``build`` makes both at once)
    builds_eval_apart: bool = False

    def accumulation_io(self, trained: list[str]) -> tuple[set[str], str]:
        """The inputs an accumulating gradient graph (``job.accumulate``) reads besides the others,
        and the suffix of each trained weight's output (``names``); asked only of a source that
        ``accumulates_in_graph``."""
        raise NotImplementedError(f"the {self.name!r} gradient source does not accumulate inside its graph")

    @abstractmethod
    def trace(self, job: GraphJob, sample_inputs: Sequence[np.ndarray], dims: dict[str, int] | None) -> Traced:
        """Trace the model (cheaply enough to run on every build: a cache hit still traces).

        ``dims`` are the symbol sizes the graphs will be specialised to (None: symbolic); a source
        may trace exactly those shapes (``sample_inputs`` then has them), which is faster to
        build, or ignore them and trace symbolically.
        """

    def trace_eval(self, job: GraphJob, sample_inputs: Sequence[np.ndarray],
                   dims: dict[str, int] | None = None) -> Traced:
        """A trace that ``build_eval`` can take, and no more (``save_as_onnx``, a signature only
        evaluated: no gradient graph is built from it), of the sample's sizes where ``dims`` fixes
        them, else symbolic; by default the whole ``trace``."""
        return self.trace(job, sample_inputs, dims)

    def record(self, job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> OpRecord | None:
        """A record of what the model computes on the sample that is much cheaper than ``trace``
        (``op_record.py``), or None when this source has none: the pipeline then finds cache
        entries by tracing. The pipeline links a record key to an entry only after a trace."""
        return None

    @abstractmethod
    def prepare(self, job: GraphJob, traced: Traced, dims: dict[str, int] | None, outputs: tuple | None,
                input_dtypes: dict[str, str]) -> Prepared:
        """What the graphs for this specialisation must look like; writes the forward debug dump."""

    @abstractmethod
    def input_constraints(self, job: GraphJob, traced: Traced) -> dict:
        """What a batch must satisfy for PyTorch to take it (``export.input_checks``): index rules
        and BatchNorm shapes, read off the trace before any build rewrites it, so that the pipeline
        can check the first batch before the build (seconds at real size) starts."""

    @abstractmethod
    def build(self, job: GraphJob, traced: Traced, prepared: Prepared) -> Built:
        """Build the gradient graph, and the eval graph where that is cheap (else ``Built.eval``
        is None and ``build_eval`` makes it when an evaluation or an export first needs it)."""

    def build_eval(self, job: GraphJob, traced: Traced, prepared: Prepared) -> onnx.ModelProto:
        """The eval graph alone (for a source whose ``build`` leaves ``Built.eval`` None; by
        default the whole build again)."""
        return self.build(job, traced, prepared).eval

    def eval_fingerprint(self, traced: Traced) -> str:
        """What keys the eval graph beyond ``traced``'s own fingerprint (the training graph's key):
        a source that traces eval mode apart, and only when an evaluation first needs it, returns
        the fingerprint of that trace, so that an edit of code only eval mode runs rebuilds the
        eval graph and not the training graph. By default nothing (``trace`` covers both modes)."""
        return ""


__all__ = ["Built", "GradientSource", "GraphJob", "OpRecord", "Prepared", "Traced"]

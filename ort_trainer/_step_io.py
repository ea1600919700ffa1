"""How a session run takes its step inputs and hands back its outputs: one seam, two classes.

- ``FreshIO``: each run binds the step's host arrays (ONNX Runtime copies them to the device its
  kernels read them on) and ONNX Runtime allocates the outputs anew, so that a returned tensor is
  never overwritten and the binding holds none of them.
- ``CapturedIO`` (``device.cuda_graph``): every input and output of the run lives at one address for
  the whole training, as a CUDA graph that ONNX Runtime captured replays its kernels on the
  addresses they had when captured. The step's arrays are copied into fixed buffers; the outputs are
  written into fixed buffers and returned as copies.

Below both the sessions of a signature (``_signature_sessions.py``), which pick the class, and the
engine (``engine.py``), which feeds and runs it. ``capture_problems`` says what in a training graph a
replayed capture would compute wrongly, or could not capture at all.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ._run_errors import node_modules
from .devices import Device
from .graph.onnx_graph import RANDOM_OPS  # (their CUDA kernels draw at launch: a replay draws its capture's)
from .graph.passes._graph import _Graph
from .sessions import Sessions

#: run option naming the captured graph a run replays (onnxruntime_run_options_config_keys.h:
#: ``kOrtRunOptionsConfigCudaGraphAnnotation``); -1 runs without capturing or replaying, 0 is reserved
GRAPH_ID_KEY = "gpu_graph_id"

# Nodes whose output shape depends on the values of their inputs (their kernels read a count back
# to the host mid-run, which a capture forbids) and control flow, which CUDA graphs cannot hold
_DATA_DEPENDENT_OPS = frozenset({"NonZero", "Compress", "Unique", "NonMaxSuppression"})
_CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})


def _draws_masks(g: _Graph, node: onnx.NodeProto) -> bool:
    """Whether a Dropout draws a mask: in training mode (or not known not to be) with a ratio not known to be 0.

    ONNX Runtime's CUDA Dropout copies its input and draws nothing when the ratio is 0 or
    ``training_mode`` is absent or false (``cuda/nn/dropout.cc``); an absent ratio is ONNX's 0.5."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    training = g.const(node.input[2])
    if training is not None and not bool(training.flat[0]):
        return False
    ratio = g.const(node.input[1]) if node.input[1] else np.full(1, 0.5)
    return ratio is None or float(ratio.flat[0]) != 0.0


def capture_problems(model: onnx.ModelProto) -> list[str]:
    """What in training graph ``model`` a captured CUDA graph would replay wrongly or cannot hold,
    one line per kind of node, naming the nodes' modules (empty: it can be captured)."""
    g = _Graph(model)
    modules = node_modules(model)
    found: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type in RANDOM_OPS and (node.op_type != "Dropout" or _draws_masks(g, node)):
            kind = ("draws random numbers: a replayed capture would draw the same ones every step "
                    "(dropout: graph_optimizations.seeded_dropout, gradient source 'torch', draws float32, float16 and "
                    "bfloat16 dropouts on the device, with ort_trainer's CUDA kernels: nvcc or "
                    "$ORT_TRAINER_KERNELS_LIBRARY; or set the model's dropout probabilities to 0 to train with "
                    "device.cuda_graph; other draws, a layer drop or SpecAugment's masks: set layerdrop, "
                    "mask_time_prob and mask_feature_prob to 0)")
        elif node.op_type in _DATA_DEPENDENT_OPS:
            kind = "has an output whose shape depends on the batch's values, which a capture fixes"
        elif node.op_type in _CONTROL_FLOW_OPS:
            kind = "is control flow, which CUDA graphs cannot hold"
        else:
            continue
        found.setdefault(f"{node.op_type} {kind}", []).append(modules.get(node.name, node.name or "(unnamed)"))
    return [f"{what}: {', '.join(dict.fromkeys(where))}" for what, where in found.items()]


def _host_tensor(value: np.ndarray) -> torch.Tensor:
    """A torch view of ``value`` (a copy of a read-only array, which torch will not wrap)."""
    array = np.ascontiguousarray(value)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _bound_outputs(binding: ort.IOBinding, names: list[str]) -> dict[str, torch.Tensor]:
    """The first ``len(names)`` outputs of ``binding``'s last run by name, as torch tensors over their memory
    (DLPack: no copy)."""
    values = binding._iobinding.get_outputs()  # the raw list: no wrapper per bound output
    return {name: torch.utils.dlpack.from_dlpack(value.to_dlpack()) for name, value in zip(names, values)}


class FreshIO:
    """Binds each run's host arrays and lets ONNX Runtime allocate the outputs anew every run.

    Args:
        device: the engine's device.
        binding: the session's binding, its outputs bound first (``outputs``, in that order).
        outputs: the outputs the run returns, by name.
    """

    def __init__(self, device: Device, binding: ort.IOBinding, outputs: list[str]):
        self.device, self.binding, self.outputs = device, binding, list(outputs)

    def feed(self, name: str, value: np.ndarray) -> None:
        """Bind a step input held in host memory for the next run."""
        self.device.bind_feed(self.binding, name, value)

    def run(self, sessions: Sessions, session: ort.InferenceSession, what: str, data: dict,
            training: bool) -> dict[str, torch.Tensor]:
        """Run the binding; the outputs by name, as torch tensors over ONNX Runtime's memory (DLPack: no copy)."""
        try:
            sessions.run(session, self.binding, what, data, training)
            return _bound_outputs(self.binding, self.outputs)
        finally:
            # the outputs are bound to fresh buffers again after every run: returned tensors are never
            # overwritten, and the binding, which holds each output until it is bound again, holds none. An
            # output the caller drops goes back to the arena at once; held, GPT-2 small's 103 MB of logits from
            # the last eval_step kept a chunk of the region the next training step's logits had used, and the
            # arena grew by another one (training after evaluating peaked at 2907 MB against 2790, 2806 with this)
            for name in self.outputs:
                self.device.bind_fresh_output(self.binding, name)


class CapturedIO:
    """Fixed buffers for every step input and output of a binding whose run ONNX Runtime captures.

    The first run learns the outputs' shapes: it runs without capture (graph id -1) into outputs
    ONNX Runtime allocates, which become the fixed buffers' first values. Every later run replays
    the capture of graph ``graph_id`` (ONNX Runtime captures on the first of them, after two runs
    of warm-up within that same call: the graph must compute the same values each time it runs on
    the same inputs, as a training graph that writes its gradients does). What torch allocates during
    that run (torch's attention kernels; the graph's tensors under ``device.torch_allocator``) comes from
    a pool of the capture's own (``Device.capture_memory``): the replays write there.

    Args:
        device: the engine's device.
        binding: the session's binding, with the engine's weights and gradient buffers bound.
        outputs: the outputs the run returns, by name.
        returned: those of ``outputs`` handed to the caller, returned as copies (the next run
            overwrites the buffers); the others are read before the next run and returned as they are.
        graph_id: the capture's graph id, at least 1 (one per binding of a session).
    """

    def __init__(self, device: Device, binding: ort.IOBinding, outputs: list[str], returned: set[str],
                 graph_id: int):
        self.device, self.binding, self.outputs, self.returned = device, binding, list(outputs), set(returned)
        self.inputs: dict[str, torch.Tensor] = {}
        self.fixed: dict[str, torch.Tensor] | None = None  # the output buffers, after the first run
        self.captured = False  # whether ONNX Runtime has captured the graph (in the second run)
        self._learn, self._replay = ort.RunOptions(), ort.RunOptions()
        self._learn.add_run_config_entry(GRAPH_ID_KEY, "-1")
        self._replay.add_run_config_entry(GRAPH_ID_KEY, str(graph_id))

    def feed(self, name: str, value: np.ndarray) -> None:
        """Copy a step input into its fixed buffer (made and bound on its first use)."""
        host = _host_tensor(value)
        buffer = self.inputs.get(name)
        if buffer is None:
            buffer = self.inputs[name] = torch.empty(host.shape, dtype=host.dtype, device=self.device.torch_device)
            self.device.bind_input(self.binding, name, buffer)
        elif buffer.shape != host.shape or buffer.dtype != host.dtype:
            raise ValueError(
                f"device.cuda_graph: input {name!r} is {tuple(host.shape)} {host.dtype} where this graph's captured "
                f"step took {tuple(buffer.shape)} {buffer.dtype}: the batch shapes past "
                "graph_optimizations.max_shape_graphs share one graph, captured for the first of them. Pad batches "
                "to a few shapes, raise max_shape_graphs, or turn device.cuda_graph off")
        buffer.copy_(host)

    def run(self, sessions: Sessions, session: ort.InferenceSession, what: str, data: dict,
            training: bool) -> dict[str, torch.Tensor]:
        """Run (the first time) or replay the binding; the outputs by name."""
        if self.fixed is not None:
            if self.captured:
                sessions.run(session, self.binding, what, data, training, self._replay)
            else:  # ONNX Runtime captures in this run: what torch allocates meanwhile stays the graph's
                with self.device.capture_memory():
                    sessions.run(session, self.binding, what, data, training, self._replay)
                self.captured = True
            return {name: buffer.clone() if name in self.returned else buffer for name, buffer in self.fixed.items()}
        sessions.run(session, self.binding, what, data, training, self._learn)
        outputs = _bound_outputs(self.binding, self.outputs)
        self.fixed = {name: tensor.clone() for name, tensor in outputs.items()}
        for name, buffer in self.fixed.items():
            self.device.bind_output(self.binding, name, buffer)
        return outputs


__all__ = ["CapturedIO", "FreshIO", "GRAPH_ID_KEY", "RANDOM_OPS", "capture_problems"]

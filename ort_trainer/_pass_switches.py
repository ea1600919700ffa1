"""The graph passes a trainer's options turn on (``graph_optimizations``), as its device and the step take them.

Most switches go to the graph job as they are; some depend on what the device is and what is at hand: the host draws
a CPU graph's dropout masks (``host_dropout_masks``), a GPU's recomputed values wait for the backward in one kernel
node (``device_barriers``), and a GPU step that must draw repeatable masks (a captured one, or one whose sublayers
``layer_recompute`` copies) draws them from a seed in device memory (``seeded_dropout``), the last two with the
kernel library's CUDA kernels. A captured step (``device.cuda_graph``) projects every label's row (no
``sparse_labels``: its count would be fixed by the capture).
"""

from __future__ import annotations

from . import kernels
from ._logging import logger
from .devices import device_class
from .graph.passes import EVAL_PASSES, JOINT_PASSES
from .graph.passes.forward import FORWARD_PASSES, GRADIENT_PASSES
from .options import ORTTrainerOptions


def pass_switches(opts: ORTTrainerOptions) -> dict:
    """``{pass name: on}`` for the graph job (with ``loss_piece_elements``, the loss pieces' size)."""
    on, device = opts.graph_optimizations, device_class(opts.device.id)
    captured = opts.device.cuda_graph
    at_hand = kernels.cuda_kernels_at_hand()
    return {**{name: on[name] for name in dict.fromkeys(FORWARD_PASSES + GRADIENT_PASSES + JOINT_PASSES + EVAL_PASSES)},
            "sparse_labels": on.sparse_labels and not captured,
            "loss_piece_elements": on.loss_piece_elements,
            "host_dropout_masks": on.host_dropout_masks and device.host_dropout_masks,
            "fused_lstm": on.fused_lstm and device.onednn_kernels,
            "torch_convolutions": on.torch_convolutions and device.onednn_kernels,
            "torch_batch_norm": on.torch_batch_norm and device.onednn_kernels,
            "device_barriers": on.device_barriers and device.device_barriers and _barriers_at_hand(on, at_hand),
            "seeded_dropout": bool(on.seeded_dropout and device.seeded_dropout and (captured or on.layer_recompute)
                                   and at_hand)}


def _barriers_at_hand(on, at_hand: bool) -> bool:
    """Whether ``device_barriers``, asked for on a device that reads a Reshape's shape on the host, can be had (a
    kernel library with CUDA kernels at hand); a warning where recomputed values' waits will be copied to the host
    instead."""
    if not at_hand and (on.activation_recompute or on.layer_recompute):
        logger.warning("graph_optimizations.device_barriers needs ort_trainer's kernel library with CUDA kernels, and "
                       "there is no nvcc here nor $ORT_TRAINER_KERNELS_LIBRARY: each wait of the recomputed values "
                       "for the backward will be copied to the host every step (a wait for the GPU each layer, and "
                       "no device.cuda_graph). Install nvcc, set $ORT_TRAINER_KERNELS_LIBRARY to a library `make "
                       "kernels` built, or turn graph_optimizations.activation_recompute off")
    return at_hand


__all__ = ["pass_switches"]

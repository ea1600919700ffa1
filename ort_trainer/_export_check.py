"""``debug.check_model_export``: the exported model's outputs against PyTorch's, on two inputs."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ._logging import logger
from .devices import host_array
from .engine import Engine
from .graph.export.guard import _model_left_untouched
from .graph.export.torchscript import ExportMismatchError, _ModelWithLoss, export_order
from .graph.gradient.torch_export import autocast_context
from .model_desc import ModelDescription


def check_model_export(model: torch.nn.Module, loss_fn: Callable | None, desc: ModelDescription, autocast: str | None,
                       engine: Engine, full_signature: Callable[[dict], tuple | None],
                       sample_inputs: Sequence[np.ndarray]) -> None:
    """Compare the torch model's eval-mode outputs with the ONNX eval graph's on two inputs.

    The first batch, then a second input made from it with other values (reversed along the
    first axis, floating-point values negated): a branch or value the export froze at the
    traced batch's value shows up on the second one.

    Args:
        autocast: the mixed-precision dtype the graphs were traced under (None: fp32).
        engine: the trainer's engine, built; ``full_signature`` picks its graphs for a batch.

    Raises:
        ExportMismatchError: naming the first output that differs (beyond rtol 1e-3, atol 1e-5;
            with mixed precision, against the model under the same autocast: rtol 1e-2, atol 1e-3)
            and the input it differs on.
    """
    count = len(desc.inputs) - (1 if loss_fn is not None else 0)
    wrapper = _ModelWithLoss(model, loss_fn, desc.input_names[:count])

    def other_values(array: np.ndarray) -> np.ndarray:
        array = np.asarray(array)
        flipped = np.flip(array, axis=0) if array.ndim else array
        return np.ascontiguousarray(-flipped if np.issubdtype(array.dtype, np.floating) else flipped)

    checks = [("the first batch", [np.asarray(a) for a in sample_inputs]),
              ("a second input (the first batch reversed along its first axis, floating-point values "
               "negated): the export froze a value or branch at the batch it traced",
               [other_values(a) for a in sample_inputs])]
    engine.select(full_signature(dict(zip(desc.input_names, sample_inputs))), training=False)
    for which, inputs in checks:
        with _model_left_untouched(model), torch.no_grad(), autocast_context(autocast):
            model.eval()
            expected = dict(zip(export_order(desc, loss_fn is not None),
                                wrapper(*(torch.from_numpy(a) for a in inputs))))
        got = engine.evaluate(dict(zip(desc.input_names, inputs)))
        for name in desc.output_names:
            a, b = (host_array(t) for t in (expected[name], got[name]))
            rtol, atol = (1e-2, 1e-3) if autocast else (1e-3, 1e-5)
            if a.shape != b.shape or not np.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
                detail = (f"shapes {list(a.shape)} vs {list(b.shape)}" if a.shape != b.shape
                          else f"max abs difference {float(np.nanmax(np.abs(a - b))):.3g}")
                raise ExportMismatchError(
                    f"debug.check_model_export: output {name!r} of the exported model differs from PyTorch "
                    f"({detail}) on {which}; the export does not reproduce the model "
                    "(see docs/export_limits.md)")
    logger.info("debug.check_model_export: %d outputs match PyTorch on two inputs", len(desc.output_names))


__all__ = ["check_model_export"]

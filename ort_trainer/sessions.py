"""ONNX Runtime sessions with the engine's options, and buffers bound to them in place.

Below both the engine (``engine.py``), which makes the gradient and eval sessions, and the optimizer
update (``update.py``), which makes the optimizer graph's: one ``Sessions`` per engine holds the
session options, the execution providers of the engine's device and what ONNX Runtime copies at
binding time.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch

from ._logging import logger
from .devices import Device


class Sessions:
    """Makes sessions and binds buffers for one engine.

    Args:
        placement: the engine's device (``devices.Device``).
        options: the session options every session gets.
        providers: the execution providers and their options.
        disabled_optimizers: ONNX Runtime graph optimizers turned off.
    """

    def __init__(self, placement: Device, options: ort.SessionOptions, providers: list,
                 disabled_optimizers: list[str]):
        self.placement = placement
        self.options = options
        self._providers = providers
        self._disabled_optimizers = disabled_optimizers
        self._copied_inputs: dict[int, set[str]] = {}  # by id(session): see bind_buffer
        self._rebinds: dict[int, list[tuple[str, torch.Tensor]]] = {}  # by id(binding)

    def make_session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        """A session of ``model`` with these session options and execution providers, once the
        device has found nothing in the graph it cannot run (``Device.check_graph``)."""
        self.placement.check_graph(model)
        return ort.InferenceSession(model.SerializeToString(), self.options, providers=self._providers,
                                    disabled_optimizers=self._disabled_optimizers)

    def bind_buffer(self, session: ort.InferenceSession, binding: ort.IOBinding, name: str,
                    tensor: torch.Tensor) -> None:
        """Bind a buffer that ``session`` reads in place. One that ONNX Runtime copies when it is
        bound instead (its consumers run on another device) is bound again before every run, or
        the session would keep reading the value it had at binding time."""
        copied = self._copied_inputs.get(id(session))
        if copied is None:
            copied = self._copied_inputs[id(session)] = self.placement.inputs_copied_at_binding(session)
            if copied:
                logger.warning("ONNX Runtime reads %s from another device than %s (their consumers have no kernel "
                               "there); they are copied before every run", ", ".join(sorted(copied)),
                               self.placement.torch_device)
        self.placement.bind_input(binding, name, tensor)
        if name in copied:
            self._rebinds.setdefault(id(binding), []).append((name, tensor))

    def before_run(self, binding: ort.IOBinding) -> None:
        """Order a run of ``binding`` after torch's work and rebind what ONNX Runtime copies at binding."""
        self.placement.synchronize()  # first: the copies below read buffers torch may still be writing
        for name, tensor in self._rebinds.get(id(binding), ()):
            self.placement.bind_input(binding, name, tensor)


__all__ = ["Sessions"]

"""What the traced forward changes in the model's weights and buffers: ``ExportGuard``'s state checks.

A weight or buffer the forward changes is refused, BatchNorm statistics excepted (the graphs train
them), and on the ``torch`` route a persistent buffer changed in place (``_stored``): an exponential
moving average, spectral normalisation's power-iteration vectors, an ``InstanceNorm``'s running
statistics. Functionalization makes such a change an output of the training program, which the trainer
stores after each step as BatchNorm's (``gradient/autograd._gradient_graph``).
"""

from __future__ import annotations

from typing import Any

import torch


class StateChanges:
    """The state checks of ``ExportGuard`` (a mixin: ``_wrapper``, ``_stop_gradients``, ``_labels`` and
    ``_problems`` are the guard's)."""

    def _state_versions(self) -> dict[tuple[str, str], tuple[int, int, bool]]:
        """``{(module path, tensor name): (id, version, is BatchNorm statistic)}`` of every weight and buffer."""
        state = {}
        for path, module in self._wrapper.named_modules():
            batch_norm = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None:
                    state[(path, name)] = (id(tensor), tensor._version, batch_norm)
        return state

    def check_program(self, program: Any) -> None:
        """Report the weights and buffers a ``torch.export`` program changes (its mutation outputs),
        BatchNorm statistics excepted: tracing changes fake copies, so ``exporting`` cannot see it.

        Args:
            program: the ``torch.export`` program traced from the wrapper.
        """
        from torch.export.graph_signature import OutputKind

        modules = dict(self._wrapper.named_modules())
        for spec in program.graph_signature.output_specs:
            if spec.kind not in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION) or not spec.target:
                continue
            path, _, name = spec.target.rpartition(".")
            module = modules.get(path)
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                continue
            if spec.kind == OutputKind.BUFFER_MUTATION and _stored(module, name):
                continue
            self._report_state_change(path, name, module, spec.kind == OutputKind.PARAMETER_MUTATION)

    def _report_state_change(self, path: str, name: str, module: torch.nn.Module | None, weight: bool) -> None:
        key = f"{path[len('model.'):]}.{name}" if path.startswith("model.") else name
        fix = ("change a persistent buffer in place instead (with torch.no_grad(): buf.mul_(0.9).add_(...)): the "
               "torch gradient source stores those after each step" if not weight and not self._stop_gradients else
               "the trainer stores the weights it trains, BatchNorm statistics and, on the torch gradient source, "
               "persistent buffers changed in place")
        self._problems.setdefault(("state", key), (
            f"the forward changes {'weight' if weight else 'buffer'} {key!r} (in place or by assigning a new tensor), "
            "in module {modules}: the exported graph reads its value from before the step and never stores a new "
            f"one, so each step would start from the same value where PyTorch keeps the change; {fix}; or move that "
            "update out of the forward", [self._labels.get(id(module), path) if module is not None else path]))

    def _check_state(self, before: dict[tuple[str, str], tuple[int, int, bool]]) -> None:
        """Report weights and buffers the traced forward changed (BatchNorm statistics are trained)."""
        modules = dict(self._wrapper.named_modules())
        for (path, name), (identity, version, batch_norm) in before.items():
            module = modules.get(path)
            tensor = None if module is None else {**module._parameters, **module._buffers}.get(name)
            if batch_norm or (tensor is not None and id(tensor) == identity and tensor._version == version):
                continue
            weight = module is not None and name in module._parameters
            if not (weight or self._stop_gradients) and id(tensor) == identity and _stored(module, name):
                continue
            self._report_state_change(path, name, module, weight)


def _stored(module: torch.nn.Module | None, name: str) -> bool:
    """Whether the ``torch`` route stores buffer ``name`` of ``module`` changed in place by the forward: its new
    value is an output of the graph (functionalization's mutation output) that the trainer keeps after each step,
    as BatchNorm's statistics. A buffer not in the state dict (non-persistent) is a constant of the graphs; one
    replaced by assignment leaves no trace in the program."""
    return module is not None and name in module._buffers and name not in module._non_persistent_buffers_set


__all__ = ["StateChanges"]

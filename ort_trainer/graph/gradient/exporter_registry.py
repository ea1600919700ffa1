"""The exporter's operator registry, each torchlib function's signature inferred when first looked up.

``torch.onnx``'s ``ONNXRegistry.from_torchlib()`` infers the ONNX signature of every torchlib
function when it registers it (~500 functions; each one's Python source read, tokenized and parsed
by onnxscript's ``function_ir``): 0.8 s of every process that exports, on the 2-core machine, where
a GPT-2 or BERT program uses ~50 of them. ``lazy_torchlib_registry`` registers the same functions
for the same targets, in the same order, with the same opset clean-up, and infers a function's
signature when the exporter's dispatcher first asks for its target (``get_decomps``). The keys and
the targets (what ``torch.onnx``'s decomposition table is made from) are known at once; a function
whose signature cannot be inferred is dropped then, as ``from_torchlib`` drops it when registering
(``tests/test_exporter_registry.py``: every target, function and signature equals ``from_torchlib``'s).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.onnx._internal.exporter import _registration

logger = logging.getLogger(__name__)

_DEFAULT_OPSET_INTRODUCED = _registration.OnnxDecompMeta.__dataclass_fields__["opset_introduced"].default


@dataclasses.dataclass
class _Pending:
    """A torchlib function registered for ``fx_target``, its signature not inferred yet (the fields the
    registry's clean-up and ``_decomp.get_onnx_implemented_overloads`` read)."""

    onnx_function: Any
    fx_target: Any
    is_complex: bool
    is_custom: bool = False
    opset_introduced: int = _DEFAULT_OPSET_INTRODUCED

    def meta(self) -> _registration.OnnxDecompMeta | None:
        """The registry entry ``from_torchlib`` makes of this function (its signature inferred), or None
        where the inference fails (``from_torchlib`` skips such a function too)."""
        try:
            return _registration.OnnxDecompMeta(onnx_function=self.onnx_function, fx_target=self.fx_target,
                                                signature=None, is_custom=False, is_complex=self.is_complex)
        except Exception:  # noqa: BLE001 - from_torchlib logs and skips any failure to register a function
            logger.debug("torchlib function %s for %s has no ONNX signature: skipped", self.onnx_function,
                         self.fx_target, exc_info=True)
            return None


class LazyRegistry(_registration.ONNXRegistry):
    """An ``ONNXRegistry`` whose torchlib entries become ``OnnxDecompMeta`` on their first lookup."""

    def get_decomps(self, target: Any) -> list[_registration.OnnxDecompMeta]:
        """``ONNXRegistry.get_decomps``, after inferring the signatures of ``target``'s functions."""
        key = target.name() if isinstance(target, torch._ops.OpOverload) else target
        entries = self.functions.get(key)
        if entries and any(isinstance(entry, _Pending) for entry in entries):
            metas = [entry.meta() if isinstance(entry, _Pending) else entry for entry in entries]
            self.functions[key] = [meta for meta in metas if meta is not None]
        return super().get_decomps(target)


def lazy_torchlib_registry() -> _registration.ONNXRegistry:
    """What ``ONNXRegistry.from_torchlib()`` returns, with the torchlib functions' signatures inferred on
    demand; ``from_torchlib()`` itself where this onnxscript does not lay its registry out as expected."""
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    try:
        from onnxscript.function_libs.torch_lib import ops, registration

        del ops  # imported for its side effect: torchlib's functions register themselves
        onnxscript_functions = registration.default_registry.items()
    except (ImportError, AttributeError):
        return _registration.ONNXRegistry.from_torchlib()
    registry = LazyRegistry()
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, functions in onnxscript_functions:
        if qualified_name.startswith("internal::"):
            continue  # onnxscript's own helpers, as from_torchlib skips them
        target = _registration._get_overload(qualified_name)
        if target is None:
            continue
        for function in functions.overloads:
            registry._register(target, _Pending(function, target, is_complex=False))
        for function in functions.complex:
            registry._register(target, _Pending(function, target, is_complex=True))
    registry._cleanup_registry_based_on_opset_version()
    return registry

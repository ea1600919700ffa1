"""``graph/gradient/exporter_registry.py``: the exporter's registry with each torchlib function's
signature inferred on its first lookup is ``ONNXRegistry.from_torchlib()``'s registry, entry for entry."""

import pytest

from ort_trainer import _runtime

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the exporter's registry is onnxscript's torchlib")


def _entries(registry, target):
    return [(meta.onnx_function, meta.fx_target, meta.is_custom, meta.is_complex, meta.opset_introduced,
             str(meta.signature)) for meta in registry.get_decomps(target)]


def test_the_lazy_registry_holds_from_torchlibs_targets_functions_and_signatures():
    from torch.onnx._internal.exporter import _decomp, _registration

    from ort_trainer.graph.gradient import exporter_registry
    from ort_trainer.graph.gradient.joint_onnx import _quiet_exporter

    with _quiet_exporter():
        eager = _registration.ONNXRegistry.from_torchlib()
        lazy = exporter_registry.lazy_torchlib_registry()
    assert isinstance(lazy, exporter_registry.LazyRegistry)
    assert lazy.opset_version == eager.opset_version
    # the keys, and the targets the decomposition table is made from, before any signature is inferred
    assert list(lazy.functions) == list(eager.functions)
    assert _decomp.get_onnx_implemented_overloads(lazy) == _decomp.get_onnx_implemented_overloads(eager)
    pending = sum(isinstance(e, exporter_registry._Pending) for entries in lazy.functions.values() for e in entries)
    assert pending > 400  # torchlib's ~500 functions wait for their first lookup
    for key, entries in eager.functions.items():
        target = entries[0].fx_target
        assert _entries(lazy, target) == _entries(eager, target), key
    assert not [e for entries in lazy.functions.values() for e in entries if isinstance(e, exporter_registry._Pending)]


def test_a_function_whose_signature_cannot_be_inferred_is_dropped_as_from_torchlib_drops_it():
    import torch

    from ort_trainer.graph.gradient import exporter_registry

    def not_onnxscript(x):  # a plain function: its signature is read from its parameters
        return x

    target = torch.ops.aten.abs.default
    registry = exporter_registry.LazyRegistry()
    registry._register(target, exporter_registry._Pending(object(), target, is_complex=False))
    assert registry.get_decomps(target) == [] and not registry.is_registered(target)
    registry._register(target, exporter_registry._Pending(not_onnxscript, target, is_complex=False))
    (meta,) = registry.get_decomps(target)
    assert meta.onnx_function is not_onnxscript and meta.fx_target is target

"""ONNX schemas of this package's own operators: what onnxscript reads to emit their nodes, and onnx's checker.

The kernel library's operators (``kernel_ops.py``), the attention operators (``attention_ops.py``) and the CTC
operators (``ctc_ops.py``) each describe theirs as ``{name: (inputs, outputs, attributes)}``: a parameter is
``(name, type)``, its type a key of ``types`` (the tensor types it allows: one constraint per key an operator
uses); attributes are names, typed by ``attribute_types`` (INT where not listed).
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

import onnx

Parameter = tuple[str, str]


def register(domain: str, version: int, doc: str, schemas: Mapping[str, tuple[Sequence[Parameter],
             Sequence[Parameter], Sequence[str]]], types: Mapping[str, Sequence[str]],
             attribute_types: Mapping[str, onnx.defs.OpSchema.AttrType] | None = None,
             variadic: Collection[tuple[str, str]] = ()) -> None:
    """Register each operator of ``schemas`` in ``domain`` at ``version`` (where not registered yet, so that calls
    after the first do nothing); ``variadic`` holds the ``(operator, parameter)`` pairs that take one or more
    tensors, and ``doc`` names the operators' family (``"ort_trainer's kernel library"``)."""
    schema, formal = onnx.defs.OpSchema, onnx.defs.OpSchema.FormalParameter
    option = schema.FormalParameterOption
    attribute_types = attribute_types or {}
    for name, (inputs, outputs, attributes) in schemas.items():
        if onnx.defs.has(name, domain):
            continue

        def parameter(p: Parameter, op: str = name) -> onnx.defs.OpSchema.FormalParameter:
            return formal(*p, param_option=option.Variadic if (op, p[0]) in variadic else option.Single)

        used = sorted({kind for _, kind in [*inputs, *outputs]})
        onnx.defs.register_schema(schema(
            name, domain, version, doc=f"{doc}: {name}",
            inputs=[parameter(p) for p in inputs], outputs=[parameter(p) for p in outputs],
            type_constraints=[(kind, list(types[kind]), kind) for kind in used],
            attributes=[schema.Attribute(a, attribute_types.get(a, schema.AttrType.INT), a, required=False)
                        for a in attributes]))


__all__ = ["register"]

"""Explicit type promotion before the ONNX translation, only where a node needs it.

torch's ONNX exporter makes every implicit type promotion of a program explicit before it
translates it (``insert_type_promotion_nodes``: an ``int64`` tensor divided by another becomes a
float division of casts, a Python integer scaling a float tensor a float constant; torchlib's
functions want operands of one type). Its pass re-runs every node of the program on fake tensors
to refresh their metadata, also where no operand needs a cast: HF GPT-2's float32 eval-mode
program (the one ``save_as_onnx`` translates) has none, and the pass took 2.3 s of GPT-2 small's
first save. A joint program does have some (Python integers scaling float tensors,
a sum of booleans), and so does a float16 one (autocast's mixed operands).

``insert_type_promotions`` asks each node's promotion rule first, as the pass itself does
(``_TypePromotionInterpreter._maybe_promote_node``: the rule's ``preview_type_promotion`` on the
operands' metadata), and runs the pass on a (sub)module only when some operand's type differs
from what its rule computes, the one case in which the pass changes the graph. A module without
such an operand is left as the pass would leave it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def insert_type_promotions(graph_module: torch.fx.GraphModule) -> int:
    """The exporter's explicit type promotion, in place, on each (sub)module that needs it.

    Args:
        graph_module: a program's graph module (``ExportedProgram.graph_module``), with each node's
            ``meta["val"]``.

    Returns:
        How many (sub)modules the pass ran on.
    """
    from torch.onnx._internal.fx import passes
    from torch.onnx._internal.fx.passes import type_promotion

    table = type_promotion.TypePromotionTable()
    ran = 0
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule) and _needs_promotion(module, table, type_promotion):
            passes.InsertTypePromotion(module).run()
            ran += 1
    logger.debug("type promotion: the pass ran on %d module(s)", ran)
    return ran


def _needs_promotion(module: torch.fx.GraphModule, table: Any, type_promotion: Any) -> bool:
    """Some node of ``module`` has an operand whose type its promotion rule would change."""
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        rule = type_promotion.get_type_promotion_rule(node, table)
        if rule is None:
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
        try:
            preview = rule.preview_type_promotion(args, kwargs)
        except Exception:  # noqa: BLE001  (the pass itself decides what such a node needs)
            return True
        if any(_differs(arg, preview.args_dtypes.get(index)) for index, arg in enumerate(args)) or any(
                _differs(arg, preview.kwargs_dtypes.get(name)) for name, arg in kwargs.items()):
            return True
    return False


def _differs(value: Any, dtype: torch.dtype | None) -> bool:
    """The pass would cast ``value`` (an operand's metadata) to ``dtype`` (None: the rule leaves it);
    True where unsure (no metadata, an unknown kind of value), so that the pass runs."""
    if dtype is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype
    if isinstance(value, (list, tuple)):
        return any(_differs(item, dtype) for item in value)
    scalar = {bool: torch.bool, int: torch.int64, float: torch.float32, complex: torch.complex64,
              torch.SymBool: torch.bool, torch.SymInt: torch.int64, torch.SymFloat: torch.float32}.get(type(value))
    return scalar is None or scalar != dtype


__all__ = ["insert_type_promotions"]

"""Explicit type promotion before the ONNX translation, only where a node needs it.

torch's ONNX exporter makes every implicit type promotion of a program explicit before it
translates it (``insert_type_promotion_nodes``: an ``int64`` tensor divided by another becomes a
float division of casts, a Python integer scaling a float tensor a float constant; torchlib's
functions want operands of one type). Its pass re-runs every node of the program on fake tensors
to refresh their metadata, also the nodes that need no cast: HF GPT-2's float32 eval-mode program
(the one ``save_as_onnx`` translates) has none at all, and the pass took 2.3 s of GPT-2 small's
first save; its joint program has a few dozen (Python integers scaling float tensors, a sum of
booleans) among thousands of nodes, and the pass took ~1 s of the cold build.

``insert_type_promotions`` asks each node's promotion rule first, as the pass itself does
(``_TypePromotionInterpreter._maybe_promote_node``: the rule's ``preview_type_promotion`` on the
operands' metadata), and runs the pass's own interpreter on those nodes only, each from its
operands' metadata (what re-running every node before it gives them): the same casts, inserted
and re-run as the pass inserts and re-runs them, and no re-run of the nodes that need none. A
module without such a node is left as it is, as the pass would leave it.

After inserting a cast the pass finds the operator overload that takes the new operands. torch before
2.13 found it by running the operator under a mode that records what dispatches first
(``find_compatible_op_overload``), and a fake tensor asked for its device there (``prim.device``) came
first: "Expected same OpOverload packet, got prim.device != aten.add" (torch 2.11, under mixed precision:
the float32 ``add`` of a loss piece's logits and the head's bias vector). ``_overloads_by_schema`` finds it
as torch 2.13 does, by matching each overload's schema against the operands, and stands in for the older
search while the pass runs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)


def insert_type_promotions(graph_module: torch.fx.GraphModule) -> int:
    """The exporter's explicit type promotion, in place, on the nodes that need it.

    Args:
        graph_module: a program's graph module (``ExportedProgram.graph_module``), with each node's
            ``meta["val"]``; its submodules (autocast regions) are promoted too.

    Returns:
        How many nodes were promoted.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx import traceback as fx_traceback
    from torch.onnx._internal.fx import passes, type_utils
    from torch.onnx._internal.fx.passes import type_promotion

    table = type_promotion.TypePromotionTable()
    promoted = 0
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        _numbers_second(module.graph)
        # the scalar -> dtype table the pass casts Python numbers by
        nodes = _needing_promotion(module, table, type_promotion, type_utils.from_scalar_type_to_torch_dtype)
        if not nodes:
            continue
        transform = passes.InsertTypePromotion(module, table)
        interpreter = transform.interpreter
        interpreter.env = {node: node.meta["val"] for node in module.graph.nodes if "val" in node.meta}
        with _overloads_by_schema(type_promotion):
            if transform.fake_mode is None or any(arg not in interpreter.env for node in nodes
                                                  for arg in node.all_input_nodes):
                transform.run()  # the pass as it is: every node re-run
            else:
                with transform.fake_mode, enable_python_dispatcher(), fx_traceback.preserve_node_meta():
                    for node in nodes:
                        interpreter.run_node(node)
        promoted += len(nodes)
    logger.debug("type promotion: %d node(s) promoted", promoted)
    return promoted


@contextlib.contextmanager
def _overloads_by_schema(type_promotion: Any) -> Iterator[None]:
    """While inside, the pass (module ``type_promotion``) picks an operator's overload by the first schema
    its operands match (module docstring); a torch that already does so is left as it is."""
    if not hasattr(type_promotion, "_OpTraceDispatchMode"):  # torch >= 2.13: by schema already
        yield
        return

    def by_schema(packet: Any, args: tuple, kwargs: dict) -> torch._ops.OpOverload:
        problems = []
        for name in packet.overloads():
            overload = getattr(packet, name)
            try:
                torch._C._check_schema_allow_fake_script_object(overload._schema, *args, **kwargs)
            except RuntimeError as exc:
                problems.append(f"{name}: {exc}")
            else:
                return overload
        raise RuntimeError(f"no overload of {packet} takes these operands: " + "; ".join(problems))

    before = type_promotion.find_compatible_op_overload
    type_promotion.find_compatible_op_overload = by_schema
    try:
        yield
    finally:
        type_promotion.find_compatible_op_overload = before


def _numbers_second(graph: torch.fx.Graph) -> int:
    """A Python number as the first operand of ``add``, ``mul`` or ``sub`` of an integer (or boolean) tensor (torch's
    decomposition of ``rsub``, the ``1.0 - mask`` of an integer mask, writes ``sub.Tensor(1.0, mask)``), which the
    pass cannot dispatch again once it has cast the tensor: ``add`` and ``mul`` with their operands swapped, ``sub``
    as the negated tensor plus the number (``-mask + 1.0``: the same values, IEEE subtraction being the addition of
    the negation); in place, returns how many."""
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    found = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor) \
                or node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], (int, float)) \
                or not isinstance(node.args[1], torch.fx.Node):
            continue
        number, tensor = node.args
        value = tensor.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
            continue
        if node.target is aten.sub.Tensor:
            with graph.inserting_before(node):
                negated = graph.call_function(aten.neg.default, (tensor,))
            with detect_fake_mode([value]) or contextlib.nullcontext():  # (torch refuses a number minus a boolean)
                negated.meta["val"] = torch.neg(value)
            node.target, tensor = aten.add.Tensor, negated
        node.args = (tensor, number)
        found += 1
    return found


def _needing_promotion(module: torch.fx.GraphModule, table: Any, type_promotion: Any,
                       scalar_dtype: Callable[[type], torch.dtype | None]) -> list[torch.fx.Node]:
    """The nodes of ``module`` with an operand whose type their promotion rule would change
    (``scalar_dtype``: the dtype the pass gives a Python number of a type)."""
    needing = []
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
        except Exception:  # noqa: BLE001  (the pass's interpreter decides what such a node needs)
            needing.append(node)
            continue
        if any(_differs(arg, preview.args_dtypes.get(index), scalar_dtype) for index, arg in enumerate(args)) or any(
                _differs(arg, preview.kwargs_dtypes.get(name), scalar_dtype) for name, arg in kwargs.items()):
            needing.append(node)
    return needing


def _differs(value: Any, dtype: torch.dtype | None, scalar_dtype: Callable[[type], torch.dtype | None]) -> bool:
    """The pass would cast ``value`` (an operand's metadata) to ``dtype`` (None: the rule leaves it);
    True where unsure (no metadata, an unknown kind of value), so that the node is promoted."""
    if dtype is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype
    if isinstance(value, (list, tuple)):
        return any(_differs(item, dtype, scalar_dtype) for item in value)
    scalar = scalar_dtype(type(value))
    return scalar is None or scalar != dtype


__all__ = ["insert_type_promotions"]

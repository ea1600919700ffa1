"""Input checks read off a ``torch.export`` program (training mode, before decomposition).

Every operator that indexes with an integer tensor (``embedding``, the class targets of
``cross_entropy_loss`` / ``nll_loss``, ``gather``, ``index_select``, ``index``, ``one_hot``, the
``scatter`` family) gets a rule (``index_rules``): the program's computation from the batch to
that index operand, translated into steps NumPy evaluates. A causal LM's labels padded with the
ignore index and shifted, labels masked with ``where``, positions made by ``arange`` of the
sequence length: each is checked as the operator sees it, so the rule says what PyTorch's own
kernel would refuse. An index computed from anything else (a weight, an activation, an operator
the steps do not know) is left unchecked, and the debug log says so.

A static trace (the default: graphs of each batch's exact shapes) holds sizes as numbers; a size
equal to exactly one description symbol's size in the traced batch is read as that symbol, so the
rules serve every shape.
"""

from __future__ import annotations

import json
from typing import Any

from ..._logging import logger
from .index_rules import Untranslatable
from .program_steps import ProgramFacts, argument, index_rule, is_integer, is_node, op_name

# loss ops: (what, position of the target, position of ignore_index, its default)
_LOSSES = {"cross_entropy_loss": ("cross-entropy", 1, 4, -100),
           **{op: ("negative log-likelihood loss", 1, 4, -100)
              for op in ("nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward")}}
# ops indexing a dimension of argument 0 with argument ``index`` at position 2 along ``dim`` at position 1
_ALONG_DIM = {"gather": "gather", "index_select": "index_select", "scatter": "scatter",
              "scatter_add": "scatter_add", "scatter_reduce": "scatter_reduce", "index_add": "index_add",
              "index_copy": "index_copy", "index_fill": "index_fill"}
# batch-norm ops: position of the ``training`` flag
_BATCH_NORMS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5, "_batch_norm_impl_index": 5}


def _module(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    if path == "model":
        return "<top-level forward>"
    return path[len("model."):] if path.startswith("model.") else "the loss function"


def _index_operands(node: Any, op: str, program: ProgramFacts) -> list[dict]:
    """What ``node`` indexes with: ``[{"index", "high", "low", "ignore", "what"}]`` (empty: nothing)."""
    args, module = node.args, _module(node)
    if op == "embedding" and len(args) > 1:
        table = args[0]
        rows = (program.shape(table) or [None])[0]
        name = program.parameters.get(getattr(table, "name", None), getattr(table, "name", "?"))
        name = name[len("model."):] if name.startswith("model.") else name
        return [{"index": args[1], "high": int(rows) if isinstance(rows, int) else None, "low": 0, "ignore": None,
                 "what": f"rows of {name!r} (embedding lookup in {module})"}]
    if op in _LOSSES:
        what, position, ignore_position, default = _LOSSES[op]
        if len(args) <= position:
            return []
        scores = program.shape(args[0]) or []
        classes = scores[1] if len(scores) > 1 else (scores[0] if scores else None)
        ignore = argument(node, ignore_position, "ignore_index", default)
        return [{"index": args[position], "high": classes, "low": 0,
                 "ignore": int(ignore) if isinstance(ignore, int) else None,
                 "what": f"classes of the {what} in {module}"}]
    if op in _ALONG_DIM and len(args) > 2:
        shape = program.shape(args[0]) or []
        axis = int(args[1]) % max(len(shape), 1)
        return [{"index": args[2], "high": shape[axis] if shape else None, "low": 0, "ignore": None, "sized": True,
                 "what": f"positions along dimension {axis} of the {_ALONG_DIM[op]} in {module}"}]
    if op == "one_hot":
        classes = int(argument(node, 1, "num_classes", -1))
        return [] if classes < 0 else [{"index": args[0], "high": classes, "low": 0, "ignore": None,
                                        "what": f"classes of the one_hot in {module}"}]
    if op == "index" and len(args) > 1:
        # an index may count from the end: with no traced size there is no range to check (as on ONNX graphs)
        shape = program.shape(args[0]) or []
        return [{"index": index, "high": shape[axis], "low": "-high", "ignore": None,
                 "sized": True, "what": f"positions along dimension {axis} of an indexing in {module}"}
                for axis, index in enumerate(args[1])
                if is_node(index) and is_integer(program.dtype(index)) and axis < len(shape)]
    return []


def find_program_constraints(program: Any, data_inputs: list[str], weight_of: dict[str, str],
                             symbols: dict[str, list], dims: dict[str, int] | None = None) -> dict[str, Any]:
    """What each batch must satisfy to be valid for PyTorch, from a ``torch.export`` program.

    Args:
        program: the ``ExportedProgram``; its user inputs are the description's inputs, in order
            (a trailing extra input, such as the loss scale, is ignored).
        data_inputs: names of the description's inputs.
        weight_of: ``{parameter or buffer fqn: weight name}`` as the graphs name weights (kept for
            the callers; rules name a table by its module path).
        symbols: ``{input: description shape}``: symbolic sizes of the traced shapes are named by
            these symbols.
        dims: the symbol sizes of a static trace (None for a symbolic one). The checks serve
            every batch shape, so a size equal to exactly one symbol's size is taken as that
            symbol, and an index rule that needs a size equal to several is left out.

    Returns:
        A JSON-able dict: ``indices``, a list of ``index_rules`` rules, and ``batchnorm``
        ``[{"module", "shape"}]`` (the input shape of each training-mode BatchNorm, a dimension
        being an int, a description symbol, or None when unknown).
    """
    del weight_of
    facts = ProgramFacts(program, data_inputs, symbols, dims)
    rules, seen = [], set()
    for node in program.graph.nodes:
        op = op_name(node)
        for operand in _index_operands(node, op, facts) if op else []:
            try:
                rule = index_rule(facts, operand)
            except (Untranslatable, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError) as exc:
                logger.debug("the %s goes unchecked: its index is computed by %s", operand["what"], exc)
                continue
            key = json.dumps(rule, sort_keys=True) if rule else None
            if rule and key not in seen:
                seen.add(key)
                rules.append(rule)

    def symbolic_shape_of(node: Any) -> list | None:
        shape = facts.shape(node)
        if shape is None:
            return None
        result = []
        for size in shape:
            if isinstance(size, facts.torch.SymInt):
                result.append(facts.named.get(str(size.node.expr)))
            elif dims:
                matches = [symbol for symbol, value in dims.items() if value == int(size)]
                result.append(int(size) if not matches else matches[0] if len(matches) == 1 else None)
            else:
                result.append(int(size))
        return result

    batchnorm = []
    for node in program.graph.nodes:
        op = op_name(node)
        if op in _BATCH_NORMS and argument(node, _BATCH_NORMS[op], "training", False) is True:
            batchnorm.append({"module": _module(node), "shape": symbolic_shape_of(node.args[0])})
    return {"indices": rules, "batchnorm": batchnorm}


__all__ = ["find_program_constraints"]

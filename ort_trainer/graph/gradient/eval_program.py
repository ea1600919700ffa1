"""The eval-mode program made translatable: ``forward_program`` gives what the ONNX exporter
translates, without tracing the whole program again where rewrites of a few nodes do.

``run_decompositions`` traces the whole program again: 13.8 s of GPT-2 small's 24.7 s
``save_as_onnx`` with symbolic shapes (sympy arithmetic on every fake tensor's sizes). An
eval-mode program of a transformer needs little of it: its operators have translations but for
``aten.__and__`` (HF's mask: ``bitwise_and``), ``aten.to`` (a cast: ``_to_copy``) and the
``_assert_tensor_metadata`` checks ``torch.export`` puts beside them (nothing to compute),
rewritten in place, and a few more, each decomposed on its own: traced by ``make_fx`` with the
exporter's decomposition table on its operands' fake values, sizes symbolic as in the program,
and that small graph put in its place (HF's ``torch.diff`` on the positions of a model called
without an attention mask: two ``slice``s and a ``sub``, sizes from ``sym_size``).
The operators of ``backward_decompositions.WRITTEN_OUT`` are written out first, as their functions there say
(``F.multilabel_margin_loss`` as ATen computes it, not as torch's own decomposition), and so is a cross-entropy with
label smoothing or a target of probabilities (``backward_decompositions.cross_entropy_loss``), and an LSTM with
projections (ATen's composite, the recurrence unrolled: ONNX's ``LSTM`` has no projection).

``training_in_eval_mode`` gives the eval-mode program without a trace of its own, where the operator
record found that eval mode runs training mode's operators, Dropouts aside: a copy of the training
program with each Dropout's ``train`` flag and each attention's ``dropout_p`` turned off (BERT-base:
the 1.4 s eval-mode ``torch.export`` of its first every-output evaluation after a loss-only loop).
"""

from __future__ import annotations

import copy
import functools
import operator
import warnings

import torch

from ..._logging import logger
from ..export import fused_lstm
from .backward_decompositions import EMBEDDING_BAGS, WRITTEN_OUT, cross_entropy_loss, embedding_bag
from .joint_onnx import _quiet_exporter, _registry_and_tables
from .torch_export import without_stack_traces

_aten = torch.ops.aten
# operators the exporter's table decomposes into one other operator of the same arguments
_ALIASES = {_aten.__and__.Tensor: _aten.bitwise_and.Tensor, _aten.__or__.Tensor: _aten.bitwise_or.Tensor,
            _aten.__xor__.Tensor: _aten.bitwise_xor.Tensor}
_TO = {_aten.to.dtype: 1, _aten.to.device: 2, _aten.to.dtype_layout: None}  # where its dtype is, None: keyword only
# the Dropouts of a training program: (argument position, keyword) of what turns them off, and its value
_DROPOUTS = {**{op: (2, "train", False) for op in (_aten.dropout.default, _aten.feature_dropout.default,
                                                   _aten.alpha_dropout.default, _aten.feature_alpha_dropout.default)},
             _aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
             fused_lstm.FORWARD: (8, "train", False)}  # (keeps no workspace for a backward)


def training_in_eval_mode(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram | None:
    """A copy of the training program ``program`` (``autograd.trace``'s) with its Dropouts off: what
    the eval-mode trace gives where the operator record found that eval mode runs the operators
    training mode runs, Dropouts aside (``OpRecord.eval_is_training``). It keeps the training
    program's signature: the scaled loss first and the loss-scale input, which the eval graph's
    translation leaves out. ``program`` is left as it is, for the gradient build to edit.

    None where anything else draws random numbers (``bernoulli``, ``rand``, a ``native_dropout``
    called directly...): only an eval-mode trace says what eval mode makes of it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own use of its deprecated pytree API
        graph_module = copy.deepcopy(program.graph_module)  # the nodes' metadata is shared, not copied
        signature = copy.deepcopy(program.graph_signature)
    old = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    new = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    for before, after in zip(old, new):  # a copy may rename a placeholder (``input`` -> ``input_1``)
        after.name = before.name
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in _DROPOUTS:
            position, keyword, off = _DROPOUTS[node.target]
            if keyword in node.kwargs or len(node.args) <= position:
                node.kwargs = {**node.kwargs, keyword: off}
            else:
                node.args = (*node.args[:position], off, *node.args[position + 1:])
        elif torch.Tag.nondeterministic_seeded in node.target.tags:
            logger.debug("%s draws random numbers in the training program: eval mode is traced", node.target)
            return None
    graph_module.recompile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return program._update(graph_module, signature)


def forward_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` decomposed to the operators the ONNX exporter translates (what ``torch.onnx.export`` does).

    The operators of the module docstring are rewritten in place and the others without a
    translation decomposed node by node, where every node then translates, none mutates and
    there are no submodules (autocast regions): the same program is returned, edited. Any other
    program is decomposed whole (``run_decompositions``).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    graph = program.graph_module.graph
    written = [(node, _decomposition(node, function=function)) for node, function in
               [(n, _written_out(n)) for n in graph.nodes] if function is not None]
    for node, decomposition in written:
        if decomposition is not None:  # (else the operator stays, to be decomposed with the rest)
            _inline(graph, node, decomposition)
    if any(decomposition is not None for _, decomposition in written):
        program.graph_module.recompile()
    decompositions = _node_decompositions(program)
    if decompositions is not None:
        for node in list(graph.nodes):
            if node in decompositions:
                _inline(graph, node, decompositions[node])
            elif node.op == "call_function":
                _canonicalize(graph, node)
        graph.lint()
        program.graph_module.recompile()
        return program
    with _quiet_exporter(), sdpa_kernel([SDPBackend.MATH]), without_stack_traces():
        return program.run_decompositions(_registry_and_tables()[1])


def _written_out(node: torch.fx.Node):
    """The function ``node`` is written out as before the other decompositions, or None: ``WRITTEN_OUT``'s, and
    ``cross_entropy_loss`` for a cross-entropy with label smoothing or a target of probabilities, which torchlib's
    ``SoftmaxCrossEntropyLoss`` computes otherwise than PyTorch (with class weights) or not at all, ATen's LSTM for a
    projected one, and ``embedding_bag`` for bags given alone (torchlib's Loop over them crashed ONNX Runtime 1.31
    in mean mode)."""
    if node.op != "call_function":
        return None
    if node.target is _aten.cross_entropy_loss.default:
        smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
        target = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
        probabilities = isinstance(target, torch.Tensor) and target.is_floating_point()
        return cross_entropy_loss if smoothing or probabilities else None
    if node.target is _aten.lstm.input and _projected(node):
        return _aten.lstm.input  # (ATen's composite: the recurrence unrolled, as the training graph has it)
    if node.target in EMBEDDING_BAGS and bags_alone(node):  # (torchlib's Loop crashed ONNX Runtime 1.31, mean mode)
        return embedding_bag
    return WRITTEN_OUT.get(node.target)


def bags_alone(node: torch.fx.Node) -> bool:
    """Whether an ``aten.embedding_bag`` node's bags are all that is read of it (its other outputs, offset2bag...,
    are torch's bookkeeping), so that ``embedding_bag`` may stand for it."""
    return all(user.target is operator.getitem and (user.args[1] == 0 or not user.users) for user in node.users)


def _projected(node: torch.fx.Node) -> bool:
    """Whether an ``aten.lstm`` node has projections (``proj_size``: its states ``h`` narrower than ``c``), which
    ONNX's ``LSTM`` has not: torchlib's translation of it is an invalid graph."""
    states = node.args[1] if len(node.args) > 1 else ()
    shapes = [s.meta.get("val").shape if isinstance(s, torch.fx.Node) and isinstance(s.meta.get("val"), torch.Tensor)
              else None for s in states]
    return len(shapes) == 2 and None not in shapes and shapes[0][-1] != shapes[1][-1]


@functools.lru_cache(maxsize=1)
def _implemented() -> frozenset:
    """The overloads the exporter translates directly (no decomposition)."""
    from torch.onnx._internal.exporter import _decomp

    registry, table, _ = _registry_and_tables()
    return frozenset(op for op in _decomp.get_onnx_implemented_overloads(registry) if op not in table)


def _node_decompositions(program: torch.export.ExportedProgram) -> dict | None:
    """``{node: its decomposition}`` for the nodes of ``program`` without a translation once
    canonicalized (``_decomposition``); None where the program must be decomposed whole: a
    submodule, a mutating operator, a node that is not an operator or has no metadata, or a
    decomposition that fails."""
    gm = program.graph_module
    if any(isinstance(child, torch.fx.GraphModule) for child in gm.children()):
        return None
    untranslated = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method") or (node.op == "call_function" and _unmeasured(node)):
            return None
        if node.op != "call_function" or node.target in _TO \
                or (node.target is _aten._assert_tensor_metadata.default and not node.users):
            continue
        verdict = _translates(_ALIASES.get(node.target, node.target))
        if verdict is None:
            return None
        if not verdict:
            untranslated.append(node)
    decompositions = {}
    for node in untranslated:
        decompositions[node] = _decomposition(node)
        if decompositions[node] is None:
            return None
    return decompositions


def _unmeasured(node: torch.fx.Node) -> bool:
    """Whether ``node`` lacks the metadata the translation reads (``meta["val"]``): a node a pass
    added without it (``sparse_labels``' mask and indices), which the whole program's decomposition
    traces anew. Operators that return nothing need none."""
    target = node.target
    return "val" not in node.meta and not (isinstance(target, torch._ops.OpOverload) and not target._schema.returns)


def _translates(target) -> bool | None:
    """True: the exporter translates ``target`` (an operator, a symbolic size's arithmetic, or
    ``getitem``); False: an operator it decomposes; None: neither, or a mutating operator."""
    overload = isinstance(target, torch._ops.OpOverload)
    if overload and target._schema.is_mutable:
        return None
    if target is operator.getitem or target in _implemented():
        return True
    return False if overload else None


def _decomposition(node: torch.fx.Node, table: dict | None = None, function=None) -> torch.fx.GraphModule | None:
    """``node``'s operator (or ``function``, called with its arguments) traced on its operands' fake
    values with the exporter's decomposition table (``make_fx``, as ``run_decompositions`` traces
    every node), or ``table``: a graph of translated operators and size arithmetic whose
    placeholders are ``node.all_input_nodes``. None where the trace fails or leaves anything else,
    or where ``node`` gives a tuple read other than by ``getitem``s."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    value = node.meta.get("val")
    many = isinstance(value, (tuple, list))
    if many and any(user.target is not operator.getitem for user in node.users):
        return None
    inputs = node.all_input_nodes
    values = [n.meta.get("val") for n in inputs]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None or not all(isinstance(v, (torch.Tensor, torch.SymInt)) for v in values):
        return None

    def run(*operands):
        by_node = dict(zip(inputs, operands))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), by_node.__getitem__)
        return (function or node.target)(*args, **kwargs)

    try:
        with _quiet_exporter(), fake_mode, enable_python_dispatcher(), sdpa_kernel([SDPBackend.MATH]):
            traced = make_fx(run, decomposition_table=table or _registry_and_tables()[1])(*values)
    except Exception as error:  # noqa: BLE001  (the whole program's decomposition reports what fails)
        logger.debug("decomposing %s alone failed (%s): the whole program is decomposed", node.target, error)
        return None
    for sub in traced.graph.nodes:
        if sub.op == "call_function" and _translates(sub.target) and not _unmeasured(sub) \
                or sub.op in ("placeholder", "output"):
            continue
        logger.debug("%s decomposes into %s (%s): the whole program is decomposed", node.target, sub.target, sub.op)
        return None
    return traced


def _inline(graph: torch.fx.Graph, node: torch.fx.Node, decomposition: torch.fx.GraphModule) -> None:
    """Put ``decomposition`` (``_decomposition(node)``) in ``node``'s place, in ``graph``."""
    nodes = list(decomposition.graph.nodes)
    placeholders = [sub for sub in nodes if sub.op == "placeholder"]
    env = dict(zip(placeholders, node.all_input_nodes))
    with graph.inserting_before(node):
        for sub in nodes:
            if sub.op == "call_function":
                env[sub] = graph.node_copy(sub, env.__getitem__)
                env[sub].meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
    result = torch.fx.node.map_arg(nodes[-1].args[0], env.__getitem__)
    if isinstance(result, torch.fx.Node):
        _replace(graph, node, result)
    else:  # a tuple: each getitem of it is replaced by its element
        for user in list(node.users):
            _replace(graph, user, result[user.args[1]])
        graph.erase_node(node)


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, value: torch.fx.Node) -> None:
    """Make ``value`` stand for ``node``, which is removed, or kept as ``value``'s copy where it is
    a program output: the signature names it (ONNX Runtime drops the copy)."""
    if any(user.op == "output" for user in node.users):
        node.target, node.args, node.kwargs = _aten.clone.default, (value,), {}
        return
    node.replace_all_uses_with(value)
    graph.erase_node(node)


def _canonicalize(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Rewrite ``node`` (see ``forward_program``) into what the exporter translates, in place."""
    if node.target in _ALIASES:
        node.target = _ALIASES[node.target]
    elif node.target is _aten._assert_tensor_metadata.default and not node.users:
        graph.erase_node(node)
    elif node.target in _TO:
        position = _TO[node.target]
        dtype = node.kwargs.get("dtype", node.args[position] if position is not None and len(node.args) > position
                                else None)
        source = node.args[0]  # a cast to its own dtype stays a node: it may be an output the signature names
        node.target, node.args = _aten._to_copy.default, (source,)
        node.kwargs = {"dtype": source.meta["val"].dtype if dtype is None else dtype}


__all__ = ["forward_program", "training_in_eval_mode"]

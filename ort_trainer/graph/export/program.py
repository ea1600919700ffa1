"""What the torch-autograd gradient source reads off, and does to, a ``torch.export`` program:
the traced sample, the fingerprint, which weights get a gradient, and whether the symbolic
dimensions stayed symbolic."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Sequence

import numpy as np
import torch

from ...model_desc import ModelDescription
from .torchscript import ExportError


def trace_inputs(desc: ModelDescription, sample_inputs: Sequence[np.ndarray], dynamic: bool) -> tuple[tuple, Any]:
    """Sample tensors (plus the loss scale, 1.0) and ``torch.export`` dynamic shapes for them (None
    when not ``dynamic``).

    Each symbolic dimension is traced one below its sample size (a sample as long as a table the
    code slices makes torch specialise the dimension to that length), or at the nearest other
    size that is not 0 or 1 (``torch.export`` specialises those) nor another symbol's size (the
    tracer may equate the two), preferring smaller ones (a sequence stays within a position
    table). Rows are dropped or repeated to get there, so index values stay valid.

    Raises:
        ValueError: when a symbolic dimension has size 0 in the sample.
    """
    arrays = [np.asarray(a) for a in sample_inputs]
    if not dynamic:
        return (*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays), torch.tensor(1.0)), None
    sizes: dict[str, int] = {}
    for io, array in zip(desc.inputs, arrays):
        for dim, size in zip(io.shape, array.shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, size)
    empty = [d for d, s in sizes.items() if s == 0]
    if empty:
        raise ValueError(f"symbolic dimension(s) {empty} have size 0 in the sample batch; trace with a non-empty batch")
    taken, traced = {0, 1}, {}
    for dim, size in sizes.items():
        # below the sample size first: a sample sequence as long as a table the code slices to it
        # (GPT's causal mask, a position table) makes torch specialise the dimension to that length
        candidates = [*range(size - 1, 1, -1), *([size] if size > 1 else []), *range(size + 1, size + 1000)]
        traced[dim] = next(c for c in candidates if c not in taken)
        taken.add(traced[dim])
    shapes, tensors = [], []
    for io, array in zip(desc.inputs, arrays):
        for axis, dim in enumerate(io.shape):
            if isinstance(dim, str) and traced[dim] != array.shape[axis]:
                array = np.take(array, np.arange(traced[dim]) % array.shape[axis], axis=axis)
        tensors.append(torch.from_numpy(np.ascontiguousarray(array)))
        # Dim.DYNAMIC, not one named Dim per symbol: torch infers the ranges the code needs (HF BERT's
        # seq <= 128) instead of failing the trace.
        spec = {axis: torch.export.Dim.DYNAMIC for axis, dim in enumerate(io.shape) if isinstance(dim, str)}
        shapes.append(spec or None)
    return (*tensors, torch.tensor(1.0)), (*shapes, None)


def check_symbolic(program: Any, desc: ModelDescription, stage: str) -> None:
    """Check that the description's symbolic dimensions are still symbolic, and distinct, in ``program``.

    Args:
        program: a program traced with dynamic shapes (``trace_inputs``), or derived from one.
        desc: the model description.
        stage: what produced ``program``, for the message.

    Raises:
        ExportError: naming each dimension tracing fixed to its traced size (or equated with another).
    """
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    users = [nodes[name] for name in names]
    fixed, resolved = [], {}
    for io, node in zip(desc.inputs, users):
        value = node.meta.get("val")
        for axis, dim in enumerate(io.shape):
            size = value.shape[axis] if isinstance(value, torch.Tensor) else None
            if isinstance(dim, str) and isinstance(size, torch.SymInt):
                expr = size.node.expr
                shape_env = size.node.shape_env
                size = shape_env.replacements.get(expr, expr) if shape_env is not None else expr
            if isinstance(dim, str) and (isinstance(size, int) or getattr(size, "is_number", False)):
                fixed.append(f"{io.name}[{axis}] ({dim!r}) = {size}")
            elif isinstance(dim, str):
                resolved.setdefault(str(size), set()).add(dim)
    fixed += [f"{' = '.join(sorted(dims))} (made equal)" for dims in resolved.values() if len(dims) > 1]
    if fixed:
        raise ExportError(f"{stage} fixed symbolic dimension(s) of model_desc to the traced size: {', '.join(fixed)}; "
                          "the model's code requires that size (declare it as an int in model_desc), or torch "
                          "specialised it while tracing (trace with other sizes, or build static-shape graphs: "
                          "dynamic=False)")


def fingerprint(program: Any, settings: list) -> str:
    """SHA-256 of what was traced: graph code, signature, constants, state names/shapes/dtypes.

    Args:
        program: the ``torch.export`` program, as traced.
        settings: anything else the graphs depend on (JSON-able values).

    Returns:
        The hex digest; weight values never enter it, constant values (non-persistent buffers,
        tensors the code creates) do.
    """
    digest = hashlib.sha256(repr(settings).encode())
    for name, module in program.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            digest.update(f"{name}\n{module.code}".encode())
    digest.update(str(program.graph_signature).encode())
    digest.update(repr(sorted((str(k), str(v)) for k, v in program.range_constraints.items())).encode())
    for node in program.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val")
            digest.update(f"{node.name}:{getattr(value, 'shape', '')}:{getattr(value, 'dtype', '')}:"
                          f"{getattr(value, 'requires_grad', '')}".encode())
    for name, constant in sorted(program.constants.items()):
        digest.update(name.encode())
        if isinstance(constant, torch.Tensor):
            digest.update(f"{tuple(constant.shape)}{constant.dtype}".encode())
            digest.update(constant.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(constant).encode())
    return digest.hexdigest()


def mark_untrained(program: Any) -> None:
    """Detach the traced values of parameters the loss gets no gradient through, in place
    (autograd would otherwise insist on a gradient for each).

    Args:
        program: the training program of ``trace``; its first output is the scaled loss.

    Raises:
        ExportError: when the loss is not a floating-point scalar, or depends on no trainable weight.
    """
    graph = program.graph
    loss = graph.output_node().args[0][0]
    value = loss.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ExportError(f"the loss must be a floating-point scalar; it has shape "
                          f"{list(getattr(value, 'shape', []))} and dtype {getattr(value, 'dtype', None)}")
    reached = _weights_reached(program)
    if reached is None:
        raise ExportError("the loss does not depend on any trainable weight (every weight it reads is frozen "
                          "or detached); nothing would be trained")
    for node in graph.nodes:
        if node.op == "placeholder" and node not in reached and _requires_grad(node.meta.get("val")):
            node.meta["val"] = node.meta["val"].detach()


def _weights_reached(program: Any) -> set | None:
    """The placeholders whose values the loss's autograd graph reaches, found by running the program on its fake
    values with autograd on (the traced values do not record it; ~0.4 s for the BERT-like model); None when the
    loss does not require grad. Autograd's own graph follows in-place writes: ``out = zeros_like(k)`` then
    ``out[:, i] = k[:, i]`` (RWKV's recurrence) makes ``out`` depend on ``k`` after ``out`` was made, which a walk
    of the program's inputs from the loss does not see."""
    from torch._guards import detect_fake_mode

    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    values = [n.meta["val"] for n in placeholders]
    fake_mode = detect_fake_mode(values)
    shape_env = getattr(fake_mode, "shape_env", None)
    # only the requires_grad flags are read here: the run must not guard on the program's symbols (torch
    # 2.11's fake tensors turn sizes into ints inside composite operators, aten.linear's on a slice, and
    # each such guard fixed a symbolic dimension of the description to its traced size)
    quiet = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
    # nor leave the sizes a data-dependent operator (nonzero, a boolean mask) makes here pending, which the
    # next trace on this shape environment (autograd's) would take for its own, unbound ones
    fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with fake_mode or contextlib.nullcontext(), quiet, fresh, torch.enable_grad():
        args = [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                for v in values]
        loss = torch.fx.Interpreter(program.graph_module).run(*args)[0]
    if not _requires_grad(loss):
        return None
    leaves, seen, stack = set(), set(), [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        function = stack.pop()
        if function in seen:
            continue
        seen.add(function)
        variable = getattr(function, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(following for following, _ in function.next_functions if following is not None)
    if loss.grad_fn is None:  # the loss is itself a weight
        leaves.add(id(loss))
    return {node for node, arg in zip(placeholders, args) if id(arg) in leaves}


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    return False


def modules_using(program: Any, op: str) -> list[str]:
    """The modules whose forward calls operator ``op``, as ``"path (Class)"``.

    Args:
        program: the ``torch.export`` program of ``autograd.trace``, or the joint program made
            from it, whose backward nodes carry the stack of the forward node they differentiate
            (an operator only the backward or a decomposition of the joint trace uses: labelled
            ``"path (Class)'s backward"``).
        op: an operator name as torch's messages write it (``aten.cummax.default``,
            ``prims.igamma``, ``igamma``); matched on the name between namespace and overload.

    Returns:
        Labels as in ``model.named_modules()`` (``<top-level forward> (Class)`` for the model's
        own forward, ``the loss function`` for code outside the model), each once.
    """
    parts = op.split(".")
    wanted = (parts[1] if len(parts) > 1 else parts[0]).lstrip("_")
    return _labels(node for node in program.graph.nodes
                   if node.op == "call_function" and getattr(node.target, "_opname", "").lstrip("_") == wanted)


def modules_computing_complex(program: Any) -> list[str]:
    """The modules whose forward computes a complex-valued tensor (``torch.view_as_complex``,
    ``torch.polar``, ``torch.fft``...), labelled as ``modules_using`` labels them."""
    return _labels(node for node in program.graph.nodes if node.op == "call_function"
                   and any(getattr(value, "is_complex", lambda: False)()
                           for value in (node.meta.get("val") if isinstance(node.meta.get("val"), (tuple, list))
                                         else [node.meta.get("val")])))


def _labels(nodes) -> list[str]:
    found = []
    for node in nodes:
        backward = node.meta.get("nn_module_stack") is None and node.meta.get("fwd_nn_module_stack") is not None
        stack = list((node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}).values())
        path, kind = stack[-1] if stack else ("", "")
        if path == "model":
            label = f"<top-level forward> ({kind.rsplit('.', 1)[-1]})"
        elif path.startswith("model."):
            label = f"{path[len('model.'):]} ({kind.rsplit('.', 1)[-1]})"
        else:
            label = "the loss function"
        if backward:
            label += "'s backward"
        if label not in found:
            found.append(label)
    return found

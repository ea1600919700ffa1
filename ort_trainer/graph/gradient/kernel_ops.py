"""The torch operators that stand for ort_trainer's own ONNX Runtime kernels (``ort_trainer/kernels``) in
a joint program, the rewrites that put them there, and their translation to the kernels' ONNX nodes.

Each rewrite replaces a backward region of the joint program by one of these operators; the exporter
translates it into one node of the domain ``kernels.DOMAIN``, which a session runs once the kernel
library is registered with it (``sessions.py``). Each operator has a torch implementation (the same
arithmetic, for an eager call) and a fake one (for the traces).

- ``ort_trainer::gelu_grad(dy, x, approximate)`` -> ``GeluGrad(dy, x)`` (``approximate="none"``) or
  ``TanhGeluGrad(dy, x)`` (``"tanh"``): ``aten.gelu_backward``'s value, computed in float32 and
  rounded once to the tensors' dtype. Put in place by ``gelu.rewrite_joint`` with ``kernel=True``
  (``graph_optimizations.fused_gelu_gradient``).
- ``ort_trainer::layer_norm_grad(dy, x, mean, rstd, gamma)`` -> ``LayerNormGrad(dy, x, mean, rstd, gamma)``'s
  first three outputs (dx, dgamma, dbeta; its fourth, the CUDA kernel's partial column sums, is read by no
  node): ``aten.native_layer_norm_backward`` over gamma's dims, computed in float32. Put in place by
  ``rewrite_layer_norm_backward`` (``fused_layer_norm_gradient``) for the ``native_layer_norm_backward``
  nodes the joint trace left undecomposed (``LAYER_NORM_KEPT``), where ``layer_norm_applies`` found every
  layer norm of the program eligible (each with a weight; float32 or half-precision input): autograd
  decomposes all of them or none.
- ``ort_trainer::softmax_grad(dy, y)`` -> ``SoftmaxGrad(dy, y)``: a softmax's gradient over the last axis
  from its output, ``y · (dy - Σ dy·y)``, computed in float32. Put in place by ``rewrite_softmax_backward``
  (``fused_softmax_gradient``) for every ``_softmax_backward_data`` (``SOFTMAX_KEPT``) over the last axis
  in a kernel dtype (a cast to the softmax's input dtype after it where that differs); any other becomes
  torch's own arithmetic in aten operators.
- ``ort_trainer::safe_softmax(x)`` -> ``SafeSoftmax(x)``: ``aten._safe_softmax`` over the last axis (a softmax
  whose rows of only -inf give zeros: attention's), computed in float32. Put in place by
  ``rewrite_safe_softmax`` (``fused_safe_softmax``) for every ``_safe_softmax`` (``SAFE_SOFTMAX_KEPT``) over
  the last axis in a kernel dtype; any other becomes torch's arithmetic.
- ``ort_trainer::cross_entropy(x, target, ignore_index)`` -> ``CrossEntropy(x, target)``: each row's
  cross-entropy of class scores and its log-sum-exp, in float32, with a registered autograd whose backward is
  ``ort_trainer::cross_entropy_grad`` -> ``CrossEntropyGrad(grad, x, target, lse)`` (dx in x's dtype). Put in
  place before autograd by the function ``fused_cross_entropy`` (the switch of that name) for every
  ``cross_entropy_loss`` of 2-D scores without class weights or label smoothing, reading half-precision scores
  directly where the program casts them to float32 for the loss alone (a Hugging Face head's
  ``logits.float()``, the loss pieces').
"""

from __future__ import annotations

import functools
import operator

import onnx
import torch

from ...kernels import DOMAIN, OPSET
from .fx_nodes import Builder, fill_fake_values
from .sparse_labels import _is_float_cast, _value, erase_unread, readers

_DTYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
GELU_GRAD_OPS = {"none": "GeluGrad", "tanh": "TanhGeluGrad"}  # by gelu's ``approximate``
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_aten = torch.ops.aten
LAYER_NORM_KEPT = (_aten.native_layer_norm_backward.default,)  # what the joint trace leaves for the rewrites
SOFTMAX_KEPT = (_aten._softmax_backward_data.default,)
SAFE_SOFTMAX_KEPT = (_aten._safe_softmax.default,)
_LAYER_NORMS = (_aten.layer_norm.default, _aten.native_layer_norm.default)  # before autograd


@torch.library.custom_op("ort_trainer::gelu_grad", mutates_args=())
def gelu_grad(dy: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``dy`` times GELU's derivative at ``x`` (``approximate``: ``"none"`` or ``"tanh"``), in float32 and
    rounded once to the inputs' dtype, as the ``GeluGrad`` / ``TanhGeluGrad`` kernels compute it."""
    return torch.ops.aten.gelu_backward(dy.float(), x.float(), approximate=approximate).to(x.dtype)


@gelu_grad.register_fake
def _gelu_grad_fake(dy: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ort_trainer::layer_norm_grad", mutates_args=())
def layer_norm_grad(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                    gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm's backward over ``gamma``'s dims, from the forward's ``mean`` and ``rstd``: (dx, dgamma, dbeta),
    in float32 and rounded once to the dtypes of x and gamma, as the ``LayerNormGrad`` kernels compute them."""
    gamma32 = gamma.float()
    dx, dgamma, dbeta = _aten.native_layer_norm_backward(dy.float(), x.float(), list(gamma.shape), mean.float(),
                                                          rstd.float(), gamma32, torch.zeros_like(gamma32),
                                                          [True, True, True])
    return dx.to(x.dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)


@layer_norm_grad.register_fake
def _layer_norm_grad_fake(dy, x, mean, rstd, gamma):
    return torch.empty_like(x), torch.empty_like(gamma), torch.empty_like(gamma)


@torch.library.custom_op("ort_trainer::softmax_grad", mutates_args=())
def softmax_grad(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A softmax's gradient over the last axis from its output ``y``, in float32 and rounded once to ``y``'s
    dtype, as the ``SoftmaxGrad`` kernels compute it."""
    return _aten._softmax_backward_data(dy.float(), y.float(), -1, torch.float32).to(y.dtype)


@softmax_grad.register_fake
def _softmax_grad_fake(dy, y):
    return torch.empty_like(y)


@torch.library.custom_op("ort_trainer::safe_softmax", mutates_args=())
def safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """``aten._safe_softmax`` over the last axis, in float32 and rounded once to ``x``'s dtype, as the
    ``SafeSoftmax`` kernels compute it."""
    return _aten._safe_softmax(x.float(), -1).to(x.dtype)


@safe_softmax.register_fake
def _safe_softmax_fake(x):
    return torch.empty_like(x)


def rewrite_safe_softmax(program) -> int:
    """Replace each ``_safe_softmax`` of a joint program, in place: by ``safe_softmax`` over the last axis in a
    kernel dtype, else by torch's arithmetic (a softmax, and zeros where a row is all -inf); returns how many
    became kernels. Autograd's ``_softmax_backward_data`` then reads the new node's output."""
    graph, count, replaced = program.graph, 0, False
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target == SAFE_SOFTMAX_KEPT[0]]:
        x, dim = node.args[:2]
        dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
        value = x.meta["val"]
        with graph.inserting_before(node):
            build = Builder(graph, node)
            if dim in (-1, value.dim() - 1) and value.dtype in KERNEL_DTYPES and dtype in (None, value.dtype):
                result = build(torch.ops.ort_trainer.safe_softmax.default, x)
                count += 1
            else:
                source = x if dtype in (None, value.dtype) else build(_aten._to_copy.default, x, dtype=dtype)
                rows = build(_aten.all.dim, build(_aten.eq.Scalar, source, float("-inf")), dim, True)
                result = build(_aten.masked_fill.Scalar, build(_aten._softmax.default, source, dim, False), rows, 0.0)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        replaced = True
    if replaced:
        graph.lint()
        program.graph_module.recompile()
    return count


@torch.library.custom_op("ort_trainer::cross_entropy", mutates_args=())
def cross_entropy(x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy of the class scores ``x`` [rows, classes] against ``target`` (0 where it is
    ``ignore_index``) and each row's log-sum-exp, in float32, as the ``CrossEntropy`` kernels compute them."""
    scores = x.float()
    losses = torch.nn.functional.cross_entropy(scores, target, reduction="none", ignore_index=ignore_index)
    return losses, torch.logsumexp(scores, -1)


@cross_entropy.register_fake
def _cross_entropy_fake(x, target, ignore_index):
    return x.new_empty(x.shape[:1], dtype=torch.float32), x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op("ort_trainer::cross_entropy_grad", mutates_args=())
def cross_entropy_grad(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                       ignore_index: int) -> torch.Tensor:
    """``grad`` [rows] times each row's softmax minus its one-hot target (zeros for an ignored row), in float32
    and rounded once to ``x``'s dtype, as the ``CrossEntropyGrad`` kernels compute it."""
    kept = (target != ignore_index).float() * grad.float()
    probabilities = torch.exp(x.float() - lse.float()[:, None])
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), x.shape[-1]).float()
    return (kept[:, None] * (probabilities - onehot)).to(x.dtype)


@cross_entropy_grad.register_fake
def _cross_entropy_grad_fake(grad, x, target, lse, ignore_index):
    return torch.empty_like(x)


def _cross_entropy_setup(ctx, inputs, output):
    x, target, ignore_index = inputs
    ctx.save_for_backward(x, target, output[1])
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(output[1])


def _cross_entropy_backward(ctx, grad_losses, _grad_lse):
    x, target, lse = ctx.saved_tensors
    return torch.ops.ort_trainer.cross_entropy_grad(grad_losses, x, target, lse, ctx.ignore_index), None, None


cross_entropy.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)
_MEAN, _SUM = 1, 2  # cross_entropy_loss's reduction (0: none)


def fused_cross_entropy(program) -> int:
    """Replace each ``cross_entropy_loss`` of a program before autograd (its submodules too) over 2-D scores,
    without class weights or label smoothing, by ``cross_entropy``'s per-row losses summed (divided by the
    count of labelled rows for a mean), in place; where the scores are a float32 cast of half-precision ones read
    by the loss alone, the half ones are read and the cast is erased. Returns how many."""
    count = 0
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph, changed = module.graph, 0
        losses = [n for n in graph.nodes if n.op == "call_function" and n.target == _aten.cross_entropy_loss.default]
        if losses:
            fill_fake_values(graph)  # (the nodes loss_pieces and sparse_labels wrote have none)
        for node in losses:
            names = ("weight", "reduction", "ignore_index", "label_smoothing")
            x, target = node.args[:2]
            weight, reduction, ignore_index, smoothing = [
                node.kwargs.get(name, node.args[2 + i] if len(node.args) > 2 + i else default)
                for i, (name, default) in enumerate(zip(names, (None, _MEAN, -100, 0.0)))]
            value, labels = _value(x), _value(target)
            if (weight is not None or smoothing or value is None or labels is None or value.dim() != 2
                    or value.dtype not in KERNEL_DTYPES or labels.dim() != 1 or labels.dtype != torch.int64):
                continue
            cast = x if _is_float_cast(x) and _value(x.args[0]).dtype in KERNEL_DTYPES and readers(x) == 1 else None
            with graph.inserting_before(node):
                build = Builder(graph, node)
                fused = build(torch.ops.ort_trainer.cross_entropy.default, cast.args[0] if cast else x, target,
                              ignore_index)
                losses = build(operator.getitem, fused, 0)
                result = losses if reduction == 0 else build(_aten.sum.default, losses)
                if reduction == _MEAN:
                    labelled = build(_aten.sum.default, build(_aten.ne.Scalar, target, ignore_index),
                                     dtype=torch.float32)
                    result = build(_aten.div.Tensor, result, labelled)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            if cast is not None:
                erase_unread(graph, [cast])
            changed += 1
        if changed:
            graph.lint()
            module.recompile()
            count += changed
    return count


def rewrite_softmax_backward(program) -> int:
    """Replace each ``_softmax_backward_data`` of a joint program, in place: by ``softmax_grad`` where the axis
    is the last and the dtypes the kernel's, else by its arithmetic in aten operators; returns how many became
    kernels."""
    graph, count, replaced = program.graph, 0, False
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target == SOFTMAX_KEPT[0]]:
        dy, y, dim, input_dtype = node.args[:4]
        value = y.meta["val"]
        with graph.inserting_before(node):
            build = Builder(graph, node)
            if dim in (-1, value.dim() - 1) and value.dtype in KERNEL_DTYPES and dy.meta["val"].dtype == value.dtype:
                result = build(torch.ops.ort_trainer.softmax_grad.default, dy, y)
                count += 1
            else:  # torch's own decomposition: y·dy - y·Σ(y·dy)
                product = build(_aten.mul.Tensor, dy, y)
                total = build(_aten.sum.dim_IntList, product, [dim], True)
                result = build(_aten.sub.Tensor, product, build(_aten.mul.Tensor, y, total))
            if result.meta["val"].dtype != input_dtype:
                result = build(_aten._to_copy.default, result, dtype=input_dtype)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        replaced = True
    if replaced:
        graph.lint()
        program.graph_module.recompile()
    return count


def layer_norm_applies(program) -> bool:
    """Whether every layer norm (``layer_norm`` or ``native_layer_norm``) of a program before autograd (its
    submodules too) has a weight and a float32, float16 or bfloat16 input: then its backward can be the kernel's
    (``LAYER_NORM_KEPT``)."""
    found = False
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _LAYER_NORMS:
                found = True
                x, weight = node.args[0], node.args[2] if len(node.args) > 2 else None
                if not isinstance(weight, torch.fx.Node) or _dtype(x) not in KERNEL_DTYPES \
                        or _dtype(weight) not in KERNEL_DTYPES:
                    return False
    return found


def rewrite_layer_norm_backward(program) -> int:
    """Replace each ``native_layer_norm_backward`` of a joint program by ``layer_norm_grad``, in place (its
    users, ``getitem`` of the three results, read the new node); returns how many."""
    graph, count = program.graph, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target == LAYER_NORM_KEPT[0]]:
        dy, x, _shape, mean, rstd, weight = node.args[:6]
        if any(user.target is not operator.getitem for user in node.users):  # (autograd reads each result alone)
            raise RuntimeError(f"{node.name}: native_layer_norm_backward read other than by getitem")
        with graph.inserting_before(node):
            fused = Builder(graph, node)(torch.ops.ort_trainer.layer_norm_grad.default, dy, x, mean, rstd, weight)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        program.graph_module.recompile()
    return count


def _dtype(node) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


@functools.lru_cache(maxsize=1)
def _register_schemas() -> None:
    """ONNX schemas of the kernels' operators (what onnxscript reads to emit their nodes, and onnx's checker)."""
    for name in (*GELU_GRAD_OPS.values(), "SoftmaxGrad"):  # (dy, x) -> dx
        schema = onnx.defs.OpSchema(
            name, DOMAIN, OPSET, doc="a GELU's or a softmax's gradient (ort_trainer's kernel library)",
            inputs=[onnx.defs.OpSchema.FormalParameter("dy", "T"),
                    onnx.defs.OpSchema.FormalParameter("y" if name == "SoftmaxGrad" else "x", "T")],
            outputs=[onnx.defs.OpSchema.FormalParameter("dx", "T")],
            type_constraints=[("T", _DTYPES, "float32, float16 or bfloat16")])
        if not onnx.defs.has(name, DOMAIN):
            onnx.defs.register_schema(schema)
    parameter = onnx.defs.OpSchema.FormalParameter
    if not onnx.defs.has("SafeSoftmax", DOMAIN):
        onnx.defs.register_schema(onnx.defs.OpSchema(
            "SafeSoftmax", DOMAIN, OPSET, doc="a softmax over the last axis, zeros for rows of only -inf",
            inputs=[parameter("x", "T")], outputs=[parameter("y", "T")],
            type_constraints=[("T", _DTYPES, "float32, float16 or bfloat16")]))
    ignore = onnx.defs.OpSchema.Attribute("ignore_index", onnx.defs.OpSchema.AttrType.INT, "a target to ignore",
                                          required=False)
    scores = ("T", _DTYPES, "the scores' dtype")
    labels = [("I", ["tensor(int64)"], "int64"), ("U", ["tensor(float)"], "float32")]
    for name, inputs, outputs in (("CrossEntropy", [("x", "T"), ("target", "I")], [("losses", "U"), ("lse", "U")]),
                                  ("CrossEntropyGrad", [("grad", "U"), ("x", "T"), ("target", "I"), ("lse", "U")],
                                   [("dx", "T")])):
        if not onnx.defs.has(name, DOMAIN):
            onnx.defs.register_schema(onnx.defs.OpSchema(
                name, DOMAIN, OPSET, doc="cross-entropy of class scores (ort_trainer's kernel library)",
                inputs=[parameter(*p) for p in inputs], outputs=[parameter(*p) for p in outputs],
                type_constraints=[scores, *labels], attributes=[ignore]))
    schema = onnx.defs.OpSchema(
        "LayerNormGrad", DOMAIN, OPSET, doc="LayerNorm's backward (ort_trainer's kernel library)",
        inputs=[parameter("dy", "T"), parameter("x", "T"), parameter("mean", "T"), parameter("rstd", "T"),
                parameter("gamma", "G")],
        outputs=[parameter("dx", "T"), parameter("dgamma", "G"), parameter("dbeta", "G"),
                 parameter("partials", "U")],
        type_constraints=[("T", _DTYPES, "the input's dtype"), ("G", _DTYPES, "the weight's dtype"),
                          ("U", ["tensor(float)"], "float32")])
    if not onnx.defs.has("LayerNormGrad", DOMAIN):
        onnx.defs.register_schema(schema)


def register_translations(registry) -> None:
    """Add the translations of these operators to the exporter's registry (``joint_onnx``)."""
    import onnxscript

    _register_schemas()
    opset = onnxscript.values.Opset(DOMAIN, OPSET)

    def gelu_grad_onnx(dy, x, approximate: str = "none"):
        return getattr(opset, GELU_GRAD_OPS[approximate])(dy, x)

    def softmax_grad_onnx(dy, y):
        return opset.SoftmaxGrad(dy, y)

    def safe_softmax_onnx(x):
        return opset.SafeSoftmax(x)

    def cross_entropy_onnx(x, target, ignore_index: int = -100):
        losses, lse = opset.CrossEntropy(x, target, ignore_index=ignore_index)
        return losses, lse

    def cross_entropy_grad_onnx(grad, x, target, lse, ignore_index: int = -100):
        return opset.CrossEntropyGrad(grad, x, target, lse, ignore_index=ignore_index)

    def layer_norm_grad_onnx(dy, x, mean, rstd, gamma):
        dx, dgamma, dbeta, _partials = opset.LayerNormGrad(dy, x, mean, rstd, gamma)
        return dx, dgamma, dbeta

    registry.register_op(torch.ops.ort_trainer.gelu_grad.default, gelu_grad_onnx)
    registry.register_op(torch.ops.ort_trainer.layer_norm_grad.default, layer_norm_grad_onnx)
    registry.register_op(torch.ops.ort_trainer.softmax_grad.default, softmax_grad_onnx)
    registry.register_op(torch.ops.ort_trainer.safe_softmax.default, safe_softmax_onnx)
    registry.register_op(torch.ops.ort_trainer.cross_entropy.default, cross_entropy_onnx)
    registry.register_op(torch.ops.ort_trainer.cross_entropy_grad.default, cross_entropy_grad_onnx)

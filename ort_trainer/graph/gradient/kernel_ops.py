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
  node): ``aten.native_layer_norm_backward`` over gamma's dims, computed in float32
  (``fused_layer_norm_gradient``), where ``layer_norm_applies`` found every layer norm of the program eligible
  (each with a weight; float32 or half-precision input): autograd decomposes all of them or none.
- ``ort_trainer::softmax_grad(dy, y)`` -> ``SoftmaxGrad(dy, y)``: a softmax's gradient over the last axis
  from its output, ``y · (dy - Σ dy·y)``, computed in float32 (``fused_softmax_gradient``), for every
  ``_softmax_backward_data`` over the last axis in a kernel dtype (a cast to the softmax's input dtype after
  it where that differs); any other becomes torch's own arithmetic in aten operators.
- ``ort_trainer::safe_softmax(x)`` -> ``SafeSoftmax(x)``: ``aten._safe_softmax`` over the last axis (a softmax
  whose rows of only -inf give zeros: attention's), computed in float32 (``fused_safe_softmax``); any other
  becomes torch's arithmetic. Where its input is a sum read by it alone, ``scores + bias`` with the bias
  broadcast to the scores (attention's mask), ``ort_trainer::safe_softmax_bias(scores, bias)`` ->
  ``BiasSafeSoftmax(scores, bias)`` adds it in the kernel, rounding the sum to the dtype as the ``Add`` did: the
  same values without a pass over the ``[batch, heads, seq, seq]`` scores.

These three are joint-program rewrites: ``kept`` names the operators the joint trace leaves undecomposed for
the switches on, and ``rewrite_joint`` replaces each of them afterwards.
- ``ort_trainer::cross_entropy(x, target, ignore_index)`` -> ``CrossEntropy(x, target)``: each row's
  cross-entropy of class scores and its log-sum-exp, in float32, with a registered autograd whose backward is
  ``ort_trainer::cross_entropy_grad`` -> ``CrossEntropyGrad(grad, x, target, lse)`` (dx in x's dtype). Put in
  place before autograd by the function ``fused_cross_entropy`` (the switch of that name) for every
  ``cross_entropy_loss`` of 2-D scores without class weights or label smoothing, reading half-precision scores
  directly where the program casts them to float32 for the loss alone (a Hugging Face head's
  ``logits.float()``, the loss pieces').
"""

from __future__ import annotations

import operator

import onnx
import torch

from ...kernels import DOMAIN, OPSET
from . import onnx_schemas
from .fx_nodes import Builder, fill_fake_values, rewrite_graphs
from .sparse_labels import _is_float_cast, _value, erase_unread, readers

_DTYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
GELU_GRAD_OPS = {"none": "GeluGrad", "tanh": "TanhGeluGrad"}  # by gelu's ``approximate``
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_aten = torch.ops.aten
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


@torch.library.custom_op("ort_trainer::safe_softmax_bias", mutates_args=())
def safe_softmax_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``safe_softmax(x + bias)``, the sum in ``x``'s dtype (``bias`` broadcast to ``x``), as the
    ``BiasSafeSoftmax`` kernels compute it."""
    return _aten._safe_softmax((x + bias).float(), -1).to(x.dtype)


@safe_softmax_bias.register_fake
def _safe_softmax_bias_fake(x, bias):
    return torch.empty_like(x)


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
    return rewrite_graphs(program, _fused_cross_entropies)


def _fused_cross_entropies(graph: torch.fx.Graph) -> int:
    changed = 0
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
            per_row = build(operator.getitem, fused, 0)
            result = per_row if reduction == 0 else build(_aten.sum.default, per_row)
            if reduction == _MEAN:
                labelled = build(_aten.sum.default, build(_aten.ne.Scalar, target, ignore_index),
                                 dtype=torch.float32)
                result = build(_aten.div.Tensor, result, labelled)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        if cast is not None:
            erase_unread(graph, [cast])
        changed += 1
    return changed


def layer_norm_applies(program) -> bool:
    """Whether every layer norm (``layer_norm`` or ``native_layer_norm``) of a program before autograd (its
    submodules too) has a weight and a float32, float16 or bfloat16 input: then its backward can be the kernel's
    (``kept``)."""
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


def _dtype(node) -> torch.dtype | None:
    value = _value(node)
    return None if value is None else value.dtype


def _safe_softmax(build: Builder, node: torch.fx.Node) -> tuple[torch.fx.Node, bool]:
    """``_safe_softmax``'s replacement: the kernel over the last axis in a kernel dtype, else torch's arithmetic
    (a softmax, and zeros where a row is all -inf)."""
    x, dim = node.args[:2]
    dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
    value = x.meta["val"]
    if dim in (-1, value.dim() - 1) and value.dtype in KERNEL_DTYPES and dtype in (None, value.dtype):
        biased = _scores_and_bias(x)
        if biased is not None:  # (rewrite_joint erases the Add, then unread)
            return build(torch.ops.ort_trainer.safe_softmax_bias.default, *biased), True
        return build(torch.ops.ort_trainer.safe_softmax.default, x), True
    source = x if dtype in (None, value.dtype) else build(_aten._to_copy.default, x, dtype=dtype)
    rows = build(_aten.all.dim, build(_aten.eq.Scalar, source, float("-inf")), dim, True)
    return build(_aten.masked_fill.Scalar, build(_aten._softmax.default, source, dim, False), rows, 0.0), False


_MAX_BIAS_RANK = 9  # the kernel's broadcast: 8 dims before the last (csrc/kernels.h, kMaxRowRank)


def _scores_and_bias(x) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(scores, bias)`` where ``x`` is ``scores + bias`` read by the softmax alone, of one dtype, ``bias``
    broadcast to the scores' shape (attention's mask: ``[batch, 1, seq, seq]``, ``[batch, 1, 1, seq]``); else None."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target == _aten.add.Tensor
            and len(x.args) == 2 and x.kwargs.get("alpha", 1) == 1 and readers(x) == 1):
        return None
    out = _value(x)
    values = [_value(a) if isinstance(a, torch.fx.Node) else None for a in x.args]
    if out is None or out.dim() > _MAX_BIAS_RANK or any(v is None or v.dtype != out.dtype for v in values):
        return None
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # (sympy: imported on a build only)

    for scores, bias in ((0, 1), (1, 0)):
        shape = values[scores].shape
        if len(shape) == out.dim() and all(statically_known_true(a == b) for a, b in zip(shape, out.shape)):
            return x.args[scores], x.args[bias]
    return None


def _softmax_backward(build: Builder, node: torch.fx.Node) -> tuple[torch.fx.Node, bool]:
    """``_softmax_backward_data``'s replacement: the kernel where the axis is the last and the dtypes the
    kernel's, else its arithmetic; cast to the softmax's input dtype where that differs."""
    dy, y, dim, input_dtype = node.args[:4]
    value = y.meta["val"]
    kernel = dim in (-1, value.dim() - 1) and value.dtype in KERNEL_DTYPES and _dtype(dy) == value.dtype
    if kernel:
        result = build(torch.ops.ort_trainer.softmax_grad.default, dy, y)
    else:  # torch's own decomposition: y·dy - y·Σ(y·dy)
        product = build(_aten.mul.Tensor, dy, y)
        total = build(_aten.sum.dim_IntList, product, [dim], True)
        result = build(_aten.sub.Tensor, product, build(_aten.mul.Tensor, y, total))
    if result.meta["val"].dtype != input_dtype:
        result = build(_aten._to_copy.default, result, dtype=input_dtype)
    return result, kernel


def _layer_norm_backward(build: Builder, node: torch.fx.Node) -> tuple[torch.fx.Node, bool]:
    """``native_layer_norm_backward``'s replacement, the kernel (its users, ``getitem`` of the three results,
    read the new node)."""
    if any(user.target is not operator.getitem for user in node.users):  # (autograd reads each result alone)
        raise RuntimeError(f"{node.name}: native_layer_norm_backward read other than by getitem")
    dy, x, _shape, mean, rstd, weight = node.args[:6]
    return build(torch.ops.ort_trainer.layer_norm_grad.default, dy, x, mean, rstd, weight), True


# the switch, the operator the joint trace leaves undecomposed for it, and its replacement (rewrite_joint)
_JOINT_REWRITES = (
    ("fused_layer_norm_gradient", _aten.native_layer_norm_backward.default, _layer_norm_backward),
    ("fused_softmax_gradient", _aten._softmax_backward_data.default, _softmax_backward),
    ("fused_safe_softmax", _aten._safe_softmax.default, _safe_softmax),
)
# (fused_attention: attention_ops.py, torch's attention kernels)
SWITCHES = ("fused_gelu_gradient", "fused_cross_entropy", "fused_attention",
            *(switch for switch, _, _ in _JOINT_REWRITES))


def kept(program, switches) -> tuple:
    """The operators the joint trace of ``program`` (before autograd) leaves undecomposed for ``rewrite_joint``,
    by the switches on: LayerNorm's backward only where every layer norm qualifies (``layer_norm_applies``), as
    autograd decomposes all of them or none."""
    return tuple(target for switch, target, _ in _JOINT_REWRITES if switch in switches
                 and (target != _aten.native_layer_norm_backward.default or layer_norm_applies(program)))


def rewrite_joint(program) -> int:
    """Replace each operator ``kept`` left in a joint program by its replacement (a kernel's operator, or torch's
    arithmetic where the kernel does not apply), in place; returns how many became kernels."""
    graph, kernels, replaced = program.graph, 0, False
    for _, target, replacement in _JOINT_REWRITES:
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target == target]:
            with graph.inserting_before(node):
                result, kernel = replacement(Builder(graph, node), node)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            erase_unread(graph, [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "call_function"])
            kernels, replaced = kernels + kernel, True
    if replaced:
        graph.lint()
        program.graph_module.recompile()
    return kernels


# each operator's inputs and outputs (name, type) and attributes; T: the scores' or activations' dtype, G:
# LayerNormGrad's weights', I: int64, U: float32, B: bool, A: any
_SCHEMAS = {
    "GeluGrad": ([("dy", "T"), ("x", "T")], [("dx", "T")], ()),
    "TanhGeluGrad": ([("dy", "T"), ("x", "T")], [("dx", "T")], ()),
    "SoftmaxGrad": ([("dy", "T"), ("y", "T")], [("dx", "T")], ()),
    "SafeSoftmax": ([("x", "T")], [("y", "T")], ()),
    "BiasSafeSoftmax": ([("x", "T"), ("bias", "T")], [("y", "T")], ()),
    "LayerNormGrad": ([("dy", "T"), ("x", "T"), ("mean", "T"), ("rstd", "T"), ("gamma", "G")],
                      [("dx", "T"), ("dgamma", "G"), ("dbeta", "G"), ("partials", "U")], ()),
    # classes: the scores are each row's first ``classes`` values (graph/passes/aligned.py: a padded product's)
    "CrossEntropy": ([("x", "T"), ("target", "I")], [("losses", "U"), ("lse", "U")], ("ignore_index", "classes")),
    "CrossEntropyGrad": ([("grad", "U"), ("x", "T"), ("target", "I"), ("lse", "U")], [("dx", "T")],
                         ("ignore_index", "classes")),
    # written by graph/passes/gradient_sums.py and layer_norm_sums.py (no torch operator stands for them)
    # (the sum float32 or of x's half dtype; x variadic, _VARIADIC; rows: y's first dim, where the inputs are padded
    # products)
    "AddHalf": ([("sum", "G"), ("x", "T")], [("y", "U")], ("rows",)),
    # written by graph/passes/weight_casts.py: float32 weights rounded to one half dtype (x and y variadic;
    # output_rows, ints: each y's first dim (0: x's), the rows past x's zeros)
    **{name: ([("x", "U")], [("y", "T")], ("output_rows",)) for name in ("CastsToFloat16", "CastsToBFloat16")},
    **{name: ([("dy", "T"), ("x", "U"), ("mean", "U"), ("rstd", "U"), ("gamma", "U"), ("residual", "U")],
              [("sum", "U"), ("dgamma", "U"), ("dbeta", "U"), ("partials", "U"), *extra], ())
       for name, extra in (("LayerNormGradAdd", []), ("LayerNormGradAddCast", [("sum_cast", "T")]))},
    **{name: ([("dy", "U"), ("x", "U"), ("mean", "U"), ("rstd", "U"), ("gamma", "U")],
              [("dx", "U"), ("dgamma", "U"), ("dbeta", "U"), ("partials", "U"), ("dx_cast", "T")], ())
       for name in ("LayerNormGradToFloat16", "LayerNormGradToBFloat16")},
    # written by graph/passes/recompute.py's device_barriers: x itself once ``after`` (of any dtype A) is computed
    "AliasAfter": ([("x", "T"), ("after", "A")], [("y", "T")], ()),
    # written by graph/passes/dropout.py's seeded_dropout: ONNX's training Dropout drawing from the seed (ratio: a
    # float attribute; stream: the node's number)
    "SeededDropout": ([("x", "T"), ("seed", "I")], [("y", "T"), ("mask", "B")], ("ratio", "stream")),
    # written by graph/passes/layer_norm_forward.py (epsilon: a float attribute)
    **{name: ([("x", "U"), ("gamma", "U"), ("beta", "U")], [("y", "T"), ("mean", "U"), ("rstd", "U")], ("epsilon",))
       for name in ("LayerNormToFloat16", "LayerNormToBFloat16")},
}
_FLOAT_ATTRIBUTES = {"epsilon", "ratio"}
_INTS_ATTRIBUTES = {"output_rows"}
# (operator, input or output): one or more tensors of its type
_VARIADIC = {("AddHalf", "x"), *((name, p) for name in ("CastsToFloat16", "CastsToBFloat16") for p in "xy")}
_TYPES = {"T": _DTYPES, "G": _DTYPES, "I": ["tensor(int64)"], "U": ["tensor(float)"], "B": ["tensor(bool)"],
          "A": [*_DTYPES, "tensor(double)", "tensor(int64)", "tensor(int32)", "tensor(bool)"]}


def _register_schemas() -> None:
    """ONNX schemas of the kernels' operators (what onnxscript reads to emit their nodes, and onnx's checker)."""
    kinds = onnx.defs.OpSchema.AttrType
    onnx_schemas.register(DOMAIN, OPSET, "ort_trainer's kernel library", _SCHEMAS, _TYPES,
                          {**{a: kinds.FLOAT for a in _FLOAT_ATTRIBUTES}, **{a: kinds.INTS for a in _INTS_ATTRIBUTES}},
                          _VARIADIC)


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

    def safe_softmax_bias_onnx(x, bias):
        return opset.BiasSafeSoftmax(x, bias)

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
    registry.register_op(torch.ops.ort_trainer.safe_softmax_bias.default, safe_softmax_bias_onnx)
    registry.register_op(torch.ops.ort_trainer.cross_entropy.default, cross_entropy_onnx)
    registry.register_op(torch.ops.ort_trainer.cross_entropy_grad.default, cross_entropy_grad_onnx)

"""ATen decompositions of the backward operators that torch's ONNX exporter cannot translate.

Autograd emits ``convolution_backward`` as a single operator, which the exporter's operator library
(torchlib) has no translation for and torch has no decomposition of. It is a linear map, written here with
``aten.convolution`` (transposed where it is the adjoint), sums and reshapes, which translate to standard ONNX.
The pools' backwards and forwards that need the same are in ``pools.py``.
And ``empty_permuted``, which torch's own decompositions make, ``cumprod`` (with its backward's bool ``max``),
whose reference uses ``prims.prod``, RReLU's forward, ``uniform_``'s draw, a stable sort, the gamma function's
logarithm and derivatives (``special_functions.py``), the modified Bessel functions of orders 0 and 1
(``bessel.py``), the k-th value and medians (``order_statistics.py``),
``cdist``'s kernel and its backward (``distances.py``), a write into a diagonal and ``torch.diagonal``'s
backward (``diagonals.py``). Used during the joint trace (``joint_onnx.joint_program``); ``FORWARD`` in the
eval-mode graph's too.

Besides, forward functions written out in place of what torch or torchlib would compute otherwise than ATen
(by the eval-mode graph, and for ``WRITTEN_OUT`` by the training program before autograd):
``multilabel_margin_loss_forward`` and ``cross_entropy_loss`` (with label smoothing or probability targets).
"""

from __future__ import annotations

import math

import torch

from . import bessel, diagonals, distances, order_statistics, pools, special_functions
from .pools import per_dim, transposed_convolution

aten = torch.ops.aten


def _weight_gradient(x: torch.Tensor, grad: torch.Tensor, kernel: list, stride: list, padding: list,
                     dilation: list, groups: int) -> torch.Tensor:
    """Gradient of a convolution's weight ``[C_out, C_in / groups, *kernel]``: a convolution of the
    input with the output gradient, the batch taking the place of the channels."""
    dims = len(kernel)
    n, c_in, c_out = x.shape[0], x.shape[1], grad.shape[1]
    space = list(range(3, 3 + dims))
    xs = x.reshape(n, groups, c_in // groups, *x.shape[2:]).permute(2, 1, 0, *space)
    xs = xs.reshape(c_in // groups, groups * n, *x.shape[2:])
    gs = grad.reshape(n, groups, c_out // groups, *grad.shape[2:]).permute(1, 2, 0, *space)
    gs = gs.reshape(c_out, n, *grad.shape[2:])
    result = aten.convolution(xs, gs, None, dilation, padding, stride, False, [0] * dims, groups)
    for axis, size in enumerate(kernel):
        result = aten.slice(result, 2 + axis, 0, size)
    return result.transpose(0, 1)


def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    """``aten.convolution_backward`` with ``aten.convolution``: the input gradient is the adjoint
    convolution, the weight gradient a convolution of input and output gradient."""
    dims = weight.dim() - 2
    stride, padding, dilation = (per_dim(v, dims) for v in (stride, padding, dilation))
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution(grad_output, weight, None, stride, padding, dilation, False, [0] * dims,
                                          groups)
        else:
            grad_input = transposed_convolution(grad_output, weight, stride, padding, dilation, groups,
                                                list(input.shape))
    if output_mask[1]:
        if transposed:  # the weight of y = conv_transpose(x, w) is that of the convolution x = conv(y, w)
            grad_weight = _weight_gradient(grad_output, input, kernel, stride, padding, dilation, groups)
        else:
            grad_weight = _weight_gradient(input, grad_output, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def multilabel_margin_loss_forward(input, target, reduction):
    """``aten.multilabel_margin_loss_forward`` as ATen's kernel computes it: for each sample, the hinge
    ``max(0, 1 - x[y_j] + x[i]) / classes`` summed over its target classes ``y_j`` (the target's entries before
    its first -1) and the classes ``i`` that are none of them; then the mean over the samples (the sum, or each
    sample's). torch's own decomposition (2.13) also adds the terms of the entries after the first -1, each as if
    its class were 0: a loss several times ATen's, which the exporter's table would have used."""
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = x.shape[-1]
    idx = torch.arange(classes, device=t.device)
    end = torch.amin(torch.where(t == -1, idx, classes), dim=-1, keepdim=True)
    counted = idx < end  # [batch, slots]: the target's entries before its first -1
    gathered = torch.gather(x, -1, torch.where(counted, t, 0))  # [batch, slots]: x at each entry's class
    is_target = torch.any(idx == torch.where(counted, t, -1).unsqueeze(-1), dim=1)  # [batch, classes]
    hinge = (1.0 - gathered.unsqueeze(-1) + x.unsqueeze(1)).clamp_min(0) / classes  # [batch, slots, classes]
    hinge = torch.where(counted.unsqueeze(-1) & ~is_target.unsqueeze(1), hinge, 0.0)
    loss = hinge.sum((1, 2))
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2 or input.dim() < 2:
        loss = loss.sum()
    return loss, is_target.to(input.dtype).reshape(target.shape)


def multilabel_margin_loss(input, target, reduction=1):
    """``aten.multilabel_margin_loss`` (``F.multilabel_margin_loss``): ``multilabel_margin_loss_forward``'s loss."""
    return multilabel_margin_loss_forward(input, target, reduction)[0]


def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """``aten.cross_entropy_loss`` as ATen's composite computes it, in functional operators. The exporter
    translates the operator to ONNX's ``SoftmaxCrossEntropyLoss``, which has no label smoothing: torchlib's own
    smoothing differs from PyTorch's with class weights, and a target of probabilities with weights made an
    invalid graph. Class indices: the weighted ``nll_loss`` mixed with the smoothing term ``-sum_c w_c log p_c``
    (zero for ignored targets; its mean divided by the counted targets' weights, or their count); probabilities,
    smoothed towards uniform: ``-sum_c w_c t_c log p_c``, whose mean divides by the positions' count."""
    classes = input.shape[1]
    logp = torch.log_softmax(input, 1)
    shape = [1, classes] + [1] * (input.dim() - 2)
    weighted = logp if weight is None else logp * weight.reshape(shape)
    if target.is_floating_point():
        if label_smoothing:
            target = target * (1 - label_smoothing) + label_smoothing / classes
        loss = -(weighted * target).sum(1)
        positions = math.prod([input.shape[0], *input.shape[2:]])  # (sizes, not numel: symbolic ones translate)
        return loss.sum() / positions if reduction == 1 else loss.sum() if reduction == 2 else loss
    nll = aten.nll_loss_nd(logp, target, weight, reduction, ignore_index)
    if not label_smoothing:
        return nll
    ignored = target == ignore_index
    smooth = torch.where(ignored, 0.0, -weighted.sum(1))
    if reduction == 1:
        counted = (~ignored).to(input.dtype) if weight is None else \
            torch.where(ignored, 0.0, weight[torch.where(ignored, 0, target)])
        smooth = smooth.sum() / counted.sum()
    elif reduction == 2:
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / classes)


def empty_permuted(size, physical_layout, **options):
    """``aten.empty_permuted``: an uninitialised tensor of ``size`` whose memory runs in the order of
    ``physical_layout``. torch's reference of ``empty_like`` makes one (the backward of ``silu``
    after a ``group_norm`` fills one with ones), and the exporter has no translation of it: an
    ``empty`` of the sizes in memory order, permuted back to ``size`` (in ONNX, where tensors have no
    strides, its values are all that count)."""
    layout = list(physical_layout)
    if layout == list(range(len(layout))):
        return aten.empty.memory_format(list(size), **options)
    inverse = [layout.index(axis) for axis in range(len(layout))]
    return aten.empty.memory_format([size[axis] for axis in layout], **options).permute(inverse)


def cumprod(input, dim, dtype=None):
    """``aten.cumprod``: each position's product of the elements up to it along ``dim``, as a
    product over ``dim`` of the input with the later elements replaced by ones (torch's reference
    writes the same with ``prims.prod``, which the exporter has no translation for; ``aten.prod``
    is ``ReduceProd``). Its backward, which autograd writes with ``cumprod`` and sums, uses it too."""
    if input.dim() == 0:
        return input.clone() if dtype is None else input.to(dtype)
    dim = dim % input.dim()
    positions = torch.arange(input.shape[dim], device=input.device)
    mask = positions.unsqueeze(1) <= positions  # [source, target]: source at or before target
    for _ in range(input.dim() - dim - 1):
        mask = mask.unsqueeze(-1)
    masked = torch.where(mask, input.unsqueeze(dim + 1), 1)
    return aten.prod.dim_int(masked, dim, False, dtype=dtype)


def max_dim(input, dim, keepdim=False):
    """``aten.max.dim`` of a bool tensor (``cumprod``'s backward finds each row's first zero so), whose
    ``ReduceMax`` and ``ArgMax`` ONNX does not take in bool: of its int32 copy. Other dtypes are left
    to the exporter."""
    if input.dtype != torch.bool:
        return NotImplemented
    values, indices = aten.max.dim(input.to(torch.int32), dim, keepdim)
    return values.to(torch.bool), indices


def uniform(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, generator=None) -> torch.Tensor:
    """``Tensor.uniform_(a, b)`` (functionalised: ``aten.uniform``; ``torch.distributions.Laplace.rsample``, noise
    drawn into a new tensor), whose reference ``prims.uniform`` the exporter cannot translate: a uniform draw of the
    graph in [0, 1) scaled to [a, b), anew at each step, as torch's kernel scales its draw."""
    return torch.rand_like(self) * (to - from_) + from_


def rrelu_with_noise_functional(self: torch.Tensor, noise: torch.Tensor, lower=0.125, upper=1.0 / 3.0,
                                training: bool = False, generator=None):
    """RReLU (``nn.RReLU``, ``F.rrelu``), which the exporter has no translation for, as torch's kernel computes it:
    in training each element at or below 0 times a slope drawn uniformly from [lower, upper] (a random operator
    of the graph, drawn anew at each step), the others kept; ``noise`` those slopes and 1 (what
    ``rrelu_with_noise_backward`` multiplies the gradient by). In eval mode a leaky ReLU of slope
    (lower + upper) / 2, ``noise`` unchanged."""
    if not training:
        return aten.leaky_relu(self, (lower + upper) / 2), noise
    slopes = uniform(self, lower, upper)
    slopes = torch.where(self <= 0, slopes, torch.ones((), dtype=self.dtype, device=self.device))
    return self * slopes, slopes


def sort_stable(self: torch.Tensor, *, stable: bool | None = None, dim: int = -1,
                descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(stable=True)`` (``aten.sort.stable``, no translation) as ``aten.sort``, which the exporter writes
    as ONNX ``TopK``: the ONNX specification breaks its ties by the lower index, which is what a stable sort
    keeps, ascending or descending."""
    return aten.sort.default(self, dim, descending)


def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """``aten.embedding_bag`` (``nn.EmbeddingBag``, ``F.embedding_bag``; its backward has no translation) as
    an embedding of every index and an ``index_add`` (sum, mean) or ``scatter_reduce`` (max) into its bag,
    which autograd differentiates as a gather. The bag of each index counts the offsets at or before it;
    indices equal to ``padding_idx`` are left out (of the means' counts too); an empty bag is zeros. Only
    the first output is computed (``eval_program.bags_alone`` checks that nothing reads the others)."""
    count, bags = indices.shape[0], offsets.shape[0] - (1 if include_last_offset else 0)
    starts = torch.zeros(count + 1, dtype=torch.int64, device=indices.device)
    # every offset (the first is 0; with include_last_offset, the last ends the last bag) counted where it
    # starts: no slice of the offsets, whose length is the batch's (torch would guard the slice's on it)
    starts = starts.index_add(0, offsets, torch.ones_like(offsets))  # offsets are in [0, count]
    bag = torch.cumsum(starts[:count], 0) - 1
    keep = bag < bags  # include_last_offset: indices past the last offset are in no bag
    if padding_idx is not None and padding_idx >= 0:
        keep = keep & (indices != padding_idx)
    bag = torch.where(keep, bag, 0)
    rows = torch.nn.functional.embedding(indices, weight, scale_grad_by_freq=scale_grad_by_freq)
    size = (bags, weight.shape[1])
    if mode == 2:  # max: the largest of each column; ties share the gradient (torch's kernel gives it to one)
        rows = torch.where(keep[:, None], rows, float("-inf"))
        best = rows.new_full(size, float("-inf")).scatter_reduce(0, bag[:, None].expand_as(rows), rows, "amax")
        return torch.where(torch.isinf(best) & (best < 0), 0.0, best), bag, bag, bag
    factor = keep.to(rows.dtype)
    if per_sample_weights is not None:  # sum mode only (torch refuses it with the others)
        factor = factor * per_sample_weights
    total = rows.new_zeros(size).index_add(0, bag, rows * factor[:, None])
    if mode == 1:
        members = rows.new_zeros(bags).index_add(0, bag, keep.to(rows.dtype))
        total = total / members.clamp(min=1)[:, None]
    return total, bag, bag, bag


def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """``torch.searchsorted`` (no translation): for each value, how many of its row's sorted values are below it
    (``right``: at or below it), counted over a comparison with every one of them (a value's row: the sequence's
    row of the same leading indices, or the whole sequence where it is 1-d). A NaN value goes after every number,
    as in torch; NaNs in the sequence count as past every number (where torch's binary search answers otherwise,
    the sequence is not sorted)."""
    if sorter is not None:
        sorted_sequence = torch.gather(sorted_sequence, -1, sorter)
    values = torch.as_tensor(values, dtype=sorted_sequence.dtype, device=sorted_sequence.device)
    rows = sorted_sequence.unsqueeze(-2)  # [..., 1, n] against values [..., m, 1]
    if sorted_sequence.dim() == 1 and values.dim() == 0:
        rows, column = sorted_sequence, values
    else:
        column = values.unsqueeze(-1)
    right = right or side == "right"
    below = (rows <= column) if right else (rows < column)
    below = below | (torch.isnan(column) & ~torch.isnan(rows))  # a NaN value goes after every number
    if right:
        below = below | (torch.isnan(column) & torch.isnan(rows))
    return below.sum(-1, dtype=torch.int32 if out_int32 else torch.int64)


def index_reduce(input, dim, index, source, reduce, *, include_self=True):
    """``Tensor.index_reduce`` (no translation) as the ``scatter_reduce`` of ``source`` with ``index`` spread over
    its other dims: the same reduction of the same elements, which autograd differentiates."""
    dim = dim % max(source.dim(), 1)
    shape = [1] * source.dim()
    shape[dim] = index.shape[0]
    spread = index.reshape(shape).expand_as(source)
    return input.scatter_reduce(dim, spread, source, {"amax": "amax", "amin": "amin"}.get(reduce, reduce),
                                include_self=include_self)




def masked_scatter_backward(grad_output: torch.Tensor, mask: torch.Tensor, sizes: list) -> torch.Tensor:
    """The source's gradient of ``masked_scatter`` (no translation: ATen's is a ``masked_select``, sized by the
    data): the k-th True position of the mask (broadcast to the gradient's shape, row-major) sends its gradient to
    the source's k-th element, the elements past the last True position get zeros. Written as a ``scatter_add``
    into one more element than the source has, where the False positions all land, dropped after."""
    numel = math.prod(sizes)
    flat_mask = mask.expand_as(grad_output).reshape(-1)
    order = torch.cumsum(flat_mask.to(torch.int64), 0) - 1
    index = torch.where(flat_mask, order, numel)
    scattered = grad_output.new_zeros([numel + 1]).scatter_add(0, index, grad_output.reshape(-1))
    return scattered[:numel].reshape(sizes)


def fmax(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``torch.fmax`` (``prims.fmax``: no translation): the larger, the other where one is NaN, as ``where`` of
    ``self >= other or other is NaN``, whose gradient is the one ATen's derivative formula gives (to ``self``
    where that holds, else to ``other``)."""
    return torch.where((self >= other) | torch.isnan(other), self, other)


def fmin(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``torch.fmin``, as ``fmax`` with ``<=``."""
    return torch.where((self <= other) | torch.isnan(other), self, other)


DECOMPOSITIONS = {
    aten.sort.stable: sort_stable,
    aten.uniform.default: uniform,
    aten.cumprod.default: cumprod,
    aten.max.dim: max_dim,
    aten.empty_permuted.default: empty_permuted,
    aten.convolution_backward.default: convolution_backward,
    aten.masked_scatter_backward.default: masked_scatter_backward,
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
    **pools.DECOMPOSITIONS,  # average, adaptive and max pools' backwards, adaptive pools' forwards
    **special_functions.DECOMPOSITIONS,  # lgamma, digamma, polygamma(1, ·)
    **bessel.DECOMPOSITIONS,  # i0, i0e, i1, i1e
    **order_statistics.DECOMPOSITIONS,  # kthvalue, median, nanmedian
    **distances.DECOMPOSITIONS,  # cdist's and pdist's kernels and their backwards
    **diagonals.DECOMPOSITIONS,  # diagonal_scatter (a write into a diagonal) and torch.diagonal's backward
}
# operators written out as these functions before anything traces them (``before_autograd``, and the eval-mode
# graph's ``forward_program``): under the Python dispatcher, where tracing runs, torch's own decomposition is registered
# for autograd and runs before any table's
WRITTEN_OUT = {aten.multilabel_margin_loss.default: multilabel_margin_loss,
               # no translation of their forwards either
               aten.searchsorted.Tensor: searchsorted, aten.searchsorted.Scalar: searchsorted,
               aten.index_reduce.default: index_reduce, aten.fmax.default: fmax, aten.fmin.default: fmin}
# nn.EmbeddingBag's operators, written out where only their bags are read (``eval_program.bags_alone``)
EMBEDDING_BAGS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx)
# forward operators among them, which the eval-mode graph decomposes with the exporter's table too
FORWARD = (aten.sort.stable, aten.uniform.default, aten.cumprod.default, *pools.FORWARD,
           aten.multilabel_margin_loss_forward.default,
           aten.rrelu_with_noise_functional.default,
           *special_functions.DECOMPOSITIONS, *bessel.DECOMPOSITIONS, *order_statistics.DECOMPOSITIONS,
           aten._cdist_forward.default,
           aten._pdist_forward.default, aten.diagonal_scatter.default)

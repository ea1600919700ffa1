"""ATen decompositions of the backward operators that torch's ONNX exporter cannot translate.

Autograd emits ``convolution_backward``, ``avg_pool2d_backward`` and
``_adaptive_avg_pool2d_backward`` as single operators, which the exporter's operator library
(torchlib) has no translation for and torch has no decomposition of. They are linear maps, so
each is written here with ``aten.convolution`` (transposed where it is the adjoint), sums and
reshapes, which translate to standard ONNX. ``max_pool2d_with_indices_backward`` (a scatter-add of
the output gradient to the maxima's positions) is one where the installed torch has no
decomposition of its own (torch 2.11: the GPU machine's; 2.13 has one and it is used);
``adaptive_max_pool2d_backward`` the same scatter-add, which no torch decomposes; the 3-d pools'
backwards as the 2-d ones; adaptive max pools' forwards (no translation of the 2-d one; the 3-d one's
indices made as the backward reads them) as an ``argmax``, a max pool, or gathered windows reduced a dim
at a time; adaptive average pools whose windows overlap or differ in size (and the 3-d pool's forward,
which has no translation either) as a product by an averaging matrix per dim.
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
from torch._decomp import decomposition_table

from . import bessel, diagonals, distances, order_statistics, special_functions

aten = torch.ops.aten
_UNSUPPORTED = ("use the gradient source of the onnxruntime-training 1.19.2 build for this model "
                "(pip install -e '.[training]')")


def _per_dim(values, dims: int) -> list:
    values = list(values)
    return values * dims if len(values) == 1 else values


def _transposed(grad: torch.Tensor, weight: torch.Tensor, stride: list, padding: list, dilation: list, groups: int,
                size: list) -> torch.Tensor:
    """The adjoint convolution of ``grad``, as large as ``size`` (input elements past the last
    window get zero): the missing rows are the transposed convolution's ``output_padding`` when
    the sizes are static; symbolic ones are padded on (``constant_pad_nd`` fixes the batch size
    while traced, so it is not used when avoidable)."""
    dims = weight.dim() - 2
    missing = [size[2 + i] - ((grad.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                              + dilation[i] * (weight.shape[2 + i] - 1) + 1) for i in range(dims)]
    if all(isinstance(m, int) for m in missing):
        result = aten.convolution(grad, weight, None, stride, padding, dilation, True, [max(m, 0) for m in missing],
                                  groups)
        for axis in (axis for axis in range(dims) if missing[axis] < 0):  # a pool's ceil_mode windows past the end
            result = aten.slice(result, 2 + axis, 0, size[2 + axis])
        return result
    result = aten.convolution(grad, weight, None, stride, padding, dilation, True, [0] * dims, groups)
    pads = []
    for axis in reversed(range(dims)):
        pads += [0, missing[axis]]
    return aten.constant_pad_nd(result, pads, 0.0)


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
    stride, padding, dilation = (_per_dim(v, dims) for v in (stride, padding, dilation))
    kernel = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = aten.convolution(grad_output, weight, None, stride, padding, dilation, False, [0] * dims,
                                          groups)
        else:
            grad_input = _transposed(grad_output, weight, stride, padding, dilation, groups, list(input.shape))
    if output_mask[1]:
        if transposed:  # the weight of y = conv_transpose(x, w) is that of the convolution x = conv(y, w)
            grad_weight = _weight_gradient(grad_output, input, kernel, stride, padding, dilation, groups)
        else:
            grad_weight = _weight_gradient(input, grad_output, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def avg_pool2d_backward(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    """``aten.avg_pool2d_backward``: each output's gradient, divided by its window's divisor, spread
    over the window by a transposed depthwise convolution of ones."""
    return _avg_pool_backward(2, grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


def avg_pool3d_backward(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    """``aten.avg_pool3d_backward`` (``local_response_norm`` uses the pool too): as ``avg_pool2d_backward``."""
    return _avg_pool_backward(3, grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)


def _avg_pool_backward(dims, grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    if input.dim() == dims + 1:  # unbatched
        return _avg_pool_backward(dims, grad_output.unsqueeze(0), input.unsqueeze(0), kernel_size, stride, padding,
                                  ceil_mode, count_include_pad, divisor_override).squeeze(0)
    kernel = _per_dim(kernel_size, dims)
    stride = _per_dim(stride or kernel_size, dims)
    padding = _per_dim(padding, dims)
    channels = input.shape[1]
    ones = grad_output.new_ones([channels, 1, *kernel])
    if divisor_override:
        scaled = grad_output / divisor_override
    elif not ceil_mode and (count_include_pad or not any(padding)):
        scaled = grad_output / math.prod(kernel)
    else:
        scaled = grad_output / _window_sizes(dims, grad_output, input, kernel, stride, padding, ceil_mode,
                                             count_include_pad)
    return _transposed(scaled, ones, stride, padding, [1] * dims, channels, list(input.shape))


def _window_sizes(dims, grad_output, input, kernel, stride, padding, ceil_mode, count_include_pad):
    """Each window's divisor, as ATen's kernel counts it: the elements of the input (``count_include_pad``: of
    the input and its padding) the window covers, a convolution of ones over a plane of ones. Under
    ``ceil_mode`` the last windows may run past the padding, where they count nothing."""
    sizes = list(input.shape[2:])
    plane = input.new_ones([1, 1, *sizes])
    if not ceil_mode:
        return aten.convolution(plane, input.new_ones([1, 1, *kernel]), None, stride, padding, [1] * dims, False,
                                [0] * dims, 1)
    past = [(grad_output.shape[2 + i] - 1) * stride[i] + kernel[i] - (sizes[i] + 2 * padding[i]) for i in range(dims)]
    if not all(isinstance(p, int) for p in past):
        raise NotImplementedError(f"avg_pool{dims}d with ceil_mode=True over symbolic sizes has no ONNX gradient "
                                  f"here; use ceil_mode=False, static sizes, or {_UNSUPPORTED}")
    inside, beyond = [], []  # constant_pad_nd's pads, the last dim first
    for axis in reversed(range(dims)):
        inside += [padding[axis], padding[axis]]
        beyond += [0, max(past[axis], 0)]
    if count_include_pad:
        plane = aten.constant_pad_nd(aten.constant_pad_nd(plane, inside, 1.0), beyond, 0.0)
    else:
        plane = aten.constant_pad_nd(plane, [a + b for a, b in zip(inside, beyond)], 0.0)
    return aten.convolution(plane, input.new_ones([1, 1, *kernel]), None, stride, [0] * dims, [1] * dims, False,
                            [0] * dims, 1)


def adaptive_avg_pool2d_backward(grad_output, input):
    """``aten._adaptive_avg_pool2d_backward``: global pooling, windows that tile the input, or else
    ``_pooled``'s products by each dim's averaging matrix, transposed."""
    out_h, out_w = grad_output.shape[-2:]
    height, width = input.shape[-2:]
    if out_h == 1 and out_w == 1:
        return (grad_output / (height * width)).expand(input.shape)
    if isinstance(height, int) and isinstance(width, int) and height % out_h == 0 and width % out_w == 0:
        kh, kw = height // out_h, width // out_w
        lead = list(grad_output.shape[:-2])
        tiled = grad_output.reshape(*lead, out_h, 1, out_w, 1).expand(*lead, out_h, kh, out_w, kw)
        return tiled.reshape(input.shape) / (kh * kw)
    return _pooled(grad_output, list(input.shape[-2:]), backward=True)


def adaptive_avg_pool3d(input, output_size):
    """``aten._adaptive_avg_pool3d`` (no translation, no torch decomposition): ``_pooled``."""
    return _pooled(input, list(output_size), backward=False)


def adaptive_avg_pool3d_backward(grad_output, input):
    """``aten._adaptive_avg_pool3d_backward``: ``_pooled``'s products, transposed."""
    return _pooled(grad_output, list(input.shape[-3:]), backward=True)


def _pooled(x, sizes, backward: bool):
    """An adaptive average pool of ``x`` over its last ``len(sizes)`` dims (to ``sizes``; ``backward``: its
    adjoint, from them to ``sizes``), one matrix product a dim: output ``i`` of a dim of ``n`` inputs averages
    inputs ``floor(i·n/m)`` to ``ceil((i+1)·n/m)`` (exclusive) of the ``m`` outputs, as ATen's kernel's
    windows, which overlap or differ in size where ``m`` does not divide ``n``. Half-precision values are
    summed in float32 (as the kernel's accumulator), then rounded once."""
    dtype = x.dtype
    work = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    for axis, size in zip(range(-len(sizes), 0), sizes):
        outputs, inputs = (x.shape[axis], size) if backward else (size, x.shape[axis])
        matrix = _averaging(outputs, inputs, work)  # [outputs, inputs]
        work = (work.movedim(axis, -1) @ (matrix if backward else matrix.t())).movedim(-1, axis)
    return work.to(dtype)


def _averaging(outputs, inputs, like: torch.Tensor) -> torch.Tensor:
    """The ``[outputs, inputs]`` matrix of an adaptive average pool along one dim: row ``i`` is ``1 / count``
    over its window ``[floor(i·inputs/outputs), ceil((i+1)·inputs/outputs))``, zero elsewhere."""
    rows = torch.arange(outputs, device=like.device)
    start = torch.div(rows * inputs, outputs, rounding_mode="floor")
    end = torch.div((rows + 1) * inputs + outputs - 1, outputs, rounding_mode="floor")
    positions = torch.arange(inputs, device=like.device)
    inside = (positions >= start.unsqueeze(1)) & (positions < end.unsqueeze(1))
    return inside.to(like.dtype) / (end - start).to(like.dtype).unsqueeze(1)


def max_pool2d_with_indices_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """``aten.max_pool2d_with_indices_backward``: each output's gradient added to the input element
    its window's maximum came from. ``indices`` are flat positions in each channel's ``H × W`` plane,
    so the gradient is a scatter-add along the flattened plane; windows that overlap and picked the
    same element add up. Half-precision gradients are added in float32 (as torch's own
    decomposition does), then rounded once."""
    return _scatter_to_maxima(2, grad_output, input, indices)


def max_pool3d_with_indices_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """``aten.max_pool3d_with_indices_backward``: as ``max_pool2d_with_indices_backward``, the indices
    flat positions in each channel's ``D × H × W`` volume."""
    return _scatter_to_maxima(3, grad_output, input, indices)


def adaptive_max_pool2d_backward(grad_output, input, indices):
    """``aten.adaptive_max_pool2d_backward``: as ``max_pool2d_with_indices_backward`` (its indices are
    flat positions in each channel's plane too)."""
    return _scatter_to_maxima(2, grad_output, input, indices)


def adaptive_max_pool3d_backward(grad_output, input, indices):
    """``aten.adaptive_max_pool3d_backward``: the indices flat positions in each channel's volume."""
    return _scatter_to_maxima(3, grad_output, input, indices)


def adaptive_max_pool2d(input, output_size):
    """``aten.adaptive_max_pool2d`` (no translation; torch 2.13 decomposes a global pool and windows that tile the
    plane only): ``_adaptive_max``."""
    return _adaptive_max(input, list(output_size))


def adaptive_max_pool3d(input, output_size):
    """``aten.adaptive_max_pool3d``: ``_adaptive_max``, whose indices ``adaptive_max_pool3d_backward`` reads."""
    return _adaptive_max(input, list(output_size))


def _adaptive_max(x, sizes):
    """The values and indices of an adaptive max pool of ``x`` over its last ``len(sizes)`` dims, as ATen's kernel:
    output ``i`` of a dim of ``n`` inputs and ``m`` outputs takes the maximum over inputs ``floor(i·n/m)`` to
    ``ceil((i+1)·n/m)`` (exclusive), its index the maximum's flat position in each channel's plane (volume), the
    first in row-major order among equal values. A global pool is the flattened plane's ``amax`` and ``argmax``,
    windows that tile the plane a max pool; other windows (they overlap or differ in size) are reduced a dim at a
    time from the last: each window's values gathered (those past its end masked with -inf), the first maximum
    taken, and the positions it came from carried along."""
    dims = len(sizes)
    spatial = list(x.shape[-dims:])
    lead = list(x.shape[:-dims])
    if all(m == 1 for m in sizes):
        flat = x.flatten(-dims)
        return flat.amax(-1).reshape(*lead, *sizes), flat.argmax(-1).reshape(*lead, *sizes)
    if not all(isinstance(n, int) and isinstance(m, int) for n, m in zip(spatial, sizes)):
        return NotImplemented  # (symbolic sizes: the operator stays, and the build names it)
    if all(n % m == 0 for n, m in zip(spatial, sizes)):
        kernel = [n // m for n, m in zip(spatial, sizes)]
        pool = aten.max_pool2d_with_indices if dims == 2 else aten.max_pool3d_with_indices
        return pool(x, kernel, kernel)
    values, index, inner = x, None, 1
    for k in reversed(range(dims)):
        axis, n, m = x.dim() - dims + k, spatial[k], sizes[k]
        width = max(-(-(i + 1) * n // m) - i * n // m for i in range(m))  # the widest window
        rows = torch.arange(m, device=x.device).unsqueeze(1)
        start, end = rows * n // m, ((rows + 1) * n + m - 1) // m
        taps = start + torch.arange(width, device=x.device)  # [m, width]
        windows = values.index_select(axis, taps.clamp(max=n - 1).flatten()).unflatten(axis, (m, width))
        trailing = [1] * (values.dim() - axis - 1)
        windows = torch.where((taps < end).reshape(m, width, *trailing), windows, float("-inf"))
        values, chosen = windows.max(axis + 1)
        position = chosen + start.reshape(m, *trailing)
        index = position if index is None else position * inner + index.gather(axis, position)
        inner *= n
    return values, index


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


def _scatter_to_maxima(dims, grad_output, input, indices):
    lead = list(input.shape[:-dims])
    grad = grad_output.reshape(*lead, -1)
    accumulate = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    zeros = grad.new_zeros([*lead, math.prod(input.shape[-dims:])], dtype=accumulate)
    summed = aten.scatter_add(zeros, -1, indices.reshape(*lead, -1), grad.to(accumulate))
    return summed.to(grad_output.dtype).reshape(input.shape)


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


DECOMPOSITIONS = {
    aten.sort.stable: sort_stable,
    aten.uniform.default: uniform,
    aten.cumprod.default: cumprod,
    aten.max.dim: max_dim,
    aten.empty_permuted.default: empty_permuted,
    aten.convolution_backward.default: convolution_backward,
    aten.avg_pool2d_backward.default: avg_pool2d_backward,
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward.default: adaptive_avg_pool3d_backward,
    aten.adaptive_max_pool2d_backward.default: adaptive_max_pool2d_backward,
    aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    aten.adaptive_max_pool3d.default: adaptive_max_pool3d,
    aten.adaptive_max_pool3d_backward.default: adaptive_max_pool3d_backward,
    aten.avg_pool3d_backward.default: avg_pool3d_backward,
    aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
    aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
    **special_functions.DECOMPOSITIONS,  # lgamma, digamma, polygamma(1, ·)
    **bessel.DECOMPOSITIONS,  # i0, i0e, i1, i1e
    **order_statistics.DECOMPOSITIONS,  # kthvalue, median, nanmedian
    **distances.DECOMPOSITIONS,  # cdist's and pdist's kernels and their backwards
    **diagonals.DECOMPOSITIONS,  # diagonal_scatter (a write into a diagonal) and torch.diagonal's backward
}
# operators written out as these functions before anything traces them (``before_autograd``, and the eval-mode
# graph's ``forward_program``): under the Python dispatcher, where tracing runs, torch's own decomposition is registered
# for autograd and runs before any table's
WRITTEN_OUT = {aten.multilabel_margin_loss.default: multilabel_margin_loss}
# forward operators among them, which the eval-mode graph decomposes with the exporter's table too
FORWARD = (aten.sort.stable, aten.uniform.default, aten.cumprod.default, aten._adaptive_avg_pool3d.default,
           aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default,
           aten.multilabel_margin_loss_forward.default,
           aten.rrelu_with_noise_functional.default,
           *special_functions.DECOMPOSITIONS, *bessel.DECOMPOSITIONS, *order_statistics.DECOMPOSITIONS,
           aten._cdist_forward.default,
           aten._pdist_forward.default, aten.diagonal_scatter.default)
if aten.max_pool2d_with_indices_backward.default not in decomposition_table:
    DECOMPOSITIONS[aten.max_pool2d_with_indices_backward.default] = max_pool2d_with_indices_backward

"""ATen decompositions of the pooling operators that torch's ONNX exporter cannot translate (``backward_decompositions``
gathers them with the rest).

``avg_pool2d_backward`` and ``_adaptive_avg_pool2d_backward`` are linear maps, written with a transposed
``aten.convolution``, sums and reshapes; ``max_pool2d_with_indices_backward`` (a scatter-add of the output gradient
to the maxima's positions) is one where the installed torch has no decomposition of its own (torch 2.11: the GPU
machine's; 2.13 has one and it is used); ``adaptive_max_pool2d_backward`` the same scatter-add, which no torch
decomposes; the 3-d pools' backwards as the 2-d ones; adaptive max pools' forwards (no translation of the 2-d one;
the 3-d one's indices made as the backward reads them) as an ``argmax``, a max pool, or gathered windows reduced a
dim at a time; adaptive average pools whose windows overlap or differ in size (and the 3-d pool's forward, which has
no translation either) as a product by an averaging matrix per dim.
"""

from __future__ import annotations

import math

import torch
from torch._decomp import decomposition_table

aten = torch.ops.aten
UNSUPPORTED = ("use the gradient source of the onnxruntime-training 1.19.2 build for this model "
               "(pip install -e '.[training]')")


def per_dim(values, dims: int) -> list:
    """``values`` (a pool's or convolution's kernel, stride...) once per spatial dim: one value repeated ``dims``
    times, else as given."""
    values = list(values)
    return values * dims if len(values) == 1 else values


def transposed_convolution(grad: torch.Tensor, weight: torch.Tensor, stride: list, padding: list, dilation: list,
                           groups: int, size: list) -> torch.Tensor:
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
    kernel = per_dim(kernel_size, dims)
    stride = per_dim(stride or kernel_size, dims)
    padding = per_dim(padding, dims)
    channels = input.shape[1]
    ones = grad_output.new_ones([channels, 1, *kernel])
    if divisor_override:
        scaled = grad_output / divisor_override
    elif not ceil_mode and (count_include_pad or not any(padding)):
        scaled = grad_output / math.prod(kernel)
    else:
        scaled = grad_output / _window_sizes(dims, grad_output, input, kernel, stride, padding, ceil_mode,
                                             count_include_pad)
    return transposed_convolution(scaled, ones, stride, padding, [1] * dims, channels, list(input.shape))


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
                                  f"here; use ceil_mode=False, static sizes, or {UNSUPPORTED}")
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


def _scatter_to_maxima(dims, grad_output, input, indices):
    lead = list(input.shape[:-dims])
    grad = grad_output.reshape(*lead, -1)
    accumulate = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    zeros = grad.new_zeros([*lead, math.prod(input.shape[-dims:])], dtype=accumulate)
    summed = aten.scatter_add(zeros, -1, indices.reshape(*lead, -1), grad.to(accumulate))
    return summed.to(grad_output.dtype).reshape(input.shape)


DECOMPOSITIONS = {
    aten.avg_pool2d_backward.default: avg_pool2d_backward,
    aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
    aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward.default: adaptive_avg_pool3d_backward,
    aten.adaptive_max_pool2d_backward.default: adaptive_max_pool2d_backward,
    aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    aten.adaptive_max_pool3d.default: adaptive_max_pool3d,
    aten.adaptive_max_pool3d_backward.default: adaptive_max_pool3d_backward,
    aten.avg_pool3d_backward.default: avg_pool3d_backward,
    aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
}
if aten.max_pool2d_with_indices_backward.default not in decomposition_table:
    DECOMPOSITIONS[aten.max_pool2d_with_indices_backward.default] = max_pool2d_with_indices_backward
# the forward operators among them, which the eval-mode graph decomposes too
FORWARD = (aten._adaptive_avg_pool3d.default, aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)

__all__ = ["DECOMPOSITIONS", "FORWARD", "UNSUPPORTED", "per_dim", "transposed_convolution"]

"""The export guard's tables of torch functions (``guard.ExportGuard.handle``): draws, metadata queries, conversions
of a tensor to a Python value, and the stand-ins the ``torch.export`` route traces in their place."""

from __future__ import annotations

import torch

# torch's random draws: a value read from one into Python (a layer dropped when torch.rand(()) < p) is one draw
DRAWS = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "multinomial",
         "normal", "poisson", "uniform_", "normal_", "bernoulli_", "exponential_", "random_", "cauchy_",
         "geometric_", "log_normal_"}
# Queries about a tensor's metadata, not its values: their results depend on shapes only.
METADATA = {
    "size", "shape", "dim", "ndim", "ndimension", "numel", "nelement", "__len__", "stride", "dtype",
    "device", "layout", "element_size", "itemsize", "nbytes", "names", "requires_grad", "is_leaf",
    "grad_fn", "data_ptr", "storage_offset", "get_device", "__hash__", "__format__", "__repr__", "__str__",
    "__dir__", "__reduce_ex__", "__deepcopy__", "type",
    "__eq__", "__ne__",  # a Python bool from these means the other side was not a tensor or number
}
CONVERSIONS = {
    "__bool__": "a tensor's value used as a Python bool (if/while/and/or/not on a tensor, bool(tensor))",
    "item": "Tensor.item()",
    "__float__": "float(tensor)",
    "__int__": "int(tensor)",
    "__index__": "a tensor used as a Python int (range(tensor), slicing or an int argument)",
    "__complex__": "complex(tensor)",
    "tolist": "Tensor.tolist()",
    "numpy": "Tensor.numpy()",
    "__array__": "numpy.asarray(tensor)",
    "__contains__": "`value in tensor`",
}
# Stand-ins for a data-dependent Python value on the torch.export route (see ``guard.ExportGuard.handle``).
PLACEHOLDERS = {
    "__bool__": lambda t: True,
    "item": lambda t: True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1,
    "__float__": lambda t: 1.0,
    "__int__": lambda t: 1,
    "__index__": lambda t: 1,
    "__complex__": lambda t: 1 + 0j,
}


__all__ = ["CONVERSIONS", "DRAWS", "METADATA", "PLACEHOLDERS"]

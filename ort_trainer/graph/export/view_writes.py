"""In-place changes through views that torch's TorchScript export drops (the ``onnxruntime`` gradient source).

The TorchScript exporter writes an in-place change made through a view back into the tensor viewed only where
the view comes from basic indexing (``x[:, :2].mul_(2)``, ``x.select(1, 0).copy_(v)``). Made through any other
view (``narrow``, ``view``, ``reshape``, ``t``, ``unsqueeze``, ``movedim``...), the change stays in the view: a
later read of the tensor viewed reads its values from before the change, in the forward and hence in the
gradients, silently (``out = zeros_like(k); out.narrow(1, 0, 2).copy_(v); loss(out)``: an evaluated loss 98%
off PyTorch's). The view itself, read afterwards, has the change (``h = x.view(-1, 3); h.relu_(); h``: exact).

``ViewWrites`` follows one trace: which call made each view, and which tensor was changed through a view whose
chain of calls holds one the exporter does not follow; a call that then reads that tensor is the problem.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

# views through which the exporter writes a change back into the tensor viewed
_FOLLOWED = frozenset({"__getitem__", "select"})


def is_in_place(name: str) -> bool:
    """Whether the Tensor method or torch function ``name`` changes its first argument in place."""
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name not in ("__init__", "__index__", "__int__",
                                                                               "__invert__", "__iter__"))
    return name.endswith("_")


class ViewWrites:
    """The views of one TorchScript trace and the tensors changed through views the export does not follow."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # id(view) -> (call, viewed, view)
        self._changed: dict[int, tuple[torch.Tensor, str, str]] = {}  # id(base) -> (base, call, where)

    def note(self, name: str, args: tuple, out: Any, where: Callable[[], str]) -> tuple[str, str] | None:
        """After a call ``name(*args) -> out``: ``("mul_() through t()", where that change was made)`` when the call
        read a tensor changed before through a view the export does not follow, else None. ``where()``: the calling
        line, looked up only for such a change."""
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        read = next((self._changed[id(t)] for t in tensors if self._changed.get(id(t), (None,))[0] is t), None)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and is_in_place(name) and target._base is not None:
            view, calls = target, []
            while (made := self._made.get(id(view))) is not None and made[2] is view:
                calls.append(made[0])
                view = made[1]
            dropped = [call for call in calls if call not in _FOLLOWED]
            if dropped:
                self._changed[id(target._base)] = (target._base, f"{name}() through {dropped[-1]}()", where())
        if isinstance(out, torch.Tensor) and out._base is not None and target is not None and out is not target:
            self._made[id(out)] = (name, target, out)
        return (read[1], read[2]) if read is not None else None


__all__ = ["ViewWrites", "is_in_place"]

"""Model descriptions: the names, shapes and dtypes of a model's inputs and outputs.

A dimension is an ``int`` (static) or a ``str`` (symbolic, e.g. ``"batch"``); ``[]`` is a scalar.
The same symbol used in several places must take the same value in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

Dim = "int | str"

_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """Normalise a torch dtype, numpy dtype or dtype name to a ``numpy.dtype``.

    Args:
        dtype: e.g. ``torch.int64``, ``np.float32`` or ``"float32"``.

    Returns:
        The ``numpy.dtype``.

    Raises:
        TypeError: if ``dtype`` is not a dtype this library can feed to ONNX Runtime.
    """
    supported = ", ".join(sorted(np.dtype(d).name for d in _TORCH_TO_NUMPY.values()))
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NUMPY:
            raise TypeError(f"torch dtype {dtype} is not supported; use one of {sorted(map(str, _TORCH_TO_NUMPY))}")
        return np.dtype(_TORCH_TO_NUMPY[dtype])
    try:
        result = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{dtype!r} is not a torch or numpy dtype; use one of {supported}") from exc
    if result not in {np.dtype(d) for d in _TORCH_TO_NUMPY.values()}:
        raise TypeError(f"dtype {result} is not supported; use one of {supported}")
    return result


@dataclass
class IODescription:
    """One model input or output.

    Args:
        name: the tensor's name (an input name is also the keyword ``train_step`` accepts).
        shape: a list of dimensions, each an ``int`` (static) or ``str`` (symbolic).
        dtype: optional torch or numpy dtype; inputs whose dtype is given are checked, and when
            every input's dtype is given the training graph is built at construction.
        num_classes: optional number of classes of an integer label (documentation and checks).
        is_loss: marks the loss output.
    """

    name: str
    shape: Sequence[Any]
    dtype: Any = None
    num_classes: int | None = None
    is_loss: bool = False

    def _problems(self, where: str) -> list[str]:
        problems = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"{where}.name: expected a non-empty str, got {self.name!r}")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Sequence):
            problems.append(f"{where}.shape: expected a list of int or str dimensions, got {self.shape!r}")
        else:
            for i, dim in enumerate(self.shape):
                if isinstance(dim, bool) or not isinstance(dim, (int, str)):
                    problems.append(f"{where}.shape[{i}]: expected an int or a str, got {dim!r}")
                elif isinstance(dim, int) and dim < 0:
                    problems.append(f"{where}.shape[{i}]: a static dimension must be >= 0, got {dim}")
                elif isinstance(dim, str) and not dim:
                    problems.append(f"{where}.shape[{i}]: a symbolic dimension needs a non-empty name")
        if self.dtype is not None:
            try:
                to_numpy_dtype(self.dtype)
            except TypeError as exc:
                problems.append(f"{where}.dtype: {exc}")
        if self.num_classes is not None and (
            isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1
        ):
            problems.append(f"{where}.num_classes: expected a positive int, got {self.num_classes!r}")
        if not isinstance(self.is_loss, bool):
            problems.append(f"{where}.is_loss: expected a bool, got {self.is_loss!r}")
        return problems

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The dtype as a ``numpy.dtype``, or None when not given."""
        return None if self.dtype is None else to_numpy_dtype(self.dtype)


@dataclass
class ModelDescription:
    """The inputs and outputs of the model the trainer runs.

    Args:
        inputs: the model inputs in the order ``train_step`` takes them positionally. With a
            ``loss_fn`` the last input is the label.
        outputs: the trainer's outputs. Exactly one is the loss: the one with ``is_loss=True``,
            or else the first.
    """

    inputs: list[IODescription] = field(default_factory=list)
    outputs: list[IODescription] = field(default_factory=list)

    @property
    def loss_index(self) -> int:
        """Index in ``outputs`` of the loss output."""
        flagged = [i for i, o in enumerate(self.outputs) if o.is_loss]
        return flagged[0] if flagged else 0

    @property
    def loss_name(self) -> str:
        """Name of the loss output."""
        return self.outputs[self.loss_index].name

    @property
    def input_names(self) -> list[str]:
        """Names of the inputs in order."""
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Names of the outputs in order."""
        return [o.name for o in self.outputs]

    def validate(self) -> None:
        """Check the description, raising one ValueError that lists every problem.

        Raises:
            ValueError: naming each offending field (``model_desc.inputs[1].shape[0]: ...``).
        """
        problems = self._problems()
        if problems:
            raise ValueError(_report(problems))

    def _problems(self) -> list[str]:
        """Every problem of the description, each with its path (entries marked ``_UNREAD`` are skipped)."""
        problems = []
        valid: dict[str, list[tuple[int, IODescription]]] = {}
        for kind in ("inputs", "outputs"):
            items = getattr(self, kind)
            valid[kind] = []
            if items is _UNREAD:
                continue
            if not isinstance(items, (list, tuple)) or not items:
                problems.append(f"model_desc.{kind}: expected a non-empty list, got {items!r}")
                continue
            seen: dict[str, int] = {}
            for i, item in enumerate(items):
                where = f"model_desc.{kind}[{i}]"
                if item is _UNREAD:
                    continue
                if not isinstance(item, IODescription):
                    problems.append(f"{where}: expected an IODescription, got {type(item).__name__}")
                    continue
                valid[kind].append((i, item))
                problems.extend(item._problems(where))
                if isinstance(item.name, str) and item.name:
                    if item.name in seen:
                        problems.append(f"{where}.name: duplicate name {item.name!r} (also "
                                        f"model_desc.{kind}[{seen[item.name]}].name); names must be unique")
                    seen.setdefault(item.name, i)
        flagged = [o.name for _, o in valid["outputs"] if o.is_loss is True]
        if len(flagged) > 1:
            problems.append(f"model_desc.outputs: exactly one output may have is_loss=True, got {flagged}; "
                            "mark the loss only")
        for i, item in valid["inputs"]:
            if item.is_loss is True:
                problems.append(f"model_desc.inputs[{i}].is_loss: only an output can be the loss")

        def names(kind: str) -> set[str]:
            return {x.name for _, x in valid[kind] if isinstance(x.name, str) and x.name}

        clash = names("inputs") & names("outputs")
        if clash:
            problems.append(f"model_desc: names used for both an input and an output: {sorted(clash)}; rename one")
        return problems

    def fingerprint(self) -> list:
        """A JSON-able summary used in the graph cache key."""
        return [
            [[i.name, list(i.shape), str(i.numpy_dtype), i.num_classes] for i in self.inputs],
            [[o.name, list(o.shape), o.is_loss] for o in self.outputs],
            self.loss_index,
        ]


# Marks an entry (or a whole list) of a dict-form description that could not be read; its
# problem is already reported, so the checks of the rest skip it.
_UNREAD: Any = object()


def _from_item(item: Any, where: str, is_output: bool, problems: list[str]) -> Any:
    """One input or output in any accepted form, or ``_UNREAD`` (with its problem added)."""
    if isinstance(item, IODescription):
        return item
    if isinstance(item, Mapping):
        known = {"name", "shape", "dtype", "num_classes", "is_loss"}
        unknown = sorted(map(str, set(item) - known))
        missing = [k for k in ("name", "shape") if k not in item]
        if unknown:
            problems.append(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
        if missing:
            problems.append(f"{where}: missing {missing}; every entry needs 'name' and 'shape'")
        return _UNREAD if unknown or missing else IODescription(**item)
    if not isinstance(item, (list, tuple)) or not 2 <= len(item) <= 3:
        form = "(name, shape[, is_loss])" if is_output else "(name, shape[, dtype])"
        problems.append(f"{where}: expected {form}, got {item!r}")
        return _UNREAD
    name, shape, *rest = item
    if is_output:
        return IODescription(name, shape, is_loss=rest[0] if rest else False)
    return IODescription(name, shape, dtype=rest[0] if rest else None)


def _report(problems: list[str]) -> str:
    return "invalid model description:\n  " + "\n  ".join(problems)


def parse_model_desc(desc: ModelDescription | Mapping[str, Any]) -> ModelDescription:
    """Turn a ``ModelDescription`` or its dict form into a validated ``ModelDescription``.

    The dict form is ``{"inputs": [(name, shape)], "outputs": [(name, shape, is_loss)]}``; lists are
    accepted where tuples are, and an input may carry a dtype as a third element.

    Args:
        desc: the description.

    Returns:
        A validated ``ModelDescription`` (a new object; ``desc`` is left as it is).

    Raises:
        ValueError: for a malformed description, listing every problem with its path
            (``model_desc.inputs[1].name: ...``), not only the first.
        TypeError: when ``desc`` is neither a ModelDescription nor a dict.
    """
    problems: list[str] = []
    if isinstance(desc, ModelDescription):
        result = ModelDescription(*(list(items) if isinstance(items, (list, tuple)) else items
                                    for items in (desc.inputs, desc.outputs)))
    elif isinstance(desc, Mapping):
        unknown = sorted(map(str, set(desc) - {"inputs", "outputs"}))
        if unknown:
            problems.append(f"model_desc: unknown keys {unknown}; expected 'inputs' and 'outputs'")
        parsed = {}
        for key in ("inputs", "outputs"):
            items = desc.get(key)
            if key not in desc:
                form = "(name, shape, is_loss)" if key == "outputs" else "(name, shape)"
                problems.append(f"model_desc.{key}: missing; give a list of {form}")
                parsed[key] = _UNREAD
            elif not isinstance(items, (list, tuple)):
                problems.append(f"model_desc.{key}: expected a list, got {type(items).__name__}")
                parsed[key] = _UNREAD
            else:
                parsed[key] = [_from_item(x, f"model_desc.{key}[{i}]", key == "outputs", problems)
                               for i, x in enumerate(items)]
        result = ModelDescription(parsed["inputs"], parsed["outputs"])
    else:
        raise TypeError(f"model_desc: expected a ModelDescription or a dict, got {type(desc).__name__}")
    problems.extend(result._problems())
    if problems:
        raise ValueError(_report(problems))
    return result

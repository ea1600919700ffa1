"""Validation of states before they are loaded: every check that can fail, with no side effects.

``IncomingState`` holds a parsed state waiting to be applied; the functions here return the
problems they find (each naming its field) so the loader can report all of them at once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch

from . import checkpoint

INFO_KEYS = ("step", "optimization_step", "all_finite", "seed")
SHARED_OPTIMIZER_STATE = "shared_optimizer_state"  # Lamb's step count, shared by every weight
OPTIONS_KEYS = ("optimizer_name", "gradient_accumulation_steps", "frozen_weights", "input_dtypes")


def as_array(value: Any) -> Any:
    """A numpy view of a value from a state dict; a checkpoint's ``StoredArray`` stays as it is."""
    if isinstance(value, checkpoint.StoredArray):
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
    return np.asarray(value)


def storage_of(tensor: torch.Tensor) -> tuple:
    """A key equal for two ``state_dict`` tensors where one is a tied alias of the other (the same memory, shape and
    strides); an empty tensor's is its own."""
    if tensor.numel() == 0:
        return (id(tensor),)
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def dtype_family(dtype: np.dtype | torch.dtype) -> str:
    """The dtype family a value must share with what it replaces: float, int, bool or complex."""
    if isinstance(dtype, torch.dtype):
        return ("float" if dtype.is_floating_point else "complex" if dtype.is_complex
                else "bool" if dtype == torch.bool else "int")
    return {"f": "float", "i": "int", "u": "int", "b": "bool", "c": "complex"}.get(np.dtype(dtype).kind, str(dtype))


def as_count(value: Any, low: int = 0, high: int = 2 ** 63) -> int | None:
    """``value`` as an int when it is an integer (Python, numpy, or a 0-d integer array) in [low, high)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        value = value[()]
    if isinstance(value, (int, np.integer)) and low <= int(value) < high:
        return int(value)
    return None


def finite_number(value: Any) -> bool:
    """True for a finite real number (not a bool)."""
    return (not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))
            and math.isfinite(value))


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` left out, as torch's ``Module.load_state_dict`` returns it.

    Attributes:
        missing_keys: weights (and ``optimizer.<weight>`` states) the trainer has and the state lacks;
            they keep their current values.
        unexpected_keys: entries of the state the trainer has no place for; they were ignored.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class WeightSpec:
    """What one weight of the trainer accepts: shape, dtype family, and whether strict mode needs it."""

    shape: tuple
    kind: str
    required: bool = True


@dataclass
class IncomingState:
    """A parsed state waiting to be applied (values are arrays, or ``StoredArray``s not read yet)."""

    weights: dict[str, Any] = field(default_factory=dict)
    moments: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)  # Update_Count / Step leaves, checked once read
    accumulated: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    scaler: Any = None

    def read(self) -> None:
        """Replace the update counts' ``StoredArray``s by their data (after their names, shapes and
        dtypes were checked), for the checks that need values. Weights, moments and accumulated
        gradients stay ``StoredArray``s: they are read one at a time as they are written into the
        engine (``np.asarray`` reads one), never all held at once on top of it."""
        self.counts = {k: v.read() if isinstance(v, checkpoint.StoredArray) else v for k, v in self.counts.items()}


_SUMMARY_SHAPES = 5  # shape mismatches the summary of a long report quotes


def problems_report(problems: list[str], expected_weights: int) -> str:
    """The problems of a state that does not fit, led by a summary: the counts of each kind and the
    first shape mismatches (what tells another model's checkpoint from an older version of this
    one), then every problem, shape and dtype mismatches first.

    Args:
        problems: the messages of the checks in this module.
        expected_weights: how many weights the trainer has (the summary says how many are missing
            of them).
    """
    shapes = [p for p in problems if ": shape " in p or ": dtype " in p]
    missing = [p for p in problems if p.startswith("missing weight ")]
    unexpected = [p for p in problems if p.startswith("unexpected weight ")]
    others = [p for p in problems if p not in shapes and p not in missing and p not in unexpected]
    ordered = shapes + missing + unexpected + others
    if len(problems) <= 3:
        return "\n  ".join(ordered)
    counts = [f"{len(missing)} of the model's {expected_weights} weights missing" if missing else "",
              f"{len(unexpected)} unexpected weights" if unexpected else "",
              f"{len(shapes)} shape or dtype mismatches" if shapes else "",
              f"{len(others)} other problems" if others else ""]
    summary = f"{len(problems)} problems: " + ", ".join(c for c in counts if c)
    differing = len(missing) + len({p.split(":")[0] for p in shapes if p.startswith("weight ")})
    if differing > expected_weights // 2:
        summary += f" ({differing} of the {expected_weights} weights are missing or of another shape: a checkpoint " \
                   "of another model, or of another size of this one?)"
    lines = [summary]
    if shapes:
        lines.append("first mismatches: " + "; ".join(shapes[:_SUMMARY_SHAPES]))
    lines.append("all problems, mismatches first:")
    return "\n  ".join(lines + ["  " + p for p in ordered])


def shape_problems(where: str, value: Any, shape: tuple, kind: str) -> list[str]:
    """Problems of a value (array or ``StoredArray``) that must have ``shape`` and a ``kind`` dtype."""
    problems = []
    if tuple(value.shape) != tuple(shape):
        problems.append(f"{where}: shape {list(value.shape)} in the state, {list(shape)} in the model")
    if dtype_family(value.dtype) != kind:
        article = "an" if kind[0] in "aeiou" else "a"
        problems.append(f"{where}: dtype {value.dtype} in the state, {article} {kind} dtype in the model")
    return problems


def parse_train_step_info(info: Any, problems: list[str]) -> dict[str, Any]:
    """Validated ``train_step_info``: non-negative int counters (both or neither), a bool, an int seed.

    Problems are appended to ``problems``; the fields that passed are returned.
    """
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        problems.append(f"train_step_info: expected a dict, got {type(info).__name__}")
        return {}
    out: dict[str, Any] = {}
    problems += [f"train_step_info: unknown key {key!r}; expected {list(INFO_KEYS)}" for key in info
                 if key not in INFO_KEYS]
    counters = [key for key in ("step", "optimization_step") if key in info]
    if len(counters) == 1:
        problems.append(f"train_step_info: has {counters[0]!r} but not the other of 'step' and 'optimization_step'")
    for key in counters:
        value = as_count(info[key])
        if value is None:
            problems.append(f"train_step_info.{key}: expected a non-negative int, got {info[key]!r}")
        else:
            out[key] = value
    if "all_finite" in info:
        if isinstance(info["all_finite"], (bool, np.bool_)):
            out["all_finite"] = bool(info["all_finite"])
        else:
            problems.append(f"train_step_info.all_finite: expected a bool, got {info['all_finite']!r}")
    if info.get("seed") is not None:
        value = as_count(info["seed"], 0, 2 ** 64)
        if value is None:
            problems.append(f"train_step_info.seed: expected an int in [0, 2**64), got {info['seed']!r}")
        else:
            out["seed"] = value
    return out


def parse_trainer_options(record: Any, problems: list[str]) -> dict[str, Any]:
    """Validated ``trainer_options`` record of a state or checkpoint (problems appended to ``problems``)."""
    if record is None:
        return {}
    if not isinstance(record, Mapping):
        problems.append(f"trainer_options: expected a dict, got {type(record).__name__}")
        return {}
    out: dict[str, Any] = {}
    problems += [f"trainer_options: unknown key {key!r}; expected {list(OPTIONS_KEYS)}" for key in record
                 if key not in OPTIONS_KEYS]
    if "optimizer_name" in record:
        if isinstance(record["optimizer_name"], str):
            out["optimizer_name"] = record["optimizer_name"]
        else:
            problems.append(f"trainer_options.optimizer_name: expected a str, got {record['optimizer_name']!r}")
    if "gradient_accumulation_steps" in record:
        value = as_count(record["gradient_accumulation_steps"], 1)
        if value is None:
            problems.append("trainer_options.gradient_accumulation_steps: expected a positive int, got "
                            f"{record['gradient_accumulation_steps']!r}")
        else:
            out["gradient_accumulation_steps"] = value
    frozen = record.get("frozen_weights", [])
    if not isinstance(frozen, (list, tuple)) or not all(isinstance(w, str) for w in frozen):
        problems.append(f"trainer_options.frozen_weights: expected a list of names, got {frozen!r}")
    dtypes = record.get("input_dtypes")
    if dtypes is not None:
        if not isinstance(dtypes, Mapping):
            problems.append(f"trainer_options.input_dtypes: expected a dict, got {type(dtypes).__name__}")
        else:
            parsed = {}
            for name, value in dtypes.items():
                try:
                    dtype = np.dtype(value) if isinstance(value, str) else None
                except Exception:  # whatever numpy's dtype parser refuses
                    dtype = None
                if dtype is None or dtype.kind not in "biuf" or dtype.itemsize > 8:
                    problems.append(f"trainer_options.input_dtypes[{name!r}]: expected a numeric dtype name, "
                                    f"got {value!r}")
                else:
                    parsed[str(name)] = dtype
            if len(parsed) == len(dtypes):
                out["input_dtypes"] = parsed
    return out


def loss_scaler_problems(state: Any) -> list[str]:
    """What ``LossScaler.state_dict()`` returns: ``loss_scale`` > 0 and an optional ``stable_steps`` >= 0."""
    if not isinstance(state, Mapping):
        return [f"loss_scaler: expected a dict, got {type(state).__name__}"]
    problems = []
    if not finite_number(state.get("loss_scale")) or not state["loss_scale"] > 0:
        problems.append(f"loss_scaler.loss_scale: expected a positive finite number, got {state.get('loss_scale')!r}")
    if "stable_steps" in state and as_count(state["stable_steps"]) is None:
        problems.append(f"loss_scaler.stable_steps: expected a non-negative int, got {state['stable_steps']!r}")
    return problems


def lr_scheduler_problems(state: Any) -> list[str]:
    """What ``_LRScheduler.state_dict()`` returns: ``last_lr`` (a list of numbers) and ``base_lr``."""
    if not isinstance(state, Mapping):
        return [f"lr_scheduler: expected a dict, got {type(state).__name__}"]
    problems = [f"lr_scheduler: unknown key {key!r}; expected 'last_lr' and 'base_lr'" for key in state
                if key not in ("last_lr", "base_lr")]
    last = state.get("last_lr", [])
    if not isinstance(last, list) or not all(finite_number(v) for v in last):
        problems.append(f"lr_scheduler.last_lr: expected a list of finite numbers, got {last!r}")
    base = state.get("base_lr")
    if base is not None and not finite_number(base):
        problems.append(f"lr_scheduler.base_lr: expected a finite number or None, got {base!r}")
    return problems


def trial_load(obj: Any, state: Any, where: str) -> list[str]:
    """Load ``state`` into a copy of ``obj``, so that a state it refuses is found before anything changes.

    An object that cannot be copied is not tried (the explicit checks still apply to its state).
    """
    try:
        probe = copy.deepcopy(obj)
    except Exception:  # a user's scaler holding something uncopyable
        return []
    try:
        probe.load_state_dict(state)
    except Exception as exc:  # any refusal of the user's object is a problem of this state
        return [f"{where}: {type(obj).__name__}.load_state_dict refused the state: {exc}"]
    return []


def weight_problems(given: dict[str, Any], specs: dict[str, WeightSpec], strict: bool,
                    left_out: IncompatibleKeys) -> list[str]:
    """Problems of the weights ``given`` against ``specs``.

    Strict: missing and unexpected weights are problems. Not strict (torch's ``strict=False``): they
    go into ``left_out`` and the unexpected ones are dropped from ``given``. Shape and dtype
    mismatches are problems either way, as in torch.
    """
    unexpected = [name for name in given if name not in specs]
    missing = [name for name, spec in specs.items() if spec.required and name not in given]
    problems = []
    if strict:
        problems += [f"unexpected weight {name!r} (the model has no such weight)" for name in unexpected]
        problems += [f"missing weight {name!r}" for name in missing]
    else:
        for name in unexpected:
            del given[name]
        left_out.unexpected_keys.extend(unexpected)
        left_out.missing_keys.extend(missing)
    for name, spec in specs.items():
        if name in given:
            problems += shape_problems(f"weight {name!r}", given[name], spec.shape, spec.kind)
    return problems


def optimizer_problems(optimizer: Any, specs: dict[str, WeightSpec], strict: bool, incoming: IncomingState,
                       left_out: IncompatibleKeys, *, state_names: list[str], config_name: str, lamb: bool,
                       trained: list[str] | None) -> list[str]:
    """Validate a state's optimizer entries into ``incoming.moments`` / ``incoming.counts``.

    Args:
        optimizer: ``{weight: {state: value}}`` from the state (falsy: nothing to load).
        specs: the trainer's weights.
        strict: False leaves out (as ``optimizer.<weight>``) a state of a weight that is not
            trained, and one a trained weight lacks, instead of reporting them.
        incoming, left_out: filled in.
        state_names: the optimizer's per-weight states (``Moment_1``, ...).
        config_name: the optimizer's name, for messages.
        lamb: the optimizer is Lamb (the only one with a shared step).
        trained: the trained weights once the graph is built, else None.
    """
    if not optimizer:
        return []
    if not isinstance(optimizer, Mapping):
        return [f"optimizer: expected a dict of per-weight states, got {type(optimizer).__name__}"]
    shared = SHARED_OPTIMIZER_STATE
    problems = []
    for weight, entry in optimizer.items():
        if not isinstance(entry, Mapping):
            problems.append(f"optimizer state for {weight!r}: expected a dict, got {type(entry).__name__}")
            continue
        entry = {s: as_array(v) for s, v in entry.items()}
        if weight == shared:
            if not lamb or set(entry) != {"Step"}:
                problems.append(f"optimizer.{shared} holds {sorted(entry)}; only Lamb has one, with 'Step'")
            else:
                problems += shape_problems(f"optimizer.{shared}.Step", entry["Step"], (), "int")
                incoming.counts[f"{shared}.Step"] = entry["Step"]
            continue
        if weight not in specs or (trained is not None and weight not in trained):
            if strict:
                problems.append(f"optimizer state for {weight!r}, which is not a trained weight")
            else:
                left_out.unexpected_keys.append(f"optimizer.{weight}")
            continue
        missing = [s for s in state_names if s not in entry]
        extra = [s for s in entry if s not in state_names and s != "Update_Count"]
        if missing or extra:
            problems.append(f"optimizer state for {weight!r} has {sorted(entry)}; {config_name} "
                            f"needs {state_names + ['Update_Count']}")
            continue
        problems += [p for s in state_names for p in shape_problems(f"optimizer state {weight}.{s}", entry[s],
                                                                     specs[weight].shape, "float")]
        if "Update_Count" in entry:
            problems += shape_problems(f"optimizer state {weight}.Update_Count", entry["Update_Count"], (), "int")
            incoming.counts[f"{weight}.Update_Count"] = entry["Update_Count"]
        incoming.moments[weight] = {s: entry[s] for s in state_names}
    if trained is not None and state_names:
        missing = [w for w in trained if w not in optimizer]
        if strict:
            problems += [f"missing optimizer state for {w!r}" for w in missing]
        else:
            left_out.missing_keys.extend(f"optimizer.{w}" for w in missing)
    return problems


def accumulated_problems(accumulated: Any, recorded_window: int | None, window: int,
                         shapes: dict[str, tuple] | None, incoming: IncomingState) -> list[str]:
    """Gradients saved inside an accumulation window must fit this trainer's accumulation buffers.

    Args:
        accumulated: ``{weight: gradient}`` from the state (falsy: none).
        recorded_window: the state's ``gradient_accumulation_steps``.
        window: this trainer's.
        shapes: the trained weights' shapes once the graph is built, else None.
        incoming: filled in.
    """
    if not accumulated:
        return []
    if not isinstance(accumulated, Mapping):
        return [f"accumulated_gradients: expected a dict, got {type(accumulated).__name__}"]
    if shapes is None:
        return ["accumulated_gradients: the state was saved inside a gradient-accumulation window, but this "
                "trainer's graph is not built (its inputs' dtypes are unknown): run one eval_step first"]
    problems = []
    if window == 1 or (recorded_window is not None and recorded_window != window):
        problems.append(f"accumulated_gradients: the state was saved inside an accumulation window of "
                        f"{recorded_window} steps; this trainer accumulates over {window}: use "
                        f"batch.gradient_accumulation_steps={recorded_window}")
    for name, value in accumulated.items():
        value = as_array(value)
        if name not in shapes:
            problems.append(f"accumulated gradient for {name!r}, which is not a trained weight")
            continue
        problems += shape_problems(f"accumulated gradient {name!r}", value, shapes[name], "float")
        incoming.accumulated[name] = value
    return problems

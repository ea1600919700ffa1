"""``ORTTrainerOptions``: the trainer's settings, typed and validated.

Options are a nested dict with attribute access (``opts.batch.gradient_accumulation_steps``).
Every key is declared in ``_SCHEMA`` (this module; ``graph_optimizations.*`` in ``_graph_options.py``) with its
type, default, range and one line of documentation; an unknown key, a wrong type or an out-of-range value raises
one ``ValueError`` that lists every problem with the key's path.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

import onnxruntime as ort

from . import _runtime, devices
from ._graph_options import GRAPH_OPTIMIZATIONS
from ._option_checks import cross_field_problems
from ._option_fields import _ANY, _BOOL, _INT, _STR, _Field, _at_least, _in_range, _one_of
from .distributed import BACKENDS

_SENTINEL = object()


def _has_cuda() -> bool:
    """Whether ``device.id`` defaults to ``"cuda"``: the CUDA runtime, a CUDA build of torch and a GPU are here."""
    return devices.default_device_id() == "cuda"


def _check_device(value: str) -> str | None:
    """'cpu', 'cuda' or 'cuda:N', usable here: the CUDA runtime, a CUDA torch and that GPU (devices.py)."""
    return devices.device_problem(value)


def _check_str_list(value: list) -> str | None:
    bad = [v for v in value if not isinstance(v, str)]
    return f"expected a list of weight names (str), got items {bad!r}" if bad else None


def _check_callable(value: Any) -> str | None:
    return None if value is None or callable(value) else f"expected a callable or None, got {type(value).__name__}"


def _check_scheduler(value: Any) -> str | None:
    from .optim.lr_scheduler import _LRScheduler

    ok = value is None or isinstance(value, _LRScheduler)
    return None if ok else f"expected an ort_trainer.optim.lr_scheduler scheduler or None, got {type(value).__name__}"


def _check_loss_scaler(value: Any) -> str | None:
    from .amp.loss_scaler import LossScaler

    ok = value is None or isinstance(value, LossScaler)
    return None if ok else f"expected an ort_trainer.amp.LossScaler or None, got {type(value).__name__}"


# The full key set of api.md section 5 (with graph.gradient_source), plus ort_trainer's graph_optimizations.
_SCHEMA: dict[str, _Field] = {
    "batch.gradient_accumulation_steps": _Field(
        _INT, 1, "micro-batches whose gradients are summed before one optimizer update", _at_least(1)
    ),
    "device.id": _Field(
        _STR, _SENTINEL, "'cpu', 'cuda' or 'cuda:N'; default 'cuda' when onnxruntime-gpu, a CUDA build of torch "
        "and a GPU are all present, else 'cpu'",
        _check_device,
    ),
    "device.mem_limit": _Field(_INT, 0, "GPU arena limit in bytes (0: no limit)", _at_least(0)),
    "device.cuda_graph": _Field(
        _BOOL, False, "capture the training step's run as a CUDA graph and replay it (no kernel launches from the "
        "host): a GPU only, no dropout, gradients accumulated outside the graph, the labelled rows not sparse"),
    "device.torch_allocator": _Field(
        _BOOL, False, "a GPU's ONNX Runtime memory (the graph's activations) from torch's caching allocator, the pool "
        "of the trainer's weights, gradients and optimizer states, instead of an arena of ONNX Runtime's own: one "
        "pool for both (no CUDA graph, no device.mem_limit; built against torch on first use, seconds)"),
    "device.host_threads": _Field(
        _INT, 0, "torch threads for the work a training step does on the host between ONNX Runtime's runs (the "
        "fused optimizer update, the gradient norm, copies), restored after the step; 0: one thread for an update "
        "of at most 4 M weights (torch's OpenMP workers spin for milliseconds after their work, on the cores ONNX "
        "Runtime's next run computes on), torch's own count above; a run with torch's kernels in it (convolutions, "
        "LSTM layers) keeps torch's own count", _at_least(0)),
    "distributed.world_rank": _Field(_INT, 0, "this process's rank", _at_least(0)),
    "distributed.world_size": _Field(
        _INT, 1, "number of data-parallel processes", _at_least(1)
    ),
    "distributed.local_rank": _Field(_INT, 0, "this process's rank on its node", _at_least(0)),
    "distributed.allreduce_post_accumulation": _Field(
        _BOOL, False, "all-reduce once per optimizer step instead of per micro-batch"
    ),
    "distributed.deepspeed_zero_optimization.stage": _Field(
        _INT, 0, "ZeRO stage: 0 off, 1 optimizer state sharded across ranks", _one_of(0, 1)
    ),
    "distributed.backend": _Field(
        _STR, "auto", "what moves the gradients between ranks: 'mpi' (mpi4py, host buffers), 'gloo' "
        "(torch.distributed, host buffers, or CUDA buffers through host copies: ranks sharing a GPU), 'nccl' "
        "(torch.distributed, CUDA buffers), 'auto' ('nccl' on CUDA, else 'mpi' under mpirun and 'gloo' under torchrun)", _one_of(*BACKENDS)
    ),
    "lr_scheduler": _Field(
        _ANY, None, "a learning-rate scheduler from ort_trainer.optim.lr_scheduler, or None", _check_scheduler
    ),
    "mixed_precision.enabled": _Field(
        _BOOL, False, "half-precision compute (torch.autocast semantics), fp32 master weights, optimizer states "
        "and loss; needs the 'torch' gradient source"
    ),
    "mixed_precision.dtype": _Field(
        _STR, "float16", "the half-precision dtype with enabled=True: 'float16' (a DynamicLossScaler by default) "
        "or 'bfloat16' (no loss scaler needed)", _one_of("float16", "bfloat16")
    ),
    "mixed_precision.loss_scaler": _Field(
        _ANY, None, "an ort_trainer.amp.LossScaler, or None (with enabled=True and dtype float16: a "
        "DynamicLossScaler(); works in fp32 too)", _check_loss_scaler
    ),
    "utils.frozen_weights": _Field((list, tuple), (), "weight names that are never updated", _check_str_list),
    "utils.grad_norm_clip": _Field(_BOOL, True, "clip the global gradient L2 norm (Adam and Lamb)"),
    "debug.deterministic_compute": _Field(_BOOL, False, "ask ONNX Runtime for deterministic kernels"),
    "debug.check_model_export": _Field(
        _BOOL, False, "compare PyTorch and ONNX Runtime outputs before the first step"
    ),
    "debug.graph_save_paths.model_after_graph_transforms_path": _Field(
        _STR, "", "write the forward graph after the trainability pass and the user hook here"
    ),
    "debug.graph_save_paths.model_with_gradient_graph_path": _Field(
        _STR, "", "write the forward + backward graph here"
    ),
    "debug.graph_save_paths.model_with_training_graph_path": _Field(
        _STR, "", "write the optimizer graph (the step after the gradient graph) here"
    ),
    "_internal_use.extra_postprocess": _Field(
        _ANY, None, "callable(onnx.ModelProto) run on the exported forward graph after the trainability pass",
        _check_callable,
    ),
    "_internal_use.onnx_opset_version": _Field(_INT, 17, "ONNX opset of the export", _in_range(14, 20)),
    **GRAPH_OPTIMIZATIONS,
    "graph.gradient_source": _Field(
        _STR, "auto", "where the backward graph comes from: 'torch' (PyTorch's autograd exported to standard "
        "ONNX, any runtime), 'onnxruntime' (ONNX Runtime's gradient builder, training build 1.19.2 only), "
        "'auto' (the gradient builder when the training build is installed, else torch)",
        _runtime.gradient_source_problem,
    ),
    "graph.optimizer": _Field(
        _STR, "fused", "the optimizer update: 'fused' (torch's fused kernels, one in-place pass per parameter "
        "segment, weights and states held once; for SGD and Adam in mode BEFORE_WEIGHT_UPDATE with bias "
        "correction, the ONNX optimizer graph for the rest) or 'graph' (always the ONNX optimizer graph, "
        "double-buffered)", _one_of("fused", "graph")
    ),
    "session_options": _Field(
        _ANY, None, "an onnxruntime.SessionOptions for the trainer's sessions, or None",
        lambda v: None if v is None or isinstance(v, ort.SessionOptions)
        else f"expected an onnxruntime.SessionOptions or None, got {type(v).__name__}",
    ),
    "provider_options": _Field((dict,), {}, "options passed to the execution provider"),
}


class _Group(dict):
    """A dict whose keys are also attributes; nested groups are ``_Group`` too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no option {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("options are read-only once validated; build a new ORTTrainerOptions instead")


def _flatten(mapping: Mapping, prefix: str, out: dict, problems: list) -> None:
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            problems.append(f"{path}: option keys must be str, got {type(key).__name__} {key!r}")
        elif path in _SCHEMA:
            out[path] = value
        elif any(p.startswith(path + ".") for p in _SCHEMA):
            if isinstance(value, Mapping):
                _flatten(value, path + ".", out, problems)
            else:
                inner = sorted({p[len(path) + 1:].split(".")[0] for p in _SCHEMA if p.startswith(path + ".")})
                problems.append(f"{path}: expected a group of options (a dict with keys {inner}), "
                                f"got {type(value).__name__} {value!r}")
        else:
            known = sorted({p[len(prefix):].split(".")[0] for p in _SCHEMA if p.startswith(prefix)})
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {prefix + guess[0]!r}?" if guess else ""
            problems.append(f"{path}: unknown option; known keys here: {known}{hint}")


def _type_problem(path: str, field: _Field, value: Any) -> str | None:
    types = field.types
    if types == _ANY:
        return None
    if bool not in types and isinstance(value, bool):
        return f"{path}: expected {'/'.join(t.__name__ for t in types)}, got bool {value!r}"
    if list in types and isinstance(value, str):
        return f"{path}: expected a list, got the str {value!r}; write [{value!r}]"
    if not isinstance(value, types):
        return f"{path}: expected {'/'.join(t.__name__ for t in types)}, got {type(value).__name__} {value!r}"
    return None


class ORTTrainerOptions(_Group):
    """Settings of an ``ORTTrainer`` (api.md section 5).

    Build it from a nested dict; keys left out take their defaults:

        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 1}, "device": {"id": "cpu"}})

    Keys, defaults and meanings are listed by ``ORTTrainerOptions.describe()``.

    Raises:
        ValueError: listing every unknown key, wrong type, out-of-range value, and every value
            whose feature this version does not support yet, each with the key's path.
    """

    def __init__(self, options: Mapping[str, Any] | None = None):
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options: expected a dict or ORTTrainerOptions, got {type(options).__name__}")
        given: dict[str, Any] = {}
        problems: list[str] = []
        _flatten(options, "", given, problems)
        values: dict[str, Any] = {}
        for path, field in _SCHEMA.items():
            value = given.get(path, _SENTINEL)
            if value is _SENTINEL:
                value = field.default
                if value is _SENTINEL:  # device.id
                    value = "cuda" if _has_cuda() else "cpu"
                values[path] = list(value) if isinstance(value, tuple) else (
                    dict(value) if isinstance(value, dict) else value
                )
                continue
            problem = _type_problem(path, field, value)
            if problem is None and field.check is not None:
                detail = field.check(value)
                problem = f"{path}: {detail}" if detail else None
            if problem:
                problems.append(problem)
            values[path] = list(value) if isinstance(value, tuple) else value
        problems.extend(cross_field_problems(values, problems))
        if problems:
            raise ValueError("invalid ORTTrainerOptions:\n  " + "\n  ".join(problems))
        _mixed_precision_defaults(values)
        nested: dict[str, Any] = {}
        for path, value in values.items():
            node = nested
            *parents, leaf = path.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        dict.update(self, _to_groups(nested))

    def flat(self) -> dict[str, Any]:
        """The options as ``{dotted.path: value}``."""
        out: dict[str, Any] = {}

        def walk(node: Mapping, prefix: str) -> None:
            for key, value in node.items():
                if isinstance(value, _Group):
                    walk(value, f"{prefix}{key}.")
                else:
                    out[f"{prefix}{key}"] = value

        walk(self, "")
        return out

    @staticmethod
    def describe() -> str:
        """One line per option: path, default, meaning."""
        lines = []
        for path, field in _SCHEMA.items():
            default = "(auto)" if field.default is _SENTINEL else repr(field.default)
            lines.append(f"{path} = {default}: {field.doc}")
        return "\n".join(lines)


def _mixed_precision_defaults(values: dict[str, Any]) -> None:
    """float16 with no scaler gets a ``DynamicLossScaler()`` (api.md section 5), set in the options
    so that the trainer, its checkpoints and the user all see the one object."""
    if values["mixed_precision.enabled"] is True and values["mixed_precision.dtype"] == "float16" \
            and values["mixed_precision.loss_scaler"] is None:
        from .amp.loss_scaler import DynamicLossScaler

        values["mixed_precision.loss_scaler"] = DynamicLossScaler()


def _to_groups(node: dict) -> _Group:
    group = _Group()
    for key, value in node.items():
        # provider_options is a user dict value, not an option group
        dict.__setitem__(group, key, _to_groups(value) if isinstance(value, dict) and key != "provider_options" else value)
    return group

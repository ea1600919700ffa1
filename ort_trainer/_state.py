"""The trainer's state: state dicts, checkpoints and the torch model round trip.

A mixin of ``ORTTrainer``: everything here reads or writes weights, optimizer moments, step counters, the scheduler
and loss-scaler state. Loading is all-or-nothing: the whole state is parsed and validated first (names, shapes,
dtypes, counter types, scheduler and scaler states), a checkpoint's array data is read only after its names, shapes
and dtypes passed, and nothing is changed unless every part fits.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch
from onnx import numpy_helper

from . import checkpoint
from ._logging import logger
from ._state_checks import (IncomingState, IncompatibleKeys, SHARED_OPTIMIZER_STATE, WeightSpec, accumulated_problems,
                            as_array, as_count, dtype_family, loss_scaler_problems, lr_scheduler_problems,
                            optimizer_problems, parse_train_step_info, parse_trainer_options, problems_report,
                            storage_of, trial_load, weight_problems)
from .graph.optimizer import state_names
from .optim.config import LambConfig

_COUNTER_SUFFIX = "num_batches_tracked"
_SHARED = SHARED_OPTIMIZER_STATE
_ACCUMULATED = "accumulated_gradients"
_NESTED_KEYS = ("model", "optimizer", "trainer_options", "train_step_info", _ACCUMULATED)


def _is_nested(state: Mapping) -> bool:
    return isinstance(state.get("model"), Mapping) and "full_precision" in state["model"]


class _StateMixin:
    """State dicts, checkpoints and ``update_torch_model`` for ``ORTTrainer``."""

    # ---- reading --------------------------------------------------------------------------------
    def _counter_values(self) -> dict[str, int]:
        """BatchNorm ``num_batches_tracked``: its value at build time plus one per ``train_step``."""
        return {k: base + self._train_step_info.step for k, base in self._counter_base.items()}

    def _weights_by_torch_key(self) -> dict[str, np.ndarray]:
        values = self._require_built("reading weights").weights()
        out = {}
        for weight, keys in self._graphs.meta["torch_keys"].items():
            if weight in values:
                for key in keys:
                    out[key] = values[weight]
        return out

    def _current_weights(self, copy: bool = True) -> dict[str, np.ndarray]:
        """Every weight by its nested-state name (built: the graph's weights; else the model's)."""
        if self._engine is not None:
            return self._engine.weights(copy)
        if isinstance(self.model, torch.nn.Module):
            return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        return {i.name: numpy_helper.to_array(i).copy() for i in self.model.graph.initializer}

    def state_dict(self, pytorch_format: bool = False) -> dict:
        """The trainer's state.

        Args:
            pytorch_format: False: the nested numpy dict of api.md section 2
                (``model.full_precision``, ``optimizer``, ``trainer_options``, ``train_step_info``
                with ``step``, ``optimization_step`` and the dropout ``seed``), and, taken inside a
                gradient-accumulation window, ``accumulated_gradients``: the gradients summed so
                far in the window, so that loading it resumes the window exactly.
                True: ``{torch state_dict key: torch.Tensor}`` that the model's
                ``load_state_dict`` accepts (BatchNorm buffers and counters included), on the CPU
                whatever the device the trainer or the module is on.

        Returns:
            The state; it works before the first step (the initial weights, no optimizer state
            yet). Under mpirun with ZeRO stage 1 it gathers every rank's moments, so every rank
            must call it.
        """
        if pytorch_format:
            if not isinstance(self.model, torch.nn.Module):
                return {k: torch.from_numpy(v) for k, v in self._current_weights().items()}
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            if self._engine is not None:
                state.update({k: torch.from_numpy(v) for k, v in self._weights_by_torch_key().items()})
                state.update({k: torch.tensor(v, dtype=state[k].dtype) for k, v in self._counter_values().items()})
            return state
        return self._nested_state()

    def _nested_state(self, copy: bool = True) -> dict:
        """``state_dict()``; ``copy=False`` gives views of the engine's host buffers instead of
        copies where it can (valid until the next step: a checkpoint writes them at once)."""
        info = self._train_step_info
        moments = {}
        if self._engine is not None:
            # under ZeRO each rank holds its range of the states: gather them
            moments = (self._gather_zero_states() if self._zero_counts is not None
                       else self._engine.optimizer_states(copy=copy))
        elif self._pending_optimizer:
            moments = self._pending_optimizer
        optimizer = {}
        for name, states in moments.items():
            optimizer[name] = {**states, "Update_Count": np.array(info.optimization_step, dtype=np.int64)}
        if isinstance(self.optim_config, LambConfig):
            optimizer[_SHARED] = {"Step": np.array(info.optimization_step, dtype=np.int64)}
        step_info = {"step": info.step, "optimization_step": info.optimization_step}
        if getattr(self, "_seed", None) is not None:
            step_info["seed"] = int(self._seed)
        state = {
            "model": {"full_precision": self._current_weights(copy)},
            "optimizer": optimizer,
            "trainer_options": self._trainer_options_record(),
            "train_step_info": step_info,
        }
        if self._engine is not None and info.step % self.options.batch.gradient_accumulation_steps:
            state[_ACCUMULATED] = self._engine.accumulated_values()
        return state

    def _trainer_options_record(self) -> dict:
        """What a checkpoint records about the job, to rebuild the graph and check compatibility."""
        dtypes = dict(self._graphs.meta["inputs"]) if self._graphs is not None else {
            d.name: str(d.numpy_dtype) for d in self.model_desc.inputs if d.dtype is not None}
        return {
            "optimizer_name": self.optim_config.name,
            "gradient_accumulation_steps": self.options.batch.gradient_accumulation_steps,
            "frozen_weights": list(self.options.utils.frozen_weights),
            "input_dtypes": dtypes,
        }

    def _gather_zero_states(self) -> dict[str, dict[str, np.ndarray]]:
        """Every weight's optimizer state, assembled from each rank's ZeRO range (collective)."""
        engine, full = self._engine, {}
        for state, local in engine.state_arrays().items():
            whole = torch.zeros(sum(self._zero_counts), dtype=torch.float32, device=engine.device)
            whole[engine.begin:engine.end] = torch.from_numpy(local)
            self._comm.allgather(whole, self._zero_counts)
            full[state] = whole.cpu().numpy()
        return engine.optimizer_states(full)

    # ---- what a state must look like --------------------------------------------------------------
    def _weight_count(self) -> int:
        """How many weights a full state of this trainer holds (a report's summary counts against it)."""
        return sum(spec.required for spec in self._weight_specs(pytorch_format=False).values())

    def _weight_specs(self, pytorch_format: bool) -> dict[str, WeightSpec]:
        """Every weight name a state may hold, with its shape, dtype family and whether it is required.

        Nested names are the graph's weights (once built) or the model's own names; a torch module's
        other state (tied aliases, BatchNorm counters, parameters the graph does not use) is accepted
        under its torch key too, so a state taken before the first step loads after it, and the other
        way. With ``pytorch_format`` every torch ``state_dict`` key is required."""
        if isinstance(self.model, torch.nn.Module) and (pytorch_format or self._engine is None):
            first: dict[tuple, str] = {}  # (a nested state names a tied weight once, as the graph: aliases optional)
            return {k: WeightSpec(tuple(v.shape), dtype_family(v.dtype), pytorch_format or (
                        not k.endswith(_COUNTER_SUFFIX) and first.setdefault(storage_of(v), k) == k))
                    for k, v in self.model.state_dict().items()}
        if self._engine is None:
            return {i.name: WeightSpec(tuple(i.dims), dtype_family(numpy_helper.to_array(i).dtype))
                    for i in self.model.graph.initializer}
        specs = {n: WeightSpec(tuple(info[0]), dtype_family(info[1])) for n, info in self._graphs.meta["weights"].items()}
        if isinstance(self.model, torch.nn.Module):
            for key, value in self.model.state_dict().items():
                specs.setdefault(key, WeightSpec(tuple(value.shape), dtype_family(value.dtype), required=False))
        return specs

    def _parse_nested(self, state: Mapping, strict: bool, problems: list[str], left_out: IncompatibleKeys,
                      recorded_window: int | None = None) -> IncomingState:
        """Validate a nested state (values may be unread ``StoredArray``s) into an ``IncomingState``.

        Its ``trainer_options`` were parsed by the caller (``_recorded_options``)."""
        incoming = IncomingState()
        weights = state["model"]["full_precision"]
        if not isinstance(weights, Mapping):
            problems.append(f"model.full_precision: expected a dict, got {type(weights).__name__}")
            weights = {}
        incoming.weights = {k: as_array(v) for k, v in weights.items()}
        specs = self._weight_specs(pytorch_format=False)
        config, graphs, engine = self.optim_config, self._graphs, self._engine
        problems += weight_problems(incoming.weights, specs, strict, left_out)
        problems += optimizer_problems(state.get("optimizer"), specs, strict, incoming, left_out,
                                       state_names=state_names(config), config_name=config.name,
                                       lamb=isinstance(config, LambConfig),
                                       trained=graphs.meta["trained"] if graphs is not None else None)
        problems += accumulated_problems(state.get(_ACCUMULATED), recorded_window,
                                         self.options.batch.gradient_accumulation_steps,
                                         engine.shapes if engine is not None else None, incoming)
        incoming.info = parse_train_step_info(state.get("train_step_info"), problems)
        return incoming

    def _recorded_options(self, state: Mapping, problems: list[str], build: bool) -> dict[str, Any]:
        """The state's ``trainer_options``, parsed; with ``build``, an unbuilt trainer builds its
        graph first from the input dtypes they record (when they record every input's)."""
        recorded = parse_trainer_options(state.get("trainer_options"), problems)
        dtypes = recorded.get("input_dtypes")
        if build and self._engine is None and dtypes and all(d.name in dtypes for d in self.model_desc.inputs):
            self._build(self._shapes.synthetic_inputs(dtypes))
        return recorded

    def _check_values(self, incoming: IncomingState) -> list[str]:
        """Checks that need the data: the saved update counts are non-negative integers."""
        return [f"optimizer state {name}: expected a non-negative count, got {np.asarray(value).tolist()!r}"
                for name, value in incoming.counts.items() if as_count(value) is None]

    # ---- loading --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> IncompatibleKeys:
        """Restore weights, optimizer state and step counters from either ``state_dict`` format.

        All or nothing: every part is validated first, and nothing changes unless all of it fits.
        A nested state taken inside a gradient-accumulation window carries the gradients
        accumulated so far; loading it resumes the window exactly (it builds the graph first if
        needed, from the input dtypes the state records).

        Args:
            state_dict: the nested dict of ``state_dict()`` or a flat torch ``state_dict``
                (which carries no optimizer state: the optimizer state is left as it is).
            strict: as torch's ``Module.load_state_dict``: True makes missing and unexpected
                entries errors; False loads what fits, ignores the unexpected entries and
                returns both lists. Shape and dtype mismatches are errors either way.

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)`` (both empty when strict): weight
            names (torch keys for a flat state), ``optimizer.<weight>`` for optimizer states,
            and top-level keys of a nested state.

        Raises:
            ValueError: listing every missing and unexpected weight (strict), shape or dtype
                mismatch and malformed counter; nothing is changed.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        problems: list[str] = []
        left_out = IncompatibleKeys([], [])
        if _is_nested(state_dict):
            unknown = [k for k in state_dict if k not in _NESTED_KEYS]
            if strict:
                problems += [f"unexpected key {k!r} in the nested state (it has {', '.join(_NESTED_KEYS)})"
                             for k in unknown]
            else:
                left_out.unexpected_keys.extend(unknown)
            # gradients accumulated in a window go to the engine's buffers: build it for them
            recorded = self._recorded_options(state_dict, problems, build=bool(state_dict.get(_ACCUMULATED)))
            incoming = self._parse_nested(state_dict, strict, problems, left_out,
                                          recorded.get("gradient_accumulation_steps"))
        else:
            incoming = IncomingState(weights={k: as_array(v) for k, v in state_dict.items()})
            problems += weight_problems(incoming.weights, self._weight_specs(pytorch_format=True), strict, left_out)
        if not problems:
            problems += self._check_values(incoming)
        if problems:
            raise ValueError("load_state_dict: the state does not fit this trainer; nothing was changed:\n  "
                             + problems_report(problems, self._weight_count()))
        self._apply(incoming)
        return left_out

    def _apply(self, incoming: IncomingState) -> None:
        """Write a validated state (no check can fail from here on)."""
        self._apply_schedules(incoming)
        info = self._train_step_info
        if "step" in incoming.info:  # first: the BatchNorm counters are stored relative to it
            info.step = incoming.info["step"]
            info.optimization_step = incoming.info["optimization_step"]
        self._apply_weights(incoming.weights)
        if any(incoming.moments.values()):
            moments = {w: entry for w, entry in incoming.moments.items() if entry}
            if self._engine is not None:
                self._engine.load_optimizer_states(moments)  # reads them one at a time
            else:
                self._pending_optimizer = {w: {s: np.asarray(v, np.float32) for s, v in entry.items()}
                                           for w, entry in moments.items()}
        if incoming.accumulated:
            self._engine.load_accumulated(incoming.accumulated)
        if "seed" in incoming.info:
            self._seed = incoming.info["seed"]
        if "all_finite" in incoming.info:
            info.all_finite = incoming.info["all_finite"]

    def _apply_schedules(self, incoming: IncomingState) -> None:
        """Load the scheduler and loss-scaler states first: they run the user's objects' code, so
        if one still refuses its (already trial-loaded) state, everything is put back."""
        targets = [(self.options.lr_scheduler, incoming.scheduler),
                   (self.options.mixed_precision.loss_scaler, incoming.scaler)]
        targets = [(target, state) for target, state in targets if state is not None]
        previous = [target.state_dict() for target, _ in targets]
        try:
            for target, state in targets:
                target.load_state_dict(state)
        except Exception:
            for (target, _), state in zip(targets, previous):
                target.load_state_dict(state)
            raise

    def _apply_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Write validated weights: into the engine once built, else into the model itself.

        Names are graph weights or torch ``state_dict`` keys: a key of a graph weight (an alias of
        a tied weight too) goes to the engine, a BatchNorm counter to its base, anything else of
        a torch module (parameters the graph does not use) into the module.
        """
        if self._engine is not None:
            by_key = {key: weight for weight, keys in self._graphs.meta["torch_keys"].items() for key in keys}
            by_key.update({w: w for w in self._graphs.meta["weights"]})
            engine_values, module_values = {}, {}
            for key, value in weights.items():
                if key in self._counter_base:
                    self._counter_base[key] = int(np.asarray(value)) - self._train_step_info.step
                elif key in by_key and by_key[key] in self._graphs.meta["weights"]:
                    # the graph weight's own name wins over an alias of it
                    if key == by_key[key] or by_key[key] not in engine_values:
                        engine_values[by_key[key]] = value
                else:
                    module_values[key] = value
            self._engine.load_weights(engine_values)
            if self._tensor_watch is not None:  # loaded after the script changed a tensor: the loaded value wins
                self._tensor_watch.rebase(synced=False)
            weights = module_values
            if not weights:
                return
        if isinstance(self.model, torch.nn.Module):
            module_state = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for key, value in weights.items():
                    module_state[key].copy_(torch.from_numpy(np.asarray(value)))
            return
        for init in self.model.graph.initializer:
            if init.name in weights:
                init.CopyFrom(numpy_helper.from_array(np.asarray(weights[init.name], dtype=numpy_helper.to_array(init).dtype),
                                                      init.name))

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, user_dict: Any = None,
                        include_optimizer_states: bool = True, allow_pickle: bool = False) -> None:
        """Save the whole training state to one new HDF5 file at ``path``.

        Holds weights, optimizer moments and step counts (unless ``include_optimizer_states`` is
        False), the train-step info (with the dropout seed), the options that shape the graph,
        the LR scheduler and loss-scaler state, gradients accumulated so far inside an
        accumulation window, and ``user_dict``. Written to a temporary file, then linked into
        place: a crash never leaves a partial file under ``path``, and temporaries that earlier
        interrupted saves left in the directory are removed. Under mpirun every rank calls it;
        rank 0 writes.

        Args:
            path: the new file.
            user_dict: your own data, as plain data: dicts with str keys, lists, str, int, float,
                bool, None, numpy arrays and numpy scalars (tuples come back as lists).
            include_optimizer_states: False saves no optimizer state (loading such a file keeps
                the optimizer state the trainer has).
            allow_pickle: pickle a ``user_dict`` that is not plain data instead of refusing it;
                loading it then needs ``load_checkpoint(..., allow_pickle=True)``.

        Raises:
            FileExistsError: ``path`` exists; it is never overwritten.
            FileNotFoundError: the directory does not exist.
            TypeError: ``user_dict`` is not plain data (every offending entry named) and
                ``allow_pickle`` is False.
            OSError: the write failed (a full disk): the message names the file; nothing is left
                under ``path``.
            KeyboardInterrupt: Ctrl-C during the save: no file is written, or the file is whole
                when the signal came after its last array.
        """
        path = os.fspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"save_checkpoint: {path!r} already exists; choose a new path or delete it first")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise FileNotFoundError(f"save_checkpoint: directory {os.path.dirname(os.path.abspath(path))!r} does not exist")
        checkpoint.encode_user_dict(user_dict, allow_pickle)  # on every rank, before any collective
        state = self._nested_state(copy=False)  # written array by array: no copy of every weight and moment
        if not include_optimizer_states:
            state["optimizer"] = {}
        content = {
            "model": state["model"],
            "optimizer": state["optimizer"],
            "train_step_info": {**state["train_step_info"], "all_finite": bool(self._train_step_info.all_finite)},
            "trainer_options": state["trainer_options"],
            "lr_scheduler": self.options.lr_scheduler.state_dict() if self.options.lr_scheduler else None,
            "loss_scaler": (self.options.mixed_precision.loss_scaler.state_dict()
                            if self.options.mixed_precision.loss_scaler else None),
            "user_dict": user_dict,
        }
        if _ACCUMULATED in state:
            content[_ACCUMULATED] = state[_ACCUMULATED]
        if self._comm is None or self._comm.rank == 0:
            checkpoint.write(path, content, allow_pickle=allow_pickle)

    def load_checkpoint(self, *paths: str | os.PathLike, strict: bool = True, allow_pickle: bool = False) -> Any:
        """Restore everything ``save_checkpoint`` saved; returns its ``user_dict``.

        Several paths are merged in order (later files override earlier ones). A checkpoint saved
        without optimizer state leaves the optimizer state as it is. Builds the training graph
        first when needed, from the input dtypes the checkpoint records.

        Loading never runs code from the file (unless ``allow_pickle``) and never reads outside
        it; every dataset's name, shape and dtype is checked against this trainer before any data
        is read, and the whole state is validated before anything changes.

        Args:
            *paths: checkpoint files.
            strict: missing and unexpected weights and optimizer states are errors; False loads
                what fits and logs a warning naming what was left out (as ``load_state_dict``).
            allow_pickle: unpickle a pickled ``user_dict`` (saved with ``allow_pickle=True``, or by
                ort_trainer before format version 2). Unpickling runs code chosen by whoever wrote
                the file: only for files you trust. Without it such a user dict is returned as
                None, with a warning, and everything else is loaded.

        Returns:
            The last file's ``user_dict``.

        Raises:
            CheckpointError (a ``ValueError``): a file is missing (or a directory), truncated,
                corrupted or unsafe, or its state does not fit this trainer; every problem is named,
                after a summary when there are many, and nothing is changed.
        """
        if not paths:
            raise TypeError("load_checkpoint needs at least one path")
        files = [checkpoint.open_checkpoint(p) for p in paths]
        merged: dict[str, Any] = {"model": {"full_precision": {}}, "optimizer": {}, _ACCUMULATED: {}}
        for file in files:
            merged["model"]["full_precision"].update(file.arrays["model"].get("full_precision", {}))
            merged["optimizer"].update(file.arrays["optimizer"])
            merged[_ACCUMULATED].update(file.arrays[_ACCUMULATED])
            merged.update(file.metadata)
        problems: list[str] = []
        left_out = IncompatibleKeys([], [])
        recorded = self._recorded_options(merged, problems, build=True)
        if merged["optimizer"] and recorded.get("optimizer_name") not in (None, self.optim_config.name):
            problems.append(
                f"the checkpoint's optimizer state is for {recorded['optimizer_name']}, this trainer uses "
                f"{self.optim_config.name}; use the same optimizer config, or save the checkpoint with "
                "include_optimizer_states=False")
        incoming = self._parse_nested(merged, strict, problems, left_out, recorded.get("gradient_accumulation_steps"))
        incoming.info.setdefault("all_finite", True)
        for key, target in (("lr_scheduler", self.options.lr_scheduler),
                            ("loss_scaler", self.options.mixed_precision.loss_scaler)):
            value = merged[key]
            if value is None:
                continue
            problems += loss_scaler_problems(value) if key == "loss_scaler" else lr_scheduler_problems(value)
            if target is not None:
                problems += trial_load(target, value, key)
                setattr(incoming, "scheduler" if key == "lr_scheduler" else "scaler", value)
        where = ", ".join(repr(str(p)) for p in paths)
        if not problems:
            incoming.read()
            problems += self._check_values(incoming)
        if problems:
            raise checkpoint.CheckpointError(f"load_checkpoint: {where} does not fit this trainer; nothing was "
                                             "changed:\n  " + problems_report(problems, self._weight_count()))
        user = files[-1].user_dict(allow_pickle)
        self._apply(incoming)
        if left_out.missing_keys or left_out.unexpected_keys:
            logger.warning("load_checkpoint(strict=False) from %s: missing (kept as they were): %s; unexpected "
                           "(ignored): %s", where, left_out.missing_keys, left_out.unexpected_keys)
        return user

    # ---- torch round trip -----------------------------------------------------------------------
    def update_torch_model(self) -> None:
        """Copy the trained weights and buffers (BatchNorm statistics too) back into the ``torch.nn.Module``; raises
        ``TypeError`` when the trainer was given an ONNX model."""
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError("update_torch_model: the trainer was given an ONNX model, not a torch.nn.Module")
        if self._engine is None:
            return  # nothing trained yet: the module already holds the weights
        state = self.model.state_dict(keep_vars=True)
        current = self._engine.current_tensors()
        with torch.no_grad():
            for weight, keys in self._graphs.meta["torch_keys"].items():
                for key in keys if weight in current else ():
                    if state[key].data_ptr() != current[weight].data_ptr():  # else shared: current already
                        state[key].copy_(current[weight])
            for key, value in self._counter_values().items():
                state[key].fill_(value)
        if self._tensor_watch is not None:  # the module's tensors now hold the engine's values
            self._tensor_watch.rebase(synced=True)

    def _share_module_memory(self, live: dict[str, torch.Tensor]) -> None:
        """Make the module's parameters and buffers views of the engine's buffers ``live``
        (``Engine.live_buffers``; the engine calls this as it is made) where they can be.

        The engine holds every weight in its own buffers; a module that kept its own tensors too would hold all
        weights twice (472 MB for GPT-2 small). Where a weight's buffer lives from step to step
        (``Engine.live_buffers``: not double-buffered) and matches the module's tensor in device, dtype and shape,
        the module's tensor becomes that buffer (``tensor.data``), so the module's old memory is freed and the
        module always holds the trained values, as with a ``torch.optim`` optimizer. Other tensors keep their own
        memory and are written by ``update_torch_model``.
        """
        if not isinstance(self.model, torch.nn.Module):
            return
        state = self.model.state_dict(keep_vars=True)
        shared = 0
        with torch.no_grad():
            for weight, keys in self._graphs.meta["torch_keys"].items():
                buffer = live.get(weight)
                for key in keys if buffer is not None else ():
                    tensor = state.get(key)
                    if (tensor is not None and tensor.is_floating_point() and tensor.device == buffer.device
                            and tensor.dtype == buffer.dtype and tensor.shape == buffer.shape):
                        tensor.data = buffer
                        shared += 1
        logger.debug("the module shares %d of its %d tensors with the engine", shared, len(state))

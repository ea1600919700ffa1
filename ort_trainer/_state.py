"""The trainer's state: state dicts, checkpoints and the torch model round trip.

A mixin of ``ORTTrainer``: everything here reads or writes weights, optimizer moments, step
counters, the scheduler and loss-scaler state. Loading is all-or-nothing: the whole state is
parsed and validated first (names, shapes, dtypes, counter types, scheduler and scaler states),
a checkpoint's array data is read only after its names, shapes and dtypes passed, and nothing is
changed unless every part fits.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch
from onnx import numpy_helper

from . import checkpoint
from ._state_checks import (IncomingState, WeightSpec, as_array, as_count, dtype_family, loss_scaler_problems,
                            lr_scheduler_problems, parse_trainer_options, parse_train_step_info, shape_problems,
                            trial_load)
from .optim.config import LambConfig

_COUNTER_SUFFIX = "num_batches_tracked"
_SHARED = "shared_optimizer_state"


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

    def _current_weights(self) -> dict[str, np.ndarray]:
        """Every weight by its nested-state name (built: the graph's weights; else the model's)."""
        if self._engine is not None:
            return self._engine.weights()
        if isinstance(self.model, torch.nn.Module):
            return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        return {i.name: numpy_helper.to_array(i).copy() for i in self.model.graph.initializer}

    def state_dict(self, pytorch_format: bool = False) -> dict:
        """The trainer's state.

        Args:
            pytorch_format: False: the nested numpy dict of api.md section 2
                (``model.full_precision``, ``optimizer``, ``trainer_options``, ``train_step_info``
                with ``step``, ``optimization_step`` and the dropout ``seed``).
                True: ``{torch state_dict key: torch.Tensor}`` that the model's
                ``load_state_dict`` accepts (BatchNorm buffers and counters included), on the CPU
                whatever the device the trainer or the module is on.

        Returns:
            The state; it works before the first step (the initial weights, no optimizer state
            yet). Under mpirun with ZeRO stage 1 it gathers every rank's moments, so every rank
            must call it.
        """
        info = self._train_step_info
        if pytorch_format:
            if not isinstance(self.model, torch.nn.Module):
                return {k: torch.from_numpy(v) for k, v in self._current_weights().items()}
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            if self._engine is not None:
                state.update({k: torch.from_numpy(v) for k, v in self._weights_by_torch_key().items()})
                state.update({k: torch.tensor(v, dtype=state[k].dtype) for k, v in self._counter_values().items()})
            return state
        moments = {}
        if self._engine is not None:
            # under ZeRO each rank holds its range of the states: gather them
            moments = self._gather_zero_states() if self._zero_counts is not None else self._engine.optimizer_states()
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
        return {
            "model": {"full_precision": self._current_weights()},
            "optimizer": optimizer,
            "trainer_options": self._trainer_options_record(),
            "train_step_info": step_info,
        }

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
    def _weight_specs(self, pytorch_format: bool) -> dict[str, WeightSpec]:
        """Every weight name a state may hold, with its shape, dtype family and whether it is required.

        Nested names are the graph's weights (once built) or the model's own names; a torch module's
        other state (tied aliases, BatchNorm counters, parameters the graph does not use) is
        accepted under its torch key too, so a state taken before the first step loads after it.
        With ``pytorch_format`` every torch ``state_dict`` key is required.
        """
        if isinstance(self.model, torch.nn.Module) and (pytorch_format or self._engine is None):
            return {k: WeightSpec(tuple(v.shape), dtype_family(v.dtype), pytorch_format or not k.endswith(_COUNTER_SUFFIX))
                    for k, v in self.model.state_dict().items()}
        if self._engine is None:
            return {i.name: WeightSpec(tuple(i.dims), dtype_family(numpy_helper.to_array(i).dtype))
                    for i in self.model.graph.initializer}
        specs = {n: WeightSpec(tuple(info[0]), dtype_family(info[1])) for n, info in self._graphs.meta["weights"].items()}
        if isinstance(self.model, torch.nn.Module):
            for key, value in self.model.state_dict().items():
                specs.setdefault(key, WeightSpec(tuple(value.shape), dtype_family(value.dtype), required=False))
        return specs

    def _check_weights(self, given: dict[str, Any], specs: dict[str, WeightSpec], strict: bool) -> list[str]:
        problems = [f"unexpected weight {name!r} (the model has no such weight)" for name in given if name not in specs]
        for name, spec in specs.items():
            if name in given:
                problems += shape_problems(f"weight {name!r}", given[name], spec.shape, spec.kind)
            elif strict and spec.required:
                problems.append(f"missing weight {name!r}")
        return problems

    def _check_optimizer(self, optimizer: Any, specs: dict[str, WeightSpec], strict: bool,
                         incoming: IncomingState) -> list[str]:
        """Validate optimizer states into ``incoming.moments`` / ``incoming.counts``."""
        if not optimizer:
            return []
        if not isinstance(optimizer, Mapping):
            return [f"optimizer: expected a dict of per-weight states, got {type(optimizer).__name__}"]
        from .graph.optimizer import state_names

        names = state_names(self.optim_config)
        trained = self._graphs.meta["trained"] if self._graphs is not None else None
        problems = []
        for weight, entry in optimizer.items():
            if not isinstance(entry, Mapping):
                problems.append(f"optimizer state for {weight!r}: expected a dict, got {type(entry).__name__}")
                continue
            entry = {s: as_array(v) for s, v in entry.items()}
            if weight == _SHARED:
                if not isinstance(self.optim_config, LambConfig) or set(entry) != {"Step"}:
                    problems.append(f"optimizer.{_SHARED} holds {sorted(entry)}; only Lamb has one, with 'Step'")
                else:
                    problems += shape_problems(f"optimizer.{_SHARED}.Step", entry["Step"], (), "int")
                    incoming.counts[f"{_SHARED}.Step"] = entry["Step"]
                continue
            if weight not in specs or (trained is not None and weight not in trained):
                problems.append(f"optimizer state for {weight!r}, which is not a trained weight")
                continue
            missing = [s for s in names if s not in entry]
            extra = [s for s in entry if s not in names and s != "Update_Count"]
            if missing or extra:
                problems.append(f"optimizer state for {weight!r} has {sorted(entry)}; {self.optim_config.name} "
                                f"needs {names + ['Update_Count']}")
                continue
            problems += [p for s in names for p in shape_problems(f"optimizer state {weight}.{s}", entry[s],
                                                                   specs[weight].shape, "float")]
            if "Update_Count" in entry:
                problems += shape_problems(f"optimizer state {weight}.Update_Count", entry["Update_Count"], (), "int")
                incoming.counts[f"{weight}.Update_Count"] = entry["Update_Count"]
            incoming.moments[weight] = {s: entry[s] for s in names}
        if strict and trained is not None and names:
            problems += [f"missing optimizer state for {w!r}" for w in trained if w not in optimizer]
        return problems

    def _check_accumulated(self, accumulated: Any, recorded_window: int | None, incoming: IncomingState) -> list[str]:
        """Gradients saved inside an accumulation window must fit this trainer's accumulation buffers."""
        if not accumulated:
            return []
        if not isinstance(accumulated, Mapping):
            return [f"accumulated_gradients: expected a dict, got {type(accumulated).__name__}"]
        window = self.options.batch.gradient_accumulation_steps
        if self._engine is None:
            return ["accumulated_gradients: the state was saved inside a gradient-accumulation window, but this "
                    "trainer's graph is not built (its inputs' dtypes are unknown): run one eval_step first"]
        problems = []
        if window == 1 or (recorded_window is not None and recorded_window != window):
            problems.append(f"accumulated_gradients: the state was saved inside an accumulation window of "
                            f"{recorded_window} steps; this trainer accumulates over {window}: use "
                            f"batch.gradient_accumulation_steps={recorded_window}")
        buffers = self._engine.accumulated
        for name, value in accumulated.items():
            value = as_array(value)
            if name not in buffers:
                problems.append(f"accumulated gradient for {name!r}, which is not a trained weight")
                continue
            problems += shape_problems(f"accumulated gradient {name!r}", value, self._engine.shapes[name], "float")
            incoming.accumulated[name] = value
        return problems

    def _parse_nested(self, state: Mapping, strict: bool, problems: list[str],
                      accumulated: Any = None, recorded_window: int | None = None) -> IncomingState:
        """Validate a nested state (values may be unread ``StoredArray``s) into an ``IncomingState``."""
        incoming = IncomingState()
        weights = state["model"]["full_precision"]
        if not isinstance(weights, Mapping):
            problems.append(f"model.full_precision: expected a dict, got {type(weights).__name__}")
            weights = {}
        incoming.weights = {k: as_array(v) for k, v in weights.items()}
        specs = self._weight_specs(pytorch_format=False)
        problems += self._check_weights(incoming.weights, specs, strict)
        problems += self._check_optimizer(state.get("optimizer"), specs, strict, incoming)
        problems += self._check_accumulated(accumulated, recorded_window, incoming)
        incoming.info = parse_train_step_info(state.get("train_step_info"), problems)
        parse_trainer_options(state.get("trainer_options"), problems)
        return incoming

    def _check_values(self, incoming: IncomingState) -> list[str]:
        """Checks that need the data: the saved update counts are non-negative integers."""
        return [f"optimizer state {name}: expected a non-negative count, got {np.asarray(value).tolist()!r}"
                for name, value in incoming.counts.items() if as_count(value) is None]

    # ---- loading --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restore weights, optimizer state and step counters from either ``state_dict`` format.

        All or nothing: every part is validated first, and nothing changes unless all of it fits.

        Args:
            state_dict: the nested dict of ``state_dict()`` or a flat torch ``state_dict``
                (which carries no optimizer state: the optimizer state is left as it is).
            strict: report missing weights as errors (unexpected ones, shape and dtype mismatches
                are always errors).

        Raises:
            ValueError: listing every missing and unexpected weight, shape or dtype mismatch and
                malformed counter; nothing is changed.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        problems: list[str] = []
        if _is_nested(state_dict):
            unknown = [k for k in state_dict if k not in ("model", "optimizer", "trainer_options", "train_step_info")]
            problems += [f"unexpected key {k!r} in the nested state (it has model, optimizer, trainer_options, "
                         "train_step_info)" for k in unknown]
            incoming = self._parse_nested(state_dict, strict, problems)
        else:
            incoming = IncomingState(weights={k: as_array(v) for k, v in state_dict.items()})
            problems += self._check_weights(incoming.weights, self._weight_specs(pytorch_format=True), strict)
        if not problems:
            problems += self._check_values(incoming)
        if problems:
            raise ValueError("load_state_dict: the state does not fit this trainer; nothing was changed:\n  "
                             + "\n  ".join(problems))
        self._apply(incoming)

    def _apply(self, incoming: IncomingState) -> None:
        """Write a validated state (no check can fail from here on)."""
        self._apply_schedules(incoming)
        info = self._train_step_info
        if "step" in incoming.info:  # first: the BatchNorm counters are stored relative to it
            info.step = incoming.info["step"]
            info.optimization_step = incoming.info["optimization_step"]
        self._apply_weights(incoming.weights)
        if any(incoming.moments.values()):
            moments = {w: {s: np.asarray(v, np.float32) for s, v in entry.items()}
                       for w, entry in incoming.moments.items() if entry}
            if self._engine is not None:
                self._engine.load_optimizer_states(moments)
            else:
                self._pending_optimizer = moments
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
        """
        path = os.fspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"save_checkpoint: {path!r} already exists; choose a new path or delete it first")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise FileNotFoundError(f"save_checkpoint: directory {os.path.dirname(os.path.abspath(path))!r} does not exist")
        checkpoint.encode_user_dict(user_dict, allow_pickle)  # on every rank, before any collective
        state = self.state_dict()
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
        window = self.options.batch.gradient_accumulation_steps
        if self._engine is not None and self._train_step_info.step % window:
            content["accumulated_gradients"] = self._engine.accumulated_values()
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
            strict: missing weights are errors.
            allow_pickle: unpickle a pickled ``user_dict`` (saved with ``allow_pickle=True``, or by
                ort_trainer before format version 2). Unpickling runs code chosen by whoever wrote
                the file: only for files you trust. Without it such a user dict is returned as
                None, with a warning, and everything else is loaded.

        Returns:
            The last file's ``user_dict``.

        Raises:
            CheckpointError (a ``ValueError``): a file is missing, truncated, corrupted or unsafe,
                or its state does not fit this trainer; every problem is named and nothing is changed.
        """
        if not paths:
            raise TypeError("load_checkpoint needs at least one path")
        files = [checkpoint.open_checkpoint(p) for p in paths]
        merged: dict[str, Any] = {"model": {"full_precision": {}}, "optimizer": {}, "accumulated_gradients": {}}
        for file in files:
            merged["model"]["full_precision"].update(file.arrays["model"].get("full_precision", {}))
            merged["optimizer"].update(file.arrays["optimizer"])
            merged["accumulated_gradients"].update(file.arrays["accumulated_gradients"])
            merged.update(file.metadata)
        problems: list[str] = []
        recorded = parse_trainer_options(merged["trainer_options"], problems)
        if merged["optimizer"] and recorded.get("optimizer_name") not in (None, self.optim_config.name):
            problems.append(
                f"the checkpoint's optimizer state is for {recorded['optimizer_name']}, this trainer uses "
                f"{self.optim_config.name}; use the same optimizer config, or save the checkpoint with "
                "include_optimizer_states=False")
        dtypes = recorded.get("input_dtypes")
        if self._engine is None and dtypes and all(d.name in dtypes for d in self.model_desc.inputs):
            self._build(self._synthetic_inputs(dtypes))
        incoming = self._parse_nested({**merged, "trainer_options": None}, strict, problems,
                                      merged["accumulated_gradients"], recorded.get("gradient_accumulation_steps"))
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
                                             "changed:\n  " + "\n  ".join(problems))
        user = files[-1].user_dict(allow_pickle)
        self._apply(incoming)
        return user

    # ---- torch round trip -----------------------------------------------------------------------
    def update_torch_model(self) -> None:
        """Copy the trained weights and buffers (BatchNorm statistics too) back into the ``torch.nn.Module``.

        Raises:
            TypeError: when the trainer was given an ONNX model.
        """
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError("update_torch_model: the trainer was given an ONNX model, not a torch.nn.Module")
        if self._engine is None:
            return  # nothing trained yet: the module already holds the weights
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in self._weights_by_torch_key().items():
                state[key].copy_(torch.from_numpy(value))
            for key, value in self._counter_values().items():
                state[key].fill_(value)

"""The trainer's state: state dicts, checkpoints and the torch model round trip.

A mixin of ``ORTTrainer``: everything here reads or writes weights, optimizer moments, step
counters, the scheduler and loss-scaler state. Loading validates the whole state first and
changes nothing when any part does not fit.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import torch
from onnx import numpy_helper

from . import checkpoint
from .optim.config import LambConfig

_COUNTER_SUFFIX = "num_batches_tracked"


def _is_nested(state: Mapping) -> bool:
    return isinstance(state.get("model"), Mapping) and "full_precision" in state["model"]


def _array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


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
                (``model.full_precision``, ``optimizer``, ``trainer_options``, ``train_step_info``).
                True: ``{torch state_dict key: torch.Tensor}`` that the model's
                ``load_state_dict`` accepts (BatchNorm buffers and counters included).

        Works before the first step (the initial weights, no optimizer state yet). Under mpirun
        with ZeRO stage 1 it gathers every rank's moments, so every rank must call it.
        """
        info = self._train_step_info
        if pytorch_format:
            if not isinstance(self.model, torch.nn.Module):
                return {k: torch.from_numpy(v) for k, v in self._current_weights().items()}
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
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
            optimizer["shared_optimizer_state"] = {"Step": np.array(info.optimization_step, dtype=np.int64)}
        return {
            "model": {"full_precision": self._current_weights()},
            "optimizer": optimizer,
            "trainer_options": self._trainer_options_record(),
            "train_step_info": {"step": info.step, "optimization_step": info.optimization_step},
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
        full = {}
        for state, local in self._engine.state_arrays().items():
            whole = np.zeros(sum(self._zero_counts), np.float32)
            whole[self._engine.begin:self._engine.end] = local
            self._comm.allgather(whole, self._zero_counts)
            full[state] = whole
        return self._engine.optimizer_states(full)

    # ---- loading --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> None:
        """Restore weights, optimizer state and step counters from either ``state_dict`` format.

        Args:
            state_dict: the nested dict of ``state_dict()`` or a flat torch ``state_dict``
                (which carries no optimizer state: the optimizer state is left as it is).
            strict: report missing weights as errors (unexpected ones and shape mismatches are
                always errors).

        Raises:
            ValueError: listing every missing/unexpected weight and shape mismatch; nothing is changed.
        """
        if _is_nested(state_dict):
            self._load_nested(state_dict, strict)
        else:
            self._load_pytorch(state_dict, strict)

    def _expected_weights(self) -> dict[str, tuple]:
        if self._engine is not None:
            return {n: tuple(info[0]) for n, info in self._graphs.meta["weights"].items()}
        return {k: tuple(v.shape) for k, v in self._current_weights().items()}

    def _check_weights(self, given: dict[str, np.ndarray], expected: dict[str, tuple], strict: bool,
                       optional: set[str] = frozenset()) -> list[str]:
        problems = [f"unexpected weight {name!r} (the model has no such weight)" for name in given
                    if name not in expected]
        problems += [f"weight {name!r}: shape {list(given[name].shape)} in the state, {list(shape)} in the model"
                     for name, shape in expected.items() if name in given and tuple(given[name].shape) != shape]
        if strict:
            problems += [f"missing weight {name!r}" for name in expected if name not in given and name not in optional]
        return problems

    def _load_nested(self, state: Mapping, strict: bool, extra: dict | None = None) -> None:
        weights = {k: _array(v) for k, v in state["model"]["full_precision"].items()}
        expected = self._expected_weights()
        optional = {k for k in expected if k.endswith(_COUNTER_SUFFIX)}
        problems = self._check_weights(weights, expected, strict, optional)
        optimizer = {k: {s: _array(v) for s, v in entry.items()} for k, entry in (state.get("optimizer") or {}).items()
                     if k != "shared_optimizer_state"}
        problems += self._check_optimizer(optimizer, expected, strict)
        info = state.get("train_step_info") or {}
        if problems:
            raise ValueError("the state does not fit this trainer:\n  " + "\n  ".join(problems))
        self._apply_weights(weights)
        if optimizer:
            moments = {w: {s: v for s, v in entry.items() if s != "Update_Count"} for w, entry in optimizer.items()}
            if self._engine is not None:
                self._engine.load_optimizer_states(moments)
            else:
                self._pending_optimizer = moments
        if extra and extra.get("accumulated_gradients") and self._engine is not None:
            self._engine.load_accumulated({k: _array(v) for k, v in extra["accumulated_gradients"].items()})
        if "step" in info:
            self._train_step_info.step = int(info["step"])
            self._train_step_info.optimization_step = int(info["optimization_step"])

    def _check_optimizer(self, optimizer: dict, expected: dict[str, tuple], strict: bool) -> list[str]:
        if not optimizer:
            return []
        from .graph.optimizer import state_names

        names = state_names(self.optim_config)
        trained = self._graphs.meta["trained"] if self._graphs is not None else None
        problems = []
        for weight, entry in optimizer.items():
            if weight not in expected or (trained is not None and weight not in trained):
                problems.append(f"optimizer state for {weight!r}, which is not a trained weight")
                continue
            missing = [s for s in names if s not in entry]
            extra = [s for s in entry if s not in names and s != "Update_Count"]
            if missing or extra:
                problems.append(f"optimizer state for {weight!r} has {sorted(entry)}; {self.optim_config.name} "
                                f"needs {names + ['Update_Count']}")
            problems += [f"optimizer state {weight}.{s}: shape {list(entry[s].shape)}, expected {list(expected[weight])}"
                         for s in names if s in entry and tuple(entry[s].shape) != expected[weight]]
        if strict and trained is not None and names:
            problems += [f"missing optimizer state for {w!r}" for w in trained if w not in optimizer]
        return problems

    def _load_pytorch(self, state: Mapping, strict: bool) -> None:
        given = {k: _array(v) for k, v in state.items()}
        if isinstance(self.model, torch.nn.Module):
            expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        else:
            expected = self._expected_weights()
        problems = self._check_weights(given, expected, strict)
        if problems:
            raise ValueError("the state does not fit this trainer:\n  " + "\n  ".join(problems))
        if self._engine is None or not isinstance(self.model, torch.nn.Module):
            self._apply_weights(given)
            return
        by_key = {key: weight for weight, keys in self._graphs.meta["torch_keys"].items() for key in keys}
        self._apply_weights({**{by_key[k]: v for k, v in given.items() if k in by_key},
                             **{k: v for k, v in given.items() if k in self._counter_base}})
        with torch.no_grad():  # parameters the graph does not use live in the module only
            module_state = self.model.state_dict(keep_vars=True)
            for key, value in given.items():
                if key not in by_key and key not in self._counter_base:
                    module_state[key].copy_(torch.from_numpy(value))

    def _apply_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Write validated weights: into the engine once built, else into the model itself."""
        if self._engine is not None:
            counters = {k: v for k, v in weights.items() if k.endswith(_COUNTER_SUFFIX)}
            self._engine.load_weights({k: v for k, v in weights.items() if k not in counters})
            for key, value in counters.items():
                if key in self._counter_base:
                    self._counter_base[key] = int(value) - self._train_step_info.step
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
    def save_checkpoint(self, path: str | os.PathLike, user_dict: dict | None = None,
                        include_optimizer_states: bool = True) -> None:
        """Save the whole training state to one new HDF5 file at ``path``.

        Holds weights, optimizer moments and step counts (unless ``include_optimizer_states`` is
        False), the train-step info, the options that shape the graph, the LR scheduler and
        loss-scaler state, gradients accumulated so far inside an accumulation window, and
        ``user_dict``. Written to a temporary file, then linked into place: a crash never leaves
        a partial file under ``path``. Under mpirun every rank calls it; rank 0 writes.

        Raises:
            FileExistsError: ``path`` exists; it is never overwritten.
            FileNotFoundError: the directory does not exist.
        """
        path = os.fspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"save_checkpoint: {path!r} already exists; choose a new path or delete it first")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise FileNotFoundError(f"save_checkpoint: directory {os.path.dirname(os.path.abspath(path))!r} does not exist")
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
            checkpoint.write(path, content)

    def load_checkpoint(self, *paths: str | os.PathLike, strict: bool = True) -> Any:
        """Restore everything ``save_checkpoint`` saved; returns its ``user_dict``.

        Several paths are merged in order (later files override earlier ones). A checkpoint saved
        without optimizer state leaves the optimizer state as it is. Builds the training graph
        first when needed, from the input dtypes the checkpoint records.

        Raises:
            CheckpointError: a file is missing, truncated, corrupted, or from another optimizer.
            ValueError: the weights do not fit the model (named); nothing is changed.
        """
        if not paths:
            raise TypeError("load_checkpoint needs at least one path")
        contents = [checkpoint.read(p) for p in paths]
        merged: dict[str, Any] = {"model": {"full_precision": {}}, "optimizer": {}, "accumulated_gradients": {}}
        for content in contents:
            merged["model"]["full_precision"].update(content["model"].get("full_precision", {}))
            merged["optimizer"].update(content["optimizer"])
            merged["accumulated_gradients"].update(content["accumulated_gradients"])
            for key in ("train_step_info", "trainer_options", "lr_scheduler", "loss_scaler", "user_dict"):
                merged[key] = content[key]
        recorded = merged["trainer_options"] or {}
        if merged["optimizer"] and recorded.get("optimizer_name") not in (None, self.optim_config.name):
            raise checkpoint.CheckpointError(
                f"load_checkpoint: the checkpoint's optimizer state is for {recorded['optimizer_name']}, "
                f"this trainer uses {self.optim_config.name}; use the same optimizer config, or save the "
                "checkpoint with include_optimizer_states=False"
            )
        if self._engine is None and recorded.get("input_dtypes"):
            dtypes = recorded["input_dtypes"]
            if all(d.name in dtypes for d in self.model_desc.inputs):
                self._build(self._synthetic_inputs({k: np.dtype(v) for k, v in dtypes.items()}))
        self._load_nested(merged, strict, extra=merged)
        if merged["lr_scheduler"] is not None and self.options.lr_scheduler is not None:
            self.options.lr_scheduler.load_state_dict(merged["lr_scheduler"])
        if merged["loss_scaler"] is not None and self.options.mixed_precision.loss_scaler is not None:
            self.options.mixed_precision.loss_scaler.load_state_dict(merged["loss_scaler"])
        self._train_step_info.all_finite = bool((merged["train_step_info"] or {}).get("all_finite", True))
        return merged["user_dict"]

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


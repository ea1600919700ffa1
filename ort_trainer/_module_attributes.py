"""The model's plain Python attributes and modes, which its traced graphs hold as they were traced.

A graph computes with the Python values its trace read: an attribute the forward divides by
(``self.temperature``), a flag it branches on, a submodule's training mode. PyTorch reads them anew
every forward; a graph never does, so a change made between steps would be ignored without a word.
``AttributeWatch`` keeps every submodule's plain attributes (bool, int, float, str, None: ~870 of GPT-2
small's 164 modules, compared in ~30 µs on a 2-core Intel Xeon) and the modes its trace ran them in, and the
trainer checks them before each step: a change is an error that names it, before the step runs.
``TensorWatch`` does the same for the module's tensors, by version counter, and brings a change the script made
to them to the trainer's copies, which the graphs read.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from .graph.export.torchscript import training_in_trace

_PLAIN = (bool, int, float, str, type(None))
_SHOWN = 10  # changes named in the message


def _getter(keys: tuple[str, ...]) -> Callable[[dict], tuple]:
    """A function of a module's ``__dict__`` giving the values of ``keys`` as a tuple."""
    if len(keys) == 1:
        key = keys[0]
        return lambda values: (values[key],)
    return operator.itemgetter(*keys)


class AttributeWatch:
    """The plain attributes of ``model``'s (and a module ``loss_fn``'s) submodules when its graphs were built."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any = None):
        self._model, self._loss_fn = model, loss_fn
        self._entries = []  # (label, the module's __dict__, the keys watched, their getter)
        roots = [("", model)] + ([("loss_fn", loss_fn)] if isinstance(loss_fn, torch.nn.Module) else [])
        for prefix, root in roots:
            for name, module in root.named_modules():
                values = vars(module)
                keys = tuple(k for k, v in values.items() if isinstance(v, _PLAIN))
                if keys:
                    label = ".".join(p for p in (prefix, name) if p) or "<top-level>"
                    self._entries.append((f"{label} ({type(module).__name__})", values, keys, _getter(keys)))
        self._values = self._current()
        self._training = training_in_trace(model)

    def _current(self) -> tuple:
        try:
            return tuple(getter(values) for _, values, _, getter in self._entries)
        except KeyError:  # an attribute was deleted
            return ()

    def current(self) -> "AttributeWatch":
        """This watch, or a new one where the values moved since it was made: after a step that traced the model
        (a new input shape), whose forward may set attributes itself (a cache of a rotary embedding's length),
        and whose graphs hold the values it left."""
        return self if self._current() == self._values else AttributeWatch(self._model, self._loss_fn)

    def check(self) -> None:
        """Raise ``RuntimeError`` naming what changed since the build, if anything did."""
        if self._current() == self._values:
            return
        changes = self._changes()
        if not changes:
            self._values = self._current()  # modes changed as the trace does not see (model.eval() and back)
            return
        listed = "; ".join(changes[:_SHOWN]) + (f"; and {len(changes) - _SHOWN} more" if len(changes) > _SHOWN else "")
        raise RuntimeError(
            f"the model changed after its graphs were built, and the graphs compute with what it was: {listed}. A "
            "graph holds the Python values its trace read; keep a value that changes during training in a tensor the "
            "forward reads, a buffer changed in place (model.register_buffer('temperature', torch.tensor(1.0)), "
            "later model.temperature.fill_(0.5)), set modes before the first step, or make a new ORTTrainer from the "
            "changed model (trainer.update_torch_model() first, to carry the trained weights)")

    def _changes(self) -> list[str]:
        """What changed, one phrase each; modes only where the trace would run a module otherwise."""
        changes = []
        for (label, values, keys, _), before in zip(self._entries, self._values):
            for key, old in zip(keys, before):
                new = values.get(key, "<deleted>")
                if key != "training" and new is not old and new != old:
                    changes.append(f"attribute {key!r} of module {label}: {old!r} -> {new!r}")
        training = training_in_trace(self._model)
        for name in sorted(self._training ^ training):
            mode = "training" if name in training else "eval"
            changes.append(f"module {name or '<top-level>'} would train in {mode} mode, where it was traced in "
                           f"{'eval' if mode == 'training' else 'training'} mode")
        return changes


class TensorWatch:
    """The model's parameters and buffers, each with its version counter, for the changes the script makes to them
    between steps (WGAN's weight clipping under ``torch.no_grad()``, a pruning mask applied, an annealed buffer),
    which PyTorch's next forward and optimizer step read. On the CPU a module's tensor is mostly the engine's own
    (``_share_module_memory``), whose changes need no copy. Elsewhere (a GPU, where the module's tensors stay on
    the host) the engine holds copies: a changed buffer or frozen weight is copied to it before the next step; a
    trained weight or a BatchNorm statistic, which the steps change, is copied where the module held the current
    values when the script changed it (after ``update_torch_model``, or before any step), and is an error otherwise,
    as is a trained weight replaced by another tensor (PyTorch's optimizer would go on updating the old one). A
    change through ``.data`` (``p.data.clamp_()``) bumps no version counter and is not seen there. A weight's
    ``requires_grad`` changed since the build is an error: the graphs train the set they were built for. The check
    costs ~33 us a step for GPT-2 small's 149 tensors (2-core Intel Xeon)."""

    def __init__(self, model: torch.nn.Module, torch_keys: dict[str, list[str]], engine: Any, updated: set[str]):
        modules = dict(model.named_modules())
        self._engine, self._updated, self._synced = engine, updated, True
        # [owner's _parameters or _buffers, name there, key, the tensor, its version, weight, its requires_grad]
        self._watched = []
        for weight, keys in torch_keys.items():
            for key in keys:
                path, _, name = key.rpartition(".")
                module = modules.get(path)
                owner = next((d for d in (getattr(module, "_parameters", {}), getattr(module, "_buffers", {}))
                              if isinstance(d.get(name), torch.Tensor)), None)
                if owner is not None:
                    tensor = owner[name]
                    self._watched.append([owner, name, key, tensor, tensor._version, weight, tensor.requires_grad])

    def rebase(self, synced: bool | None, training: bool = False) -> None:
        """Take each tensor as it is now for unchanged: the module's were written from the engine's (``synced``:
        they hold its current values), the engine's from elsewhere (a state loaded), or a trace of a new shape ran
        the forward, which put back what it changed in place (``None``: as synced as before). ``training``: a step
        that changes the trained weights follows."""
        self._synced = (self._synced if synced is None else synced) and not training
        for entry in self._watched:
            current = entry[0].get(entry[1])
            if isinstance(current, torch.Tensor):
                entry[3], entry[4] = current, current._version

    def copy_changes(self) -> None:
        """Copy each tensor changed since the last call (or ``rebase``) to the engine's tensor of it, before a
        step."""
        targets, flipped = None, []
        for entry in self._watched:
            owner, name, key, tensor, version, weight, requires_grad = entry
            current = owner.get(name)
            if current is None:  # a module's _parameters and _buffers hold tensors or None
                continue
            if current.requires_grad != requires_grad:
                flipped.append(f"{key!r} {requires_grad} -> {not requires_grad}")
            if current is tensor and current._version == version:
                continue
            targets = targets or self._engine.current_tensors()
            target = targets[weight]
            if current.data_ptr() != target.data_ptr():  # else it is the engine's tensor, changed already
                if weight in self._updated and (current is not tensor or not self._synced):
                    raise RuntimeError(
                        f"the model's {key!r} was {'replaced' if current is not tensor else 'changed'} after steps "
                        "had changed it: on this device the module holds a copy of the trained values as they were "
                        "at the build (or at the last trainer.update_torch_model()), which the trainer cannot take "
                        "for the current ones. Call trainer.update_torch_model() first, then change the module's "
                        "tensors in place (with torch.no_grad(): parameter.clamp_(-c, c)), or load new values with "
                        "trainer.load_state_dict")
                with torch.no_grad():
                    target.copy_(current.detach().reshape(target.shape))
            entry[3], entry[4] = current, current._version
        if flipped:
            raise RuntimeError(
                f"requires_grad of the model's weights changed after the graphs were built: {', '.join(flipped)}. "
                "The graphs train the weights that required grad (and were not in utils.frozen_weights) at the "
                "build. To train another set, call trainer.update_torch_model() and make a new ORTTrainer for the "
                "model (the optimizer's state starts anew), or set the flags before the first step")


__all__ = ["AttributeWatch", "TensorWatch"]

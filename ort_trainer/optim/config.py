"""Optimizer configurations (api.md section 4).

A config holds the default hyper-parameters and a list of parameter groups
``{"params": [weight names], <hyper-parameter>: value, ...}``; weights in no group use the defaults.
The update math itself is built into the ONNX optimizer graph (``ort_trainer.graph.optimizer``).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Sequence


class DecayMode(enum.IntEnum):
    """Where Adam applies weight decay (``lambda_coef``)."""

    BEFORE_WEIGHT_UPDATE = 0
    """Decay the weight before the Adam step, as ``torch.optim.AdamW`` does."""
    AFTER_WEIGHT_UPDATE = 1
    """Decay the weight after the Adam step, as Hugging Face's former AdamW did."""


class _OptimizerConfig:
    """Base class: validates hyper-parameters and parameter groups at construction."""

    name: str = ""
    # hyper-parameter -> (type(s), check or None); order is the constructor's.
    _HYPER: dict[str, tuple] = {}
    # hyper-parameters that are global, not per group
    _GLOBAL: frozenset = frozenset()

    def __init__(self, params: Sequence[dict] | None = None, **hyper: Any):
        problems = []
        for key, value in hyper.items():
            problems.extend(self._check(key, value, type(self).__name__))
        self.defaults = dict(hyper)
        """The hyper-parameters of the weights in no group: ``{name: value}``, as given to the constructor."""
        for key, value in hyper.items():
            object.__setattr__(self, key, value)
        groups = [] if params is None else params
        if not isinstance(groups, (list, tuple)):
            problems.append(f"{type(self).__name__}.params: expected a list of dicts, got {type(groups).__name__}")
            groups = []
        seen: dict[str, int] = {}
        for i, group in enumerate(groups):
            where = f"{type(self).__name__}.params[{i}]"
            if not isinstance(group, dict):
                problems.append(f"{where}: expected a dict {{'params': [names], ...}}, got {type(group).__name__}")
                continue
            names = group.get("params")
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                problems.append(f"{where}.params: expected a list of weight names (str)")
                names = []
            for name in names:
                if name in seen:
                    problems.append(f"{where}.params: weight {name!r} is already in group {seen[name]}")
                seen[name] = i
            for key, value in group.items():
                if key == "params":
                    continue
                if key in self._GLOBAL:
                    problems.append(f"{where}.{key}: is global to the optimizer and cannot be set per group")
                elif key not in self._HYPER:
                    problems.append(
                        f"{where}.{key}: unknown hyper-parameter for {type(self).__name__}; "
                        f"known: {sorted(set(self._HYPER) - self._GLOBAL)}"
                    )
                else:
                    problems.extend(self._check(key, value, where))
        problems += self._combination_problems([dict(hyper)] + [{**hyper, **g} for g in groups if isinstance(g, dict)])
        if problems:
            raise ValueError(f"invalid {type(self).__name__}:\n  " + "\n  ".join(problems))
        self.params = [dict(g, params=list(g["params"])) for g in groups]
        """The parameter groups, copied: ``[{"params": [weight names], <hyper-parameter>: value, ...}]``."""

    def _combination_problems(self, groups: list[dict]) -> list[str]:
        """Problems of hyper-parameters that are valid alone but not together; ``groups``: the defaults, then each
        group's resolved values."""
        return []

    def _check(self, key: str, value: Any, where: str) -> list[str]:
        types, check = self._HYPER[key]
        if isinstance(value, bool) and bool not in types:
            return [f"{where}.{key}: expected {types[0].__name__}, got bool"]
        if not isinstance(value, types):
            return [f"{where}.{key}: expected {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}"]
        problem = check(value) if check else None
        return [f"{where}.{key}: {problem}"] if problem else []

    def group_hyperparameters(self, group_index: int | None) -> dict[str, Any]:
        """Resolved hyper-parameters of a group (``None``: the default group)."""
        resolved = dict(self.defaults)
        if group_index is not None:
            resolved.update({k: v for k, v in self.params[group_index].items() if k != "params"})
        return resolved

    def fingerprint(self) -> list:
        """A JSON-able summary used in the graph cache key (lr excluded: it is a graph input)."""

        def plain(d: dict) -> dict:
            return {k: (int(v) if isinstance(v, enum.Enum) else v) for k, v in sorted(d.items()) if k != "lr"}

        return [type(self).__name__, plain(self.defaults), [sorted(g["params"]) + [plain(g)] for g in self.params]]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"{type(self).__name__}(params={self.params!r}, {args})"


_NUM = (int, float)
# the optimizer runs in float32: a larger value would be inf there
_FLOAT32_MAX = 3.4028234663852886e38


def _finite(v: float) -> str | None:
    if not math.isfinite(v):
        return f"must be a finite number, got {v}"
    if abs(v) > _FLOAT32_MAX:
        return f"must fit in float32 (|value| <= 3.4e38; the update runs in float32), got {v}"
    return None


def _positive(v: float) -> str | None:
    return _finite(v) or (None if v > 0 else f"must be > 0, got {v}")


def _non_negative(v: float) -> str | None:
    return _finite(v) or (None if v >= 0 else f"must be >= 0, got {v}")


def _unit(v: float) -> str | None:
    return None if 0 <= v < 1 else f"must be in [0, 1), got {v}"


def _not_nan(v: float) -> str | None:
    return f"must be a number, got {v}" if math.isnan(v) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUM) and not isinstance(value, bool)


def check_learning_rate(value: float, where: str) -> str | None:
    """The problem with a learning rate about to be used (None when it is usable).

    Learning rates can change after construction (``cfg.lr = ...``, a scheduler), so the trainer
    checks the value of every step before any work.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{where}: expected a number, got {type(value).__name__}"
    problem = _non_negative(float(value))
    return f"{where}: {problem}" if problem else None


class SGDConfig(_OptimizerConfig):
    """SGD: ``w -= lr * g``, with ``torch.optim.SGD``'s momentum, dampening, Nesterov momentum and weight decay where
    given. Never clipped.

    With ``g`` the gradient plus ``weight_decay * w``, momentum keeps a buffer per weight, ``b = g`` at the first
    step and ``b = momentum * b + (1 - dampening) * g`` after it, and steps by ``b`` (with ``nesterov``, by
    ``g + momentum * b``): torch's formulas, in its order.

    Args:
        params: parameter groups, each ``{"params": [names], "lr": ...}``; a group may set any hyper-parameter below.
        lr: learning rate.
        momentum: the momentum factor (0: none, no buffer kept).
        dampening: damps the gradient's share of the buffer after the first step.
        nesterov: Nesterov momentum (needs a momentum and no dampening).
        weight_decay: adds ``weight_decay * w`` to the gradient (L2, as ``torch.optim.SGD``).
    """

    name = "SGDOptimizer"
    """The optimizer's name, recorded in checkpoints (a checkpoint loads only into the same optimizer)."""
    _HYPER = {"lr": (_NUM, _non_negative), "momentum": (_NUM, _non_negative), "dampening": (_NUM, _finite),
              "nesterov": ((bool,), None), "weight_decay": (_NUM, _non_negative)}

    def __init__(self, params: Sequence[dict] | None = None, lr: float = 0.001, momentum: float = 0.0,
                 dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                         weight_decay=weight_decay)

    def _combination_problems(self, groups: list[dict]) -> list[str]:
        problems = []
        for index, hp in enumerate(groups):
            if hp.get("nesterov") is True and not (_is_number(hp.get("momentum")) and hp["momentum"] > 0
                                                   and hp.get("dampening") == 0):
                where = "SGDConfig" if index == 0 else f"SGDConfig.params[{index - 1}]"
                problems.append(f"{where}: nesterov=True needs a momentum > 0 and dampening=0 (as torch.optim.SGD), "
                                f"got momentum={hp.get('momentum')}, dampening={hp.get('dampening')}")
        return problems

    @property
    def has_momentum(self) -> bool:
        """Whether any group keeps a momentum buffer (the optimizer's per-weight state ``Momentum``)."""
        return any(self.group_hyperparameters(i)["momentum"] > 0 for i in [None, *range(len(self.params))])


class AdamConfig(_OptimizerConfig):
    """Adam with decoupled weight decay (api.md section 4).

    Args:
        params: parameter groups; a group may set any hyper-parameter below but ``max_norm_clip``.
        lr: learning rate.
        alpha: beta1, the first-moment decay.
        beta: beta2, the second-moment decay.
        lambda_coef: weight decay.
        epsilon: added to the denominator.
        max_norm_clip: global gradient-norm clip threshold (with ``utils.grad_norm_clip``).
        do_bias_correction: divide the moments by ``1 - alpha^t`` and ``1 - beta^t``.
        weight_decay_mode: ``DecayMode.BEFORE_WEIGHT_UPDATE`` (torch AdamW) or
            ``DecayMode.AFTER_WEIGHT_UPDATE`` (Hugging Face's former AdamW).
    """

    name = "AdamOptimizer"
    """The optimizer's name, recorded in checkpoints (a checkpoint loads only into the same optimizer)."""
    _HYPER = {
        "lr": (_NUM, _non_negative),
        "alpha": (_NUM, _unit),
        "beta": (_NUM, _unit),
        "lambda_coef": (_NUM, _non_negative),
        "epsilon": (_NUM, _positive),
        "max_norm_clip": (_NUM, _positive),
        "do_bias_correction": ((bool,), None),
        "weight_decay_mode": ((DecayMode, int), lambda v: None if v in (0, 1) else f"must be a DecayMode, got {v}"),
    }
    _GLOBAL = frozenset({"max_norm_clip"})

    def __init__(
        self,
        params: Sequence[dict] | None = None,
        lr: float = 0.001,
        alpha: float = 0.9,
        beta: float = 0.999,
        lambda_coef: float = 0.0,
        epsilon: float = 1e-8,
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = True,
        weight_decay_mode: DecayMode = DecayMode.BEFORE_WEIGHT_UPDATE,
    ):
        super().__init__(
            params, lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, epsilon=epsilon,
            max_norm_clip=max_norm_clip, do_bias_correction=do_bias_correction,
            weight_decay_mode=DecayMode(weight_decay_mode) if weight_decay_mode in (0, 1) else weight_decay_mode,
        )


class LambConfig(_OptimizerConfig):
    """Lamb (api.md section 4): Adam's direction scaled by the trust ratio ``‖w‖/‖d‖``.

    Args:
        params: parameter groups; a group may set any hyper-parameter below but ``max_norm_clip``.
        lr: learning rate.
        alpha: beta1, the first-moment decay.
        beta: beta2, the second-moment decay.
        lambda_coef: weight decay.
        ratio_min: lower clamp of the trust ratio.
        ratio_max: upper clamp of the trust ratio.
        epsilon: added to the denominator.
        max_norm_clip: global gradient-norm clip threshold (with ``utils.grad_norm_clip``).
        do_bias_correction: divide the moments by ``1 - alpha^t`` and ``1 - beta^t``.
    """

    name = "LambOptimizer"
    """The optimizer's name, recorded in checkpoints (a checkpoint loads only into the same optimizer)."""
    _HYPER = {
        "lr": (_NUM, _non_negative),
        "alpha": (_NUM, _unit),
        "beta": (_NUM, _unit),
        "lambda_coef": (_NUM, _non_negative),
        "ratio_min": (_NUM, _not_nan),
        "ratio_max": (_NUM, _not_nan),
        "epsilon": (_NUM, _positive),
        "max_norm_clip": (_NUM, _positive),
        "do_bias_correction": ((bool,), None),
    }
    _GLOBAL = frozenset({"max_norm_clip"})

    def __init__(
        self,
        params: Sequence[dict] | None = None,
        lr: float = 0.001,
        alpha: float = 0.9,
        beta: float = 0.999,
        lambda_coef: float = 0.0,
        ratio_min: float = -math.inf,
        ratio_max: float = math.inf,
        epsilon: float = 1e-6,
        max_norm_clip: float = 1.0,
        do_bias_correction: bool = False,
    ):
        super().__init__(
            params, lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, ratio_min=ratio_min,
            ratio_max=ratio_max, epsilon=epsilon, max_norm_clip=max_norm_clip,
            do_bias_correction=do_bias_correction,
        )
        if ratio_min > ratio_max:
            raise ValueError(f"invalid LambConfig:\n  LambConfig.ratio_min: {ratio_min} > ratio_max {ratio_max}")

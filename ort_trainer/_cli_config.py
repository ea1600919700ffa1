"""The configs of ``ort-trainer train``: defaults, YAML loading, overrides and validation.

A config has the sections of ``DEFAULTS``; a key left out takes its default. Each value must
have its default's type (an int is fine where a float is expected) and pass ``RULES``; unknown
keys are errors with a suggestion. ``options`` is checked by ``ORTTrainerOptions`` itself.
Every problem is collected and reported at once, each with its dotted path.
"""

from __future__ import annotations

import copy
import difflib
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/run",
    "seed": 0,
    "model": {"type": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64, "dropout": 0.0,
              "hidden": 128, "path": "", "task": "causal-lm"},
    "data": {"name": "stdlib", "files": "", "path": "", "text": "text", "label": "label", "max_bytes": 1_000_000,
             "validation_fraction": 0.1, "mask_probability": 0.15},
    "optimizer": {"type": "adam", "lr": 1e-3, "lambda_coef": 0.01, "no_decay": ["bias", "ln", "norm"], "momentum": 0.0,
                  "nesterov": False},
    "lr_scheduler": {"type": "cosine", "warmup": 0.05},
    "train": {"max_steps": 200, "batch_size": 16, "log_every": 10, "eval_every": 50, "eval_batches": 4,
              "checkpoint_every": 0},
    "export": {"onnx": True, "sample_tokens": 200, "prompt": "def "},
    "logging": {"tensorboard": False},
    "options": {},
}
"""Every section and key of a config with its default; a value must have its default's type."""

# One line per key of DEFAULTS: what it sets (the API reference's config-key table prints them).
KEY_DOCS: dict[str, str] = {
    "output_dir": "where the run writes metrics, checkpoints, the loss plot and the exported model",
    "seed": "seeds the model's initial weights and the batches",
    "model.type": "gpt (bundled GPT), hf_gpt2 / hf_bert (transformers models of this size), hf (a saved model "
                  "from model.path), mlp (digits classifier)",
    "model.n_layer": "transformer layers (gpt, hf_gpt2, hf_bert)",
    "model.n_head": "attention heads; model.n_embd must be a multiple of it",
    "model.n_embd": "embedding width (gpt, hf_gpt2, hf_bert)",
    "model.block_size": "tokens per example (the sequence length)",
    "model.dropout": "dropout probability of the bundled and hf_* models and the MLP",
    "model.hidden": "hidden width of the mlp",
    "model.path": "model.type=hf: the directory of a model saved with save_pretrained (nothing is downloaded)",
    "model.task": "model.type=hf: causal-lm, masked-lm, or sequence-classification (labelled examples)",
    "data.name": "stdlib (the Python standard library's source), text (your files), jsonl / csv (your labelled "
                 "examples), digits (scikit-learn's digits)",
    "data.files": "data.name=text: a glob of UTF-8 text files (~ expanded, ** recursive)",
    "data.path": "data.name=jsonl or csv: the file of labelled examples",
    "data.text": "data.name=jsonl or csv: the field holding an example's text",
    "data.label": "data.name=jsonl or csv: the field holding an example's label (a class number or name)",
    "data.max_bytes": "at most this many bytes of text are read (stdlib, text)",
    "data.validation_fraction": "the share of the data held out for evaluation",
    "data.mask_probability": "masked-lm (hf_bert, hf masked-lm): the share of tokens masked and labelled",
    "optimizer.type": "adam, lamb or sgd",
    "optimizer.lr": "the base learning rate",
    "optimizer.lambda_coef": "weight decay (adam, lamb: their lambda_coef; sgd: torch.optim.SGD's weight_decay)",
    "optimizer.no_decay": "name fragments: weights whose names contain one get no weight decay",
    "optimizer.momentum": "sgd: the momentum factor, as torch.optim.SGD (0: plain SGD)",
    "optimizer.nesterov": "sgd: Nesterov momentum (needs optimizer.momentum > 0)",
    "lr_scheduler.type": "the learning-rate schedule after the warmup (none: a constant lr without warmup)",
    "lr_scheduler.warmup": "the warmup's share of train.max_steps",
    "train.max_steps": "optimizer steps of the run",
    "train.batch_size": "examples per step (per rank under torchrun or mpirun)",
    "train.log_every": "steps between two records of metrics.jsonl",
    "train.eval_every": "steps between two evaluations (0: none)",
    "train.eval_batches": "validation batches of each evaluation",
    "train.checkpoint_every": "steps between two checkpoints (0: none)",
    "export.onnx": "write output_dir/model.onnx after training",
    "export.sample_tokens": "language models: tokens of text sampled from model.onnx into samples.txt (0: none)",
    "export.prompt": "language models: the text the samples start from",
    "logging.tensorboard": "also write the scalars to output_dir/tensorboard (needs the tensorboard extra)",
    "options": "an ORTTrainerOptions dict, key for key (the distributed ranks are set by the launcher)",
}


def leaves(config: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of each key of ``config`` that holds a value, as overrides name them:
    nested sections are walked, ``options`` (an ``ORTTrainerOptions`` dict) and empty mappings are
    values."""
    for key, value in config.items():
        if isinstance(value, dict) and value and key != "options":
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class ConfigError(ValueError):
    """A config or override names an unknown key or has a value of the wrong type or range."""


CHOICES = {
    "model.type": ("gpt", "hf_gpt2", "hf_bert", "hf", "mlp"),
    "model.task": ("causal-lm", "masked-lm", "sequence-classification"),
    "data.name": ("stdlib", "text", "jsonl", "csv", "digits"),
    "optimizer.type": ("adam", "lamb", "sgd"),
    "lr_scheduler.type": ("none", "constant", "cosine", "linear", "poly"),
}
"""The allowed values of the keys that name a kind."""


# value checks that go beyond the type (the type comes from DEFAULTS): path -> (test, expected)
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "output_dir": (lambda v: bool(v.strip()), "a non-empty path"),
    "seed": (lambda v: v >= 0, "an int >= 0"),
    "model.n_layer": (lambda v: v >= 1, "an int >= 1"),
    "model.n_head": (lambda v: v >= 1, "an int >= 1"),
    "model.n_embd": (lambda v: v >= 1, "an int >= 1"),
    "model.block_size": (lambda v: v >= 1, "an int >= 1"),
    "model.hidden": (lambda v: v >= 1, "an int >= 1"),
    "model.dropout": (lambda v: 0 <= v < 1, "a float in [0, 1)"),
    "data.max_bytes": (lambda v: v >= 1000, "an int >= 1000"),
    "data.validation_fraction": (lambda v: 0 < v < 1, "a float in (0, 1)"),
    "data.mask_probability": (lambda v: 0 < v <= 1, "a float in (0, 1]"),
    "optimizer.lr": (lambda v: math.isfinite(v) and v >= 0, "a finite float >= 0"),
    "optimizer.lambda_coef": (lambda v: math.isfinite(v) and v >= 0, "a finite float >= 0"),
    "optimizer.no_decay": (lambda v: all(isinstance(x, str) for x in v), "a list of name fragments (str)"),
    "optimizer.momentum": (lambda v: math.isfinite(v) and v >= 0, "a finite float >= 0"),
    "lr_scheduler.warmup": (lambda v: 0 <= v <= 1, "a float in [0, 1] (a fraction of train.max_steps)"),
    "train.max_steps": (lambda v: v >= 1, "an int >= 1"),
    "train.batch_size": (lambda v: v >= 1, "an int >= 1"),
    "train.log_every": (lambda v: v >= 1, "an int >= 1 (steps between two log records)"),
    "train.eval_every": (lambda v: v >= 0, "an int >= 0 (0: no evaluation)"),
    "train.eval_batches": (lambda v: v >= 1, "an int >= 1"),
    "train.checkpoint_every": (lambda v: v >= 0, "an int >= 0 (0: no checkpoints)"),
    "export.sample_tokens": (lambda v: v >= 0, "an int >= 0"),
}
"""Each checked key's test and what it expects (the type is checked against ``DEFAULTS``)."""
RULES.update({path: (lambda v, allowed=allowed: v in allowed, "one of " + ", ".join(allowed))
              for path, allowed in CHOICES.items()})


def _unknown_key(where: str, key: Any, known: list[str]) -> str:
    guess = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    return f"{where}: unknown key; known keys: {known}{hint}"


def _check(value: Any, default: Any, path: str, problems: list[str]) -> Any:
    if path == "options":
        if not isinstance(value, dict):
            problems.append(f"options: expected a mapping (ORTTrainerOptions), got {type(value).__name__}")
        else:
            if "lr_scheduler" in value:
                problems.append("options.lr_scheduler: set the schedule in the lr_scheduler section instead")
            distributed = value.get("distributed")
            for key in ("world_rank", "world_size", "local_rank"):
                if isinstance(distributed, dict) and key in distributed:
                    problems.append(f"options.distributed.{key}: set by the launcher; run `torchrun "
                                    "--nproc_per_node N -m ort_trainer train ...` or `mpirun -n N ort-trainer train "
                                    "...` for N ranks instead")
        return value
    if isinstance(default, dict):
        if not isinstance(value, dict):
            problems.append(f"{path or 'the config'}: expected a mapping of {sorted(default)}, "
                            f"got {type(value).__name__} {value!r}")
            return copy.deepcopy(default)
        merged = copy.deepcopy(default)
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in default:
                problems.append(_unknown_key(where, key, sorted(default)))
            else:
                merged[key] = _check(item, default[key], where, problems)
        return merged
    if isinstance(default, float) and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    elif isinstance(default, list):
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        got = "no value" if value is None else f"{type(value).__name__} {value!r}"
        problems.append(f"{path}: expected {type(default).__name__}, got {got}")
    elif path in RULES and not RULES[path][0](value):
        problems.append(f"{path}: expected {RULES[path][1]}, got {value!r}")
    return value


def _combination_problems(config: dict, problems: list[str]) -> list[str]:
    """Problems between keys that are each fine on their own (keys with a problem of their own are skipped)."""
    bad = {p.split(":")[0] for p in problems}
    model, data = config["model"], config["data"]
    found = []
    if bad & {"model", "data", "model.type", "data.name"}:
        return found
    if data["name"] == "digits" and model["type"] != "mlp":
        found.append(f"model.type={model['type']} does not fit data.name=digits: use model.type=mlp "
                     "(or data.name=stdlib for the language models)")
    if data["name"] == "text" and not data["files"].strip():
        found.append("data.name=text needs data.files: a glob of your text files, e.g. data.files='corpus/*.txt'")
    if data["name"] in ("stdlib", "text", "jsonl", "csv") and model["type"] == "mlp":
        found.append(f"model.type=mlp does not fit data.name={data['name']}: use data.name=digits "
                     "(or model.type gpt, hf_gpt2 or hf_bert)")
    if model["type"] == "hf" and not model["path"].strip():
        found.append("model.type=hf needs model.path: the directory of a model saved with save_pretrained")
    labelled = data["name"] in ("jsonl", "csv")
    classifying = model["type"] == "hf" and model["task"] == "sequence-classification"
    if labelled and not data["path"].strip():
        found.append(f"data.name={data['name']} needs data.path: the file of your labelled examples")
    if labelled and not classifying:
        found.append(f"data.name={data['name']} holds labelled examples: use model.type=hf with "
                     "model.task=sequence-classification (or data.name=text for a language model)")
    if classifying and not labelled:
        found.append("model.task=sequence-classification needs labelled examples: data.name=jsonl or csv, with "
                     "data.path, data.text and data.label")
    optimizer = config["optimizer"]
    if not bad & {"optimizer", "optimizer.type", "optimizer.momentum", "optimizer.nesterov"}:
        if optimizer["type"] != "sgd":
            found += [f"optimizer.{key}={optimizer[key]} is an SGD setting; optimizer.type={optimizer['type']} keeps "
                      f"its own moments: drop optimizer.{key} or use optimizer.type=sgd"
                      for key in ("momentum", "nesterov") if optimizer[key]]
        elif optimizer["nesterov"] and not optimizer["momentum"]:
            found.append("optimizer.nesterov=true needs a momentum: set optimizer.momentum, e.g. 0.9")
    if model["type"] not in ("mlp", "hf") and not bad & {"model.n_head", "model.n_embd"} and \
            model["n_embd"] % model["n_head"]:
        found.append(f"model.n_embd={model['n_embd']} must be a multiple of model.n_head={model['n_head']}")
    return found


def _yaml(text: str, source: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error becomes a ConfigError naming ``source`` and the position."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict:
    """Read a YAML config, apply ``key=value`` overrides and validate everything.

    Args:
        path: the YAML file, or None for the defaults alone.
        overrides: dotted ``key=value`` items; values are read as YAML.

    Returns:
        The complete config: every section of ``DEFAULTS``, with the file's and the overrides' values.

    Raises:
        ConfigError: for a missing or unreadable file and for bad YAML, or else listing every
            unknown key, wrong type and out-of-range value, each with its dotted path.
    """
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML config such as "
                              "configs/digits_mlp.yaml") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {str(path)!r} is a directory; pass a YAML file in it") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") \
                from None
        raw = _yaml(text, str(path))
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(DEFAULTS)}) at the top level, "
                              f"got a {type(raw).__name__}")
    problems: list[str] = []
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            problems.append(f"override {override!r}: expected key=value, e.g. train.max_steps=10")
            continue
        try:
            value = _yaml(text, f"override {override!r}")
        except ConfigError as exc:
            problems.append(f"{exc}; quote a string value")
            continue
        node, parts = raw, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {key}: {part} is not a section")
                break
        else:
            node[parts[-1]] = value
    config = _check(raw, DEFAULTS, "", problems)
    problems += _combination_problems(config, problems)
    if config["logging"]["tensorboard"] is True:
        from ._tensorboard import tensorboard_problem

        problems += [problem for problem in [tensorboard_problem()] if problem]
    if isinstance(config.get("options"), dict) and "lr_scheduler" not in config["options"]:
        from .options import ORTTrainerOptions

        try:
            ORTTrainerOptions(config["options"])
        except ValueError as exc:
            problems += ["options." + line.strip() for line in str(exc).splitlines()[1:]]
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return config

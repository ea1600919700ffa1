"""A pretrained Hugging Face model and its tokenizer from a local directory, for the command line.

``model: {type: hf, path: DIR, task: causal-lm | masked-lm | sequence-classification}`` loads ``DIR``
with ``from_pretrained`` (``local_files_only``: never the network) and, after training, writes the
trained weights back as a directory the same ``from_pretrained`` loads (``OUTPUT_DIR/hf_model``:
``save_pretrained`` of the model and of its tokenizer), beside the ONNX export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
         "sequence-classification": "AutoModelForSequenceClassification"}
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def missing(path: str | Path) -> list[str]:
    """What ``path`` lacks to be loaded as a model (empty when nothing is missing)."""
    path = Path(path)
    if not path.is_dir():
        return [f"the directory {str(path)!r} itself (it does not exist or is not a directory)"]
    found = []
    if not (path / "config.json").is_file():
        found.append("config.json (the model's configuration)")
    if not any((path / name).is_file() for name in _WEIGHTS):
        found.append(f"the weights ({' or '.join(_WEIGHTS[:2])})")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        found.append("the tokenizer (tokenizer.json or tokenizer_config.json with its vocabulary)")
    return found


def load_pretrained(path: str | Path, task: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the checkpoint in ``path`` for ``task`` (see ``TASKS``).

    Raises:
        ValueError: naming every file the directory lacks, or what ``from_pretrained`` refused.
        ImportError: without ``transformers`` (the ``hf`` extra).
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImportError('model.type=hf needs Hugging Face transformers: pip install -e ".[hf]"') from exc
    lacking = missing(path)
    if lacking:
        raise ValueError(f"model.path={str(path)!r} is not a saved model: it lacks {'; '.join(lacking)}. Save one "
                         "with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = getattr(transformers, TASKS[task]).from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.path={str(path)!r} cannot be loaded for model.task={task}: "
                         f"{str(exc).splitlines()[0]}") from exc
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a training step returns no key/value cache
    if tokenizer.pad_token is None and (tokenizer.eos_token or tokenizer.unk_token):
        # GPT-2's tokenizer has no padding token: padded examples (classification) use its end (or unknown) token,
        # and the model finds each example's last token by it
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tokenizer_id(tokenizer) -> str:
    """What names ``tokenizer`` in the token caches' keys (``user_data.cached``): its class, name or path,
    vocabulary size and padding token."""
    return f"{type(tokenizer).__name__} {tokenizer.name_or_path} {len(tokenizer)} {tokenizer.pad_token_id}"


def save_pretrained(trainer, model, tokenizer, directory: Path) -> None:
    """Write ``trainer``'s weights into ``model`` and save it and ``tokenizer`` under ``directory``.

    The trainer's state in PyTorch's names (``state_dict(pytorch_format=True)``) is loaded into the module
    the job was built from, which ``save_pretrained`` then writes (safetensors, with its configuration).
    """
    model.load_state_dict(trainer.state_dict(pytorch_format=True))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


__all__ = ["TASKS", "load_pretrained", "missing", "save_pretrained", "tokenizer_id"]

"""The jobs the command line runs: a model, its data and its model description, from a config.

``build_job(config, rank)`` turns the ``model`` and ``data`` sections of a config (see
``ort_trainer.cli``) into a ``Job``. Batches depend only on (seed, step, rank), so a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import zoo
from .text import ByteTokenizer
from .user_data import corpus_ids


@dataclass
class Job:
    """Everything the training loop needs besides the trainer.

    Attributes:
        model: the torch module to train.
        desc: its model description (dict form).
        loss_fn: ``loss_fn(prediction, label)`` or None when the model returns its loss.
        train_batch: ``step -> tuple of arrays`` (this rank's micro-batch).
        eval_batch: ``index -> tuple of arrays`` from held-out data.
        samples_per_batch: examples in one micro-batch.
        kind: ``"lm"`` (text generation after export), ``"mlm"``, ``"classifier"`` or ``"pretrained"``
            (a model from a local directory: written back with ``save`` after training).
        save: ``save(trainer, directory)`` writes the trained model as its own format (None: no such format).
    """

    model: torch.nn.Module
    desc: dict
    loss_fn: Callable | None
    train_batch: Callable[[int], tuple]
    eval_batch: Callable[[int], tuple]
    samples_per_batch: int
    kind: str
    save: Callable | None = None


def _rng(seed: int, step: int, rank: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step, rank])


def _windows(ids: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(ids) - length - 1, size=batch)
    return np.stack([ids[s:s + length + 1] for s in starts])


def build_job(config: dict, rank: int = 0) -> Job:
    """The job a config describes, for process ``rank``.

    Raises:
        ValueError: for an unknown model type or data set, or a combination that does not fit.
        ImportError: for a Hugging Face model without ``transformers`` (``pip install -e ".[hf]"``).
    """
    model_cfg, data_cfg, seed = config["model"], config["data"], config["seed"]
    batch = config["train"]["batch_size"]
    kind = model_cfg["type"]
    if data_cfg["name"] == "digits":
        if kind != "mlp":
            raise ValueError(f"data.name=digits needs model.type=mlp, got {kind!r}")
        return _digits_job(model_cfg, seed, rank, batch)
    if kind == "hf":
        return _pretrained_job(config, rank)
    if data_cfg["name"] not in ("stdlib", "text"):
        raise ValueError(f"data.name: expected 'stdlib', 'text' or 'digits', got {data_cfg['name']!r}")
    if kind not in ("gpt", "hf_gpt2", "hf_bert"):
        raise ValueError(f"model.type: expected gpt, hf_gpt2, hf_bert, hf or mlp, got {kind!r}")
    length = model_cfg["block_size"]
    train_ids, val_ids = _lm_splits(corpus_ids(data_cfg, ByteTokenizer().encode, "bytes"), data_cfg, length, "bytes")
    vocab = ByteTokenizer.vocab_size
    torch.manual_seed(seed)

    def windows(source: np.ndarray, step: int, stream: int) -> np.ndarray:
        return _windows(source, batch, length, _rng(seed, step, rank, stream))

    if kind == "gpt":
        model = zoo.GPT(vocab, length, model_cfg["n_layer"], model_cfg["n_head"], model_cfg["n_embd"],
                        model_cfg["dropout"])
        desc = {"inputs": [("ids", ["batch", "seq"]), ("targets", ["batch", "seq"])],
                "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])]}

        def lm_batch(source, step, stream):
            w = windows(source, step, stream)
            return w[:, :-1], w[:, 1:]

        return Job(model, desc, zoo.lm_loss, lambda s: lm_batch(train_ids, s, 0), lambda i: lm_batch(val_ids, i, 1),
                   batch, "lm")
    model = _hf_model(kind, model_cfg, vocab, length)
    # byte 0 serves as hf_bert's [MASK] token
    return _hf_lm_job(model, vocab, (train_ids, val_ids), config, rank, "lm" if kind == "hf_gpt2" else "mlm",
                      mask_id=None if kind == "hf_gpt2" else 0)


def _lm_splits(ids: np.ndarray, data_cfg: dict, length: int, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """``(training, validation)`` ids of a language model's text: the last ``data.validation_fraction`` held
    out. Raises ValueError when a split is too short for one window of ``length`` + 1 (``unit``: bytes or
    tokens)."""
    cut = int(len(ids) * (1.0 - data_cfg["validation_fraction"]))
    splits = (("training", ids[:cut]), ("validation", ids[cut:]))
    short = [f"the {part} split has {len(part_ids)} {unit}" for part, part_ids in splits if len(part_ids) < length + 2]
    if short:
        raise ValueError(f"model.block_size={length} needs at least {length + 2} {unit} of text per split, but "
                         f"{' and '.join(short)} (data.max_bytes={data_cfg['max_bytes']}, data.validation_fraction="
                         f"{data_cfg['validation_fraction']}): raise data.max_bytes or lower model.block_size")
    return splits[0][1], splits[1][1]


def _hf_lm_job(model, vocab: int, splits: tuple[np.ndarray, np.ndarray], config: dict, rank: int, kind: str,
               mask_id: int | None, save: Callable | None = None) -> Job:
    """A Hugging Face language model's job on windows of ``splits``, its loss inside the model: causal
    (``mask_id`` None: the labels are the ids, which the model shifts itself) or masked (``data.mask_probability``
    of the ids replaced by ``mask_id`` and labelled, the rest labelled -100)."""
    seed, batch, length = config["seed"], config["train"]["batch_size"], config["model"]["block_size"]
    probability = config["data"]["mask_probability"]
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                       ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])]}

    def batch_of(source: np.ndarray, step: int, stream: int) -> tuple:
        ids = _windows(source, batch, length, _rng(seed, step, rank, stream))[:, :-1]
        attention = np.ones_like(ids)
        if mask_id is None:
            return ids, attention, ids.copy()
        chosen = _rng(seed, step, rank, stream + 10).random(ids.shape) < probability
        return np.where(chosen, mask_id, ids), attention, np.where(chosen, ids, -100)

    return Job(model, desc, None, lambda s: batch_of(splits[0], s, 0), lambda i: batch_of(splits[1], i, 1), batch,
               kind, save=save)


def _pretrained_job(config: dict, rank: int) -> Job:
    """A pretrained model from ``model.path`` trained on the corpus tokenized with its own tokenizer."""
    from .hf_local import load_pretrained, save_pretrained, tokenizer_id

    model_cfg, data_cfg = config["model"], config["data"]
    length, task = model_cfg["block_size"], model_cfg["task"]
    model, tokenizer = load_pretrained(model_cfg["path"], task)
    saving = lambda trainer, directory: save_pretrained(trainer, model, tokenizer, directory)  # noqa: E731
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if positions and length > positions:
        raise ValueError(f"model.block_size={length} is longer than the {positions} positions of the model in "
                         f"{model_cfg['path']}: use model.block_size <= {positions}")
    if task == "sequence-classification":
        return _classification_job(config, rank, model, tokenizer, saving)
    if task == "masked-lm" and tokenizer.mask_token_id is None:
        raise ValueError(f"model.task=masked-lm needs a tokenizer with a mask token; the one in {model_cfg['path']} "
                         "has none (set tokenizer.mask_token and save it again), or use model.task=causal-lm")
    ids = corpus_ids(data_cfg, lambda text: tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"],
                     tokenizer_id(tokenizer))
    return _hf_lm_job(model, model.config.vocab_size, _lm_splits(ids, data_cfg, length, "tokens"), config, rank,
                      "pretrained", None if task == "causal-lm" else tokenizer.mask_token_id, save=saving)


def _classification_job(config: dict, rank: int, model, tokenizer, saving) -> Job:
    """Labelled examples (``data.name`` jsonl or csv) for a sequence classifier, a validation split of them."""
    from .hf_local import tokenizer_id
    from .user_data import cached, class_numbers, encoded_examples, labelled_examples

    data_cfg, seed = config["data"], config["seed"]
    batch, length = config["train"]["batch_size"], config["model"]["block_size"]
    texts, labels, lines = labelled_examples(data_cfg)
    num_labels = model.config.num_labels
    classes = class_numbers(labels, lines, num_labels, dict(model.config.label2id or {}))
    arrays = cached([Path(data_cfg["path"]).expanduser()],
                    [tokenizer_id(tokenizer), length, data_cfg["text"], data_cfg["label"]],
                    lambda: dict(zip(("ids", "mask"), encoded_examples(texts, tokenizer, length))))
    order = np.random.default_rng([seed, 99]).permutation(len(texts))  # the split: the same for every rank
    held = max(1, int(round(len(order) * data_cfg["validation_fraction"])))
    if len(order) - held < batch:
        raise ValueError(f"train.batch_size={batch} is more than the {len(order) - held} training examples of "
                         f"{data_cfg['path']} ({held} held out for validation): lower train.batch_size")
    train_rows, val_rows = order[held:], order[:held]
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", num_labels])]}

    def rows(chosen):
        return arrays["ids"][chosen], arrays["mask"][chosen], classes[chosen]

    def train_batch(step):
        return rows(train_rows[_rng(seed, step, rank, 0).choice(len(train_rows), size=batch, replace=False)])

    def eval_batch(index):
        start = (index * batch) % len(val_rows)
        return rows(val_rows[start:start + batch])

    return Job(model, desc, None, train_batch, eval_batch, batch, "classifier", save=saving)


def _hf_model(kind: str, cfg: dict, vocab: int, length: int) -> torch.nn.Module:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"model.type={kind} needs Hugging Face transformers: pip install -e \".[hf]\"") from exc
    if kind == "hf_gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=cfg["n_embd"],
                                         n_layer=cfg["n_layer"], n_head=cfg["n_head"], resid_pdrop=cfg["dropout"],
                                         embd_pdrop=cfg["dropout"], attn_pdrop=cfg["dropout"], bos_token_id=0,
                                         eos_token_id=0, loss_type="ForCausalLM", use_cache=False)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
                                     num_attention_heads=cfg["n_head"], intermediate_size=4 * cfg["n_embd"],
                                     max_position_embeddings=length, hidden_dropout_prob=cfg["dropout"],
                                     attention_probs_dropout_prob=cfg["dropout"])
    return transformers.BertForMaskedLM(config)


def _digits_job(cfg: dict, seed: int, rank: int, batch: int) -> Job:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError("data.name=digits needs scikit-learn: pip install -e \".[examples]\"") from exc

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, digits.target.astype(np.int64), test_size=0.2, stratify=digits.target, random_state=seed)
    if batch > len(x_train):
        raise ValueError(f"train.batch_size={batch} is more than the {len(x_train)} training images of "
                         f"data.name=digits (batches are drawn without replacement): use at most {len(x_train)}")
    torch.manual_seed(seed)
    model = zoo.MLPClassifier(64, cfg["hidden"], 10, cfg["dropout"])
    desc = {"inputs": [("pixels", ["batch", 64]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 10])]}

    def train_batch(step):
        chosen = _rng(seed, step, rank, 0).choice(len(x_train), size=batch, replace=False)
        return x_train[chosen], y_train[chosen]

    def eval_batch(index):
        return x_test, y_test

    return Job(model, desc, torch.nn.functional.cross_entropy, train_batch, eval_batch, batch, "classifier")

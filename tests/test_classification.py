"""``model.task=sequence-classification`` on ``data: {name: jsonl | csv, path, text, label}``: labelled
examples of the user's, checked, tokenized (truncated to the block size, padded) and cached beside the
data; the losses equal eager PyTorch's, evaluation reports accuracy, and bad examples are named."""

import csv
import json
import logging

import numpy as np
import pytest
import torch

from ort_trainer.cli import ConfigError, load_config, read_metrics, train
from ort_trainer.jobs import build_job

from models import eager_training, save_tiny_pretrained
from tolerances import steps_bound

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

WORDS = ["def", "return", "import", "class", "while", "print", "yield", "lambda"]


def _examples(count=60):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        label = int(rng.integers(0, 3))
        words = rng.choice(WORDS, size=int(rng.integers(3, 30)))
        rows.append({"sentence": f"{['bad', 'so so', 'good'][label]} " + " ".join(words), "y": label})
    return rows


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("tiny_classifier"), "sequence-classification")


def _config(tmp_path, classifier, name, path, *extra):
    return load_config(None, [f"output_dir={tmp_path / 'out'}", "model.type=hf", f"model.path={classifier}",
                              "model.task=sequence-classification", f"data.name={name}", f"data.path={path}",
                              "data.text=sentence", "data.label=y", "model.block_size=16", "train.batch_size=4",
                              "train.max_steps=3", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
                              "lr_scheduler.type=none", "optimizer.lambda_coef=0", "export.onnx=false", *extra])


@pytest.mark.parametrize("name", ["jsonl", "csv"])
def test_labelled_examples_train_as_eager_pytorch_and_report_accuracy(tmp_path, classifier, name, caplog):
    rows = _examples()
    path = tmp_path / f"examples.{name}"
    if name == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a blank last line is skipped
    else:
        with open(path, "w", newline="") as out:
            writer = csv.DictWriter(out, ["sentence", "y"])
            writer.writeheader()
            writer.writerows(rows)
    config = _config(tmp_path, classifier, name, path)
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        job = build_job(config)
    assert any("longer than model.block_size=16 tokens and were truncated" in r.getMessage() for r in caplog.records)
    eager, expected = eager_training(job, config)
    summary = train(config)
    # float32 sums of ≤ 300 terms in another order over 3 steps (test_hf_local.py's bound)
    np.testing.assert_allclose(summary["losses"], expected, rtol=steps_bound(3, length=300))
    evaluation = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evaluation] == [3] and 0 <= evaluation[0]["eval_accuracy"] <= 1
    # the accuracy is eager's on the same held-out batches
    right = seen = 0
    with torch.no_grad():
        for index in range(2):
            ids, mask, labels = (torch.from_numpy(a) for a in job.eval_batch(index))
            right += int((eager(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).sum())
            seen += len(labels)
    assert evaluation[0]["eval_accuracy"] == right / seen
    written = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "hf_model",
                                                                               local_files_only=True)
    assert written.config.num_labels == 3


def test_label_names_map_through_the_models_label2id_and_the_tokens_are_cached(tmp_path, classifier, caplog):
    rows = [{"sentence": r["sentence"], "y": ["neg", "neutral", "pos"][r["y"]]} for r in _examples()]
    path = tmp_path / "named.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = build_job(_config(tmp_path, classifier, "jsonl", path))
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        second = build_job(_config(tmp_path, classifier, "jsonl", path))
    assert any("from the cache" in r.getMessage() for r in caplog.records)
    for a, b in zip(first.train_batch(0), second.train_batch(0)):
        np.testing.assert_array_equal(a, b)
    assert set(first.train_batch(0)[2].tolist()) <= {0, 1, 2}


def test_bad_examples_are_named_with_their_lines(tmp_path, classifier):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"sentence": "ok", "y": 1}\nnot json\n{"y": 2}\n{"sentence": "x"}\n{"sentence": 3, "y": 0}\n')
    with pytest.raises(ValueError, match=r"1 line\(s\) is not a JSON object \(line 2\); 1 line\(s\) has no field "
                                         r"'sentence' \(data.text\) \(line 3\); 1 line\(s\) has no field 'y' "
                                         r"\(data.label\) \(line 4\); 1 line\(s\) has a 'sentence' that is not text"):
        build_job(_config(tmp_path, classifier, "jsonl", path))
    path.write_text('{"sentence": "a", "y": 3}\n{"sentence": "b", "y": "happy"}\n{"sentence": "c", "y": 1}\n')
    with pytest.raises(ValueError, match=r"2 label\(s\) the model cannot take: 3 \(line 1\), 'happy' \(line 2\); "
                                         r"it has 3 classes: use 0..2 or one of \['neg', 'neutral', 'pos'\]"):
        build_job(_config(tmp_path, classifier, "jsonl", path))
    path.write_text("")
    with pytest.raises(ValueError, match=r"holds no examples"):
        build_job(_config(tmp_path, classifier, "jsonl", path))
    with pytest.raises(ValueError, match=r"is not a file"):
        build_job(_config(tmp_path, classifier, "jsonl", tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"model.task=sequence-classification needs labelled examples"):
        load_config(None, ["model.type=hf", "model.path=x", "model.task=sequence-classification"])
    with pytest.raises(ConfigError, match=r"data.name=csv holds labelled examples: use model.type=hf"):
        load_config(None, ["data.name=csv", "data.path=x.csv"])

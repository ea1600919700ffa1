"""``data: {name: text, files: GLOB}`` of the command line: the user's text files, tokenized with the
job's tokenizer under a progress bar, the ids cached beside the data and reused while the files and the
tokenizer are unchanged."""

import logging

import numpy as np
import pytest

from ort_trainer import user_data
from ort_trainer.cli import ConfigError, load_config, train
from ort_trainer.jobs import build_job
from ort_trainer.text import ByteTokenizer

from models import save_tiny_pretrained

TEXT = "def f(x):\n    return x * 2  # ünïcode\n" * 40


def _corpus(folder, count=3):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"part{i}.txt").write_text(f"# part {i}\n" + TEXT)
    return folder


def test_text_files_train_a_byte_level_gpt(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    config = load_config(None, [f"output_dir={tmp_path / 'out'}", "data.name=text", f"data.files={corpus}/*.txt",
                                "train.max_steps=2", "train.log_every=1", "train.eval_every=2", "train.batch_size=2",
                                "model.block_size=16", "export.onnx=false"])
    expected = "".join((corpus / f"part{i}.txt").read_text() + "\n" for i in range(3)).encode()
    ids = user_data.corpus_ids(config["data"], ByteTokenizer().encode, "bytes")
    assert ids.tolist() == list(expected)  # every file, in name order, each ending its line
    summary = train(config)
    assert summary["step"] == 2 and np.isfinite(summary["losses"]).all()


def test_the_tokens_are_cached_beside_the_data_until_a_file_changes(tmp_path, monkeypatch, caplog):
    corpus = _corpus(tmp_path / "corpus")
    data = {"name": "text", "files": str(corpus / "*.txt"), "max_bytes": 10 ** 6}
    first = user_data.corpus_ids(data, lambda text: list(text.encode()), "bytes")
    assert len(list((corpus / user_data.CACHE_FOLDER).glob("tokens-*.npz"))) == 1

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(user_data, "_tokenize", no_tokenizing)
    with caplog.at_level(logging.INFO, logger="ort_trainer"):
        again = user_data.corpus_ids(data, lambda text: list(text.encode()), "bytes")
    np.testing.assert_array_equal(again, first)
    assert any("from the cache" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    (corpus / "part1.txt").write_text("changed\n" + TEXT)  # another size: another key
    changed = user_data.corpus_ids(data, lambda text: list(text.encode()), "bytes")
    assert changed.tolist() != first.tolist()
    another_tokenizer = user_data.corpus_ids(data, lambda text: [b % 7 for b in text.encode()], "mod 7")
    assert another_tokenizer.max() < 7
    assert len(list((corpus / user_data.CACHE_FOLDER).glob("tokens-*.npz"))) == 3


def test_a_pretrained_tokenizer_reads_the_files(tmp_path):
    pretrained = save_tiny_pretrained(tmp_path / "model")
    corpus = _corpus(tmp_path / "corpus")
    config = load_config(None, [f"output_dir={tmp_path / 'out'}", "model.type=hf", f"model.path={pretrained}",
                                "data.name=text", f"data.files={corpus}/*.txt", "model.block_size=16",
                                "train.batch_size=2"])
    job = build_job(config)  # reads the files through the cache it fills
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained, local_files_only=True)
    expected = [t for i in range(3) for t in tokenizer((corpus / f"part{i}.txt").read_text() + "\n",
                                                       add_special_tokens=False)["input_ids"]]
    cached = list((corpus / user_data.CACHE_FOLDER).glob("tokens-*.npz"))
    assert len(cached) == 1 and np.load(cached[0])["ids"].tolist() == expected
    ids, _, labels = job.train_batch(0)
    assert ids.max() < len(tokenizer) and (labels == ids).all()  # causal-lm: the model shifts them itself


def test_missing_and_empty_files_are_named(tmp_path, caplog):
    with pytest.raises(ConfigError, match=r"data.name=text needs data.files"):
        load_config(None, ["data.name=text"])
    with pytest.raises(ValueError, match=r"matches no file"):
        user_data.matching_files(str(tmp_path / "nothing" / "*.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"all 1 matching file\(s\) are empty"):
        user_data.matching_files(str(tmp_path / "*.txt"))
    (tmp_path / "full.txt").write_text(TEXT)
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        assert user_data.matching_files(str(tmp_path / "*.txt")) == [tmp_path / "full.txt"]
    assert any("1 of 2 files are empty" in r.getMessage() for r in caplog.records)

"""``model: {type: hf, path: DIR, task: ...}`` of the command line: a model and tokenizer saved with
``save_pretrained`` (built here, offline: a tiny configuration and a tokenizer trained on the spot),
trained on the corpus tokenized with that tokenizer, and written back as a directory
``from_pretrained`` loads."""


import numpy as np
import pytest
import torch

from ort_trainer.cli import ConfigError, load_config, train
from ort_trainer.jobs import build_job
from models import eager_training, save_tiny_pretrained
from tolerances import steps_bound

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

SHORT = ["train.max_steps=3", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1", "train.batch_size=4",
         "model.block_size=16", "data.max_bytes=60000", "export.onnx=false", "lr_scheduler.type=none"]


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("tiny_gpt2"), "causal-lm")


@pytest.fixture(scope="module")
def saved_bert(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("tiny_bert"), "masked-lm")


@pytest.mark.parametrize("task", ["causal-lm", "masked-lm"])
def test_a_saved_model_trains_as_eager_pytorch_and_is_written_back(tmp_path, task, saved_gpt2, saved_bert):
    """The CLI's losses equal eager PyTorch's (AdamW, the gradient norm clipped at 1, the same batches and
    initial weights) at every step; the directory written at the end loads with ``from_pretrained``, with
    the tokenizer, and holds the trained weights: the eager model's, to the same bound."""
    source = saved_gpt2 if task == "causal-lm" else saved_bert
    config = load_config(None, [f"output_dir={tmp_path}", "model.type=hf", f"model.path={source}",
                                f"model.task={task}", "optimizer.lambda_coef=0", *SHORT])
    job = build_job(config)
    eager, expected = eager_training(job, config)
    summary = train(config)
    assert "hf_model" in summary["files"]
    # float32 sums of ≤ 300 terms (the vocabulary) in another order, over 3 steps: steps_bound(3, length=300)
    # = 5.4e-5 relative (test_parity.py's reasoning; observed ~1e-7)
    bound = steps_bound(3, length=300)
    np.testing.assert_allclose(summary["losses"], expected, rtol=bound)
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForMaskedLM
    written = auto.from_pretrained(tmp_path / "hf_model", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_model", local_files_only=True)
    assert len(tokenizer) == written.config.vocab_size
    # the trained function: the written model's loss on the next batch is the eager model's (weights are not
    # compared one by one: BERT's key biases have a gradient of rounding noise alone, which Adam's m/√v turns
    # into updates of size lr in arbitrary directions, on either side, without changing any output)
    ids, mask, labels = (torch.from_numpy(a) for a in job.train_batch(config["train"]["max_steps"]))
    with torch.no_grad():
        got = float(written(input_ids=ids, attention_mask=mask, labels=labels).loss)
        want = float(eager(input_ids=ids, attention_mask=mask, labels=labels).loss)
        initial = float(auto.from_pretrained(source, local_files_only=True)(
            input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert got == pytest.approx(want, rel=bound)
    assert got != pytest.approx(initial, rel=10 * bound)  # 3 steps moved it (by 0.4% on these tiny models)


def test_a_missing_or_incomplete_directory_names_what_is_missing(tmp_path, saved_gpt2):
    config = load_config(None, [f"output_dir={tmp_path / 'out'}", "model.type=hf", f"model.path={tmp_path / 'none'}",
                                *SHORT])
    with pytest.raises(ValueError, match=r"does not exist or is not a directory"):
        build_job(config)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((saved_gpt2 / "config.json").read_text())
    config = load_config(None, [f"output_dir={tmp_path / 'out'}", "model.type=hf", f"model.path={partial}", *SHORT])
    with pytest.raises(ValueError, match=r"lacks the weights \(model.safetensors or pytorch_model.bin\); the tokenizer"):
        build_job(config)
    with pytest.raises(ConfigError, match=r"model.type=hf needs model.path"):
        load_config(None, ["model.type=hf"])
    with pytest.raises(ConfigError, match=r"model.task=sequence-classification needs labelled examples"):
        load_config(None, ["model.type=hf", "model.path=x", "model.task=sequence-classification"])

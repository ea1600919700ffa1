"""``logging: {tensorboard: true}`` of the command line: the scalars of ``metrics.jsonl`` as TensorBoard
events under ``OUTPUT_DIR/tensorboard``, read back with TensorBoard's own reader; a resumed run keeps
one value per step; without the package, a config error before anything runs."""

import builtins
from pathlib import Path

import pytest

from ort_trainer.cli import ConfigError, load_config, read_metrics, train

pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'ort_trainer[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

DIGITS = str(Path(__file__).resolve().parents[1] / "configs" / "digits_mlp.yaml")
SHORT = ["train.max_steps=6", "train.log_every=2", "train.eval_every=3", "train.eval_batches=1",
         "train.batch_size=8", "export.onnx=false", "logging.tensorboard=true"]


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_run_writes_loss_learning_rate_speed_and_evaluation(tmp_path):
    config = load_config(DIGITS, [f"output_dir={tmp_path}", *SHORT])
    summary = train(config)
    scalars = _scalars(tmp_path / "tensorboard")
    # the digits job is a classifier: its evaluations report accuracy too
    assert set(scalars) == {"train/loss", "train/learning_rate", "train/samples_per_s", "eval/loss", "eval/accuracy"}
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [value for _, value in scalars["eval/accuracy"]] == pytest.approx(
        [r["eval_accuracy"] for r in records if "eval_accuracy" in r], rel=2 ** -23)
    assert [step for step, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [step for step, _ in scalars["eval/loss"]] == [3, 6]
    # float32 in the event file: the float64 loss of metrics.jsonl rounded once (2^-24 relative)
    assert scalars["train/loss"][-1][1] == pytest.approx(summary["losses"][-1], rel=2 ** -23)
    assert all(value > 0 for _, value in scalars["train/samples_per_s"])


def test_float16_runs_log_their_loss_scale(tmp_path):
    config = load_config(DIGITS, [f"output_dir={tmp_path}", *SHORT,
                                                     "options.mixed_precision.enabled=true"])
    train(config)
    scale = _scalars(tmp_path / "tensorboard")["train/loss_scale"]
    assert [step for step, _ in scale] == [2, 4, 6] and all(value >= 1 for _, value in scale)


def test_a_resumed_run_keeps_one_value_per_step(tmp_path):
    first = load_config(DIGITS, [f"output_dir={tmp_path}", *SHORT, "train.checkpoint_every=2",
                                                    "train.max_steps=4"])
    train(first)
    resumed = load_config(DIGITS, [f"output_dir={tmp_path}", *SHORT, "train.checkpoint_every=2"])
    train(resumed, resume=True)
    scalars = _scalars(tmp_path / "tensorboard")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [step for step, _ in scalars["train/loss"]] == [r["step"] for r in records if "loss" in r] == [2, 4, 6]
    # the first run evaluated at its last step (4) too; the resumed one from step 5 on
    assert [step for step, _ in scalars["eval/loss"]] == [r["step"] for r in records if "eval_loss" in r] == [3, 4, 6]


def test_without_the_package_the_config_says_how_to_install_it(monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match=r"logging.tensorboard: the tensorboard package is not installed; "
                                          r"pip install \"ort_trainer\[tensorboard\]\""):
        load_config(DIGITS, ["logging.tensorboard=true"])

"""The ort-trainer command line: every shipped config, the files a run writes, resume, export, mpirun,
torchrun."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ort_trainer.cli import ConfigError, load_config
from models import save_tiny_pretrained

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ORT_TRAINER = shutil.which("ort-trainer", path=str(Path(sys.executable).parent))
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
SHORT = ["train.max_steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=1",
         "export.sample_tokens=12", "data.max_bytes=300000"]


def _cli(*args, timeout=600, launcher=()):
    # stdin empty: mpiexec forwards its stdin to rank 0, and hydra ends the job (exit 255, "process reading stdin
    # too slowly") when a rank does not read what it forwards
    command = [*launcher, ORT_TRAINER, *map(str, args)] if ORT_TRAINER else [*launcher, sys.executable, "-m",
                                                                             "ort_trainer", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_trains(tmp_path, config):
    if "hf_" in config.stem:
        pytest.importorskip("transformers", reason="needs the hf extra")
    extra = []
    if config.stem == "finetune_local":  # its model.path is the user's: a tiny model saved here stands in
        extra = [f"model.path={save_tiny_pretrained(tmp_path / 'pretrained')}", "model.block_size=16"]
    result = _cli("train", config, f"output_dir={tmp_path}", *SHORT, *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["samples_per_s"] > 0 and r["lr"] >= 0 for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert "logits" in [o.name for o in session.get_outputs()]  # (and the loss, for models that return it)
    if (tmp_path / "samples.txt").exists():
        assert len((tmp_path / "samples.txt").read_text()) >= 12
    if config.stem == "finetune_local":
        assert (tmp_path / "hf_model" / "config.json").is_file() and (tmp_path / "hf_model" / "tokenizer.json").is_file()


def test_resume_continues_the_step_count_and_export_rebuilds_the_model(tmp_path):
    config = ROOT / "configs" / "gpt_stdlib.yaml"
    common = [f"output_dir={tmp_path}", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=2",
              "export.sample_tokens=0", "data.max_bytes=300000", "model.n_layer=1"]
    first = _cli("train", config, *common, "train.max_steps=4")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002.h5", "step_0000004.h5"]
    second = _cli("train", config, *common, "train.max_steps=6", "--resume")
    assert second.returncode == 0, second.stderr
    steps = [r["step"] for r in _records(tmp_path)]
    assert steps == [2, 4, 6]  # the log continues where the first run stopped
    assert "step 6:" in second.stdout
    out = tmp_path / "exported.onnx"
    exported = _cli("export", tmp_path / "checkpoints" / "step_0000006.h5", out)
    assert exported.returncode == 0, exported.stderr
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"ids": np.zeros((1, 5), np.int64)})
    assert logits.shape == (1, 5, 256)


def test_overrides_reject_unknown_keys_and_wrong_types(tmp_path):
    config = ROOT / "configs" / "digits_mlp.yaml"
    result = _cli("train", config, "train.max_stepz=3", "train.batch_size=big", "options.batch.gradient_accumulation_steps=0")
    assert result.returncode == 2
    assert "train.max_stepz: unknown key" in result.stderr
    assert "train.batch_size: expected int, got str 'big'" in result.stderr
    assert "batch.gradient_accumulation_steps: must be >= 1, got 0" in result.stderr
    with pytest.raises(ConfigError, match="options.lr_scheduler: set the schedule in the lr_scheduler section"):
        load_config(config, ["options.lr_scheduler=1"])
    assert load_config(config, ["optimizer.lr=1"])["optimizer"]["lr"] == 1.0  # an int is a fine float


def test_python_dash_m_runs_the_same_command_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ort_trainer", "train", ROOT / "configs" / "digits_mlp.yaml",
                             f"output_dir={tmp_path}", "train.max_steps=2", "train.log_every=1", "train.eval_every=2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "model.onnx").exists()


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install -e '.[mpi]'")
def test_command_line_under_mpirun(tmp_path):
    result = _cli("train", ROOT / "configs" / "gpt_stdlib.yaml", f"output_dir={tmp_path}", *SHORT, "model.n_layer=1",
                  launcher=(MPIEXEC, "-n", "2"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("wrote ") == 1  # rank 0 reports
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == [2, 4]
    assert (tmp_path / "model.onnx").exists() and (tmp_path / "samples.txt").exists()


@pytest.mark.skipif(MPIEXEC is None or TORCHRUN is None, reason="needs mpiexec and torchrun: pip install -e '.[mpi]'")
def test_command_line_under_torchrun_gives_the_losses_of_mpirun(tmp_path):
    """The same command under ``torchrun --standalone --nproc_per_node 2 -m ort_trainer``: rank 0 alone
    reports and writes; the logged losses equal ``mpirun -n 2``'s bit for bit (gloo and MPI both add
    the two ranks' gradients once, a + b)."""
    args = ["train", ROOT / "configs" / "gpt_stdlib.yaml", *SHORT, "model.n_layer=1"]
    runs = {}
    for name, launcher in (("torchrun", (TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "ort_trainer")),
                           ("mpirun", (MPIEXEC, "-n", "2", sys.executable, "-m", "ort_trainer"))):
        out = tmp_path / name
        result = subprocess.run([*launcher, *map(str, args), f"output_dir={out}"], capture_output=True, text=True,
                                timeout=600, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("wrote ") == 1  # rank 0 reports
        assert (out / "model.onnx").exists()
        runs[name] = [(r["step"], r["loss"]) for r in _records(out) if "loss" in r]
    assert runs["torchrun"] == runs["mpirun"] and [s for s, _ in runs["torchrun"]] == [2, 4], runs


DIGITS = ROOT / "configs" / "digits_mlp.yaml"


def _main(capsys, *args):
    from ort_trainer.cli import main

    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_yaml_problems_exit_2_with_one_line_and_no_traceback(tmp_path, capsys):
    broken, listed = tmp_path / "broken.yaml", tmp_path / "list.yaml"
    broken.write_text("train: {max_steps: 3\n")
    listed.write_text("- train\n- model\n")
    for config, expected in [
        (broken, f"ort-trainer: {broken}: not valid YAML at line 2, column 1: expected ',' or '}}', but got "
                 "'<stream end>'\n"),
        (tmp_path / "nope.yaml", f"ort-trainer: config file '{tmp_path / 'nope.yaml'}' does not exist; pass a YAML "
                                 "config such as configs/digits_mlp.yaml\n"),
        (listed, f"ort-trainer: {listed}: expected a mapping of sections (output_dir, seed, model, data, optimizer, "
                 "lr_scheduler, train, export, logging, options) at the top level, got a list\n"),
    ]:
        assert _main(capsys, "train", config) == (2, "", expected)


def test_every_bad_value_is_listed_with_its_fix(capsys):
    status, _, err = _main(capsys, "train", DIGITS, "train.log_every=0", "train.max_steps=-1", "seed=-1",
                           "optimizer.lr=inf", "model.dropout=1.5", "optimizer.type=adamw", "train.max_stepz=3",
                           "lr_scheduler.warmup=2", "train.eval_batches=[1", "train.batch_size=", "model.type=gpt",
                           "options.utils.frozen_weights=fc")
    assert status == 2
    lines = err.splitlines()
    assert lines[0] == "ort-trainer: invalid config:"
    assert sorted(lines[1:]) == sorted([
        "  override 'train.eval_batches=[1': not valid YAML at line 1, column 3: expected ',' or ']', but got "
        "'<stream end>'; quote a string value",
        "  seed: expected an int >= 0, got -1",
        "  model.dropout: expected a float in [0, 1), got 1.5",
        "  optimizer.type: expected one of adam, lamb, sgd, got 'adamw'",
        "  optimizer.lr: expected a finite float >= 0, got inf",
        "  lr_scheduler.warmup: expected a float in [0, 1] (a fraction of train.max_steps), got 2.0",
        "  train.max_steps: expected an int >= 1, got -1",
        "  train.log_every: expected an int >= 1 (steps between two log records), got 0",
        "  train.max_stepz: unknown key; known keys: ['batch_size', 'checkpoint_every', 'eval_batches', "
        "'eval_every', 'log_every', 'max_steps']; did you mean 'max_steps'?",
        "  train.batch_size: expected int, got no value",
        "  model.type=gpt does not fit data.name=digits: use model.type=mlp (or data.name=stdlib for the "
        "language models)",
        "  options.utils.frozen_weights: expected a list, got the str 'fc'; write ['fc']",
    ])


def test_a_float_in_exponent_form_is_a_float():
    assert load_config(DIGITS, ["optimizer.lr=1e-3"])["optimizer"]["lr"] == 1e-3  # YAML 1.1 reads it as a str


def test_debug_shows_the_traceback_of_a_user_error(capsys):
    status, _, err = _main(capsys, "train", DIGITS, "train.log_every=0", "--debug")
    assert status == 2
    assert err.startswith("Traceback (most recent call last):") and "ConfigError" in err
    assert err.endswith("train.log_every: expected an int >= 1 (steps between two log records), got 0\n")


def test_errors_found_while_running_exit_2_without_traceback_or_mpi_abort(tmp_path):
    """--resume without a checkpoint and a batch larger than the data set: found after MPI started."""
    missing = _cli("train", DIGITS, "--resume", f"output_dir={tmp_path}", timeout=300)  # --resume may come first
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.splitlines()[-1] == (
        f"ort-trainer: --resume: no checkpoint in {tmp_path / 'checkpoints'}: the run there saved none (set "
        "train.checkpoint_every > 0 to save some), or output_dir is not that run's; leave out --resume to start afresh")
    too_big = _cli("train", DIGITS, f"output_dir={tmp_path}", "train.batch_size=5000", timeout=300)
    assert too_big.returncode == 2, too_big.stderr
    assert too_big.stderr.splitlines()[-1] == (
        "ort-trainer: train.batch_size=5000 is more than the 1437 training images of data.name=digits (batches are "
        "drawn without replacement): use at most 1437")
    for result in (missing, too_big):
        assert "Traceback" not in result.stderr and "MPI_Abort" not in result.stderr


def test_export_names_a_missing_checkpoint(tmp_path, capsys):
    status, _, err = _main(capsys, "export", tmp_path / "step_0000002.h5", tmp_path / "out.onnx")
    assert status == 2
    assert err == (f"ort-trainer: export: checkpoint '{tmp_path / 'step_0000002.h5'}' does not exist; pass one that "
                   "`ort-trainer train` wrote (OUTPUT_DIR/checkpoints/step_<N>.h5, with train.checkpoint_every > 0)\n")


def test_resume_after_a_crash_mid_line_in_the_metrics_log_still_exports(tmp_path):
    common = [f"output_dir={tmp_path}", "train.log_every=1", "train.eval_every=2", "train.checkpoint_every=2"]
    first = _cli("train", DIGITS, *common, "train.max_steps=4", timeout=300)
    assert first.returncode == 0, first.stderr
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a") as log:  # the crashed run had logged step 5, then died writing step 6
        log.write('{"step": 5, "loss": 2.1, "lr": 0.003, "samples_per_s": 900.0}\n{"step": 6, "lo')
    (tmp_path / "model.onnx").unlink()
    second = _cli("train", DIGITS, *common, "train.max_steps=6", "--resume", timeout=300)
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "model.onnx").stat().st_size > 0 and (tmp_path / "loss.png").exists()
    lines = metrics.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is whole again
    assert [(r["step"], "eval_loss" in r) for r in records] == [
        (1, False), (2, False), (2, True), (3, False), (4, False), (4, True),
        (5, False), (6, False), (6, True)]
    assert records[6]["loss"] != 2.1  # step 5 of the crashed run was dropped and logged again


def test_a_second_run_into_an_earlier_runs_output_dir_stops_before_training(tmp_path):
    """Without --resume or --overwrite an output_dir holding an earlier run is refused at once, its files
    untouched (the run would have replaced its metrics, then stopped at its first checkpoint, which it may
    not overwrite); --overwrite starts afresh, deleting the earlier checkpoints first (a later --resume must
    not find them); --resume with --overwrite is refused."""
    common = [f"output_dir={tmp_path}", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=2"]
    first = _cli("train", DIGITS, *common, "train.max_steps=6", timeout=300)
    assert first.returncode == 0, first.stderr

    def files():
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    earlier = files()
    again = _cli("train", DIGITS, *common, "train.max_steps=4", timeout=300)
    assert again.returncode == 2, again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"ort-trainer: output_dir={str(tmp_path)!r} holds an earlier run (3 checkpoint(s), the newest "
        "step_0000006.h5); nothing was trained: continue it with --resume, start afresh over it with --overwrite, or give another "
        "output_dir=...")
    both = _cli("train", DIGITS, *common, "--resume", "--overwrite", timeout=300)
    assert both.returncode == 2 and both.stderr.splitlines()[-1] == (
        "ort-trainer: --resume continues the run in output_dir and --overwrite starts afresh over it: give one")
    assert files() == earlier
    fresh = _cli("train", DIGITS, *common, "train.max_steps=4", "--overwrite", timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002.h5", "step_0000004.h5"]
    assert [r["step"] for r in _records(tmp_path)] == [2, 4]


def test_the_metrics_reader_skips_a_torn_line_with_a_warning(tmp_path, caplog):
    from ort_trainer._metrics import MetricsLog, read_metrics

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"step": 1, "loss": 1.0})
    log.append({"step": 2, "loss": 0.5})
    with path.open("a") as f:
        f.write('[1]\n{"step": 3, "lo')
    with caplog.at_level("WARNING", logger="ort_trainer"):
        assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"{path} line 3 is not a JSON object", f"{path} line 4 is not a JSON object"]
    log.resume(1)
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_rank_options_are_left_to_the_launcher():
    with pytest.raises(ConfigError) as info:
        load_config(DIGITS, ["options.distributed.world_size=2", "options.distributed.world_rank=1"])
    assert ("options.distributed.world_size: set by the launcher; run `torchrun --nproc_per_node N -m ort_trainer "
            "train ...` or `mpirun -n N ort-trainer train ...` for N ranks instead") in str(info.value)
    assert "options.distributed.world_rank: set by the launcher" in str(info.value)


def test_a_job_that_does_not_fit_its_data_says_which_key_to_change(monkeypatch):
    from ort_trainer.jobs import build_job

    config = load_config(ROOT / "configs" / "gpt_stdlib.yaml",
                         ["data.max_bytes=1000", "data.validation_fraction=0.01", "model.block_size=64"])
    with pytest.raises(ValueError, match=r"model.block_size=64 needs at least 66 bytes of text per split, but the "
                                         r"validation split has 10 bytes .* raise data.max_bytes or lower "
                                         r"model.block_size"):
        build_job(config)
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):  # as if scikit-learn were not installed
        monkeypatch.setitem(sys.modules, name, None)  # (its submodules too: an earlier test may have imported them)
    with pytest.raises(ImportError, match=r'data.name=digits needs scikit-learn: pip install -e ".\[examples\]"'):
        build_job(load_config(DIGITS))


def test_sgd_keys_become_torch_sgds_momentum_nesterov_and_weight_decay():
    import torch

    from ort_trainer.cli import _optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))  # 0.weight decays; biases, norm not
    config = load_config(DIGITS, ["optimizer.type=sgd", "optimizer.momentum=0.9", "optimizer.nesterov=true",
                                  "optimizer.lambda_coef=0.02", "optimizer.no_decay=[bias, '1.']"])
    sgd = _optimizer(config, model)
    assert type(sgd).__name__ == "SGDConfig"
    assert sgd.params == [{"params": ["0.bias", "1.weight", "1.bias"], "weight_decay": 0.0}]
    assert sgd.group_hyperparameters(None) == {"lr": config["optimizer"]["lr"], "momentum": 0.9, "dampening": 0.0,
                                               "nesterov": True, "weight_decay": 0.02}
    assert sgd.group_hyperparameters(0)["weight_decay"] == 0.0
    plain = _optimizer(load_config(DIGITS, ["optimizer.type=sgd", "optimizer.lambda_coef=0"]), model)
    assert plain.params == [] and not plain.has_momentum


def test_sgd_keys_with_another_optimizer_or_without_momentum_are_errors():
    with pytest.raises(ConfigError) as info:
        load_config(DIGITS, ["optimizer.type=adam", "optimizer.momentum=0.9", "optimizer.nesterov=true"])
    assert str(info.value).splitlines()[1:] == [
        "  optimizer.momentum=0.9 is an SGD setting; optimizer.type=adam keeps its own moments: drop "
        "optimizer.momentum or use optimizer.type=sgd",
        "  optimizer.nesterov=True is an SGD setting; optimizer.type=adam keeps its own moments: drop "
        "optimizer.nesterov or use optimizer.type=sgd"]
    with pytest.raises(ConfigError, match=r"optimizer.nesterov=true needs a momentum: set optimizer.momentum"):
        load_config(DIGITS, ["optimizer.type=sgd", "optimizer.nesterov=true"])
    with pytest.raises(ConfigError, match=r"optimizer.momentum: expected a finite float >= 0, got -0.5"):
        load_config(DIGITS, ["optimizer.type=sgd", "optimizer.momentum=-0.5"])

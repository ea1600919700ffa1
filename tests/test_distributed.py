"""Data-parallel training with real ``mpiexec -n 2`` jobs (api.md section 8)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

JOB = Path(__file__).with_name("mpi_job.py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

try:
    import mpi4py  # noqa: F401
except ImportError:  # pragma: no cover
    mpi4py = None

pytestmark = pytest.mark.skipif(MPIEXEC is None or mpi4py is None,
                                reason="needs mpi4py and mpiexec: pip install -e '.[mpi]'")


def _run(out: Path, ranks: int, *args: str, check: bool = True, timeout: float = 300):
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(JOB), "--out", str(out), *args]
    if ranks > 1:
        command = [MPIEXEC, "-n", str(ranks), *command]
    env = dict(os.environ)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def _facts(out: Path):
    return [json.loads((out / f"facts_rank{rank}.json").read_text()) for rank in (0, 1)]


def _weights(out: Path, rank: int):
    with np.load(out / f"weights_rank{rank}.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 rank x global batch 16, 20 Adam steps."""
    out = tmp_path_factory.mktemp("single")
    _run(out, 1)
    return _weights(out, 0)


@pytest.fixture(scope="module")
def accumulated_reference(tmp_path_factory):
    """1 rank, 2 micro-batches of 8 per step."""
    out = tmp_path_factory.mktemp("single_acc")
    _run(out, 1, "--accumulation", "2")
    return _weights(out, 0)


def _check(out, expected, facts):
    rank0, rank1 = _weights(out, 0), _weights(out, 1)
    for name, value in expected.items():
        np.testing.assert_array_equal(rank0[name], rank1[name])  # bitwise identical on both ranks
        error = np.linalg.norm(rank0[name] - value) / np.linalg.norm(value)
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
    assert [f["optimization_step"] for f in facts] == [20, 20]  # counted across a resume too
    assert [f["threads"] for f in facts] == [max(1, len(os.sched_getaffinity(0)) // 2)] * 2


def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, reference):
    _run(tmp_path, 2)
    facts = _facts(tmp_path)
    assert [(f["rank"], f["size"], f["local_rank"]) for f in facts] == [(0, 2, 0), (1, 2, 1)]
    _check(tmp_path, reference, facts)


@pytest.mark.parametrize("post", [False, True], ids=["per-micro-batch", "post-accumulation"])
def test_two_ranks_with_accumulation(tmp_path, accumulated_reference, post):
    _run(tmp_path, 2, "--accumulation", "2", *(["--post-accumulation"] if post else []))
    _check(tmp_path, accumulated_reference, _facts(tmp_path))


def test_zero_stage_1_shards_the_optimizer_state(tmp_path, reference):
    _run(tmp_path, 2, "--zero", "1")
    facts = _facts(tmp_path)
    _check(tmp_path, reference, facts)
    total = sum(v.size for v in reference.values()) * 2  # two Adam moments per weight
    local = [f["local_optimizer_state_elements"] for f in facts]
    assert sum(local) == total and max(local) <= 0.6 * total, local
    assert [f["gathered_optimizer_weights"] for f in facts] == [4, 4]  # state_dict gathers every shard


def test_zero_stage_1_with_lamb_keeps_whole_tensors(tmp_path):
    single = tmp_path / "single"
    _run(single, 1, "--optimizer", "lamb")
    _run(tmp_path / "zero", 2, "--zero", "1", "--optimizer", "lamb")
    _check(tmp_path / "zero", _weights(single, 0), _facts(tmp_path / "zero"))


def test_zero_checkpoint_resume_under_mpirun(tmp_path, reference):
    """2 ranks with ZeRO: 10 steps, save (rank 0 writes the gathered state), resume for 10 more."""
    ckpt = tmp_path / "ckpt.h5"
    _run(tmp_path / "first", 2, "--zero", "1", "--steps", "10", "--save", str(ckpt))
    assert ckpt.exists() and [p.name for p in tmp_path.iterdir() if p.suffix == ".h5"] == ["ckpt.h5"]
    _run(tmp_path / "second", 2, "--zero", "1", "--steps", "10", "--load", str(ckpt))
    _check(tmp_path / "second", reference, _facts(tmp_path / "second"))


def test_an_error_on_one_rank_ends_the_job(tmp_path):
    started = time.monotonic()
    result = _run(tmp_path, 2, "--fail-at-step", "3", check=False, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert "deliberate failure on rank 1 at step 3" in result.stderr


def _timed(out: Path, *args: str, timeout_variable: str = "", limit: float = 120):
    env = dict(os.environ, ORT_TRAINER_COLLECTIVE_TIMEOUT=timeout_variable) if timeout_variable else None
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(JOB), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=limit, env=env)
    return result, time.monotonic() - started


def test_a_rank_that_skips_a_step_ends_the_job_naming_the_ranks(tmp_path):
    """Rank 1 catches a bad batch's error and goes on: it makes one train_step fewer than rank 0.

    Before the collectives were checked, rank 0 then waited in its last all-reduce forever.
    """
    result, elapsed = _timed(tmp_path, "--bad-batch-at-step", "5")
    assert result.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert re.search(r"rank 0 is in allreduce_sum at train_step 19 \(collective #\d+\); rank 1 has left the job: "
                     r"its script ended after train_step 18", result.stderr), result.stderr
    assert "CollectiveMismatchError" in result.stderr
    assert not (tmp_path / "facts_rank0.json").exists()  # rank 0 never got past its 20th step


def test_a_rank_that_leaves_its_loop_early_ends_the_job(tmp_path):
    result, elapsed = _timed(tmp_path, "--leave-at-step", "7")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stderr)
    assert re.search(r"rank 0 is in allreduce_sum at train_step 7 \(collective #\d+\); rank 1 has left the job: "
                     r"its script ended after train_step 6", result.stderr), result.stderr


def test_a_stuck_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    result, elapsed = _timed(tmp_path, "--stall-at-step", "5", timeout_variable="4")
    assert result.returncode != 0
    assert 4 <= elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert re.search(r"rank 0: waited 4 s in allreduce_sum at train_step 5 \(collective #\d+\), but rank\(s\) \[1\] "
                     r"never arrived", result.stderr), result.stderr
    assert "raise ORT_TRAINER_COLLECTIVE_TIMEOUT (seconds, now 4)" in result.stderr


def test_a_malformed_collective_timeout_is_refused(tmp_path):
    result, _ = _timed(tmp_path, "--steps", "1", timeout_variable="ten minutes")
    assert result.returncode != 0
    assert ("ORT_TRAINER_COLLECTIVE_TIMEOUT='ten minutes': expected a positive number of seconds (e.g. 600)"
            in result.stderr), result.stderr


def test_ranks_at_different_steps_are_stopped_at_their_first_all_reduce(tmp_path):
    ckpt = tmp_path / "ckpt.h5"
    _run(tmp_path / "first", 1, "--steps", "3", "--save", str(ckpt))
    result, elapsed = _timed(tmp_path / "second", "--steps", "3", "--load", str(ckpt), "--load-on-rank-0-only")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stderr)
    assert re.search(r"rank 0 is in allreduce_sum at train_step 3 \(collective #\d+\); rank 1 is in allreduce_sum at "
                     r"train_step 0 \(collective #\d+\)", result.stderr), result.stderr

"""Data-parallel training with real ``mpiexec -n 2`` jobs (api.md section 8)."""

import json
import os
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

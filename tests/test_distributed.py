"""Data-parallel training with real ``mpiexec -n 2`` and ``torchrun --nproc_per_node 2`` jobs (api.md
section 8), with each backend that runs on the CPU: MPI and torch.distributed's gloo; and, marked
``cuda`` (``make gpu-check``), NCCL on two GPUs and gloo with two ranks on CUDA buffers of one GPU."""

import functools
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
from tolerances import check

JOB = Path(__file__).with_name("mpi_job.py")
COLLECTIVES_JOB = Path(__file__).with_name("collectives_job.py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
# torchrun is torch's console script for torch.distributed.run; --standalone: one node, a free port
TORCHRUN = [shutil.which("torchrun", path=str(Path(sys.executable).parent))
            or shutil.which("torchrun") or sys.executable, "--standalone", "--nproc_per_node"]
if TORCHRUN[0] == sys.executable:  # pragma: no cover - a torch install without its scripts
    TORCHRUN[1:1] = ["-m", "torch.distributed.run"]

try:
    import mpi4py  # noqa: F401
except ImportError:  # pragma: no cover
    mpi4py = None

BACKENDS = ["mpi", "gloo"]
# Two ranks against one with twice the batch (mpi_job.py: the MLP, 20 Adam or Lamb steps clipped at
# norm 1, 16 rows a step): each weight gradient sums the same 16 rows, in one sum or as partial sums
# of 8 (4 with 2 micro-batches) that accumulation and the all-reduce add up (the means and the
# 1/ranks, 1/window scales are exact powers of two), at most 16·u apart per step (Higham); with ZeRO
# the clipping norm's 837 squares are also summed as two ranges of 419 and 418, at most 837·u / 2
# apart. Carried through 20 steps: ≥ 20 · 16 · u = 1.9e-5 at worst. The test holds the tighter
# 1e-5, below that worst case (which has every rounding add the same way). Observed at 1 and 2
# threads: 2.1e-7, 48x under.
DATA_PARALLEL_BOUND = 1e-5
# The same on two GPUs with NCCL (not run yet: it needs two GPUs): cuBLAS and ONNX Runtime's CUDA
# kernels may also split a sum (≤ 64 terms) differently for 8 rows than for 16, and NCCL adds the
# ranks' gradients in its own order: 20 steps · (64 + 837 / 2) · u = 5.8e-4 at worst with ZeRO's
# norm; the test holds 1e-4, 10x the CPU bound. Not measured.
NCCL_BOUND = 1e-4
# Two ranks sharing one GPU through gloo against one rank with twice the batch, 10 steps: the same
# arithmetic as with NCCL (the two ranks' gradients added once, a + b, exact up to one rounding
# either way; gloo's copies through pinned host memory are exact), so the same per-step bound as
# NCCL's: 10 · (64 + 837 / 2) · u = 2.9e-4 at worst; the test holds NCCL's 1e-4. Not measured.
GLOO_ON_ONE_GPU_BOUND = NCCL_BOUND


def _needs_mpi():
    if MPIEXEC is None or mpi4py is None:
        pytest.skip("needs mpi4py and mpiexec: pip install -e '.[mpi]'")


@functools.cache
def _two_rank_problem() -> str | None:
    """Why ``mpiexec -n 2`` cannot start a 2-rank mpi4py job here (None: it can).

    The cuda tests check it first: on a GPU machine the MPI is put together by hand, and an mpi4py
    that cannot load an MPI library, or one built against another MPI than this mpiexec's (each
    process then a world of 1), is a missing MPI, to be skipped with its reason like a missing mpiexec.
    """
    if MPIEXEC is None or mpi4py is None:
        return "needs mpi4py and mpiexec: pip install -e '.[mpi]'"
    # each rank writes one delimited token: the two ranks' lines can reach the pipe merged ("2\n" twice read
    # as "22" once was), so the sizes are counted by their tokens, not by lines
    command = [MPIEXEC, "-n", "2", sys.executable, "-c",
               "import sys; from mpi4py import MPI; sys.stdout.write(f'<size {MPI.COMM_WORLD.Get_size()}>')"]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"needs a working mpiexec and mpi4py: {MPIEXEC} -n 2 python failed: {exc}"
    sizes = re.findall(r"<size (\d+)>", probe.stdout)
    if probe.returncode != 0 or sizes != ["2", "2"]:
        return (f"needs a working mpiexec and mpi4py: `{MPIEXEC} -n 2` gave exit {probe.returncode} and world sizes "
                f"{sizes} (expected [2, 2]: is mpi4py built against this mpiexec's MPI?) "
                f"{probe.stdout.strip()[-200:]} {probe.stderr.strip()[-400:]}")
    return None


def _needs_two_ranks():
    problem = _two_rank_problem()
    if problem is not None:
        pytest.skip(problem)


def _launch(launcher: str, ranks: int) -> list[str]:
    """The command line prefix that starts ``ranks`` processes of a Python script with ``launcher``
    (torchrun runs the script with its own Python)."""
    return [MPIEXEC, "-n", str(ranks), sys.executable] if launcher == "mpirun" else [*TORCHRUN, str(ranks)]


def _run(out: Path, ranks: int, *args: str, check: bool = True, timeout: float = 300, job: Path = JOB,
         launcher: str = "mpirun"):
    if launcher == "mpirun":
        _needs_mpi()
    out.mkdir(parents=True, exist_ok=True)
    command = [str(job), "--out", str(out), *args]
    command = _launch(launcher, ranks) + command if ranks > 1 else [sys.executable, *command]
    env = dict(os.environ)
    # stdin empty: mpiexec forwards its stdin to rank 0, and hydra ends the job (exit 255, "process reading stdin
    # too slowly") when a rank does not read what it forwards
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            stdin=subprocess.DEVNULL)
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


def _check(out, expected, facts, backend="mpi"):
    assert [f["backend"] for f in facts] == [backend] * 2
    rank0, rank1 = _weights(out, 0), _weights(out, 1)
    for name, value in expected.items():
        np.testing.assert_array_equal(rank0[name], rank1[name])  # bitwise identical on both ranks
        error = np.linalg.norm(rank0[name] - value) / np.linalg.norm(value)
        check(error, DATA_PARALLEL_BOUND, f"{name}: relative error {error:.2e}")
    assert [f["optimization_step"] for f in facts] == [20, 20]  # counted across a resume too
    assert [f["threads"] for f in facts] == [max(1, len(os.sched_getaffinity(0)) // 2)] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, reference, backend):
    _run(tmp_path, 2, "--backend", backend)
    facts = _facts(tmp_path)
    assert [(f["rank"], f["size"], f["local_rank"]) for f in facts] == [(0, 2, 0), (1, 2, 1)]
    _check(tmp_path, reference, facts, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("post", [False, True], ids=["per-micro-batch", "post-accumulation"])
def test_two_ranks_with_accumulation(tmp_path, accumulated_reference, post, backend):
    _run(tmp_path, 2, "--accumulation", "2", "--backend", backend, *(["--post-accumulation"] if post else []))
    _check(tmp_path, accumulated_reference, _facts(tmp_path), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_stage_1_shards_the_optimizer_state(tmp_path, reference, backend):
    """837 weights: ranges of 419 and 418, so gloo gathers them through its padded path."""
    _run(tmp_path, 2, "--zero", "1", "--backend", backend)
    facts = _facts(tmp_path)
    _check(tmp_path, reference, facts, backend)
    total = sum(v.size for v in reference.values()) * 2  # two Adam moments per weight
    local = [f["local_optimizer_state_elements"] for f in facts]
    assert sum(local) == total and max(local) <= 0.6 * total, local
    assert [f["gathered_optimizer_weights"] for f in facts] == [4, 4]  # state_dict gathers every shard


def test_zero_stage_1_with_lamb_keeps_whole_tensors(tmp_path):
    single = tmp_path / "single"
    _run(single, 1, "--optimizer", "lamb")
    _run(tmp_path / "zero", 2, "--zero", "1", "--optimizer", "lamb")
    _check(tmp_path / "zero", _weights(single, 0), _facts(tmp_path / "zero"))


def _two_ranks_on_one_device(out: Path, device: str, bound: float):
    """1 rank x batch 16 on ``device`` against 2 ranks x batch 8, both on ``device``, with gloo:
    after 10 steps, with ZeRO stage 0 and 1, both ranks' weights are bitwise equal and within
    ``bound`` of the one rank's."""
    _run(out / "single", 1, "--device", device, "--steps", "10")
    expected = _weights(out / "single", 0)
    single = json.loads((out / "single" / "facts_rank0.json").read_text())
    assert (single["device"], single["optimization_step"]) == (device, 10)
    total = sum(v.size for v in expected.values()) * 2  # two Adam moments per weight
    for zero in ("0", "1"):
        run = out / f"gloo_zero{zero}"
        _run(run, 2, "--device", device, "--backend", "gloo", "--zero", zero, "--steps", "10")
        facts = _facts(run)
        assert [(f["rank"], f["backend"], f["device"], f["optimization_step"]) for f in facts] == [
            (0, "gloo", device, 10), (1, "gloo", device, 10)]
        local = [f["local_optimizer_state_elements"] for f in facts]
        if zero == "0":
            assert local == [total, total], local
        else:  # ranges of 419 and 418 weights: the padded all-gather
            assert sum(local) == total and max(local) <= 0.6 * total, local
        rank0, rank1 = _weights(run, 0), _weights(run, 1)
        for name, value in expected.items():
            np.testing.assert_array_equal(rank0[name], rank1[name])  # bitwise identical on both ranks
            error = np.linalg.norm(rank0[name] - value) / np.linalg.norm(value)
            check(error, bound, f"ZeRO {zero}, {name}: relative error {error:.2e}")


def test_two_ranks_on_one_device_with_gloo_on_the_cpu(tmp_path):
    """The cuda test's jobs and checks (test_two_ranks_on_one_gpu_with_gloo_equal_one_rank_with_twice_the_batch)
    with the buffers on the CPU: only the device differs (the probe of mpiexec they start with too)."""
    _needs_two_ranks()
    _two_ranks_on_one_device(tmp_path, "cpu", DATA_PARALLEL_BOUND)


@pytest.mark.parametrize("saved, resumed", [("mpi", "mpi"), ("gloo", "gloo"), ("gloo", "mpi")],
                         ids=["mpi", "gloo", "gloo-then-mpi"])
def test_zero_checkpoint_resume_under_mpirun(tmp_path, reference, saved, resumed):
    """2 ranks with ZeRO: 10 steps, save (rank 0 writes the gathered state), resume for 10 more;
    the checkpoint does not depend on the backend that wrote it."""
    ckpt = tmp_path / "ckpt.h5"
    _run(tmp_path / "first", 2, "--zero", "1", "--steps", "10", "--save", str(ckpt), "--backend", saved)
    assert ckpt.exists() and [p.name for p in tmp_path.iterdir() if p.suffix == ".h5"] == ["ckpt.h5"]
    assert [f["backend"] for f in _facts(tmp_path / "first")] == [saved] * 2
    _run(tmp_path / "second", 2, "--zero", "1", "--steps", "10", "--load", str(ckpt), "--backend", resumed)
    _check(tmp_path / "second", reference, _facts(tmp_path / "second"), resumed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_error_on_one_rank_ends_the_job(tmp_path, backend):
    """The traceback reaches stderr under gloo too (torch's excepthook wrapper would buffer it past MPI_Abort)."""
    started = time.monotonic()
    result = _run(tmp_path, 2, "--fail-at-step", "3", "--backend", backend, check=False, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert "[rank 1] uncaught exception; aborting the MPI job" in result.stderr, result.stderr
    assert "RuntimeError: deliberate failure on rank 1 at step 3" in result.stderr, result.stderr


def _timed(out: Path, *args: str, timeout_variable: str = "", limit: float = 120, launcher: str = "mpirun"):
    if launcher == "mpirun":
        _needs_mpi()
    env = dict(os.environ, ORT_TRAINER_COLLECTIVE_TIMEOUT=timeout_variable) if timeout_variable else None
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = subprocess.run([*_launch(launcher, 2), str(JOB), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=limit, env=env, stdin=subprocess.DEVNULL)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_leaves_its_loop_early_ends_the_job(tmp_path, backend):
    """Under gloo too: the header exchange over MPI precedes every torch.distributed collective."""
    result, elapsed = _timed(tmp_path, "--leave-at-step", "7", "--backend", backend)
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stderr)
    assert re.search(r"rank 0 is in allreduce_sum at train_step 7 \(collective #\d+\); rank 1 has left the job: "
                     r"its script ended after train_step 6", result.stderr), result.stderr


def _a_killed_rank_ends_the_job(out: Path, *args: str, launcher: str = "mpirun"):
    """Rank 1 is killed with SIGKILL at step 3 (no handler runs, no goodbye over MPI): the launcher
    must end rank 0, which waits for it in its next collective, at once rather than after the
    collective timeout; and the job must fail."""
    result, _ = _timed(out, "--kill-at-step", "3", *args, limit=240, launcher=launcher)
    finished = time.time()
    assert (out / "killed_at.txt").exists(), result.stdout + result.stderr  # rank 1 reached step 3
    since_kill = finished - float((out / "killed_at.txt").read_text())
    assert result.returncode != 0, result.stdout + result.stderr
    assert since_kill < 30, f"the job ended {since_kill:.1f} s after rank 1 was killed:\n{result.stderr}"
    assert not (out / "facts_rank0.json").exists()  # rank 0 never finished its 20 steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_rank_ends_the_job(tmp_path, backend):
    _a_killed_rank_ends_the_job(tmp_path, "--backend", backend)


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


def _expected_collectives(ranks: int) -> dict:
    """What collectives_job.py's buffers must hold after each collective, for ``ranks`` ranks."""
    gathered = {}
    for counts in ([5] * ranks, [7 if r % 2 == 0 else 3 for r in range(ranks)],
                   [3 if r % 2 == 0 else 7 for r in range(ranks)]):
        gathered[str(counts)] = [100.0 * (r + 1) + i for r, count in enumerate(counts) for i in range(count)]
    return {
        "allreduce_sum": [float(i * ranks * (ranks + 1) // 2) for i in range(1000)],
        "allreduce_slice": lambda rank: [float(rank)] * 2 + [float(ranks * (ranks - 1) // 2)] * 4 + [float(rank)] * 4,
        "broadcast": {"float32": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "int64": [0, 7], "bool": [True, False],
                      "scalar": 3.5},
        "allgather": gathered,
        "allgather_object": [{"rank": r} for r in range(ranks)],
    }


def _check_collectives(out: Path, backend: str, device: str = "cpu"):
    """What collectives_job.py's 2 ranks wrote, against the known values."""
    expected = _expected_collectives(2)
    for rank in (0, 1):
        got = json.loads((out / f"collectives_rank{rank}.json").read_text())
        assert (got["class"], got["backend"], got["device"]) == (
            {"mpi": "MPICommunicator"}.get(backend, "TorchDistributedCommunicator"), backend, device)
        assert got["allreduce_sum"] == expected["allreduce_sum"]
        assert got["allreduce_slice"] == expected["allreduce_slice"](rank)
        assert got["broadcast"] == expected["broadcast"]
        assert got["broadcast_from_last_rank"] == [1.0] * 4
        assert got["allgather"] == expected["allgather"]
        assert got["allgather_object"] == expected["allgather_object"]
        _check_refusals(got["errors"], backend, ranks=2, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_collective_on_known_values(tmp_path, backend):
    """The communicator alone: in-place all-reduce (of a slice too), broadcast of every buffer dtype
    the engine holds (float32, int64, bool, 0-d), all-gather of equal ranges (in place) and of unequal
    ranges both ways round, twice (gloo pads them), and the refusals, which leave the ranks in step."""
    _run(tmp_path, 2, "--backend", backend, job=COLLECTIVES_JOB, timeout=120)
    _check_collectives(tmp_path, backend)


def _check_refusals(errors: dict, backend: str, ranks: int, device: str = "cpu"):
    device_fix = {"mpi": "the MPI backend moves host buffers, and this buffer is on meta: use "
                         "distributed.backend='nccl'",
                  "gloo": f"the gloo communicator moves buffers on {device}, and this buffer is on meta: make it for "
                          "the device the engine's buffers are on",
                  "nccl": "the nccl communicator moves buffers on cuda:"}[backend]
    assert errors["device"].startswith("RuntimeError: " + device_fix), errors["device"]
    assert "the buffer must be contiguous" in errors["strided"]
    assert f"allgather: counts [5, 4] must give one range per rank ({ranks})" in errors["counts"]


def test_a_single_process_job_runs_the_communicator_too(tmp_path):
    """Rank 0 of 1 (no mpiexec): the gloo process group forms from a store on a free port. With
    ``--device auto``, the device setup_onnxruntime_with_mpi picked: the CPU here (a GPU in the cuda test)."""
    _run(tmp_path, 1, "--backend", "gloo", "--device", "auto", job=COLLECTIVES_JOB, timeout=120)
    got = json.loads((tmp_path / "collectives_rank0.json").read_text())
    assert got["device"] == "cpu"
    expected = _expected_collectives(1)
    assert got["allreduce_sum"] == expected["allreduce_sum"] and got["allgather"] == expected["allgather"]


# ---- choosing the backend (no MPI job needed) -------------------------------------------------------
def test_the_backend_option_and_its_default():
    from ort_trainer import ORTTrainerOptions
    from ort_trainer.distributed import resolve_backend

    assert ORTTrainerOptions().distributed.backend == "auto"
    assert ORTTrainerOptions({"distributed": {"backend": "gloo"}}).distributed.backend == "gloo"
    assert [resolve_backend("auto", d) for d in ("cpu", "cuda", "cuda:3")] == ["mpi", "nccl", "nccl"]
    assert resolve_backend("gloo", "cpu") == "gloo"
    with pytest.raises(ValueError, match=r"distributed.backend: must be one of \['auto', 'mpi', 'gloo', 'nccl'\], "
                                         r"got 'ucc'"):
        ORTTrainerOptions({"distributed": {"backend": "ucc"}})


def test_nccl_on_the_cpu_is_an_options_error():
    from ort_trainer import ORTTrainerOptions

    with pytest.raises(ValueError, match=r"distributed.backend: 'nccl' moves CUDA buffers, but device.id is 'cpu'; "
                                         r"on the CPU use 'gloo' or 'mpi'"):
        ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": {"backend": "nccl"}})


def test_backend_problems_name_the_fix():
    import torch.distributed

    from ort_trainer.distributed import backend_problem, make_communicator

    problem = backend_problem("mpi", "cuda:1", 2)
    assert problem.startswith("'mpi' moves host buffers, but device.id is 'cuda:1'") and "use 'nccl'" in problem
    assert "or 'gloo', which copies them through host memory" in problem
    assert backend_problem("auto", "cpu", 2) is None and backend_problem("gloo", "cpu", 2) is None
    assert backend_problem("auto", "cuda", 1) is None  # one process makes no collectives
    if not torch.distributed.is_nccl_available():  # this CPU build of torch
        assert "has no 'nccl' backend; install a CUDA build of torch on Linux" in backend_problem("nccl", "cuda:0", 2)
        assert "has no 'nccl' backend" in backend_problem("auto", "cuda:0", 2)
    with pytest.raises(ValueError, match="distributed.backend: 'nccl' moves CUDA buffers"):
        make_communicator("nccl", "cpu", 2, 0)  # refused before MPI is touched


def test_gloo_moves_cuda_buffers_too():
    """Ranks that share a GPU (NCCL refuses two ranks on one device) take gloo on its CUDA buffers."""
    import torch

    from ort_trainer.comm.torch import _buffer_device
    from ort_trainer.distributed import backend_problem, resolve_backend

    assert torch.distributed.is_gloo_available()  # this torch build; the cuda tests use the GPU machine's
    for device in ("cuda", "cuda:0", "cuda:3"):
        assert backend_problem("gloo", device, 2) is None and backend_problem("gloo", device, 1) is None
        assert resolve_backend("gloo", device) == "gloo" and resolve_backend("auto", device) == "nccl"
    assert _buffer_device("gloo", "cuda:0") == torch.device("cuda", 0)  # the engine's GPU: no host buffer
    assert _buffer_device("gloo", "cpu") == torch.device("cpu")
    assert _buffer_device("nccl", "cuda:1") == torch.device("cuda", 1)


def test_a_torch_build_without_gloo_is_named_with_the_fix_for_the_device(monkeypatch):
    import torch.distributed

    from ort_trainer.distributed import backend_problem

    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: False)
    on_cpu, on_gpu = backend_problem("gloo", "cpu", 2), backend_problem("gloo", "cuda:0", 2)
    assert "has no 'gloo' backend; install a torch build with gloo, or use 'mpi' on the CPU" in on_cpu
    assert "has no 'gloo' backend; install a torch build with gloo, or use 'nccl'" in on_gpu
    assert "has no 'nccl' backend; install a CUDA build of torch on Linux" in backend_problem("nccl", "cuda:0", 2)


# ---- NCCL on GPUs (make gpu-check; skipped without CUDAExecutionProvider, a CUDA torch and a GPU) --------
def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.cuda
def test_nccl_collectives_on_known_values(tmp_path):
    """The NCCL communicator on CUDA buffers: 2 ranks on 2 GPUs (1 rank where there is one GPU;
    NCCL refuses two ranks on one GPU)."""
    ranks = min(2, _gpus())
    _run(tmp_path, ranks, "--backend", "nccl", job=COLLECTIVES_JOB, timeout=300)
    expected = _expected_collectives(ranks)
    for rank in range(ranks):
        got = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        assert (got["class"], got["device"]) == ("TorchDistributedCommunicator", f"cuda:{rank}")
        assert got["allreduce_sum"] == expected["allreduce_sum"]
        assert got["allreduce_slice"] == expected["allreduce_slice"](rank)
        assert got["broadcast"] == expected["broadcast"]
        assert got["allgather"] == expected["allgather"]
        _check_refusals(got["errors"], "nccl", ranks)


@pytest.mark.cuda
def test_two_gpus_with_nccl_equal_one_gpu_with_twice_the_batch(tmp_path):
    """2 ranks x batch 8 on 2 GPUs, gradients all-reduced by NCCL in device memory == 1 GPU x batch 16,
    and with ZeRO stage 1."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    _needs_two_ranks()
    _run(tmp_path / "single", 1, "--device", "auto")
    expected = _weights(tmp_path / "single", 0)
    for zero in ("0", "1"):
        out = tmp_path / f"nccl_zero{zero}"
        _run(out, 2, "--device", "auto", "--backend", "nccl", "--zero", zero)
        facts = _facts(out)
        assert [f["backend"] for f in facts] == ["nccl", "nccl"]
        rank0, rank1 = _weights(out, 0), _weights(out, 1)
        for name, value in expected.items():
            np.testing.assert_array_equal(rank0[name], rank1[name])
            error = np.linalg.norm(rank0[name] - value) / np.linalg.norm(value)
            check(error, NCCL_BOUND, f"ZeRO {zero}, {name}: relative error {error:.2e}")


# ---- gloo with two ranks on one GPU (make gpu-check): what NCCL refuses, on the same torch.distributed path --
@pytest.mark.cuda
def test_two_ranks_on_one_gpu_with_gloo_equal_one_rank_with_twice_the_batch(tmp_path):
    """2 ranks x batch 8, both on cuda:0, gradients all-reduced (and with ZeRO stage 1 the weights
    all-gathered) by gloo on the CUDA buffers == 1 rank x batch 16 on cuda:0, after 10 steps."""
    _needs_two_ranks()
    _two_ranks_on_one_device(tmp_path, "cuda:0", GLOO_ON_ONE_GPU_BOUND)


@pytest.mark.cuda
def test_gloo_collectives_on_cuda_buffers_of_one_gpu(tmp_path):
    """The gloo communicator on CUDA buffers, 2 ranks on cuda:0: every collective of
    test_each_collective_on_known_values (float32, int64, bool and 0-d broadcasts; in-place and
    padded all-gathers) on known values, and the refusals."""
    _needs_two_ranks()
    _run(tmp_path, 2, "--backend", "gloo", "--device", "cuda:0", job=COLLECTIVES_JOB, timeout=300)
    _check_collectives(tmp_path, "gloo", device="cuda:0")


@pytest.mark.cuda
def test_a_killed_rank_on_the_gpu_ends_the_job(tmp_path):
    """2 ranks on cuda:0 with gloo; rank 1 is killed (SIGKILL) at step 3: the job fails at once."""
    _needs_two_ranks()
    _a_killed_rank_ends_the_job(tmp_path, "--device", "cuda:0", "--backend", "gloo")


# ---- torchrun: the same job, the same results, the same failures as under mpirun ----------------------------
@pytest.mark.parametrize("args", [(), ("--zero", "1"), ("--accumulation", "2", "--post-accumulation")],
                         ids=["plain", "zero1", "accumulation"])
def test_torchrun_gives_the_results_of_mpirun(tmp_path, reference, accumulated_reference, args):
    """The same script under ``torchrun --nproc_per_node 2``: ranks, local ranks and threads from
    torchrun's variables, gloo picked by 'auto' (there is no MPI world), and weights bitwise equal to
    ``mpirun -n 2``'s with gloo (the same data movement: two ranks' partial sums added once); both
    within the data-parallel bound of one rank with twice the batch."""
    _run(tmp_path / "torchrun", 2, *args, launcher="torchrun")
    facts = _facts(tmp_path / "torchrun")
    assert [(f["rank"], f["size"], f["local_rank"], f["launcher"]) for f in facts] == [
        (0, 2, 0, "torchrun"), (1, 2, 1, "torchrun")]
    _check(tmp_path / "torchrun", accumulated_reference if "--accumulation" in args else reference, facts, "gloo")
    _run(tmp_path / "mpirun", 2, *args, "--backend", "gloo")
    assert [f["launcher"] for f in _facts(tmp_path / "mpirun")] == ["mpirun"] * 2
    for rank in (0, 1):
        torchrun, mpirun = _weights(tmp_path / "torchrun", rank), _weights(tmp_path / "mpirun", rank)
        for name, value in mpirun.items():
            np.testing.assert_array_equal(torchrun[name], value)


def test_a_zero_checkpoint_written_under_torchrun_resumes_under_mpirun(tmp_path, reference):
    """10 steps under torchrun with ZeRO stage 1, saved; 10 more under mpirun with MPI: the launcher
    leaves no trace in the checkpoint, and the 20 steps match one rank's."""
    ckpt = tmp_path / "ckpt.h5"
    _run(tmp_path / "first", 2, "--zero", "1", "--steps", "10", "--save", str(ckpt), launcher="torchrun")
    _run(tmp_path / "second", 2, "--zero", "1", "--steps", "10", "--load", str(ckpt), "--backend", "mpi")
    _check(tmp_path / "second", reference, _facts(tmp_path / "second"), "mpi")


def test_each_collective_on_known_values_under_torchrun(tmp_path):
    """The gloo communicator in a torchrun world: headers and small objects through torchrun's store."""
    _run(tmp_path, 2, "--backend", "gloo", job=COLLECTIVES_JOB, timeout=120, launcher="torchrun")
    _check_collectives(tmp_path, "gloo")
    assert json.loads((tmp_path / "collectives_rank0.json").read_text())["launcher"] == "torchrun"


def test_under_torchrun_an_error_on_one_rank_ends_the_job(tmp_path):
    result, elapsed = _timed(tmp_path, "--fail-at-step", "3", limit=60, launcher="torchrun")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stderr)
    assert "[rank 1] uncaught exception; aborting the torchrun job" in result.stderr, result.stderr
    assert "RuntimeError: deliberate failure on rank 1 at step 3" in result.stderr, result.stderr


def test_under_torchrun_a_rank_that_leaves_early_is_named(tmp_path):
    """The exit notice goes through torchrun's store: rank 0 stops at its next all-reduce."""
    result, elapsed = _timed(tmp_path, "--leave-at-step", "7", launcher="torchrun")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stderr)
    assert re.search(r"rank 0 is in allreduce_sum at train_step 7 \(collective #\d+\); rank 1 has left the job: "
                     r"its script ended after train_step 6", result.stderr), result.stderr


def test_under_torchrun_a_stuck_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    result, elapsed = _timed(tmp_path, "--stall-at-step", "5", timeout_variable="4", launcher="torchrun")
    assert result.returncode != 0
    assert 4 <= elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert re.search(r"rank 0: waited 4 s in allreduce_sum at train_step 5 \(collective #\d+\), but rank\(s\) \[1\] "
                     r"never arrived", result.stderr), result.stderr


def test_under_torchrun_a_killed_rank_ends_the_job(tmp_path):
    _a_killed_rank_ends_the_job(tmp_path, launcher="torchrun")


def test_under_torchrun_the_mpi_backend_is_refused_with_the_fix(tmp_path):
    result, _ = _timed(tmp_path, "--backend", "mpi", "--steps", "1", launcher="torchrun")
    assert result.returncode != 0
    assert ("distributed.backend: 'mpi' moves buffers between ranks that mpirun started, and torchrun started this "
            "one; use 'gloo' on the CPU (or 'auto', which picks it under torchrun)") in result.stderr, result.stderr


def test_the_launcher_is_read_from_the_environment():
    from ort_trainer.comm.torchrun import environment_problem
    from ort_trainer.distributed import launcher_of_environment, launcher_rank, resolve_backend

    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert (launcher_of_environment(torchrun), launcher_rank(torchrun)) == ("torchrun", 1)
    assert (launcher_of_environment({"PMI_RANK": "3", **torchrun}), launcher_rank({"PMI_RANK": "3"})) == ("mpirun", 3)
    assert (launcher_of_environment({}), launcher_rank({})) == ("mpirun", 0)  # a plain process: rank 0 of 1
    assert launcher_of_environment({"RANK": "0"}) == "mpirun"  # RANK alone is not env://
    assert environment_problem(torchrun) is None
    assert environment_problem({"RANK": "0", "WORLD_SIZE": "2"}) == (
        "MASTER_ADDR, MASTER_PORT not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    assert environment_problem({**torchrun, "RANK": "2"}) == "RANK=2 must be below WORLD_SIZE=2"
    assert environment_problem({**torchrun, "LOCAL_RANK": "one"}) == (
        "LOCAL_RANK='one': expected non-negative whole numbers")
    assert [resolve_backend("auto", device, launcher) for device in ("cpu", "cuda:0")
            for launcher in ("mpirun", "torchrun")] == ["mpi", "gloo", "nccl", "nccl"]


@pytest.mark.cuda
def test_two_ranks_on_one_gpu_under_torchrun_equal_mpirun(tmp_path):
    """torchrun's world on a GPU: 2 ranks on cuda:0 with gloo (NCCL refuses two ranks on one GPU),
    10 steps, weights bitwise equal to the same job under mpirun."""
    _needs_two_ranks()
    for launcher in ("torchrun", "mpirun"):
        _run(tmp_path / launcher, 2, "--device", "cuda:0", "--backend", "gloo", "--steps", "10", launcher=launcher)
        assert [f["launcher"] for f in _facts(tmp_path / launcher)] == [launcher] * 2
    for rank in (0, 1):
        torchrun, mpirun = _weights(tmp_path / "torchrun", rank), _weights(tmp_path / "mpirun", rank)
        for name, value in mpirun.items():
            np.testing.assert_array_equal(torchrun[name], value)


@pytest.mark.cuda
def test_two_gpus_with_nccl_under_torchrun_equal_mpirun(tmp_path):
    """NCCL's process group from torchrun's store: 2 ranks on 2 GPUs ('auto' picks NCCL), ZeRO stage 1,
    weights bitwise equal to the same job under mpirun."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    _needs_two_ranks()
    for launcher in ("torchrun", "mpirun"):
        _run(tmp_path / launcher, 2, "--device", "auto", "--zero", "1", launcher=launcher)
        assert [f["backend"] for f in _facts(tmp_path / launcher)] == ["nccl"] * 2
    for rank in (0, 1):
        torchrun, mpirun = _weights(tmp_path / "torchrun", rank), _weights(tmp_path / "mpirun", rank)
        for name, value in mpirun.items():
            np.testing.assert_array_equal(torchrun[name], value)

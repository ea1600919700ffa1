"""``make gpu-check``'s parts that run without a GPU: the preflight that says what is missing, and
the report ``benchmarks/gpu.py`` writes from its measurements."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402  (benchmarks/gpu.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the preflight passes here")
def test_the_preflight_says_what_this_machine_lacks():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--preflight"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "gpu-check cannot run: torch" in result.stderr and "sees no GPU" in result.stderr
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert 'pip install "ort_trainer[cuda]"' in result.stderr


def test_make_gpu_check_runs_the_preflight_the_cuda_tests_and_the_benchmark():
    for extra, pytest_args in (([], ""), (["GPU_PYTEST_ARGS=--junitxml=cuda.xml"], " --junitxml=cuda.xml")):
        dry = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "GPU_PYTHON=py", *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        # under an outer make (make test) make may still announce directories: only the commands count
        commands = [line.rstrip() for line in dry.stdout.splitlines() if not line.startswith("make")]
        assert commands[:3] == ["py benchmarks/gpu.py --preflight", "py -m pytest -q -m cuda -rs tests" + pytest_args,
                                "py benchmarks/gpu.py"]


def _result(impl: str, precision: str, ms: float, peak_mb: float, losses: list[float], **extra) -> dict:
    return {"phase": "time", "round": 0, "model": "gpt2", "impl": impl, "precision": precision, "batch": 8,
            "tokens": 8 * 512, "params": 124_000_000, "step_s": [1.0] + [ms / 1000] * 4, "losses": losses, "build_s": 2.0,
            "peak_mb": peak_mb, "device_name": "NVIDIA H100 80GB HBM3", "versions": "torch 2.11.0+cu130, onnxruntime 1.31.1",
            **extra}


def test_the_report_gives_ratios_mfu_memory_and_loss_errors_and_says_which_goal_is_missed(tmp_path):
    losses = [10.0, 9.0, 8.0]
    results = [
        _result("ort", "bf16", 100.0, 20_000, losses, torch_allocated_peak_mb=2000.0, after_first_step_mb=19_000.0),
        _result("eager", "bf16", 150.0, 30_000, [10.0, 9.0, 8.08]),  # 1 % off (relative to 8.08): within bf16's 2e-2
        _result("compile", "bf16", 90.0, 25_000, losses),
        _result("ort", "fp32", 400.0, 40_000, losses),
        _result("eager", "fp32", 380.0, 30_000, [10.0, 9.0, 8.01]),  # 1.25e-3 off: over fp32's 1e-4
        {"phase": "time", "model": "gpt2", "impl": "compile", "precision": "fp32", "error": "exit 1: boom"},
        {"phase": "probe", "model": "gpt2", "impl": "ort", "precision": "fp32", "batch": 16, "peak_mb": 50_000,
         "step_s": [1.0, 0.5], "losses": [1.0, 1.0], "build_s": 1.0},
        {"phase": "probe", "model": "gpt2", "impl": "ort", "precision": "fp32", "batch": 32,
         "error": "RuntimeError: CUDA out of memory", "out_of_memory": True},
        {"phase": "probe", "model": "gpt2", "impl": "ort", "precision": "fp32", "batch": 24,  # 1.5 x 16, tried after
         "error": "RuntimeError: CUDA out of memory", "out_of_memory": True},
        {"phase": "probe", "model": "gpt2", "impl": "eager", "precision": "fp32", "batch": 8, "peak_mb": 40_000,
         "step_s": [1.0, 0.5], "losses": [1.0, 1.0], "build_s": 1.0},
    ]
    args = gpu.parse(["--steps", "5", "--warmup", "1"])
    args.versions = "torch 2.11.0+cu130, onnxruntime 1.31.1"
    text, missed = gpu.report(results, args)
    # MFU: 6 x 124 M x 4096 tokens / 0.1 s / 989.4 TFLOP/s = 3.08 %; samples/s: 8 / 0.1 s
    assert "| gpt2 | 8 × 512 | bf16 | **ort_trainer** | 100.0 | 80 | 3.1% | 20000 (2000) | — |  |  | 2.0 | [100.0] |" in text
    assert "| bf16 | `torch.autocast` bf16 | 150.0 | 53 | 2.1% | 30000 | 1.50× | ≥ 1.2×: met | 9.9e-03 (2e-02: ok) |" in text
    assert "| bf16 | `torch.compile` of the same | 90.0 | 89 | 3.4% | 25000 | 0.90× | ≥ 1.0×: MISSED |" in text
    # fp32 peak: 66.9 TFLOP/s; 6 x 124 M x 4096 / 0.4 s = 7.6 TFLOP/s
    assert "| fp32 | **ort_trainer** | 400.0 | 20 | 11.4% | 40000 |" in text
    assert "| 30000 | 0.95× | ≥ 1.0×: MISSED | 1.2e-03 (1e-04: OVER) | 2.0 | [380.0] |" in text
    assert "- time gpt2 fp32 compile: exit 1: boom" in text
    assert "after the first step → the process's peak (MB; a second copy of the activations after the first step shows " \
           "here): gpt2 bf16 ort 19000 → 20000." in text
    assert "| gpt2 | fp32 | ort | [16] | 24 (out of memory) | 16 | 50000 |" in text
    assert "ort_trainer's largest batch over eager's (goal: ≥ 1.5× in fp16): gpt2 fp32 2.00×." in text
    assert missed == ["gpt2 bf16 vs compile: 0.90×", "gpt2 fp32 vs eager: 0.95×", "gpt2 fp32 vs compile: not measured",
                      "gpt2 fp32: peak memory 40000 MB > eager's 30000 MB"]


def test_the_whole_harness_runs_on_the_cpu_at_toy_size(tmp_path):
    """Warm-up, two alternating rounds of ort_trainer / eager / torch.compile (aot_eager: no C++ build on
    the CPU), the largest-batch probe and the page, in separate processes, as on a GPU."""
    results, out = tmp_path / "results.jsonl", tmp_path / "benchmarks_gpu.md"
    env = {**os.environ, "ORT_TRAINER_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "gpt2-tiny",
                           "--precisions", "fp32", "--steps", "4", "--warmup", "1", "--warm-parallel", "2", "--warm-impls",
                           "compile", "--probe", "gpt2-tiny", "--probe-precisions", "fp32", "--probe-start", "4", "--probe-max", "4", "--profile-steps", "1", "--compile-backend",
                           "aot_eager", "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    # the probe runs between the rounds
    assert [r["phase"] for r in lines] == ["warm"] + ["time"] * 3 + ["probe"] * 2 + ["time"] * 3, done.stdout + done.stderr
    assert not [r for r in lines if "error" in r], lines
    # one round ort, eager, compile; the next reversed
    assert [r["impl"] for r in lines if r["phase"] == "time"] == ["ort", "eager", "compile", "compile", "eager", "ort"]
    table = gpu.summarize(lines, warmup=1)[("gpt2-tiny", "fp32")]
    # fp32 on the same CPU: float32 sums in another order, ~1e-7 relative per step over 4 steps
    assert table["eager"]["loss_error"] < 1e-5 and table["compile"]["loss_error"] < 1e-5
    assert all(table[i]["ms"] > 0 and table[i]["peak_mb"] > 100 for i in ("ort", "eager", "compile"))
    text = out.read_text()
    assert "| gpt2-tiny | 4 × 16 | fp32 | **ort_trainer** |" in text
    assert "| gpt2-tiny | fp32 | eager | [4] | none (probe cap) | 4 |" in text
    # round 1 profiled one more step of each implementation (on the CPU: torch's operators only)
    profiled = [r for r in lines if r.get("profile")]
    assert [(r["round"], r["impl"]) for r in profiled] == [(0, "ort"), (0, "eager"), (0, "compile")]
    assert "## Where a step goes" in text and "| gpt2-tiny | fp32 | eager |" in text
    assert any("matrix products" in r["profile"]["categories"] for r in profiled if r["impl"] == "eager")
    assert done.returncode in (0, 1), done.stderr  # 1: a goal missed (toy sizes on 2 cores say nothing)
    # --append: a second invocation of the same lease adds its processes to the file, and the page is of both
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--models",
                            "gpt2-tiny", "--precisions", "bf16", "--impls", "eager", "--rounds", "1", "--steps", "2",
                            "--warmup", "1", "--warm-parallel", "0", "--probe", "", "--profile-steps", "0", "--append",
                            "--results", str(results), "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
    appended = [json.loads(line) for line in results.read_text().splitlines()]
    assert appended[:len(lines)] == lines, again.stdout + again.stderr
    assert [(r["impl"], r["precision"]) for r in appended[len(lines):]] == [("eager", "bf16")], again.stderr
    text = out.read_text()
    assert "| gpt2-tiny | 4 × 16 | fp32 | **ort_trainer** |" in text and "| gpt2-tiny | 4 × 16 | bf16 |" in text


def test_the_row_that_fills_the_gpu_times_at_the_largest_batch_eager_fitted(tmp_path):
    """``--batch-of-probe eager``: the probe first (eager only), then every implementation timed at the
    largest batch eager trained (the probe's cap here), as the GPT-2 1024-token MFU row runs on a GPU."""
    results, out = tmp_path / "results.jsonl", tmp_path / "page.md"
    env = {**os.environ, "ORT_TRAINER_CACHE_DIR": str(tmp_path / "cache")}
    common = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "gpt2-tiny",
              "--precisions", "fp32", "--impls", "ort,eager", "--rounds", "1", "--steps", "2", "--warmup", "1",
              "--warm-parallel", "0", "--profile-steps", "0", "--probe", "gpt2-tiny", "--probe-impls", "eager",
              "--probe-start", "2", "--probe-max", "4", "--results", str(results), "--out", str(out)]
    done = subprocess.run([*common, "--batch-of-probe", "eager"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: a goal missed (toy sizes say nothing)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["phase"], r["impl"], r["batch"]) for r in lines] == [
        ("probe", "eager", 2), ("probe", "eager", 4), ("time", "ort", 4), ("time", "eager", 4)], lines
    assert "timing at batch 4: the largest eager fitted" in done.stdout
    assert "| gpt2-tiny | 4 × 16 | fp32 | **ort_trainer** |" in out.read_text()
    refused = subprocess.run([*common, "--batch-of-probe", "ort"], capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "among --probe-impls ('eager')" in refused.stderr, refused.stderr


def test_make_gpu_wheels_runs_the_script_and_the_install_checks_the_parts_first(tmp_path):
    """``make gpu-wheels`` runs ``benchmarks/gpu_wheels.sh``; the install script it ships refuses
    parts that do not match their checksums before it installs or removes anything."""
    dry = subprocess.run(["make", "-n", "--no-print-directory", "gpu-wheels", "PYTHON=py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "PYTHON=py KERNELS_PYTHON=.venv/bin/python benchmarks/gpu_wheels.sh .gpu-wheels" in dry.stdout
    (tmp_path / "onnxruntime-gpu.tar.xz.part-00").write_bytes(b"one part")
    subprocess.run("md5sum onnxruntime-gpu.tar.xz.part-00 > parts.md5", shell=True, cwd=tmp_path, check=True)
    (tmp_path / "onnxruntime-gpu.tar.xz.part-00").write_bytes(b"one part, damaged in transit")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_install.sh"), str(tmp_path), str(tmp_path / "prefix")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": "false"})
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr
    assert not (tmp_path / "prefix").exists()


def test_make_test_gpu_torch_runs_the_suite_under_the_gpu_machines_torch():
    """``make test-gpu-torch`` installs torch 2.11.0 (the GPU machines') and this package into a venv of its own,
    as ``make install`` sets up .venv, and runs the suite there; ``GPU_TORCH`` names another version."""
    for version, venv in (("", ".venv-torch-2.11.0"), ("GPU_TORCH=2.12.0", ".venv-torch-2.12.0")):
        dry = subprocess.run(["make", "-n", "-B", "--no-print-directory", "test-gpu-torch", "PYTHON=py", "TEST_WORKERS=2",
                              *([version] if version else [])], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.splitlines()
        expected = [f"py -m venv {venv}",
                    f"{venv}/bin/python -m pip install --quiet torch=={venv.rsplit('-', 1)[1]}",
                    f'{venv}/bin/python -m pip install --quiet -e ".[cpu,dev,mpi]"',
                    f"touch {venv}/.installed-cpu",
                    f'{venv}/bin/python -m pytest -q -n 2 --dist worksteal -m "not slow" tests']
        assert all(line in lines for line in expected), lines
        assert [lines.index(line) for line in expected] == sorted(lines.index(line) for line in expected), lines


def test_the_install_joins_the_parts_and_takes_the_mpi_wheels_where_they_are(tmp_path):
    """``install.sh`` (``make gpu-wheels``) joins and unpacks the parts, installs onnx2fx and the kernel library
    beside them, and mpich with mpi4py only where their wheels are (``DIR-mpi``, what ``make gpu-wheels``
    writes): without them it says that the tests of several ranks will skip. A stand-in Python records what it is
    asked to install."""
    wheels = tmp_path / "wheels"
    (wheels / "package").mkdir(parents=True)
    (wheels / "package" / "module.py").write_text("VALUE = 1\n")
    subprocess.run("tar cf - -C wheels package | xz > packed && split -b 100 -d packed wheels/onnxruntime-gpu.tar.xz"
                   ".part- && rm -r packed wheels/package && cd wheels && md5sum onnxruntime-gpu.tar.xz.part-* > "
                   "parts.md5 && touch onnx2fx-0.0.1-py3-none-any.whl && echo library | xz > "
                   "libort_trainer_kernels.so.xz",
                   shell=True, cwd=tmp_path, check=True)
    log = tmp_path / "python.log"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase "$1" in -c) echo python3.12;; esac\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python)}
    install = [str(ROOT / "benchmarks" / "gpu_install.sh"), str(wheels)]

    done = subprocess.run(["bash", *install, str(tmp_path / "one")], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "one" / "site" / "package" / "module.py").read_text() == "VALUE = 1\n"
    assert "the cuda tests of several ranks will skip" in done.stdout
    assert "mpich" not in (tmp_path / "one" / "env.sh").read_text() and "mpich" not in log.read_text()
    assert f"--target {tmp_path / 'one' / 'site'} {wheels}/onnx2fx-0.0.1-py3-none-any.whl" in log.read_text()
    assert (tmp_path / "one" / "libort_trainer_kernels.so").read_text() == "library\n"
    assert f"ORT_TRAINER_KERNELS_LIBRARY={tmp_path / 'one'}/libort_trainer_kernels.so" in \
        (tmp_path / "one" / "env.sh").read_text()

    (tmp_path / "wheels-mpi").mkdir()
    for name in ("mpich-5.0.2-py3-none-any.whl", "mpi4py-4.1.2-cp312-cp312-any.whl"):
        (tmp_path / "wheels-mpi" / name).touch()
    done = subprocess.run(["bash", *install, str(tmp_path / "two")], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert "will skip" not in done.stdout
    assert f"--prefix {tmp_path / 'two' / 'mpich'} {tmp_path}/wheels-mpi/mpich-" in log.read_text()
    assert f"MPI4PY_LIBMPI={tmp_path / 'two' / 'mpich'}/lib/libmpi.so.12" in (tmp_path / "two" / "env.sh").read_text()


def _elf_with_fatbins(fatbins: list[list[tuple[int, int, bytes]]], padding: bytes = bytes(8)) -> tuple[bytes, dict]:
    """A minimal 64-bit ELF file whose ``.nv_fatbin`` section holds ``fatbins`` (each a list of ``(kind, arch,
    payload)`` entries) with ``padding`` between them, and where each payload starts in the file."""
    import fatbin_prune  # benchmarks/fatbin_prune.py

    names = b"\0.shstrtab\0.nv_fatbin\0"
    section, where = b"", {}
    for index, fatbin in enumerate(fatbins):
        body = b""
        for kind, arch, payload in fatbin:
            header = bytearray(64)
            struct.pack_into("<HHIQ", header, 0, kind, 1, 64, len(payload))
            struct.pack_into("<I", header, 28, arch)
            where[kind, arch, index] = 64 + len(names) + len(section) + 16 + len(body) + 64
            body += bytes(header) + payload
        section += struct.pack("<IHHQ", fatbin_prune.FATBIN_MAGIC, 1, 16, len(body)) + body
        if index + 1 < len(fatbins):
            section += padding
    shoff = 64 + len(names) + len(section)
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 1)
    sections = bytes(64)  # the null section
    sections += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 11, 1, 2, 0, 64 + len(names), len(section), 0, 0, 8, 0)
    return header + names + section + sections, where


def test_fatbin_prune_zeroes_the_code_no_kept_gpu_runs_and_nothing_else(tmp_path):
    """``benchmarks/fatbin_prune.py`` (``make gpu-wheels``): an entry stays when a kept GPU runs it (a cubin of the
    same major architecture at or below the GPU's, PTX at or below it); every other entry's payload becomes zeros
    in place, headers and every other byte unchanged. A section it cannot walk leaves the file as it was."""
    import fatbin_prune

    def payload(arch: int, kind: int) -> bytes:
        return bytes([arch % 251 + 1, kind]) * 24

    layout = [[(2, 75, payload(75, 2)), (2, 80, payload(80, 2)), (2, 86, payload(86, 2)), (2, 90, payload(90, 2)),
               (1, 80, payload(80, 1)), (1, 120, payload(120, 1))],
              [(2, 120, payload(120, 2))]]
    original, where = _elf_with_fatbins(layout)
    library = tmp_path / "libkernels.so"
    for keep, kept in (([90], {(2, 90), (1, 80)}), ([86], {(2, 80), (2, 86), (1, 80)}),
                       ([80, 90], {(2, 80), (2, 90), (1, 80)})):
        library.write_bytes(original)
        assert fatbin_prune.main([str(library), *[f"--keep={arch}" for arch in keep]]) == 0
        pruned = library.read_bytes()
        assert len(pruned) == len(original)
        expected = bytearray(original)
        for (kind, arch, index), start in where.items():
            assert pruned[start:start + 48] == (payload(arch, kind) if (kind, arch) in kept else bytes(48)), \
                (keep, kind, arch)
            expected[start:start + 48] = pruned[start:start + 48]
        assert pruned == bytes(expected)  # nothing but payloads changed
    damaged, _ = _elf_with_fatbins(layout, padding=b"\1" + bytes(7))
    library.write_bytes(damaged)
    assert fatbin_prune.main([str(library), "--keep", "90"]) == 1
    assert library.read_bytes() == damaged
    library.write_bytes(b"not an ELF file")
    assert fatbin_prune.main([str(library), "--keep", "90"]) == 1


def test_the_gemm_probe_runs_every_backend_and_they_agree(tmp_path):
    """``benchmarks/gpu_probe.py`` at toy size on the CPU: every backend computes every product (the biased one:
    those that write it), and each equals torch's (the padded one too: its padding multiplies zeros)."""
    import gpu_probe  # benchmarks/gpu_probe.py

    results = tmp_path / "probe.jsonl"
    assert gpu_probe.main(["--device", "cpu", "--precisions", "fp32", "--tokens", "48", "--hidden", "32",
                           "--widths", "257,264", "--repeat", "2", "--results", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    cases = [row for row in rows if "backend" in row]
    expected = {(b, p, n) for b in gpu_probe.BACKENDS for p in gpu_probe.PRODUCTS for n in (257, 264)
                if p != "bias" or b in gpu_probe.BIAS_BACKENDS}
    assert len(cases) == len(expected)
    assert not [row for row in cases if "error" in row]
    # float32 sums of 32 (dx: 257 or 264) products of N(0, 1) values in another order: each within a few
    # hundred float32 roundings of |sum| ≈ 20 (2^-24 · 20 · 300 ≈ 4e-4)
    assert max(row["max_abs_vs_first"] for row in cases) < 4e-4
    assert {(row["backend"], row["product"], row["n"]) for row in cases} == expected
    assert "process" in rows[-1]


def test_the_session_runs_the_tests_then_the_levers_probe_and_settings(tmp_path):
    """``benchmarks/gpu_session.sh`` (a GPU machine's visit in one command) on the CPU at toy size, with the
    environment as it is (no wheels to install): the machine, the preflight, the cuda tests (skipped here, their
    report kept), then ``benchmarks/gpu_levers.sh``: the probe's lines, then ort_trainer without the levers and
    with each one, in one run: every row carries its whole setting, and the page has a row per lever with its
    ratio to ort_trainer without it. All it printed is in ``session.log``."""
    env = {**os.environ, "ORT_TRAINER_CACHE_DIR": str(tmp_path / "cache"), "GPU_PYTHON": sys.executable,
           "DEVICE": "cpu", "MODELS": "gpt2-tiny", "PRECISIONS": "fp32", "ROUNDS": "1",
           "PROBE_ARGS": "--tokens 32 --hidden 16 --widths 257 --precisions fp32 --repeat 2",
           "WHEELS": "", "TESTS": "tests/test_cuda_graph.py", "LEVERS": "aligned_products,half_precision_loss",
           "REFERENCES": "eager"}  # torch.compile's too by default: a C++ build of the toy model here
    session = tmp_path / "session"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), str(session), "600"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    log = (session / "session.log").read_text()
    assert log == done.stdout
    assert [line.split(": ", 1)[1] for line in log.splitlines() if line.startswith("== ")] == [
        "the machine", "preflight", "cuda tests, 180 s at most", f"levers, {log.split('s: levers, ')[1].split()[0]} s",
        "done"]
    assert 'skipped="2"' in (session / "cuda-tests.xml").read_text()
    out = session / "levers"
    probe = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    assert {row["backend"] for row in probe if "backend" in row} == {"torch", "ort-matmul", "ort-gemm",
                                                                      "ort-fusedmatmul", "ort-padded"}
    rows = [json.loads(line) for line in (out / "levers.jsonl").read_text().splitlines()]
    assert not [row for row in rows if "error" in row], rows
    timed = {row["impl"]: row for row in rows if row.get("phase") == "time"}
    assert set(timed) == {"ort", "eager", "ort+aligned_products", "ort+half_precision_loss"}, rows
    del timed["eager"]  # PyTorch: no graph_optimizations
    assert {impl: row["ort_optimizations"] for impl, row in timed.items()} == {
        "ort": {"aligned_products": False, "half_precision_loss": False},
        "ort+aligned_products": {"aligned_products": True, "half_precision_loss": False},
        "ort+half_precision_loss": {"aligned_products": False, "half_precision_loss": True}}
    page = (out / "levers.md").read_text()
    assert "| ort_trainer + `aligned_products` |" in page and "| ort_trainer + `half_precision_loss` |" in page
    # each setting's row has the goal's ratio against PyTorch measured in the same run
    for lever in ("aligned_products", "half_precision_loss"):
        row = next(line for line in page.splitlines() if f"| ort_trainer + `{lever}` |" in line)
        assert re.search(r"lever: ort_trainer's time / this; \d+\.\d\d× eager \(goal 1\.0×\)", row), row


def test_a_lever_named_device_x_is_a_device_option_of_the_run():
    """``ort+device.cuda_graph`` A/Bs the device option, not a graph_optimizations switch."""
    import gpu_worker

    assert gpu.variant("ort+device.cuda_graph+half_precision_loss") == (
        "ort", {"device.cuda_graph": True, "half_precision_loss": True})
    options = gpu_worker.ort_options("cuda", "bf16", {"device.cuda_graph": True, "half_precision_loss": False})
    assert options == {"device": {"id": "cuda", "cuda_graph": True},
                       "mixed_precision": {"enabled": True, "dtype": "bfloat16"},
                       "graph_optimizations": {"half_precision_loss": False}}


def test_the_probe_tries_one_and_a_half_times_the_last_batch_that_trained(tmp_path, monkeypatch):
    """The probe doubles the batch until a step fails, then tries 1.5 times the last batch that trained (the
    issue's goal is 1.5 times eager's largest batch); a worker that stands for the GPU fits 100 samples."""
    tried = []

    def spawn(args, model, impl, precision, steps, batch=None, profile=0):
        tried.append(batch)
        if batch > 100:
            return {"model": model, "impl": impl, "precision": precision, "batch": batch, "error": "OOM",
                    "out_of_memory": True}
        return {"model": model, "impl": impl, "precision": precision, "batch": batch, "step_s": [1.0, 1.0],
                "losses": [1.0, 1.0], "peak_mb": float(batch)}

    monkeypatch.setattr(gpu, "_spawn", spawn)
    args = gpu.parse(["--probe", "gpt2", "--probe-impls", "ort", "--probe-start", "16",
                      "--results", str(tmp_path / "r.jsonl")])
    run = gpu.Run(args)
    run.probe()
    assert tried == [16, 32, 64, 128, 96]
    assert run.probed == {"ort": [16, 32, 64, 96]}


def test_each_configuration_is_warmed_just_before_its_round_and_the_deadline_leaves_whole_ones(tmp_path, monkeypatch):
    """A run cut short by ``--deadline`` (a GPU machine's time running out) has every (model, precision) it
    reached warmed and timed, rather than every cache warmed and nothing timed."""
    spawned = []

    def spawn(args, model, impl, precision, steps, batch=None, profile=0):
        spawned.append(("warm" if steps == 2 else "time", model, precision, impl))
        return {"model": model, "impl": impl, "precision": precision, "step_s": [0.1, 0.1], "losses": [1.0]}

    monkeypatch.setattr(gpu, "_spawn", spawn)
    args = gpu.parse(["--device", "cpu", "--models", "gpt2,bert-base", "--precisions", "fp16", "--impls",
                      "ort,ort+x", "--warm-impls", "ort", "--warm-parallel", "1", "--rounds", "2", "--probe", "",
                      "--results", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "r.md")])
    run = gpu.Run(args)
    run.all()
    assert spawned == [("warm", "gpt2", "fp16", "ort"), ("warm", "gpt2", "fp16", "ort+x"),
                       ("time", "gpt2", "fp16", "ort"), ("time", "gpt2", "fp16", "ort+x"),
                       ("warm", "bert-base", "fp16", "ort"), ("warm", "bert-base", "fp16", "ort+x"),
                       ("time", "bert-base", "fp16", "ort+x"), ("time", "bert-base", "fp16", "ort"),  # alternating
                       ("time", "gpt2", "fp16", "ort+x"), ("time", "gpt2", "fp16", "ort"),
                       ("time", "bert-base", "fp16", "ort"), ("time", "bert-base", "fp16", "ort+x")]
    # the deadline passing after the first configuration's round: nothing of the second starts
    spawned.clear()
    run = gpu.Run(args)
    monkeypatch.setattr(run, "late", lambda: len(spawned) >= 4)
    run.all()
    assert spawned == [("warm", "gpt2", "fp16", "ort"), ("warm", "gpt2", "fp16", "ort+x"),
                       ("time", "gpt2", "fp16", "ort"), ("time", "gpt2", "fp16", "ort+x")]


def test_the_probe_of_a_variant_is_set_against_eagers_largest_batch():
    """``--probe-impls ort+layer_recompute,eager``: the variant's largest batch over eager's, named."""
    probe = {"phase": "probe", "model": "gpt2", "precision": "fp16", "step_s": [1.0, 0.5], "losses": [1.0, 1.0],
             "build_s": 1.0, "peak_mb": 1000}
    results = [{**probe, "impl": "ort+layer_recompute", "batch": 96}, {**probe, "impl": "eager", "batch": 32},
               {**probe, "impl": "eager", "batch": 64, "error": "OutOfMemoryError", "out_of_memory": True}]
    assert "gpt2 fp16 (ort+layer_recompute) 3.00×." in "\n".join(gpu._probe_lines(results))

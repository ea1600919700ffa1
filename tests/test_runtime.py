"""Runtime detection, the gradient_source option, packaging extras and the CI script.

Detection is tested on fake package metadata (no real installs), and end to end in subprocesses
whose import path is rigged: a second runtime's metadata, no runtime at all, a damaged module.
"""

import os
import runpy
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import onnxruntime as ort
import pytest

from ort_trainer import ORTTrainerOptions, _runtime

REPO = Path(__file__).resolve().parent.parent


class _FakeDistribution:
    def __init__(self, name, version, top_level=None, files=None):
        self.metadata = {"Name": name}
        self.version = version
        self._top_level = top_level
        self.files = None if files is None else [PurePosixPath(f) for f in files]

    def read_text(self, filename):
        return self._top_level if filename == "top_level.txt" else None


def _fake_metadata(monkeypatch, *dists):
    monkeypatch.setattr(_runtime, "metadata", SimpleNamespace(distributions=lambda: list(dists)))


def _import_ok(monkeypatch):
    monkeypatch.setattr(_runtime, "_import_onnxruntime", lambda: ort)


def _import_fails(monkeypatch, error):
    def fail():
        raise error

    monkeypatch.setattr(_runtime, "_import_onnxruntime", fail)


ORT_131 = _FakeDistribution("onnxruntime", "1.31.1", top_level="onnxruntime\n")
TRAINING = _FakeDistribution("onnxruntime_training_cpu", "1.19.2", top_level="onnxruntime\n")


def test_only_distributions_that_ship_the_onnxruntime_module_count(monkeypatch):
    _fake_metadata(
        monkeypatch,
        ORT_131,
        _FakeDistribution("numpy", "2.4.6", top_level="numpy\n"),
        _FakeDistribution("onnxruntime-extensions", "0.15.2", top_level="onnxruntime_extensions\n"),
        _FakeDistribution("onnxruntime-genai", "0.18.0", files=["onnxruntime_genai/__init__.py"]),
        _FakeDistribution("ort-nightly-gpu", "1.32.0.dev1", files=["onnxruntime/__init__.py", "x.dist-info/RECORD"]),
        _FakeDistribution("onnxruntime-training", "1.19.2"),  # no file list: a well-known name is trusted
        _FakeDistribution("onnxruntime-mystery", "0.1"),  # no file list, unknown name: not counted
        _FakeDistribution("onnxruntime", "1.20.0", top_level="onnxruntime\n"),  # shadowed copy later on sys.path
    )
    found = _runtime.installed_runtimes()
    assert [(d.name, d.version) for d in found] == [
        ("onnxruntime", "1.31.1"), ("onnxruntime-training", "1.19.2"), ("ort-nightly-gpu", "1.32.0.dev1"),
    ]
    assert found[0].pin == "onnxruntime==1.31.1" and str(found[0]) == "onnxruntime 1.31.1"


def test_none_installed_says_which_extra_to_install(monkeypatch):
    _fake_metadata(monkeypatch, _FakeDistribution("numpy", "2.4.6", top_level="numpy\n"))
    _import_fails(monkeypatch, ModuleNotFoundError("No module named 'onnxruntime'"))
    with pytest.raises(ImportError) as info:
        _runtime.check_runtime()
    message = str(info.value)
    assert "none is installed" in message
    for extra in ("cpu", "cuda", "training"):
        assert f'pip install "ort_trainer[{extra}]"' in message
    assert 'pip install -e ".[cpu]"' in message


def test_a_module_without_package_metadata_is_accepted(monkeypatch):
    _fake_metadata(monkeypatch)
    _import_ok(monkeypatch)
    assert _runtime.check_runtime() is None


def test_two_installed_are_named_with_what_to_uninstall_and_reinstall(monkeypatch):
    _fake_metadata(monkeypatch, TRAINING, ORT_131)
    _import_ok(monkeypatch)  # the mix may well import: it is refused all the same
    with pytest.raises(ImportError) as info:
        _runtime.check_runtime()
    message = str(info.value)
    assert "2 ONNX Runtime distributions installed together: onnxruntime 1.31.1, onnxruntime-training-cpu 1.19.2" in message
    assert "overwrite each other's files" in message
    assert "pip uninstall -y onnxruntime onnxruntime-training-cpu" in message
    assert "pip install onnxruntime==1.31.1 | pip install onnxruntime-training-cpu==1.19.2" in message
    assert 'pip install "ort_trainer[training]"' in message


def test_an_installed_runtime_that_does_not_import_gets_the_reinstall_command(monkeypatch):
    _fake_metadata(monkeypatch, ORT_131)
    _import_fails(monkeypatch, OSError("libonnxruntime.so.1: cannot open shared object file"))
    with pytest.raises(ImportError) as info:
        _runtime.check_runtime()
    message = str(info.value)
    assert "onnxruntime 1.31.1 is installed but `import onnxruntime` fails" in message
    assert "OSError: libonnxruntime.so.1: cannot open shared object file" in message
    assert "pip install --force-reinstall --no-deps onnxruntime==1.31.1" in message


def test_one_installed_that_imports_is_returned(monkeypatch):
    _fake_metadata(monkeypatch, ORT_131)
    _import_ok(monkeypatch)
    assert _runtime.check_runtime() == _runtime.RuntimeDistribution("onnxruntime", "1.31.1")


def test_this_environment_has_exactly_one_runtime_and_the_training_build_matches_it():
    (dist,) = _runtime.installed_runtimes()
    assert _runtime.check_runtime() == dist
    assert dist.version == ort.__version__
    assert _runtime.has_training_build() == (dist.name in _runtime.TRAINING_DISTRIBUTIONS)
    description = _runtime.runtime_description()
    assert str(dist) in description and "CPUExecutionProvider" in description
    assert ("no training build" in description) != _runtime.has_training_build()
    expected = "onnxruntime" if _runtime.has_training_build() else "torch"
    assert _runtime.resolve_gradient_source("auto") == expected
    assert _runtime.resolve_gradient_source() == expected


def _run_import(code_or_import, extra_path=(), **kwargs):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code_or_import], env=env, capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_importing_ort_trainer_beside_a_second_runtime_fails_with_the_fix(tmp_path):
    info = tmp_path / "onnxruntime_gpu-1.31.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: 1.31.1\n")
    (info / "top_level.txt").write_text("onnxruntime\n")
    result = _run_import("import ort_trainer", extra_path=[tmp_path])
    assert result.returncode != 0
    assert "ImportError: ort_trainer found 2 ONNX Runtime distributions installed together" in result.stderr
    assert "onnxruntime-gpu 1.31.1" in result.stderr and "pip uninstall -y " in result.stderr


def test_importing_ort_trainer_with_no_runtime_says_what_to_install():
    code = textwrap.dedent(f"""
        import sys
        sys.path[:] = [p for p in sys.path if "site-packages" not in p] + [{str(REPO)!r}]
        import ort_trainer
    """)
    result = _run_import(code)
    assert result.returncode != 0
    assert "ImportError: ort_trainer needs ONNX Runtime, and none is installed" in result.stderr
    assert 'pip install "ort_trainer[cpu]"' in result.stderr


def test_importing_ort_trainer_over_a_damaged_runtime_says_how_to_reinstall_it(tmp_path):
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "__init__.py").write_text("raise ImportError('simulated damage')\n")
    (dist,) = _runtime.installed_runtimes()
    result = _run_import("import ort_trainer", extra_path=[tmp_path])
    assert result.returncode != 0
    assert f"{dist} is installed but `import onnxruntime` fails (ImportError: simulated damage)" in result.stderr
    assert f"pip install --force-reinstall --no-deps {dist.pin}" in result.stderr


# --- graph.gradient_source -------------------------------------------------------------------------

@pytest.fixture
def legacy_runtime(monkeypatch):
    monkeypatch.setattr(_runtime, "has_training_build", lambda: True)
    monkeypatch.setattr(_runtime, "runtime_description", lambda: "onnxruntime-training-cpu 1.19.2 (training build)")


@pytest.fixture
def current_runtime(monkeypatch):
    monkeypatch.setattr(_runtime, "has_training_build", lambda: False)
    monkeypatch.setattr(_runtime, "runtime_description", lambda: "onnxruntime 1.31.1 (no training build)")


def test_auto_takes_the_gradient_builder_on_the_training_build(legacy_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: False)  # not needed there
    assert _runtime.resolve_gradient_source("auto") == "onnxruntime"
    assert _runtime.resolve_gradient_source("onnxruntime") == "onnxruntime"
    assert ORTTrainerOptions().graph.gradient_source == "auto"


def test_auto_takes_torch_on_a_current_runtime(current_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: True)
    assert _runtime.resolve_gradient_source("auto") == "torch"
    assert _runtime.resolve_gradient_source("torch") == "torch"


def test_torch_can_be_forced_on_the_training_build(legacy_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: True)
    assert _runtime.resolve_gradient_source("torch") == "torch"
    assert ORTTrainerOptions({"graph": {"gradient_source": "torch"}}).graph.gradient_source == "torch"


def test_onnxruntime_without_the_training_build_is_an_error_at_construction(current_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: True)
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"graph": {"gradient_source": "onnxruntime"}})
    message = str(info.value)
    assert "graph.gradient_source: 'onnxruntime' builds gradients with ONNX Runtime's GradientGraphBuilder" in message
    assert "onnxruntime 1.31.1 (no training build)" in message
    assert 'pip install "ort_trainer[training]"' in message and "or use 'torch'" in message
    assert message.count("graph.gradient_source") == 1
    with pytest.raises(ValueError, match="GradientGraphBuilder"):
        _runtime.resolve_gradient_source("onnxruntime")


def test_torch_without_onnxscript_says_which_package_to_install(legacy_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: False)
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"graph": {"gradient_source": "torch"}})
    assert "graph.gradient_source: 'torch' exports" in str(info.value)
    assert "needs onnxscript" in str(info.value) and "pip install onnxscript" in str(info.value)


def test_the_default_auto_is_checked_too(current_runtime, monkeypatch):
    monkeypatch.setattr(_runtime, "has_onnxscript", lambda: False)
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions()
    assert "graph.gradient_source: 'auto' (here 'torch': the runtime has no training build)" in str(info.value)
    with pytest.raises(ValueError, match="onnxscript"):
        _runtime.resolve_gradient_source("auto")


def test_unknown_gradient_source_values_are_rejected_with_the_choices():
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"graph": {"gradient_source": "autograd"}})
    assert "graph.gradient_source: must be one of ['auto', 'torch', 'onnxruntime'], got 'autograd'" in str(info.value)
    with pytest.raises(ValueError, match="expected str, got int"):
        ORTTrainerOptions({"graph": {"gradient_source": 1}})
    with pytest.raises(ValueError, match="must be one of"):
        _runtime.resolve_gradient_source("Torch")
    assert "graph.gradient_source = 'auto'" in ORTTrainerOptions.describe()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="needs a runtime without CUDA")
def test_cuda_on_a_runtime_without_it_names_the_runtime_and_the_extra():
    with pytest.raises(ValueError) as info:
        ORTTrainerOptions({"device": {"id": "cuda"}})
    message = str(info.value)
    assert "device.id: 'cuda' was asked for but the installed ONNX Runtime has no CUDA provider" in message
    assert f"installed: {_runtime.runtime_description()}" in message
    assert 'pip install "ort_trainer[cuda]"' in message


# --- packaging, Makefile, CI script ----------------------------------------------------------------

RUNTIME_NAMES = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu"}


def _requirement_name(requirement):
    name = requirement
    for stop in "<>=!~[; ":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


def _setup_kwargs(monkeypatch):
    setuptools = pytest.importorskip("setuptools")
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    return captured


def test_each_runtime_comes_from_exactly_one_extra_and_none_from_the_base(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    assert not RUNTIME_NAMES & {_requirement_name(r) for r in kwargs["install_requires"]}
    extras = kwargs["extras_require"]
    runtimes_of = {extra: [r for r in reqs if _requirement_name(r) in RUNTIME_NAMES] for extra, reqs in extras.items()}
    assert {extra: [_requirement_name(r) for r in reqs] for extra, reqs in runtimes_of.items() if reqs} == {
        extra: [name] for name, extra in _runtime.EXTRA_OF.items()
    }
    assert runtimes_of["cpu"] == ["onnxruntime==1.31.*"] and runtimes_of["cuda"] == ["onnxruntime-gpu==1.31.*"]
    assert runtimes_of["training"] == ["onnxruntime-training-cpu==1.19.2"]
    for extra in _runtime.EXTRA_OF.values():
        assert "onnxscript" in {_requirement_name(r) for r in extras[extra]}, extra
    # ONNX Runtime 1.19 reads IR <= 10 (onnx < 1.18); the current ones pin onnx >= 1.18, which makes
    # [cpu,training] and [cuda,training] unresolvable for pip instead of installing two runtimes
    assert "onnx==1.17.*" in extras["training"]
    assert "onnx>=1.19.1" in extras["cpu"] and "onnx>=1.19.1" in extras["cuda"]
    assert "onnx>=1.16" in kwargs["install_requires"]
    assert "<" not in kwargs["python_requires"]


def _make_dry_run(*args):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-C", str(REPO), "-n", "-B", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_install_swaps_out_any_other_runtime_before_installing_its_own():
    out = _make_dry_run("install", "RUNTIME=cpu")
    assert "pip show --quiet onnxruntime-gpu onnxruntime-training onnxruntime-training-cpu" in out
    assert "pip uninstall --quiet -y onnxruntime onnxruntime-gpu onnxruntime-training onnxruntime-training-cpu" in out
    assert 'pip install --quiet -e ".[cpu,dev,mpi]"' in out
    assert out.index("torch==2.13.0") < out.index("pip uninstall") < out.index('-e ".[cpu,dev,mpi]"')
    assert "touch .venv/.installed-cpu" in out


def test_make_test_legacy_runs_the_parity_checkpoint_rewrite_and_mpi_tests_on_the_training_build():
    out = _make_dry_run("test-legacy")
    assert 'pip install --quiet -e ".[training,dev,mpi]"' in out and "touch .venv-legacy/.installed-training" in out
    (command,) = [line for line in out.splitlines() if "-m pytest" in line]
    # in two worker processes, as make test
    assert command.startswith(".venv-legacy/bin/python -m pytest -q -n 2 --dist worksteal ")
    files = command.split()[8:]
    assert {"tests/test_parity.py", "tests/test_checkpoint.py", "tests/test_distributed.py",
            "tests/test_rewrites.py"} <= set(files)
    assert all((REPO / f).is_file() for f in files)


def test_make_test_installs_todays_onnxruntime_by_default_and_runs_the_whole_suite():
    out = _make_dry_run("test")
    assert 'pip install --quiet -e ".[cpu,dev,mpi]"' in out and "touch .venv/.installed-cpu" in out
    assert '".[training' not in out
    (command,) = [line for line in out.splitlines() if "-m pytest" in line]
    # the whole suite but the slow tests (a 2.6 GB model, 16 GB of memory), which make test-large runs; in two
    # worker processes (pytest-xdist, a dev requirement), each taking the next test as it finishes one
    assert shlex.split(command) == [".venv/bin/python", "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-m",
                                    "not slow", "tests"]
    assert "pytest-xdist" in (REPO / "setup.py").read_text()
    (serial,) = [line for line in _make_dry_run("test", "TEST_WORKERS=0").splitlines() if "-m pytest" in line]
    assert shlex.split(serial)[4:6] == ["-n", "0"]  # pytest's own process
    (large,) = [line for line in _make_dry_run("test-large").splitlines() if "-m pytest" in line]
    assert shlex.split(large) == [".venv/bin/python", "-m", "pytest", "-q", "-m", "slow", "tests"]


def test_make_run_trains_the_bundled_config_afresh_each_time():
    """A second `make run` starts over its own output_dir (test_cli: --overwrite), not refused by it."""
    (command,) = [line for line in _make_dry_run("run").splitlines() if "ort-trainer" in line]
    assert shlex.split(command) == [".venv/bin/ort-trainer", "train", "configs/gpt_stdlib.yaml", "--overwrite"]


@pytest.mark.parametrize("codes, expected", [((0, 0), 0), ((2, 0), 1), ((0, 2), 1), ((2, 2), 1)])
def test_ci_script_runs_both_environments_and_fails_if_either_fails(tmp_path, codes, expected):
    fake_make = tmp_path / "make"
    fake_make.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$1" >> {tmp_path / 'calls'}
        case "$1" in test) exit {codes[0]} ;; test-legacy) exit {codes[1]} ;; *) exit 99 ;; esac
    """))
    fake_make.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == expected, result.stdout + result.stderr
    assert (tmp_path / "calls").read_text().split() == ["test", "test-legacy"]

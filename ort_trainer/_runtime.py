"""Which ONNX Runtime is installed, checked first when ``ort_trainer`` is imported.

Every ONNX Runtime distribution (``onnxruntime``, ``onnxruntime-gpu``, ``onnxruntime-training-cpu``,
``onnxruntime-directml``, ...) installs the same ``onnxruntime`` module. Two of them in one
environment overwrite each other's files and leave a module that is a mix of both, which fails in
ways that name neither; so the check here refuses that, and a missing or damaged runtime, with an
``ImportError`` that says what to install or uninstall.

The gradient source (``graph.gradient_source``) is resolved here too, since it depends on what is
installed: ONNX Runtime's ``GradientGraphBuilder`` exists only in the 1.19.2 training build;
PyTorch's autograd exported to standard ONNX works on any runtime but needs ``onnxscript``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import re
import sys
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger("ort_trainer")

#: the ``pip install`` extra of ort_trainer for each supported distribution
EXTRA_OF = {"onnxruntime": "cpu", "onnxruntime-gpu": "cuda", "onnxruntime-training-cpu": "training"}
#: the distributions that carry ONNX Runtime's training code (``GradientGraphBuilder``)
TRAINING_DISTRIBUTIONS = frozenset({"onnxruntime-training", "onnxruntime-training-cpu"})
#: the values of ``graph.gradient_source``
GRADIENT_SOURCES = ("auto", "torch", "onnxruntime")

# Names that may ship the `onnxruntime` module: the official builds (onnxruntime, -gpu, -training,
# -training-cpu, -directml, -openvino, -qnn, -rocm, -migraphx, -cann, -azure, ...), the nightlies
# (ort-nightly, ort-nightly-gpu, ...) and forks. Each candidate is confirmed by its file list, which
# leaves out the ones that ship another module (onnxruntime-extensions, onnxruntime-genai, ...).
_CANDIDATE_NAME = re.compile(r"^(onnxruntime|ort-nightly)")
_WELL_KNOWN = frozenset({"onnxruntime", "onnxruntime-gpu", "onnxruntime-training", "onnxruntime-training-cpu"})

_INSTALL_ONE = (
    '  pip install "ort_trainer[cpu]"       # onnxruntime >= 1.31: the default, any gradient through PyTorch\n'
    '  pip install "ort_trainer[cuda]"      # onnxruntime-gpu >= 1.31 (CUDA 13)\n'
    '  pip install "ort_trainer[training]"  # onnxruntime-training-cpu 1.19.2 and its own gradient builder '
    "(Python <= 3.12)\n"
    'From a clone of the repository: pip install -e ".[cpu]" (or ".[cuda]", ".[training]").'
)


@dataclass(frozen=True)
class RuntimeDistribution:
    """One installed distribution that ships the ``onnxruntime`` module.

    Attributes:
        name: the distribution's normalised name (``onnxruntime-training-cpu``).
        version: its version string (``1.19.2``).
    """

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"

    @property
    def pin(self) -> str:
        """The requirement that reinstalls exactly this distribution (``onnxruntime==1.31.1``)."""
        return f"{self.name}=={self.version}"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _ships_onnxruntime_module(dist: metadata.Distribution, name: str) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return "onnxruntime" in top_level.split()
    files = dist.files
    if files is not None:
        return any(f.parts[:1] == ("onnxruntime",) for f in files)
    return name in _WELL_KNOWN  # no file list to read: trust the name


def installed_runtimes() -> list[RuntimeDistribution]:
    """The installed distributions that ship the ``onnxruntime`` module, read from package metadata.

    A distribution found twice on ``sys.path`` (a user site and a virtual environment) counts once,
    as the copy Python imports.

    Returns:
        The distributions, sorted by name; empty when none is installed.
    """
    found: dict[str, RuntimeDistribution] = {}
    for dist in metadata.distributions():
        raw_name = dist.metadata["Name"] if dist.metadata is not None else None
        if not raw_name:
            continue
        name = _normalise(raw_name)
        if name in found or not _CANDIDATE_NAME.match(name) or not _ships_onnxruntime_module(dist, name):
            continue
        found[name] = RuntimeDistribution(name, dist.version)
    return sorted(found.values(), key=lambda d: d.name)


def _import_onnxruntime():
    already = "onnxruntime" in sys.modules
    root_handlers = list(logging.getLogger().handlers)
    module = importlib.import_module("onnxruntime")
    if not already:
        # Importing the training build calls logging.basicConfig() as a side effect (its
        # tools/logger.py); take that root handler back off so the application's logging is its own.
        for handler in logging.getLogger().handlers[:]:
            if handler not in root_handlers:
                logging.getLogger().removeHandler(handler)
    return module


def check_runtime() -> RuntimeDistribution | None:
    """Check that exactly one ONNX Runtime is installed and imports; called when ort_trainer is imported.

    An ``onnxruntime`` module with no package metadata (a build from source on ``PYTHONPATH``) is
    accepted when it imports.

    Returns:
        The installed distribution, or None for a module without package metadata.

    Raises:
        ImportError: when none is installed (saying which extra to install), when two or more are
            (naming them, with the commands that uninstall them and reinstall the one wanted), or
            when the one installed does not import (with the command that reinstalls it).
    """
    runtimes = installed_runtimes()
    if len(runtimes) > 1:
        names = " ".join(d.name for d in runtimes)
        reinstall = " | ".join(f"pip install {d.pin}" for d in runtimes)
        raise ImportError(
            f"ort_trainer found {len(runtimes)} ONNX Runtime distributions installed together: "
            f"{', '.join(map(str, runtimes))}. They all install the same `onnxruntime` module and overwrite "
            "each other's files, so what imports is a mix of them. Uninstall all of them, then install "
            f"the one you want:\n  pip uninstall -y {names}\n  then one of: {reinstall}\n"
            "or through ort_trainer's extras:\n" + _INSTALL_ONE
        )
    try:
        _import_onnxruntime()
    except Exception as error:  # a damaged native module raises OSError or others, not only ImportError
        if not runtimes:
            raise ImportError(
                "ort_trainer needs ONNX Runtime, and none is installed "
                f"(`import onnxruntime`: {type(error).__name__}: {error}). Install exactly one:\n" + _INSTALL_ONE
            ) from error
        (dist,) = runtimes
        raise ImportError(
            f"{dist} is installed but `import onnxruntime` fails ({type(error).__name__}: {error}). "
            "Its files are damaged or incomplete (for example another ONNX Runtime distribution was "
            "installed over it, or uninstalled after it); reinstall it:\n"
            f"  pip install --force-reinstall --no-deps {dist.pin}"
        ) from error
    if not runtimes:
        logger.debug("onnxruntime imports without package metadata (a build from source?); using it")
        return None
    return runtimes[0]


@functools.cache
def has_training_build() -> bool:
    """Whether the installed ONNX Runtime has its training code (the pybind ``GradientGraphBuilder``).

    Returns:
        True on ``onnxruntime-training`` / ``onnxruntime-training-cpu`` 1.19.2, False on the current
        runtimes (``onnxruntime``, ``onnxruntime-gpu``).
    """
    try:
        from onnxruntime.capi._pybind_state import GradientGraphBuilder  # noqa: F401
    except ImportError:
        return False
    return True


def has_onnxscript() -> bool:
    """Whether ``onnxscript`` (which ``torch.onnx.export(dynamo=True)`` needs) is installed."""
    return importlib.util.find_spec("onnxscript") is not None


def runtime_description() -> str:
    """One line naming the installed ONNX Runtime, for logs and error messages.

    Returns:
        For example ``"onnxruntime 1.31.1 (no training build; providers: CPUExecutionProvider)"``.
    """
    import onnxruntime as ort

    runtimes = installed_runtimes()
    name = ", ".join(map(str, runtimes)) or f"onnxruntime {ort.__version__} (no package metadata)"
    build = "training build" if has_training_build() else "no training build"
    return f"{name} ({build}; providers: {', '.join(ort.get_available_providers())})"


def gradient_source_problem(value: object) -> str | None:
    """Why ``graph.gradient_source=value`` cannot work with what is installed, or None when it can.

    Args:
        value: the option's value: ``"auto"``, ``"torch"`` or ``"onnxruntime"``.

    Returns:
        A message that names the problem and the fix, or None.
    """
    if value not in GRADIENT_SOURCES:
        return f"must be one of {list(GRADIENT_SOURCES)}, got {value!r}"
    if value == "onnxruntime" and not has_training_build():
        return (
            "'onnxruntime' builds gradients with ONNX Runtime's GradientGraphBuilder, which only the "
            f"1.19.2 training build has, and the installed runtime is {runtime_description()}. Install "
            'that build instead (pip uninstall -y the installed one, then pip install "ort_trainer[training]"), '
            "or use 'torch' (or 'auto'): PyTorch's autograd exported to standard ONNX, on any runtime"
        )
    if (value == "torch" or (value == "auto" and not has_training_build())) and not has_onnxscript():
        chosen = "'torch'" if value == "torch" else "'auto' (here 'torch': the runtime has no training build)"
        return (
            f"{chosen} exports PyTorch's forward + backward graph with torch.onnx's dynamo exporter, "
            "which needs onnxscript, not installed: pip install onnxscript (every runtime extra of "
            'ort_trainer includes it: pip install "ort_trainer[cpu]")'
        )
    return None


def resolve_gradient_source(value: str = "auto") -> str:
    """The gradient source that ``graph.gradient_source=value`` selects with the installed runtime.

    Args:
        value: ``"auto"`` (ONNX Runtime's gradient builder when the training build is installed,
            else PyTorch's autograd), ``"torch"`` or ``"onnxruntime"``.

    Returns:
        ``"torch"`` or ``"onnxruntime"``.

    Raises:
        ValueError: when the value is unknown or the installed packages cannot provide that source
            (the message says what to install).
    """
    problem = gradient_source_problem(value)
    if problem:
        raise ValueError(f"graph.gradient_source: {problem}")
    if value == "auto":
        return "onnxruntime" if has_training_build() else "torch"
    return value

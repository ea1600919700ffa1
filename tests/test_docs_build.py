"""The documentation site builds with warnings as errors (``make docs``): every public name of the API
reference has a docstring that renders, every link between pages resolves, and the option and
config-key tables come from the schemas in the code (docs/hooks.py).

The build needs the ``docs`` extra (mkdocs, mkdocstrings), which ``dev`` includes.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "mkdocstrings", "griffe")),
    reason="mkdocs and mkdocstrings are not installed (pip install -e '.[docs]'; the dev extra has them)",
)


def _hooks():
    """docs/hooks.py as a module (it is loaded by path, as mkdocs loads it)."""
    spec = importlib.util.spec_from_file_location("ort_trainer_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    problems = [line for line in result.stderr.splitlines() if not line.startswith("INFO")]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems[-60:])
    site = tmp_path / "site"
    for page in ("index.html", "usage.html", "reference/ort_trainer.html", "reference/optim.html",
                 "reference/amp.html", "reference/distributed.html", "reference/options.html", "reference/cli.html"):
        assert (site / page).is_file(), page
    assert 'id="ort_trainer.ORTTrainer.train_step"' in (site / "reference" / "ort_trainer.html").read_text()
    assert "train.max_steps" in (site / "reference" / "cli.html").read_text()
    options = (site / "reference" / "options.html").read_text()
    assert "graph_optimizations.sparse_labels" in options and "<!-- options-table -->" not in options


def test_every_name_the_reference_renders_has_a_docstring():
    assert _hooks().check_docstrings(DOCS) == []


def test_every_config_key_has_a_line_in_the_reference():
    from ort_trainer import _cli_config

    keys = {path for path, _ in _cli_config.leaves(_cli_config.DEFAULTS)}
    assert set(_cli_config.KEY_DOCS) == keys


def test_the_docstring_check_finds_a_missing_docstring(tmp_path):
    """A public function, method or attribute without a docstring is found; one that its class's
    docstring describes, a private name, or a name outside ``__all__`` is not."""
    import griffe

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        """A package."""

        __all__ = ["Described", "bare", "documented"]


        def documented():
            """Has one."""


        def bare():
            pass


        def unexported():
            pass


        class Described:
            """A class.

            Args:
                size: described as an argument.
            """

            def __init__(self, size, other):
                self.size = size
                self.other = other
                self._private = 0

            def method(self):
                pass
    '''))
    loaded = griffe.load("pkg", search_paths=[str(tmp_path)], resolve_aliases=True)
    missing = sorted(entry.split(" ")[0] for entry in _hooks().undocumented("pkg", loaded))
    assert missing == ["pkg.Described.method", "pkg.Described.other", "pkg.bare"]


def test_a_link_out_of_docs_is_info_and_a_broken_link_between_pages_a_warning():
    outside = _hooks()._OutsideDocsLinks()

    def level(message: str) -> int:
        record = logging.LogRecord("mkdocs.structure.pages", logging.WARNING, __file__, 0, message, None, None)
        outside.filter(record)
        return record.levelno

    assert level("Doc file 'usage.md' contains a link '../benchmarks/run.py', but the target is not found "
                 "among documentation files.") == logging.INFO
    assert level("Doc file 'benchmarks_real/a.md' contains a link '../../configs/x.yaml', but the target "
                 "'../configs/x.yaml' is not found among documentation files.") == logging.INFO
    assert level("Doc file 'usage.md' contains a link 'desing.md', but the target is not found among "
                 "documentation files.") == logging.WARNING

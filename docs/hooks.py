"""mkdocs hooks of the API reference (mkdocs.yml ``hooks``).

- Every name the reference renders must have a docstring: each ``::: identifier`` of
  ``docs/reference/*.md`` is walked as mkdocstrings walks it (a module's public members, a class's
  public members, inherited ones included), and a name without a docstring is a warning, so
  ``mkdocs build --strict`` fails on it. An attribute counts as documented when the docstring of
  the class shown describes it (an ``Attributes:`` item, or the constructor argument it holds).
- ``<!-- options-table -->`` and ``<!-- config-table -->`` in a page become the tables of
  ``ORTTrainerOptions``' keys and of the ``ort-trainer train`` config keys, read from the schemas in
  the code (``ort_trainer.options._SCHEMA``, ``ort_trainer._cli_config``), so they cannot drift.
- A link that leaves ``docs/`` (``../benchmarks/run.py``) is not a page of the site: mkdocs' "not
  found" warning for it becomes an info line. Links between pages must still resolve.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("mkdocs.hooks.reference")

IDENTIFIER = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
SECTIONS_NAMING_ATTRIBUTES = ("attributes", "parameters")


# ---- every rendered name has a docstring ---------------------------------------------------------
def identifiers(reference_dir: Path) -> list[str]:
    """The ``::: identifier`` targets of the reference pages, in page order."""
    found = []
    for page in sorted(reference_dir.glob("*.md")):
        found += IDENTIFIER.findall(page.read_text(encoding="utf-8"))
    return found


def _has_docstring(obj: Any) -> bool:
    return bool(obj.docstring and obj.docstring.value.strip())


def _described_names(obj: Any) -> set[str]:
    """The names an ``Attributes:`` or ``Args:`` section of ``obj``'s docstring (or its ``__init__``'s) lists."""
    names: set[str] = set()
    for owner in (obj, obj.members.get("__init__")):
        if owner is None or not _has_docstring(owner):
            continue
        # quiet about parameters: mkdocstrings reports the docstrings' problems when it renders them
        for section in owner.docstring.parse("google", warn_unknown_params=False, warn_missing_types=False):
            if section.kind.value in SECTIONS_NAMING_ATTRIBUTES:
                names.update(item.name for item in section.value)
    return names


def _rendered_members(obj: Any) -> Iterator[Any]:
    """The members mkdocstrings shows with ``filters: public``, less the submodules (a page each, or
    none) and a class's special methods (``__repr__``: shown only when they have a docstring): in a
    module, the names of its ``__all__``; in a class, its public names, inherited ones included."""
    members = obj.all_members if obj.is_class else obj.members
    for member in members.values():
        if not member.is_public or member.is_module or (obj.is_class and member.is_special):
            continue
        yield member


def undocumented(identifier: str, package: Any) -> list[str]:
    """The names that ``::: identifier`` renders without a docstring (``package``: griffe's ``ort_trainer``)."""
    path = identifier.split(".")[1:]
    obj = package
    for part in path:
        obj = obj.members[part]
    missing: list[str] = []

    def walk(item: Any, described: set[str]) -> None:
        target = item.final_target if item.is_alias else item
        if not _has_docstring(target) and not (target.is_attribute and item.name in described):
            missing.append(f"{item.path} ({target.kind.value}, {target.relative_filepath}:{target.lineno})")
        if target.is_class or target.is_module:
            inner = _described_names(target) if target.is_class else set()
            for member in _rendered_members(target):
                walk(member, inner)

    walk(obj, set())
    return missing


def check_docstrings(docs_dir: Path) -> list[str]:
    """Every rendered name without a docstring, over all the reference pages."""
    import griffe

    package = griffe.load("ort_trainer", search_paths=[str(docs_dir.parent)], resolve_aliases=True)
    missing: list[str] = []
    for identifier in identifiers(docs_dir / "reference"):
        missing += [name for name in undocumented(identifier, package) if name not in missing]
    return missing


# ---- the generated tables ------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{_cell(repr(value))}`"


def _yaml(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return f"`{_cell(text.removesuffix('...').strip())}`"


def options_table() -> str:
    """``ORTTrainerOptions``' keys: one row per key of ``options._SCHEMA``."""
    from ort_trainer import options

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for path, field in options._SCHEMA.items():
        kinds = "any" if field.types == options._ANY else " or ".join(t.__name__ for t in field.types)
        default = "automatic (see meaning)" if field.default is options._SENTINEL else _code(field.default)
        rows.append(f"| `{path}` | {kinds} | {default} | {_cell(field.doc)} |")
    return "\n".join(rows)


def config_table() -> str:
    """The ``ort-trainer train`` config keys: one row per key of ``_cli_config.DEFAULTS``."""
    from ort_trainer import _cli_config as config

    rows = ["| key | type | default | allowed values | meaning |", "|---|---|---|---|---|"]
    for path, default in config.leaves(config.DEFAULTS):
        kind = "mapping" if path == "options" else type(default).__name__
        allowed = config.RULES[path][1] if path in config.RULES else f"any {kind}"
        meaning = config.KEY_DOCS.get(path)
        if meaning is None:
            log.warning("config key %s has no line in ort_trainer._cli_config.KEY_DOCS", path)
        rows.append(f"| `{path}` | {kind} | {_yaml(default)} | {_cell(allowed)} | {_cell(meaning or '')} |")
    for path in sorted(set(config.KEY_DOCS) - {path for path, _ in config.leaves(config.DEFAULTS)}):
        log.warning("ort_trainer._cli_config.KEY_DOCS describes %s, which is not a config key", path)
    return "\n".join(rows)


TABLES = {"<!-- options-table -->": options_table, "<!-- config-table -->": config_table}


# ---- links that leave docs/ ----------------------------------------------------------------------
class _OutsideDocsLinks(logging.Filter):
    """Turns mkdocs' "not found" warning for a link that leaves docs/ into an info line."""

    LINK = re.compile(r"contains a link '([^']*)', but the target '?([^' ]*)'? ?is not found")

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.LINK.search(record.getMessage()) if record.levelno == logging.WARNING else None
        if match and (match.group(2) or match.group(1)).startswith("../"):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


# ---- the hooks -----------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    """Install the link filter once."""
    pages = logging.getLogger("mkdocs.structure.pages")
    if not any(isinstance(f, _OutsideDocsLinks) for f in pages.filters):
        pages.addFilter(_OutsideDocsLinks())
    return config


def on_pre_build(config: Any) -> None:
    """Warn (an error under ``--strict``) for each rendered name without a docstring."""
    for name in check_docstrings(Path(config["docs_dir"])):
        log.warning("no docstring: %s", name)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the table placeholders with the generated tables."""
    for placeholder, table in TABLES.items():
        if placeholder in markdown:
            markdown = markdown.replace(placeholder, table())
    return markdown

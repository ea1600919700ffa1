"""Checks that raise: a tensor's value tested by ``if <condition>: raise ...`` or ``assert <condition>``.

Input validation reads the batch into Python (Hugging Face's CTC models: ``if labels.max() >= vocab_size: raise
ValueError(...)``; ``F.gaussian_nll_loss``: ``if torch.any(var < 0): raise ValueError(...)``). The export guard
refuses a value read from the data, because the graph would freeze the traced batch's branch; but a check's
branches are "raise" and "go on", and the graph can only be the second. Such a check is traced where it passes:
the guard gives the condition the value that goes on, and logs once, as a warning, that the graph does not make
the check for each batch as PyTorch does.

A check is recognised from the source of the line that reads the value: an ``if`` statement whose test holds that
line, whose body is one ``raise`` and which has no ``else``; or an ``assert`` statement. The value that goes on
is False for an ``if`` (True under one ``not``) and True for an ``assert`` (False under one ``not``); a test whose
``and`` / ``or`` operands are negated differently is not recognised (which value goes on is not known).
"""

from __future__ import annotations

import ast
import functools
import linecache
import sys
from types import FrameType
from typing import Callable

from ..._logging import warn_once


def source_line(filename: str, lineno: int) -> str:
    """``file:line (code)`` (``file:line`` where the source is not at hand), as problems and warnings name a line."""
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno} ({code})" if code else f"{filename}:{lineno}"


def caller_outside(skipped: Callable[[str], bool]) -> FrameType | None:
    """The innermost frame of this call's stack whose file ``skipped`` does not take (the caller's own file is
    tested too: skip it where it is not the user's)."""
    frame = sys._getframe(1)
    while frame is not None and skipped(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_line(frame: FrameType | None) -> str:
    """``source_line`` of ``frame``'s current line (``<unknown line>`` for None)."""
    return "<unknown line>" if frame is None else source_line(frame.f_code.co_filename, frame.f_lineno)


def warn_traced_check(what: str) -> None:
    """Log, the first time for ``what`` (a check named by its line, or a torch function's check), that the graph does
    not make that check for each batch."""
    warn_once(("check", what), "%s: a check that raises, on values of the batch or the weights. PyTorch makes it on "
              "every batch; the exported graph cannot raise, so it is traced where the check passes and does not make "
              "it: validate the data before train_step where it matters", what)


@functools.lru_cache(maxsize=16)
def source_tree(filename: str) -> ast.Module | None:
    """The parsed source of ``filename`` as ``linecache`` holds it; None where it cannot be parsed."""
    try:
        return ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def _check_statement(filename: str, lineno: int) -> ast.If | ast.Assert | None:
    """The innermost ``if`` (its body one ``raise``, no ``else``) or ``assert`` whose test spans ``lineno``."""
    tree = source_tree(filename)
    if tree is None:
        return None
    found = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.Assert)) and node.test.lineno <= lineno <= (node.test.end_lineno or 0):
            if found is None or node.test.lineno >= found.test.lineno:
                found = node
    if isinstance(found, ast.If) and (found.orelse or len(found.body) != 1 or not isinstance(found.body[0],
                                                                                              ast.Raise)):
        return None
    return found


def _negated(test: ast.expr) -> bool | None:
    """Whether a tensor's truth value enters ``test`` negated; None where its operands differ."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _negated(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        kinds = {_negated(value) for value in test.values}
        return kinds.pop() if len(kinds) == 1 else None
    return False


def passing_value(frame: FrameType | None) -> bool | None:
    """The truth value with which the check on ``frame``'s line goes on, or None where that line is no check
    (module docstring); logs the first time a check is found."""
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    statement = _check_statement(filename, lineno)
    negated = None if statement is None else _negated(statement.test)
    if negated is None:
        return None
    warn_traced_check(source_line(filename, lineno))
    return negated if isinstance(statement, ast.If) else not negated


__all__ = ["passing_value", "source_line", "source_tree", "warn_traced_check"]

"""The user-error type: a mistake the user can fix, with its cause and the fix.

Every stage raises `UserError` for bad input (a wrong path, a bad jsonl line, clashing
settings); the CLI prints the cause and the fix and exits with code 2, and nothing has been
written by then. Anything else is a bug or an engine failure and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix. The CLI prints `cause` and `fix` and exits with code 2."""

    def __init__(self, cause: str, fix: str | None = None):
        super().__init__(cause if fix is None else f"{cause} (fix: {fix})")
        self.cause = cause
        self.fix = fix


def bad_line(path: str, line: int, reason: str, fix: str) -> UserError:
    """A UserError about one line of an input file: `path:line: reason`."""
    return UserError(f"{path}:{line}: {reason}", fix)

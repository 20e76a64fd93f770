"""User errors, and the one wrapper every command line runs under.

A :class:`UserError` is a problem the user can fix: a bad value in ``params.yaml``, a missing or malformed input
file, a cache store or a draft made for another target, a damaged file. Its message names the file, the field, the
value and what to do, on one line. :func:`run_stage` (the entry of ``stages/*.py`` and of ``dspark``) prints it as
``error: <message>`` on stderr and exits with status :data:`EXIT_USER_ERROR` -- no traceback. Every other exception
is a bug and keeps its full traceback.

``UserError`` is a ``ValueError``: code that catches ``ValueError`` around a check keeps working.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A problem in the user's inputs; the message says where (file, field, value) and what to do."""


def report_user_error(err: UserError) -> None:
    """Print ``error: <message>`` on stderr and exit with status 2."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def run_stage(main: Callable[..., Any]) -> None:
    """Run a typer command function (``stages/*.py``) or a ``typer.Typer`` app; a :class:`UserError` it raises
    becomes two words and a line on stderr and exit status 2 (the rich traceback is for bugs only)."""
    import typer

    try:
        if isinstance(main, typer.Typer):
            main()
        else:
            typer.run(main)
    except UserError as e:
        report_user_error(e)

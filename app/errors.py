"""Turning exceptions in callbacks into messages: a user sees what was wrong, never a traceback."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from dash import html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.errors import InputError
from headscope.analysis.models import ModelError
from headscope.analysis.store import StoreReadError, StoreWriteError

log = logging.getLogger("headscope.app")

# Analyses validate their inputs at the boundary and raise ValueError with a message meant for
# users (InputError and ModelError are ValueErrors too); a result the store could not write, or a
# stored one it could not read right now (too many open files, an I/O error: the record stays), says
# so and what to check (its message names no server path).
USER_ERRORS: tuple[type[Exception], ...] = (InputError, ModelError, ValueError, StoreWriteError, StoreReadError)


def message(problems: Sequence[str] | str) -> list | str:
    """Children for the error banner (empty string hides it)."""
    if isinstance(problems, str):
        problems = [problems] if problems else []
    return [html.Div(p, className="hs-error-line") for p in problems] if problems else ""


def guarded(outputs: int, error_index: int | None = None) -> Callable:
    """Wrap a callback with ``outputs`` outputs; the error message goes to ``error_index``
    (default: the last output). Other outputs are left unchanged on error."""
    index = outputs - 1 if error_index is None else error_index

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except PreventUpdate:
                raise
            except USER_ERRORS as e:
                text = str(e)
            except MemoryError:
                text = "The analysis ran out of memory. Try a shorter input."
            except Exception as e:  # a bug: log it with its traceback, show a short message
                log.exception("callback %s failed", fn.__name__)
                text = f"Something went wrong ({type(e).__name__}). The server log has the details."
            result = [no_update] * outputs
            result[index] = message(text)
            return tuple(result) if outputs > 1 else result[0]

        return inner

    return wrap

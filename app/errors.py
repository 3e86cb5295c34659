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


def guarded(outputs: int | Sequence[str], error_index: int | None = None, *, error: str = "error") -> Callable:
    """Wrap a callback so an exception becomes a message in one of its outputs.

    ``outputs`` is either the number of positional outputs (the message goes to ``error_index``, by
    default the last) or the names of a callback declared with named outputs (Dash's flexible
    signature, ``output=dict(figure=Output(...), error=Output(...))``): the callback returns a dict
    with any of those names, names it leaves out are ``no_update``, and the message goes to the
    output named ``error``. Other outputs are left unchanged on error."""
    if isinstance(outputs, int):
        return _guarded_positional(outputs, outputs - 1 if error_index is None else error_index)
    names = tuple(outputs)
    if error not in names:
        raise ValueError(f"the error output {error!r} is not one of the outputs {names}")

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                given = fn(*args, **kwargs)
                unknown = set(given) - set(names)
                if unknown:
                    raise KeyError(f"{fn.__name__} returned outputs it does not declare: {sorted(unknown)}")
                return {name: given.get(name, no_update) for name in names}
            except PreventUpdate:
                raise
            except Exception as e:  # noqa: BLE001 - every failure becomes a message (see _failure)
                return {**dict.fromkeys(names, no_update), error: message(_failure(fn, e))}

        return inner

    return wrap


def _failure(fn: Callable, e: Exception) -> str:
    """What a user sees when ``fn`` raised ``e``: the message of an error meant for users, or a short
    note for a bug (logged with its traceback)."""
    if isinstance(e, USER_ERRORS):
        return str(e)
    if isinstance(e, MemoryError):
        return "The analysis ran out of memory. Try a shorter input."
    log.exception("callback %s failed", fn.__name__, exc_info=e)
    return f"Something went wrong ({type(e).__name__}). The server log has the details."


def _guarded_positional(outputs: int, index: int) -> Callable:
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except PreventUpdate:
                raise
            except Exception as e:  # noqa: BLE001 - every failure becomes a message (see _failure)
                result = [no_update] * outputs
                result[index] = message(_failure(fn, e))
                return tuple(result) if outputs > 1 else result[0]

        return inner

    return wrap

"""Values typed into a page's form, checked once for every page: comma-separated number lists and whole
numbers. A bad value is an :class:`headscope.analysis.errors.InputError` whose message names the field."""

from __future__ import annotations

from typing import Any

from headscope.analysis.errors import InputError


def number_list(text: Any, what: str, cast: type = float, most: int = 12) -> list:
    """The numbers of a text box (commas or semicolons between them), each ``cast``; 1 to ``most`` of them.
    Written in ASCII: ``٣`` or ``３`` are digits to Python, not numbers a user meant to type."""
    if not str(text or "").isascii():
        raise InputError(f"{what} must be numbers written with the digits 0-9, got {str(text)[:40]!r}.")
    try:
        values = [cast(x) for x in str(text or "").replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{what} must be numbers separated by commas, got {str(text)[:40]!r}.") from None
    if not values:
        raise InputError(f"Give at least one value for {what.lower()}.")
    if len(values) > most:
        raise InputError(f"At most {most} values for {what.lower()}.")
    return values


def whole_number(value: Any, what: str, low: int, high: int | None = None) -> int:
    """A number box's value as an int from ``low`` to ``high`` (2.0 is 2; 2.5, text and booleans are
    refused). Give the box the same ``min`` and ``max``: the browser then sends nothing (None) for a
    number outside them, and the message says so rather than echoing what was typed."""
    bounds = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
    if value is None:
        raise InputError(f"{what} must be a whole number {bounds}: the box is empty or holds a number outside that.")
    if (isinstance(value, bool) or not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf"))
            or value != int(value) or value < low or (high is not None and value > high)):
        shown = repr(value) if len(repr(value)) <= 20 else repr(value)[:20] + "…"
        raise InputError(f"{what} must be a whole number {bounds}, got {shown}.")
    return int(value)

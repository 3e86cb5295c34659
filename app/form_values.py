"""Values typed into a page's form, checked once for every page: comma-separated number lists and whole
numbers. A bad value is an :class:`analysis.errors.InputError` whose message names the field."""

from __future__ import annotations

from typing import Any

from analysis.errors import InputError


def number_list(text: Any, what: str, cast: type = float, most: int = 12) -> list:
    """The numbers of a text box (commas or semicolons between them), each ``cast``; 1 to ``most`` of them."""
    try:
        values = [cast(x) for x in str(text or "").replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{what} must be numbers separated by commas, got {str(text)[:40]!r}.") from None
    if not values:
        raise InputError(f"Give at least one value for {what.lower()}.")
    if len(values) > most:
        raise InputError(f"At most {most} values for {what.lower()}.")
    return values


def whole_number(value: Any, what: str, low: int) -> int:
    """A number box's value as an int of at least ``low`` (2.0 is 2; 2.5, text and booleans are refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < low:
        raise InputError(f"{what} must be a whole number of at least {low}, got {value!r}.")
    return int(value)

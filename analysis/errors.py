"""Errors a user can cause, and the range checks that raise them, in one place.

:class:`InputError` is what every analysis raises for input a user can fix; the app shows its message
in the page's banner and the CLI prints it as one line (exit status 2), never a traceback.

Layers and heads are checked here, once, at the boundary (the analysis function a page, a job or the
CLI calls); the code inside trusts them. Layers count from 0 to ``n_layers − 1``, query heads from 0
to ``n_heads − 1`` in every layer (DESIGN.md, *Definitions*: ``A[l, h]``).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any


class InputError(ValueError):
    """Input a user can fix: the message says what was wrong and what to do."""


# A numeral in ASCII digits: "٣", "３" or "𝟑" are digits to int() but no head number a user meant to type
_NUMERAL = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_OTHER_DIGITS = re.compile(r"\s*[+-]?\d+\s*")
# More significant digits than any layer or head count has: out of range, without converting it (int()
# refuses numerals past 4,300 digits, with a message about Python's limit)
_MOST_DIGITS = 18


def _long_numeral(value: Any) -> bool:
    return isinstance(value, str) and bool(_NUMERAL.fullmatch(value)) and \
        len(value.strip().lstrip("+-").lstrip("0")) > _MOST_DIGITS


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (an int, a whole float, a numeral in ASCII digits of at
    most 18 significant digits), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):  # int and numpy's integers (numpy not imported: the CLI reads
        # manifests with parse_json before anything heavy loads)
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    if isinstance(value, str) and _NUMERAL.fullmatch(value) and not _long_numeral(value):
        text = value.strip()
        return (-1 if text.startswith("-") else 1) * int(text.lstrip("+-").lstrip("0") or "0")  # 000…07 is 7
    return None


def shown(value: Any) -> str:
    """``value`` as a message shows it: a numeral plainly (a very long one cut, with its length), anything
    else as ``repr`` writes it, cut at 40 characters."""
    if isinstance(value, str) and _NUMERAL.fullmatch(value):
        digits = value.strip()
        return digits if len(digits) <= 20 else f"{digits[:10]}…{digits[-4:]} ({len(digits):,} digits)"
    return _cut_repr(value)


def _cut_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _not_whole(what: str, *values: Any) -> str:
    """The message for ``values`` that are not whole numbers (``what``: "Layer", "Layer and head")."""
    given = " and ".join(_cut_repr(v) for v in values)
    kind = "whole numbers" if len(values) > 1 else "a whole number"
    if any(isinstance(v, str) and _OTHER_DIGITS.fullmatch(v) and not _NUMERAL.fullmatch(v) for v in values):
        kind += " written with the digits 0-9"
    return f"{what} must be {kind}, got {given}."


def parse_json(text: str | bytes) -> Any:
    """``text`` parsed as JSON, or ``ValueError`` (never another exception) when it is not JSON a
    person or a page could have meant: malformed, nested too deeply for the parser (``RecursionError``),
    or holding a numeral too long to convert. The one parser for JSON that comes from outside (a
    request body, a pasted needles list, a manifest or needles file given to the CLI)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None
    except ValueError as e:
        raise ValueError(str(e)) from None


def check_layer(n_layers: int, layer: Any) -> int:
    """``layer`` as an int in ``0 .. n_layers − 1``; an :class:`InputError` naming the valid range otherwise."""
    index = _whole(layer)
    if index is None and not _long_numeral(layer):
        raise InputError(_not_whole("Layer", layer))
    if index is None or not 0 <= index < n_layers:
        raise InputError(f"Layer {shown(layer) if index is None else index} is out of range: the model has "
                         f"layers 0..{n_layers - 1}.")
    return index


def check_head(n_heads: int, head: Any, layer: int | None = None, kind: str = "query heads") -> int:
    """``head`` as an int in ``0 .. n_heads − 1`` (``kind``: query heads, or key-value heads where a
    site is per key-value head; ``layer`` only names where, in the message); an :class:`InputError`
    naming the valid range otherwise."""
    index = _whole(head)
    if index is None and not _long_numeral(head):
        raise InputError(_not_whole("Head", head))
    if index is None or not 0 <= index < n_heads:
        where = "" if layer is None else f" in layer {layer}"
        raise InputError(f"Head {shown(head) if index is None else index} is out of range{where}: the model has "
                         f"{kind} 0..{n_heads - 1}.")
    return index


def check_head_index(n_layers: int, n_heads: int, layer: Any, head: Any, kind: str = "query heads"
                     ) -> tuple[int, int]:
    """Validated ``(layer, head)`` for a model of ``n_layers`` layers × ``n_heads`` query heads.

    Raises
    ------
    InputError
        Not whole numbers, or out of range; the message gives the valid ranges.
    """
    if (_whole(layer) is None and not _long_numeral(layer)) or (_whole(head) is None and not _long_numeral(head)):
        raise InputError(_not_whole("Layer and head", layer, head))
    layer = check_layer(n_layers, layer)
    return layer, check_head(n_heads, head, layer, kind)

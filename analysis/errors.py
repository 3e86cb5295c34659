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
from typing import Any


class InputError(ValueError):
    """Input a user can fix: the message says what was wrong and what to do."""


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (an int, a whole float, a numeral), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):  # int and numpy's integers (numpy not imported: the CLI reads
        # manifests with parse_json before anything heavy loads)
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        try:  # "²" is a digit to isdigit() but not to int(); so is a numeral past 4,300 digits
            return int(value)
        except ValueError:
            return None
    return None


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
    if index is None:
        raise InputError(f"Layer must be a whole number, got {layer!r}.")
    if not 0 <= index < n_layers:
        raise InputError(f"Layer {index} is out of range: the model has layers 0..{n_layers - 1}.")
    return index


def check_head(n_heads: int, head: Any, layer: int | None = None, kind: str = "query heads") -> int:
    """``head`` as an int in ``0 .. n_heads − 1`` (``kind``: query heads, or key-value heads where a
    site is per key-value head; ``layer`` only names where, in the message); an :class:`InputError`
    naming the valid range otherwise."""
    index = _whole(head)
    if index is None:
        raise InputError(f"Head must be a whole number, got {head!r}.")
    if not 0 <= index < n_heads:
        where = "" if layer is None else f" in layer {layer}"
        raise InputError(f"Head {index} is out of range{where}: the model has {kind} 0..{n_heads - 1}.")
    return index


def check_head_index(n_layers: int, n_heads: int, layer: Any, head: Any, kind: str = "query heads"
                     ) -> tuple[int, int]:
    """Validated ``(layer, head)`` for a model of ``n_layers`` layers × ``n_heads`` query heads.

    Raises
    ------
    InputError
        Not whole numbers, or out of range; the message gives the valid ranges.
    """
    if _whole(layer) is None or _whole(head) is None:
        raise InputError(f"Layer and head must be whole numbers, got {layer!r} and {head!r}.")
    layer = check_layer(n_layers, layer)
    return layer, check_head(n_heads, head, layer, kind)

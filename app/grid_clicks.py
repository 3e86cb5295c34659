"""What a click on a layer × head grid does, declared where the grid is laid out (``data-hs-click``,
read by ``assets/grid_clicks.js``): select a head, toggle it in a selection, or ask for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dash import html

from headscope.app import figures
from headscope.app.page_shell import url_id


def head_clicks(component: Any, action: dict[str, Any]) -> html.Div:
    """``component`` (a layer × head grid, or what wraps it) in a holder that says what a click on one of
    its cells does: ``action`` is :func:`select_head`, :func:`toggle_head` or :func:`ask_for_head`.
    ``assets/grid_clicks.js`` reads it from the holder's ``data-hs-click`` when a click lands in the
    grid's plot area, so a page declares its clickable grids where it lays them out."""
    return html.Div(component, **{"data-hs-click": json.dumps(action, separators=(",", ":"))})


def select_head(graph: str, prefix: str, drop: Sequence[str] = (),
                when: dict[str, Sequence[str | None]] | None = None) -> dict[str, Any]:
    """A click on a cell of ``graph`` selects that head in the page's URL (its Location, :func:`url_id`
    of ``prefix``), as a link would, and removes the URL keys in ``drop`` (what a new head resets); only
    while each key of ``when`` has one of its values (None: the key is absent)."""
    return {"do": "select", "graph": graph, "url": url_id(prefix), "drop": list(drop),
            "when": {key: list(values) for key, values in (when or {}).items()}}


def toggle_head(graph: str, pending: str, box: str) -> dict[str, Any]:
    """A click on a cell of ``graph`` adds that head to the selection in the store ``pending``, or removes
    it, and writes the selection into the heads box ``box`` and onto the map (its
    :data:`headscope.app.figures.CHOSEN_TRACE` markers and the count in its title), in the browser."""
    return {"do": "toggle", "graph": graph, "pending": pending, "box": box, "marks": figures.CHOSEN_TRACE}


def ask_for_head(graph: str, store: str) -> dict[str, Any]:
    """A click on a cell of ``graph`` puts ``{"layer", "head", "click"}`` into the store ``store`` (the
    click count makes the same head clicked again a new request); not on a map whose cells are
    positions (``layout.meta.cells == "positions"``)."""
    return {"do": "ask", "graph": graph, "store": store}

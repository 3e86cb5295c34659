"""The page for a path no page has (Dash Pages shows the module named ``not_found_404`` for it):
"No page at /x" in the app's own layout, with a link to every page, instead of Dash's bare 404.

The path is shown as text (React escapes it), shortened when long; nothing in it is ever read as a
file name or run."""

from __future__ import annotations

from urllib.parse import unquote

import dash
from dash import dcc, html

dash.register_page(__name__, path="/not-found", name="Not found", title="headscope — no such page", nav=False)

SHOWN = 200  # characters of the path shown


def asked_path() -> str:
    """The path the browser asked for, decoded and shortened past :data:`SHOWN` characters: the pages
    router builds this layout inside its callback, whose input is the browser location's pathname."""
    try:
        inputs = dash.ctx.inputs
    except Exception:  # built outside a request (the offers walk): no path
        inputs = {}
    path = next((v for k, v in inputs.items() if k.endswith(".pathname") and isinstance(v, str)), None)
    if path is None:
        return "this address"
    path = unquote(path, errors="replace")
    return path if len(path) <= SHOWN else f"{path[:SHOWN]}… ({len(path):,} characters)"


def layout(**_query) -> html.Div:
    pages = [p for p in dash.page_registry.values() if p.get("nav", True)]
    return html.Div(
        [
            html.H2(["No page at ", html.Code(asked_path())], className="hs-section"),
            html.P("This address names no headscope page: it may be mistyped, or come from a link to a page "
                   "that does not exist. These are the pages:"),
            html.Ul([html.Li([dcc.Link(p["name"], href=p["relative_path"]),
                              html.Span(f" — {p['title'].removeprefix('headscope — ')}", className="hs-hint")])
                     for p in pages]),
        ],
        id="hs-not-found",
        className="hs-panel",
    )

"""The export buttons under a figure and the one callback per page that turns a click into a zip of
the figure, its data and the manifest that rebuilds it (:func:`headscope.app.export.bundle`)."""

from __future__ import annotations

from typing import Any

from dash import (
    ALL,
    Input,
    State,
    callback,
    ctx,
    dcc,
    html,
    no_update,
)
from dash.exceptions import PreventUpdate

from headscope.app import ids
from headscope.app.context import get_context
from headscope.app.errors import guarded
from headscope.app.export import FORMATS, bundle
from headscope.app.jobs import on_workers
from headscope.app.page_shell import (
    job_error,
    page_download,
    query_store_id,
    show_in_shell,
    url_state_when_present,
)
from headscope.app.url_state import PageState, parse
from headscope.app.views import VIEWS, names


def export_bar(prefix: str, view: str) -> html.Div:
    return html.Div(
        [html.Span("Export", className="hs-export-label")]
        + [
            html.Button(fmt.upper(), id={"type": ids.EXPORT, "page": prefix, "view": view, "fmt": fmt},
                        className="hs-export-btn",
                        n_clicks=0, **{"data-export": f"{view}-{fmt}"},
                        title=f"Download the {VIEWS[names.split(view)[0]].title.lower()} as {fmt.upper()} with its data and manifest")
            for fmt in FORMATS
        ],
        className="hs-export-bar",
    )


def view_params(view: str, state: PageState, query: int | None = None) -> dict[str, Any]:
    """The parameters a view is drawn with, from the page state (what the page shows is what exports):
    each view declares how (:attr:`headscope.app.views.View.from_state`)."""
    name, which = names.split(view)
    if name not in VIEWS:
        raise PreventUpdate
    return VIEWS[name].from_state(state, query, which)


def _stored_run(state: PageState):
    return get_context().run(state.run) if state.run else None


def register_export(prefix: str, run_of: Any = _stored_run) -> None:
    """One callback per page: any export button → a zip of figure, data and manifest.

    ``run_of(state)`` gives the run the page's figures are drawn from (default: the URL's run).
    """

    show_in_shell(prefix)

    @callback(
        page_download(prefix),  # with Redis this is a job: not the app's download (see job_error)
        job_error(prefix),
        Input({"type": ids.EXPORT, "page": prefix, "view": ALL, "fmt": ALL}, "n_clicks"),
        url_state_when_present(prefix),  # the export buttons vanish with the page: see there
        State(query_store_id(prefix), "data", allow_optional=True),
        **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
        prevent_initial_call=True,
    )
    @guarded(outputs=2)
    def export(clicks, search, query):
        trigger = ctx.triggered_id
        if not isinstance(clicks, list) or not any(isinstance(c, int) and c > 0 for c in clicks):
            raise PreventUpdate
        view, fmt = (trigger.get("view"), trigger.get("fmt")) if isinstance(trigger, dict) else (None, None)
        if not isinstance(view, str) or names.split(view)[0] not in VIEWS or fmt not in FORMATS:
            raise PreventUpdate  # not one of the page's export buttons
        if isinstance(query, bool) or not isinstance(query, int):
            query = None  # the hovered token, when the page has one
        state = parse(search)
        run = run_of(state)
        if run is None and VIEWS[names.split(view)[0]].needs_run:
            return no_update, "Nothing to export yet: run something first."
        params = view_params(view, state, query)
        name, data = bundle(run, names.split(view)[0], params, fmt)
        return dcc.send_bytes(data, name), ""

    export.__name__ = f"export_{prefix}"

"""The text box, model menu and Run button every page has, the callback behind Run, and the line of
chips that describes the run shown. Each page's bar has its own ids (its prefix)."""

from __future__ import annotations

from typing import Any

import numpy as np
from dash import (
    ClientsideFunction,
    Input,
    Output,
    State,
    callback,
    clientside_callback,
    dcc,
    html,
)
from dash.exceptions import PreventUpdate

from headscope.analysis.capture import capture
from headscope.analysis.models import ModelError, load_model
from headscope.analysis.statistics_run import capture_for_page
from headscope.app import ids
from headscope.app.context import get_context, offered_model
from headscope.app.errors import guarded
from headscope.app.jobs import on_workers
from headscope.app.page_shell import job_error, show_in_shell, url_id, url_patch, url_patch_id
from headscope.app.url_state import parse


def text_id(prefix: str) -> str:
    return f"{prefix}-{ids.TEXT}"


def text_fill_id(prefix: str) -> str:
    """The store a page's render writes its run's text to; :func:`fill_text_from_runs` puts it in the
    text box without replacing what the user wrote (a render writing the box itself would)."""
    return f"{prefix}-{ids.TEXT}-fill"


def fill_text_from_runs(prefix: str) -> None:
    """Fill the page's text box from its render's store, in the browser (assets/text_fill.js): an
    empty box gets the run's text; text the user wrote there (neither empty nor what was last put
    there) is never replaced, whether they are still typing or have moved on."""
    clientside_callback(
        ClientsideFunction(namespace="headscope_text", function_name="fill"),
        Output(text_id(prefix), "value"),
        Input(text_fill_id(prefix), "data"),
        State(text_id(prefix), "id"),
        prevent_initial_call=True,
    )


def model_id(prefix: str) -> str:
    return f"{prefix}-{ids.MODEL}"


def run_id(prefix: str) -> str:
    return f"{prefix}-{ids.RUN_BUTTON}"


PROMPT_POLICY_TITLE = ("How a text becomes the model's tokens: a BOS the model expects is prepended and shown "
                       "as token 0, so positions are those the model saw; a model without a chat template "
                       "(a base model) reads plain prompts, and needle-in-a-haystack prompts end with 'Answer:'.")


def prompt_policy(spec: str) -> str:
    """The BOS and chat-template line of a model this server offers
    (:attr:`headscope.analysis.model_facts.ModelFacts.prompt_policy`); "" for any other spec (nothing is claimed
    about a model this server does not load)."""
    try:
        return load_model(offered_model(spec)).facts.prompt_policy
    except ModelError:
        return ""


def run_info(run: Any, layer: int, head: int, policy: str = "") -> html.Div:
    """The line of chips above a run's figures: run id, model, tokens, how it ran, mean loss, the
    model's BOS/template ``policy`` (:func:`prompt_policy`; left out when ""), the selected head."""
    loss = np.nanmean(run.token_loss) if run.n_tokens > 1 else float("nan")
    return html.Div(
        [
            html.Span(f"run {run.short_id}", className="hs-chip"),
            html.Span(run.model_name, className="hs-chip"),
            html.Span(f"{run.n_tokens} tokens", className="hs-chip"),
            *([html.Span(f"statistics mode (no patterns kept; {run.seconds:.1f} s)", className="hs-chip",
                         title="Attention ran through the statistics kernels: the grid, sink map and pooled "
                               "map come from per-row statistics; zoom into the map for exact values.")]
              if not run.has_patterns else []),
            html.Span(f"mean loss {loss:.3f}", className="hs-chip"),
            *([html.Span(policy, className="hs-chip", title=PROMPT_POLICY_TITLE)] if policy else []),
            html.Span(f"selected: layer {layer}, head {head}", className="hs-chip hs-selected"),
        ]
    )


def input_bar(prefix: str, placeholder: str = "Type or paste text to analyse…", model: Any = None) -> html.Div:
    """The text box, model menu and Run button. ``model``: the model the page's link names (its
    ``model=`` query), chosen in the menu from the first frame when the server offers it. Set later, by
    the page's render, a Run pressed at once would run the default model although the link names another."""
    context = get_context()
    chosen = model if isinstance(model, str) and model in context.allowed_models() else context.default_model
    return html.Div(
        [
            dcc.Textarea(id=text_id(prefix), placeholder=placeholder, className="hs-text", value=""),
            dcc.Store(id=text_fill_id(prefix)),
            html.Div(
                [
                    html.Label("Model", htmlFor=model_id(prefix)),
                    dcc.Dropdown(id=model_id(prefix), options=context.model_options(),
                                 value=chosen, clearable=False, className="hs-model"),
                    html.Button("Run", id=run_id(prefix), n_clicks=0, className="hs-run"),
                ],
                className="hs-controls",
            ),
        ],
        className="hs-input",
    )


def register_run(prefix: str, state_after: Any, keeps: tuple[str, ...], long_runs: bool = False) -> None:
    """Wire a page's Run button: capture (or load) the run, then write it into the URL.

    ``state_after(old_state, model, run) -> PageState`` says what the page shows next; ``keeps``
    names the URL keys of the settings it carries over, which keep what the user chose while the
    text ran (:func:`url_patch`). With
    ``long_runs`` a text longer than the patterns limit runs in statistics mode
    (:func:`headscope.analysis.statistics_run.capture_for_page`); without, it is refused with the limit.
    """

    show_in_shell(prefix)

    @callback(
        Output(url_patch_id(prefix), "data", allow_duplicate=True),  # into the URL as it is then
        job_error(prefix),  # with Redis this is a job: not the banner (see there)
        Input(run_id(prefix), "n_clicks"),
        State(text_id(prefix), "value"),
        State(model_id(prefix), "value"),
        State(url_id(prefix), "search"),
        **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
        prevent_initial_call=True,
    )
    @guarded(outputs=2)
    def run_text(n_clicks, text, model_spec, search):
        if not n_clicks:  # the page's layout arriving is not a click
            raise PreventUpdate
        context = get_context()
        model = load_model(offered_model(model_spec))  # the allowlist, never a path from the request
        if long_runs:
            run = capture_for_page(model, text or "", context.store, context.max_tokens)
        else:
            run = capture(model, text or "", store=context.store, max_tokens=context.max_tokens,
                          max_tokens_variable="HEADSCOPE_MAX_TOKENS")
        context.remember(run)
        return url_patch(search, state_after(parse(search), model, run).to_search(), keep=keeps), ""

    run_text.__name__ = f"run_text_{prefix}"

"""The runs this browser was shown: what the Compare page offers, instead of the store's list.

Whoever reaches the server reads only the results whose link they have (SECURITY.md). A run reaches
a browser in one way: a page's URL names it (a Run writes its id into the URL; a link carries one).
So the browser keeps the ids its pages' URLs named (the keys :data:`RUN_KEYS`), newest first, in
one store in the app shell (:func:`seen_runs_store`, the browser's local storage: every tab of this
browser, and after a restart), written in the browser whenever any page's URL changes
(:func:`remember_runs_shown`). The server never lists its store for a page: it resolves the ids the
browser sends (:func:`shown_runs`), each checked as 8-64 hex digits, and labels those that are runs.
Listing every stored run is the command line's (``headscope runs list``), for whoever can read the store.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from dash import Dash, Input, Output, State, dcc

from headscope.analysis.runs import RUN_KINDS
from headscope.app import ids

RUN_KEYS = ("run", "first", "second")  # the URL keys that name a stored run (app/url_state.py)
MAX_KEPT = 100  # ids the browser keeps; the oldest go first
RUN_ID = re.compile(r"[0-9a-f]{8,64}")  # as app/url_state.py reads a link's ids


def seen_runs_store() -> dcc.Store:
    """The app shell's store of run ids this browser was shown (local storage: shared by its tabs)."""
    return dcc.Store(id=ids.SEEN_RUNS, storage_type="local")


# In the browser: the ids a page's URL names go to the front of the list (a URL naming none changes
# nothing). The server checks every id again (:func:`run_ids`): the browser is not trusted.
_REMEMBER = """function (search, seen) {{
    const given = new URLSearchParams(search || ""), valid = new RegExp("^{pattern}$");
    const named = {keys}.map(key => (given.get(key) || "").toLowerCase()).filter(id => valid.test(id));
    const kept = Array.isArray(seen) ? seen.filter(id => typeof id === "string" && valid.test(id)) : [];
    const out = [...new Set([...named, ...kept])].slice(0, {most});
    return JSON.stringify(out) === JSON.stringify(seen) ? window.dash_clientside.no_update : out;
}}"""


def remember_runs_shown(app: Dash) -> None:
    """Register, for every page with a URL of its own (``PREFIX``), the browser-side callback that
    adds the runs its URL names to :func:`seen_runs_store`: a page added later is covered unedited."""
    import dash

    from headscope.app.page_shell import url_id

    source = _REMEMBER.format(pattern=RUN_ID.pattern, keys=json.dumps(list(RUN_KEYS)), most=MAX_KEPT)
    for page in dash.page_registry.values():
        prefix = getattr(sys.modules.get(page["module"]), "PREFIX", None)
        if prefix is None:
            continue
        app.clientside_callback(source, Output(ids.SEEN_RUNS, "data", allow_duplicate=True),
                                Input(url_id(prefix), "search"), State(ids.SEEN_RUNS, "data"),
                                prevent_initial_call="initial_duplicate")


def run_id(value: Any) -> str | None:
    """``value`` as a run id (8-64 hex digits, any case, surrounding blanks ignored), or None."""
    if not isinstance(value, str) or len(value) > 200:
        return None
    value = value.strip().lower()
    return value if RUN_ID.fullmatch(value) else None


def run_ids(seen: Any) -> list[str]:
    """The valid ids of a list the browser sent (anything else in it is ignored), in order, at most
    :data:`MAX_KEPT`."""
    if not isinstance(seen, list):
        return []
    out: list[str] = []
    for value in seen[:MAX_KEPT]:
        key = run_id(value)
        if key is not None and key not in out:
            out.append(key)
    return out


@dataclass(frozen=True)
class ShownRun:
    """A stored run as the lists show it: its id (16 digits, as links write it), model, length, text."""

    key: str
    model_name: str
    n_tokens: int | None
    statistics: bool
    text: str

    @property
    def label(self) -> str:
        text = " ".join(self.text.split())
        text = text[:48] + "…" if len(text) > 48 else text
        mode = ", statistics" if self.statistics else ""
        tokens = "?" if self.n_tokens is None else self.n_tokens
        return f"{self.key[:8]} · {self.model_name} · {tokens} tokens{mode} · {text}"


def shown_run(store: Any, key: Any) -> ShownRun | None:
    """The stored run whose key starts with ``key`` (a unique prefix of 8-64 hex digits), read from
    its metadata only; None when ``key`` is not such an id, names no run or several records, or its
    record cannot be read (a damaged row hides that run, never the others)."""
    key = run_id(key)
    if key is None:
        return None
    try:
        found = store.find(key)
        if len(found) != 1:
            return None
        record = store.get(found[0], verify=False)
    except (OSError, ValueError, TypeError) as e:  # a damaged or unreadable row: that run is not offered
        import logging

        logging.getLogger("headscope.app").warning("stored run %s not offered: %s", key[:12], e)
        return None
    if record is None or record.kind not in RUN_KINDS or not isinstance(record.meta, dict):
        return None
    meta = record.meta
    n_tokens = meta.get("n_tokens")
    return ShownRun(record.key[:16], str(meta.get("model_name") or "?")[:80],
                    n_tokens if isinstance(n_tokens, int) and not isinstance(n_tokens, bool) else None,
                    record.kind == "stats_run", str(meta.get("text") or "")[:200])


def shown_runs(store: Any, keys: list[str]) -> list[ShownRun]:
    """The runs among ``keys`` (ids checked by :func:`run_ids`), in order, each once."""
    out: list[ShownRun] = []
    for key in keys:
        run = shown_run(store, key)
        if run is not None and all(run.key != r.key for r in out):
            out.append(run)
    return out

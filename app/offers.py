"""What a callback request may carry: only values the page could have offered.

Each control's allowed values are read from where the control is defined, by walking the app
shell's and every page's layout once: a Dropdown's, RadioItems' or Checklist's ``options``, a
number Input's ``min``/``max``, a text box's size limit, a button's click count, a Location's query
string. A POST to ``/_dash-update-component`` whose inputs or states carry anything else is refused
with a 400 and a message naming the control, before any callback runs; so a new control is covered
without anyone remembering to. A control whose ``options`` a callback changes (the QK page's
feature list) is checked by that callback instead, and values that are structures (graph clicks,
table cells, stores) get a type check here and their content checked by their callback.

Other kinds of value each have one check of their own: models (:func:`headscope.app.context.offered_model`),
the page state in the URL (:func:`headscope.app.url_state.parse`), heads and layers
(:func:`headscope.analysis.errors.check_head_index`), uploads as content (:func:`headscope.app.uploads.upload_text`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dash import dcc, html
from dash.development.base_component import Component
from flask import Flask, Response, request

from headscope.analysis.errors import parse_json
from headscope.analysis.limits import limit

log = logging.getLogger("headscope.app")

UPDATE_PATH = "_dash-update-component"
# Properties Dash components fill with structures (plotly events, table state, stores): a type
# check here; the callback that reads them validates what is inside.
STRUCTURED = {"clickData": dict, "hoverData": dict, "relayoutData": dict, "selectedData": dict,
              "active_cell": dict, "derived_viewport_data": list, "data": (dict, list, str, int, float, bool),
              "columns": list}


MAX_PATH = 65_536  # characters of a request line http.server (werkzeug's base) reads; longer: 414


def text_limit() -> int:
    """Characters of one text box: as much as one uploaded file may hold."""
    return limit("HEADSCOPE_MAX_UPLOAD_BYTES")


@dataclass(frozen=True)
class Offer:
    """The values one property of one control may take."""

    kind: str  # "choice", "number", "text", "path", "count" or "structure"
    values: frozenset = frozenset()
    multi: bool = False
    types: Any = None
    low: float | None = None  # a number box's min, max and step (a whole step: whole numbers only)
    high: float | None = None
    step: Any = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not one this control offers, or ``None``."""
        if value is None:
            return None
        if self.kind == "choice":
            chosen = value if self.multi and isinstance(value, list) else [value]
            if all(_hashable(v) and v in self.values for v in chosen):
                return None
            return f"is not one of its options ({', '.join(sorted(map(str, self.values)))[:200]})"
        if self.kind == "number":
            # the box's own min, max and step: the browser sends null for a typed value outside them
            # (dcc.Input checks validity), so anything else is forged; the callback checks what depends
            # on the run (a layer of this model), with a message saying what to type instead
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                return "is not a number"
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                return f"is outside its range {_num(self.low)}..{_num(self.high)}"
            if isinstance(self.step, int) and not isinstance(self.step, bool) and float(value) != int(value):
                return "is not a whole number"
            return None
        if self.kind == "count":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return "is not a click count"
            return None
        if self.kind == "text":
            if not isinstance(value, str):
                return "is not text"
            if len(value) > text_limit():
                return (f"has {len(value):,} characters (the limit is {text_limit():,}; "
                        "set HEADSCOPE_MAX_UPLOAD_BYTES to change it)")
            return None
        if self.kind == "path":  # a page's path, as the browser's location has it
            # any length the HTTP server takes in a request line (65,536): an unknown path, however
            # long, reaches the router, which shows the not-found page for it
            if not isinstance(value, str) or not value.startswith("/") or len(value) > MAX_PATH:
                return "is not a page's path"
            return None
        if self.kind == "structure" and not isinstance(value, self.types):
            return "does not have the shape this control sends"
        return None


def _num(bound: float | None) -> str:
    return "" if bound is None else f"{bound:g}"


def _bound(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finite(value: int | float) -> bool:
    """A number a float can hold (a JSON integer may have hundreds of digits: ``math.isfinite`` overflows)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _hashable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def option_values(options: Any) -> frozenset:
    """The values of a Dash ``options`` prop in any of its three spellings."""
    if isinstance(options, dict):
        return frozenset(options)
    out = set()
    for o in options or []:
        out.add(o.get("value") if isinstance(o, dict) else o)
    return frozenset(out)


def offers_of(component: Component) -> Iterator[tuple[str, Offer]]:
    """(property, offer) pairs that ``component`` declares by the way it is defined."""
    if isinstance(component, (dcc.Dropdown, dcc.RadioItems, dcc.Checklist)):
        multi = isinstance(component, dcc.Checklist) or bool(getattr(component, "multi", False))
        yield "value", Offer("choice", option_values(getattr(component, "options", None)), multi=multi)
    elif isinstance(component, dcc.Input):
        if getattr(component, "type", None) == "number":
            yield "value", Offer("number", low=_bound(getattr(component, "min", None)),
                                 high=_bound(getattr(component, "max", None)), step=getattr(component, "step", None))
        else:
            yield "value", Offer("text")
    elif isinstance(component, dcc.Textarea):
        yield "value", Offer("text")
    elif isinstance(component, dcc.Location):
        for prop in ("search", "hash", "href"):
            yield prop, Offer("text")
        yield "pathname", Offer("path")
    elif isinstance(component, dcc.Upload):
        yield "contents", Offer("text")
        yield "filename", Offer("text")
    if isinstance(component, html.Button) or "n_clicks" in getattr(component, "_prop_names", ()):
        yield "n_clicks", Offer("count")
    for prop, types in STRUCTURED.items():
        if prop in getattr(component, "_prop_names", ()):
            yield prop, Offer("structure", types=types)


def walk(node: Any) -> Iterator[Component]:
    if isinstance(node, Component):
        yield node
        yield from walk(getattr(node, "children", None))
    elif isinstance(node, (list, tuple)):
        for child in node:
            yield from walk(child)


WILDCARDS = (["ALL"], ["MATCH"], ["ALLSMALLER"])


def _declared_id(cid: str) -> str | dict:
    """A dependency's id as declared: a string, or a pattern-matching id (a dict, kept as JSON)."""
    return json.loads(cid) if cid.startswith("{") else cid


def _id_matches(declared: str | dict, given: Any) -> bool:
    """``given`` (an id a request names) is ``declared``, or fits it when it is a pattern."""
    if isinstance(declared, str):
        return given == declared
    if isinstance(given, str) and given.startswith("{"):  # outputs name pattern ids as their JSON
        try:
            given = json.loads(given)
        except ValueError:
            return False
    if not isinstance(given, dict) or set(given) != set(declared):
        return False
    return all(_hashable(given[k]) and given[k] is not None if v in WILDCARDS else given[k] == v
               for k, v in declared.items())


def _many(declared: str | dict) -> bool:
    """A pattern whose wildcard stands for any number of components (ALL, ALLSMALLER): a list."""
    return isinstance(declared, dict) and any(v in (["ALL"], ["ALLSMALLER"]) for v in declared.values())


def _item_problem(item: Any, cid: str | dict, prop: str, where: str) -> str | None:
    """Why ``item`` is not the value of ``cid.prop`` as the renderer sends it (one item, or a list
    of items for an ALL pattern), or ``None``."""
    named = cid if isinstance(cid, str) else json.dumps(cid, sort_keys=True)
    for one in (item if _many(cid) and isinstance(item, list) else [item]):
        if not isinstance(one, dict) or not isinstance(one.get("property"), str):
            return f"The request's {where} are malformed."
        if one["property"].split("@", 1)[0] != prop or not _id_matches(cid, one.get("id")):
            return f"The request's {where} do not match its callback: {str(one.get('id'))[:80]}.{one['property'][:40]} " \
                   f"is not {named}.{prop}."
    return None


def shape_problems(body: dict, callback: dict) -> list[str]:
    """What makes ``body`` other than a request for ``callback`` as the renderer builds it: its
    inputs and states, one per dependency in the declared order and under the declared id and
    property (Dash hands them to the callback by position, so an item under another name would carry
    its value past the check of the control in that position), its outputs, its changed properties."""
    for group in ("inputs", "state"):
        given = body.get(group) or []
        declared = callback.get(group, [])
        if not isinstance(given, list):
            return [f"The request's {group} are not a list."]
        if len(given) != len(declared):
            return [f"The request has {len(given)} {group}; its callback has {len(declared)}."]
        for item, dep in zip(given, declared, strict=True):
            if not isinstance(dep, dict):
                continue
            why = _item_problem(item, _declared_id(dep["id"]), dep["property"], group)
            if why:
                return [why]
    parts = [p.rpartition(".") for p in body["output"].strip(".").split("...")]
    outputs = body.get("outputs")
    if not callback.get("no_output"):
        multi = body["output"].startswith("..")
        if not isinstance(outputs, list if multi else dict) or len(outputs if multi else [outputs]) != len(parts):
            return ["The request's outputs do not match its callback."]
        for out, (cid, _, prop) in zip(outputs if multi else [outputs], parts, strict=True):
            why = _item_problem(out, _declared_id(cid), prop.split("@", 1)[0], "outputs")
            if why:
                return [why]
    changed = body.get("changedPropIds", [])
    if not isinstance(changed, list) or not all(isinstance(c, str) for c in changed):
        return ["The request's changedPropIds are not a list of names."]
    return []


def _outputs(callback_map: dict) -> set[tuple[str, str]]:
    """(id, property) of every callback output (``id.prop``, ``..a.p...b.q..``, ``@hash`` suffixes)."""
    out = set()
    for key in callback_map:
        for part in key.strip(".").split("..."):
            cid, _, prop = part.rpartition(".")
            out.add((cid, prop.split("@", 1)[0]))
    return out


class Offers:
    """Every control's offers in one app, collected from its layouts on first use."""

    def __init__(self, app: Any):
        self.app = app
        self._table: dict[tuple[str, str], Offer] | None = None
        self._lock = threading.Lock()

    def table(self) -> dict[tuple[str, str], Offer]:
        with self._lock:
            if self._table is None:
                self._table = self._collect()
            return self._table

    def _collect(self) -> dict[tuple[str, str], Offer]:
        import dash

        layouts = [self.app.layout]
        for page in dash.page_registry.values():
            layout = page.get("layout")
            try:
                layouts.append(layout() if callable(layout) else layout)
            except Exception:  # a page that cannot build its layout offers nothing; say so once
                log.exception("could not read the controls of page %s", page.get("path"))
        changed = {(cid, "value") for cid, prop in _outputs(self.app.callback_map) if prop == "options"}
        table: dict[tuple[str, str], Offer] = {}
        for component in walk(layouts):
            cid = getattr(component, "id", None)
            if not isinstance(cid, str):
                continue  # pattern-matching ids (export buttons) carry click counts only
            for prop, offer in offers_of(component):
                if (cid, prop) not in changed:
                    table[(cid, prop)] = offer
        return table

    def problems(self, body: Any) -> list[str]:
        """What is wrong with a callback request's body (empty: nothing)."""
        if not isinstance(body, dict) or not isinstance(body.get("output"), str):
            return ["This is not a callback request."]
        callback = self.app.callback_map.get(body["output"])
        if callback is None or "callback" not in callback:  # a clientside one runs in the browser only
            return ["No such callback."]
        shape = shape_problems(body, callback)
        if shape:
            return shape
        items = []
        for group in ("inputs", "state"):
            values = body.get(group, [])
            if not isinstance(values, list):
                return [f"The request's {group} are not a list."]
            for item in values:
                items.extend(item if isinstance(item, list) else [item])
        table, out = self.table(), []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("property"), str):
                return ["The request's inputs are malformed."]
            cid = item.get("id")
            offer = table.get((cid, item["property"])) if isinstance(cid, str) else None
            why = offer.problem(item.get("value")) if offer else None
            if why:
                out.append(f"The value of {cid}.{item['property']} {why}.")
        return out


def check_callback_requests(app: Any, server: Flask) -> Offers:
    """Refuse (400, with the reason) any callback request carrying a value the page did not offer."""
    offers = Offers(app)

    @server.before_request
    def refuse_values_not_offered():
        if request.method != "POST" or not request.path.endswith("/" + UPDATE_PATH):
            return None
        try:  # reading passes the size cap: 413 (app.server.cap_request_size), not "malformed"
            body = parse_json(request.get_data(cache=True) or b"null")
        except ValueError:
            body = None
        problems = offers.problems(body)
        if not problems:
            return None
        log.warning("refused a callback request: %s", " ".join(problems)[:300])
        return Response("headscope refused this request: " + " ".join(problems)[:2000] + "\n", status=400,
                        mimetype="text/plain")

    return offers

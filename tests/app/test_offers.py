"""The request boundary of the served app (``app/offers.py``, ``app/server.py``), through Flask's
test client: values a control did not offer are refused before any callback runs."""

from __future__ import annotations

import json

import pytest

from headscope.analysis.store import Store
from headscope.app.context import AppContext
from headscope.app.server import create_app
from tests.app.forged_posts import request_body


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(AppContext(store=Store(tmp_path_factory.mktemp("offers-home"))))
    client = app.server.test_client()
    client.dash_app = app
    client.get("/")
    return client, {d["output"]: d for d in json.loads(client.get("/_dash-dependencies").data)}


def post(client, dep: dict, values: dict):
    return client.post("/_dash-update-component", json=request_body(dep, values))


def sweep_callback(deps: dict) -> dict:
    return next(d for d in deps.values() if any(s["id"] == "hs-heads-haystack" for s in d["state"]))


@pytest.mark.parametrize("value", ["/etc/passwd", "../data/niah/haystack_prose.txt", ["prose"], {"path": "x"}, 3])
def test_a_choice_the_page_did_not_offer_is_refused(client, value):
    client, deps = client
    r = post(client, sweep_callback(deps), {"hs-heads-run.n_clicks": 1, "hs-heads-haystack.value": value})
    assert r.status_code == 400
    assert "hs-heads-haystack.value is not one of its options (custom, passkey, prose)" in r.get_data(as_text=True)


def test_types_are_checked_and_offered_values_pass(client):
    client, deps = client
    dep = sweep_callback(deps)
    for key, value, why in [("hs-heads-sink.value", "4", "is not a number"),
                            ("hs-heads-run.n_clicks", -1, "is not a click count"),
                            ("hs-heads-lengths.value", ["512"], "is not text"),
                            ("hs-heads-needles.value", ["no-such-needle"], "is not one of its options")]:
        r = post(client, dep, {"hs-heads-run.n_clicks": 0, key: value})
        assert r.status_code == 400 and why in r.get_data(as_text=True), (key, r.get_data(as_text=True))
    # the page's own values pass the boundary (n_clicks 0: the callback itself then does nothing)
    r = post(client, dep, {"hs-heads-run.n_clicks": 0, "hs-heads-haystack.value": "passkey",
                           "hs-heads-needles.value": [], "hs-heads-sink.value": 4, "hs-heads-lengths.value": "512"})
    assert r.status_code in (200, 204)


def test_a_model_path_in_the_dropdown_is_refused(client, tmp_path):
    client, deps = client
    dep = next(d for d in deps.values() if any(s["id"] == "attn-hs-model" for s in d["state"]))
    r = post(client, dep, {"attn-hs-run.n_clicks": 1, "attn-hs-text.value": "hi", "attn-hs-model.value": str(tmp_path)})
    assert r.status_code == 400 and "attn-hs-model.value is not one of its options" in r.get_data(as_text=True)


def test_unknown_callbacks_and_malformed_bodies_are_refused(client):
    client, _ = client
    assert client.post("/_dash-update-component", json={"output": "nope.children", "inputs": []}).status_code == 400
    assert client.post("/_dash-update-component", data=b"not json", content_type="application/json").status_code == 400
    assert client.post("/_dash-update-component", json=[1, 2]).status_code == 400


def test_request_size_cap(client, monkeypatch):
    client, _ = client
    monkeypatch.setenv("HEADSCOPE_MAX_REQUEST_BYTES", "1000")
    r = client.post("/_dash-update-component", data=b"{" + b" " * 2000 + b"}", content_type="application/json")
    assert r.status_code == 413 and "HEADSCOPE_MAX_REQUEST_BYTES" in r.get_data(as_text=True)


def _sweep_body(deps: dict) -> dict:
    """A well-formed request of the Heads sweep (Run clicked, the page's own values)."""
    dep = sweep_callback(deps)
    values = {"hs-heads-haystack": "prose", "hs-heads-sink": 4, "hs-heads-lengths": "128", "hs-heads-needles": []}
    outputs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2].split("@")[0]}
               for p in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs,
            "inputs": [{"id": "hs-heads-run", "property": "n_clicks", "value": 0}],
            "state": [{**s, "value": values.get(s["id"])} for s in dep["state"]],
            "changedPropIds": ["hs-heads-run.n_clicks"]}


def _renamed(body: dict, old: str, new_id: str, value) -> dict:
    body["state"] = [{**s, "id": new_id, "value": value} if s["id"] == old else s for s in body["state"]]
    return body


# A forged request's *shape*: Dash hands inputs and states to the callback by position, so an item
# under another id (or property) would carry its value past the check of the control in that position.
# (name, change to a well-formed body, what the 400 must say)
FORGED_SHAPES = [
    ("renamed id carries a path", lambda b: _renamed(b, "hs-heads-haystack", "no-such-control", "/etc/passwd"),
     "is not hs-heads-haystack.value"),
    ("id of another control", lambda b: _renamed(b, "hs-heads-haystack", "hs-heads-lengths", "/etc/passwd"),
     "is not hs-heads-haystack.value"),
    ("other property", lambda b: {**b, "inputs": [{"id": "hs-heads-run", "property": "value", "value": "/etc"}]},
     "is not hs-heads-run.n_clicks"),
    ("a state missing", lambda b: {**b, "state": b["state"][:3]}, "has 3 state"),
    ("a state too many", lambda b: {**b, "state": [*b["state"], b["state"][0]]}, "state"),
    ("no inputs", lambda b: {**b, "inputs": []}, "has 0 inputs"),
    ("item not an object", lambda b: {**b, "inputs": ["hs-heads-run"]}, "inputs"),
    ("a list where one item goes", lambda b: {**b, "inputs": [[b["inputs"][0]]]}, "inputs"),
    ("outputs a string", lambda b: {**b, "outputs": "x"}, "outputs"),
    ("outputs missing", lambda b: {k: v for k, v in b.items() if k != "outputs"}, "outputs"),
    ("outputs of another callback", lambda b: {**b, "outputs": [{"id": "hs-error", "property": "children"}]}, "outputs"),
    ("changedPropIds a number", lambda b: {**b, "changedPropIds": 5}, "changedPropIds"),
    ("changedPropIds with a list", lambda b: {**b, "changedPropIds": [["x"]]}, "changedPropIds"),
    ("a number too large for a float", lambda b: _renamed(b, "hs-heads-sink", "hs-heads-sink", 10**400),
     "hs-heads-sink.value is not a number"),
]


@pytest.mark.parametrize("change, why", [c[1:] for c in FORGED_SHAPES], ids=[c[0] for c in FORGED_SHAPES])
def test_a_request_not_shaped_as_its_callback_is_refused_with_a_message(client, change, why):
    client, deps = client
    assert client.post("/_dash-update-component", json=_sweep_body(deps)).status_code in (200, 204)  # as sent
    r = client.post("/_dash-update-component", json=change(_sweep_body(deps)))
    assert r.status_code == 400, r.get_data(as_text=True)[:300]
    assert why in r.get_data(as_text=True), r.get_data(as_text=True)


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"output":' * 30_000 + b"1" + b"}" * 30_000,
                                  b'{"output": "x", "inputs": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
                                  b'{"output": 1' + b"0" * 5000 + b"}"],
                         ids=["nested arrays", "nested objects", "nested inputs", "5000-digit number"])
def test_deeply_nested_or_oversized_json_is_a_400_not_a_500(client, body):
    client, _ = client
    r = client.post("/_dash-update-component", data=body, content_type="application/json")
    assert r.status_code == 400 and "not a callback request" in r.get_data(as_text=True)
    assert client.get("/").status_code == 200


def test_a_browser_side_callback_named_in_a_request_is_refused_not_a_500(client):
    """Clientside callbacks (the nav links' state) run in the browser; the server has nothing to run."""
    client, deps = client
    dep = next(d for d in deps.values() if d.get("clientside_function"))
    outputs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2].split("@")[0]}
               for p in dep["output"].strip(".").split("...")]
    r = client.post("/_dash-update-component", json={
        "output": dep["output"], "outputs": outputs if dep["output"].startswith("..") else outputs[0],
        "inputs": [{**s, "value": "?model=/etc"} for s in dep["inputs"]], "state": [], "changedPropIds": []})
    assert r.status_code == 400 and "No such callback" in r.get_data(as_text=True)


# A number box's range and step as the page declares them: the browser sends null for anything else
# (dcc.Input checks validity), so only a forged request carries such a value, e.g. 10**8 random seeds
# for the ablation curve (a list of 10**8 seeds before any check). (control, value, what the 400 says)
OUT_OF_RANGE = [
    ("hs-abl-curve-seeds", 10**8, "is outside its range 0..10"), ("hs-abl-curve-seeds", 11, "is outside its range 0..10"),
    ("hs-abl-curve-seeds", -1, "is outside its range 0..10"), ("hs-heads-sink", -5, "is outside its range 0.."),
    ("hs-qk-layer", 1.5, "is not a whole number"), ("hs-qk-sentences", 10**6, "is outside its range 1.."),
    ("hs-qk-head", -1, "is outside its range 0.."),
]


@pytest.mark.parametrize("cid, value, why", OUT_OF_RANGE, ids=[f"{c}={v}" for c, v, _ in OUT_OF_RANGE])
def test_a_number_outside_its_box_range_or_step_is_refused(client, cid, value, why):
    client, deps = client
    dep = next(d for d in deps.values() if any(s["id"] == cid for s in d["inputs"] + d["state"]))
    r = post(client, dep, {f"{cid}.value": value})
    assert r.status_code == 400 and f"{cid}.value {why}" in r.get_data(as_text=True), r.get_data(as_text=True)[:300]


FORGED = {"choice": "/etc/passwd", "number": "4", "text": {"path": "/etc/passwd"}, "count": -1, "path": "etc/passwd"}


def test_a_clicked_button_carries_no_forged_state_past_the_boundary(client):
    """The HTTP fuzzer forges one value at a time with every button unclicked, so a forged State
    never reaches a job's body there. Here every server callback that a button starts gets its
    button clicked and one State forged at a time: each is refused before the callback runs
    (nothing is computed, no job starts), whatever the button."""
    from headscope.app.offers import Offers

    client, deps = client
    table = Offers(client.dash_app).table()
    checked, refused = 0, []
    for dep in deps.values():
        buttons = [s for s in dep["inputs"] if s["property"] == "n_clicks"]
        if not buttons or dep.get("clientside_function") or any(s["id"].startswith("{") for s in dep["inputs"]):
            continue  # pattern-id inputs (export buttons): the fuzzer covers their request shape
        for spec in dep["state"]:
            offer = table.get((spec["id"], spec["property"]))
            if offer is None or offer.kind not in FORGED:
                continue  # stores and pattern ids: data the page produced, checked by shape elsewhere
            values = {f"{b['id']}.n_clicks": 1 for b in buttons}
            forged = [FORGED[offer.kind]]
            if offer.kind == "number" and offer.high is not None:
                forged.append(10**8)  # past the box's max: e.g. 10**8 random seeds for the curve
            for value in forged:
                r = post(client, dep, {**values, f"{spec['id']}.{spec['property']}": value})
                checked += 1
                if r.status_code != 400 or f"{spec['id']}.{spec['property']}" not in r.get_data(as_text=True):
                        refused.append(f"{dep['output'][:60]} {spec['id']}.{spec['property']}={value!r} → {r.status_code} "
                                   f"{r.get_data(as_text=True)[:150]}")
    print(f"{checked} button-started States forged")
    assert checked >= 30, f"only {checked} button-started States found: the layouts changed?"
    assert not refused, "forged States reached a callback whose button was clicked:\n" + "\n".join(refused)


def test_a_request_thread_closes_its_sqlite_connections_when_its_request_ends(client):
    """The server runs one thread per request; a connection left in the thread's local storage was closed
    by the interpreter when the thread ended, outside the fork gate (a job forked then could inherit one
    of SQLite's mutexes held). Each request now closes the store's and the job cache's connections itself."""
    from headscope.app.context import get_context
    from headscope.app.jobs import background_manager

    store, cache = get_context().store, background_manager().handle
    with client[0].dash_app.server.test_request_context("/"):
        store.list()
        cache.get("anything")
        assert store._local.conn is not None and cache._local.con is not None  # opened in this request
    assert getattr(store._local, "conn", None) is None and getattr(cache._local, "con", None) is None

"""The request boundary of the served app (``app/offers.py``, ``app/server.py``), through Flask's
test client: values a control did not offer are refused before any callback runs."""

from __future__ import annotations

import json

import pytest

from analysis.store import Store
from app.context import AppContext
from app.server import create_app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_app(AppContext(store=Store(tmp_path_factory.mktemp("offers-home"))))
    client = app.server.test_client()
    client.get("/")
    return client, {d["output"]: d for d in json.loads(client.get("/_dash-dependencies").data)}


def post(client, dep: dict, values: dict):
    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2]} for p in dep["output"].strip(".").split("...")]
    body = {"output": dep["output"], "outputs": outputs if len(outputs) > 1 else outputs[0],
            "inputs": [item(s) for s in dep["inputs"]], "state": [item(s) for s in dep["state"]],
            "changedPropIds": [f"{dep['inputs'][0]['id']}.{dep['inputs'][0]['property']}"]}
    return client.post("/_dash-update-component", json=body)


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

"""Raw requests to the Ablation page's server callbacks with stale or forged store contents, as a
script (not the page) sends them: each answers with a message or nothing, never a traceback or a 500,
and Keep never keeps a row that is not the numbers of effects shown. The browser's part, the effects
panel's reducer, is tested in tests/app/test_ablation_state.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytestmark = [pytest.mark.integration]
UPDATE = "_dash-update-component"


def post(url: str, body: dict) -> tuple[int, dict | None]:
    req = urllib.request.Request(url + UPDATE, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            payload = r.read()
            return r.status, json.loads(payload) if payload else None
    except urllib.error.HTTPError as e:
        return e.code, None


def dependency(url: str, output_id: str) -> dict:
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=60) as r:
        deps = json.loads(r.read())
    return next(d for d in deps if f"{output_id}." in d["output"] and not d.get("clientside_function"))


def body(dep: dict, values: dict, changed: list[str]) -> dict:
    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = [{"id": part.rpartition(".")[0], "property": part.rpartition(".")[2]}
               for part in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs if dep["output"].startswith("..") else outputs[0],
            "inputs": [item(s) for s in dep["inputs"]], "state": [item(s) for s in dep["state"]],
            "changedPropIds": changed}


ROW = {"run": "aaaa", "heads": "3.1", "n_heads": 1, "method": "zero", "d_loss": 0.5}
FORGED_PANELS = [  # (the panel store as forged, whether Keep may keep its row)
    (None, False), (7, False), ("effects", False), ([ROW], False), ({"row": ROW}, False),
    ({"shows": "note", "key": None, "row": ROW}, False), ({"shows": "computing", "row": ROW}, False),
    ({"shows": "effects", "row": "3.1"}, False), ({"shows": "effects", "row": [ROW]}, False),
    ({"shows": "effects", "row": {**ROW, "<img src=x onerror=alert(1)>": 1, "__proto__": {"x": 1}}}, True),
    ({"shows": "effects", "row": ROW}, True),
]


@pytest.mark.parametrize("panel, kept", FORGED_PANELS)
def test_keep_keeps_only_the_numbers_of_effects_shown(server, panel, kept):
    url = server[0]
    dep = dependency(url, "hs-abl-kept")
    status, answer = post(url, body(dep, {"hs-abl-keep.n_clicks": 1, "hs-abl-kept.data": [], "hs-abl-panel.data": panel},
                                    ["hs-abl-keep.n_clicks"]))
    if not kept:
        assert status == 204, answer
        return
    assert status == 200
    rows = answer["response"]["hs-abl-kept"]["data"]
    assert len(rows) == 1 and set(rows[0]) <= {"set", "run", "heads", "n_heads", "method", "d_loss"}, rows


@pytest.mark.parametrize("kept", [None, 5, "x", [{"set": "1"}, {"set": True}, 3, None], [{"set": 10**30, "heads": 1}]])
def test_keep_with_a_forged_table_adds_after_the_rows_it_can_read(server, kept):
    url = server[0]
    dep = dependency(url, "hs-abl-kept")
    status, answer = post(url, body(dep, {"hs-abl-keep.n_clicks": 1, "hs-abl-kept.data": kept,
                                          "hs-abl-panel.data": {"shows": "effects", "row": ROW}},
                                    ["hs-abl-keep.n_clicks"]))
    assert status == 200
    rows = answer["response"]["hs-abl-kept"]["data"]
    assert all(isinstance(r["set"], int) for r in rows) and rows[-1]["heads"] == "3.1"


FORGED_PENDING = [None, 7, [], {"a": 1}, "", "3.1", "3.1,,5.0", "99999.1", "3.1" * 10_000, "kv:3.1", "<b>3.1</b>",
                  "3.1,5.0\n", True]


@pytest.mark.parametrize("pending", FORGED_PENDING, ids=range(len(FORGED_PENDING)))
def test_the_render_draws_a_stale_or_forged_selection_as_its_own_or_none(server, pending):
    """A render posted with any pending selection answers (200) with an event for the effects panel
    for the URL it was given, and writes the selection only on a first draw (a pending it cannot read)."""
    url = server[0]
    dep = dependency(url, "hs-abl-effects-asked")
    search = "?heads=3.1&run=0123456789abcdef"
    status, answer = post(url, body(dep, {"abl-hs-url.search": search, "hs-abl-pending.data": pending},
                                    ["abl-hs-url.search"]))
    assert status == 200, answer
    response = answer["response"]
    asked = response["hs-abl-effects-asked"]["data"]
    assert asked["search"] == search and asked["computing"] is False  # no stored run: nothing to compute
    assert "No stored run" in json.dumps(response["hs-error"])
    first_draw = pending not in ("", "3.1")  # the only two the page could have written
    assert ("hs-abl-pending" in response) == first_draw, (pending, response.get("hs-abl-pending"))


@pytest.mark.parametrize("wanted, drawn", [(None, None), (5, None), ({"key": 1}, 1), ({"key": [1]}, {"key": 2}),
                                           ({}, None), ("x" * 100_000, None)])
def test_the_map_redraw_with_forged_stores_answers_with_nothing_or_a_map(server, wanted, drawn):
    url = server[0]
    dep = next(d for d in json.loads(urllib.request.urlopen(url + "_dash-dependencies", timeout=60).read())
               if "hs-abl-grid.figure" in d["output"] and any(s["id"] == "hs-abl-map" for s in d["inputs"]))
    status, answer = post(url, body(dep, {"hs-abl-map.data": wanted, "hs-abl-pending.data": "3.1",
                                          "hs-abl-drawn.data": drawn, "abl-hs-url.search": "?by=first_token"},
                                    ["hs-abl-map.data"]))
    assert status in (200, 204), answer

"""Raw requests, as a script sends them, to the callbacks that draw the NIAH accuracy intervals of #42
item 4 (the Heads page's sweep figures, the Ablation page's render and its "Run curve"), with forged
values: wrong types, nan, huge numbers, ids that name nothing. Each answers 200 with a message in the
page's own place (or 204: nothing to do), never a 500 or a traceback, and the server keeps serving.

A stored sweep (one needle, 160 tokens) is written into the shared server's store from this process,
so the valid parts of a request name something real and the forged part is what is refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.app.forged_posts import answer

pytestmark = [pytest.mark.integration]


def dependency(url: str, output_id: str) -> dict:
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=60) as r:
        deps = json.loads(r.read())
    return next(d for d in deps if f"{output_id}." in d["output"] and not d.get("clientside_function"))


def body(dep: dict, values: dict) -> dict:
    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = [{"id": part.rpartition(".")[0], "property": part.rpartition(".")[2]}
               for part in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs if dep["output"].startswith("..") else outputs[0],
            "inputs": [item(s) for s in dep["inputs"]], "state": [item(s) for s in dep["state"]],
            "changedPropIds": [f"{s['id']}.{s['property']}" for s in dep["inputs"][:1]]}


@pytest.fixture(scope="module")
def sweep_id(server, real_model):
    """A one-trial sweep in the shared server's store (the server reads its store per request)."""
    import torch

    from headscope.analysis.niah import Needle, named_haystack
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    store = Store(server[2])
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        swept = sweep(real_model, [Needle(needle="The secret passkey is 7731.", question="What is the secret passkey?",
                                          answer="7731", id="forged-posts")], [160], [50],
                      named_haystack("passkey"), store=store, max_new_tokens=12)
    finally:
        torch.set_num_threads(n)
        store.close()
    return swept.key[:16]


def _clean(status: int, raw: bytes) -> None:
    """200 or 204, or the server's refusal of a value of the wrong kind (400, one line saying which)."""
    refused = status == 400 and raw.startswith(b"headscope refused this request: The value of ")
    assert status in (200, 204) or refused, (status, raw[:300])
    assert b"Traceback" not in raw and b"Internal Server Error" not in raw, raw[:300]


HEADS_SEARCHES = ["?sweep=nan", "?sweep=" + "f" * 5000, "?sweep=NaN&agg=nan", "?sweep={sweep}&agg=inf",
                  "?sweep={sweep}&layer=1e400&head=-1", "?sweep={sweep}&trial=99999999999999999999",
                  "?sweep={sweep}&sink_size=nan&window=1e308", 5, 10**400, None, ["?sweep={sweep}"],
                  {"sweep": "{sweep}"}, "?sweep={sweep}"]


@pytest.mark.parametrize("search", HEADS_SEARCHES, ids=range(len(HEADS_SEARCHES)))
def test_the_heads_sweep_figures_answer_forged_links_with_a_message(server, sweep_id, search):
    url = server[0]
    if isinstance(search, str):
        search = search.replace("{sweep}", sweep_id)
    elif isinstance(search, list):
        search = [s.replace("{sweep}", sweep_id) for s in search]
    dep = dependency(url, "hs-heads-niah")
    keys = dep["inputs"][0]  # the page's sweep store: a new sweep was shown
    status, data, raw = answer(url, body(dep, {f"{keys['id']}.{keys['property']}": {"sweep": sweep_id},
                                               **{f"{s['id']}.{s['property']}": search for s in dep["state"]}}))
    _clean(status, raw)
    if search == f"?sweep={sweep_id}":  # the real one: drawn, with its interval
        heat = data["response"]["hs-heads-niah"]["figure"]["data"][0]
        assert heat["customdata"] == [["1 of 1 answered: 1.00 [0.21, 1.00] n=1 (95 % Wilson)"]]
    assert urllib.request.urlopen(url, timeout=60).status == 200


ABLATION_SEARCHES = ["?curve=nan", "?curve=" + "0" * 5000, "?curve=inf&sweep=nan", "?sweep={sweep}&curve={sweep}",
                     "?sweep={sweep}&by=retrieval&curve=ffffffffffffffff", 7, 10**400, None, [1, "a"]]


@pytest.mark.parametrize("search", ABLATION_SEARCHES, ids=range(len(ABLATION_SEARCHES)))
def test_the_ablation_curve_answers_forged_links_with_a_message(server, sweep_id, search):
    url = server[0]
    if isinstance(search, str):
        search = search.replace("{sweep}", sweep_id)
    dep = dependency(url, "hs-abl-curve")
    status, _, raw = answer(url, body(dep, {f"{s['id']}.{s['property']}": search
                                            for s in dep["inputs"] + dep["state"] if s["property"] == "search"}))
    _clean(status, raw)
    assert urllib.request.urlopen(url, timeout=60).status == 200


CURVE_FORMS = [  # (k values, seeds, control top N, metric): what "Run curve" is sent
    ("nan", 1, 1, "niah"), ("0,99999999999999999999999", 1, 1, "niah"), ("0," + "9" * 5000, 1, 1, "niah"),
    ("1e400", 1, 1, "niah"), (5, 1, 1, "niah"), (["0", "1"], 1, 1, "niah"), ("0,1", "nan", 1, "niah"),
    ("0,1", 10**400, 1, "niah"), ("0,1", -1, 1, "niah"), ("0,1", [1], 1, "niah"), ("0,1", 1, "nan", "niah"),
    ("0,1", 1, 10**30, "niah"), ("0,1", 1, -5, "niah"), ("0,1", 1, 1.5, "niah"), ("0,1", 1, 1, 5),
    ("0,1", 1, 1, {"niah": 1}), ("0,1", True, 1, "niah"),
]


@pytest.mark.parametrize("ks, seeds, control, metric", CURVE_FORMS, ids=range(len(CURVE_FORMS)))
def test_run_curve_on_a_sweep_refuses_forged_values_with_a_message(server, sweep_id, ks, seeds, control, metric):
    url = server[0]
    dep = dependency(url, "hs-abl-curve-status")
    values = {"hs-abl-curve-run.n_clicks": 1, "hs-abl-curve-ks.value": ks, "hs-abl-curve-seeds.value": seeds,
              "hs-abl-curve-control.value": control, "hs-abl-curve-metric.value": metric}
    values |= {f"{s['id']}.search": f"?sweep={sweep_id}&by=retrieval" for s in dep["state"] if s["property"] == "search"}
    status, data, raw = answer(url, body(dep, values), timeout=180)
    _clean(status, raw)
    said = json.dumps(data or {})
    assert "Traceback" not in said and "curve=" not in said, said[:400]  # nothing forged ran into a curve
    if status == 200:  # said in the curve's status line, in words
        message = data["response"]["hs-abl-curve-status"]["children"]
        assert isinstance(message, str) and 20 < len(message) < 300, message[:400]
    assert urllib.request.urlopen(url, timeout=60).status == 200

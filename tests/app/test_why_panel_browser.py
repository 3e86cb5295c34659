"""The Attention page's "why" panel (#41, "Where users see it"), in real Chromium: a click on a heatmap cell
explains the head's score there as QK attribution terms; the check line's numbers are the analysis's own
score; a link reopens the panel; a click on the top key-side head's bar opens that head. And its callbacks
answer forged requests (a key after the query, positions past the text, wrong types, a run that does not
exist) with a message, never a 500."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.app.browsing import click_cell, run_prompt, settled, wait_for_run, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TEXT = "When Mary and John went to the store, John gave a drink to"
LAYER, HEAD = 12, 3
CHECK = "#attn-hs-why-check"
NUMBERS = re.compile(r"s_ij = (-?[0-9.]+) \(the model's own score before softmax: (-?[0-9.]+)")


def search_of(page) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(page.evaluate("location.search").lstrip("?")).items()}


def wait_check(page, timeout: float = 240_000) -> tuple[float, float]:
    page.wait_for_function("s => (document.querySelector(s)?.innerText || '').includes('s_ij =')", arg=CHECK,
                           timeout=timeout)
    found = NUMBERS.search(page.inner_text(CHECK))
    assert found, page.inner_text(CHECK)
    return float(found[1]), float(found[2])


def test_a_cell_click_explains_the_score_and_the_top_key_head_opens(server, page, real_model):
    from headscope.analysis.qk_attribution import qk_attribution
    from headscope.analysis.residual_components import head_name

    url, proc, _ = server
    run_prompt(page, url, TEXT)
    wait_for_run(page, timeout=240_000)
    ids = real_model.input_ids(TEXT)
    n = len(ids)
    assert f"{n} tokens" in page.inner_text("#hs-run-info")
    state = {**search_of(page), "layer": str(LAYER), "head": str(HEAD)}
    page.goto(f"{url}?{urllib.parse.urlencode(state)}")
    wait_title(page, "hs-heatmap", f"layer {LAYER}, head {HEAD}", timeout=120_000)
    query, key = n - 1, 4
    click_cell(page, "hs-heatmap", col=key, row=query, n_cols=n, n_rows=n)
    total, own = wait_check(page)
    assert (search_of(page)["query"], search_of(page)["key"]) == (str(query), str(key))
    a = qk_attribution(real_model, ids, LAYER, HEAD, query, key)
    assert abs(own - a.score) <= 2e-6 + 1e-6 * abs(a.score), (own, a.score)
    assert abs(total - a.score) <= 1e-4 * max(1.0, abs(a.score)), (total, a.score)
    assert "frozen at this run" in page.inner_text("#attn-hs-why")

    # the link reopens the panel on the same cell
    link = page.evaluate("location.href")
    page.goto(link)
    assert wait_check(page)[1] == own

    # the top key-side head (by |column sum|) among the panel's bars: a click opens that head
    heads = [i for i, name in enumerate(a.key_names) if name[:1].isdigit()]
    top = a.key_names[max(heads, key=lambda i: abs(a.key_sums[i]))]
    settled(page)
    bars = page.evaluate("() => document.querySelector('#attn-hs-why-graph .js-plotly-plot').data[1].y")
    assert top in bars, (top, bars)
    bar = page.locator("#attn-hs-why-graph .barlayer .trace").nth(1).locator(".point").nth(bars.index(top))
    bar.click(force=True)
    layer, head = (int(x) for x in top.split("."))
    assert head_name(layer, head) == top
    page.wait_for_function("s => location.search.includes(s)", arg=f"layer={layer}&head={head}", timeout=60_000)
    wait_title(page, "hs-heatmap", f"layer {layer}, head {head}", timeout=120_000)
    assert "key=" not in page.evaluate("location.search")
    page.wait_for_selector("#attn-hs-why", state="hidden", timeout=60_000)
    assert proc.poll() is None


def dependency(url: str, output_piece: str) -> dict:
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=120) as r:
        deps = json.loads(r.read())
    return next(d for d in deps if output_piece in d["output"])


def post(url: str, dep: dict, values: list, state: list) -> tuple[int, dict | None]:
    """A raw callback request with ``values`` for the inputs and ``state`` for the states, in order."""
    from tests.app.forged_posts import outputs_of

    body = {"output": dep["output"], "outputs": outputs_of(dep["output"]) if dep["output"].startswith("..")
            else outputs_of(dep["output"])[0],
            "inputs": [{"id": s["id"], "property": s["property"], "value": v} for s, v in zip(dep["inputs"], values, strict=True)],
            "state": [{"id": s["id"], "property": s["property"], "value": v} for s, v in zip(dep["state"], state, strict=True)],
            "changedPropIds": [f"{dep['inputs'][0]['id']}.{dep['inputs'][0]['property']}"]}
    req = urllib.request.Request(url + "_dash-update-component", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:  # a value the page never offers: refused before any callback runs
        return e.code, e.read().decode(errors="replace")


def answered(status: int, answer) -> bool:
    """A message or nothing: the callback's answer (200, 204) or the server's refusal of a value the page
    never offers (400 with its reason, app/offers.py), never a 500 or a traceback."""
    text = json.dumps(answer)
    return (status in (200, 204) or (status == 400 and "refused this request" in text)) and "Traceback" not in text


def test_forged_requests_to_the_why_callbacks_get_a_message_never_a_500(server, page, real_model):
    url, proc, _ = server
    url = url if url.endswith("/") else url + "/"
    run_prompt(page, url, TEXT)
    wait_for_run(page, timeout=240_000)
    run = search_of(page)["run"]
    n = len(real_model.input_ids(TEXT))
    explain = dependency(url, "attn-hs-why-message.children")
    held, tried = 0, 0
    forged_cells = [
        (f"?run={run}&layer=3&head=1&query=2&key=5", "comes after query"),  # query < key
        (f"?run={run}&layer=3&head=1&query={n + 5}&key=1", "outside the text"),  # past the text
        (f"?run={run}&layer=3&head=1&query=999999&key=0", "outside the text"),
        (f"?run={run}&layer=99&head=1&query=3&key=1", "layer"),  # no such layer
        (f"?run={run}&layer=3&head=77&query=3&key=1", "head"),
        ("?run=deadbeefdeadbeef&layer=3&head=1&query=3&key=1", "No stored run"),  # a run that does not exist
    ]
    for search, said in forged_cells:
        tried += 1
        status, answer = post(url, explain, [search, "layer"], ["/", None])
        text = json.dumps(answer)
        if status == 200 and said in text and "Traceback" not in text:
            held += 1
        else:
            print("not held:", search, status, text[:300])
    # wrong types for every input and state: a message or nothing, never a 500
    for value in (None, 5, 1.5, [1, 2], {"a": 1}, True, "?" + "query=1&" * 3000, "\x00", f"?run={run}&key=-1"):
        for values, state in (([value, "layer"], ["/", None]), ([f"?run={run}&query=3&key=1", value], [value, value])):
            tried += 1
            status, answer = post(url, explain, values, state)
            ok = answered(status, answer)
            held += ok
            if not ok:
                print("not held:", str(values)[:80], str(state)[:80], status)
    deps = json.loads(urllib.request.urlopen(url + "_dash-dependencies", timeout=120).read())
    heat = next(d for d in deps if [(i["id"], i["property"]) for i in d["inputs"]] == [("hs-heatmap", "clickData")]
                and "search" in d["output"])
    bars = next(d for d in deps if [(i["id"], i["property"]) for i in d["inputs"]] == [("attn-hs-why-graph", "clickData")])
    for dep in (heat, bars):
        for value in (None, 5, "x", [], {"points": None}, {"points": [None]}, {"points": [{"x": "1.2", "y": "3.4"}]},
                      {"points": [{"x": "٣ a", "y": "٣ b"}]}, {"points": [{"x": "9" * 5000, "y": "1.1"}]},
                      {"points": [{"x": {"a": 1}, "y": [1]}]}):
            for search in (f"?run={run}", None, 7, "?run=deadbeefdeadbeef"):
                tried += 1
                status, answer = post(url, dep, [value], [search])
                ok = answered(status, answer)
                held += ok
                if not ok:
                    print("not held:", dep["output"], value if len(str(value)) < 80 else "long", search, status)
    print(f"forged requests to the why callbacks: {held}/{tried} held")
    assert held == tried, f"{tried - held} of {tried} forged requests were not answered with a message"
    assert proc.poll() is None

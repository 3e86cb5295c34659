"""The Compress page's error bars (#42 item 4) in real Chromium on a real ``headscope serve``: a curve
stored here (4 NIAH prompts, so accuracies move in steps of 0.25) opens from its link, the table shows each
accuracy's Wilson interval and n, the Pareto figure's error bars are those intervals, the smallest KV
within tolerance is decided on the intervals and says its n; and raw callback POSTs with forged tolerance
and policy values answer with a message, never a traceback or a 500."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from headscope.analysis.intervals import wilson

PARETO, TABLE = "#hs-kv-pareto", "#hs-kv-table"
N = 4
# (ranking, fraction kept full, seed, answered of N)
POINTS = [("retrieval", 0.25, None, 1), ("retrieval", 0.5, None, 3), ("random", 0.25, 0, 1), ("random", 0.25, 1, 2),
          ("random", 0.5, 0, 2), ("random", 0.5, 1, 3), ("all_streaming", 0.0, None, 0)]


@pytest.fixture(scope="module")
def stored(server):
    """A curve saved into the server's store: its key."""
    from headscope.analysis.kv_compression import CompressionCurve, KVMemory, Policy, PolicyEvaluation
    from headscope.analysis.kv_compression_sweep import save_curve
    from headscope.analysis.store import Store, content_key

    def made(ranking, fraction, seed, k):
        full = np.zeros((3, 2), dtype=bool)
        full.reshape(-1)[:round(fraction * 6)] = True
        return PolicyEvaluation(Policy(full, 4, 8, ranking, fraction, seed),
                                KVMemory(1000, int(1000 * max(fraction, 0.012)), 1000), 2.0 + (1 - fraction),
                                0.9, k / N, 1.0, N)

    curve = CompressionCurve([made(*p) for p in POINTS], made("all_full", 1.0, None, 2), 4, 8, 1, N,
                             meta={"rankings": ["retrieval", "random", "all_streaming"], "fractions": [0.25, 0.5],
                                   "seeds": [0, 1]})
    key = content_key("test-kv-interval-curve", 1)
    store = Store(server[2])
    save_curve(store, key, curve)
    store.close()
    return key


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def column(page, name: str) -> list[str]:
    return page.locator(f"{TABLE} td[data-dash-column='{name}']").all_inner_texts()


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_stored_curve_shows_its_intervals_in_the_table_and_the_error_bars(server, page, stored):
    url, proc, _ = server
    page.goto(f"{url}compress?compress={stored[:16]}")
    page.wait_for_selector(f"{TABLE} td[data-dash-column='niah_interval']", timeout=240_000)
    assert column(page, "ranking")[:3] == ["uncompressed", "retrieval", "retrieval"]
    # the table: retrieval at 0.25 answered 1 of 4 -> 0.25 [0.05, 0.70], n = 4
    one = wilson(1, N)
    assert column(page, "niah_interval")[1] == f"[{one.low:.2f}, {one.high:.2f}]" == "[0.05, 0.70]"
    assert column(page, "niah_n") == ["4"] * (1 + len(POINTS))
    assert column(page, "niah_seed_band")[3] == "0.38, 0.25–0.50 (2 seeds)"  # random at 0.25: 1/4 and 2/4
    # the figure: the retrieval curve's error bars are the Wilson intervals, in KV order
    data = plot_data(page, PARETO)
    retrieval = next(t for t in data if t.get("yaxis", "y") == "y" and t["name"].startswith("Retrieval score"))
    want = [wilson(k, N) for _, _, _, k in POINTS[:2]]
    np.testing.assert_allclose(retrieval["error_y"]["array"], [w.high - w.value for w in want])
    np.testing.assert_allclose(retrieval["error_y"]["arrayminus"], [w.value - w.low for w in want])
    assert retrieval["customdata"][0][1] == "0.25 [0.05, 0.70] n=4"
    mean = next(t for t in data if t.get("yaxis", "y") == "y" and t["name"].endswith("(mean)"))
    pooled = wilson(1 + 2, 2 * N)  # random at 0.25, both seeds' 8 prompts
    assert mean["error_y"]["array"][0] == pytest.approx(pooled.high - pooled.value)
    # the decision is on the intervals: 1/4 is not told apart from the uncompressed 2/4 (the point rule
    # would have said 0.25 < 0.45), and it says the n it rests on
    info = page.inner_text("#hs-kv-info")
    assert ("Smallest KV within 5 NIAH points of full, Retrieval score (group max): KV 0.250 (groups full 0.25), "
            "NIAH 0.25 [0.05, 0.70] on n = 4 prompts") in info
    assert "uncompressed NIAH 0.50 [0.15, 0.85] n=4" in info
    assert page.inner_text("#hs-error").strip() == ""
    assert proc.poll() is None


UPDATE = "_dash-update-component"


def post(url: str, body: dict) -> tuple[int, dict | None]:
    req = urllib.request.Request(url + UPDATE, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            payload = r.read()
            return r.status, json.loads(payload) if payload else None
    except urllib.error.HTTPError as e:
        return e.code, {"refused": e.read().decode("utf-8", "replace")}


def forged(url: str, input_id: str, value, search: str) -> tuple[int, dict | None]:
    """The callback whose input is ``input_id``, as a script sends it: ``value`` and the page's URL search."""
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=60) as r:
        deps = json.loads(r.read())
    dep = next(d for d in deps if any(i["id"] == input_id for i in d["inputs"]) and "kv-hs-url" in d["output"]
               and not d.get("clientside_function"))
    outputs = [{"id": part.rpartition(".")[0], "property": part.rpartition(".")[2]}
               for part in dep["output"].strip(".").split("...")]
    state = [{**s, "value": search} for s in dep["state"]]
    return post(url, {"output": dep["output"], "outputs": outputs, "inputs": [{**dep["inputs"][0], "value": value}],
                      "state": state, "changedPropIds": [f"{input_id}.value"]})


BAD_TOLERANCES = ["abc", -5, 101, 2.5, True, 1e308, [5], {"a": 1}, "5", 10**40]
BAD_PICKS = ["retrieval:0.3", "nope:0.5", "x" * 1000, 5, ["retrieval:0.5"], {"a": 1}, "<img src=x onerror=alert(1)>",
             "random:0.25:99", "retrieval:1e5", True]


@pytest.mark.integration
@pytest.mark.parametrize("value", BAD_TOLERANCES, ids=[repr(v)[:20] for v in BAD_TOLERANCES])
def test_a_forged_tolerance_is_a_message_and_the_url_stays(server, stored, value):
    """Refused at the request (a value the box does not offer: 400 naming the control) or, past that, by
    the callback's own check (a message in the banner); never a 500, and the URL stays."""
    status, answer = forged(server[0], "hs-kv-tolerance", value, f"?compress={stored[:16]}")
    assert status in (200, 400), value
    if status == 400:
        text = answer["refused"]
        assert text.startswith("headscope refused this request") and "hs-kv-tolerance" in text, text
        assert "Traceback" not in text and len(text) < 600
        return
    response = answer["response"]
    shown = response["hs-error"]["children"]
    assert "tolerance (NIAH points below full) must be a whole number from 0 to 100" in json.dumps(shown), shown
    assert len(json.dumps(shown)) < 400 and "Traceback" not in json.dumps(answer)
    assert "kv-hs-url" not in json.dumps(list(response))  # the URL is not changed


@pytest.mark.integration
def test_a_good_tolerance_goes_into_the_url(server, stored):
    status, answer = forged(server[0], "hs-kv-tolerance", 10, f"?compress={stored[:16]}")
    assert status == 200 and "tol=10" in json.dumps(answer["response"])


@pytest.mark.integration
@pytest.mark.parametrize("value", BAD_PICKS, ids=[repr(v)[:20] for v in BAD_PICKS])
def test_a_forged_policy_pick_is_a_message(server, stored, value):
    status, answer = forged(server[0], "hs-kv-pick", value, f"?compress={stored[:16]}")
    assert status in (200, 204), value
    if status == 200:
        assert "Traceback" not in json.dumps(answer["response"])
        shown = json.dumps(answer["response"].get("hs-error", {}).get("children"))
        assert ("RANKING:FRACTION" in shown or "has no policy" in shown), (value, shown)
        assert len(shown) < 1200

"""The Compare page (``/compare``) in real Chromium against a real ``headscope serve`` on the embedded
model: two stored runs of equal length chosen from the lists, the grids and the largest changes equal
to :func:`headscope.analysis.run_comparison.compare_runs` worked here from the runs' exported patterns, a clicked
head's change in attention, a run of another length refused in the page, and the export's numbers."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import zipfile

import numpy as np
import pytest

from tests.app.browsing import cut_off_titles, select_option, settle, wait_for_run
from tests.app.servers import start_server

TEXTS = ("The capital of France is Paris.", "The capital of Italy is Rome.", "A longer text of another length here.")
GRIDS = "#hs-cmp-grids"


@pytest.fixture(scope="module")
def server(tmp_path_factory, real_model):
    """Three stored runs (two of 7 tokens, one longer), captured here into the server's store."""
    from headscope.analysis.statistics_run import capture_for_page
    from headscope.analysis.store import Store

    home = tmp_path_factory.mktemp("compare-home")
    store = Store(home)
    runs = [capture_for_page(real_model, text, store, 512) for text in TEXTS]
    store.close()
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    env.pop("HEADSCOPE_REDIS_URL", None)
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, home / "server.log")
    yield url, proc, runs
    proc.terminate()
    proc.wait(timeout=30)


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def previous_token_by_hand(run) -> np.ndarray:
    """(1/(n−1)) Σ_{i≥1} A[i, i−1] per head, from the run's own patterns."""
    a = np.asarray(run.patterns, dtype=np.float64)
    n = a.shape[-1]
    return np.mean([a[:, :, q, q - 1] for q in range(1, n)], axis=0)


@pytest.mark.browser
@pytest.mark.integration
def test_compare_two_runs_in_the_page(server, page):
    url, proc, (first, second, longer) = server
    assert first.n_tokens == second.n_tokens != longer.n_tokens
    # the lists offer the runs this browser was shown: here three links opened, one after another
    for run in (longer, second):
        page.goto(url + f"compare?first={run.key[:16]}")
        page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('Choose the second')",
                               timeout=120_000)
    # from a nav link the first run is the page's run; the second list offers only runs of its length
    page.goto(url + f"compare?run={first.key[:16]}")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('Choose the second')",
                           timeout=120_000)
    page.click("#hs-cmp-second")
    options = page.get_by_role("option")
    disabled = {options.nth(i).inner_text(): options.nth(i).locator("input").is_disabled()
                for i in range(options.count())}
    assert len(disabled) == 3
    assert [off for label, off in disabled.items() if longer.key[:8] in label] == [True], disabled
    assert [off for label, off in disabled.items() if second.key[:8] in label] == [False], disabled
    page.keyboard.press("Escape")
    select_option(page, "hs-cmp-second", second.key[:8])
    select_option(page, "hs-cmp-metric", "Previous-token")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('differ at')",
                           timeout=120_000)
    status = page.inner_text("#hs-cmp-status")
    assert status.startswith("Two prompts on one model, 7 tokens") and "3: ·France → ·Italy" in status

    # the grids: both runs' scores and the change, worked by hand from the patterns
    page.wait_for_function(f"(document.querySelector('{GRIDS} .js-plotly-plot')?.layout?.title?.text || '')"
                           ".startsWith('Previous-token')", timeout=60_000)
    data = plot_data(page, GRIDS)
    by_hand = [previous_token_by_hand(first), previous_token_by_hand(second)]
    for trace, expected in zip(data[:3], [*by_hand, by_hand[1] - by_hand[0]], strict=True):
        np.testing.assert_allclose(np.array(trace["z"], dtype=float), expected, atol=1e-5)
    change = by_hand[1] - by_hand[0]
    layer, head = np.unravel_index(np.argmax(np.abs(change)), change.shape)
    top = page.locator("#hs-cmp-top tbody tr").first.inner_text().split()
    assert top[0] == f"{layer}.{head}" and float(top[3]) == pytest.approx(change[layer, head], abs=1e-3)
    assert f"second={second.key[:16]}" in page.url and "metric=previous_token" in page.url

    # a clicked head: its change in attention, second − first, below. Two heads clicked in quick
    # succession on two of the grids (first, then change): the page ends on the second one clicked
    page.locator(GRIDS).scroll_into_view_if_needed()
    where = """([s, axis, x, y]) => { const el = document.querySelector(s + ' .js-plotly-plot');
        const xa = el._fullLayout['xaxis' + axis], ya = el._fullLayout['yaxis' + axis], box = el.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(x), box.top + ya._offset + ya.d2p(y)]; }"""
    other = (int(layer) + 1) % change.shape[0], (int(head) + 1) % change.shape[1]
    page.mouse.click(*page.evaluate(where, [GRIDS, "", other[1], other[0]]))
    page.mouse.click(*page.evaluate(where, [GRIDS, "3", int(head), int(layer)]))
    page.wait_for_function(f"(document.querySelector('{GRIDS} .js-plotly-plot')?.layout?.shapes || []).length === 3"
                           f" && document.querySelector('{GRIDS} .js-plotly-plot').layout.shapes"
                           f".every(s => s.x0 === {int(head)} - 0.5 && s.y0 === {int(layer)} - 0.5)", timeout=60_000)
    page.wait_for_function("document.querySelector('#hs-cmp-diff .js-plotly-plot')?.data?.[0]?.type === 'heatmap'",
                           timeout=60_000)
    diff = np.array(page.evaluate("Array.from(document.querySelector('#hs-cmp-diff .js-plotly-plot')._fullData[0].z,"
                                  " row => Array.from(row))"), dtype=float)
    expected = np.asarray(second.patterns[layer, head], np.float64) - np.asarray(first.patterns[layer, head], np.float64)
    lower = np.tril(np.ones_like(expected, dtype=bool))
    np.testing.assert_allclose(diff[lower], expected[lower], atol=1e-5)
    assert cut_off_titles(page) == []  # both grids', the change's and the difference's titles fit
    assert f"layer={layer}" in page.url and f"head={head}" in page.url

    # the export: the comparison's rows with a manifest naming both runs
    with page.expect_download() as got:
        page.click("[data-export='run_comparison-csv']")
    with zipfile.ZipFile(got.value.path()) as z:
        rows = list(csv.DictReader(io.StringIO(z.read("data.csv").decode())))
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["view"] == "run_comparison"
    assert (manifest["params"]["first"], manifest["params"]["second"]) == (first.key[:16], second.key[:16])
    assert manifest["params"]["metric"] == "previous_token" and manifest["model"]["name"] == "smollm2-135m"
    assert len(rows) == 270
    np.testing.assert_allclose([float(r["change"]) for r in rows], change.ravel(), atol=1e-5)

    # a link naming a run of another length: the page says why, the server lives on
    page.goto(url + f"compare?first={first.key[:16]}&second={longer.key[:16]}")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('token')",
                           timeout=60_000)
    assert "tokens: compare runs of equal length" in page.inner_text("#hs-cmp-status")
    assert page.inner_text("#hs-error") == ""
    page.goto(url + "compare?first=feedfacefeedface&second=00000000")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('No stored run')",
                           timeout=60_000)
    assert proc.poll() is None


# --- what the page offers: the runs this browser was shown, never the store's list (SECURITY.md) ---

def _dash(url: str, path: str, body: object | None = None) -> tuple[int, bytes]:
    """One raw HTTP request to the server, as any client can send it (no browser, no page)."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _outputs(output: str) -> list[dict] | dict:
    parts = output.strip(".").split("...") if output.startswith("..") else [output]
    out = [{"id": cid, "property": prop} for cid, _, prop in (p.rpartition(".") for p in parts)]
    return out if output.startswith("..") else out[0]


def _forged(dep: dict, values: dict) -> dict:
    """A callback request as the renderer sends it, each input and state ``values[property]`` (None if absent)."""
    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(spec["property"])}

    return {"output": dep["output"], "outputs": _outputs(dep["output"]), "inputs": [item(s) for s in dep["inputs"]],
            "state": [item(s) for s in dep["state"]], "changedPropIds": [f"{s['id']}.{s['property']}"
                                                                        for s in dep["inputs"][:1]]}


def offered(page, dropdown: str) -> list[str]:
    """The labels a run list offers, read as a user reads them: open it, read, close it."""
    settle(page)
    page.click(dropdown)
    page.wait_for_timeout(200)
    labels = page.get_by_role("option").all_inner_texts()
    page.keyboard.press("Escape")
    return labels


def wait_status(page, text: str, timeout: float = 120_000) -> None:
    page.wait_for_function("t => (document.querySelector('#hs-cmp-status')?.innerText || '').includes(t)", arg=text,
                           timeout=timeout)


@pytest.mark.browser
@pytest.mark.integration
def test_the_lists_offer_only_the_runs_this_browser_was_shown(server, browser):
    """One browser opens a run by a link on the Attention page and another on the Compare page: its
    lists offer both, and not the third stored run. A second browser (its own context: its own
    storage) is offered none of them, and sees no id or text of theirs anywhere in the page, until it
    pastes an id, which is checked and resolved before it is offered."""
    url, proc, (first, second, longer) = server
    one = browser.new_context(viewport={"width": 1400, "height": 1000})
    other = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        a = one.new_page()
        a.set_default_timeout(60_000)
        a.goto(url + f"?run={second.key[:16]}")  # a link to a run on the Attention page
        wait_for_run(a, timeout=240_000)
        a.goto(url + f"compare?first={first.key[:16]}")
        wait_status(a, "Choose the second")
        labels = offered(a, "#hs-cmp-second")
        assert [run.key[:8] in " ".join(labels) for run in (first, second, longer)] == [True, True, False], labels
        a.goto(url + "compare")  # the runs stay offered in this browser: a later visit, a new tab
        wait_status(a, "Choose two")
        assert sum(run.key[:8] in " ".join(offered(a, "#hs-cmp-first")) for run in (first, second)) == 2

        b = other.new_page()
        b.set_default_timeout(60_000)
        b.goto(url + "compare")
        wait_status(b, "Choose two")
        assert offered(b, "#hs-cmp-first") == [] and offered(b, "#hs-cmp-second") == []
        shown = b.content() + json.dumps(b.evaluate("Object.assign({}, localStorage, sessionStorage)"))
        for run in (first, second, longer):
            assert run.key[:8] not in shown and run.text[:16] not in shown

        # an id typed or pasted: checked (hex), resolved through the store, then offered
        for typed, says in (("../etc/passwd", "8 to 64 hex digits"), ("%", "8 to 64 hex digits"),
                            (longer.key[:7], "8 to 64 hex digits"), ("feedfacefeedface", "No stored run")):
            b.fill("#hs-cmp-paste", typed)
            b.press("#hs-cmp-paste", "Enter")
            b.wait_for_function("t => (document.querySelector('#hs-cmp-paste-note')?.innerText || '').includes(t)",
                                arg=says)
        assert offered(b, "#hs-cmp-first") == []
        b.fill("#hs-cmp-paste", "  " + longer.key[:12].upper() + " ")
        b.press("#hs-cmp-paste", "Enter")
        b.wait_for_function("t => (document.querySelector('#hs-cmp-paste-note')?.innerText || '').includes(t)",
                            arg=longer.key[:8])
        labels = offered(b, "#hs-cmp-first")
        assert len(labels) == 1 and longer.key[:8] in labels[0], labels
        assert first.key[:8] not in b.content() and second.key[:8] not in b.content()
    finally:
        one.close()
        other.close()
    assert proc.poll() is None


@pytest.mark.integration
def test_no_forged_request_lists_the_stored_runs(server):
    """Every server-side callback of the Compare page, posted straight to the server with no page and
    hostile values (empty lists, LIKE wildcards, one-digit and 7-digit prefixes, 5,000 guessed ids, a
    huge string, wrong types): no answer holds the id or the text of a run the request did not name by
    at least 8 hex digits. The same request naming a run does get its label (the forgery is well formed)."""
    import random

    url, proc, runs = server
    status, body = _dash(url, "_dash-dependencies")
    assert status == 200
    deps = [d for d in json.loads(body) if "hs-cmp" in d["output"] and not d.get("clientside_function")]
    assert deps, "no server-side callback of the Compare page"
    rng = random.Random(0)
    hexes = "0123456789abcdef"
    guesses = ["".join(rng.choice(hexes) for _ in range(8)) for _ in range(5000)]
    short = [run.key[:7] for run in runs]
    lists = [None, [], ["%"], ["_" * 8], ["%" * 10], list(hexes), short, [c * 8 for c in hexes], guesses,
             "A" * 100_000, {"first": runs[0].key}, [[runs[0].key[:16]]], [10**20, None, True], [" " + short[0]]]
    searches = ["", "?first=%25&second=_", "?run=" + short[0], f"?first={short[0]}&second={short[1]}",
                "?first=" + "0" * 8]
    values = ([{"data": v} for v in lists] + [{"search": s} for s in searches]
              + [{"value": v} for v in ("%", "_" * 8, short[0], "*", "0" * 8, ["0" * 8], {"a": 1})])
    leaks, tried = [], 0
    for dep in deps:
        for v in values:
            status, payload = _dash(url, "_dash-update-component", _forged(dep, v))
            tried += 1
            assert status in (200, 204, 400), (dep["output"], status, payload[:300])
            for run in runs:
                if run.key[:8].encode() in payload or run.text[:16].encode() in payload:
                    leaks.append(f"{dep['output'][:60]} with {json.dumps(v)[:80]}: run {run.key[:8]}")
    assert leaks == [], leaks
    assert tried >= 2 * len(values)
    # the same requests, naming a run by its link's id, are answered with its label: they were well formed
    named = [dep for dep in deps if any(s["property"] == "data" for s in dep["inputs"] + dep["state"])]
    assert named, "no callback reads the browser's list of runs"
    _, payload = _dash(url, "_dash-update-component", _forged(named[0], {"data": [runs[2].key[:16]]}))
    assert runs[2].key[:8].encode() in payload and runs[0].key[:8].encode() not in payload
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_changes_print_to_the_precision_of_the_stored_patterns(server, page):
    """The runs keep float16 patterns: every number is printed to the decimals their rounding leaves
    meaningful (no 4 decimals where the 4th is rounding), and the heads whose change rounding alone can
    make are counted in the status line, dotted on the change grid and printed without a sign, all as
    :mod:`headscope.analysis.run_comparison` computes them."""
    from headscope.analysis.run_comparison import compare_runs, shown_decimals

    url, proc, (first, second, _) = server
    result = compare_runs(first, second, "entropy")
    within = result.within_rounding
    assert 0 < within.sum() < within.size  # these two texts: some heads' change is rounding alone
    page.goto(url + f"compare?first={first.key[:16]}&second={second.key[:16]}&metric=entropy")
    wait_status(page, "differ at")
    status = page.inner_text("#hs-cmp-status")
    assert f"{int(within.sum())} of 270 heads changed by no more than the rounding of the float16 patterns" in status
    # the status line comes with the figure, which plotly draws a moment later (dcc.Graph loads it lazily)
    page.wait_for_function("document.querySelector('#hs-cmp-grids .js-plotly-plot')?.data")
    dots = page.evaluate("document.querySelector('#hs-cmp-grids .js-plotly-plot').data"
                         ".filter(t => t.type === 'scatter').flatMap(t => t.x.map((x, i) => [t.y[i], x]))")
    assert sorted(map(tuple, dots)) == sorted(zip(*map(lambda a: a.tolist(), np.nonzero(within)), strict=True))
    for row in page.locator("#hs-cmp-top tbody tr").all():
        cells = row.locator("td").all_inner_texts()
        layer, head = map(int, cells[0].split("."))
        decimals = int(shown_decimals(result.resolution[layer, head]))
        assert decimals < 4 and all(len(c.split(".")[1]) == decimals for c in cells[1:4]), cells
    # one run with itself: every change is 0, within the rounding, and printed without a sign
    page.goto(url + f"compare?first={first.key[:16]}&second={first.key[:16]}&metric=entropy")
    wait_status(page, "the same tokens")
    changes = page.locator("#hs-cmp-top tbody td:nth-child(4)").all_inner_texts()
    assert len(changes) == 10 and set(changes) == {"≈ 0 (within rounding)"}, changes
    assert "270 of 270 heads changed by no more than the rounding" in page.inner_text("#hs-cmp-status")
    assert proc.poll() is None

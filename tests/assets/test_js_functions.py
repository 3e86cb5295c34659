"""The browser code's pure functions, each run alone in a blank Chromium page (no server, no Dash): the asset
file is added to an empty page and its functions are called with ``page.evaluate``. Dash's clientside
object is a stand-in that records what the code writes (``set_props``) and marks ``no_update``.

What a user would notice if these were wrong: a job's result written over what they changed meanwhile
(``url_patch.merge``), a click on one head selecting another (``cellAt``), the Ablation page's line
naming other heads than those chosen (head lists), a new page's grid ignoring clicks (``data-hs-click``).
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly
import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
pytestmark = pytest.mark.browser

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NO_UPDATE = "<no_update>"
DASH_STAND_IN = f"""
window.calls = [];
window.dash_clientside = {{no_update: {json.dumps(NO_UPDATE)},
                          set_props: (id, props) => window.calls.push([id, props])}};
window.layout = {{}};  // id -> props, read through Dash's component API
window.dash_component_api = {{getLayout: (id) => (id in window.layout ? {{props: window.layout[id]}} : null)}};
"""


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def blank(chromium):
    """A blank page with Dash's stand-in and the given asset files; no server behind it."""
    context = chromium.new_context(viewport={"width": 800, "height": 600})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def load(*assets: str):
        page.set_content("<!doctype html><html><body></body></html>")
        page.add_script_tag(content=DASH_STAND_IN)
        for name in assets:
            page.add_script_tag(path=str(PLOTLY_JS if name == "plotly" else ASSETS / name))
        return page

    yield load
    context.close()
    assert not errors, errors


# ---------------------------------------------------------------------------------------------------
# url_patch.merge: a job's change of the URL, put into the URL as it is when the job ends

MERGE_CASES = [
    # (patch, search now, expected): only what the job changed is set; what the user changed meanwhile stays
    ({"before": "?run=aaaaaaaa&score=streaming", "after": "?run=aaaaaaaa&score=streaming&sweep=bbbbbbbb"},
     "?run=aaaaaaaa&score=entropy", "?run=aaaaaaaa&score=entropy&sweep=bbbbbbbb"),
    # a key the job removed is removed
    ({"before": "?run=aaaaaaaa&pick=x", "after": "?run=aaaaaaaa"}, "?run=aaaaaaaa&pick=x&layer=2", "?run=aaaaaaaa&layer=2"),
    # reset: set to the job's value even where the job did not change it (the user's pick goes)
    ({"before": "?pick=a", "after": "?pick=a&compress=cccccccc", "reset": ["pick"]}, "?pick=b",
     "?pick=a&compress=cccccccc"),
    # keep: a new text's URL taken whole, but the settings the user changed meanwhile stay
    ({"started": "?run=aaaaaaaa&score=streaming&query=4", "before": "?run=aaaaaaaa&query=4",
      "after": "?run=dddddddd&score=streaming", "keep": ["score"]},
     "?run=aaaaaaaa&score=entropy&query=4", "?run=dddddddd&score=entropy"),
    # keep, and the URL already says it: written as it stands (the run is drawn)
    ({"before": "?run=aaaaaaaa", "after": "?run=aaaaaaaa", "keep": []}, "?run=aaaaaaaa", "?run=aaaaaaaa"),
    # no change and no keep: nothing written
    ({"before": "?run=aaaaaaaa", "after": "?run=aaaaaaaa"}, "?run=aaaaaaaa", NO_UPDATE),
    # a patch for a run the page no longer shows writes nothing; run ids compare without case
    # (the second: AAAAAAAA is the run aaaaaaaa, so its patch is written)
    ({"started": "?run=aaaaaaaa", "before": "?run=aaaaaaaa", "after": "?run=aaaaaaaa&curve=eeeeeeee", "on": ["run"]},
     "?run=ffffffff", NO_UPDATE),
    ({"started": "?run=AAAAAAAA", "before": "?run=aaaaaaaa", "after": "?run=aaaaaaaa&curve=eeeeeeee", "on": ["run"]},
     "?run=aaaaaaaa", "?run=aaaaaaaa&curve=eeeeeeee"),
    # everything removed: an empty query string, not "?"
    ({"before": "?run=aaaaaaaa", "after": ""}, "?run=aaaaaaaa", ""),
]

FORGED_PATCHES = [None, "?run=aaaaaaaa", 7, [], {}, {"after": "?x=1"}, {"before": "?x=1"},
                  {"before": 1, "after": "?x=1"}, {"before": "", "after": ["?x=1"]},
                  {"before": "", "after": "?x=1", "on": "run"}, {"before": "", "after": "?x=1", "keep": "run"},
                  {"before": "", "after": "?x=1", "reset": {"0": "x"}},
                  {"before": "", "after": "?x=1", "on": {"length": 1, "0": "run"}}]


def test_url_patch_merge_sets_only_what_the_job_changed(blank):
    page = blank("url_patch.js")
    for patch, search, expected in MERGE_CASES:
        got = page.evaluate("([p, s]) => window.dash_clientside.headscope_url.merge(p, s)", [patch, search])
        assert got == expected, (patch, search)


def test_url_patch_merge_writes_nothing_for_a_forged_patch(blank):
    page = blank("url_patch.js")
    for patch in FORGED_PATCHES:
        got = page.evaluate("([p, s]) => window.dash_clientside.headscope_url.merge(p, s)", [patch, "?run=aaaaaaaa"])
        assert got == NO_UPDATE, patch


def test_a_stale_result_says_so_in_its_status_line_and_nowhere_else(blank):
    """A result computed on a run the page left writes "Not shown" into the job's status line (an element
    with role="status"), and into no other element, whatever id the patch names."""
    page = blank("url_patch.js")
    page.evaluate("""() => { document.body.innerHTML =
        '<span id="job-line" role="status"></span><div id="hs-text"></div><span id="hs-plain-status"></span>'; }""")
    stale = {"started": "?run=aaaaaaaa", "before": "?run=aaaaaaaa", "after": "?run=aaaaaaaa&curve=eeeeeeee",
             "on": ["run"], "what": "The curve"}
    for status, written in (("job-line", True), ("hs-text", False), ("hs-plain-status", False), ("nowhere", False),
                            (None, False), ({"id": "job-line"}, False)):
        page.evaluate("() => { window.calls = []; }")
        url, banner = page.evaluate("([p, s]) => window.dash_clientside.headscope_url.apply(p, s)",
                                    [{**stale, "status": status}, "?run=ffffffff"])
        assert url == NO_UPDATE and banner.startswith("The curve was computed for what the page showed")
        calls = page.evaluate("() => window.calls")
        assert calls == ([["job-line", {"children": "Not shown: computed for the text the page showed when it "
                                                    "started."}]] if written else []), status


# ---------------------------------------------------------------------------------------------------
# head lists: "3.1,5.0" as the pages write them, "L3H1, L5H0" as a line names them


def heads(page, function: str, *args):
    return page.evaluate(f"(args) => window.headscope_heads.{function}(...args)", list(args))


def test_a_toggled_head_goes_in_sorted_by_layer_then_head_or_comes_out(blank):
    page = blank("head_lists.js")
    assert heads(page, "toggled", "", 3, 1) == {"list": "3.1", "pairs": [[3, 1]]}
    assert heads(page, "toggled", "3.1", 2, 10)["list"] == "2.10,3.1"
    assert heads(page, "toggled", "2.10,3.1", 2, 9)["list"] == "2.9,2.10,3.1"  # numbers, not text: 9 before 10
    assert heads(page, "toggled", "2.9,2.10,3.1", 2, 10)["list"] == "2.9,3.1"
    assert heads(page, "toggled", "3.1", 3, 1) == {"list": "", "pairs": []}


def test_a_line_names_twelve_heads_and_counts_the_rest(blank):
    page = blank("head_lists.js")
    assert heads(page, "names", "3.1,5.0") == "L3H1, L5H0"
    thirteen = ",".join(f"{layer}.0" for layer in range(13))
    assert heads(page, "names", thirteen) == ", ".join(f"L{layer}H0" for layer in range(12)) + " and 1 more"
    assert heads(page, "count", thirteen) == 13
    assert heads(page, "same", "1.2,3.4", "3.4,1.2") and not heads(page, "same", "1.2", "1.2,3.4")


HOSTILE_LISTS = [None, 7, {}, [], "", ",,,", "1.2.3", "a.b", "__proto__", "constructor.1", "-1.2", "1.2,1.2",
                 "1e3.2", "٣.1", " 1.2", "<img src=x onerror=alert(1)>.1", ",".join(["9.9"] * 20000)]


def test_hostile_lists_toggle_to_plain_heads_only_and_never_throw(blank):
    page = blank("head_lists.js")
    for text in HOSTILE_LISTS:
        toggled = heads(page, "toggled", text, 2, 3)
        assert toggled["list"] in ("2.3", "2.3,9.9", "1.2,2.3"), text  # only plain layer.head entries survive
        assert isinstance(heads(page, "names", text), str) and isinstance(heads(page, "count", text), int)


# ---------------------------------------------------------------------------------------------------
# the cell under a click


def cell(page, area, x, y):
    return page.evaluate("([a, x, y]) => window.headscope_grid.cellAt(a, x, y)", [area, x, y])


@pytest.mark.parametrize("n_layers, n_heads, reversed_layers", [(30, 9, False), (30, 9, True), (1, 1, False),
                                                                (4, 12, True)])
def test_the_cell_under_a_point_is_the_one_drawn_there(blank, n_layers, n_heads, reversed_layers):
    """Against the plain arithmetic of a grid: the point at fraction (fx, fy) of the plot area lies in column
    ⌊fx·n⌋ and row ⌊fy·n⌋ from the top (the top row: the last layer, or layer 0 on a reversed axis)."""
    page = blank("grid_clicks.js")
    box = {"left": 40, "top": 30, "width": 270, "height": 600}
    layers = [n_layers - 0.5, -0.5] if reversed_layers else [-0.5, n_layers - 0.5]
    area = {"x": [-0.5, n_heads - 0.5], "y": layers, "box": box}
    points = [(box["left"] + box["width"] * (i + 0.5) / (4 * n_heads), box["top"] + box["height"] * (j + 0.5) / (4 * n_layers))
              for i in range(4 * n_heads) for j in range(4 * n_layers)]
    got = page.evaluate("([a, ps]) => ps.map(([x, y]) => window.headscope_grid.cellAt(a, x, y))", [area, points])
    for (x, y), found in zip(points, got, strict=True):
        column = int((x - box["left"]) / box["width"] * n_heads)
        row = int((y - box["top"]) / box["height"] * n_layers)
        assert found == [row if reversed_layers else n_layers - 1 - row, column], (x, y)


def test_no_cell_off_the_grid_or_on_a_broken_area(blank):
    page = blank("grid_clicks.js")
    area = {"x": [-0.5, 8.5], "y": [-0.5, 29.5], "box": {"left": 0, "top": 0, "width": 90, "height": 300}}
    assert cell(page, area, 95, 10) is None and cell(page, area, 10, -5) is None  # outside the box
    assert cell(page, area, 90, 10) is None  # the right edge pixel rounds to head 9, which is not there
    zoomed = {**area, "x": [2.6, 3.4]}  # zoomed inside head 3: every point is head 3
    assert cell(page, zoomed, 1, 150)[1] == 3 and cell(page, zoomed, 89, 150)[1] == 3
    for broken in (None, {}, {**area, "box": {"left": 0, "top": 0, "width": 0, "height": 300}},
                   {**area, "x": [None, "a"]}, {**area, "x": [-0.5, float("inf")]},
                   {**area, "box": {"left": "x", "top": 0, "width": 90, "height": 300}}):
        assert cell(page, broken, 10, 10) is None, broken


def test_selecting_a_head_sets_it_and_drops_what_it_resets(blank):
    page = blank("grid_clicks.js")
    select = "([s, d]) => window.headscope_grid.selecting(s, 3, 5, d)"
    assert page.evaluate(select, ["?run=aaaaaaaa&layer=1&head=2&query=7", ["query"]]) == "?run=aaaaaaaa&layer=3&head=5"
    assert page.evaluate(select, ["", []]) == "?layer=3&head=5"
    assert page.evaluate(select, [None, None]) == "?layer=3&head=5"
    holds = "([w, s]) => window.headscope_grid.holds(w, s)"
    assert page.evaluate(holds, [{"agg": ["query", None]}, "?run=a"])
    assert page.evaluate(holds, [{"agg": ["query", None]}, "?agg=query"])
    assert not page.evaluate(holds, [{"agg": ["query", None]}, "?agg=group_max"])
    assert page.evaluate(holds, [{}, "?agg=group_max"]) and page.evaluate(holds, [None, ""])
    assert not page.evaluate(holds, [{"agg": "query"}, "?agg=query"])  # allowed values are a list


# ---------------------------------------------------------------------------------------------------
# a grid declared clickable in the page's markup alone


GRID_PAGE = """([spec, cols, rows]) => new Promise((done) => {
    const holder = document.createElement("div");
    holder.setAttribute("data-hs-click", typeof spec === "string" ? spec : JSON.stringify(spec));
    holder.innerHTML = '<div id="a-new-grid" style="width:500px;height:400px"></div>';
    document.body.appendChild(holder);
    const z = Array.from({length: rows}, (_, r) => Array.from({length: cols}, (_, c) => r * cols + c));
    const figure = {data: [{type: "heatmap", z: z, x: [...Array(cols).keys()], y: [...Array(rows).keys()]},
                           {type: "scatter", uid: "chosen", x: [], y: [], mode: "markers"}],
                    layout: {margin: {l: 40, r: 10, t: 40, b: 30}, title: {text: "0 heads chosen"}}};
    window.layout["a-new-grid"] = {figure: figure};
    Plotly.newPlot(document.getElementById("a-new-grid"), figure.data, figure.layout).then(() => done());
})"""


def click_cell(page, col, row, n_cols, n_rows, move=0):
    box = page.locator("#a-new-grid .nsewdrag").first.bounding_box()
    x = box["x"] + box["width"] * (col + 0.5) / n_cols
    y = box["y"] + box["height"] * (n_rows - row - 0.5) / n_rows  # layer 0 at the bottom
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + move, y)
    page.mouse.up()
    return page.evaluate("() => { const c = window.calls; window.calls = []; return c; }")


def test_a_grid_declared_in_its_page_selects_the_head_clicked(blank):
    """A grid no script names (a new page's) selects heads through the URL its holder names."""
    page = blank("plotly", "head_lists.js", "grid_clicks.js")
    page.evaluate("() => { window.layout['a-new-url'] = {search: '?run=aaaaaaaa&query=4'}; }")
    page.evaluate(GRID_PAGE, [{"do": "select", "graph": "a-new-grid", "url": "a-new-url", "drop": ["query"],
                               "when": {}}, 6, 4])
    assert click_cell(page, 5, 2, 6, 4) == [["a-new-url", {"search": "?run=aaaaaaaa&layer=2&head=5"}]]
    assert click_cell(page, 0, 3, 6, 4) == [["a-new-url", {"search": "?run=aaaaaaaa&layer=3&head=0"}]]
    assert click_cell(page, 1, 1, 6, 4, move=30) == []  # a drag (a zoom) selects nothing


def test_a_grid_declared_to_toggle_heads_writes_the_selection_box_and_markers(blank):
    page = blank("plotly", "head_lists.js", "grid_clicks.js")
    page.evaluate("() => { window.layout['a-pending'] = {data: '3.1'}; }")
    page.evaluate(GRID_PAGE, [{"do": "toggle", "graph": "a-new-grid", "pending": "a-pending", "box": "a-box",
                               "marks": "chosen"}, 6, 4])
    calls = click_cell(page, 5, 2, 6, 4)
    assert [c[0] for c in calls] == ["a-pending", "a-box", "a-new-grid"]
    assert calls[0][1] == {"data": "2.5,3.1"} and calls[1][1] == {"value": "2.5,3.1"}
    figure = calls[2][1]["figure"]
    assert figure["data"][1]["x"] == [5, 1] and figure["data"][1]["y"] == [2, 3]
    assert figure["layout"]["title"]["text"] == "2 heads chosen"


def test_a_grid_declared_to_ask_for_a_head_counts_each_click_and_skips_position_maps(blank):
    page = blank("plotly", "head_lists.js", "grid_clicks.js")
    page.evaluate(GRID_PAGE, [{"do": "ask", "graph": "a-new-grid", "store": "a-click"}, 6, 4])
    first, second = click_cell(page, 2, 1, 6, 4), click_cell(page, 2, 1, 6, 4)
    assert first == [["a-click", {"data": {"layer": 1, "head": 2, "click": 1}}]]
    assert second == [["a-click", {"data": {"layer": 1, "head": 2, "click": 2}}]]
    page.evaluate("() => { window.layout['a-new-grid'].figure.layout.meta = {cells: 'positions'}; }")
    assert click_cell(page, 2, 1, 6, 4) == []


@pytest.mark.parametrize("spec", ["{not json", '"select"', "null", '{"do": "constructor", "graph": "a-new-grid"}',
                                  '{"do": "__proto__", "graph": "a-new-grid"}', '{"do": "select"}',
                                  '{"do": "select", "graph": "a-new-grid", "url": "missing"}',
                                  '{"do": "toggle", "graph": "a-new-grid", "pending": "missing", "box": "b"}'])
def test_a_holder_that_declares_no_valid_action_does_nothing(blank, spec):
    page = blank("plotly", "head_lists.js", "grid_clicks.js")
    page.evaluate(GRID_PAGE, [spec, 6, 4])
    assert click_cell(page, 2, 1, 6, 4) == []


# ---------------------------------------------------------------------------------------------------
# the Ablation page's line under its heads box


def test_the_ablation_line_says_applied_only_for_the_heads_applied(blank):
    page = blank("head_lists.js", "ablation.js")
    line = "([p, s]) => window.dash_clientside.headscope_ablation.line(p, s)"
    assert page.evaluate(line, ["", None]).startswith("No heads chosen")
    assert page.evaluate(line, ["3.1,5.0", None]) == "2 heads chosen: L3H1, L5H0 — Apply to compute their effects"
    assert page.evaluate(line, ["3.1,5.0", {"row": {"heads": "5.0,3.1"}}]) == "2 heads applied: L3H1, L5H0"
    assert page.evaluate(line, ["3.1,5.0", {"row": {"heads": "3.1"}}]).startswith("2 heads chosen")
    for forged in (7, [], {"row": 1}, {"row": {"heads": 5}}, {"row": None}):
        assert page.evaluate(line, ["3.1", forged]).startswith("1 heads chosen"), forged

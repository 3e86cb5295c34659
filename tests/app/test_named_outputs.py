"""Page callbacks name their outputs (Dash's flexible callback signature): a render returns a dict, the
names it leaves out stay as they are, and its error goes to the output named ``error`` (the banner).

Through Flask's test client on the app as ``headscope serve`` builds it: raw posts to
``/_dash-update-component`` as the renderer sends them (the request and answer are the same for named
and positional outputs: a flat list of outputs out, ``{id: {property: value}}`` back)."""

from __future__ import annotations

import errno
import json

import pytest

from headscope.analysis.store import Store
from headscope.app import ids
from headscope.app.context import AppContext, get_context, set_context
from headscope.app.page_shell import job_error_id
from headscope.app.server import create_app
from tests.app.forged_posts import outputs_of, request_body

MAX_POSITIONAL = 4  # wider than this, a callback names its outputs
UPDATE = "/_dash-update-component"
MISSING = "ffffffffffffffff"  # an id no record has


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app, its test client and its callbacks by output (``/_dash-dependencies``)."""
    app = create_app(AppContext(store=Store(tmp_path_factory.mktemp("named-outputs-home") / "store")))
    client = app.server.test_client()
    client.get("/")  # the pages' callbacks join app.callback_map on the first request
    deps = {d["output"]: d for d in json.loads(client.get("/_dash-dependencies").data)}
    return app, client, deps


def page_callbacks(app) -> dict[str, list]:
    """Each page module's server callbacks (name → its outputs' grouping), from the app's callback map."""
    import dash

    modules = {p["module"] for p in dash.page_registry.values()}
    out: dict[str, list] = {m.rpartition(".")[2]: [] for m in modules}
    for spec in app.callback_map.values():
        fn = spec.get("callback")
        if getattr(fn, "__module__", None) in modules:
            out[fn.__module__.rpartition(".")[2]].append((fn.__name__, spec["outputs_indices"]))
    return out


def test_no_page_callback_returns_more_than_four_positional_outputs(served):
    app, _, _ = served
    by_page = page_callbacks(app)
    assert {"attention", "flow", "heads", "qk", "patching", "compare", "compress", "ablation"} <= set(by_page)
    wide = []
    for page, callbacks in by_page.items():
        assert callbacks or page == "not_found_404", f"no callbacks of page {page} were found: the check saw nothing"
        wide += [f"{page}.{name}: {len(grouping)} positional outputs" for name, grouping in callbacks
                 if isinstance(grouping, list) and len(grouping) > MAX_POSITIONAL]
    assert not wide, "name these outputs (output=dict(...)):\n" + "\n".join(wide)


def post(client, dep: dict, values: dict, drop: str | None = None):
    """A request for ``dep`` as the renderer sends it, with ``values`` keyed ``id.property``."""
    body = request_body(dep, values)
    if drop:
        body.pop(drop)
    return client.post(UPDATE, json=body)


def render_of(deps: dict, first_output: str) -> dict:
    """The callback whose first output is ``first_output`` (``id.property``)."""
    found = [d for key, d in deps.items() if key.strip(".").split("...")[0] == first_output]
    assert len(found) == 1, (first_output, [k[:80] for k in deps if first_output.split(".")[0] in k])
    return found[0]


# The renders with named outputs, each by its first output, with the page's path and URL prefix
RENDERS = {
    "attention": ("hs-grid.figure", "/", "attn"),
    "flow": ('{"method":"attention","type":"hs-flow-strips"}.figure', "/flow", "flow"),
    "patching": ("hs-pat-map.figure", "/patching", "pat"),
    "compress": ("hs-kv-pareto.figure", "/compress", "kv"),
    "compare": ("hs-cmp-metric.value", "/compare", "cmp"),
    "heads": ("hs-heads-grid.figure", "/heads", "heads"),
}


def banner_lines(answer: dict, prefix: str) -> list[str]:
    """The lines the answer puts in the error banner: the banner itself, or the page's store that the
    browser copies into it (a job's error: :func:`headscope.app.page_shell.job_error`)."""
    response = answer["response"]
    children = (response[ids.ERROR]["children"] if ids.ERROR in response
                else response[job_error_id(prefix)]["data"])
    return [line["props"]["children"] for line in children]


def banner_outputs(prefix: str) -> set[str]:
    return {ids.ERROR, job_error_id(prefix)}


@pytest.fixture(scope="module")
def stored_run(served, real_model):
    """A run of the embedded model in the app's store, as the Attention page's Run stores it."""
    from headscope.analysis.statistics_run import capture_for_page

    context = get_context()
    run = capture_for_page(real_model, "The cat sat on the mat because it was warm.", context.store,
                           context.max_tokens)
    return run.key[:16]


@pytest.fixture
def fresh_context(served):
    """A context with no run cached in memory, so a render reads the run from the store."""
    before = get_context()
    set_context(AppContext(store=before.store))
    yield get_context()
    set_context(before)


@pytest.mark.integration
@pytest.mark.parametrize("page, link, said", [
    ("patching", f"?patching={MISSING}", "No stored patching result has the id"),
    ("compress", f"?compress={MISSING}", "No stored compression curve has the id"),
    ("flow", "?run={run}&target=999", "Target position 999 is out of range"),
    ("attention", "?run={run}", "Could not read the stored run right now: Too many open files"),
    ("compare", "?first={run}&second={run}", "Could not read the stored run right now: Too many open files"),
])
def test_a_failing_render_says_why_in_the_banner_and_leaves_its_figures(served, stored_run, fresh_context,
                                                                         monkeypatch, page, link, said):
    """A link the render cannot draw (an id no record has, a target past the text, a stored run that
    cannot be read right now: too many open files) answers with the banner only: every other output
    of the render is left as the page shows it."""
    import headscope.analysis.store as store

    def no_descriptor_left(*_args, **_kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    if "Too many open files" in said:
        monkeypatch.setattr(store, "_read_verified", no_descriptor_left)
    _, client, deps = served
    first, path, prefix = RENDERS[page]
    dep = render_of(deps, first)
    url = f"{prefix}-hs-url"
    r = post(client, dep, {f"{url}.search": link.format(run=stored_run), f"{url}.pathname": path})
    assert r.status_code == 200, r.get_data(as_text=True)[:500]
    answer = r.get_json()
    assert set(answer["response"]) <= banner_outputs(prefix), f"{page}: outputs other than the banner were written"
    assert any(said in line for line in banner_lines(answer, prefix)), banner_lines(answer, prefix)


@pytest.mark.integration
def test_a_sweep_link_naming_no_sweep_blanks_the_heads_figures_and_says_why(served):
    """The Heads page's sweep figures (named outputs) are blank and the banner names the missing sweep."""
    _, client, deps = served
    dep = render_of(deps, "hs-heads-grid.figure")
    r = post(client, dep, {"heads-hs-url.search": f"?sweep={MISSING}"})
    answer = r.get_json()
    assert r.status_code == 200 and "Run a sweep" in json.dumps(answer["response"]["hs-heads-grid"])
    assert any(MISSING in line for line in banner_lines(answer, "heads")), banner_lines(answer, "heads")


HOSTILE = [12345, 1.5, True, None, {"a": [1]}, ["?run=" + MISSING], "?" + "run=" + "f" * 5000, "A" * 1_000_000,
           "?run=" + MISSING + "&layer=-1&head=99999999999999999999", "?patching=../../etc/passwd",
           "?target=1e400&run=" + MISSING, "?" + "&".join(f"k{i}=v" for i in range(2000))]


@pytest.mark.integration
@pytest.mark.parametrize("page", sorted(RENDERS))
def test_forged_requests_to_a_named_render_get_an_answer_not_a_crash(served, page):
    """Wrong types, huge and nested values for the render's URL, and requests missing their inputs or
    outputs: refused (400) or answered (200/204) with the render's own outputs only, never a 500."""
    app, client, deps = served
    first, path, prefix = RENDERS[page]
    dep = render_of(deps, first)
    url = f"{prefix}-hs-url.search"
    declared = {(json.dumps(o["id"], sort_keys=True, separators=(",", ":")) if isinstance(o["id"], dict) else o["id"],
                 o["property"].split("@")[0]) for o in outputs_of(dep["output"])}
    tried = 0
    for value in HOSTILE:
        r = post(client, dep, {url: value, url.replace("search", "pathname"): path})
        tried += 1
        assert r.status_code in (200, 204, 400), (page, str(value)[:80], r.status_code)
        if r.status_code == 200:
            for cid, props in r.get_json()["response"].items():
                assert {(cid, p) for p in props} <= declared, (page, cid, props)
    for part in ("inputs", "outputs", *(["state"] if dep["state"] else [])):
        r = post(client, dep, {url: ""}, drop=part)
        tried += 1
        assert r.status_code == 400, (page, part, r.status_code)
    assert tried >= len(HOSTILE) + 2


@pytest.mark.integration
@pytest.mark.parametrize("first, shown", [("hs-heads-steps.figure", ["hs-heads-steps"]),
                                          ("hs-heads-scatter.figure", ["hs-heads-scatter", "hs-heads-score-grid",
                                                                       "hs-heads-mass"])])
def test_a_heads_figure_that_cannot_be_drawn_says_why_in_its_place(served, first, shown):
    """The decode steps and the score figures show their own problem where they would be drawn (the
    banner is the sweep's): a link naming no stored sweep says so there, and nothing else changes."""
    _, client, deps = served
    dep = render_of(deps, first)
    r = post(client, dep, {"heads-hs-url.search": f"?sweep={MISSING}&layer=0&head=0&trial=0"})
    assert r.status_code == 200, r.get_data(as_text=True)[:300]
    response = r.get_json()["response"]
    if first == "hs-heads-scatter.figure":  # no sweep: blank figures, the banner (draw_sweep) says why
        assert set(response) >= set(shown) and "Run a sweep" in json.dumps(response["hs-heads-scatter"])
        return
    assert set(response) == set(shown)
    said = [a["text"] for a in response["hs-heads-steps"]["figure"]["layout"]["annotations"]]
    assert any(MISSING in text for text in said) and not any("Something went wrong" in t for t in said), said

"""The Heads page's sweep over the long-context task suite (#42 item 3): the form offers the needles or the
suite, the form's values become the :class:`~headscope.analysis.long_context_tasks.TaskSuite` that
``task_scan`` runs (forged values are messages, also as raw requests to the running server), the NIAH grid
of a task sweep has one column per task with n and its 95 % Wilson interval in the cells, hover and rows,
a link to a task sweep fills the form with its suite, and in Chromium a researcher runs one and reads it."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.long_context_tasks import TASKS, TaskSuite
from tests.app.browsing import layout_props
from tests.app.forged_posts import answer as _answer


@pytest.fixture(scope="module")
def heads_page(tmp_path_factory):
    import dash

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path_factory.mktemp("store"))))  # the pages register with an app
    page = next(p for p in dash.page_registry.values() if p["path"] == "/heads")
    return sys.modules[page["module"]]


def test_the_form_offers_the_needles_or_every_task_of_the_suite(heads_page):
    from headscope.app import ids

    props = {p["id"]: p for p in layout_props(heads_page.layout(), []) if isinstance(p.get("id"), str)}
    assert [o["value"] for o in props[ids.HEADS_PROMPT_SOURCE]["options"]] == ["needles", "tasks"]
    assert props[ids.HEADS_PROMPT_SOURCE]["value"] == "needles"  # the needle sweep, as before, unless asked
    assert [o["value"] for o in props[ids.HEADS_TASKS]["options"]] == list(TASKS)
    assert props[ids.HEADS_PER_TASK]["min"] == 1 and props[ids.HEADS_TASK_SEED]["min"] == 0


FORGED_FORMS = [  # (source, tasks, prompts per task, seed, lengths, what the message says)
    ("tasks", [], 2, 0, "1024", "Tick at least one task"), ("tasks", None, 2, 0, "1024", "Tick at least one task"),
    ("tasks", "passkey", 2, 0, "1024", "Tick at least one task"), ("tasks", {"a": 1}, 2, 0, "1024", "Tick at least"),
    ("tasks", ["../etc/passwd"], 2, 0, "1024", "Unknown task"), ("tasks", ["nope", 5], 2, 0, "1024", "Unknown task"),
    ("tasks", ["<img src=x onerror=alert(1)>"], 2, 0, "1024", "Unknown task"),
    ("tasks", [["passkey"]], 2, 0, "1024", "Unknown task"),
    ("tasks", ["passkey"], 0, 0, "1024", "Prompts per task"), ("tasks", ["passkey"], -1, 0, "1024", "Prompts per task"),
    ("tasks", ["passkey"], "3", 0, "1024", "Prompts per task"), ("tasks", ["passkey"], 10**30, 0, "1024", "Prompts per"),
    ("tasks", ["passkey"], 2.5, 0, "1024", "Prompts per task"), ("tasks", ["passkey"], None, 0, "1024", "box is empty"),
    ("tasks", ["passkey"], True, 0, "1024", "Prompts per task"), ("tasks", ["passkey"], [2], 0, "1024", "Prompts per"),
    ("tasks", ["passkey"], 2, -1, "1024", "seed"), ("tasks", ["passkey"], 2, "x", "1024", "seed"),
    ("tasks", ["passkey"], 2, 10**6 + 1, "1024", "seed"), ("tasks", ["passkey"], 2, 0, "512", "1,024 to 8,192"),
    ("tasks", ["passkey"], 2, 0, "8193", "1,024 to 8,192"), ("tasks", ["passkey"], 2, 0, "-1024", "1,024 to 8,192"),
    ("tasks", ["passkey"], 2, 0, "", "at least one value"), ("tasks", ["passkey"], 2, 0, "1024.5", "separated by commas"),
    ("tasks", ["passkey"], 2, 0, "１０２４", "digits 0-9"), ("tasks", ["passkey"], 2, 0, None, "at least one value"),
    ("tasks", list(TASKS), 500, 0, "1024,2048", "would run 6,000 trials"),
    ("both", ["passkey"], 2, 0, "1024", "needles or the task suite"), (None, ["passkey"], 2, 0, "1024", "needles or"),
    (["tasks"], ["passkey"], 2, 0, "1024", "needles or the task suite"),
]


@pytest.mark.parametrize("source, tasks, n, seed, lengths, said", FORGED_FORMS, ids=range(len(FORGED_FORMS)))
def test_forged_form_values_are_messages(heads_page, source, tasks, n, seed, lengths, said):
    with pytest.raises(InputError, match=said):
        heads_page.task_suite(source, tasks, n, seed, lengths)


def test_the_form_becomes_the_suite(heads_page):
    suite = heads_page.task_suite("tasks", ["passkey", "multi_key", "passkey"], 3.0, 7, "1024, 2048,1024")
    assert suite == TaskSuite(("passkey", "multi_key"), (1024, 2048), 3, 7)
    assert heads_page.task_suite("needles", None, None, None, None) is None  # the needles: nothing to check here


@pytest.fixture
def task_sweep_stored(make_tiny_model, tmp_path):
    """A task sweep of a tiny random model (2,048 positions) in the store the views read, restored after."""
    from headscope.analysis.store import Store
    from headscope.analysis.task_retrieval import task_sweep
    from headscope.app import context
    from headscope.app.context import AppContext, set_context

    store = Store(tmp_path / "home")
    model = make_tiny_model(max_positions=2048, name="tiny-heads-tasks")
    swept = task_sweep(model, TaskSuite(("passkey", "multi_key"), (1024,), 2, 4), store=store)
    before = context._context
    set_context(AppContext(store=store))
    yield store, swept
    context._context = before
    store.close()


def test_the_niah_grid_of_a_task_sweep_has_a_column_per_task_with_n_and_its_interval(heads_page, task_sweep_stored):
    from headscope.analysis.intervals import wilson
    from headscope.app.views import VIEWS, names

    store, swept = task_sweep_stored
    fig, rows = VIEWS[names.NIAH_GRID].build(None, {"sweep": swept.key[:16]})
    heat = fig.data[0]
    assert list(heat.x) == ["passkey", "multi-key"] and fig.layout.xaxis.title.text == "task"
    answered, n = swept.cell_counts()
    for j, task in enumerate(["passkey", "multi_key"]):
        p = wilson(int(answered[0, j]), 2)
        assert heat.customdata[0][j] == f"{p.successes} of 2 answered: {p.text()} (95 % Wilson)"
        assert f"{p.successes}/2" in heat.text[0][j]
        row = rows[j]  # what the CSV export writes
        assert row["task"] == task and row["length"] == 1024 and "depth" not in row
        assert (row["accuracy_n"], row["accuracy_answered"]) == (2, p.successes)
        assert row["accuracy_low"] == pytest.approx(p.low) and row["accuracy_high"] == pytest.approx(p.high)
    assert "task %{x}" in heat.hovertemplate
    # the other views of the sweep that read only the store draw too
    assert VIEWS[names.RETRIEVAL_GRID].build(None, {"sweep": swept.key[:16], "agg": "query"})[1]
    assert VIEWS[names.RETRIEVAL_HISTOGRAM].build(None, {"sweep": swept.key[:16]})[1]


def test_a_link_to_a_task_sweep_fills_the_form_with_its_suite(heads_page, task_sweep_stored):
    _, swept = task_sweep_stored
    filled = heads_page.form_from_sweep({}, f"?sweep={swept.key[:16]}", None, "")
    assert filled["source"] == "tasks" and filled["tasks"] == ["passkey", "multi_key"]
    assert (filled["per_task"], filled["seed"], filled["lengths"]) == (2, 4, "1024")
    assert "Settings filled from sweep" in filled["note"] and filled["filled"] == swept.key[:16]


# -- raw requests to the running server's "Run sweep" --------------------------------------------



def _run_sweep_body(url: str, values: dict) -> dict:
    with urllib.request.urlopen(url + "_dash-dependencies", timeout=60) as r:
        deps = json.loads(r.read())
    dep = next(d for d in deps if any(i["id"] == "hs-heads-run" for i in d["inputs"]) and "hs-heads-status." in d["output"]
               and not d.get("clientside_function"))  # the job, not the page's busy state

    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = [{"id": part.rpartition(".")[0], "property": part.rpartition(".")[2]}
               for part in dep["output"].strip(".").split("...")]
    return {"output": dep["output"], "outputs": outputs, "inputs": [item(s) for s in dep["inputs"]],
            "state": [item(s) for s in dep["state"]], "changedPropIds": ["hs-heads-run.n_clicks"]}


POSTED = [  # (tasks, prompts per task, seed, lengths): each refused before the model runs anything
    (["nope"], 2, 0, "1024"), (["passkey"], 0, 0, "1024"), (["passkey"], 10**400, 0, "1024"), (["passkey"], -1, 0, "1024"),
    (["passkey"], "3", 0, "1024"), (["passkey"], 2, 0, "512"), (["passkey"], 2, 0, "100000"), (["passkey"], 2, "nan", "1024"),
    (list(TASKS), 100, 0, "1024"), ("passkey", 2, 0, "1024"), ([{"__proto__": 1}], 2, 0, "1024"),
]


@pytest.mark.integration
@pytest.mark.parametrize("tasks, n, seed, lengths", POSTED, ids=range(len(POSTED)))
def test_run_sweep_refuses_a_forged_suite_with_a_message(server, tasks, n, seed, lengths):
    url = server[0]
    values = {"hs-heads-run.n_clicks": 1, "hs-heads-prompt-source.value": "tasks", "hs-heads-tasks.value": tasks,
              "hs-heads-per-task.value": n, "hs-heads-task-seed.value": seed, "hs-heads-lengths.value": lengths,
              "hs-heads-sink.value": 4, "hs-heads-window.value": 64, "hs-heads-needles.value": [],
              "hs-heads-depths.value": "50", "hs-heads-haystack.value": "prose"}
    status, data, raw = _answer(url, _run_sweep_body(url, values), timeout=180)
    refused = status == 400 and raw.startswith(b"headscope refused this request: The value of ")
    assert status == 200 or refused, (status, raw[:300])
    assert b"Traceback" not in raw and b"Internal Server Error" not in raw, raw[:300]
    if status == 200:
        said = json.dumps(data["response"])
        assert "sweep=" not in said, said[:400]  # nothing ran into a sweep
        text = json.dumps(data["response"]["heads-hs-job-error"]["data"])  # the page's error line
        assert any(w in text for w in ("task", "Prompts per task", "seed", "1,024", "trials")), text[:400]
    assert urllib.request.urlopen(url, timeout=60).status == 200


# -- in Chromium, on the embedded model -------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(900)  # one passkey prompt of 1,024 tokens decoded, then the other per-head scores on it
def test_a_researcher_sweeps_the_task_suite_and_reads_a_tasks_interval(server, page):
    from tests.app.browsing import wait_title

    url = server[0]
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run", timeout=240_000)
    # each choice shows its own fields: the needles', or the task suite's
    needle_fields = ("#hs-heads-needles", "#hs-heads-depths", "#hs-heads-haystack", "#hs-heads-depth-rule",
                     "#hs-heads-custom-needles", "#hs-heads-custom-haystack")
    assert all(page.is_visible(f) for f in needle_fields) and page.is_visible("#hs-heads-lengths")
    assert not page.is_visible("#hs-heads-tasks") and not page.is_visible("#hs-heads-per-task")
    page.check("#hs-heads-prompt-source input[value='tasks']")
    page.wait_for_selector("#hs-heads-tasks", state="visible", timeout=30_000)
    assert page.is_visible("#hs-heads-per-task") and page.is_visible("#hs-heads-task-seed")
    assert not any(page.is_visible(f) for f in needle_fields)
    assert page.is_visible("#hs-heads-lengths") and page.is_visible("#hs-heads-sink")  # they serve both
    for box in page.locator("#hs-heads-tasks input").all():
        box.check() if box.get_attribute("value") == "passkey" else box.uncheck()
    page.fill("#hs-heads-per-task", "1")
    page.fill("#hs-heads-lengths", "1024")
    page.click("#hs-heads-run")
    page.wait_for_function("new URLSearchParams(location.search).has('sweep')", timeout=800_000)
    page.wait_for_function("(document.querySelector('#hs-heads-info')?.innerText || '').includes('tasks passkey')",
                           timeout=120_000)
    assert page.inner_text("#hs-error").strip() == ""
    page.wait_for_function("""() => {
        const g = document.querySelector('#hs-heads-niah .js-plotly-plot');
        return g && g.data && g.data[0] && g.data[0].x && g.data[0].x[0] === 'passkey'; }""", timeout=120_000)
    heat = page.evaluate("""() => { const d = document.querySelector('#hs-heads-niah .js-plotly-plot').data[0];
                                    return {x: d.x, custom: d.customdata, text: d.text}; }""")
    assert heat["x"] == ["passkey"]
    said = heat["custom"][0][0]
    assert said.endswith("n=1 (95 % Wilson)") and (" of 1 answered: " in said), said
    assert page.locator("#hs-heads-niah .xtitle").text_content() == "task"  # an SVG text
    wait_title(page, "hs-heads-score-grid", "Streaming score")  # the other per-head scores, over the task prompt
    # the link reopens the sweep with its suite in the form
    link = page.url
    page.goto(url + "heads")
    page.goto(link)
    page.wait_for_function("document.querySelector('#hs-heads-prompt-source input[value=\"tasks\"]')?.checked",
                           timeout=120_000)
    assert page.input_value("#hs-heads-per-task") == "1" and page.input_value("#hs-heads-lengths") == "1024"

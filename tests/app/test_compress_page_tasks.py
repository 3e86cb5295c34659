"""The Compress page's task-suite choice (#42 item 3): the form's prompt source, tasks and prompts per task
become the :class:`~headscope.analysis.long_context_tasks.TaskSuite` that ``compress_sweep`` scores, forged
values are messages, and a curve measured on the suite says each task's uncompressed answer rate."""

from __future__ import annotations

import sys

import pytest

from headscope.analysis.errors import InputError
from tests.app.browsing import layout_props


@pytest.fixture(scope="module")
def compress_page(tmp_path_factory):
    import dash

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path_factory.mktemp("store"))))  # the pages register with an app
    page = next(p for p in dash.page_registry.values() if p["path"] == "/compress")  # as the router has it
    return sys.modules[page["module"]]


def test_the_form_offers_the_sweep_or_every_task_of_the_suite(compress_page):
    from headscope.analysis.long_context_tasks import TASKS
    from headscope.app import ids

    props = {p["id"]: p for p in layout_props(compress_page.layout(), []) if isinstance(p.get("id"), str)}
    assert [o["value"] for o in props[ids.KV_PROMPT_SOURCE]["options"]] == ["sweep", "tasks"]
    assert props[ids.KV_PROMPT_SOURCE]["value"] == "sweep"  # the needle sweep, as before, unless asked
    assert [o["value"] for o in props[ids.KV_TASKS]["options"]] == list(TASKS)
    assert props[ids.KV_PER_TASK]["min"] == 1


def test_the_form_becomes_the_suite_and_forged_values_are_messages(compress_page):
    suite = compress_page.task_suite("tasks", ["passkey", "multi_key", "passkey"], 3, "1024, 2048")
    assert suite.tasks == ("multi_key", "passkey") and suite.lengths == (1024, 2048) and suite.n_per_task == 3
    assert compress_page.task_suite("sweep", ["passkey"], 3, "1024") is None
    for source, tasks, per_task, message in [
        ("tasks", [], 3, "Tick at least one task"), ("tasks", None, 3, "Tick at least one task"),
        ("tasks", "passkey", 3, "Tick at least one task"), ("tasks", ["../etc/passwd"], 3, "Tick at least one task"),
        ("tasks", ["passkey"], 0, "Prompts per task"), ("tasks", ["passkey"], 10**9, "Prompts per task"),
        ("tasks", ["passkey"], "x", "Prompts per task"), ("both", ["passkey"], 3, "needle sweep or on the task"),
        (None, ["passkey"], 3, "needle sweep or on the task"), (["tasks"], ["passkey"], 3, "needle sweep or on the task"),
    ]:
        with pytest.raises(InputError, match=message):
            compress_page.task_suite(source, tasks, per_task, "1024")


def test_a_curve_on_the_suite_says_each_tasks_rate_and_the_dropped_ones(compress_page):
    tasks = {"passkey": {"answered": 4, "n": 5, "rate": 0.8, "low": 0.376, "high": 0.964, "dropped": False},
             "common_words": {"answered": 0, "n": 5, "rate": 0.0, "low": 0.0, "high": 0.434, "dropped": True}}
    text = compress_page.task_rates(tasks)
    assert "passkey 0.80 [0.38, 0.96] n=5" in text
    assert text.index("Dropped") < text.index("common words 0.00 [0.00, 0.43] n=5")


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(900)  # a one-trial sweep at 1,024 tokens, 2 task prompts answered, 2 policies on them
def test_the_page_scores_the_task_suite_and_says_each_tasks_rate(server, page):
    url, proc, home = server
    page.goto(url + "compress")
    page.wait_for_selector("#hs-kv-run", timeout=240_000)
    for box in page.locator("#hs-kv-needles input").all():
        box.uncheck()
    page.check("#hs-kv-needles input[value='locker-code']")
    page.fill("#hs-kv-lengths", "1024")
    page.fill("#hs-kv-depths", "50")
    for box in page.locator("#hs-kv-rankings input").all():
        box.check() if box.get_attribute("value") == "retrieval" else box.uncheck()
    page.fill("#hs-kv-fractions", "0.5")
    page.fill("#hs-kv-sink", "16")
    page.fill("#hs-kv-recent", "64")
    # the task suite's fields show only while the suite is chosen
    assert not page.is_visible("#hs-kv-tasks") and not page.is_visible("#hs-kv-per-task")
    page.check("#hs-kv-prompt-source input[value='tasks']")
    page.wait_for_selector("#hs-kv-tasks", state="visible", timeout=30_000)
    assert page.is_visible("#hs-kv-per-task") and page.is_visible("#hs-kv-needles")  # needles still rank the heads
    for box in page.locator("#hs-kv-tasks input").all():
        box.check() if box.get_attribute("value") == "passkey" else box.uncheck()
    page.fill("#hs-kv-per-task", "2")
    page.click("#hs-kv-run")
    page.wait_for_function("new URLSearchParams(location.search).has('compress')", timeout=800_000)
    page.wait_for_function("(document.querySelector('#hs-kv-info')?.innerText || '').includes('task suite')",
                           timeout=120_000)
    info = page.inner_text("#hs-kv-info")
    assert page.inner_text("#hs-error").strip() == ""
    assert "NIAH accuracy on the task suite" in info and "passkey" in info and "n=2" in info, info
    assert ": 2 NIAH prompt(s)" in info, info  # the accuracy rests on the suite's prompts, not the sweep's one

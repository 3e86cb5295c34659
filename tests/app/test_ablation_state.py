"""The Ablation page's effects panel has one owner, ``reduce(state, event)`` in assets/ablation.js: every
row of its state × event table, events out of order, and forged states and events, run alone in a blank
Chromium page (no server, no Dash). What a user would notice if it were wrong: the effects of one text
or set shown under another, a link's "computing" note replaced while its job runs, effects an Apply drew
replaced by a render that answered late, or a Cancel that wipes the effects it did not stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.browser
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SKIP = "<no_update>"
STAND_IN = f"window.dash_clientside = {{no_update: {SKIP!r}}};"


def fig(text: str) -> dict:
    return {"data": [], "layout": {"annotations": [{"text": text}]}}


URL = "?run=aaaa&heads=3.1"
OTHER_URL = "?run=bbbb&heads=3.1"
KEY = [None, "aaaa", "3.1", "zero", None, None]
KEY2 = [None, "aaaa", "3.1,5.0", "zero", None, None]
OTHER_RUN_KEY = [None, "bbbb", "3.1", "zero", None, None]
ROW = {"run": "aaaa", "heads": "3.1", "d_loss": 0.5}
WAITING, COMPUTING, CANCELLED, EFFECTS = fig("Apply computes"), fig("Computing"), fig("Cancelled"), fig("ablation")
NOTE = {"shows": "note", "key": None, "row": None}


def key(k: list) -> str:
    return json.dumps(k, separators=(",", ":"))


def asked(figure=WAITING, k=KEY, search=URL, computing=False) -> dict:
    return {"type": "asked", "search": search, "key": k, "figure": figure, "computing": computing,
            "cancelled": CANCELLED}


def applied(k=KEY) -> dict:
    return {"type": "applied", "key": k, "figure": EFFECTS, "summary": "top 5", "row": ROW}


SHOWING = {"shows": "effects", "key": key(KEY), "row": ROW}
COMPUTING_KEY = {"shows": "computing", "key": key(KEY), "row": None}


@pytest.fixture(scope="module")
def reduce():
    """``reduce(state, event, now=URL)`` run in the page, with ``no_update`` read as absent."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_content("<!doctype html><html><body></body></html>")
        page.add_script_tag(content=STAND_IN)
        page.add_script_tag(path=str(ROOT / "assets" / "ablation.js"))

        def run(state, event, now=URL):
            event = {**event, "now": now} if isinstance(event, dict) else event
            return page.evaluate("([s, e]) => window.dash_clientside.headscope_ablation.reduce(s, e)", [state, event])

        run.page = page
        yield run
        browser.close()
        assert not errors, errors


# ---------------------------------------------------------------------------------------------------
# every row of the table


@pytest.mark.parametrize("state", [NOTE, SHOWING, COMPUTING_KEY], ids=["note", "effects", "computing"])
def test_a_render_of_a_url_the_page_has_left_changes_nothing(reduce, state):
    assert reduce(state, asked(search=OTHER_URL)) == {"state": state}


@pytest.mark.parametrize("state", [SHOWING, COMPUTING_KEY], ids=["effects", "computing"])
def test_a_render_of_the_same_text_and_set_keeps_effects_and_a_links_computing_note(reduce, state):
    assert reduce(state, asked(WAITING)) == {"state": state}


@pytest.mark.parametrize("state", [NOTE, {**SHOWING, "key": key(KEY2)}, {**COMPUTING_KEY, "key": key(KEY2)},
                                   {"shows": "note", "key": key(KEY), "row": None}],
                         ids=["note", "effects-of-another-set", "computing-another-set", "note-same-key"])
def test_any_other_render_shows_its_figure_without_a_summary(reduce, state):
    assert reduce(state, asked(WAITING)) == {"state": {"shows": "note", "key": key(KEY), "row": None},
                                             "figure": WAITING, "summary": ""}
    assert reduce(state, asked(COMPUTING, computing=True)) == {
        "state": {"shows": "computing", "key": key(KEY), "row": None}, "figure": COMPUTING, "summary": ""}


@pytest.mark.parametrize("state", [NOTE, SHOWING, COMPUTING_KEY], ids=["note", "effects", "computing"])
def test_effects_of_a_text_the_page_no_longer_shows_are_dropped(reduce, state):
    assert reduce(state, applied(OTHER_RUN_KEY)) == {"state": state}
    assert reduce(state, applied(KEY), now=OTHER_URL) == {"state": state}


@pytest.mark.parametrize("state", [NOTE, SHOWING, COMPUTING_KEY, {**SHOWING, "key": key(KEY2)}],
                         ids=["note", "effects", "computing", "effects-of-another-set"])
def test_effects_of_the_text_shown_are_shown_with_their_summary_and_row(reduce, state):
    assert reduce(state, applied(KEY2)) == {"state": {"shows": "effects", "key": key(KEY2), "row": ROW},
                                            "figure": EFFECTS, "summary": "top 5"}
    # the run's id in another case is the same run
    assert reduce(state, applied(KEY), now="?run=AAAA")["state"]["shows"] == "effects"


def test_a_refused_link_says_why_where_it_said_computing(reduce):
    failed = fig("No effects: out of range")
    assert reduce(COMPUTING_KEY, {"type": "failed", "figure": failed}) == {
        "state": {**COMPUTING_KEY, "shows": "note"}, "figure": failed, "summary": ""}


@pytest.mark.parametrize("state", [NOTE, SHOWING], ids=["note", "effects"])
def test_a_refused_apply_leaves_the_panel_as_it_is(reduce, state):
    assert reduce(state, {"type": "failed", "figure": fig("No effects")}) == {"state": state}


def test_cancel_keeps_the_effects_shown_and_says_so(reduce):
    out = reduce(SHOWING, {"type": "cancel", "figure": CANCELLED})
    assert out["state"] == SHOWING and "figure" not in out and "effects shown are the last applied" in out["status"]


@pytest.mark.parametrize("state", [NOTE, COMPUTING_KEY], ids=["note", "computing"])
def test_cancel_with_no_effects_shown_says_none_were_computed(reduce, state):
    out = reduce(state, {"type": "cancel", "figure": CANCELLED})
    assert out == {"state": {**state, "shows": "note"}, "figure": CANCELLED, "summary": "",
                   "status": "Cancelled: no effects computed; Apply computes the chosen heads' effects."}


# ---------------------------------------------------------------------------------------------------
# events out of order, as they reach a page


def fold(reduce, events, state=None, now=URL):
    shown = {}
    for event in events:
        out = reduce(state, event, now)
        state = out["state"]
        shown.update({k: v for k, v in out.items() if k != "state"})
    return state, shown


def test_a_render_that_answers_after_apply_keeps_apply_s_effects(reduce):
    state, shown = fold(reduce, [asked(COMPUTING, computing=True), asked(WAITING), applied(), asked(WAITING)])
    assert state["shows"] == "effects" and shown["figure"] == EFFECTS and shown["summary"] == "top 5"


def test_a_render_for_an_old_text_arriving_after_the_new_one_changes_nothing(reduce):
    new = asked(WAITING, OTHER_RUN_KEY, OTHER_URL)
    old = asked(COMPUTING, KEY, URL, computing=True)
    state, shown = fold(reduce, [new, old], now=OTHER_URL)
    assert state == {"shows": "note", "key": key(OTHER_RUN_KEY), "row": None} and shown["figure"] == WAITING


def test_apply_s_effects_of_the_old_text_arriving_after_a_new_text_do_not_show(reduce):
    state, shown = fold(reduce, [asked(WAITING, OTHER_RUN_KEY, OTHER_URL), applied(KEY)], now=OTHER_URL)
    assert state["shows"] == "note" and shown["figure"] == WAITING


def test_cancel_before_apply_then_apply_s_effects_show(reduce):
    state, shown = fold(reduce, [asked(WAITING), {"type": "cancel", "figure": CANCELLED}, applied()])
    assert state == SHOWING and shown["figure"] == EFFECTS


def test_apply_twice_shows_the_last_set_and_a_late_cancel_keeps_it(reduce):
    state, shown = fold(reduce, [applied(KEY), applied(KEY2), {"type": "cancel", "figure": CANCELLED}])
    assert state == {"shows": "effects", "key": key(KEY2), "row": ROW} and shown["figure"] == EFFECTS
    assert "effects shown are the last applied" in shown["status"]


def test_a_cancelled_link_then_its_late_rerender_shows_waiting_not_computing(reduce):
    state, shown = fold(reduce, [asked(COMPUTING, computing=True), {"type": "cancel", "figure": CANCELLED},
                                 asked(WAITING)])
    assert state["shows"] == "note" and shown["figure"] == WAITING


# ---------------------------------------------------------------------------------------------------
# forged states and events (a store is the browser's: whatever is there is checked, not trusted)

FORGED_STATES = [  # (what the store holds, what the reducer reads)
    (None, NOTE), (7, NOTE), ("effects", NOTE), ([], NOTE), ({"shows": "x"}, NOTE), ({"shows": ["effects"]}, NOTE),
    ({"shows": "effects", "key": 5, "row": 5}, {"shows": "effects", "key": None, "row": None}),
    ({"shows": "effects", "key": key(KEY), "row": [1]}, {"shows": "effects", "key": key(KEY), "row": None}),
    ({"shows": "note", "key": key(KEY), "row": ROW}, {"shows": "note", "key": key(KEY), "row": None}),
    ({"shows": "toString"}, NOTE), ({"shows": "computing", "key": [1]}, {"shows": "computing", "key": None, "row": None}),
]
FORGED_EVENTS = [None, 3, "asked", [], {}, {"type": "nope"}, {"type": "asked", "figure": "x", "search": URL},
                 {"type": "asked", "figure": WAITING}, {"type": "asked", "figure": None, "search": URL, "key": KEY},
                 {"type": "applied", "key": "aaaa", "figure": EFFECTS}, {"type": "applied", "key": [None, 5],
                                                                          "figure": EFFECTS},
                 {"type": "applied", "key": KEY, "figure": [1]}, {"type": "applied", "key": [], "figure": EFFECTS},
                 {"type": "failed", "figure": "x"}, {"type": "toString"}, {"type": "constructor"}]


@pytest.mark.parametrize("state, read", FORGED_STATES)
def test_a_forged_state_reads_as_a_state_the_page_writes(reduce, state, read):
    assert reduce(state, {"type": "nope"}) == {"state": read}
    # and a Keep row forged into a note is never kept: the line and Keep read the row only of effects
    assert reduce(state, asked(search=OTHER_URL))["state"]["row"] in (None, ROW)


@pytest.mark.parametrize("event", FORGED_EVENTS)
def test_a_forged_event_changes_nothing(reduce, event):
    for state in (NOTE, SHOWING, COMPUTING_KEY):
        assert reduce(state, event) == {"state": state}, (state, event)


def test_a_forged_summary_or_row_is_not_drawn(reduce):
    out = reduce(NOTE, {**applied(), "summary": 5, "row": "x"})
    assert out["summary"] == "" and out["state"]["row"] is None


# ---------------------------------------------------------------------------------------------------
# the Dash callbacks: one per event source, each the reducer


def call(reduce, name: str, *args):
    return reduce.page.evaluate("([name, args]) => window.dash_clientside.headscope_ablation[name](...args)", [name, args])


def test_each_source_s_callback_writes_what_the_reducer_decides(reduce):
    a = asked(COMPUTING, computing=True)
    del a["type"]
    assert call(reduce, "asked", a, URL, None) == [COMPUTING, "", COMPUTING_KEY]
    assert call(reduce, "applied", {k: v for k, v in applied().items() if k != "type"}, URL, COMPUTING_KEY) == [
        EFFECTS, "top 5", SHOWING]
    failed = fig("No effects: why")
    assert call(reduce, "applied", {"failed": failed}, URL, COMPUTING_KEY) == [failed, "", {**COMPUTING_KEY,
                                                                                          "shows": "note"}]
    figure, summary, state, status = call(reduce, "cancel", 1, a, SHOWING)
    assert (figure, summary, state) == (SKIP, SKIP, SKIP) and status.startswith("Cancelled: the effects shown")
    assert call(reduce, "cancel", 1, a, COMPUTING_KEY)[:3] == [CANCELLED, "", {**COMPUTING_KEY, "shows": "note"}]


@pytest.mark.parametrize("value", [None, 5, "x", [], {"failed": None}, {"key": KEY}])
def test_a_forged_store_value_reaching_a_callback_changes_nothing(reduce, value):
    for name in ("asked", "applied"):
        assert call(reduce, name, value, URL, SHOWING) == [SKIP, SKIP, SKIP], (name, value)
    figure, summary, state, _ = call(reduce, "cancel", 1, value, SHOWING)
    assert (figure, summary, state) == (SKIP, SKIP, SKIP)


def test_a_cancel_callback_without_a_click_changes_nothing(reduce):
    for clicks in (0, None):
        assert call(reduce, "cancel", clicks, asked(), COMPUTING_KEY) == [SKIP, SKIP, SKIP, SKIP]


@pytest.mark.parametrize("first", ["asked", "applied"])
def test_a_render_and_apply_s_effects_asked_together_leave_the_effects_and_their_row(reduce, first):
    """Dash reads the State of callbacks asked together before it writes any of their answers: both
    read the link's "computing" state. Whichever answer is written last, the panel shows the effects
    and its state has their row (what the line and Keep read)."""
    a = {k: v for k, v in asked(WAITING).items() if k != "type"}
    b = {k: v for k, v in applied().items() if k != "type"}
    answers = {"asked": call(reduce, "asked", a, URL, COMPUTING_KEY),
               "applied": call(reduce, "applied", b, URL, COMPUTING_KEY)}
    page = [COMPUTING, "", COMPUTING_KEY]
    for name in (first, "applied" if first == "asked" else "asked"):
        page = [old if new == SKIP else new for old, new in zip(page, answers[name], strict=True)]
    assert page == [EFFECTS, "top 5", SHOWING]

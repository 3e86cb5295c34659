"""A page declares its own URL fields (:func:`headscope.app.url_state.page_part`), in its own module: links
then read, check and write them with no list in ``url_state`` to edit, after the keys older links had
(which keep their order: tests/app/test_url_state.py)."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlencode

import pytest

from headscope.app import url_state
from headscope.app.url_state import (
    PageState,
    page_part,
    parse,
    read_one_of,
    read_stored_id,
    read_whole_number,
)


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is; what a test registers is gone after it."""
    for name in ("PARTS", "_OWNER", "_READERS"):
        monkeypatch.setattr(url_state, name, dict(getattr(url_state, name)))
    monkeypatch.setattr(url_state, "_ORDER", url_state._ORDER)


def declare_demo():
    @page_part("demo", readers={"zoom": read_whole_number, "shade": read_one_of("light", "dark"),
                                "result": read_stored_id})
    @dataclasses.dataclass
    class DemoState:
        zoom: int | None = None
        shade: str = "light"
        result: str | None = None

    return DemoState


def test_a_page_declares_its_url_fields_and_links_read_and_write_them(registry):
    declare_demo()
    state = parse("?shade=dark&run=0123456789abcdef&zoom=3&layer=2&result=ABCDEF0123")
    assert (state.demo.zoom, state.demo.shade, state.zoom, state.layer, state.result) == (
        3, "dark", 3, 2, "abcdef0123")
    assert state.problems == []
    # written after the keys links had, in the order the part declares its fields
    assert state.to_search() == "?run=0123456789abcdef&layer=2&zoom=3&shade=dark&result=abcdef0123"
    assert parse(state.to_search()) == state
    assert PageState(zoom=4).to_search() == "?zoom=4" and PageState(shade="light").to_search() == ""
    old = parse("?layer=1&head=0&score=entropy&agg=group_max&heads=1.2&ablate=mean")  # older keys: as before
    assert old.to_search() == "?layer=1&head=0&score=entropy&heads=1.2&ablate=mean&agg=group_max"


HOSTILE = ["-1", "", "٣", "３", "1e3", " 3", "3 ", "9" * 5000, "0x10", "1000000", "<b>", "%00", "null",
           "3&zoom=4"]


def test_bad_values_of_declared_fields_are_dropped_and_said(registry):
    declare_demo()
    bad = parse("?zoom=-1&shade=%3Cb%3E&result=xyz")
    assert (bad.zoom, bad.shade, bad.result) == (None, "light", None)
    assert bad.problems == ["The link's zoom '-1' is not a non-negative whole number.",
                            "The link's shade '<b>' is not one of: light, dark.",
                            "The link's result 'xyz' is not a valid id (8–64 hex digits)."]
    for value in HOSTILE:
        state = parse("?" + urlencode({"zoom": value, "shade": value, "result": value}))
        assert state.zoom is None and state.shade == "light" and state.result is None, value
        assert len(state.problems) == 3 and all(len(p) < 200 for p in state.problems), value


def test_a_readers_own_bug_leaves_the_link_open_without_the_field(registry):
    @page_part("buggy", readers={"odd": lambda text: 1 / 0})
    @dataclasses.dataclass
    class BuggyState:
        odd: int | None = None

    state = parse("?odd=1&layer=2")
    assert state.odd is None and state.layer == 2
    assert state.problems == ["The link's odd '1' could not be read; it is left out."]


def test_a_part_that_takes_a_name_or_misses_a_reader_fails_when_it_is_declared(registry):
    for name, fields_, readers, error in [
        ("attention", {"zoom": int}, {"zoom": read_whole_number}, ValueError),  # a part's name
        ("demo2", {"metric": str}, {"metric": read_one_of("a")}, ValueError),  # the Attention page's field
        ("demo3", {"layer": int}, {"layer": read_whole_number}, ValueError),  # a shared key
        ("demo4", {"sink": int}, {"sink": read_whole_number}, ValueError),  # drop_sink's URL key
        ("demo5", {"problems": int}, {"problems": read_whole_number}, ValueError),
        ("demo6", {"zoom": int}, {}, TypeError),  # no reader
        ("demo7", {"zoom": int}, {"zoom": read_whole_number, "pan": read_whole_number}, TypeError),
    ]:
        cls = dataclasses.make_dataclass(f"{name}State", [(f, t, dataclasses.field(default=None))
                                                          for f, t in fields_.items()])
        with pytest.raises(error):
            page_part(name, readers=readers)(cls)
    assert "demo6" not in url_state.PARTS and parse("?zoom=1").problems == []

"""A page declares its own URL fields, each with :func:`headscope.app.url_state.url_field`, in a part named after
the page (:func:`headscope.app.url_state.page_part`), in its own module: links then read, check and write them
with no list in ``url_state`` to edit, after the keys older links had (which keep their order:
tests/app/test_url_state.py, tests/app/test_url_state_fields.py)."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from urllib.parse import urlencode

import pytest

from headscope.app import url_state
from headscope.app.url_state import (
    OneOf,
    PageState,
    Pattern,
    StoredId,
    WholeNumber,
    page_part,
    parse,
    url_field,
)


def test_parts_are_named_after_their_pages():
    """``state.qk`` is the QK page's fields; a page whose name is also a field's (Heads, Patching, Compress)
    is ``state.part(page)``, and the flat name stays the field (the Ablation page's head list)."""
    pages = {p.stem for p in (pathlib.Path(url_state.__file__).parent / "pages").glob("*.py")}
    assert set(url_state.PARTS) <= pages
    assert {"attention", "flow", "heads", "qk", "ablation", "patching", "compare", "compress"} <= set(url_state.PARTS)
    state = parse("?heads=1.2&agg=group_mean&patching=0123456789abcdef&ppos=fedcba9876543210&compress=abcdef0123"
                  "&tol=5&method=umap")
    assert state.heads == "1.2" and state.part("ablation").heads == "1.2"
    assert state.part("heads").agg == "group_mean" and state.agg == "group_mean"
    assert (state.patching, state.part("patching").ppos) == ("0123456789abcdef", "fedcba9876543210")
    assert (state.compress, state.part("compress").tol) == ("abcdef0123", 5)
    assert state.qk is state.part("qk") and state.qk.method == "umap"
    state.part("heads").agg = "group_max"
    assert state.to_search().endswith("&agg=group_max&patching=0123456789abcdef&ppos=fedcba9876543210"
                                      "&compress=abcdef0123&tol=5")


OLDER = ["?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5&metric=first_token&query=7",
         "?layer=1&head=0&score=entropy&heads=1.2&ablate=mean&agg=group_max",
         "?model=smollm2-135m&sweep=0123456789abcdef&compress=fedcba9876543210&tol=10&pick=random%3A0.25%3A1"]


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is; what a test declares is gone after it."""
    for name in ("PARTS", "_FIELDS"):
        monkeypatch.setattr(url_state, name, dict(getattr(url_state, name)))


def test_a_new_part_declared_with_field_specs_needs_no_edit_to_url_state(registry):
    """A page declares its fields in its own module; url_state.py, unchanged, reads, checks and writes them,
    after the keys links already had, in the order declared."""
    @page_part("gallery")
    @dataclasses.dataclass
    class GalleryState:
        zoom: int | None = url_field(WholeNumber(high=8))
        shade: str = url_field(OneOf(("light", "dark")), "light")
        result: str | None = url_field(StoredId(), key="res")
        caption: str | None = url_field(Pattern(re.compile("[a-z]{1,10}"), "The link's caption {text} is not a word."))

    state = parse("?shade=dark&run=0123456789abcdef&zoom=3&layer=2&res=ABCDEF0123&caption=hi")
    assert state.part("gallery") == GalleryState(3, "dark", "abcdef0123", "hi") and state.gallery.zoom == 3
    assert (state.result, state.layer, state.problems) == ("abcdef0123", 2, [])
    assert state.to_search() == "?run=0123456789abcdef&layer=2&zoom=3&shade=dark&res=abcdef0123&caption=hi"
    assert PageState(zoom=4).to_search() == "?zoom=4" and PageState(shade="light").to_search() == ""
    bad = parse("?zoom=9&shade=%3Cb%3E&res=xyz&caption=Hi!")
    assert bad.part("gallery") == GalleryState() and bad.problems == [
        "The link's zoom 9 is more than 8; using the default.",
        "Unknown shade '<b>'; choose one of light, dark.",
        "The link's res id 'xyz' is not valid (8–64 hex digits).",
        "The link's caption 'Hi!' is not a word."]
    for search in OLDER:  # the older links are as they were
        assert parse(search).to_search() == search


def test_a_declaration_that_takes_a_name_or_lacks_a_kind_fails_when_it_is_made(registry):
    before = (dict(url_state.PARTS), dict(url_state._FIELDS))
    cases = [("attention", {"zoom": url_field(WholeNumber())}, ValueError),  # a part's name
             ("demo2", {"metric": url_field(WholeNumber())}, ValueError),  # the Attention page's field
             ("demo3", {"layer": url_field(WholeNumber())}, ValueError),  # a shared field
             ("demo4", {"sink": url_field(WholeNumber())}, ValueError),  # drop_sink's URL key
             ("demo5", {"zoom": url_field(WholeNumber(), key="layer")}, ValueError),  # a shared URL key
             ("demo6", {"problems": url_field(WholeNumber())}, ValueError),
             ("demo7", {"qk": url_field(WholeNumber())}, ValueError),  # would take state.qk from the QK page
             ("run", {"zoom": url_field(WholeNumber())}, ValueError),  # a part named like a shared field
             ("demo8", {"zoom": url_field(WholeNumber()), "pan": url_field(WholeNumber(), key="zoom")}, ValueError),
             ("demo9", {"zoom": dataclasses.field(default=None)}, TypeError)]  # no kind
    for name, declared, error in cases:
        cls = dataclasses.make_dataclass(f"{name}State", [(f, object, spec) for f, spec in declared.items()])
        with pytest.raises(error):
            page_part(name)(cls)
    with pytest.raises(TypeError):
        page_part("demo10")(type("NotADataclass", (), {}))
    assert (url_state.PARTS, url_state._FIELDS) == before and parse("?zoom=1").problems == []


def test_a_kinds_own_bug_leaves_the_link_open_without_the_field(registry):
    class Broken:
        def read(self, key, text):
            return 1 / 0

        def holds(self, value):
            return False

    @page_part("buggy")
    @dataclasses.dataclass
    class BuggyState:
        odd: int | None = url_field(Broken())

    state = parse("?odd=1&layer=2")
    assert state.odd is None and state.layer == 2
    assert state.problems == ["The link's odd '1' could not be read; it is left out."]


HOSTILE = ["-1", "", "٣", "３", "1e3", " 3", "3 ", "9" * 5000, "0x10", "1000000", "<b>", "%00", "null",
           "3&zoom=4", "3\n", "light\n", "abcdef0123\n"]


def test_bad_values_of_declared_fields_are_dropped_and_said(registry):
    @page_part("demo")
    @dataclasses.dataclass
    class DemoState:
        zoom: int | None = url_field(WholeNumber())
        shade: str = url_field(OneOf(("light", "dark")), "light")
        result: str | None = url_field(StoredId())

    bad = parse("?zoom=-1&shade=%3Cb%3E&result=xyz")
    assert (bad.zoom, bad.shade, bad.result) == (None, "light", None)
    assert bad.problems == ["The link's zoom '-1' is not a non-negative whole number.",
                            "Unknown shade '<b>'; choose one of light, dark.",
                            "The link's result id 'xyz' is not valid (8–64 hex digits)."]
    for value in HOSTILE:
        state = parse("?" + urlencode({"zoom": value, "shade": value, "result": value}))
        assert state.zoom is None and state.shade == "light" and state.result is None, value
        assert len(state.problems) == 3 and all(len(p) < 200 for p in state.problems), value

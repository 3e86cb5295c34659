"""Each URL field is declared once (key, kind, range or choices, default: :func:`headscope.app.url_state.url_field`);
reading a link, writing one and the order of its keys come from the declarations. Links written before keep
reading to the same state and writing the same bytes; no link, however hostile, makes ``parse`` raise or yields
a value outside its field's declared domain."""

from __future__ import annotations

from urllib.parse import quote, urlencode

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headscope.app import url_state
from headscope.app.url_state import (
    MAX_SEARCH,
    PageState,
    parse,
)

# Links as the app writes them today: each reads back to a state that writes the same bytes.
LINKS = [
    "?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5&metric=first_token&query=7",
    "?run=0123456789abcdef&target=4&fusion=max&sink=1",
    "?layer=1&head=0&score=evidence&stat=std&sink_size=2&window=16&sweep=00112233445566778899&trial=2&agg=group_max",
    "?layer=16&head=0&query=5&method=umap&colour=kind&feature=determiner&sentences=20&labels=abcdef0123456789"
    "&texts=0123456789abcdef&find=the",
    "?heads=12.3%2Ckv%3A14.1&ablate=mean&by=induction&k=5&seed=3&curve=aaaaaaaabbbbbbbb&hsweep=ccccccccdddddddd"
    "&source=eeeeeeeeffffffff&ref=0000000011111111&sweep=1234567812345678",
    "?run=0123456789abcdef&region=0-10%2C0-20",
    "?model=smollm2-135m&sweep=0123456789abcdef&compress=fedcba9876543210&tol=10&pick=random%3A0.25%3A1",
    "?layer=1&head=0&score=entropy&heads=1.2&ablate=mean&agg=group_max",
    "?model=smollm2-135m&run=0123456789abcdef&patching=0123456789abcdef&ppos=fedcba9876543210",
    "?model=smollm2-135m&first=0123456789abcdef&second=fedcba9876543210",
    "?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5",
    # every field at once, off its default: the whole key order
    "?model=smollm2-135m&run=00000001&layer=1&head=2&metric=first_token&query=3&target=4&fusion=max&sink=1"
    "&method=umap&colour=kind&feature=determiner&sentences=5&score=entropy&stat=std&sink_size=6&window=7"
    "&heads=1.2&ablate=mean&by=induction&k=8&seed=9&curve=00000002&hsweep=00000003&source=00000004&ref=00000005"
    "&labels=00000006&texts=00000007&find=cat&region=0-1%2C0-1&sweep=00000008&trial=10&agg=group_max"
    "&patching=00000009&ppos=0000000a&first=0000000b&second=0000000c&compress=0000000d&tol=11&pick=random%3A0.5",
    "",
]


@pytest.mark.parametrize("search", LINKS)
def test_every_link_the_app_writes_reads_back_and_is_written_byte_identical(search):
    state = parse(search)
    assert state.problems == []
    assert state.to_search() == search
    assert parse(state.to_search()) == state


# --- hostile links ---

DIGITS = ["٣", "３", "𝟑", "³", "①", "৩", "〇"]
NUMBERS = [*DIGITS, "9" * 5000, "1000000", "-1", "-0", "+1", "1e3", "0x1f", " 1", "1 ", "1\n", "", "1.0", "1_0",
           "\x00", "1\x00"]
WORDS = ["", " ", "\x00", "entropy ", " entropy", "ENTROPY", "__class__", "mean\x00", "<b>", "x" * 5000, "\n",
         "pca\n", "é", "\u200bpca", "ｐｃａ"]
IDS = ["0123456789abcdef\n", "0123456789abcdef\x00", " 0123456789abcdef", "0123456789ABCDEF", "0" * 65, "0" * 7,
       "０１２３４５６７", "g" * 8, "0123456789abcdef\r\n", "\u212a" * 8, "xyz"]
SHAPES = ["1.2\n", "1.2\x00", "<script>", "٣.١", "1." + "2" * 2000, "0-1,0-1\n", "0-1,0-1 ", "random:0.5\n",
          "a" * 41, "the\x7f", "x<y", "cat\n"]


def _hostile_links() -> list:
    links: list = []
    for f in url_state._FIELDS.values():
        for value in NUMBERS + WORDS + IDS + SHAPES:
            links.append("?" + urlencode({f.key: value}))
        links.append(f"?{f.key}=%ff%fe&{f.key}=1")  # bad UTF-8, then a repeat
    links += [
        "?layer=1&layer=2", "?layer=x&layer=2", "?layer=2&layer=x", "?" + "&".join(f"layer={i}" for i in range(50)),
        "?" + "&".join(f"k{i}=1" for i in range(50)), "?" + "&".join(f"k{i}=1" for i in range(51)),
        "?" + "&".join(f"{f.key}=1" for f in url_state._FIELDS.values()) + "&" + "&".join(f"x{i}=" for i in range(30)),
        "?layer=" + "1" * (MAX_SEARCH - 7), "?layer=" + "1" * MAX_SEARCH, "?\x00", "%00", "?run=%00%01",
        "?\ud800=1", "?layer=\ud800", "?run=%ud800", "?find=\ud800", "?find=a\udfff", "?feature=\ud800",
        "%", "%%%", "?&&&", "?=", "?===", "?layer=1;head=2",
        "?lаyer=1", "?LAYER=1", "?layer%00=1", "?tol=100", "?tol=101", "?tol=999999", "?model=../../etc/passwd",
        "?model=smollm2-135m%0A", "?model=%20smollm2-135m%20", "??layer=1", "?#layer=1", "?layer=1#head=2",
        "?sink=0", "?sink=TRUE", "?sink=1&sink=0", b"?layer=1", 3, ["?layer=1"], None, "?",
    ]
    return links


def _in_domain(state: PageState) -> list[str]:
    """The fields whose value is neither the default nor in the declared domain."""
    return [f.name for f in url_state._FIELDS.values()
            if getattr(state, f.name) != f.default and not f.kind.holds(getattr(state, f.name))]


def test_hostile_links_never_raise_and_never_yield_a_value_outside_its_field():
    links, held = _hostile_links(), []
    for search in links:
        state = parse(search)
        assert _in_domain(state) == [], (search[:80] if isinstance(search, str) else search, _in_domain(state))
        assert all(len(p) < 400 and "\x00" not in p for p in state.problems), state.problems
        again = parse(state.to_search())
        assert again.problems == [], (search, again.problems)
        assert again.to_search() == state.to_search()
        held.append(search)
    assert len(held) == len(links) > 2400
    print(f"{len(held)} hostile links held")
    assert parse("?layer=1&layer=2").layer == 1 and parse("?layer=x&layer=2").layer is None
    assert parse("?" + "&".join(f"k{i}=1" for i in range(51))).problems == [
        "The link's parameters could not be read; starting fresh."]
    assert parse("?run=0123456789abcdef%0A").run is None and parse("?heads=1.2%0A").heads is None
    assert parse("?model=%20smollm2-135m%20").model == "smollm2-135m"


_KEYS = st.sampled_from(sorted({f.key for f in url_state._FIELDS.values()}) + ["x", "lаyer", ""])
_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    NUMBERS + WORDS + IDS + SHAPES) | st.integers(-10, 10**12).map(str)
_QUERY = st.lists(st.tuples(_KEYS, _TEXT), max_size=60).map(
    lambda pairs: "?" + "&".join(f"{quote(k)}={quote(v, safe='', errors='surrogatepass')}" for k, v in pairs))


@settings(max_examples=400, deadline=None)
@given(st.one_of(_QUERY, st.text(st.characters(exclude_categories=()), max_size=300)))
def test_random_links_never_raise_and_never_yield_a_value_outside_its_field(search):
    state = parse(search)
    assert _in_domain(state) == []
    again = parse(state.to_search())
    assert again.problems == [] and again.to_search() == state.to_search()

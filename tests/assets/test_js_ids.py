"""No browser script names a component id by hand. Ids reach ``assets/*.js`` from the Python that lays the
components out (app/ids.py and the pages): in a holder's ``data-*`` attribute (a grid's click, the
Attention strip's heatmap) or as an argument of the clientside callback. A page that renames an id, or
a new page, then cannot leave a script looking for an element that is not there (a click that does
nothing, silently)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.app.registered_pages import registered_pages

ROOT = Path(__file__).resolve().parents[2]
COMMENT = re.compile(r"/\*.*?\*/|(?<![:\\\"'])//[^\n]*", re.S)
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|`(?:[^`\\]|\\.)*`')
REGEX = re.compile(r"(?<=[=(,:!&|?{};\s])/(?![/*\s])((?:[^/\\\n\[]|\\.|\[(?:[^\]\\\n]|\\.)*\])+)/([a-z]*)")


def app_ids() -> set[str]:
    pages = registered_pages()
    return set(pages["shell"]["ids"]).union(*(page["ids"] for page in pages["pages"]))


def named_by_hand(script: str, ids: set[str]) -> list[str]:
    """The ids ``script`` names in its code (not its comments): a string that is an id, holds one as a CSS
    selector (``#id``) or is a piece of the page-prefix scheme (``-hs-url``), and a regular expression that
    matches ids."""
    code = COMMENT.sub(" ", script)
    found = []
    for literal in STRING.findall(code):
        text = literal[1:-1]
        if text in ids or any(f"#{i}" in text for i in ids) or (
                len(text) > 3 and (text.startswith("-") or text.endswith("-")) and any(text in i for i in ids)):
            found.append(text)
    for body, flags in REGEX.findall(STRING.sub('""', code)):
        try:
            pattern = re.compile(body, re.I if "i" in flags else 0)
        except re.error:
            continue
        if any(pattern.search(i) for i in ids):
            found.append(f"/{body}/{flags}")
    return found


@pytest.fixture(scope="module")
def ids() -> set[str]:
    found = app_ids()
    assert {"hs-grid", "hs-abl-grid", "attn-hs-url", "attn-hs-run"} <= found  # the scan sees every page's ids
    return found


def test_no_script_names_a_component_id_by_hand(ids):
    scripts = sorted((ROOT / "assets").glob("*.js"))
    assert scripts
    by_hand = {path.name: named_by_hand(path.read_text(), ids) for path in scripts}
    print("\nids named by hand:", sum(map(len, by_hand.values())), {k: v for k, v in by_hand.items() if v})
    assert not any(by_hand.values()), {k: v for k, v in by_hand.items() if v}


def test_the_scan_finds_ids_however_a_script_writes_them():
    """The scan itself, on code that names ids in each way it looks for (and in comments, which it skips)."""
    ids = {"hs-grid", "cmp-hs-url", "hs-pat-status"}
    script = """/* "hs-grid" in a comment */ // "cmp-hs-url" too
        const A = "hs-grid", B = 'cmp-hs-url', C = `#hs-grid .nsewdrag`, D = prefix + "-hs-url";
        const S = /^hs-[a-z-]+-status$/; const ok = "hs-token-strip", div = a / b / c;"""
    assert named_by_hand(script, ids) == ["hs-grid", "cmp-hs-url", "#hs-grid .nsewdrag", "-hs-url",
                                          "/^hs-[a-z-]+-status$/"]
    assert named_by_hand("/* only 'hs-grid' here */ const x = 1;", ids) == []

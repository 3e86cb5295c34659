"""Component ids and page prefixes are unique: two pages sharing one made a page's callbacks fire on the
other (the Compress page drew into a missing figure when the Compare page's URL changed, because both
used the prefix ``cmp``, so one URL component id, and one status id was defined twice in ``app/ids.py``).
Read from the sources: a name assigned twice in a module keeps only its last value at run time."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def _constants(path: Path) -> list[tuple[str, str]]:
    """Every ``NAME = "string"`` at the top of a module, in order, repeats included."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name)]
    return out


def test_every_component_id_is_defined_once():
    found = _constants(APP / "ids.py")
    assert len(found) > 100
    names = collections.Counter(name for name, _ in found)
    values = collections.Counter(value for _, value in found)
    assert [n for n, c in names.items() if c > 1] == []
    assert [v for v, c in values.items() if c > 1] == []


def test_every_page_has_its_own_prefix():
    prefixes = {path.stem: dict(_constants(path))["PREFIX"] for path in sorted((APP / "pages").glob("*.py"))
                if "PREFIX" in dict(_constants(path))}
    assert len(prefixes) >= 8, prefixes
    assert len(set(prefixes.values())) == len(prefixes), prefixes

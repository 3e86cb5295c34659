"""The README's "From Python (notebooks)" example, as its text: run in this checkout by
tests/app/test_readme.py and against an installed wheel by tests/test_install.py."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def notebook_example() -> str:
    """The one fenced python block of the README section "From Python (notebooks)"."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## From Python \(notebooks\)\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## From Python (notebooks)' section"
    blocks = re.findall(r"^```python\n(.*?)^```", section[1], re.S | re.M)
    assert len(blocks) == 1, f"the section should hold one python block, found {len(blocks)}"
    return blocks[0]

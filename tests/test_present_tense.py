"""Docstrings and comments in analysis/, kernels/ and app/'s top-level modules say what is true now, and
the names they cite exist.

A bug's history (what the code used to do, which issue it was fixed in, how long it took before) belongs in
the commit message or in docs/decisions.md; a docstring that narrates it misleads the next reader about
what the code does now. A cross-reference (``:func:`name```) to a function that was renamed or moved
sends them nowhere. Both are checked statically (no module is imported), so this runs in the fast tier.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = sorted(p for folder in ("analysis", "kernels", "app") for p in (ROOT / folder).glob("*.py"))

#: Phrases that narrate history rather than state what is true.
HISTORY = {
    "used to": r"\bused to\b(?! (find|compute|draw|rank|build|pick|show|make|check|score|mask|ablate|store))",
    "no longer": r"\bno longer\b",
    "any more": r"\bany ?more\b",
    "previously / formerly": r"\b(previously|formerly|originally)\b",
    "was fixed": r"\b(was|were|got|been) fixed\b|\bfixed in\b|\bthe fix\b",
    "a commit": r"\b(before|after|since|in) commit\b|\bcommit [0-9a-f]{7,40}\b",
    "an issue number": r"(?<![\w/&])#\d+\b",
    "the old way": r"\b(the|its) old (way|definition|code|text|behaviou?r|version|path)\b|\bas before\b",
    "now ... instead": r"\bnow\b[^.]*\binstead\b",
    "seen once": r"\d\s*(ms|s|min)\s+seen\b|\bseen in CI\b|\bwent back\b",
}

#: Phrases above that read as history but state what is true now: (file, text it occurs in).
ALLOWED = {
    # the max-flow algorithm's own wording: a node that cannot reach the sink any longer is dropped
    ("analysis/flow.py", "no longer reaches the sink"),
    # a fork's semantics: the thread that owned a lock does not exist in the child
    ("analysis/fork_gate.py", "no longer exists"),
    # why the random control draws outside the top N: inside it, it would stop being a control
    ("analysis/ablation_curve.py", "would no longer be a control"),
}

ROLE = re.compile(r":(func|mod|class|meth|data|attr|exc|obj):`~?([A-Za-z_][\w.]*?)(?:\(\))?`")


def _texts(path: Path) -> list[tuple[int, str, str]]:
    """(line, its text, its text and the next line's) of every comment and docstring line in ``path``
    (a phrase may wrap onto the next line)."""
    source = path.read_text()
    texts = [(tok.start[0], tok.string.lstrip("#:").strip())
             for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                texts += [(first.lineno + i, line.strip()) for i, line in enumerate(first.value.value.split("\n"))]
    texts.sort()
    return [(line, text, f"{text} {texts[i + 1][1] if i + 1 < len(texts) else ''}")
            for i, (line, text) in enumerate(texts)]


def history_notes(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for line, own, text in _texts(path):
        for what, pattern in HISTORY.items():
            m = re.search(pattern, text, re.IGNORECASE)
            if m and m.start() < len(own) and not any(f == rel and allowed in text for f, allowed in ALLOWED):
                found.append(f"{rel}:{line}: {what}: {text.strip()[:120]}")
    return found


def test_history_phrases_are_found():
    """The scan finds what it looks for (so the test below cannot pass by finding nothing)."""
    for text, what in [("Nothing is memory-mapped any more", "any more"), ("stored (#16).", "an issue number"),
                       ("``topk > 16`` keeps the old way", "the old way"), ("(7-12 s seen)", "seen once"),
                       ("This used to leak a file", "used to"), ("fixed in 3b3eb98", "was fixed")]:
        assert re.search(HISTORY[what], text, re.IGNORECASE), (what, text)
    for text in ["as used to find retrieval heads", "plotly/dash#2369", "stored before this was a setting",
                 "the old record or the new one"]:
        assert not any(re.search(p, text, re.IGNORECASE) for p in HISTORY.values()), text


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docstrings_and_comments_say_what_is_true_now(path):
    notes = history_notes(path)
    assert not notes, "history belongs in the commit message or docs/decisions.md:\n" + "\n".join(notes)


# -- cross-references --------------------------------------------------------------------------------


def _module_file(dotted: str) -> Path | None:
    """The file of ``headscope.<dotted>`` (a module or a package), or None."""
    rel = Path(*dotted.split("."))
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _names(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Top-level names of a module, and the members of each class defined in it (nested ones too)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    classes: dict[str, set[str]] = {}

    def bound(stmt: ast.stmt) -> set[str]:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return {stmt.name}
        if isinstance(stmt, ast.Assign):
            return {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            return {stmt.target.id}
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            return {(a.asname or a.name).split(".")[0] for a in stmt.names}
        if isinstance(stmt, ast.If | ast.Try | ast.With):
            return {n for body in ast.iter_child_nodes(stmt) if isinstance(body, ast.stmt) for n in bound(body)}
        return set()

    for stmt in tree.body:
        top |= bound(stmt)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            members = set().union(*(bound(s) for s in node.body)) if node.body else set()
            classes.setdefault(node.name, set()).update(members)
    return top, classes


def _resolves(target: str, here: Path) -> bool:
    parts = target.split(".")
    if parts[0] == "headscope":
        for i in range(len(parts), 1, -1):
            path = _module_file(".".join(parts[1:i]))
            if path is not None:
                rest = parts[i:]
                break
        else:
            return False
    elif parts[0] in dir(builtins):
        return True
    else:
        path, rest = here, parts
    if not rest:
        return True
    top, classes = _names(path)
    if rest[0] not in top:
        # an unqualified method or attribute of a class of this module, or a class defined inside a function
        return path == here and len(rest) == 1 and (rest[0] in classes or any(rest[0] in m for m in classes.values()))
    return len(rest) == 1 or rest[0] not in classes or rest[1] in classes[rest[0]]


def stale_references(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{i}: {m.group(0)}"
            for i, line in enumerate(path.read_text().split("\n"), 1) for m in ROLE.finditer(line)
            if not _resolves(m.group(2), path)]


def test_a_stale_reference_is_found():
    """A reference to a name that is nowhere is caught; existing names of every kind are not."""
    here = ROOT / "analysis" / "store.py"
    assert not _resolves("headscope.analysis.store.no_such_function", here)
    assert not _resolves("no_such_function", here)
    assert not _resolves("headscope.analysis.no_such_module", here)
    for target in ["headscope.analysis.store", "headscope.analysis.store.Store", "headscope.analysis.store.Store.get",
                   "Store.put", "put", "note_read", "ValueError", "headscope.app.workers"]:
        assert _resolves(target, here), target


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cross_reference_names_something_that_exists(path):
    stale = stale_references(path)
    assert not stale, "these references name nothing:\n" + "\n".join(stale)

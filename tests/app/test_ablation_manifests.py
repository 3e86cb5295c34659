"""Ablation exports made before a change still rebuild the same figure after it.

The fixture under ``fixtures/ablation_manifests`` was made by its ``make_fixture.py`` with the code
of the commit that added it (before issue #15's ablation refactor): the manifests of an effects view
and of a top-k curve view, their rows and figures, and the stored curve record the curve manifest
names. Each manifest is rebuilt here with :func:`headscope.app.export.regenerate` and compared number by
number (relative 1e-5: a forward pass may differ in its last bits across thread counts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "ablation_manifests"


def _same(a, b, path="") -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, int | float) and isinstance(b, int | float), f"{path}: {a!r} != {b!r}"
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=2e-4), \
            f"{path}: {a!r} != {b!r}"
    elif isinstance(a, str) and isinstance(b, str) and _number(a) is not None and _number(b) is not None:
        _same(_number(a), _number(b), path)  # a loss in a hover's customdata, written out as text
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _number(s: str) -> float | None:
    """A number written as text (as float() reads it, without surrounding space), else None."""
    if s != s.strip() or not any(c.isdigit() for c in s):
        return None
    try:
        return float(s)
    except ValueError:
        return None


@pytest.fixture
def old_store(tmp_path, real_model):
    """A fresh store holding the curve record exactly as the old code stored it."""
    from headscope.analysis.store import Store
    from headscope.app import context
    from headscope.app.context import AppContext, set_context

    rec = json.loads((FIXTURE / "curve_record.json").read_text())
    store = Store(tmp_path / "home")
    store.put(rec["key"], rec["kind"], rec["meta"],
              {n: np.asarray(v, dtype=np.float64) for n, v in rec["arrays"].items()})
    before = context._context
    set_context(AppContext(store=store, default_model="smollm2-135m"))
    yield store
    context._context = before
    store.close()


@pytest.mark.parametrize("view", ["ablation_curve", "ablation_effects"])
def test_an_old_ablation_manifest_rebuilds_the_same_figure_and_rows(old_store, view):
    from headscope.app.export import read_manifest, regenerate

    man = read_manifest(FIXTURE / f"{view}.manifest.json")
    _, fig, rows = regenerate(man, old_store)
    _same(json.loads(json.dumps(rows)), json.loads((FIXTURE / f"{view}.rows.json").read_text()), "rows")
    _same(json.loads(fig.to_json()), json.loads((FIXTURE / f"{view}.figure.json").read_text()), "figure")

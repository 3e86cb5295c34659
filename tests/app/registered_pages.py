"""The app's pages as ``dash.page_registry`` holds them once the app is created, with what each page's
layout holds: for tests that must cover every page without naming one (the fuzzer, the grid and id checks).

In a process of its own: creating the app registers the pages and their callbacks, which the calling
process may do with other settings (or may have done already)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LIST_PAGES = r"""
import json, os, sys
from pathlib import Path

import dash

from headscope.analysis.store import Store
from headscope.app.context import AppContext
from headscope.app.server import create_app
from tests.app.browsing import layout_props

app = create_app(AppContext(store=Store(Path(os.environ["HEADSCOPE_HOME"]) / "store")))


def described(layout):
    props = layout_props(layout)
    return {"ids": sorted({p["id"] for p in props if isinstance(p.get("id"), str)}),
            "clicks": [json.loads(p["data-hs-click"]) for p in props if "data-hs-click" in p]}


pages = []
for page in dash.page_registry.values():
    layout = page["layout"]
    pages.append({"path": page["path"], "module": page["module"], "name": page["name"],
                  "prefix": getattr(sys.modules[page["module"]], "PREFIX", None),
                  **described(layout() if callable(layout) else layout)})
print(json.dumps({"shell": described(app.layout), "pages": pages}))
"""


@functools.cache
def registered_pages() -> dict:
    """``{"shell": {...}, "pages": [{"path", "module", "name", "prefix", "ids", "clicks"}, ...]}``: every
    registered page (the 404 page too) with the string ids of its layout's components and the head
    clicks its grids declare (``data-hs-click``); the shell's the same. Created once per test process,
    in an empty home of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_MODELS"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as home:
        # the checkout on the path for tests.app.browsing.layout_props; the empty home as the working folder
        root = str(Path(__file__).resolve().parents[2])
        out = subprocess.run([sys.executable, "-c", LIST_PAGES], capture_output=True, text=True, timeout=600,
                             env={**env, "HEADSCOPE_HOME": home, "PYTHONPATH": root}, cwd=home)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])

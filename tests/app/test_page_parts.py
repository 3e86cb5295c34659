"""A page's parts come from its own modules, not from lists kept elsewhere: its views from its module in
``app/views/`` (the package imports every module it holds), its clickable grids from its layout
(``data-hs-click``, :func:`headscope.app.grid_clicks.head_clicks`). Its URL fields:
tests/app/test_url_state_parts.py; its fuzzing: tests/app/test_fuzz_callbacks.py; its ids in the browser:
tests/assets/test_js_ids.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from headscope.app import figures
from tests.app.registered_pages import registered_pages

NEW_VIEWS_MODULE = '''
import plotly.graph_objects as go

from headscope.app.views.registry import register


@register("a_new_pages_view", "A view of a page added after the registry", params=("layer",),
          from_state=lambda state, query, variant: {"layer": state.layer}, needs_run=False)
def a_new_pages_view(run, params):
    return go.Figure(), [{"layer": params["layer"]}]
'''

IMPORT_VIEWS_WITH_ANOTHER_FOLDER = '''
import importlib.util, json, sys

spec = importlib.util.find_spec("headscope.app.views")
spec.submodule_search_locations.append(sys.argv[1])  # the package as if the new module were in app/views/
package = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = package
spec.loader.exec_module(package)
view = package.VIEWS["a_new_pages_view"]
print(json.dumps({"views": sorted(package.VIEWS), "built": view.build(None, {"layer": 3})[1]}))
'''


def test_a_new_views_module_registers_its_views_without_being_listed(tmp_path):
    """``headscope figure``, the exports and the manifests find a new page's views by importing
    ``headscope.app.views``: a module put in the package is imported with it, named nowhere else."""
    folder = tmp_path / "more_views"
    folder.mkdir()
    (folder / "a_new_page.py").write_text(textwrap.dedent(NEW_VIEWS_MODULE))
    out = subprocess.run([sys.executable, "-c", IMPORT_VIEWS_WITH_ANOTHER_FOLDER, str(folder)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["built"] == [{"layer": 3}]
    assert {"attention", "head_grid", "a_new_pages_view"} <= set(found["views"])  # the old views too


@pytest.fixture(scope="module")
def pages() -> list[dict]:
    return registered_pages()["pages"]


IDS_OF = {"select": ("graph", "url"), "toggle": ("graph", "pending", "box"), "ask": ("graph", "store")}


def test_every_clickable_grid_names_components_of_its_own_page(pages):
    """What a grid's holder declares is what the browser acts on: each id it names is a component of
    the same page's layout (a renamed or missing id would make the click do nothing, silently)."""
    declared = 0
    for page in pages:
        for spec in page["clicks"]:
            declared += 1
            assert spec.get("do") in IDS_OF, (page["module"], spec)
            missing = [spec.get(key) for key in IDS_OF[spec["do"]] if spec.get(key) not in page["ids"]]
            assert not missing, f"{page['module']}: {spec['do']} names {missing}, not on the page"
            if spec["do"] == "toggle":
                assert spec["marks"] == figures.CHOSEN_TRACE
            if spec["do"] == "select":
                assert all(isinstance(k, str) for k in spec["drop"]) and all(
                    isinstance(v, list) for v in spec["when"].values())
    # every page that draws a layer × head map to choose heads on declares it: Attention, Heads (two),
    # QK, Ablation, Patching, Compare
    assert declared >= 7, [(p["module"], p["clicks"]) for p in pages]

"""app/views/registry.py and names.py: every view is registered once under its constant name,
declares its parameters and how a page's URL state gives them; names in manifests and export
buttons resolve; the registry imports none of the view modules (no import circle)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from dash.exceptions import PreventUpdate

from headscope.app.export_bar import view_params
from headscope.app.url_state import PageState, parse
from headscope.app.views import VIEWS, names

ROOT = Path(__file__).resolve().parents[3]
STATE = PageState(model="smollm2-135m", run="abc", layer=3, head=2, metric="first_token", query=4, target=5,
                  fusion="max", drop_sink=True, sweep="sw", agg="group_max", heads="1.2", curve="cv")


def test_every_name_is_a_registered_view_and_every_view_has_a_name():
    constants = {v for k, v in vars(names).items() if k.isupper()}
    assert constants == set(VIEWS)
    assert all(VIEWS[n].name == n and VIEWS[n].title for n in VIEWS)


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_every_view_declares_its_parameters_and_the_page_state_gives_them(name):
    view = VIEWS[name]
    assert isinstance(view.params, tuple) and callable(view.from_state)
    given = view.from_state(STATE, None, "rollout")
    missing = set(view.params) - set(given)
    assert not missing, f"{name}: the page state does not give {sorted(missing)}"
    # the export callback exports what the page draws (a button may name a variant: relevance:rollout)
    assert view_params(names.variant(name, "rollout"), STATE) == given


def test_view_params_are_what_the_page_shows():
    """The parameters of a few views, written out: a change to them changes what exports record."""
    assert view_params(names.HEAD_GRID, STATE) == {"metric": "first_token", "layer": 3, "head": 2}
    assert view_params(names.TOKEN_STRIP, STATE, query=7) == {"layer": 3, "head": 2, "query": 7, "region": None}
    assert view_params(names.TOKEN_STRIP, STATE) == {"layer": 3, "head": 2, "query": 4, "region": None}
    assert view_params(names.variant(names.RELEVANCE, "flow"), STATE) == {
        "target": 5, "fusion": "max", "drop_sink": True, "method": "flow"}
    assert view_params(names.FAITHFULNESS_SET, STATE) == {"fusion": "max", "drop_sink": True, "_compute": False}
    assert view_params(names.SINK_MAP, STATE) == {}
    assert view_params(names.RETRIEVAL_GRID, STATE)["agg"] == "group_max"
    assert view_params(names.ABLATION_CURVE, STATE)["curve"] == "cv"
    assert view_params(names.QK_RANK_MAP, STATE)["model"] == "smollm2-135m"
    with pytest.raises(PreventUpdate):
        view_params("no_such_view", parse(""))


def test_view_names_in_stored_manifests_resolve():
    fixtures = ROOT / "tests" / "app" / "fixtures" / "ablation_manifests"
    manifests = sorted(fixtures.glob("*.manifest.json"))
    assert manifests
    for path in manifests:
        view = json.loads(path.read_text())["view"]
        assert view in VIEWS and VIEWS[view].name == view, path.name


def test_the_registry_imports_no_view_module():
    """Each view module imports the registry; were the registry to import them back, they would form
    an import circle (as app/views.py once did, importing its plug-ins at its last line)."""
    tree = ast.parse((ROOT / "app" / "views" / "registry.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith("headscope.app.")}, imported
    for module in ("attention", "flow", "heads", "ablation", "qk"):
        tree = ast.parse((ROOT / "app" / "views" / f"{module}.py").read_text())
        assert not any(isinstance(n, ast.ImportFrom) and n.module == "headscope.app.views"
                       and any(a.name == "VIEWS" for a in n.names) for n in ast.walk(tree)), module

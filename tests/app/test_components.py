"""The pieces every page shares: the run bar (app/run_bar.py), the page shell (app/page_shell.py)."""

import pytest

from headscope.analysis.capture import capture
from headscope.app import run_bar


def _texts(div) -> list[str]:
    return [child.children for child in div.children]


def test_run_info_says_the_models_bos_and_template_policy(tiny_model):
    run = capture(tiny_model, "The cat sat on the mat.", pattern_dtype="float32")
    policy = tiny_model.facts.prompt_policy
    texts = _texts(run_bar.run_info(run, 1, 2, policy))
    assert policy in texts and f"run {run.short_id}" in texts and "selected: layer 1, head 2" in texts
    assert f"{run.n_tokens} tokens" in texts
    assert not any("BOS" in t for t in _texts(run_bar.run_info(run, 0, 0, "")))  # unknown: not claimed


def test_prompt_policy_of_a_model_this_server_does_not_offer_is_not_claimed():
    assert run_bar.prompt_policy("/nowhere/not-a-model") == ""


def _into_shell_on_page_load(deps: list[dict]) -> list[list[str]]:
    """The outputs of each background callback (a forked job, or a Celery task) in the served
    dependencies ``deps`` that Dash calls on every page load: it has ``prevent_initial_call`` and
    writes to the app shell (the error banner, the download)."""
    from headscope.app import ids

    shell = {ids.ERROR, ids.DOWNLOAD}
    into_shell = []
    for d in deps:
        outputs = {p.rpartition(".")[0].split("@")[0] for p in d["output"].strip(".").split("...")}
        if d.get("background") and d["prevent_initial_call"] and outputs & shell:
            into_shell.append(sorted(outputs))
    return into_shell


# Prints the app's served dependencies: run in a fresh process, where the pages register their
# callbacks as this environment says (the pages are imported once per process).
_DEPENDENCIES = """
import json, sys, tempfile
from pathlib import Path
from headscope.analysis.store import Store
from headscope.app.context import AppContext
from headscope.app.server import create_app
app = create_app(AppContext(store=Store(Path(tempfile.mkdtemp()) / "store")))
client = app.server.test_client()
client.get("/")
sys.stdout.write(client.get("/_dash-dependencies").get_data(as_text=True))
"""


def test_no_background_job_starts_when_a_page_loads(tmp_path):
    """A background callback (a forked job, or a Celery task) that writes to the app shell (the error
    banner, the download) is called by Dash whenever its page loads, whatever ``prevent_initial_call``
    says: its inputs and outputs are not in one layout chunk (plotly/dash#2369). Each page load then
    forked a job, and the page's Run button stayed disabled until that job came back (7-12 s seen),
    so a click right after the page appeared was lost. Jobs write their errors into their own page,
    which copies them into the banner in the browser. (The QK page's job draws a linked head on
    landing: it is called on load on purpose.)"""
    import json

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    app = create_app(AppContext(store=Store(tmp_path / "store")))
    client = app.server.test_client()
    client.get("/")
    deps = json.loads(client.get("/_dash-dependencies").data)
    assert len([d for d in deps if d.get("background")]) >= 10
    assert _into_shell_on_page_load(deps) == []


@pytest.mark.slow  # a process that builds the app with Celery
def test_no_job_is_queued_when_a_page_loads_with_redis_workers(tmp_path):
    """With ``HEADSCOPE_REDIS_URL`` every expensive callback (:func:`headscope.app.jobs.on_workers`: it loads a
    model or reads results) is a Celery task too: one that wrote to the app shell was queued on every
    page load, as above (each page's export, Run on the Ablation and Flow pages, the sink map, the
    heads chosen, the faithfulness input, the KV pattern download). They write into their page
    (:func:`headscope.app.page_shell.job_error`, :func:`headscope.app.page_shell.page_download`). The app is made as the
    web process makes it (Redis is not reached until a job runs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HEADSCOPE_REDIS_URL": "redis://127.0.0.1:9/0", "HEADSCOPE_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _DEPENDENCIES], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    deps = json.loads(out.stdout)
    background = [d for d in deps if d.get("background")]
    assert len(background) >= 30  # the page callbacks are tasks too
    assert _into_shell_on_page_load(deps) == []


def test_a_link_naming_a_model_has_it_chosen_from_the_first_frame(tmp_path, monkeypatch):
    """A link with ``model=`` draws the page with that model already in the menu: set later by the
    page's render, a Run pressed at once ran the server's default model instead (seen in Chromium once
    Run was enabled at page load). A model the server does not offer is not put in the menu."""
    import dash

    import headscope.app.context
    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    monkeypatch.setattr(headscope.app.context, "_context", headscope.app.context._context)  # restored after the test
    # the pages as Dash loads them (importing app.pages.* here would register their callbacks twice)
    create_app(AppContext(store=Store(tmp_path / "store"), default_model="smollm2-135m",
                          extra_models=["/models/tiny-qwen3"]))
    layouts = {p["module"].rpartition(".")[2]: p["layout"] for p in dash.page_registry.values()}

    def chosen(layout, prefix):
        found = []

        def walk(node):
            if getattr(node, "id", None) == run_bar.model_id(prefix):
                found.append(node.value)
            children = getattr(node, "children", None)
            for child in children if isinstance(children, list) else [children]:
                if hasattr(child, "to_plotly_json"):
                    walk(child)
        walk(layout)
        return found

    for name, prefix in (("attention", "attn"), ("ablation", "abl"), ("flow", "flow")):
        layout = layouts[name]
        assert chosen(layout(model="/models/tiny-qwen3"), prefix) == ["/models/tiny-qwen3"]
        assert chosen(layout(), prefix) == ["smollm2-135m"]
        assert chosen(layout(model="/etc/passwd"), prefix) == ["smollm2-135m"]


def test_a_page_knows_it_is_being_left_from_its_own_location_path():
    """Every page's Location hears a nav link, so the page being left sees another page's path there
    while the router fetches that page (headscope.app.page_shell.leaving); its own path, with or without a
    trailing slash, and no path yet, are not leaving."""
    from headscope.app.page_shell import leaving

    assert leaving("/flow", "/") and leaving("/ablation", "/flow") and leaving("/", "/flow")
    assert not leaving("/", "/") and not leaving("/flow/", "/flow") and not leaving("/flow", "/flow")
    assert not leaving(None, "/") and not leaving(["/flow"], "/")


def test_the_settings_a_new_text_keeps_are_those_each_pages_after_run_carries_over(tmp_path):
    """A Run's URL change keeps the user's meanwhile changes to the settings in its ``keeps`` (the page's
    ``KEPT_ON_RUN``) and drops everything else of the old text: the list must be exactly what the page's
    ``_after_run`` carries over, or a new text would keep an old text's query (or lose a setting)."""
    import sys
    from types import SimpleNamespace

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path / "store")))  # the pages register with an app
    ablation, attention, flow = (sys.modules[f"pages.{name}"] for name in ("ablation", "attention", "flow"))  # as Dash loaded them: an import of headscope.app.pages.* would register each page again
    from headscope.app.url_state import parse

    model = SimpleNamespace(name="smollm2-135m", n_layers=30, n_heads=9)
    run = SimpleNamespace(key="0123456789abcdef" * 2)
    old = {  # every key each page has, at a value that is not its default
        ablation: "?heads=3.1&ablate=uniform&by=first_token&sweep=abcdef12&ref=abcdef12&source=abcdef12&k=4&seed=2"
                  "&curve=abcdef12&hsweep=abcdef12&query=3&layer=2&head=1",
        attention: "?layer=2&head=1&metric=first_token&query=3&region=0-10",
        flow: "?fusion=max&sink=1&target=4&layer=2&head=1",
    }
    kept = {ablation: ablation.KEPT_ON_RUN, attention: attention.KEPT_ON_RUN, flow: flow.KEPT_ON_RUN}
    for page, search in old.items():
        after = page._after_run(parse(search), model, run).to_search()
        carried = set(parse_qs_keys(after)) - {"model", "run"}
        assert carried == set(kept[page]), (page.__name__, carried)


def parse_qs_keys(search: str) -> list[str]:
    from urllib.parse import parse_qs

    return list(parse_qs(search.lstrip("?")))

import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.app.export import PLOTLYJS_NAME, bundle, plotlyjs, read_manifest, regenerate, write_files
from headscope.app.views import VIEWS

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture
def run(tiny_model, store):
    return capture(tiny_model, "Tokens like <script>alert(1)</script> stay text.", store=store)


def test_views_check_heads(run):
    with pytest.raises(InputError, match="Layer 2 is out of range"):
        VIEWS["attention"].build(run, {"layer": 2, "head": 0})
    with pytest.raises(InputError, match="Head 4 is out of range"):
        VIEWS["attention"].build(run, {"layer": 0, "head": 4})
    with pytest.raises(InputError, match="whole numbers"):
        VIEWS["attention"].build(run, {"layer": "x", "head": 0})


def test_attention_data_rows_are_the_pattern(run):
    _fig, rows = VIEWS["attention"].build(run, {"layer": 1, "head": 3})
    n = run.n_tokens
    assert len(rows) == n * (n + 1) // 2
    r = rows[-1]
    assert (r["query_pos"], r["key_pos"]) == (n - 1, n - 1)
    assert r["weight"] == pytest.approx(float(run.patterns[1, 3, n - 1, n - 1]))


def test_token_labels_are_escaped(run):
    fig, _ = VIEWS["attention"].build(run, {"layer": 0, "head": 0})
    labels = " ".join(fig.data[0].x)
    assert "<" not in labels and "&lt;" in labels  # "<script>" tokenises into pieces, each escaped


@pytest.mark.parametrize("fmt", [pytest.param("svg", marks=pytest.mark.browser), "html", "csv", "json"])  # svg: kaleido's Chromium
def test_bundle_has_figure_data_and_manifest(run, fmt):
    name, data = bundle(run, "attention", {"layer": 1, "head": 2}, fmt)
    assert name.endswith(f"-{fmt}.zip")
    z = zipfile.ZipFile(io.BytesIO(data))
    names = set(z.namelist())
    assert {"data.csv", "data.json", "manifest.json"} <= names
    assert PLOTLYJS_NAME not in names  # one figure per zip: an html page carries its own library
    manifest = json.loads(z.read("manifest.json"))
    assert manifest["token_ids"] == run.token_ids and manifest["model"]["digest"] == run.model_digest
    assert manifest["params"] == {"layer": 1, "head": 2} and manifest["view"] == "attention"
    if fmt == "svg":
        svg = z.read("attention.svg").decode()
        assert svg.lstrip().startswith(("<svg", "<?xml")) and "layer 1, head 2" in svg
    if fmt == "html":
        page = z.read("attention.html").decode()
        assert "<script>alert(1)</script>" not in page  # tokens are text, not markup
        assert plotlyjs().decode() in page and not re.findall(r"<script[^>]*\bsrc=", page)  # standalone


@pytest.mark.browser  # kaleido's Chromium
def test_png_and_pdf_are_real_images(run):
    for fmt, magic in (("png", b"\x89PNG"), ("pdf", b"%PDF")):
        _, data = bundle(run, "head_grid", {"metric": "entropy"}, fmt)
        z = zipfile.ZipFile(io.BytesIO(data))
        assert z.read(f"head_grid.{fmt}")[:4] == magic


def test_manifest_regenerates_the_same_figure(run, store, tmp_path, monkeypatch):
    # The tiny random model is built in-process, not loadable by spec: hand it to regenerate().
    monkeypatch.setattr("headscope.app.export.load_model", lambda spec, device="cpu": _tiny(spec))
    _, data = bundle(run, "head_grid", {"metric": "previous_token", "layer": 1, "head": 0}, "json")
    path = tmp_path / "manifest.json"
    path.write_bytes(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    # not on offer by its name: named as `headscope figure --model` names it, on the command line
    again, fig, rows = regenerate(read_manifest(path), store=store, model=run.model_name)
    assert again.key == run.key
    original, _ = VIEWS["head_grid"].build(run, {"metric": "previous_token", "layer": 1, "head": 0})
    assert fig.to_json() == original.to_json()


_TINY = {}


def _tiny(spec):
    return _TINY[spec]


@pytest.fixture(autouse=True)
def _register_tiny(tiny_model):
    _TINY[tiny_model.name] = tiny_model


def test_bad_manifests_are_explained(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        read_manifest(bad)
    bad.write_text(json.dumps({"view": "attention"}))
    with pytest.raises(InputError, match="missing"):
        read_manifest(bad)
    with pytest.raises(InputError, match="Cannot read"):
        read_manifest(tmp_path / "absent.json")


# --- HTML pages open offline, sharing one copy of the plotting library ------------------------------


@pytest.fixture(scope="module")
def offline_page():
    """Open a local file in real Chromium with the network off; return what the page shows."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)

        def open_page(path: Path) -> dict:
            context = browser.new_context(offline=True)
            page = context.new_page()
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(path.resolve().as_uri())
            page.wait_for_load_state("load")
            try:
                page.wait_for_selector(".plotly .main-svg", timeout=15_000)
            except Exception:  # no plot: report what the page shows instead
                pass
            shown = {
                "plotly": page.evaluate("typeof window.Plotly"),
                "plots": page.locator(".plotly .main-svg").count(),
                "title": page.locator(".plotly .gtitle").all_text_contents(),
                "missing_notice": page.locator("#headscope-missing-plotlyjs").is_visible(),
                "text": page.inner_text("body"),
                "remote": [u for u in requests if not u.startswith(("file:", "data:", "blob:"))],
            }
            context.close()
            return shown

        yield open_page
        browser.close()



@pytest.mark.browser
def test_html_from_a_bundle_opens_offline_on_its_own(run, tmp_path, offline_page):
    _, data = bundle(run, "attention", {"layer": 1, "head": 2}, "html")
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path / "unzipped")
    # What a zip viewer does when a user double-clicks the page inside the zip: only that file.
    alone = tmp_path / "alone" / "attention.html"
    alone.parent.mkdir()
    alone.write_bytes(zipfile.ZipFile(io.BytesIO(data)).read("attention.html"))
    for page in (tmp_path / "unzipped" / "attention.html", alone):
        shown = offline_page(page)
        assert shown["plotly"] == "object" and shown["plots"] >= 1, shown["text"][:300]
        assert shown["title"] == ["Attention of layer 1, head 2"] and shown["remote"] == []


@pytest.mark.browser
def test_folder_page_copied_without_its_library_says_so(run, tmp_path, offline_page):
    write_files(run, "attention", {"layer": 1, "head": 2}, tmp_path / "out", ("html",))
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "attention.html").write_bytes((tmp_path / "out" / "attention.html").read_bytes())
    shown = offline_page(tmp_path / "copied" / "attention.html")
    assert shown["plots"] == 0 and shown["missing_notice"]
    assert "This figure needs plotly.min.js" in shown["text"] and "copy the whole folder" in shown["text"]
    shown = offline_page(tmp_path / "out" / "attention.html")  # in its folder: drawn, notice hidden
    assert shown["plots"] >= 1 and not shown["missing_notice"]


@pytest.mark.browser
def test_subfolders_share_one_library(run, tmp_path, offline_page):
    out = tmp_path / "scan"
    shared = out / PLOTLYJS_NAME
    write_files(run, "head_grid", {"metric": "entropy"}, out, ("html",))
    for metric in ("previous_token", "first_token"):
        write_files(run, "head_grid", {"metric": metric}, out / metric, ("html",), plotlyjs_path=shared)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.js")) == [PLOTLYJS_NAME]
    pages = sorted(out.rglob("*.html"))
    assert len(pages) == 3 and all(p.stat().st_size < 100_000 for p in pages)
    shown = offline_page(out / "previous_token" / "head_grid.html")  # loads ../plotly.min.js
    assert shown["plotly"] == "object" and shown["plots"] >= 1 and shown["remote"] == []
    assert shown["title"] == ["Previous-token attention per head"]


@pytest.mark.browser
@pytest.mark.integration
def test_cli_output_folder_opens_offline(tmp_path, offline_page):
    out = tmp_path / "out"
    env = {**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "headscope.app.cli", "run", "The cat sat on the mat.", "--formats", "svg,html",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / PLOTLYJS_NAME).read_bytes() == plotlyjs()
    assert (out / "head_grid.html").stat().st_size < 100_000
    shown = offline_page(out / "head_grid.html")
    assert shown["plotly"] == "object" and shown["plots"] >= 1 and shown["remote"] == []
    assert shown["title"] and shown["title"][0].startswith("Normalised entropy")

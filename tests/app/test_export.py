import io
import json
import zipfile

import pytest

from analysis.capture import InputError, capture
from app.export import bundle, read_manifest, regenerate
from app.views import VIEWS


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


@pytest.mark.parametrize("fmt", ["svg", "html", "csv", "json"])
def test_bundle_has_figure_data_and_manifest(run, fmt):
    name, data = bundle(run, "attention", {"layer": 1, "head": 2}, fmt)
    assert name.endswith(f"-{fmt}.zip")
    z = zipfile.ZipFile(io.BytesIO(data))
    names = set(z.namelist())
    assert {"data.csv", "data.json", "manifest.json"} <= names
    manifest = json.loads(z.read("manifest.json"))
    assert manifest["token_ids"] == run.token_ids and manifest["model"]["digest"] == run.model_digest
    assert manifest["params"] == {"layer": 1, "head": 2} and manifest["view"] == "attention"
    if fmt == "svg":
        svg = z.read("attention.svg").decode()
        assert svg.lstrip().startswith(("<svg", "<?xml")) and "layer 1, head 2" in svg
    if fmt == "html":
        page = z.read("attention.html").decode()
        assert "<script>alert(1)</script>" not in page  # tokens are text, not markup
        assert "cdn" not in page.split("<body>")[0].lower() or "plotly.js" in page


def test_png_and_pdf_are_real_images(run):
    for fmt, magic in (("png", b"\x89PNG"), ("pdf", b"%PDF")):
        _, data = bundle(run, "head_grid", {"metric": "entropy"}, fmt)
        z = zipfile.ZipFile(io.BytesIO(data))
        assert z.read(f"head_grid.{fmt}")[:4] == magic


def test_manifest_regenerates_the_same_figure(run, store, tmp_path, monkeypatch):
    # The tiny random model is built in-process, not loadable by spec: hand it to regenerate().
    monkeypatch.setattr("app.export.load_model", lambda spec, device="cpu": _tiny(spec))
    _, data = bundle(run, "head_grid", {"metric": "previous_token", "layer": 1, "head": 0}, "json")
    path = tmp_path / "manifest.json"
    path.write_bytes(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    again, fig, rows = regenerate(read_manifest(path), store=store)
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

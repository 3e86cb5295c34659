"""Export bundles: a figure (PNG, SVG, PDF or HTML), its data (CSV, JSON) and a manifest.

HTML figures written into an output folder (:func:`write_files`: ``headscope run``, ``scan``,
``ablate``, ``figure``) share one copy of the plotting library, ``plotly.min.js`` (about 4.6 MB),
written beside them and referenced by a relative path: a scan's fifteen figures cost one copy, not
fifteen, and the pages still open offline (no CDN). A page copied out of its folder without that
file says so instead of staying blank. The app's download (:func:`bundle`) holds one figure, so its
HTML page stays standalone, library inlined: sharing would save nothing in a one-figure zip
(deflate already shrinks it to about 1.5 MB), and the page opens even when a user double-clicks it
inside the zip viewer or copies it out alone.

The manifest names the model and its digest, the token ids, the capture settings, the view and its
parameters, and the headscope version; ``headscope figure manifest.json`` rebuilds the same figure
from it (recomputing the run, or loading it from the store).
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import threading
import warnings
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import quote

import plotly.graph_objects as go
import plotly.io as pio

from analysis.capture import capture
from analysis.errors import InputError
from analysis.models import load_model
from analysis.runs import AttentionRun
from analysis.store import Store
from app.export_formats import DATA_FORMATS, FIGURE_FORMATS, FORMATS, IMAGE_FORMATS  # noqa: F401 (also read from here)
from app.manifest_schema import ManifestError, read_manifest_file
from app.views import VIEWS, Rows

MANIFEST_VERSION = 1
PLOTLYJS_NAME = "plotly.min.js"  # the shared copy of the plotting library beside exported HTML pages


def headscope_version() -> str:
    try:
        return version("headscope")
    except PackageNotFoundError:
        return "0+unknown"


def manifest(run: AttentionRun | None, view: str, params: dict[str, Any]) -> dict[str, Any]:
    """What rebuilds a figure. Views drawn from a probe set rather than a run have no token ids."""
    if run is None:
        from analysis.models import load_model

        model = load_model(params["model"])
        model_info, run_info = {"name": model.name, "digest": model.digest}, {}
    else:
        model_info = {"name": run.model_name, "digest": run.model_digest}
        run_info = {"run_key": run.key, "token_ids": run.token_ids, "tokens": run.tokens, "settings": run.settings}
    return {
        "manifest_version": MANIFEST_VERSION,
        "headscope_version": headscope_version(),
        "view": view,
        "params": params,
        "model": model_info,
        "token_ids": [],
        "settings": {},
        **run_info,
    }


def rows_to_csv(rows: Rows) -> str:
    buf = io.StringIO()
    if rows:
        # Some views put a few summary rows (e.g. a query's top keys) above their main table.
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(buf, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


_kaleido_lock = threading.Lock()
_kaleido_started = False


def _start_kaleido() -> None:
    """Keep one headless Chromium for image exports (3.5 s per image otherwise)."""
    global _kaleido_started
    if _kaleido_started:
        return
    import kaleido

    try:
        kaleido.start_sync_server(silence_warnings=True)
    except Exception:  # already running in this process
        pass
    _kaleido_started = True


def plotlyjs() -> bytes:
    """The plotting library (plotly.js, minified) that exported HTML pages load, as bytes."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


def write_plotlyjs(path: Path) -> Path:
    """Write :func:`plotlyjs` to ``path`` unless the same bytes are already there; return ``path``.

    Written to a temporary name and renamed, so a page never finds half a library (two exports
    writing into one folder at once both leave the whole file)."""
    path = Path(path)
    js = plotlyjs()
    if path.is_file() and path.stat().st_size == len(js) and path.read_bytes() == js:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(js)
    os.replace(tmp, path)
    return path


_MISSING_LIBRARY = """
<div id="headscope-missing-plotlyjs" hidden style="font: 15px system-ui, sans-serif; margin: 2em; max-width: 44em">
  <p><b>This figure needs {src}</b>, the plotting library headscope wrote beside this page.
  Keep the page and that file together (copy the whole folder), then open this page again.</p>
</div>
<script>if (!window.Plotly) document.getElementById("headscope-missing-plotlyjs").hidden = false;</script>
"""


def figure_bytes(fig: go.Figure, fmt: str, *, plotlyjs_src: str | None = None) -> bytes:
    """One figure rendered as ``fmt``: png, svg or pdf (via kaleido + Chromium), or html.

    Parameters
    ----------
    fig : the figure.
    fmt : one of :data:`FIGURE_FORMATS`.
    plotlyjs_src : html only. ``None`` (default): a standalone page with the plotting library
        inlined (about 4.8 MB). A relative path such as ``"plotly.min.js"``: the page loads the
        library from there (a few kB per page; write the file with :func:`write_plotlyjs`), and
        shows a plain message if it is missing.
    """
    if fmt == "html":
        if plotlyjs_src is None:
            return fig.to_html(include_plotlyjs=True, full_html=True).encode()
        if not plotlyjs_src.endswith(".js"):
            raise InputError(f"plotlyjs_src must name a .js file (e.g. {PLOTLYJS_NAME!r}), got {plotlyjs_src!r}.")
        page = fig.to_html(include_plotlyjs=plotlyjs_src, full_html=True)
        notice = _MISSING_LIBRARY.format(src=html.escape(plotlyjs_src))
        head, tail = page.rsplit("</body>", 1)
        return (head + notice + "</body>" + tail).encode()
    if fmt not in IMAGE_FORMATS:
        raise InputError(f"Unknown figure format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    with _kaleido_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _start_kaleido()
        width = fig.layout.width or 1000
        height = fig.layout.height or 600
        return pio.to_image(fig, format=fmt, width=width, height=height, scale=2 if fmt == "png" else 1)


def bundle(run: AttentionRun | None, view: str, params: dict[str, Any], fmt: str) -> tuple[str, bytes]:
    """A zip with ``<view>.<fmt>`` (for figure formats), ``data.csv``, ``data.json``, ``manifest.json``.

    An html figure is a standalone page (library inlined): the zip holds one figure, so there is
    nothing to share, and the page must open on its own, wherever the user puts it."""
    if view not in VIEWS:
        raise InputError(f"Unknown view {view!r}.")
    if fmt not in FORMATS:
        raise InputError(f"Unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    fig, rows = VIEWS[view].build(run, params)
    man = manifest(run, view, {k: v for k, v in params.items() if not k.startswith("_")})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        if fmt in FIGURE_FORMATS:
            z.writestr(f"{view}.{fmt}", figure_bytes(fig, fmt))
        z.writestr("data.csv", rows_to_csv(rows))
        z.writestr("data.json", json.dumps(rows))
        z.writestr("manifest.json", json.dumps(man, indent=2))
    name = f"headscope-{view}-{run.short_id if run else man['model']['digest'][:12]}-{fmt}.zip"
    return name, buf.getvalue()


def write_files(run: AttentionRun | None, view: str, params: dict[str, Any], out: Path, formats: tuple[str, ...],
                *, plotlyjs_path: Path | None = None) -> list[Path]:
    """Write the figure in ``formats`` plus data and manifest into ``out``; return the paths.

    An html figure loads the plotting library from ``plotlyjs_path`` (default ``out/plotly.min.js``),
    written there once and referenced by a relative path. Several folders of one export (a scan's
    per-score subfolders) pass the same ``plotlyjs_path`` in their common folder to share one copy;
    the returned paths include it when this call needed it.
    """
    fig, rows = VIEWS[view].build(run, params)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        if fmt == "html":
            js = write_plotlyjs(Path(plotlyjs_path) if plotlyjs_path is not None else out / PLOTLYJS_NAME)
            src = quote(Path(os.path.relpath(js.resolve(), out.resolve())).as_posix())
            p = out / f"{view}.html"
            p.write_bytes(figure_bytes(fig, "html", plotlyjs_src=src))
            paths += [p, js]
        elif fmt in FIGURE_FORMATS:
            p = out / f"{view}.{fmt}"
            p.write_bytes(figure_bytes(fig, fmt))
            paths.append(p)
    (out / f"{view}.csv").write_text(rows_to_csv(rows))
    (out / f"{view}.json").write_text(json.dumps(rows))
    (out / f"{view}.manifest.json").write_text(json.dumps(manifest(run, view, params), indent=2))
    paths += [out / f"{view}.csv", out / f"{view}.json", out / f"{view}.manifest.json"]
    return paths


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse and validate a manifest file (:func:`app.manifest_schema.read_manifest_file`, the one
    schema the CLI uses too); a problem is an ``InputError`` naming the file and the field."""
    try:
        return read_manifest_file(path)
    except ManifestError as e:
        raise InputError(str(e)) from None


def regenerate(man: dict[str, Any], store: Store | None = None) -> tuple[AttentionRun | None, go.Figure, Rows]:
    """Rebuild a manifest's run (from the store when there) and its figure."""
    model = load_model(man["model"]["name"])
    if model.digest != man["model"].get("digest"):
        raise InputError(
            f"The model {man['model']['name']!r} here has digest {model.digest[:12]}…, but the manifest "
            f"was made with {str(man['model'].get('digest'))[:12]}…: the weights differ."
        )
    if not man["token_ids"]:  # a view of a probe set, not of one run
        fig, rows = VIEWS[man["view"]].build(None, man["params"])
        return None, fig, rows
    settings = man["settings"]
    if "block_size" in settings:  # a long run: statistics mode, same settings
        from analysis.statistics_run import capture_statistics

        run = capture_statistics(model, man["token_ids"], sink=settings["sink"], window=settings["window"],
                                 spans=settings.get("spans", ()), store=store)
        fig, rows = VIEWS[man["view"]].build(run, man["params"])
        return run, fig, rows
    run = capture(
        model,
        man["token_ids"],
        qk_layers=settings.get("qk_layers", ()),
        pattern_dtype=settings.get("pattern_dtype", "float16"),
        store=store,
    )
    fig, rows = VIEWS[man["view"]].build(run, man["params"])
    return run, fig, rows

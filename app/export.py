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
from it, on any machine, with an empty store:

- the run a view is drawn from is recomputed from its token ids and settings (or found in the store);
- the stored results a view read while it was drawn (:func:`headscope.analysis.store.recording_reads`) travel
  with it: other runs by their token ids and settings (``runs``: recomputed, their keys checked),
  everything else (a sweep, a curve, a patching result...) as its metadata and checksummed ``.npy``
  arrays (``results``, up to :data:`MAX_CARRIED_BYTES`; a larger one is named in
  ``results_left_out`` and must be in the store it is rebuilt with). What a view computes from
  them it computes again, with the model.

A rebuild reads the carried results from a temporary store of its own: what a manifest carries
(anyone may have edited it) never enters the user's store. Only the command line names model
paths: a manifest names its model by a spec on offer (or by its digest), never by a path that
would be loaded (:func:`manifest_model`).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import dataclasses
import hashlib
import html
import io
import json
import os
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import quote

import plotly.graph_objects as go
import plotly.io as pio

from headscope.analysis.capture import capture, save_run
from headscope.analysis.errors import InputError
from headscope.analysis.models import ModelError, converted_gguf, embedded_gguf, load_model, offered_embedded
from headscope.analysis.runs import RUN_KINDS, AttentionRun
from headscope.analysis.store import (
    CorruptRecord,
    Record,
    Store,
    as_json,
    npy_bytes,
    parse_npy,
    recording_reads,
)
from headscope.app.export_formats import DATA_FORMATS, FIGURE_FORMATS, FORMATS, IMAGE_FORMATS  # noqa: F401 (also read from here)
from headscope.app.manifest_schema import ManifestError, read_manifest_file
from headscope.app.views import VIEWS, Rows

MANIFEST_VERSION = 1
PLOTLYJS_NAME = "plotly.min.js"  # the shared copy of the plotting library beside exported HTML pages
#: The most bytes of stored arrays a manifest carries (before base64); a larger result is named in
#: ``results_left_out`` and read from the store a rebuild is given.
MAX_CARRIED_BYTES = 64 << 20


def headscope_version() -> str:
    try:
        return version("headscope")
    except PackageNotFoundError:
        return "0+unknown"


def manifest(run: AttentionRun | None, view: str, params: dict[str, Any], reads: Sequence[Any] = ()
             ) -> dict[str, Any]:
    """What rebuilds a figure: the model, the run (token ids and settings; views drawn from stored
    results or a probe set have none) and what the view read from the store (``reads``, from
    :func:`built`), carried as :func:`carried` says."""
    if run is None:
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
        **carried(reads, model_info["digest"], run.key if run is not None else None),
    }


def carried(reads: Sequence[Any], model_digest: str, run_key: str | None = None) -> dict[str, Any]:
    """The stored records a figure was drawn from, as a manifest carries them.

    ``runs``: each run of the manifest's model by its token ids, settings and text (a rebuild
    recomputes it, and checks that its key comes out the same); ``results``: every other record
    (a run of another model too) as its kind, metadata and arrays (``.npy`` bytes in base64 with
    their sha256), up to :data:`MAX_CARRIED_BYTES` in all; ``results_left_out``: the keys of those
    past it. The run the manifest names itself (``run_key``) is not repeated."""
    runs: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    left_out: list[str] = []
    total = 0
    for record in reads:
        if record.key == run_key:
            continue
        if not isinstance(record, Record):  # a run the app kept in memory from an earlier read
            if record.model_digest == model_digest:
                runs.append(as_json({"key": record.key, "kind": "run" if record.has_patterns else "stats_run",
                                     "token_ids": record.token_ids, "settings": record.settings, "text": record.text}))
                continue
            from headscope.app.context import get_context

            record = get_context().store.get(record.key)
            if record is None:
                continue
        meta = record.meta
        if record.kind in RUN_KINDS and meta.get("model_digest") == model_digest:
            runs.append(as_json({"key": record.key, "kind": record.kind, "token_ids": meta["token_ids"],
                                 "settings": meta["settings"], "text": meta.get("text")}))
            continue
        arrays = {}
        for name in record.array_info:
            data, sha256 = npy_bytes(record.array(name))
            arrays[name] = {"sha256": sha256, "npy": base64.b64encode(data).decode("ascii")}
            total += len(data)
        if total > MAX_CARRIED_BYTES:
            left_out.append(record.key)
            continue
        results.append({"key": record.key, "kind": record.kind, "meta": as_json(meta), "arrays": arrays})
    out: dict[str, Any] = {}
    if runs:
        out["runs"] = runs
    if results:
        out["results"] = results
    if left_out:
        out["results_left_out"] = left_out
    return out


def built(run: AttentionRun | None, view: str, params: dict[str, Any]) -> tuple[go.Figure, Rows, list[Record]]:
    """``VIEWS[view]`` drawn for ``run`` and ``params``, and the stored records it read meanwhile."""
    with recording_reads() as reads:
        fig, rows = VIEWS[view].build(run, params)
    return fig, rows, reads


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
    fig, rows, reads = built(run, view, params)
    man = manifest(run, view, {k: v for k, v in params.items() if not k.startswith("_")}, reads)
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
                *, plotlyjs_path: Path | None = None,
                drawn: tuple[go.Figure, Rows, Sequence[Any]] | None = None) -> list[Path]:
    """Write the figure in ``formats`` plus data and manifest into ``out``; return the paths.

    An html figure loads the plotting library from ``plotlyjs_path`` (default ``out/plotly.min.js``),
    written there once and referenced by a relative path. Several folders of one export (a scan's
    per-score subfolders) pass the same ``plotlyjs_path`` in their common folder to share one copy;
    the returned paths include it when this call needed it. ``drawn``: the figure, rows and reads of
    :func:`built` when the view was drawn already (a rebuild: :class:`Rebuilt`).
    """
    fig, rows, reads = drawn if drawn is not None else built(run, view, params)
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
    (out / f"{view}.manifest.json").write_text(json.dumps(manifest(run, view, params, reads), indent=2))
    paths += [out / f"{view}.csv", out / f"{view}.json", out / f"{view}.manifest.json"]
    return paths


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse and validate a manifest file (:func:`headscope.app.manifest_schema.read_manifest_file`, the one
    schema the CLI uses too); a problem is an ``InputError`` naming the file and the field."""
    try:
        return read_manifest_file(path)
    except ManifestError as e:
        raise InputError(str(e)) from None


def manifest_model(man: dict[str, Any], given: str | None = None) -> str:
    """The model spec a manifest is rebuilt with.

    Only the command line names paths: ``given`` (``headscope figure --model``) is used as it is (a
    rebuild then checks its digest against the manifest's, so any copy of the same weights will do).
    Otherwise the manifest's ``model.name`` must be a model on offer here: the embedded ones and the
    specs in ``HEADSCOPE_MODELS``. A path (a ``.gguf``, a folder) or any other name in a manifest is
    never loaded; when its digest is an embedded model's, the message names that model.

    Raises
    ------
    ManifestError
        The model is not on offer, or ``params.model`` names another model than ``model.name``.
    """
    from headscope.analysis.models import DEFAULT_MODEL
    from headscope.app.context import env_models

    name, digest = man["model"]["name"], man["model"]["digest"]
    in_params = man["params"].get("model")
    if in_params not in (None, "", name):
        raise ManifestError(f"field 'params.model' ({str(in_params)[:80]!r}) names another model than field "
                            f"'model.name' ({name[:80]!r}); pass the manifest.json from an export.")
    if given:
        return given
    allowed = list(dict.fromkeys([DEFAULT_MODEL, *offered_embedded(), *env_models()]))
    if name in allowed:
        return name
    same = next((spec for spec in offered_embedded() if _embedded_digest(spec) == digest), None)
    hint = f"; its digest is {same}'s: add `--model {same}`" if same else ""
    raise ManifestError(
        f"field 'model.name' names {name[:80]!r}, which is not a model on offer here ({', '.join(allowed)}), and "
        "a manifest never makes headscope load a file or folder: name the model on the command line, "
        f"`headscope figure MANIFEST --model SPEC` (its weights must have the manifest's digest){hint}.")


def _embedded_digest(spec: str) -> str | None:
    """The weights' digest of an embedded model (converted once, then read from its cache), or None."""
    try:
        return converted_gguf(embedded_gguf(spec))[1]
    except (ModelError, OSError):
        return None


def regenerate(man: dict[str, Any], store: Store | None = None, model: str | None = None
               ) -> tuple[AttentionRun | None, go.Figure, Rows]:
    """Rebuild a manifest's run (from the store when there) and its figure (:func:`rebuilding`)."""
    with rebuilding(man, store, model) as again:
        return again.run, again.figure, again.rows


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """A manifest's figure drawn again: the run (None for views of stored results), the figure, its
    rows, the params it was drawn with (``model``: the spec loaded), the store the view read and
    what it read there (:func:`built`: a manifest written from it carries the same)."""

    run: AttentionRun | None
    figure: go.Figure
    rows: Rows
    params: dict[str, Any]
    results: Store
    reads: list[Any]


@contextlib.contextmanager
def rebuilding(man: dict[str, Any], store: Store | None = None, model: str | None = None) -> Iterator[Rebuilt]:
    """Rebuild a checked manifest's figure (:class:`Rebuilt`). The view reads the manifest's carried
    results from a temporary store of its own (``Rebuilt.results``, ``store`` itself when it carries
    none) that lives until the block ends and is the app context's store inside it, so
    :func:`write_files` there draws the same figure and carries the same results on.

    Parameters
    ----------
    man : a manifest that passed :func:`headscope.app.manifest_schema.check_manifest`.
    store : the user's store: the manifest's runs are looked up there and stored there once
        computed (they are computed from token ids with a model checked against the manifest's digest).
    model : the model spec given on the command line (:func:`manifest_model`).

    Raises
    ------
    ManifestError, InputError
        A model not on offer or with other weights, a view that needs a run without token ids, carried
        runs or results that do not match their keys or checksums.
    """
    from headscope.app import context
    from headscope.app.context import AppContext, set_context

    view = VIEWS.get(man["view"])
    if view is None:
        raise ManifestError(f"field 'view' names an unknown view {man['view']!r}; known: {', '.join(VIEWS)}.")
    if view.needs_run and not man["token_ids"]:
        raise ManifestError(f"field 'token_ids' is empty, but the view {man['view']!r} is drawn from a run: its "
                            "manifest names the run's token ids; pass the manifest.json from that view's export.")
    spec = manifest_model(man, model)
    loaded = load_model(spec)
    if loaded.digest != man["model"]["digest"]:
        raise InputError(
            f"The model {spec!r} here has digest {loaded.digest[:12]}…, but the manifest "
            f"was made with {str(man['model']['digest'])[:12]}…: the weights differ."
        )
    params = {**man["params"], **({"model": spec} if "model" in man["params"] else {})}
    with contextlib.ExitStack() as stack:
        results = store if store is not None else Store()
        if man.get("runs") or man.get("results"):
            results = Store(stack.enter_context(tempfile.TemporaryDirectory(prefix="headscope-figure-")), shared=False)
            _seed(results, man, loaded, store)
        previous = context._context
        set_context(AppContext(store=results, default_model=spec))
        stack.callback(setattr, context, "_context", previous)
        run = _manifest_run(man, loaded, store) if man["token_ids"] else None
        fig, rows, reads = built(run, man["view"], params)
        yield Rebuilt(run, fig, rows, params, results, reads)


def _manifest_run(man: dict[str, Any], model, store: Store | None) -> AttentionRun:
    """The manifest's own run, recomputed from its token ids and settings (or found in ``store``)."""
    settings = man["settings"]
    if "block_size" in settings:  # a long run: statistics mode, same settings
        from headscope.analysis.statistics_run import capture_statistics

        return capture_statistics(model, man["token_ids"], sink=settings["sink"], window=settings["window"],
                                  spans=settings.get("spans", ()), store=store)
    return capture(model, man["token_ids"], qk_layers=settings.get("qk_layers", ()),
                   pattern_dtype=settings.get("pattern_dtype", "float16"), store=store)


def _seed(results: Store, man: dict[str, Any], model, store: Store | None) -> None:
    """Put a manifest's carried results into ``results`` (each array checked against its sha256)
    and recompute its carried runs there (each key checked: a run is what its key says)."""
    for i, item in enumerate(man.get("results", [])):
        arrays = {}
        for name, arr in item["arrays"].items():
            try:
                data = base64.b64decode(arr["npy"], validate=True)
            except ValueError:
                raise ManifestError(f"field 'results' item {i}: array {name!r} is not base64.") from None
            if hashlib.sha256(data).hexdigest() != arr["sha256"]:
                raise ManifestError(f"field 'results' item {i}: array {name!r} fails its sha256 (damaged or edited).")
            try:
                arrays[name] = parse_npy(data, name)
            except CorruptRecord as e:
                raise ManifestError(f"field 'results' item {i}: {e}.") from None
        results.put(item["key"], item["kind"], item["meta"], arrays, share=False)
    for i, item in enumerate(man.get("runs", [])):
        settings, ids = item["settings"], item["token_ids"]
        if item["kind"] == "stats_run":
            from headscope.analysis.statistics_run import capture_statistics, save_stats_run

            run = capture_statistics(model, ids, sink=settings.get("sink", 0), window=settings.get("window", 1),
                                     spans=settings.get("spans", ()), store=store)
            save = save_stats_run
        else:
            run = capture(model, ids, qk_layers=settings.get("qk_layers", ()),
                          pattern_dtype=settings.get("pattern_dtype", "float16"), store=store)
            save = save_run
        if run.key != item["key"]:
            raise ManifestError(f"field 'runs' item {i}: its token ids and settings make run {run.key[:12]}, not "
                                f"{item['key'][:12]} (an edited manifest, or one made by another version).")
        save(results, dataclasses.replace(run, text=item.get("text")))

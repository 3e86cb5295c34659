"""The Dash application: pages from ``app/pages``, assets served locally (never from a CDN).

Both processes that create it start here: the web server (:func:`create_app`, :func:`warm_up`) and
a Celery worker (:func:`start_worker`; how jobs reach workers is :mod:`headscope.app.workers`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import dash
from dash import Dash, dcc, html
from flask import Flask, Response, request

from headscope.analysis.limits import limit
from headscope.analysis.models import load_model
from headscope.analysis.paths import ASSETS_DIR
from headscope.analysis.store import Store
from headscope.app import ids, workers
from headscope.app.access import redact_tokens_in_logs
from headscope.app.context import AppContext, set_context
from headscope.app.jobs import background_manager
from headscope.app.seen_runs import remember_runs_shown, seen_runs_store

log = logging.getLogger("headscope.app")


def create_app(context: AppContext) -> Dash:
    set_context(context)
    app = Dash(
        __name__,
        use_pages=True,
        pages_folder=str(Path(__file__).parent / "pages"),
        assets_folder=str(ASSETS_DIR),
        serve_locally=True,
        title="headscope",
        suppress_callback_exceptions=True,
        background_callback_manager=background_manager(),
        on_error=show_error,
    )
    app.layout = html.Div(
        [
            html.Header(
                [
                    html.A("headscope", href="/", className="hs-brand"),
                    html.Nav(
                        [dcc.Link(page["name"], href=page["relative_path"], className="hs-nav-link",
                                  id=_nav_link_id(page))
                         for page in dash.page_registry.values() if page.get("nav", True)],
                        className="hs-nav",
                    ),
                ],
                className="hs-header",
            ),
            html.Main(
                [
                    html.Div(id=ids.ERROR, role="alert", className="hs-error"),
                    dcc.Download(id=ids.DOWNLOAD),
                    seen_runs_store(),
                    dash.page_container,
                ],
                className="hs-main",
            ),
        ]
    )
    carry_shared_state_in_nav(app)
    remember_runs_shown(app)  # what the Compare page may offer: the runs this browser was shown
    answer_404_for_unknown_paths(app)
    answer_404_for_unknown_components(app)
    redact_tokens_in_logs()
    cap_request_size(app.server)
    answer_408_for_stalled_requests(app.server)
    from headscope.app.offers import check_callback_requests

    check_callback_requests(app, app.server)
    close_sqlite_after_requests(app.server, context)
    return app


def close_sqlite_after_requests(server, context: AppContext) -> None:
    """Each request thread closes its SQLite connections (the store's index, the job cache) when its
    request ends, inside the fork gate (:mod:`headscope.analysis.fork_gate`).

    The server runs one thread per request; a connection left open in a thread's local storage would be
    closed when the thread ends, by the interpreter, outside the gate: a job forked at that moment
    could inherit one of SQLite's mutexes held, and wait on it for ever."""
    from headscope.app.jobs import GatedCache, background_manager

    @server.teardown_request
    def _close(_error=None) -> None:
        context.store.close()
        cache = getattr(background_manager(), "handle", None)
        if isinstance(cache, GatedCache):
            cache.close()


def _nav_link_id(page: dict) -> str:
    return f"hs-nav-{page['module'].rsplit('.', 1)[-1]}"


def carry_shared_state_in_nav(app: Dash) -> None:
    """The nav links carry what every page shares (model, run, layer, head:
    :data:`headscope.app.url_state.SHARED_KEYS`), so going to another page keeps the text's run.

    One browser-side callback per page, on that page's own URL (a page writes its state there
    without telling the router): the links follow every change without a server round trip."""
    import json
    import sys

    from headscope.app.page_shell import url_id
    from headscope.app.url_state import SHARED_KEYS

    pages = [page for page in dash.page_registry.values() if page.get("nav", True)]  # the 404 page has no link
    paths = json.dumps([page["relative_path"] for page in pages])
    keep = json.dumps(list(SHARED_KEYS))
    outputs = [dash.Output(_nav_link_id(page), "href", allow_duplicate=True) for page in pages]
    for page in pages:
        prefix = getattr(sys.modules.get(page["module"]), "PREFIX", None)
        if prefix is None:
            continue
        app.clientside_callback(
            f"""function(search) {{
                const given = new URLSearchParams(search || ""), kept = new URLSearchParams();
                for (const key of {keep}) {{ if (given.get(key)) kept.set(key, given.get(key)); }}
                const query = kept.toString() ? "?" + kept.toString() : "";
                return {paths}.map(path => path + query);
            }}""",
            *outputs,
            dash.Input(url_id(prefix), "search"),
            prevent_initial_call="initial_duplicate",
        )


def answer_404_for_unknown_paths(app: Dash) -> None:
    """A path that names no page is answered with status 404, not 200 (a crawler, ``curl -f`` or a link
    checker then knows it is missing); the body is still the app, so a browser shows the app's own
    404 page (:mod:`headscope.app.pages.not_found_404`), which Dash Pages draws for it.

    Dash Pages serves every path through one catch-all route; the status is set after it, for that
    route only, by the router's own matching of a path to a page (so the status and the page shown
    never disagree). The 404 page's own path (``/not-found``) is no page either."""
    from dash._pages import _path_to_page  # the router's matching (dash/_pages.py); no public equivalent

    catch_all = app.config.routes_pathname_prefix + "<path:path>"

    @app.server.after_request
    def not_found_status(response: Response) -> Response:
        if request.endpoint == catch_all and response.status_code == 200:
            page, _ = _path_to_page(app.strip_relative_path(request.path))
            if not page or page["module"].rsplit(".", 1)[-1] == "not_found_404":
                response.status_code = 404
        return response


def answer_404_for_unknown_components(app: Dash) -> None:
    """``/_dash-component-suites/<package>/<path>`` serves the scripts of the packages Dash registered; a
    package or path it did not register (a typo, a probe, a ``..%2f`` that climbs out of a package), or a
    registered one whose file is missing, is answered 404 with one line, not a 500 and a logged traceback.
    Dash checks the path against what it registered before it reads anything
    (``dash._validate.validate_js_path``); this only turns its refusal into the status it means."""
    from dash.exceptions import DependencyException

    for rule in app.server.url_map.iter_rules():
        if "/_dash-component-suites/" not in rule.rule:
            continue
        serve = app.server.view_functions[rule.endpoint]

        def serve_or_404(*args, _serve=serve, **kwargs):
            try:
                return _serve(*args, **kwargs)
            except (DependencyException, OSError):  # OSError: a registered file that is not there
                return Response("headscope: no such component script.\n", status=404, mimetype="text/plain")

        app.server.view_functions[rule.endpoint] = serve_or_404


def max_request_bytes() -> int:
    """Bytes of one request body: ``HEADSCOPE_MAX_REQUEST_BYTES``, by default room for the largest
    upload (``HEADSCOPE_MAX_UPLOAD_BYTES``) after base64 plus 1 MiB for the rest of the callback."""
    try:
        value = int(os.environ.get("HEADSCOPE_MAX_REQUEST_BYTES", "0"))
    except ValueError:
        value = 0
    return value if value > 0 else -(-limit("HEADSCOPE_MAX_UPLOAD_BYTES") * 4 // 3) + (1 << 20)


def cap_request_size(server: Flask) -> None:
    """Refuse a request body over :func:`max_request_bytes` with 413 and a message, before reading it:
    by its Content-Length, or (chunked, no length) as soon as reading passes the cap. (What is left of
    the body is then dropped by the HTTP server, a bounded buffer at a time; the app never holds it.)"""

    def too_large() -> Response:
        cap = max_request_bytes()
        response = Response(f"headscope: this request is larger than {cap:,} bytes, the limit for one request "
                            "(set HEADSCOPE_MAX_REQUEST_BYTES to change it; an uploaded file may have up to "
                            f"{limit('HEADSCOPE_MAX_UPLOAD_BYTES'):,} bytes).\n", status=413, mimetype="text/plain")
        return response

    @server.before_request
    def refuse_large_bodies():
        cap = max_request_bytes()
        request.max_content_length = cap  # a chunked body is cut off when reading passes the cap
        if request.content_length is not None and request.content_length > cap:
            return too_large()
        if request.content_length is None and request.environ.get("wsgi.input_terminated"):
            # chunked: the stream stops at the cap without a word, so a body that reaches it is too large
            if len(request.get_data(cache=True)) >= cap:
                return too_large()
        return None

    server.register_error_handler(413, lambda _e: too_large())


def request_handler() -> type:
    """The web server's request handler: every read from a client waits at most ``HEADSCOPE_READ_TIMEOUT``
    seconds for the next bytes (headers or body), so a client that stops sending (a body shorter than its
    Content-Length) frees its thread then, instead of holding it for ever. A slow upload that keeps
    sending is not cut: the limit is on each wait, as nginx's ``client_body_timeout``."""
    from werkzeug.serving import WSGIRequestHandler

    class TimedRequestHandler(WSGIRequestHandler):
        timeout = limit("HEADSCOPE_READ_TIMEOUT")  # socketserver sets it on the connection

    return TimedRequestHandler


def answer_408_for_stalled_requests(server: Flask) -> None:
    """A body that stopped arriving (:func:`request_handler`'s timeout, raised where the app reads it, as
    itself or as werkzeug's ClientDisconnected): 408 and one log line, not a 500 with a traceback or a 400
    that blames the request's form."""
    from werkzeug.exceptions import ClientDisconnected

    def stalled() -> Response:
        log.warning("%s %r: the request's body stopped arriving for %d s; connection closed", request.method,
                    request.path[:200], limit("HEADSCOPE_READ_TIMEOUT"))
        response = Response("headscope: the request's body stopped arriving; send it again.\n", status=408,
                            mimetype="text/plain")
        response.headers["Connection"] = "close"
        return response

    def disconnected(error: ClientDisconnected):
        return stalled() if isinstance(error.__context__, TimeoutError) else error

    server.register_error_handler(TimeoutError, lambda _error: stalled())
    server.register_error_handler(ClientDisconnected, disconnected)


def show_error(error: Exception) -> None:
    """An error no callback turned into a message (e.g. a job whose worker was lost too often, or a
    bug in a background job): logged, and shown in the page's error banner instead of a spinner."""
    from dash import set_props
    from dash.exceptions import BackgroundCallbackError

    from headscope.app.errors import USER_ERRORS, message

    text = str(error)
    if isinstance(error, BackgroundCallbackError):  # "An error occurred inside …: MSG\nTRACEBACK"
        text = text.split(": ", 1)[-1].split("\n", 1)[0]
    elif not isinstance(error, USER_ERRORS):  # a bug, or a forged value no check caught: no internals
        text = f"Something went wrong ({type(error).__name__}). The server log has the details."
    try:
        where = dash.callback_context.outputs_list
    except Exception:
        where = None
    log.error("callback failed (%s): %s", str(where)[:200], str(error).split("\n", 1)[0][:300])
    set_props(ids.ERROR, {"children": message(text or f"Something went wrong ({type(error).__name__}).")})


def warm_up(model_spec: str) -> None:
    """Load the model and start the export browser before the first request needs them."""
    import plotly.graph_objects as go

    from headscope.app.export import figure_bytes

    load_model(model_spec)

    def _export() -> None:
        try:
            figure_bytes(go.Figure(), "svg")
        except Exception as e:  # export still works later, or says why then
            log.warning("image export is not ready: %s", e)

    threading.Thread(target=_export, daemon=True).start()


def start_worker(*, models: list[str], concurrency: int, device: str, name: str | None,
                 page_concurrency: int = 1) -> None:
    """Run Celery workers for the app's background callbacks until they are stopped.

    The same Dash app as the web process is created first (its background callbacks become Celery
    tasks), then ``models`` are loaded in this process, before anything forks (see
    :mod:`headscope.app.workers`). Then this process forks a child that runs Celery's worker on the ``pages`` queue
    (``page_concurrency`` pool processes) and runs the ``jobs`` worker itself (``concurrency``).
    """
    os.environ["HEADSCOPE_DEVICE"] = device
    create_app(workers.worker_context(Store(), models))
    if device.startswith("cuda"):
        print(f"headscope worker: {device}: models load in each pool process on first use "
              "(CUDA cannot be forked)", file=sys.stderr)
    else:
        for spec in models:
            t = time.time()
            load_model(spec, device=device)
            print(f"headscope worker: {spec} loaded on {device} in {time.time() - t:.1f} s, before forking "
                  f"{concurrency} pool process(es)", file=sys.stderr)
    name = name or f"headscope-{os.getpid()}"
    queue, n, host = workers.JOBS, concurrency, name
    if page_concurrency > 0 and os.fork() == 0:
        from billiard.util import set_pdeathsig

        set_pdeathsig(signal.SIGTERM)  # the pages worker ends with the worker that forked it
        queue, n, host = workers.PAGES, page_concurrency, f"{name}-pages"
    workers.celery_app().worker_main(["worker", "--pool=prefork", f"--concurrency={n}", f"--queues={queue}",
                                      "--loglevel=INFO", f"--hostname={host}@%h", "--without-gossip", "--without-mingle"])


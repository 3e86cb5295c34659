"""``headscope serve``: the web app, with its access token and host rule."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import time

from headscope.app.cli.arguments import MODEL_HELP, allowed_hosts, bind_host, count, non_empty
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import model_spec, open_store
from headscope.app.cli.terminal import redacted


def _port_free(host: str, port: int) -> None:
    """Refuse a host that does not resolve or a port already taken, before the model loads."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"argument --host: cannot resolve {host!r} ({e.strerror})") from None
    except UnicodeError as e:  # a name that IDNA cannot encode (a label over 63 characters, ...)
        raise UsageError(f"argument --host: {host!r} is not a name that can be resolved ({e})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise UsageError(f"argument --port: cannot listen on {host}:{port} ({e.strerror})") from None


def cmd_serve(args) -> int:
    host = args.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    given = args.token or os.environ.get("HEADSCOPE_TOKEN")
    if given is not None and len(given) < 16:
        raise UsageError("argument --token: an access token must have at least 16 characters.")
    if given is not None and (given != given.strip() or any(c.isspace() or not c.isprintable() for c in given)):
        raise UsageError("argument --token: an access token has no spaces or control characters "
                         "(it travels in links).")
    names = args.allowed_hosts
    if names is None and os.environ.get("HEADSCOPE_ALLOWED_HOSTS", "").strip():
        try:
            names = allowed_hosts(os.environ["HEADSCOPE_ALLOWED_HOSTS"])
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"HEADSCOPE_ALLOWED_HOSTS: {e}") from None
    _port_free(host, args.port)
    from headscope.app.jobs import prepare_server_threads

    prepare_server_threads()  # before torch loads: jobs fork from this process and share its cores
    from headscope.app.access import HostRule, guard_hosts, new_token, protect
    from headscope.app.context import AppContext
    from headscope.app.server import create_app, warm_up
    from headscope.app.workers import redis_url

    token = given or (None if loopback else new_token())
    model = model_spec(args)
    context = AppContext(store=open_store(args), default_model=model)
    if redis_url():
        from headscope.analysis.models import refuse_loading

        # jobs and every model-using callback run on `headscope worker`s: this process loads no model
        refuse_loading("This web front end loads no model: its jobs run on headscope workers "
                       "(HEADSCOPE_REDIS_URL is set), and this page asked it to load one. Please report it.")
        print(f"headscope: jobs run on Celery workers through {redacted(redis_url())}; "
              "start them with `headscope worker`", file=sys.stderr)
    else:
        print(f"headscope: loading {model} …", file=sys.stderr)
        t = time.time()
        with argument("--model"):
            warm_up(model)
        print(f"headscope: model ready in {time.time() - t:.1f} s", file=sys.stderr)
        # UMAP's numba code is compiled when the QK page first asks for UMAP (app/pages/qk.py), not
        # here: a job forked while it compiles waits for it, the first Run on the Attention page too
    app = create_app(context)
    from headscope.app.jobs import end_jobs_with_server

    end_jobs_with_server()  # a SIGTERM ends the running jobs too, not only this process
    if token is not None:
        protect(app.server, token)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        # a token the operator chose is never echoed (logs keep stderr); a generated one must be shown once
        shown_token = "<your token>" if given else token
        print(f"headscope: access token required; open http://{shown}:{args.port}/?token={shown_token}",
              file=sys.stderr)
    rule = HostRule.for_server(host, names or ())
    guard_hosts(app.server, rule)  # before the token's check: a request for another name is refused first
    if rule.any_host:
        print("headscope: answering to any host name (bound beyond the loopback, the token guards it); "
              "--allowed-hosts limits the names", file=sys.stderr)
    print(f"headscope: serving on http://{host}:{args.port}  (store: {context.store.root})", file=sys.stderr)
    from headscope.app.server import request_handler

    app.run(host=host, port=args.port, debug=False, threaded=True, request_handler=request_handler())
    return 0


def add_parser(sub) -> None:
    """``headscope serve``: start the web app."""
    p = sub.add_parser("serve", help="start the web app")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", type=bind_host,
                   help="the address to listen on (default 127.0.0.1; 0.0.0.0 or :: for every address)")
    p.add_argument("--port", type=count(1, 65535), default=8050)
    p.add_argument("--token", help="access token of at least 16 characters (default: a random one when --host is "
                                   "not a loopback address; also HEADSCOPE_TOKEN)")
    p.add_argument("--allowed-hosts", type=allowed_hosts, metavar="NAMES",
                   help="host names the server also answers to, comma-separated, e.g. a reverse proxy's "
                        "lab.example.org (default: loopback addresses and localhost when --host is a loopback "
                        "address, any name otherwise; also HEADSCOPE_ALLOWED_HOSTS)")
    p.set_defaults(func=cmd_serve)

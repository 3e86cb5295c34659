"""The ``headscope`` command: serve the app, run texts, list models and runs, rebuild figures.

Every argument is checked at this boundary, before anything heavy is imported (torch, transformers,
dash and the analysis modules load only after parsing and validation, so ``--help`` and a mistyped
argument answer at once). A bad input ends in one line on stderr that names the argument, and exit
status 2; progress bars are drawn only on a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from headscope import __version__  # the installed distribution's, read from its metadata
from headscope.analysis.ablation_choices import (
    CONTROL_TOP_N,
    DEFAULT_METHOD,
    DEFAULT_SEEDS,
    MAX_SEEDS,
    METHODS,
)
from headscope.analysis.errors import shown
from headscope.analysis.kv_compression_choices import BACKENDS as COMPRESS_BACKENDS
from headscope.analysis.kv_compression_choices import DEFAULT_FRACTIONS as COMPRESS_FRACTIONS
from headscope.analysis.kv_compression_choices import DEFAULT_RANKINGS as COMPRESS_RANKINGS
from headscope.analysis.kv_compression_choices import (
    DEFAULT_RECENT_SIZE,
    DEFAULT_SINK_SIZE,
    DEFAULT_TOLERANCE,
)
from headscope.analysis.kv_compression_choices import RANKINGS as COMPRESS_RANKING_NAMES
from headscope.analysis.patching_choices import DIRECTIONS as PATCH_DIRECTIONS
from headscope.analysis.patching_choices import METRICS as PATCH_METRICS
from headscope.analysis.patching_choices import PATH_SITES
from headscope.analysis.patching_choices import SITES as PATCH_SITES
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.export_formats import FIGURE_FORMATS

EXIT_USER_ERROR = 2


class UsageError(ValueError):
    """A bad argument found by the command line itself; the message names the argument."""


def one_line(message: str) -> str:
    """``message`` as one printable line: its line breaks become spaces, and any other control character or
    lone surrogate (from bytes that were not UTF-8) that an argument brought into it is shown escaped, as
    ``repr`` writes it, so the user sees what was typed and the terminal receives no escape sequence."""
    text = " ".join(message.split("\n")).strip()
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    """argparse, with an error as one line naming the argument (not a usage block) and status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {one_line(message)} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


# ---------------------------------------------------------------------------------------------
# Argument types: each checks one value and raises ArgumentTypeError, which argparse reports as
# "argument --name: message".


_WHOLE = re.compile(r"[+-]?[0-9]+")
_MOST_DIGITS = 18  # no count or index has more; int() refuses numerals past 4,300 digits


def _number(text: str, kind: type = int) -> int | float:
    """``text`` as an int (ASCII digits, an optional sign) or a float (as ``float()`` reads it), written in
    ASCII: ``٣`` or ``３`` are digits to Python, not numbers a user meant to type. ValueError with what to
    write otherwise."""
    t = text.strip()
    if not t.isascii():
        raise ValueError(f"{shown(text)} is not a number: write numbers with the digits 0-9")
    if kind is float:
        try:
            return float(t)
        except ValueError:
            raise ValueError(f"{shown(text)} is not a number") from None
    if not _WHOLE.fullmatch(t):
        raise ValueError(f"{shown(text)} is not a whole number")
    if len(t.lstrip("+-").lstrip("0")) > _MOST_DIGITS:
        raise ValueError(f"{shown(t)} is out of range")
    return int(t)


def _whole(text: str) -> int:
    try:
        return _number(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        n = _whole(text)
        if n < minimum or (maximum is not None and n > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n

    return parse


def number_list(kind: type, minimum: float, maximum: float | None = None, what: str = "numbers"
                ) -> Callable[[str], list]:
    """Comma-separated numbers, at least one, each in ``[minimum, maximum]``."""

    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give one or more {what} separated by commas, e.g. "
                                             f"{int(minimum) if kind is int else minimum},{int(minimum) + 1}")
        try:
            values = [_number(x, kind) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}; give {what} separated by commas") from None
        for v in values:
            if v != v or v < minimum or (maximum is not None and v > maximum):
                bound = f"between {minimum:g} and {maximum:g}" if maximum is not None else f"at least {minimum:g}"
                raise argparse.ArgumentTypeError(f"each value must be {bound}, got {v:g}")
        return values

    return parse


def _shown_path(path: str) -> str:
    """A path as a message shows it: a very long one cut short."""
    return path if len(path) <= 160 else path[:150] + "…"


def _user_path(path: str) -> Path:
    """``path`` with ``~`` or ``~user`` expanded; ArgumentTypeError for a user this machine does not have."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # ~someone, and no such user
        raise argparse.ArgumentTypeError(f"cannot use {_shown_path(path)}: no user {path[1:].split('/')[0]!r} "
                                         "here to expand ~ for") from None


def read_text_file(path: str) -> str:
    """The contents of a UTF-8 text file, or ArgumentTypeError saying why it cannot be used."""
    p = _user_path(path)
    try:
        exists, is_dir, is_file = p.exists(), p.is_dir(), p.is_file()
    except OSError as e:  # a name too long for the file system, a loop of links...
        raise argparse.ArgumentTypeError(f"cannot read {_shown_path(path)}: {e.strerror or e}") from None
    path = _shown_path(path)
    if not exists:
        raise argparse.ArgumentTypeError(f"cannot read {path}: no such file")
    if is_dir:
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is a folder, not a text file")
    if not is_file:  # a pipe waits for a writer, /dev/zero never ends: only a file has an end
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is not a regular file (a pipe or a device?)")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None
    if b"\0" in raw:
        raise argparse.ArgumentTypeError(f"cannot read {path}: it is a binary file, not UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def text_file(path: str) -> str:
    """A path that :func:`read_text_file` accepts (returned as given)."""
    read_text_file(path)
    return path


def haystack(value: str) -> str:
    """A haystack name (:data:`headscope.analysis.niah.HAYSTACK_NAMES`) or a UTF-8 text file."""
    from headscope.analysis.niah import HAYSTACK_NAMES  # light: no model code

    if value in HAYSTACK_NAMES:
        return value
    if value.isidentifier() and not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"unknown haystack {value!r}: use {', '.join(HAYSTACK_NAMES)} or the path "
                                         "of a UTF-8 text file")
    return text_file(value)


def folder(path: str) -> str:
    """A folder that exists or can be created (an output or store folder)."""
    if not path.strip():  # "" would silently mean the default folder (or the current one)
        raise argparse.ArgumentTypeError("the folder is empty: give a folder's path")
    p = _user_path(path)
    try:
        if p.exists() and not p.is_dir():
            raise argparse.ArgumentTypeError(f"{_shown_path(path)} is a file, not a folder")
        parent = p
        while not parent.exists():
            parent = parent.parent
    except OSError as e:  # a name too long for the file system, a loop of links...
        raise argparse.ArgumentTypeError(f"cannot use {_shown_path(path)} as a folder: {e.strerror or e}") from None
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {_shown_path(str(parent))}")
    return path


def non_empty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} is empty")
        return text

    return parse


def text_arg(text: str) -> str:
    """Text given on the command line: not empty, and valid Unicode (bytes that are not UTF-8 come
    through as lone surrogates)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the text is empty: give some text to analyse")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"the text is not valid UTF-8 at character {e.start}") from None
    return text


def bind_host(text: str) -> str:
    """``--host``: an IP address or a host name (:func:`headscope.app.access.host_name`)."""
    from headscope.app.access import host_name

    try:
        return host_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def allowed_hosts(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: host names or IP addresses, comma-separated (:func:`headscope.app.access.host_names`)."""
    from headscope.app.access import host_names

    try:
        return host_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


def device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device: use cpu, cuda, cuda:N or mps")
    return text


def _check_formats(value: str, allowed: tuple[str, ...] = FIGURE_FORMATS, flag: str = "--formats") -> tuple[str, ...]:
    formats = tuple(f.strip() for f in value.split(",") if f.strip())
    unknown = [f for f in formats if f not in allowed]
    if unknown:
        raise UsageError(f"argument {flag}: unknown format(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return formats


@contextlib.contextmanager
def _argument(name: str) -> Iterator[None]:
    """Report a user error raised inside (analysis' InputError, ModelError) as one about ``name``."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UsageError) or not _is_user_error(e) or isinstance(e, OSError):
            raise  # a store that cannot be opened or written is no argument's fault (StoreWriteError, ...)
        raise UsageError(f"argument {name}: {e}") from None


def _model_spec(args) -> str:
    """``--model``, or the default model (read from analysis only once it is imported)."""
    from headscope.analysis.models import DEFAULT_MODEL

    return args.model or DEFAULT_MODEL


@contextlib.contextmanager
def progress_bar(desc: str, enabled: bool | None = None) -> Iterator:
    """A tqdm bar driven by a ``progress(fraction)`` callback, on a terminal only (``enabled=None``:
    when stderr is a terminal); shown only when the work takes time. Captured output gets no bar,
    so no carriage returns or escape codes run into the result lines."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda fraction: None
        return
    from tqdm import tqdm

    bar = tqdm(total=100, desc=desc, leave=False, file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}", delay=1.0)

    def update(fraction: float) -> None:
        bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def _store(args):
    from headscope.analysis.store import Store

    try:
        return Store(args.home) if getattr(args, "home", None) else Store()
    except OSError as e:
        where = args.home or os.environ.get("HEADSCOPE_HOME") or "the user data dir"
        flag = "--home" if args.home else "HEADSCOPE_HOME"
        raise UsageError(f"{flag}: cannot use {where} as the store folder ({e.strerror or e}); "
                         "give a writable folder") from None


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
    model = _model_spec(args)
    context = AppContext(store=_store(args), default_model=model)
    if redis_url():
        from headscope.analysis.models import refuse_loading

        # jobs and every model-using callback run on `headscope worker`s: this process loads no model
        refuse_loading("This web front end loads no model: its jobs run on headscope workers "
                       "(HEADSCOPE_REDIS_URL is set), and this page asked it to load one. Please report it.")
        print(f"headscope: jobs run on Celery workers through {_redacted(redis_url())}; "
              "start them with `headscope worker`", file=sys.stderr)
    else:
        print(f"headscope: loading {model} …", file=sys.stderr)
        t = time.time()
        with _argument("--model"):
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


def _redacted(url: str) -> str:
    """A Redis URL without its password, for messages."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def cmd_worker(args) -> int:
    """A Celery worker for the app's jobs (needs HEADSCOPE_REDIS_URL)."""
    from headscope.app.workers import redis_url

    if not redis_url():
        raise UsageError("set HEADSCOPE_REDIS_URL to the Redis server the web front end uses, e.g. "
                         "HEADSCOPE_REDIS_URL=redis://127.0.0.1:6379/0 headscope worker")
    import redis

    try:
        redis.Redis.from_url(redis_url(), socket_connect_timeout=5).ping()
    except (redis.RedisError, ValueError) as e:
        raise UsageError(f"HEADSCOPE_REDIS_URL: cannot reach Redis at {_redacted(redis_url())}: {e}") from None
    if args.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        index = int(args.device.split(":")[1]) if ":" in args.device else 0
        if index >= n:
            raise UsageError(f"argument --device: {args.device} is not here ({n} CUDA device(s) found)")
    from headscope.analysis.models import DEFAULT_MODEL
    from headscope.app.server import start_worker

    if args.home:
        os.environ["HEADSCOPE_HOME"] = args.home
    with _argument("--model"):  # the models load first, before the pool forks
        start_worker(models=args.model or [DEFAULT_MODEL], concurrency=args.concurrency, device=args.device,
                     name=args.name, page_concurrency=args.page_concurrency)
    return 0


def cmd_run(args) -> int:
    if args.text is not None and args.file:
        raise UsageError("give the text either as TEXT or with --file, not both")
    if args.text is None and not args.file:
        raise UsageError("give a TEXT or --file F")
    text = read_text_file(args.file) if args.file else args.text
    formats = _check_formats(args.formats)

    import numpy as np

    from headscope.analysis.limits import limit
    from headscope.analysis.models import load_model
    from headscope.analysis.statistics_run import STATS_METRICS, capture_for_page, capture_statistics
    from headscope.app.export import write_files
    from headscope.app.views import names

    store = _store(args)
    with progress_bar("loading model") as bar, _argument("--model"):
        model = load_model(_model_spec(args))
        bar(1.0)
    with progress_bar("capturing") as bar, _argument("--file" if args.file else "TEXT"):
        if args.stats:
            run = capture_statistics(model, text, store=store, max_tokens=limit("HEADSCOPE_MAX_STATS_TOKENS"),
                                     progress=bar)
        else:
            run = capture_for_page(model, text, store, limit("HEADSCOPE_MAX_TOKENS"))
            bar(1.0)
    out = Path(args.out) if args.out else store.root / "exports" / run.short_id
    paths = write_files(run, names.HEAD_GRID, {"metric": "entropy"}, out, formats)
    for name, arr in run.kept_arrays().items():  # patterns, or per-row statistics, column sums and pooled maps
        np.save(out / f"{name}.npy", arr, allow_pickle=False)
        paths.append(out / f"{name}.npy")
    if not run.has_patterns:  # statistics mode: the scores a short run's grid would recompute from patterns
        with open(out / "scores.csv", "w", encoding="utf-8") as f:
            f.write("layer,head," + ",".join(STATS_METRICS) + "\n")
            tables = [run.head_scores(name) for name in STATS_METRICS]
            for la in range(run.n_layers):
                for h in range(run.n_heads):
                    f.write(f"{la},{h}," + ",".join(f"{t[la, h]:.6g}" for t in tables) + "\n")
        paths.append(out / "scores.csv")
    mode = run.mode
    print(f"run {run.key}")
    loss = float(np.nanmean(run.token_loss)) if run.n_tokens > 1 else float("nan")  # one token: no loss
    print(f"{run.n_tokens} tokens, mean loss {loss:.4f} ({mode})")
    print(f"results in {out}")
    for p in dict.fromkeys(paths):
        print(f"  {p.name}")
    return 0


def cmd_models(args) -> int:
    from headscope.analysis.models import EMBEDDED, available_models, offered_embedded

    for m in available_models():
        print(f"{m['spec']:<32} {m['status']:<8} {m['description']}")
        if m.get("terms"):
            print(f"{'':<32} terms:   {m['terms']}")
    print("\nAlso loadable: a .gguf file, or a local folder with config.json and *.safetensors.")
    for name in [n for n in EMBEDDED if n not in offered_embedded()]:
        print(f"Opt-in, not installed: {name} ({EMBEDDED[name].terms}); install it with {EMBEDDED[name].install}.")
    return 0


def cmd_runs(args) -> int:
    if args.action == "list" and args.ids:
        raise UsageError("argument ids: `runs list` takes no run ids (did you mean `runs rm`?)")
    if args.action == "rm" and not args.ids:
        raise UsageError("argument ids: give the ids of the runs to remove (`headscope runs list` shows them)")
    store = _store(args)
    if args.action == "list":
        from headscope.analysis.runs import stored_runs

        runs, skipped = stored_runs(store)
        for line in skipped:  # a row that rotted inside the index: reported, never hiding the others
            print(f"headscope runs list: skipped {_printable(line)} (`headscope runs rm` removes it)", file=sys.stderr)
        if not runs and not skipped:
            print("no runs stored in", store.root)
        for r in runs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
            mode = "statistics  " if r.statistics else ""
            print(f"{r.key[:16]}  {when}  {_printable(r.model_name)[:40]:<16} {r.n_tokens:>6} tok  "
                  f"{mode}{_printable(r.text or '')[:50]}")
        return 0
    missing = 0
    for run_id in args.ids:
        keys = store.find(run_id)
        if len(keys) != 1:
            print(f"headscope runs rm: argument ids: {run_id!r} matches {len(keys)} runs", file=sys.stderr)
            missing += 1
            continue
        store.remove(keys[0])
        print(f"removed {keys[0][:16]}")
    return EXIT_USER_ERROR if missing else 0


def _printable(text: str) -> str:
    """``text`` on one line, with control characters (a stored text's newlines, a terminal's escape
    sequences) shown as spaces."""
    return "".join(c if c.isprintable() else " " for c in text)


def cmd_figure(args) -> int:
    from headscope.app.manifest_schema import ManifestError, read_manifest_file

    try:
        manifest = read_manifest_file(args.manifest)
    except ManifestError as e:
        raise UsageError(f"argument manifest: {e}") from None
    formats = _check_formats(args.formats) if args.formats else FIGURE_FORMATS
    from headscope.app.export import rebuilding, write_files
    from headscope.app.views import VIEWS

    if manifest["view"] not in VIEWS:
        raise UsageError(f"argument manifest: field 'view' names an unknown view {manifest['view']!r}; "
                         f"known: {', '.join(VIEWS)}")
    out = Path(args.out) if args.out else Path(args.manifest).resolve().parent / "regenerated"
    with contextlib.ExitStack() as stack:
        with progress_bar("rebuilding") as bar:
            store = _store(args)
            try:  # the model: --model, else a spec on offer that the manifest names (never a path it names)
                with _argument("manifest"):
                    again = stack.enter_context(rebuilding(manifest, store=store, model=args.model))
            except (UsageError, OSError):
                raise  # the store or the disk (StoreReadError, ...) says what it is itself
            except Exception as e:
                if _is_user_error(e):
                    raise
                # an edited manifest whose params, settings or carried results the view cannot draw
                raise UsageError(f"argument manifest: the view {manifest['view']!r} cannot be drawn from this "
                                 f"manifest's params, settings or results ({type(e).__name__}: {str(e)[:200]})"
                                 ) from None
            bar(1.0)
        # inside the rebuild (the results it read live until its end): the new manifest carries them on
        paths = write_files(again.run, manifest["view"], again.params, out, formats,
                            drawn=(again.figure, again.rows, again.reads))
    for p in paths:
        print(p)
    return 0


def _check_needle_types(path: str) -> None:
    """Refuse a needles file whose fields are not strings (``headscope.analysis.niah`` reads the shape and
    would turn a number or a list into text)."""
    from headscope.analysis.errors import parse_json

    try:
        raw = parse_json(read_text_file(path))
    except ValueError:
        return  # not JSON at all: load_needles says so
    items = raw.get("needles") if isinstance(raw, dict) else raw
    for i, item in enumerate(items if isinstance(items, list) else []):
        for key in ("needle", "question", "answer", "id", "kind"):
            if isinstance(item, dict) and key in item and not isinstance(item[key], str):
                kind = "a number" if isinstance(item[key], (int, float)) else type(item[key]).__name__
                raise UsageError(f"argument --needles-file: needle {i}: field {key!r} must be a string, got {kind}")


def _needles(args) -> list:
    """The needles chosen by ``--needles-file`` and ``--needles`` (ids), checked."""
    from headscope.analysis.niah import load_needles

    if args.needles_file:
        _check_needle_types(args.needles_file)
    with _argument("--needles-file"):
        needles = load_needles(args.needles_file) if args.needles_file else load_needles()
    if args.needles:
        wanted = [n.strip() for n in args.needles.split(",") if n.strip()]
        known = {n.id: n for n in needles}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise UsageError(f"argument --needles: unknown needle id(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        needles = [known[w] for w in wanted]
    return needles


def _haystack(args) -> str:
    """The text of ``--haystack`` (default prose)."""
    from headscope.analysis.niah import load_haystack

    with _argument("--haystack"):
        return load_haystack(args.haystack or "prose")


def _depth_rule(args) -> str:
    """``--depth-rule`` (default: :data:`headscope.analysis.niah.DEFAULT_DEPTH_RULE`), checked."""
    from headscope.analysis.niah import DEFAULT_DEPTH_RULE, DEPTH_RULES

    rule = args.depth_rule or DEFAULT_DEPTH_RULE
    if rule not in DEPTH_RULES:
        raise UsageError(f"argument --depth-rule: choose one of {', '.join(DEPTH_RULES)}, got {rule!r}")
    return rule


def cmd_scan(args) -> int:
    """Needle-in-a-haystack sweep → retrieval score tables and figures (re-running reuses trials)."""
    formats = _check_formats(args.formats)
    lengths, depths = args.lengths, args.depths
    from headscope.analysis.niah import check_streaming_window  # the Heads page's rule too; imports no torch

    with _argument("--sink/--window/--lengths"):  # S + W against the shortest length
        check_streaming_window(args.sink, args.window, lengths)
    needles, hay = _needles(args), _haystack(args)
    _depth_rule(args)

    import json

    import numpy as np

    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.heads import head_scores_of

    store, spec, model = _open_store_and_model(args)
    result = _niah_sweep(model, args, store, needles, hay, lengths, depths)
    if not result.trials:
        print("headscope scan: no trial finished", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else store.root / "exports" / f"scan-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    tables = {"scores": result.scores, "group_max": result.group_max, "group_mean": result.group_mean}
    for name, table in tables.items():
        np.savetxt(out / f"retrieval_{name}.csv", table, delimiter=",", fmt="%.6f")
    summary = {
        "sweep": result.key, "model": model.name, "model_digest": model.digest,
        "lengths": lengths, "depths": depths, "needles": [n.id for n in needles],
        "n_trials": result.n_trials, "n_counted": result.n_counted,
        "share_above_0.1": result.share_above(0.1),
        "accuracy": np.where(np.isfinite(result.accuracy), result.accuracy, None).tolist(),
        "reused_trials": sum(t.reused for t in result.trials),
        "depth_rule": result.depth_rule, "stop_at_newline": result.stop_at_newline,
    }
    params = {"model": spec, "sweep": result.key[:16], "agg": "query", "score": "streaming", "stat": "mean",
              "sink_size": args.sink, "window": args.window, "trial": 0}
    with progress_bar(f"per-head scores on {len({tuple(t.prompt_ids) for t in result.trials})} prompts") as bar:
        scores = head_scores_of(result, params, progress=bar)
    for name in scores.names:
        np.savetxt(out / f"{name}_mean.csv", scores.mean[name], delimiter=",", fmt="%.6f")
        np.savetxt(out / f"{name}_std.csv", scores.std[name], delimiter=",", fmt="%.6f")
    summary["head_scores"] = {"n_prompts": scores.n_prompts, "sink_size": scores.sink, "window": scores.window,
                              "scores": scores.names}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for view in (names.RETRIEVAL_GRID, names.RETRIEVAL_HISTOGRAM, names.RETRIEVAL_SCATTER, names.NIAH_GRID):
        write_files(None, view, params, out, formats)
    for score in scores.names:
        write_files(None, names.HEAD_SCORE_GRID, {**params, "score": score}, out / score, formats,
                    plotlyjs_path=out / "plotly.min.js")
    for score in ("retrieval", *[name for name in scores.names if HEAD_SCORES[name].mass_curve]):
        write_files(None, names.SCORE_MASS, {**params, "score": score}, out / f"mass_{score}", formats,
                    plotlyjs_path=out / "plotly.min.js")
    print(f"sweep {result.key} ({result.settings_text()})")
    print(f"{result.n_counted}/{result.n_trials} trials answered ({summary['reused_trials']} reused); "
          f"{result.share_above(0.1):.1%} of heads score above 0.1")
    print(f"results in {out}")
    return 0


def _check_ablate_args(args) -> None:
    """What ``ablate`` can check before anything is imported: which options go together."""
    if bool(args.heads) == bool(args.top_k):
        raise UsageError("choose the heads with exactly one of --heads (e.g. 12.3,14.1) and --top-k N --by SCORE")
    if args.text is not None and args.file:
        raise UsageError("give the text either with --text or with --file, not both")
    if args.text is None and not args.file and not args.sweep:
        raise UsageError("say what to measure on: --text, --file, or --sweep (needle-in-a-haystack prompts)")
    if not args.sweep:
        given = [flag for flag, value in (("--lengths", args.lengths), ("--depths", args.depths),
                                          ("--needles", args.needles), ("--needles-file", args.needles_file),
                                          ("--haystack", args.haystack), ("--depth-rule", args.depth_rule),
                                          ("--stop-at-newline", args.stop_at_newline)) if value]
        if given:
            raise UsageError(f"argument {given[0]}: only used with --sweep")
    if args.top_k:
        if args.by == "retrieval" and not args.sweep:
            raise UsageError("argument --by: --by retrieval needs --sweep (the retrieval scores come from its trials)")
        if args.by != "retrieval" and args.text is None and not args.file:
            raise UsageError(f"argument --by: --by {args.by} is computed on a text: give --text or --file")
    if args.curve and not args.top_k:
        raise UsageError("argument --curve: needs --top-k and --by (the score whose top heads are ablated)")
    if args.method == "resample" and not args.source:
        raise UsageError("argument --source: --method resample needs --source TEXT "
                         "(the input whose head outputs are patched in)")
    if args.source and args.method != "resample":
        raise UsageError("argument --source: only used with --method resample")
    if args.reference_file and args.method != "mean":
        raise UsageError("argument --reference-file: only used with --method mean")


def ablation_table(summary: dict) -> list[str]:
    """The numbers of an ablation's ``summary.json`` as a readable table, one line per row."""
    lines = [f"ablated {len(summary['heads'].split(','))} heads ({summary['heads']}) by {summary['method']}: "
             f"{summary.get('method_does', '')}".rstrip(": ")]
    rows: list[tuple[str, str, str, str]] = []
    if "text" in summary and summary["text"]:
        t = summary["text"]
        rows.append(("mean loss on the text (nats)", f"{t['mean_loss_clean']:.4f}", f"{t['mean_loss_ablated']:.4f}",
                     f"{t['mean_loss_ablated'] - t['mean_loss_clean']:+.4f}"))
        rows.append((f"p(next token {t['target_token']!r})", f"{t['target_prob_clean']:.4f}",
                     f"{t['target_prob_ablated']:.4f}", f"{t['target_prob_ablated'] - t['target_prob_clean']:+.4f}"))
    if "niah" in summary:
        n = summary["niah"]
        rows.append((f"NIAH accuracy ({n['n_prompts']} prompts)", f"{n['accuracy_clean']:.3f}",
                     f"{n['accuracy_ablated']:.3f}", f"{n['accuracy_ablated'] - n['accuracy_clean']:+.3f}"))
    if rows:
        width = max(len(r[0]) for r in rows)
        cols = [max(len(r[i]) for r in rows + [("", "clean", "ablated", "change")]) for i in (1, 2, 3)]
        lines.append(f"{'':<{width}}  {'clean':>{cols[0]}}  {'ablated':>{cols[1]}}  {'change':>{cols[2]}}")
        lines += [f"{r[0]:<{width}}  {r[1]:>{cols[0]}}  {r[2]:>{cols[1]}}  {r[3]:>{cols[2]}}".rstrip() for r in rows]
    t = summary.get("text") or {}
    for which in ("clean", "ablated"):
        if f"continuation_{which}" in t:
            shown = repr(t[f"continuation_{which}"])
            lines.append(f"continuation, {which + ':':<8} {shown if len(shown) <= 80 else shown[:77] + '...'}")
    if "curve" in summary:
        c = summary["curve"]
        outside = f" from outside the top {c['random_outside_top']}" if c.get("random_outside_top") else ""
        lines.append(f"top-k vs random curve: {c['metric']} with the top k heads by {c['by_label']} ablated, "
                     f"and k random heads{outside} ({c['n_seeds']} sets)")
        lines.append(f"{'k':>5}  {'top-k':>10}  {'random mean':>12}  {'± std':>8}")
        for k, top, mean, std in zip(c["k"], c["top"], c["random_mean"], c["random_std"], strict=True):
            lines.append(f"{k:>5}  {top:>10.4f}  {mean:>12.4f}  {std:>8.4f}")
    return lines


def _open_store_and_model(args):
    """The store of ``--home``, the ``--model`` spec and the loaded model, set as the app's context
    (the views that write exports read both from it)."""
    from headscope.analysis.models import load_model
    from headscope.app.context import AppContext, set_context

    store = _store(args)
    spec = _model_spec(args)
    set_context(AppContext(store=store, default_model=spec))
    with progress_bar("loading model") as bar, _argument("--model"):
        model = load_model(spec)
        bar(1.0)
    return store, spec, model


def _niah_sweep(model, args, store, needles, hay, lengths, depths):
    """The needle-in-a-haystack sweep of ``scan`` and ``ablate --sweep`` (stored trials are reused)."""
    from headscope.analysis.retrieval import sweep

    depth_rule = _depth_rule(args)
    with progress_bar(f"needle-in-a-haystack sweep ({len(needles)} needles × {len(lengths)} lengths × "
                      f"{len(depths)} depths)") as bar, _argument("--lengths/--depths/--needles"):
        return sweep(model, needles, lengths, depths, hay, store=store, depth_rule=depth_rule,
                     stop_at_newline=args.stop_at_newline, progress=bar)


def _ablation_spec(model, args, heads, store, reference):
    """The :class:`AblationSpec` of ``--method`` on ``heads``, and the page parameters naming it."""
    from headscope.analysis.ablation import LIMIT as ABLATION_LIMIT
    from headscope.analysis.ablation import AblationSpec, format_heads, head_means
    from headscope.analysis.capture import capture
    from headscope.analysis.limits import limit
    from headscope.app.views.ablation import builtin_reference

    params = {"model": _model_spec(args), "heads": format_heads(heads), "ablate": args.method}
    means = source = None
    if args.method == "mean":
        with progress_bar("reference means") as bar:
            means = head_means(model, reference or builtin_reference(), store=store, progress=bar)
        params["ref"] = means.key[:16]
    if args.method == "resample":
        with _argument("--source"):
            source_run = capture(model, args.source, store=store, max_tokens=limit(ABLATION_LIMIT),
                                 max_tokens_variable=ABLATION_LIMIT)
        source, params["source"] = tuple(source_run.token_ids), source_run.key[:16]
    spec = AblationSpec(tuple(heads), args.method, means=means, source_ids=source)
    spec.validate(model)
    return spec, params


def _niah_accuracy(model, spec, result, needles, lengths, depths) -> dict:
    """NIAH accuracy on the sweep's prompts, clean and with ``spec`` ablated, for ``summary.json``."""
    from headscope.analysis.ablation import ablation_hooks
    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.retrieval import trial_prompt

    prompts = [trial_prompt(t) for t in result.trials]
    with progress_bar("retrieval accuracy, clean and ablated") as bar:
        clean = retrieval_accuracy(model, prompts)
        bar(0.5)
        ablated = retrieval_accuracy(model, prompts, ablation_hooks(model, spec))
    return {"sweep": result.key, "needles": [n.id for n in needles], "lengths": lengths, "depths": depths,
            "n_prompts": len(prompts), "accuracy_clean": clean.accuracy, "accuracy_ablated": ablated.accuracy,
            "responses_ablated": ablated.responses}


def cmd_ablate(args) -> int:
    """Ablate heads: effects on a text, retrieval accuracy on a needle-in-a-haystack sweep, and the
    top-k vs random curve; writes tables (CSV, JSON) and figures, and prints the numbers as a table."""
    _check_ablate_args(args)
    text = read_text_file(args.file) if args.file else args.text
    reference = None
    if args.reference_file:
        reference = [t for t in read_text_file(args.reference_file).splitlines() if t.strip()]
    formats = _check_formats(args.formats)
    needles = hay = None
    if args.sweep:
        needles, hay = _needles(args), _haystack(args)
        _depth_rule(args)

    import json

    import numpy as np

    from headscope.analysis.ablation import LIMIT as ABLATION_LIMIT
    from headscope.analysis.ablation import METHOD_DESCRIPTIONS, format_heads, parse_heads
    from headscope.analysis.ablation_curve import ablation_curve, check_curve, rank_heads
    from headscope.analysis.capture import capture
    from headscope.analysis.errors import InputError
    from headscope.analysis.limits import limit
    from headscope.analysis.store import content_key
    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.registry import metric_scores

    lengths, depths = args.lengths or [512], args.depths or [25.0, 75.0]
    store, spec_name, model = _open_store_and_model(args)
    n_heads = model.n_layers * model.n_heads
    if args.top_k and args.top_k > n_heads:
        raise UsageError(f"argument --top-k: must be at most {n_heads} (the heads of {spec_name}), got {args.top_k}")
    if args.curve:
        with _argument("--curve"):  # checked before any long work
            check_curve(model, args.curve, args.seeds, args.control_top)
    with _argument("--heads"):
        heads = parse_heads(model, args.heads) if args.heads else None
    with _argument("--file" if args.file else "--text"):
        run = capture(model, text, store=store, max_tokens=limit(ABLATION_LIMIT),
                      max_tokens_variable=ABLATION_LIMIT) if text else None
    result = _niah_sweep(model, args, store, needles, hay, lengths, depths) if args.sweep else None
    scores, by_label = None, ""  # the scores heads are ranked by
    if args.top_k:
        if args.by == "retrieval":
            scores, by_label = np.nan_to_num(result.scores, nan=0.0), "Retrieval score"
        else:
            scores, by_label = metric_scores(run, args.by), HEAD_SCORES[args.by].label
        heads = rank_heads(scores)[: args.top_k]
        if len(heads) < args.top_k:
            raise InputError(f"Only {len(heads)} heads have a {by_label} here; --top-k must be at most that.")
    spec, params = _ablation_spec(model, args, heads, store, reference)
    out = Path(args.out) if args.out else store.root / "exports" / f"ablate-{content_key(params)[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": model.name, "model_digest": model.digest, "heads": format_heads(heads),
                     "method": args.method, "method_does": METHOD_DESCRIPTIONS[args.method],
                     "by": args.by if args.top_k else None}
    if run is not None:
        fig_rows = write_files(run, names.ABLATION_EFFECTS, params, out, formats)
        rows = json.loads(fig_rows[-2].read_text()) if fig_rows else []
        summary["text"] = rows[-1] if rows else {}
    if result is not None:
        summary["niah"] = _niah_accuracy(model, spec, result, needles, lengths, depths)
    if args.curve:
        seeds = list(range(args.seeds))
        with progress_bar(f"top-k vs random curve ({len(set(args.curve))} k × {1 + len(seeds)} sets)") as bar:
            key, curve, meta = ablation_curve(model, scores, args.curve, spec, store, on=result or run,
                                              by_label=by_label, seeds=seeds, outside_top=args.control_top,
                                              source_id=params.get("source"), progress=bar)
        write_files(None, names.ABLATION_CURVE, {**params, "curve": key[:16]}, out, formats)
        summary["curve"] = {"k": curve.k_values, "top": curve.top.tolist(), "random": curve.random.tolist(),
                            "random_mean": curve.random_mean.tolist(), "random_std": curve.random_std.tolist(),
                            "metric": meta["metric_label"], "by_label": by_label, "n_seeds": len(seeds),
                            "random_outside_top": curve.outside_top,
                            "top_heads": format_heads(curve.order[: max(curve.k_values)])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for line in ablation_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


BY_HELP = f"retrieval (needs --sweep) or a per-head score on the text: {', '.join(RUN_SCORES)}"
METRIC_HELP = f"the per-head score (default entropy; the Attention page's metrics: {', '.join(RUN_SCORES)})"


def text_score(text: str) -> str:
    """``--metric``: a per-head score of one text (:data:`headscope.analysis.score_registry.RUN_SCORES`)."""
    if text not in RUN_SCORES:
        raise argparse.ArgumentTypeError(f"unknown score {text[:40]!r}; choose one of {', '.join(RUN_SCORES)}")
    return text


def rank_score(text: str) -> str:
    """``--by``: ``retrieval`` (a sweep's) or a per-head score of the text."""
    if text != "retrieval" and text not in RUN_SCORES:
        raise argparse.ArgumentTypeError(f"unknown score {text[:40]!r}; use retrieval or one of {', '.join(RUN_SCORES)}")
    return text


def ranking_list(text: str) -> list[str]:
    """``--rankings``: names of :data:`headscope.analysis.kv_compression_choices.RANKINGS`, comma-separated."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not items:
        raise argparse.ArgumentTypeError(f"give one or more rankings separated by commas, from "
                                         f"{', '.join(COMPRESS_RANKING_NAMES)}")
    unknown = [x for x in items if x not in COMPRESS_RANKING_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ranking(s) {', '.join(unknown)}; choose from "
                                         f"{', '.join(COMPRESS_RANKING_NAMES)}")
    return items


def share(text: str) -> float:
    """A number in [0, 1] (a tolerance on an accuracy)."""
    try:
        v = _number(text, float)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 <= v <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def export_choice(text: str) -> tuple[str, float | None, int | None]:
    """``--export RANKING[:FRACTION[:SEED]]``."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or parts[0] not in COMPRESS_RANKING_NAMES:
        raise argparse.ArgumentTypeError(f"write RANKING:FRACTION (e.g. retrieval:0.25, random:0.5:1 for a seed, "
                                         f"or all_streaming), with RANKING one of {', '.join(COMPRESS_RANKING_NAMES)}")
    try:
        fraction = _number(parts[1], float) if len(parts) > 1 else None
        seed = _number(parts[2]) if len(parts) > 2 else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; the fraction must be a number and the seed a whole number") from None
    if fraction is not None and not 0 <= fraction <= 1:
        raise argparse.ArgumentTypeError(f"the fraction must be between 0 and 1, got {parts[1]}")
    return parts[0], fraction, seed


def _check_compress_args(args) -> None:
    """What ``compress`` can check before anything is imported."""
    if args.text is not None and args.file:
        raise UsageError("give the text either with --text or with --file, not both")
    lengths = args.lengths or [2048]
    if args.sink + args.recent >= min(lengths):
        raise UsageError(f"argument --sink/--recent: S + W = {args.sink + args.recent} keeps every key of a "
                         f"{min(lengths)}-token prompt (nothing to compress, and no rows for the streaming score); "
                         "keep it below the shortest of --lengths")
    if args.export:
        ranking, fraction, seed = args.export
        if ranking not in args.rankings:
            raise UsageError(f"argument --export: {ranking} is not among --rankings ({', '.join(args.rankings)})")
        if fraction is not None and ranking not in ("all_full", "all_streaming") and fraction not in args.fractions:
            raise UsageError(f"argument --export: fraction {fraction:g} is not among --fractions "
                             f"({','.join(f'{f:g}' for f in args.fractions)})")
        if seed is not None and (ranking != "random" or not 0 <= seed < args.seeds):
            raise UsageError(f"argument --export: a seed is only for random, from 0 to {args.seeds - 1}")


def compression_table(summary: dict) -> list[str]:
    """The rows of a compression evaluation's ``summary.json`` as a readable table."""
    def num(x, fmt):
        return "—" if x is None or x != x else format(x, fmt)

    b = summary["baseline"]
    lines = [f"KV cache policies on {summary['model']}: streaming groups keep S={summary['sink_size']} sinks + "
             f"W={summary['recent_size']} recent tokens; KV memory for {b['kv_tokens']:,} tokens "
             f"(full: {b['kv_full_bytes'] / 2**20:.1f} MiB); loss and agreement on {summary['n_texts']} text(s), "
             f"NIAH accuracy on {summary['n_prompts']} prompt(s)"]
    head = ("ranking", "seed", "full", "KV frac", "KV MiB", "loss", "agree", "NIAH")
    rows = [("uncompressed", "", "1.00", "1.000", f"{b['kv_bytes'] / 2**20:.1f}", num(b["loss"], ".4f"),
             num(b["agreement"], ".3f"), num(b["niah_accuracy"], ".3f"))]
    for r in summary["rows"]:
        rows.append((r["ranking"], "" if r["seed"] is None else str(r["seed"]), f"{r['fraction_full']:.2f}",
                     f"{r['kv_fraction']:.3f}", f"{r['kv_bytes'] / 2**20:.1f}", num(r["loss"], ".4f"),
                     num(r["agreement"], ".3f"), num(r["niah_accuracy"], ".3f")))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True))))
    tol = summary["tolerance"]
    for ranking, best in summary["smallest_within_tolerance"].items():
        where = "none" if best is None else (f"KV fraction {best['kv_fraction']:.3f} (fraction full "
                                             f"{best['fraction_full']:.2f})")
        lines.append(f"smallest KV within {tol * 100:g} NIAH points of full, {ranking}: {where}")
    if not summary["complete"]:
        lines.append("cancelled: the table holds the policies that finished")
    return lines


def cmd_compress(args) -> int:
    """KV-cache compression from head classes: evaluate policies (ranking × fraction kept full) against
    the uncompressed model; writes compress.csv, summary.json, policies.json and a DuoAttention pattern
    folder, and prints the table."""
    _check_compress_args(args)
    text = read_text_file(args.file) if args.file else args.text
    formats = _check_formats(args.formats)
    needles, hay = _needles(args), _haystack(args)
    _depth_rule(args)

    import csv
    import json

    import numpy as np

    from headscope.analysis.capture import tokenize_input
    from headscope.analysis.kv_compression import export_policy
    from headscope.analysis.kv_compression_sweep import compress_sweep
    from headscope.analysis.store import content_key
    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.compress import pick_text

    lengths, depths = args.lengths or [2048], args.depths or [25.0, 75.0]
    store, spec, model = _open_store_and_model(args)
    with _argument("--file" if args.file else "--text"):
        text_ids = tokenize_input(model, text, model.n_ctx) if text else None
    result = _niah_sweep(model, args, store, needles, hay, lengths, depths)
    if not result.trials:
        print("headscope compress: no trial finished", file=sys.stderr)
        return 1
    texts = [text_ids] if text_ids else None
    seeds = list(range(args.seeds))
    n_policies = sum(1 if r.startswith("all_") else len(args.fractions) * (len(seeds) if r == "random" else 1)
                     for r in args.rankings)
    with progress_bar(f"{n_policies} policies on {len(result.trials)} prompts") as bar, \
            _argument("--rankings/--fractions"):
        stored = compress_sweep(model, result, args.rankings, args.fractions, seeds=seeds, sink_size=args.sink,
                                recent_size=args.recent, texts=texts, backend=args.backend, store=store,
                                progress=bar)
    curve = stored.curve
    key = content_key("compress", result.key, args.rankings, curve.meta["fractions"], seeds, args.sink,
                      args.recent, texts, *([args.backend] if args.backend != "auto" else []))
    out = Path(args.out) if args.out else store.root / "exports" / f"compress-{key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    rows = curve.rows()
    with open(out / "compress.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(curve.baseline.row()))
        writer.writeheader()
        writer.writerows(rows)
    best = {r: curve.smallest_within(r, args.tolerance) for r in args.rankings if r not in ("all_full",)}
    if args.export:
        chosen = curve.find(*args.export)
    else:  # the first score ranking's smallest policy within the tolerance, else its largest
        named = [r for r in args.rankings if r not in ("random", "all_full", "all_streaming")] or list(args.rankings)
        chosen = best.get(named[0]) or max((e for e in curve.evaluations if e.policy.ranking == named[0]),
                                           key=lambda e: e.memory.fraction, default=None)
    pattern = None
    if chosen is not None:
        pattern = out / "pattern"
        export_policy(chosen.policy, pattern, model_name=model.name)

    def finite(x):
        return None if x is None or x != x else x

    summary = {
        "model": model.name, "model_digest": model.digest, "sweep": result.key, "lengths": lengths, "depths": depths,
        "needles": [n.id for n in needles], "sink_size": args.sink, "recent_size": args.recent,
        "rankings": args.rankings, "fractions": curve.meta["fractions"], "seeds": seeds,
        "n_texts": curve.n_texts, "n_prompts": curve.n_prompts, "text": "given" if text_ids else "sweep prompts",
        "layout": curve.meta["layout"], "dtype_bytes": curve.meta["dtype_bytes"], "complete": curve.complete,
        "tolerance": args.tolerance, "backend": curve.meta["backend"],
        "baseline": {k: finite(v) for k, v in curve.baseline.row().items()},
        "rows": [{k: finite(v) for k, v in r.items()} for r in rows],
        "smallest_within_tolerance": {r: (None if e is None else {k: finite(v) for k, v in e.row().items()})
                                      for r, e in best.items()},
        "exported": None if chosen is None else {"folder": str(pattern), **chosen.row()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "policies.json").write_text(json.dumps([e.policy.to_json() for e in curve.evaluations]))
    np.savetxt(out / "retrieval_group_max.csv", result.group_max, delimiter=",", fmt="%.6f")
    if stored.key:  # the figures read the stored curve (a cancelled one is not stored)
        params = {"model": spec, "compress": stored.key[:16], "tolerance": args.tolerance,
                  "pick": None if chosen is None else pick_text(chosen)}
        write_files(None, names.COMPRESSION_PARETO, params, out, formats)
        if chosen is not None:
            write_files(None, names.COMPRESSION_POLICY, params, out, formats)
    for line in compression_table(summary):
        print(line)
    if chosen is not None:
        p = chosen.policy
        print(f"pattern folder ({p.ranking}{'' if p.seed is None else f' seed {p.seed}'}, fraction full "
              f"{p.fraction:g}, KV fraction {chosen.memory.fraction:.3f}): {pattern}")
    print(f"results in {out}")
    return 0


def answer_list(text: str) -> list[str]:
    """``--answers``: one or two answers separated by a comma, each kept exactly as typed (an answer
    that follows a space in the text is written with it: ``" Mary, John"``)."""
    items = text.split(",")
    if not 1 <= len(items) <= 2 or not all(item.strip() for item in items):
        raise argparse.ArgumentTypeError("give one or two answer tokens separated by a comma, the clean answer "
                                         "first, e.g. \" Mary, John\"")
    return items


_LAYER_HEAD = re.compile(r"^\s*([0-9]{1,9})\.([0-9]{1,9})\s*$")  # ASCII digits: not "٣" or "３"


def layer_head(text: str) -> tuple[int, int]:
    m = _LAYER_HEAD.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a head: write layer.head with the digits 0-9, "
                                         "e.g. 23.3")
    return int(m[1]), int(m[2])


def head_list(text: str) -> list[tuple[int, int]]:
    """``--path-from``, ``--path-to``: heads as layer.head, comma-separated (``0.1,3.2``), read by
    :func:`headscope.analysis.patching_choices.parse_head_pairs` as the Patching page reads them."""
    from headscope.analysis.errors import InputError
    from headscope.analysis.patching_choices import parse_head_pairs

    try:
        return parse_head_pairs(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


def patching_table(summary: dict) -> list[str]:
    """The numbers of a patching's ``summary.json``: the setting, the largest effects and the agreement."""
    lines = [f"{summary['direction']} {summary['site']}: {summary['unit']}",
             f"{summary['metric_label']} {' vs '.join(repr(a) for a in summary['answers'])}: "
             f"clean {summary['clean']:.4f}, corrupted {summary['corrupted']:.4f} (normalised: 1 and 0)"]
    top = summary.get("top_exact") or summary.get("top_attribution") or []
    has_exact, has_attr = "top_exact" in summary, "top_attribution" in summary
    if top:
        lines.append(f"largest effects ({'exact' if has_exact else 'attribution'} patching):")
        width = max(len(r["unit"]) for r in top)
        head = f"{'unit':<{width}}  {'exact':>9}" if has_exact else f"{'unit':<{width}}"
        lines.append(head + (f"  {'attribution':>11}" if has_attr else ""))
        for r in top:
            row = f"{r['unit']:<{width}}"
            if has_exact:
                row += f"  {r['exact']:>9.4f}"
            if has_attr:
                row += f"  {r['attribution']:>11.4f}"
            lines.append(row)
    a = summary.get("agreement")
    if a:
        lines.append(f"attribution vs exact over {a['n_units']} units: Pearson {a['pearson']:.3f}, "
                     f"Spearman {a['spearman']:.3f}, top-{a['k']} overlap {a['overlap']:.0%}")
    times = [f"exact {summary['seconds_exact']:.1f} s"] if has_exact else []
    if has_attr:
        times.append(f"attribution {summary['seconds_attribution']:.2f} s")
    lines.append("time: " + ", ".join(times) + (" (stored result)" if summary.get("reused") else ""))
    return lines


def _patch_prompts(args) -> None:
    """``--pair ID`` (a built-in pair, :mod:`headscope.analysis.patching_pairs`) or ``--clean``, ``--corrupted`` and
    ``--answers``, not both: fills the three from the pair."""
    given = [f"--{name}" for name in ("clean", "corrupted", "answers") if getattr(args, name) is not None]
    if args.pair is not None:
        if given:
            raise UsageError(f"argument --pair: a built-in pair brings its own prompts and answers; drop "
                             f"{', '.join(given)} or --pair")
        from headscope.analysis.patching_pairs import pair_by_id

        with _argument("--pair"):
            spec = pair_by_id(args.pair)
        args.clean, args.corrupted, args.answers = spec.clean, spec.corrupted, list(spec.answers)
        return
    for name in ("clean", "corrupted", "answers"):
        if getattr(args, name) is None:
            raise UsageError(f"argument --{name}: required (or --pair ID, one of the built-in prompt pairs)")


def cmd_patch(args) -> int:
    """Activation patching (and attribution patching) between a clean and a corrupted prompt; writes
    the map, the exact-vs-attribution scatter, their tables and ``summary.json``, and prints the top units."""
    _patch_prompts(args)
    if (args.path_from is None) != (args.path_to is None):
        missing = "--path-to" if args.path_to is None else "--path-from"
        raise UsageError(f"argument {missing}: path patching needs both --path-from (senders) and --path-to "
                         f"(receivers)")
    if args.path_from is not None:
        return _cmd_path_patch(args)
    if args.path_site is not None or args.freeze_mlps:
        raise UsageError(f"argument {'--path-site' if args.path_site is not None else '--freeze-mlps'}: only with "
                         f"--path-from and --path-to")
    if args.head is not None and args.site == "resid":
        raise UsageError("argument --head: the residual stream map is already per position; use --site z, q, k or v")
    if args.attribution_only and args.attribution:
        raise UsageError("argument --attribution-only: already includes --attribution")
    formats = _check_formats(args.formats)

    import json

    import numpy as np

    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.patching import unit_names

    store, spec, model = _open_store_and_model(args)
    from headscope.analysis.patching import activation_patching, load_patching, patching_key, prompt_pair
    from headscope.analysis.patching_choices import METRIC_LABELS

    # Checked in two steps so that the message names the argument to fix: the prompts (lengths,
    # differences) with a placeholder answer, then the answers.
    with _argument("--corrupted"):
        prompt_pair(model, args.clean, args.corrupted, [0])
    with _argument("--answers"):
        pair = prompt_pair(model, args.clean, args.corrupted, args.answers)
    attribution = args.attribution or args.attribution_only
    exact = not args.attribution_only
    reused = load_patching(store, patching_key(model, pair, args.site, args.direction, args.metric, args.head,
                                               attribution, exact)) is not None
    with progress_bar(f"{args.direction} {args.site}") as bar, _argument("--head" if args.head else "--metric"):
        result = activation_patching(model, list(pair.clean_ids), list(pair.corrupted_ids), list(pair.answers),
                                     site=args.site, direction=args.direction, metric=args.metric, head=args.head,
                                     attribution=attribution, exact=exact, store=store, progress=bar)
    out = Path(args.out) if args.out else store.root / "exports" / f"patch-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    params = {"model": spec, "patching": result.key[:16]}
    names_ = unit_names(result)
    summary: dict = {
        "patching": result.key, "pair": args.pair, "model": model.name, "model_digest": model.digest,
        "site": result.site,
        "direction": result.direction, "metric": result.metric, "metric_label": METRIC_LABELS[result.metric],
        "head": list(result.head) if result.head else None, "unit": result.unit,
        "clean_tokens": list(result.pair.clean_tokens), "corrupted_tokens": list(result.pair.corrupted_tokens),
        "differ": list(result.pair.differ), "answers": list(result.pair.answer_tokens),
        "clean": result.clean, "corrupted": result.corrupted, "reused": reused,
    }
    for which, arr in (("exact", result.values), ("attribution", result.attribution)):
        if arr is None:
            continue
        top = result.top_units(10, attribution=which == "attribution")
        flat_index = [int(np.ravel_multi_index(ix, arr.shape)) for ix, _ in top]
        summary[f"top_{which}"] = [
            {"unit": names_[i], "exact": None if result.values is None else float(result.values.ravel()[i]),
             "attribution": None if result.attribution is None else float(result.attribution.ravel()[i])}
            for i in flat_index]
    if result.values is not None:
        summary["seconds_exact"] = result.seconds - result.attribution_seconds
    if result.attribution is not None:
        summary["seconds_attribution"] = result.attribution_seconds
    if result.agreement is not None:
        a = result.agreement
        summary["agreement"] = {"pearson": a.pearson, "spearman": a.spearman, "k": a.k, "overlap": a.overlap,
                                "n_units": a.n_units}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_files(None, names.PATCHING_MAP, {**params, "show": None}, out, formats)
    if result.agreement is not None:
        write_files(None, names.PATCHING_AGREEMENT, params, out, formats)
    for line in patching_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


def _cmd_path_patch(args) -> int:
    """``headscope patch --path-from … --path-to …``: path patching (:func:`headscope.analysis.path_patching.path_patching`);
    prints the value and writes ``summary.json``."""
    for flag, given in (("--head", args.head is not None), ("--attribution", args.attribution),
                        ("--attribution-only", args.attribution_only), ("--site", args.site != "z")):
        if given:
            raise UsageError(f"argument {flag}: not with path patching (--path-from, --path-to; the receivers' "
                             f"input is --path-site)")
    import json

    from headscope.analysis.errors import check_head_index
    from headscope.analysis.patching_choices import KV_SITES, METRIC_LABELS

    site = args.path_site or "q"
    store, spec, model = _open_store_and_model(args)
    from headscope.analysis.patching import patching_metric, prompt_pair
    from headscope.analysis.path_patching import path_patching
    from headscope.analysis.store import content_key

    with _argument("--path-from"):
        for layer, head in args.path_from:
            check_head_index(model.n_layers, model.n_heads, layer, head)
    with _argument("--path-to"):
        n = model.n_kv_heads if site in KV_SITES else model.n_heads
        for layer, head in args.path_to:
            check_head_index(model.n_layers, n, layer, head)
    with _argument("--corrupted"):
        prompt_pair(model, args.clean, args.corrupted, [0])
    with _argument("--answers"):
        pair = prompt_pair(model, args.clean, args.corrupted, args.answers)
    with _argument("--metric"):
        patching_metric(args.metric, pair.answers)
    with _argument("--path-to"):
        result = path_patching(model, args.clean, args.corrupted, args.answers, args.path_from, args.path_to,
                               site=site, direction=args.direction, metric=args.metric, freeze_mlps=args.freeze_mlps)
    key = content_key("path-patching", model.digest, list(result.pair.clean_ids), list(result.pair.corrupted_ids),
                      list(result.pair.answers), result.senders, result.receivers, site, result.direction,
                      result.metric, result.freeze_mlps)
    out = Path(args.out) if args.out else store.root / "exports" / f"path-{key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    senders = ",".join(f"{la}.{h}" for la, h in result.senders)
    receivers = ",".join(f"{la}.{h}" for la, h in result.receivers)
    summary = {
        "path_patching": {"senders": [list(h) for h in result.senders], "receivers": [list(h) for h in result.receivers],
                          "site": site, "freeze_mlps": result.freeze_mlps},
        "pair": args.pair, "model": model.name, "model_digest": model.digest, "direction": result.direction,
        "metric": result.metric, "metric_label": METRIC_LABELS[result.metric],
        "clean_tokens": list(result.pair.clean_tokens), "corrupted_tokens": list(result.pair.corrupted_tokens),
        "differ": list(result.pair.differ), "answers": list(result.pair.answer_tokens),
        "clean": result.clean, "corrupted": result.corrupted, "patched": result.raw, "value": result.value,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    kv = " (key-value heads)" if site in KV_SITES else ""
    print(f"path patching, {result.direction}: {senders} -> {site} of {receivers}{kv}"
          f"{', MLPs frozen' if result.freeze_mlps else ''}")
    print(f"{METRIC_LABELS[result.metric]} {' vs '.join(repr(a) for a in result.pair.answer_tokens)}: "
          f"clean {result.clean:.4f}, corrupted {result.corrupted:.4f}, patched {result.raw:.4f}")
    print(f"value {result.value:.4f} (0 = corrupted, 1 = clean)")
    print(f"results in {out}")
    return 0


def cmd_compare(args) -> int:
    """Two stored runs compared head by head (:func:`headscope.analysis.run_comparison.compare_runs`): prints the
    heads whose score changed most (second − first); writes both grids with the change, one head's
    change in attention (``--head``), their tables and ``summary.json``."""
    formats = _check_formats(args.formats)

    import json

    import numpy as np

    from headscope.analysis.errors import InputError
    from headscope.analysis.run_comparison import compare_runs
    from headscope.app.context import AppContext, set_context
    from headscope.app.export import write_files
    from headscope.app.views import names

    metric = args.metric or "entropy"
    store = _store(args)
    from headscope.analysis.models import DEFAULT_MODEL

    context = AppContext(store=store, default_model=DEFAULT_MODEL)
    set_context(context)
    runs = []
    for which, run_id in (("first", args.first), ("second", args.second)):
        keys = [k for k in store.find(run_id) if (r := store.get(k)) is not None and r.kind in ("run", "stats_run")]
        run = context.run(keys[0]) if len(keys) == 1 else None
        if run is None:
            why = "matches several runs: give more of it" if len(keys) > 1 else "is no stored run"
            raise UsageError(f"argument {which}: {run_id!r} {why} (`headscope runs list` shows them)")
        runs.append(run)
    first, second = runs
    with _argument("--metric"):
        for run in runs:
            if metric not in run.metrics:
                compare_runs(first, second, metric)  # raises, naming the run that cannot compute it
    with _argument("second"):
        result = compare_runs(first, second, metric)
    # the manifest names the first run's model (checked when rebuilt); both runs are read from the store
    params = {"model": first.model_name, "first": first.key[:16], "second": second.key[:16], "metric": metric}
    if args.head is not None:
        with _argument("--head"):
            from headscope.analysis.run_comparison import attention_difference

            attention_difference(first, second, *args.head)
        params.update(layer=args.head[0], head=args.head[1])
    out = Path(args.out) if args.out else store.root / "exports" / f"compare-{first.short_id[:8]}-{second.short_id[:8]}"
    out.mkdir(parents=True, exist_ok=True)
    top = result.largest_changes(args.top)
    summary = {
        "first": first.key, "second": second.key, "first_model": first.model_name, "second_model": second.model_name,
        "kind": result.kind, "metric": metric, "metric_label": HEAD_SCORES[metric].label,
        "n_tokens": first.n_tokens, "differ": list(result.differ),
        "differ_tokens": [[first.tokens[i], second.tokens[i]] for i in result.differ],
        "largest_changes": [{"layer": c.layer, "head": c.head, "first": _finite(c.first), "second": _finite(c.second),
                             "change": _finite(c.change)} for c in top],
        "mean_abs_change": _finite(np.nanmean(np.abs(result.difference))) if np.isfinite(result.difference).any()
        else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        write_files(None, names.RUN_COMPARISON, params, out, formats)
        if args.head is not None:
            write_files(None, names.ATTENTION_DIFFERENCE, params, out, formats)
    except InputError as e:  # checked above; a run removed meanwhile
        raise UsageError(f"argument second: {e}") from None
    for line in comparison_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


def _finite(x) -> float | None:
    """A number for JSON: nan (a score the run's length cannot give) is null, not ``NaN``."""
    return float(x) if x == x else None


def _shown(x: float | None, sign: str = "") -> str:
    return "n/a" if x is None else f"{x:{sign}.4f}"


def comparison_table(summary: dict) -> list[str]:
    """``headscope compare``'s printed summary: what was compared, and the heads that changed most."""
    differ = summary["differ"]
    where = ", ".join(f"{i} {a!r} / {b!r}" for i, (a, b) in zip(differ[:6], summary["differ_tokens"][:6], strict=True))
    lines = [f"{summary['metric_label']}: {summary['kind']}, {summary['n_tokens']} tokens"
             + (f"; tokens differ at {len(differ)} position(s): {where}{' …' if len(differ) > 6 else ''}" if differ else ""),
             f"first  {summary['first'][:12]} ({summary['first_model']})",
             f"second {summary['second'][:12]} ({summary['second_model']})",
             f"mean |change| over heads {_shown(summary['mean_abs_change'])}; largest changes (second − first):",
             f"  {'head':>6} {'first':>9} {'second':>9} {'change':>9}"]
    lines += [f"  {c['layer']:>3}.{c['head']:<2} {_shown(c['first']):>9} {_shown(c['second']):>9} "
              f"{_shown(c['change'], '+'):>9}" for c in summary["largest_changes"]]
    return lines


def _niah_options(p: argparse.ArgumentParser, prefix: str) -> None:
    """The needle placement and decode stop of a sweep (``scan`` and ``ablate --sweep``)."""
    p.add_argument("--depth-rule",
                   help=prefix + "where the needle goes: the sentence boundary nearest to the depth (default) "
                        "or the previous one (at or before it)")
    p.add_argument("--stop-at-newline", action="store_true",
                   help=prefix + "stop each decode at the first newline after some text (the retrieval-head "
                                 "paper's rule; default: at EOS or after 32 tokens)")


MODEL_HELP = "model spec: an embedded model (smollm2-135m; gemma3-270m after `make gemma3`), a .gguf file, " \
             "a folder of safetensors (default: the embedded model; `headscope models` lists them)"


def _add_patch_parser(sub) -> None:
    """``headscope patch``: activation and attribution patching (:func:`headscope.analysis.patching.activation_patching`)."""
    p = sub.add_parser("patch", help="activation patching between a clean and a corrupted prompt: which heads "
                                     "(or residual positions) carry the answer")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--pair", type=non_empty("the pair id"),
                   help="a built-in prompt pair (data/patching/pairs.json: IOI name swaps, factual recall, "
                        "induction), instead of --clean, --corrupted and --answers")
    p.add_argument("--clean", type=text_arg, help="the clean prompt")
    p.add_argument("--corrupted", type=text_arg,
                   help="the corrupted prompt: the same number of tokens (e.g. a name swapped)")
    p.add_argument("--answers", type=answer_list,
                   help="the clean answer token, then the corrupted one, comma-separated and with their leading "
                        "space, e.g. \" Mary, John\"")
    p.add_argument("--site", choices=PATCH_SITES, default="z",
                   help="z: head outputs; q: queries; k, v: keys, values (per key-value head); resid: the "
                        "residual stream, layer × position (default z)")
    p.add_argument("--direction", choices=PATCH_DIRECTIONS, default="denoise",
                   help="denoise: clean activations into the corrupted run; noise: the reverse (default denoise)")
    p.add_argument("--metric", choices=PATCH_METRICS, default="logit_diff",
                   help="logit difference of the two answers, or the loss on the clean answer")
    p.add_argument("--head", type=layer_head, help="patch this head (layer.head) one position at a time")
    p.add_argument("--attribution", action="store_true",
                   help="also attribution patching (one forward and one backward pass) and its agreement")
    p.add_argument("--attribution-only", action="store_true", help="attribution patching alone (fast)")
    p.add_argument("--path-from", type=head_list,
                   help="path patching (Wang et al. 2022): sender heads layer.head, comma-separated; with --path-to")
    p.add_argument("--path-to", type=head_list,
                   help="path patching: receiver heads layer.head (key-value heads for --path-site k or v)")
    p.add_argument("--path-site", choices=PATH_SITES,
                   help="path patching: the receivers' input the path ends in: q, k or v (default q)")
    p.add_argument("--freeze-mlps", action="store_true",
                   help="path patching: freeze the MLPs too (only direct sender -> receiver paths; default: "
                        "MLPs recomputed, as in Wang et al.)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_patch)


def build_parser() -> argparse.ArgumentParser:
    """The command line's arguments, each with a type that checks it (nothing heavy is imported)."""
    parser = _Parser(prog="headscope", description="A workbench for attention heads.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--home", type=folder, help="store folder (default: $HEADSCOPE_HOME or the user data dir)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    p = sub.add_parser("worker", help="run the app's jobs as a Celery worker (needs HEADSCOPE_REDIS_URL)")
    p.add_argument("--concurrency", type=count(1), default=1,
                   help="long jobs (sweeps, curves, embeddings) at once: pool processes (default 1)")
    p.add_argument("--page-concurrency", type=count(0), default=1,
                   help="page callbacks at once, beside the jobs, so a long job never blocks a page "
                        "(default 1; 0: this worker takes no page callbacks)")
    p.add_argument("--device", type=device, default="cpu", help="torch device for models, e.g. cuda:0 (default cpu)")
    p.add_argument("--model", action="append", type=non_empty("the model spec"),
                   help="model to load before the pool forks (repeatable; default: the embedded model); "
                        "the first is the default model of jobs")
    p.add_argument("--name", type=non_empty("the worker name"), help="worker name (default headscope-<pid>); "
                                                                    "unique per host")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("run", help="run a text and write its results")
    p.add_argument("text", nargs="?", type=text_arg, metavar="TEXT")
    p.add_argument("--file", type=text_file, help="read the text from a UTF-8 file")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="", help="figure formats to write, e.g. svg,png,html")
    p.add_argument("--stats", action="store_true",
                   help="statistics mode at any length (attention through the kernels, no patterns kept); "
                        "texts above HEADSCOPE_MAX_TOKENS use it anyway")
    p.set_defaults(func=cmd_run)

    lengths = number_list(int, 1, what="token counts")
    depths = number_list(float, 0, 100, what="depths in percent")
    p = sub.add_parser("scan", help="needle-in-a-haystack sweep: retrieval scores per head")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--lengths", type=lengths, default=[512], help="context lengths in tokens, e.g. 512,1024")
    p.add_argument("--depths", type=depths, default=[10.0, 50.0, 90.0], help="needle depths in percent, e.g. 0,50,100")
    p.add_argument("--needles", default="", help="needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file, help="a JSON file of needles (fields: needle, question, answer)")
    p.add_argument("--haystack", type=haystack, default="prose", help="prose, passkey, or a UTF-8 text file")
    # S and W are kernels.statistics' DEFAULT_SINK_SIZE and DEFAULT_WINDOW, written out so --help does
    # not import torch (tests/app/test_cli.py checks they agree)
    p.add_argument("--sink", type=count(0), default=4, help="streaming score: S, the first tokens kept as sinks")
    p.add_argument("--window", type=count(1), default=64, help="streaming score: W, the recent window")
    _niah_options(p, "")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_scan)

    p = sub.add_parser("ablate", help="ablate heads: effects on a text or on needle-in-a-haystack retrieval, "
                                      "and the top-k vs random curve")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--heads", help="e.g. 12.3,14.1 or kv:20.1 (a key-value group) or 7.* (a layer)")
    p.add_argument("--top-k", type=count(1), help="ablate the k heads with the highest --by score")
    p.add_argument("--by", default="retrieval", type=rank_score, help=BY_HELP)
    p.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS)
    p.add_argument("--text", type=text_arg)
    p.add_argument("--file", type=text_file, help="read the text from a UTF-8 file")
    p.add_argument("--source", type=text_arg, help="resample: the text whose head outputs are patched in")
    p.add_argument("--reference-file", type=text_file,
                   help="mean: reference texts, one per line (default: built-in sentences)")
    p.add_argument("--sweep", action="store_true", help="measure needle-in-a-haystack retrieval accuracy")
    p.add_argument("--lengths", type=lengths, help="--sweep: context lengths in tokens (default 512)")
    p.add_argument("--depths", type=depths, help="--sweep: needle depths in percent (default 25,75)")
    p.add_argument("--needles", default="", help="--sweep: needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file,
                   help="--sweep: a JSON file of needles (fields: needle, question, answer)")
    p.add_argument("--haystack", type=haystack, help="--sweep: prose (default), passkey, or a UTF-8 text file")
    _niah_options(p, "--sweep: ")
    p.add_argument("--curve", type=number_list(int, 0, what="head counts"),
                   help="k values for the top-k vs random curve, e.g. 0,5,10,20")
    p.add_argument("--seeds", type=count(1, MAX_SEEDS), default=DEFAULT_SEEDS,
                   help=f"random head sets per k (1 to {MAX_SEEDS})")
    p.add_argument("--control-top", type=count(0), default=CONTROL_TOP_N,
                   help="--curve: the random heads are drawn from outside the top N heads by the score "
                        f"(default {CONTROL_TOP_N}; at least the largest k)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("compress", help="KV-cache compression from head classes: evaluate full/streaming policies "
                                        "per KV group (DuoAttention) by ranking and fraction kept full")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--rankings", type=ranking_list, default=list(COMPRESS_RANKINGS),
                   help=f"how KV groups are ranked, from {', '.join(COMPRESS_RANKING_NAMES)} "
                        f"(default {','.join(COMPRESS_RANKINGS)})")
    p.add_argument("--fractions", type=number_list(float, 0, 1, what="fractions"), default=list(COMPRESS_FRACTIONS),
                   help="shares of KV groups kept full, e.g. 0.1,0.25,0.5")
    p.add_argument("--seeds", type=count(1, MAX_SEEDS), default=DEFAULT_SEEDS, help="random policies per fraction")
    p.add_argument("--sink", type=count(0), default=DEFAULT_SINK_SIZE,
                   help=f"S: first tokens a streaming group keeps (default {DEFAULT_SINK_SIZE}, DuoAttention's)")
    p.add_argument("--recent", type=count(1), default=DEFAULT_RECENT_SIZE,
                   help=f"W: recent tokens a streaming group keeps (default {DEFAULT_RECENT_SIZE}, DuoAttention's)")
    p.add_argument("--text", type=text_arg, help="measure loss and agreement on this text (default: the sweep's prompts)")
    p.add_argument("--file", type=text_file, help="read that text from a UTF-8 file")
    p.add_argument("--lengths", type=lengths, help="sweep: context lengths in tokens (default 2048)")
    p.add_argument("--depths", type=depths, help="sweep: needle depths in percent (default 25,75)")
    p.add_argument("--needles", default="", help="sweep: needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file, help="sweep: a JSON file of needles")
    p.add_argument("--haystack", type=haystack, help="sweep: prose (default), passkey, or a UTF-8 text file")
    _niah_options(p, "sweep: ")
    p.add_argument("--backend", choices=COMPRESS_BACKENDS, default="auto",
                   help="eager: mask the attention scores (N × N per layer); statistics: the kernels' per-head key "
                        "mask (O(N) memory); auto (default): statistics mode above HEADSCOPE_MAX_TOKENS tokens or "
                        "on CUDA, where the model supports it")
    p.add_argument("--tolerance", type=share, default=DEFAULT_TOLERANCE,
                   help="report the smallest KV fraction whose NIAH accuracy is within this of full (default 0.05)")
    p.add_argument("--export", type=export_choice,
                   help="the policy written as the pattern folder, RANKING:FRACTION[:SEED] (default: the first score "
                        "ranking's smallest policy within --tolerance)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html",
                   help="figure formats of compression_pareto and compression_policy (default svg,html; none: '')")
    p.set_defaults(func=cmd_compress)

    _add_patch_parser(sub)

    p = sub.add_parser("compare", help="compare two stored runs head by head: the change of a per-head score "
                                       "(second - first) and of one head's attention")
    p.add_argument("first", type=non_empty("the first run id"), help="a stored run's id (`headscope runs list`)")
    p.add_argument("second", type=non_empty("the second run id"),
                   help="a run of the same length: another text on the same model, or the same text on a model "
                        "with the same tokenizer")
    p.add_argument("--metric", type=text_score, help=METRIC_HELP)
    p.add_argument("--head", type=layer_head, help="also this head's change in attention (layer.head)")
    p.add_argument("--top", type=count(1, 10_000), default=10, help="how many heads to print (default 10)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("models", help="list what can be loaded offline")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("runs", help="list or remove stored runs")
    p.add_argument("action", choices=["list", "rm"])
    p.add_argument("ids", nargs="*")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("figure", help="rebuild a figure from an export's manifest.json")
    p.add_argument("manifest")
    p.add_argument("--model", type=non_empty("the model spec"),
                   help="the model to rebuild with, when the manifest's is not on offer here (a .gguf file or "
                        "folder of its own: a manifest never names a path to load); its digest must match")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="")
    p.set_defaults(func=cmd_figure)
    return parser


def _is_user_error(e: BaseException) -> bool:
    """An error the user can fix: ours, analysis' InputError (any subclass, whichever module raised it), a
    manifest's, a model's or the store's."""
    if isinstance(e, (UsageError, argparse.ArgumentTypeError)):
        return True
    from headscope.analysis.errors import InputError
    from headscope.app.manifest_schema import ManifestError

    kinds = [InputError, ManifestError]
    # the rest are checked only where their module is loaded (importing it to check would load torch);
    # an error of that kind was raised by that module, so it is loaded
    for module, name in (("headscope.analysis.models", "ModelError"),
                         ("headscope.analysis.store", "StoreUnavailable"), ("headscope.analysis.store", "StoreWriteError"),
                         ("headscope.analysis.store", "StoreReadError")):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return isinstance(e, tuple(kinds))


def _quiet_libraries() -> None:
    """Off a terminal, silence transformers' and huggingface_hub's own progress bars (they write
    carriage returns into captured output)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # plain tqdm bars, e.g. transformers' GGUF conversion
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def _torch_cache_outside_tmp() -> None:
    """torch creates its compile cache folder when it is imported (``torch._dynamo.package`` asks
    ``torch._inductor`` for it), by default ``$TMPDIR/torchinductor_<user>``: a folder every command left in
    the temporary files, under a name any local user could create first. headscope compiles nothing with
    inductor; its processes (and the jobs and workers they start) keep that folder in headscope's own cache
    folder instead, unless ``TORCHINDUCTOR_CACHE_DIR`` names one."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import platformdirs

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(platformdirs.user_cache_dir("headscope"), "torchinductor")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _torch_cache_outside_tmp()  # before anything imports torch
    if not sys.stderr.isatty():
        _quiet_libraries()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("headscope: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_user_error(e):
            raise
        print(f"headscope {args.command}: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())

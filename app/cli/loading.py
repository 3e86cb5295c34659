"""The store of ``--home`` and the model of ``--model``, opened once the arguments are checked."""

from __future__ import annotations

import os

from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.terminal import progress_bar


def model_spec(args) -> str:
    """``--model``, or the default model (read from analysis only once it is imported)."""
    from headscope.analysis.models import DEFAULT_MODEL

    return args.model or DEFAULT_MODEL


def open_store(args):
    """The store of ``--home`` (else ``HEADSCOPE_HOME``, else the user data dir); UsageError if it cannot be used."""
    from headscope.analysis.store import Store

    try:
        return Store(args.home) if getattr(args, "home", None) else Store()
    except OSError as e:
        where = args.home or os.environ.get("HEADSCOPE_HOME") or "the user data dir"
        flag = "--home" if args.home else "HEADSCOPE_HOME"
        raise UsageError(f"{flag}: cannot use {where} as the store folder ({e.strerror or e}); "
                         "give a writable folder") from None


def open_store_and_model(args):
    """The store of ``--home``, the ``--model`` spec and the loaded model, set as the app's context
    (the views that write exports read both from it)."""
    from headscope.analysis.models import load_model
    from headscope.app.context import AppContext, set_context

    store = open_store(args)
    spec = model_spec(args)
    set_context(AppContext(store=store, default_model=spec))
    with progress_bar("loading model") as bar, argument("--model"):
        model = load_model(spec)
        bar(1.0)
    return store, spec, model

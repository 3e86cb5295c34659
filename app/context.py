"""Process-wide state of a running app: the store, the model specs on offer, limits.

Pages read it; ``headscope.app.server.create_app`` sets it. Models are loaded through ``headscope.analysis.models``,
which memoises them, so each is loaded once per process.

Models on offer (the allowlist, :func:`offered_model`): the embedded ones (an opt-in one such as
``gemma3-270m`` only when its package is installed), the server's default
(``headscope serve --model``), ``extra_models``, and the specs listed in ``HEADSCOPE_MODELS``
(comma-separated). A request naming anything else is refused with the same message whether or not
such a file or folder exists, so a request can neither load nor probe server paths.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from headscope.analysis.capture import Run, load_run
from headscope.analysis.limits import limit
from headscope.analysis.models import DEFAULT_MODEL, EMBEDDED, ModelError, offered_embedded
from headscope.analysis.statistics_run import StatsRun, load_stats_run
from headscope.analysis.store import Store, note_read


@dataclass
class AppContext:
    store: Store
    default_model: str = DEFAULT_MODEL
    extra_models: list[str] = field(default_factory=list)
    max_tokens: int = field(default_factory=lambda: limit("HEADSCOPE_MAX_TOKENS"))
    _runs: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def allowed_models(self) -> list[str]:
        """Every model spec a request may name (the default first)."""
        return list(dict.fromkeys([self.default_model, *self.extra_models, *offered_embedded(), *env_models()]))

    def model_options(self) -> list[dict[str, str]]:
        """The model dropdown's options: each spec, with the terms of its weights where they have
        any (an embedded model's ``terms``), so they are read where the model is chosen."""
        return [{"label": model_label(s), "value": s} for s in self.allowed_models()]

    def run(self, run_id: str) -> Run | StatsRun | None:
        """A stored run (patterns, or statistics for a long one) by full key or unique prefix
        (≥ 8 hex digits), cached in memory. Anything else (a number, an empty or short string, as a
        forged request may carry) is no run: ``None``, never the first cached run a short prefix matches."""
        if not isinstance(run_id, str) or len(run_id) < 8:
            return None
        with self._lock:
            for key in self._runs:
                if key.startswith(run_id):
                    self._runs.move_to_end(key)
                    return note_read(self._runs[key])  # a read of the store all the same (exports carry it)
        keys = self.store.find(run_id)
        if len(keys) != 1:
            return None
        run = load_run(self.store, keys[0]) or load_stats_run(self.store, keys[0])
        if run is not None:
            self.remember(run)
        return run

    def remember(self, run: Run | StatsRun) -> None:
        """Keep ``run`` in memory; drop the least recently used runs beyond 16 or beyond
        ``HEADSCOPE_RUN_CACHE_MB`` (runs are read into memory and verified, never memory-mapped, so
        the budget bounds what the server holds; the latest run is always kept)."""
        budget = run_cache_bytes()
        with self._lock:
            self._runs[run.key] = run
            self._runs.move_to_end(run.key)
            held = sum(run_bytes(r) for r in self._runs.values())
            while len(self._runs) > 1 and (len(self._runs) > 16 or held > budget):
                _, dropped = self._runs.popitem(last=False)
                held -= run_bytes(dropped)

    def cached_keys(self) -> list[str]:
        """Keys of the runs held in memory, least recently used first."""
        with self._lock:
            return list(self._runs)


def model_label(spec: str) -> str:
    """``spec``, followed by the terms its weights come under when it is an embedded model with terms."""
    terms = EMBEDDED[spec].terms if spec in EMBEDDED else None
    return f"{spec} — {terms}" if terms else spec


def run_cache_bytes() -> float:
    """``HEADSCOPE_RUN_CACHE_MB`` (default 2048, fractions allowed) in bytes, read when checked."""
    try:
        mb = float(os.environ.get("HEADSCOPE_RUN_CACHE_MB", "2048"))
    except ValueError:
        mb = 2048.0
    return (mb if mb > 0 else 2048.0) * 2**20


def run_bytes(run: Run | StatsRun) -> int:
    """Bytes of the arrays a run holds (patterns or statistics, loss, top-k; dicts of arrays too)."""
    total = 0
    for value in vars(run).values():
        for item in value.values() if isinstance(value, dict) else (value,):
            if isinstance(item, np.ndarray):
                total += item.nbytes
    return total


def env_models() -> list[str]:
    """The specs listed in ``HEADSCOPE_MODELS`` (comma-separated), read when checked."""
    return [s.strip() for s in os.environ.get("HEADSCOPE_MODELS", "").split(",") if s.strip()]


def offered_model(spec: object) -> str:
    """``spec`` if this server offers it (``None`` or empty: the default model); else ``ModelError``.

    The one check for a model named by a request (a dropdown's value, a link's ``model=``). The
    message is the same for every refused value: it never says whether a path exists.
    """
    allowed = _context.allowed_models() if _context is not None else AppContext.allowed_models(_Defaults())
    if spec is None or spec == "":
        return allowed[0]
    if isinstance(spec, str) and spec.strip() in allowed:
        return spec.strip()
    shown = spec[:60] if isinstance(spec, str) else type(spec).__name__
    raise ModelError(f"Cannot load model {shown!r}: it is not offered by this server; choose one of {', '.join(allowed)}. "
                     "To offer another model, start the server with `headscope serve --model SPEC` "
                     "or list it in HEADSCOPE_MODELS.")


def dropdown_model(spec: str, problems: list[str]) -> str:
    """The model dropdown's value for a run made with ``spec``: ``spec`` when this server offers it;
    else the default, with a line in ``problems`` (a run made by the CLI or another server may name a
    model this one does not offer; putting it in the dropdown would make the next Run refused)."""
    try:
        return offered_model(spec)
    except ModelError:
        default = offered_model(None)
        problems.append(f"This run was made with a model this server does not offer; Run uses {default}. "
                        "To offer the run's model, start the server with `headscope serve --model SPEC` "
                        "or list it in HEADSCOPE_MODELS.")
        return default


@dataclass
class _Defaults:  # the allowlist's inputs before any app set a context (no store needed)
    default_model: str = DEFAULT_MODEL
    extra_models: list[str] = field(default_factory=list)


_context: AppContext | None = None


def set_context(ctx: AppContext) -> None:
    global _context
    _context = ctx


def get_context() -> AppContext:
    global _context
    if _context is None:
        _context = AppContext(store=Store())
    return _context

"""Process-wide state of a running app: the store, the model specs on offer, limits.

Pages read it; ``app.server.create_app`` sets it. Models are loaded through ``analysis.models``,
which memoises them, so each is loaded once per process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from analysis.capture import Run, load_run
from analysis.limits import limit
from analysis.models import DEFAULT_MODEL, available_models
from analysis.statistics_run import StatsRun, load_stats_run
from analysis.store import Store


@dataclass
class AppContext:
    store: Store
    default_model: str = DEFAULT_MODEL
    extra_models: list[str] = field(default_factory=list)
    max_tokens: int = field(default_factory=lambda: limit("HEADSCOPE_MAX_TOKENS"))
    _runs: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def model_options(self) -> list[dict[str, str]]:
        specs = [self.default_model, *self.extra_models]
        specs += [m["spec"] for m in available_models() if m["spec"] not in specs]
        return [{"label": s, "value": s} for s in specs]

    def run(self, run_id: str) -> Run | StatsRun | None:
        """A stored run (patterns, or statistics for a long one) by full key or unique prefix
        (≥ 8 hex digits), cached in memory."""
        with self._lock:
            for key in self._runs:
                if key.startswith(run_id):
                    self._runs.move_to_end(key)
                    return self._runs[key]
        keys = self.store.find(run_id) if len(run_id) >= 8 else []
        if len(keys) != 1:
            return None
        run = load_run(self.store, keys[0]) or load_stats_run(self.store, keys[0])
        if run is not None:
            self.remember(run)
        return run

    def remember(self, run: Run | StatsRun) -> None:
        with self._lock:
            self._runs[run.key] = run
            self._runs.move_to_end(run.key)
            while len(self._runs) > 16:
                self._runs.popitem(last=False)


_context: AppContext | None = None


def set_context(ctx: AppContext) -> None:
    global _context
    _context = ctx


def get_context() -> AppContext:
    global _context
    if _context is None:
        _context = AppContext(store=Store())
    return _context

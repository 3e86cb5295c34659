"""One interface for both kinds of run, so the UI codes against it and never against a kind.

A :class:`headscope.analysis.capture.Run` keeps the full attention patterns ``A[l, h]`` of a short input; a
:class:`headscope.analysis.statistics_run.StatsRun` keeps per-row statistics, column sums and block-pooled
maps of a long one (the kernels' statistics mode). Both implement :class:`AttentionRun`: sizes,
tokens, loss, per-head scores by name (through the registry of head scores,
:mod:`headscope.analysis.score_registry`), attention received per key, sink positions and the
attention of a region, each with the same definition on both (tested equal on the same input in
``tests/analysis/test_statistics_run.py``). What only full patterns can give (rollout, flow,
attribution) is asked for through :meth:`AttentionRun.require_patterns`, which says why not.

:class:`RunRecord` holds what both kinds share as stored records (ids, sizes, the common part of
their metadata).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: The record kinds that are runs: :class:`headscope.analysis.capture.Run` and :class:`headscope.analysis.statistics_run.StatsRun`.
RUN_KINDS = ("run", "stats_run")


@runtime_checkable
class AttentionRun(Protocol):
    """What the app reads of a run (see the module docstring)."""

    key: str
    model_name: str
    model_digest: str
    token_ids: list[int]
    tokens: list[str]
    text: str | None
    settings: dict[str, Any]
    token_loss: np.ndarray  # [pos] cross-entropy of token pos given the tokens before it (nan at 0)
    top_ids: np.ndarray  # [pos, 5]
    top_probs: np.ndarray  # [pos, 5]
    seconds: float  # how long the forward pass took (nan when not timed)

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def short_id(self) -> str: ...
    @property
    def has_patterns(self) -> bool:
        """True when the full ``[layer, head, query, key]`` patterns are kept."""
    @property
    def block_size(self) -> int:
        """Side ``B`` of the blocks of :meth:`attention_overview` (1: every cell)."""
    @property
    def metrics(self) -> tuple[str, ...]:
        """Names of the head scores this run can give (:func:`headscope.analysis.score_registry.run_metrics`)."""
    @property
    def mode(self) -> str:
        """What was kept, in words (the CLI prints it)."""
    @property
    def layer_windows(self) -> list[int | None] | None:
        """Per layer the sliding window in keys the model attended with (None: full attention),
        from :attr:`headscope.analysis.model_facts.ModelFacts.windows` at capture; None when no layer has one."""

    def require_patterns(self, what: str) -> None:
        """Nothing when full patterns are kept; else an ``InputError`` saying ``what`` needs them."""

    def head_scores(self, metric: str, model: Any = None) -> np.ndarray:
        """``[layer, head]`` score ``metric`` (a name in :attr:`metrics`); ``model`` for a score that needs
        the model (default: the run's own, loaded)."""

    def received_attention(self) -> np.ndarray:
        """``[layer, head, n]`` ``Σ_{i>j} A[i, j] / (n − 1 − j)``; nan at the last position."""

    def sink_counts(self) -> np.ndarray:
        """``[n]`` number of heads for which each position is a sink (:func:`headscope.analysis.streaming.sink_map`)."""

    def attention_overview(self, layer: int, head: int) -> np.ndarray:
        """One head's attention at a glance: ``A[l, h]`` itself, or its mean per ``B × B`` block."""

    def attention_region(self, layer: int, head: int, queries: tuple[int, int], keys: tuple[int, int],
                         model: Any = None) -> np.ndarray:
        """Exact ``A[l, h][q0:q1, k0:k1]`` (half-open); ``model`` for a run that must recompute it."""

    def kept_arrays(self) -> dict[str, np.ndarray]:
        """The attention arrays this run keeps, by file name (what ``headscope run`` writes)."""

    def meta(self) -> dict[str, Any]: ...


@dataclass
class RunRecord:
    """What both run kinds share as stored records: ids, the token count and common metadata."""

    key: str
    model_name: str
    model_digest: str
    token_ids: list[int]
    tokens: list[str]
    text: str | None
    settings: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def short_id(self) -> str:
        return self.key[:12]

    @property
    def layer_windows(self) -> list[int | None] | None:
        return self.settings.get("layer_windows")

    def common_meta(self) -> dict[str, Any]:
        """The metadata every run stores (its kind adds a version and its own fields after it)."""
        return {
            "model_name": self.model_name,
            "model_digest": self.model_digest,
            "token_ids": self.token_ids,
            "tokens": self.tokens,
            "text": self.text,
            "settings": self.settings,
            "n_tokens": self.n_tokens,
        }


@dataclass(frozen=True)
class StoredRun:
    """A stored run as ``headscope runs list`` shows it, from its metadata alone (no array is read)."""

    key: str
    kind: str
    created: float
    model_name: str
    n_tokens: int
    text: str | None

    @property
    def statistics(self) -> bool:
        """True for a run kept as statistics (a long input), not full patterns."""
        return self.kind == "stats_run"


def _listed(record: Any) -> StoredRun:
    """``record`` (metadata only) as a :class:`StoredRun`; ``ValueError`` naming the field a run's
    metadata lacks or holds with the wrong type (a row that rotted inside: SQLite's quick check
    passes it)."""
    meta = record.meta
    name, n_tokens, text = meta.get("model_name"), meta.get("n_tokens"), meta.get("text")
    if not isinstance(name, str) or not name:
        raise ValueError("its metadata has no model name")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError("its metadata has no token count")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"its metadata's text is {type(text).__name__}, not text")
    if not 0 <= record.created < 2**33:  # a time a clock can show (nan and inf fail too)
        raise ValueError(f"its creation time {record.created!r} is not a time")
    return StoredRun(record.key, record.kind, record.created, name, n_tokens, text)


def stored_runs(store: Any, limit: int = 1000) -> tuple[list[StoredRun], list[str]]:
    """The stored runs of both kinds, newest first (at most ``limit``), and one line for each run
    that could not be listed: its id and what is wrong with its row. A bad row is reported and left
    out; it never hides the others.

    Parameters
    ----------
    store : :class:`headscope.analysis.store.Store`
    limit : the most runs listed.

    Returns
    -------
    (runs, skipped) : the listed runs, and one line (``<id>: <why>``) per skipped row.
    """
    records, unreadable = [], []
    for kind in RUN_KINDS:
        records += store.list(kind, limit=limit, skipped=unreadable)
    skipped = [f"{row.key[:16]}: {row.reason}" for row in unreadable]
    runs = []
    for record in sorted(records, key=lambda r: r.created, reverse=True)[:limit]:
        try:
            runs.append(_listed(record))
        except ValueError as e:
            skipped.append(f"{record.key[:16]}: {e}")
    return runs, skipped

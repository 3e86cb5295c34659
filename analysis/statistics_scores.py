"""Per-head scores from a statistics run's kept statistics (statistics mode: no ``n × n`` matrix).

Each function reads a :class:`headscope.analysis.statistics_run.StatsRun` (per-row statistics, column
sums, pair terms and detection cells the kernels returned in the forward pass) and gives the same
number as the pattern-based definition it names, tested equal on runs short enough for both
(``tests/analysis/test_statistics_run.py``); :mod:`headscope.analysis.statistics_run` lists the
statistics each reads. The registry (:data:`headscope.analysis.score_registry.HEAD_SCORES`) says which
score each one computes; this module imports neither it nor ``statistics_run``, so the run module
can dispatch through the registry without an import circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from headscope.analysis.entropy import mean_normalised_entropy
from headscope.analysis.errors import InputError
from headscope.analysis.streaming import SINK_MIN_LATER, mid_sink_score, received_from_columns, unbound_rows

ROW_MEANS = {"prev": "previous_token", "argmax_prob": "max_attention"}
"""Row statistics whose mean over rows 1..n−1 is a score: ``A[i, i−1]`` and the row's largest weight."""


def _nan(run: Any) -> np.ndarray:
    return np.full((run.n_layers, run.n_heads), np.nan)


def received(run: Any) -> np.ndarray:
    """``[layer, head, n]`` attention received from strictly later queries, averaged over those that
    see the key (:func:`headscope.analysis.streaming.sink_map`'s ``received``): ``(Σ_i A[i, j] − A[j, j]) /
    v_l(j)`` from the column sums and the diagonal pair term; nan at the last position."""
    if "received" not in run._memo:
        column = run.col_sum.astype(np.float64) - run.rows["diag"].astype(np.float64)
        run._memo["received"] = received_from_columns(column, run.layer_windows)
    return run._memo["received"]


def entropy_from_statistics(run: Any) -> np.ndarray:
    """Normalised entropy: ``mean H_i / log(v_i)`` over rows with ``v_i ≥ 2`` visible keys, ``H_i`` the
    kernel's row entropy (:func:`headscope.analysis.entropy.mean_normalised_entropy`)."""
    return mean_normalised_entropy(run.rows["entropy"], run.layer_windows)


def row_mean_from_statistics(run: Any, row: str) -> np.ndarray:
    """``mean_{i≥1}`` of a row statistic of :data:`ROW_MEANS` (previous-token: ``A[i, i−1]``, a pair term;
    max attention: the kernel's argmax probability); nan for a single token."""
    if row not in ROW_MEANS:
        raise ValueError(f"no score is the mean of the row statistic {row!r}; choose one of {', '.join(ROW_MEANS)}")
    if run.n_tokens < 2:
        return _nan(run)
    return run.rows[row][..., 1:].astype(np.float64).mean(-1)


def first_token_from_statistics(run: Any) -> np.ndarray:
    """``mean_{1≤i<min(n, W_l)} A[i, 0]``: the rows that see key 0 (``W_l`` the layer's model window)."""
    n = run.n_tokens
    if n < 2:
        return _nan(run)
    windows = run.layer_windows or [None] * run.n_layers
    return np.stack([run.rows["first"][la, :, 1 : min(n, w) if w else n].astype(np.float64).mean(-1)
                     for la, w in enumerate(windows)])


def streaming_from_statistics(run: Any, sink: int | None = None, window: int | None = None) -> np.ndarray:
    """``mean_{S+W≤i<min(n, W_l)} (Σ_{j<S} A[i, j] + Σ_{i−W<j≤i} A[i, j])`` from the sink and recent
    masses (:func:`headscope.analysis.streaming.streaming_score`). ``sink``/``window`` must be the run's
    own S and W (None: the run's), as the masses were taken with them."""
    S, W = run.settings["sink"], run.settings["window"]
    if (sink is not None and sink != S) or (window is not None and window != W):
        raise InputError(f"This run's masses were taken with S={S}, W={W}; capture it again for S={sink}, W={window}.")
    n = run.n_tokens
    out = _nan(run)
    for la, w in enumerate(run.layer_windows or [None] * run.n_layers):
        rows_read = unbound_rows(n, S, W, w)
        if len(rows_read):
            sl = slice(rows_read.start, rows_read.stop)
            out[la] = (run.rows["sink_mass"][la, :, sl].astype(np.float64)
                       + run.rows["recent_mass"][la, :, sl].astype(np.float64)).mean(-1)
    return out


def mid_sink_from_statistics(run: Any) -> np.ndarray:
    """The mid-sequence sink: the largest :func:`received` over the checked keys ``j ≥ 1``
    (:func:`headscope.analysis.streaming.mid_sink_score`)."""
    return mid_sink_score(received(run), SINK_MIN_LATER, run.layer_windows)


def detector_from_statistics(run: Any, kind: str) -> np.ndarray:
    """TransformerLens' ``mul`` detector score ``Σ_{D[i,j]=1} A[i, j] / Σ_ij A[i, j]``: the detection
    cells' weights, read exactly from the lse, over ``Σ_ij A[i, j] = n`` (every row sums to 1); nan for
    a single token or when the run kept no cells (too many of them)."""
    if run.n_tokens < 2 or kind not in run.detectors:
        return _nan(run)
    return run.detectors[kind] / run.n_tokens


def evidence_from_statistics(run: Any, question: tuple[int, int], evidence: Sequence[int]) -> np.ndarray:
    """``mean_{i∈Q} Σ_{j∈E} A[i, j]`` with ``E`` the union of the run's spans listed in ``evidence``
    (indices into ``settings["spans"]``; spans must not overlap)."""
    if run.span_mass is None:
        raise InputError("This run was captured without spans: no evidence score.")
    a, e = int(question[0]), int(question[1])
    if not 0 <= a < e <= run.n_tokens:
        raise InputError(f"The question span ({a}, {e}) is outside the {run.n_tokens}-token input.")
    mass = run.span_mass[:, :, a:e][..., list(evidence)].astype(np.float64).sum(-1)
    return mass.mean(-1)


def evidence_span_from_statistics(run: Any, question: tuple[int, int], evidence: tuple[int, int]) -> np.ndarray:
    """The evidence score of one evidence span, which the run must have been captured with (its masses)."""
    spans = [tuple(s) for s in run.settings.get("spans", [])]
    if tuple(evidence) not in spans:
        raise InputError(f"This run was captured without the evidence span {tuple(evidence)}: capture it with that "
                         "span to score it.")
    return evidence_from_statistics(run, question, [spans.index(tuple(evidence))])

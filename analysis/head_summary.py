"""Per-head summaries of one run's attention patterns, shown as the layer × head grid.

Each function maps a run's patterns ``[layer, head, query, key]`` (and, for the detectors, the token
ids the model saw) to ``[layer, head]``. The registry of head scores
(:data:`headscope.analysis.score_registry.HEAD_SCORES`) names the scores they compute; pages, exports
and the command line read it, not this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from headscope.analysis.detectors import head_detector_scores
from headscope.analysis.streaming import mid_sink_score, sink_map


def first_token_mass(patterns: np.ndarray, layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """Mean attention on key position 0 over the later query rows that see it (the attention-sink share).

    ``score(l, h) = mean_{1 ≤ i < min(N, W_l)} A[l, h][i, 0]``, ``W_l`` the model's sliding window of
    layer l (``layer_windows``; none on a full-attention layer, then rows 1..N−1): queries the window
    keeps away from position 0 are not counted as declining it. This is the sink map's
    ``received(l, h, 0)`` (:func:`headscope.analysis.streaming.sink_map`). nan for a single token.
    """
    p = np.asarray(patterns)
    n = p.shape[-1]
    if n < 2:
        return np.full(p.shape[:2], np.nan)
    windows = layer_windows or [None] * p.shape[0]
    return np.stack([np.asarray(p[layer, :, 1 : min(n, w) if w else n, 0], dtype=np.float64).mean(-1)
                     for layer, w in enumerate(windows)])


def previous_token_mass(patterns: np.ndarray) -> np.ndarray:
    """Mean attention of query i on key i-1 over rows 1..n-1 (a previous-token head scores near 1).

    ``score = (1/(n−1)) Σ_{i=1}^{n−1} A[i, i−1]``, per layer and head.

    Against TransformerLens' ``detect_head(..., "previous_token_head")`` (``head_detector.py``, the
    default ``error_measure="mul"``, ``exclude_bos=False``, ``exclude_current_token=False``): it
    scores ``Σ_{i,j} A[i, j] D[i, j] / Σ_{i,j} A[i, j]`` with ``D[i, i−1] = 1``; every row of A sums to
    1, so its denominator is n and its score is ``(n−1)/n`` times this one. Row 0 has no previous
    token: TransformerLens counts it as a miss, this score leaves it out, so a perfect previous-token
    head scores 1 here at any length (TransformerLens: ``1 − 1/n``). Multiply by ``(n−1)/n`` to
    compare with a TransformerLens number.
    """
    p = np.asarray(patterns)
    n = p.shape[-1]
    if n < 2:
        return np.full(p.shape[:2], np.nan)
    i = np.arange(1, n)
    return np.asarray(p[..., i, i - 1], dtype=np.float64).mean(-1)


def max_attention(patterns: np.ndarray) -> np.ndarray:
    """Mean over rows 1..n-1 of the row's largest weight (1 = always one key)."""
    p = np.asarray(patterns)
    if p.shape[-1] < 2:
        return np.full(p.shape[:2], np.nan)
    return np.asarray(p[..., 1:, :].max(-1), dtype=np.float64).mean(-1)


def mid_sequence_sink(patterns: np.ndarray, layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """The most attention any single non-first key receives, averaged over the later queries that see it.

    ``max_{j ≥ 1, v_l(j) ≥ m} received(l, h, j)`` with ``received`` and ``v_l(j)`` (later queries that
    see key j, fewer on a layer with a model window) from :func:`headscope.analysis.streaming.sink_map` and
    ``m = SINK_MIN_LATER`` (so the last few keys cannot win by having one or two queries after them).
    High = the head parks its attention on a mid-sequence sink (Gu et al. 2024, arXiv:2410.10781, §3);
    nan when the run is too short to have such a key, or the layer's window is at most m keys.
    """
    p = np.asarray(patterns)
    return mid_sink_score(sink_map(p, layer_windows=layer_windows).received, layer_windows=layer_windows)


def detection_score(patterns: np.ndarray, token_ids: Sequence[int], kind: str) -> np.ndarray:
    """TransformerLens' ``head_detector`` score ``kind`` (``duplicate_token`` or ``induction``, error
    measure ``mul``) of every head (:func:`headscope.analysis.detectors.head_detector_scores`); nan for a
    single token, which has no earlier key to detect."""
    p = np.asarray(patterns)
    if p.shape[-1] < 2:
        return np.full(p.shape[:2], np.nan)
    return head_detector_scores(p, token_ids, kind)

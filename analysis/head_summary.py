"""Per-head summaries of one run, shown as the layer × head grid.

Each metric maps a run's patterns ``[layer, head, query, key]`` and the token ids the model saw to
``[layer, head]``. The registry is the one place that names them: pages, exports and the CLI read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from headscope.analysis.detectors import head_detector_scores
from headscope.analysis.entropy import normalised_entropy
from headscope.analysis.streaming import (
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    SINK_MIN_LATER,
    mid_sink_score,
    sink_map,
    streaming_score,
)


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


@dataclass(frozen=True)
class HeadMetric:
    """A named per-head score: ``compute(patterns [L, H, N, N], token_ids [N], windows) -> [L, H]``
    with ``windows`` the per-layer sliding windows (:attr:`headscope.analysis.model_facts.ModelFacts.windows`;
    None: all full attention). ``windowed`` says, in words, how the score treats a layer the model
    windows ("" when it reads such a layer like any other); the grid shows it beside windowed layers."""

    name: str
    label: str
    compute: Callable[..., np.ndarray]
    description: str
    windowed: str = ""


def _patterns_only(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda patterns, token_ids=(), windows=None: fn(patterns)


def _with_windows(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda patterns, token_ids=(), windows=None: fn(patterns, layer_windows=windows)


def _entropy(patterns: np.ndarray, token_ids: Sequence[int] = (), windows=None) -> np.ndarray:
    return normalised_entropy(patterns, windows)


def _detector(kind: str) -> Callable[..., np.ndarray]:
    def compute(patterns: np.ndarray, token_ids: Sequence[int], windows=None) -> np.ndarray:
        if np.asarray(patterns).shape[-1] < 2:
            return np.full(np.asarray(patterns).shape[:2], np.nan)
        return head_detector_scores(patterns, token_ids, kind)

    return compute


HEAD_METRICS: dict[str, HeadMetric] = {
    m.name: m
    for m in [
        HeadMetric("entropy", "Normalised entropy", _entropy,
                   "Mean row entropy / log(visible keys): 0 = one key, 1 = uniform.",
                   "normalised by the keys the window leaves visible"),
        HeadMetric("first_token", "Attention on first token", _with_windows(first_token_mass),
                   "Mean attention on position 0 (sink share).",
                   "averaged over the queries the window lets see position 0"),
        HeadMetric("mid_sink", "Mid-sequence sink", _with_windows(mid_sequence_sink),
                   "Largest mean attention received by any key after position 0 (a mid-sequence sink).",
                   f"each key averaged over the queries that see it; blank: a window of {SINK_MIN_LATER} "
                   "keys or fewer checks none"),
        HeadMetric("previous_token", "Previous-token attention", _patterns_only(previous_token_mass),
                   "Mean attention from token i to token i-1."),
        HeadMetric("duplicate_token", "Duplicate-token score", _detector("duplicate_token"),
                   "Share of attention on earlier copies of the current token (TransformerLens head_detector)."),
        HeadMetric("induction", "Induction score", _detector("induction"),
                   "Share of attention on the token after an earlier copy of the current token "
                   "(TransformerLens head_detector; needs repeated text to fire)."),
        HeadMetric("max_attention", "Max attention", _patterns_only(max_attention),
                   "Mean of each row's largest weight."),
        HeadMetric("streaming", "Streaming score", _with_windows(streaming_score),
                   f"Share of attention on the first {DEFAULT_SINK} tokens plus the last {DEFAULT_WINDOW} "
                   "(DuoAttention's sink + recent window): high = streaming head, low = needs full context.",
                   "scored only on rows from S+W until the window binds (they still see every key), so "
                   "locality the model forces is not counted; blank: the window binds before row S+W"),
    ]
}

"""Per-head summaries of one run, shown as the layer × head grid.

Each metric maps a run's patterns ``[layer, head, query, key]`` and the token ids the model saw to
``[layer, head]``. The registry is the one place that names them: pages, exports and the CLI read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from analysis.detectors import head_detector_scores
from analysis.entropy import normalised_entropy
from analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW, SINK_MIN_LATER, sink_map, streaming_score


def first_token_mass(patterns: np.ndarray) -> np.ndarray:
    """Mean attention on key position 0 over query rows 1..n-1 (the attention-sink share)."""
    p = np.asarray(patterns)
    if p.shape[-1] < 2:
        return np.full(p.shape[:2], np.nan)
    return np.asarray(p[..., 1:, 0], dtype=np.float64).mean(-1)


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


def mid_sequence_sink(patterns: np.ndarray) -> np.ndarray:
    """The most attention any single non-first key receives, averaged over later queries.

    ``max_{1 <= j < N - m} received(l, h, j)`` with ``received`` from :func:`analysis.streaming.sink_map`
    and ``m = SINK_MIN_LATER`` later queries at least (so the last few keys cannot win by having one
    or two queries after them). High = the head parks its attention on a mid-sequence sink
    (Gu et al. 2024, arXiv:2410.10781, §3); nan when the run is too short to have such a key.
    """
    p = np.asarray(patterns)
    n = p.shape[-1]
    if n < SINK_MIN_LATER + 2:
        return np.full(p.shape[:2], np.nan)
    received = sink_map(p).received
    return received[..., 1 : n - SINK_MIN_LATER].max(-1)


@dataclass(frozen=True)
class HeadMetric:
    """A named per-head score: ``compute(patterns [L, H, N, N], token_ids [N], windows) -> [L, H]``
    with ``windows`` the per-layer sliding windows (:attr:`analysis.model_facts.ModelFacts.windows`;
    None: all full attention), which only entropy reads."""

    name: str
    label: str
    compute: Callable[..., np.ndarray]
    description: str


def _patterns_only(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda patterns, token_ids=(), windows=None: fn(patterns)


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
                   "Mean row entropy / log(visible keys): 0 = one key, 1 = uniform."),
        HeadMetric("first_token", "Attention on first token", _patterns_only(first_token_mass),
                   "Mean attention on position 0 (sink share)."),
        HeadMetric("mid_sink", "Mid-sequence sink", _patterns_only(mid_sequence_sink),
                   "Largest mean attention received by any key after position 0 (a mid-sequence sink)."),
        HeadMetric("previous_token", "Previous-token attention", _patterns_only(previous_token_mass),
                   "Mean attention from token i to token i-1."),
        HeadMetric("duplicate_token", "Duplicate-token score", _detector("duplicate_token"),
                   "Share of attention on earlier copies of the current token (TransformerLens head_detector)."),
        HeadMetric("induction", "Induction score", _detector("induction"),
                   "Share of attention on the token after an earlier copy of the current token "
                   "(TransformerLens head_detector; needs repeated text to fire)."),
        HeadMetric("max_attention", "Max attention", _patterns_only(max_attention),
                   "Mean of each row's largest weight."),
        HeadMetric("streaming", "Streaming score", _patterns_only(streaming_score),
                   f"Share of attention on the first {DEFAULT_SINK} tokens plus the last {DEFAULT_WINDOW} "
                   "(DuoAttention's sink + recent window): high = streaming head, low = needs full context."),
    ]
}

"""Per-head summaries of one run, shown as the layer × head grid.

Each metric maps a run's patterns ``[layer, head, query, key]`` to ``[layer, head]``. The registry is
the one place that names them: pages, exports and the CLI read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from analysis.entropy import normalised_entropy
from analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW, streaming_score


def first_token_mass(patterns: np.ndarray) -> np.ndarray:
    """Mean attention on key position 0 over query rows 1..n-1 (the attention-sink share)."""
    p = np.asarray(patterns)
    if p.shape[-1] < 2:
        return np.full(p.shape[:2], np.nan)
    return np.asarray(p[..., 1:, 0], dtype=np.float64).mean(-1)


def previous_token_mass(patterns: np.ndarray) -> np.ndarray:
    """Mean attention of query i on key i-1 over rows 1..n-1 (a previous-token head scores near 1)."""
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


@dataclass(frozen=True)
class HeadMetric:
    name: str
    label: str
    compute: Callable[[np.ndarray], np.ndarray]
    description: str


HEAD_METRICS: dict[str, HeadMetric] = {
    m.name: m
    for m in [
        HeadMetric("entropy", "Normalised entropy", normalised_entropy,
                   "Mean row entropy / log(visible keys): 0 = one key, 1 = uniform."),
        HeadMetric("first_token", "Attention on first token", first_token_mass,
                   "Mean attention on position 0 (sink share)."),
        HeadMetric("previous_token", "Previous-token attention", previous_token_mass,
                   "Mean attention from token i to token i-1."),
        HeadMetric("max_attention", "Max attention", max_attention,
                   "Mean of each row's largest weight."),
        HeadMetric("streaming", "Streaming score", streaming_score,
                   f"Share of attention on the first {DEFAULT_SINK} tokens plus the last {DEFAULT_WINDOW} "
                   "(DuoAttention's sink + recent window): high = streaming head, low = needs full context."),
    ]
}

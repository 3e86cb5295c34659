"""Normalised attention entropy per head.

For a causal pattern row i (query i sees keys 0..i), the row entropy is
``H_i = -Σ_j A[i, j] log A[i, j]``; normalised by its maximum ``log(i + 1)`` (uniform over the visible
keys) it lies in [0, 1]: 0 = all attention on one key, 1 = uniform. A head's score is the mean of
``H_i / log(i + 1)`` over rows with at least two visible keys (row 0 has one key and no entropy to
normalise). See DESIGN.md, "Entropy".
"""

from __future__ import annotations

import numpy as np


def row_entropy(patterns: np.ndarray, chunk: int = 64) -> np.ndarray:
    """Row entropies in nats, ``[..., query]`` for ``patterns`` of shape ``[..., query, key]``."""
    patterns = np.asarray(patterns)
    out = np.empty(patterns.shape[:-1], dtype=np.float64)
    # Chunk over queries: a float64 copy of a whole [30, 9, N, N] array would be large.
    for start in range(0, patterns.shape[-2], chunk):
        a = np.asarray(patterns[..., start : start + chunk, :], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0)
        out[..., start : start + chunk] = -terms.sum(-1)
    return out


def normalised_entropy(patterns: np.ndarray) -> np.ndarray:
    """Mean normalised row entropy per head.

    Parameters
    ----------
    patterns : ``[layer, head, query, key]`` causal post-softmax attention (query i sees keys ≤ i,
        queries and keys aligned: the run's own positions).

    Returns
    -------
    ``[layer, head]`` in [0, 1]; nan when the sequence has a single token.
    """
    patterns = np.asarray(patterns)
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [layer, head, n, n], got shape {patterns.shape}")
    n = patterns.shape[-1]
    if n < 2:
        return np.full(patterns.shape[:2], np.nan)
    h = row_entropy(patterns)[..., 1:]  # rows 1..n-1 see 2..n keys
    norm = np.log(np.arange(2, n + 1, dtype=np.float64))
    return (h / norm).mean(-1)

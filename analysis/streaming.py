"""Streaming heads and attention sinks.

**Streaming score** — the training-free form of DuoAttention's split (Xiao et al. 2024,
"DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads",
arXiv:2410.10819): a *streaming head* only needs the attention sinks and a recent window (the
StreamingLLM pattern, Xiao et al. 2023, arXiv:2309.17453). DuoAttention learns a gate per head; here
the split is measured directly from a run's patterns. For query row i and sink/window sizes S, W,

    m_i = Σ_{j < S} A[i, j]  +  Σ_{i − W < j ≤ i} A[i, j]

(the first S keys plus the last W keys up to and including the query itself; the two sets are
disjoint because only rows ``i >= S + W`` are used), and

    streaming(l, h) = mean_{i = S+W .. N−1} m_i.

High (near 1) = the head would lose almost nothing with a sink + window cache; low = it needs the
full context.

**Sink map** — attention received per key position, averaged over later queries (Xiao et al. 2023;
Gu et al. 2024, "When Attention Sink Emerges in Language Models", arXiv:2410.10781):

    received(l, h, j) = mean_{i > j} A[l, h][i, j]      (nan for the last position).

A key is flagged as a sink of head (l, h) when ``received >= threshold`` (default 0.2: on average
the key takes at least a fifth of every later query's attention, far above a uniform share once
queries have more than a handful of keys) and at least ``min_later`` queries follow it (default 16,
so that a key near the end, seen by a few queries of a local head, is not flagged). Every position
is tested, so sinks in the middle of the sequence (often the first newline or full stop) are
flagged as well as position 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kernels.statistics import DEFAULT_SINK_SIZE, DEFAULT_WINDOW

DEFAULT_SINK = DEFAULT_SINK_SIZE  # S and W as the kernels define them (StreamingLLM's 4 sinks, a 64-token window)
SINK_THRESHOLD = 0.2
SINK_MIN_LATER = 16


def _check_patterns(patterns: np.ndarray) -> np.ndarray:
    patterns = np.asarray(patterns)
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [layer, head, N, N] (causal, one sequence), got {patterns.shape}")
    return patterns


def streaming_score(
    patterns: np.ndarray,
    sink: int = DEFAULT_SINK,
    window: int = DEFAULT_WINDOW,
    *,
    chunk: int = 128,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """DuoAttention-style streaming score per head, training-free (Xiao et al. 2024, arXiv:2410.10819).

    ``streaming(l, h) = mean_{i >= S+W} [ Σ_{j<S} A[i, j] + Σ_{i−W<j≤i} A[i, j] ]``.

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax causal attention (float16 or float32; read in
        chunks of ``chunk`` query rows, so a memory-mapped run is never copied whole).
    sink : S, the number of initial tokens kept as attention sinks (>= 0).
    window : W, the recent window per query, the query itself included (>= 1).

    Returns
    -------
    ``[layer, head]`` float64 in [0, 1]; nan when ``N <= S + W`` (no query row qualifies).
    """
    patterns = _check_patterns(patterns)
    if sink < 0 or window < 1:
        raise ValueError(f"sink must be >= 0 and window >= 1; got sink={sink}, window={window}")
    n = patterns.shape[-1]
    first = sink + window
    if n <= first:
        return np.full(patterns.shape[:2], np.nan)
    n_layers = patterns.shape[0]
    total = np.zeros(patterns.shape[:2], dtype=np.float64)
    starts = range(first, n, chunk)
    # One layer and ``chunk`` query rows at a time: [head, rows, keys] in float64 stays small.
    for layer in range(n_layers):
        for start in starts:
            stop = min(start + chunk, n)
            rows = np.asarray(patterns[layer, :, start:stop, :stop], dtype=np.float64)
            cums = np.concatenate([np.zeros(rows.shape[:-1] + (1,)), np.cumsum(rows, axis=-1)], axis=-1)
            i = np.arange(start, stop)
            r = np.arange(stop - start)
            window_mass = cums[:, r, i + 1] - cums[:, r, i + 1 - window]
            sink_mass = cums[:, r, sink] if sink else 0.0
            total[layer] += (window_mass + sink_mass).sum(-1)
        if progress:
            progress((layer + 1) / n_layers)
    return total / (n - first)


def sink_checked_positions(n_tokens: int, min_later: int = SINK_MIN_LATER) -> int:
    """How many leading positions of an ``n_tokens`` text can be called a sink or not.

    Position j has ``N − 1 − j`` later queries and is tested only when that is at least
    ``min_later``, so positions ``0 .. N − 1 − min_later`` are checked: ``max(0, N − min_later)`` of
    them. 0 means the text is too short to call any sink, position 0 included, however much
    attention it receives.
    """
    if min_later < 1:
        raise ValueError(f"min_later must be >= 1; got {min_later}")
    return max(0, int(n_tokens) - min_later)


def received_from_columns(column: np.ndarray) -> np.ndarray:
    """``[..., N]`` attention received per key position, averaged over the strictly later queries:
    ``column[..., j] / (N − 1 − j)``, where ``column`` sums each key's attention from strictly later
    queries; nan at the last position (no later query)."""
    n = column.shape[-1]
    later = (n - 1 - np.arange(n)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(later > 0, column / np.maximum(later, 1), np.nan)


def sink_flags(received: np.ndarray, threshold: float = SINK_THRESHOLD, min_later: int = SINK_MIN_LATER) -> np.ndarray:
    """``[..., N]`` bool: position j is a sink of its head when ``received >= threshold`` and at least
    ``min_later`` queries follow it (:func:`sink_checked_positions`); nan counts as 0."""
    n = received.shape[-1]
    return (np.nan_to_num(received, nan=0.0) >= threshold) & (np.arange(n) < sink_checked_positions(n, min_later))


@dataclass
class SinkMap:
    """Attention received per key position and the positions flagged as sinks.

    Attributes
    ----------
    received : ``[layer, head, N]`` mean attention from later queries (nan at the last position).
    mean_received : ``[N]`` ``received`` averaged over all heads.
    flags : ``[layer, head, N]`` bool, ``received >= threshold`` with at least ``min_later`` later queries.
    head_counts : ``[N]`` number of heads that flag each position.
    positions : positions flagged by at least one head, ascending.
    mid_sequence : the flagged positions other than 0.
    """

    received: np.ndarray
    mean_received: np.ndarray
    flags: np.ndarray
    head_counts: np.ndarray
    positions: list[int]
    mid_sequence: list[int]
    threshold: float
    min_later: int


def sink_map(
    patterns: np.ndarray,
    threshold: float = SINK_THRESHOLD,
    min_later: int = SINK_MIN_LATER,
    *,
    chunk: int = 256,
    progress: Callable[[float], None] | None = None,
) -> SinkMap:
    """Attention received per key position, averaged over later queries; sinks flagged anywhere.

    ``received(l, h, j) = Σ_{i>j} A[l, h][i, j] / (N − 1 − j)`` (Xiao et al. 2023, arXiv:2309.17453;
    Gu et al. 2024, arXiv:2410.10781). Position j is a sink of head (l, h) when
    ``received >= threshold`` and ``N − 1 − j >= min_later``.

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax causal attention.
    threshold : mean received attention that makes a sink (default 0.2).
    min_later : fewest later queries for a position to be flagged (default 16).

    Returns
    -------
    :class:`SinkMap`.
    """
    patterns = _check_patterns(patterns)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1]; got {threshold}")
    if min_later < 1:
        raise ValueError(f"min_later must be >= 1; got {min_later}")
    n_layers, n_heads, n, _ = patterns.shape
    column = np.zeros((n_layers, n_heads, n), dtype=np.float64)
    for layer in range(n_layers):
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            rows = np.asarray(patterns[layer, :, start:stop, :], dtype=np.float64)
            # Strictly later queries only: drop the diagonal (and the zeros above it) of each row.
            keep = np.arange(n)[None, :] < np.arange(start, stop)[:, None]
            column[layer] += np.where(keep, rows, 0.0).sum(-2)
        if progress:
            progress((layer + 1) / n_layers)
    received = received_from_columns(column)
    flags = sink_flags(received, threshold, min_later)
    head_counts = flags.sum((0, 1))
    positions = [int(p) for p in np.flatnonzero(head_counts)]
    return SinkMap(
        received=received,
        mean_received=received.mean(axis=(0, 1)),  # nan only at the last position, for every head
        flags=flags,
        head_counts=head_counts,
        positions=positions,
        mid_sequence=[p for p in positions if p > 0],
        threshold=threshold,
        min_later=min_later,
    )

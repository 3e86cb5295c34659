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

    received(l, h, j) = mean_{i > j, i sees j} A[l, h][i, j]      (nan when no later query sees j).

A key is flagged as a sink of head (l, h) when ``received >= threshold`` (default 0.2: on average
the key takes at least a fifth of every later query's attention, far above a uniform share once
queries have more than a handful of keys) and at least ``min_later`` later queries see it (default
16, so that a key near the end, seen by a few queries of a local head, is not flagged). Every
position is tested, so sinks in the middle of the sequence (often the first newline or full stop)
are flagged as well as position 0.

**Layers windowed by the model.** On a layer with a sliding window of ``W_l`` keys (Mistral: every
layer; Gemma 2/3: most layers; :attr:`headscope.analysis.model_facts.ModelFacts.windows`) query i sees only keys
``i − W_l < j ≤ i``: from row ``W_l`` on, the sinks are out of reach and every head is local because
the model makes it so, not because the head chose it. Read over all rows, such a head would look
like a streaming head and its early keys would look like poor sinks (their attention averaged with
the zeros of queries that cannot see them). So, with ``layer_windows`` given:

- the streaming score reads only the rows where the window does not bind yet (the query sees every
  earlier key), ``R_l = {i : S + W ≤ i < min(N, W_l)}``:

      streaming(l, h) = mean_{i ∈ R_l} m_i,      nan when R_l is empty (W_l ≤ S + W);

  full-attention layers keep ``R_l = {S + W .. N − 1}``. A layer whose score is nan already keeps
  at most ``W_l ≤ S + W`` keys; the KV-compression ranking counts nan as 0, i.e. streams it first,
  which costs it nothing.
- the sink map averages a key over the later queries that can see it, ``j < i < min(N, j + W_l)``:

      received(l, h, j) = Σ_{j < i < min(N, j + W_l)} A[i, j] / (min(N, j + W_l) − 1 − j),

  and checks key j only when ``min(N − 1 − j, W_l − 1) ≥ min_later`` (a window of at most
  ``min_later`` keys checks none). The first-token share and the mid-sequence sink
  (:mod:`headscope.analysis.head_summary`) read this ``received``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from headscope.kernels.statistics import DEFAULT_SINK_SIZE, DEFAULT_WINDOW

DEFAULT_SINK = DEFAULT_SINK_SIZE  # S and W as the kernels define them (StreamingLLM's 4 sinks, a 64-token window)
SINK_THRESHOLD = 0.2
SINK_MIN_LATER = 16
WINDOWED_SINKS = "each key averaged over the queries that see it"
"""How the sink map reads a layer the model windows, in words (the page says it beside such layers)."""


def _check_windows(layer_windows: Sequence[int | None] | None, n_layers: int) -> list[int | None]:
    if layer_windows is None:
        return [None] * n_layers
    if len(layer_windows) != n_layers:
        raise ValueError(f"layer_windows has {len(layer_windows)} entries for {n_layers} layers")
    return [int(w) if w else None for w in layer_windows]


def unbound_rows(n_tokens: int, sink: int, window: int, model_window: int | None) -> range:
    """The query rows the streaming score reads on a layer: ``S + W ≤ i < min(N, W_l)``, those past
    the sink and recent window whose query still sees every earlier key (``W_l`` None: full attention)."""
    stop = n_tokens if not model_window else min(n_tokens, int(model_window))
    return range(sink + window, max(stop, sink + window))


def visible_later(n_tokens: int, layer_windows: Sequence[int | None] | None, n_layers: int) -> np.ndarray:
    """``[layer, N]`` strictly later queries that see key j: ``N − 1 − j``, or ``min(N − 1 − j, W_l − 1)``
    on a layer with a sliding window of ``W_l`` keys (query i sees key j iff ``i − W_l < j ≤ i``)."""
    later = (n_tokens - 1 - np.arange(n_tokens)).astype(np.int64)
    return np.stack([np.minimum(later, w - 1) if w else later for w in _check_windows(layer_windows, n_layers)])


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
    layer_windows: Sequence[int | None] | None = None,
    chunk: int = 128,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """DuoAttention-style streaming score per head, training-free (Xiao et al. 2024, arXiv:2410.10819).

    ``streaming(l, h) = mean_{i ∈ R_l} [ Σ_{j<S} A[i, j] + Σ_{i−W<j≤i} A[i, j] ]`` with
    ``R_l = {i : S + W ≤ i < min(N, W_l)}`` (:func:`unbound_rows`; ``W_l`` the model's sliding window
    of layer l, none on a full-attention layer: see the module docstring).

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax causal attention (float16 or float32; read in
        chunks of ``chunk`` query rows, so a memory-mapped run is never copied whole).
    sink : S, the number of initial tokens kept as attention sinks (>= 0).
    window : W, the recent window per query, the query itself included (>= 1).
    layer_windows : per layer the model's sliding window in keys (None: full attention), e.g. a
        run's ``layer_windows``; None: every layer attends to all earlier keys.

    Returns
    -------
    ``[layer, head]`` float64 in [0, 1]; nan on a layer where no query row qualifies (``N <= S + W``,
    or the model's window ``W_l <= S + W``).
    """
    patterns = _check_patterns(patterns)
    if sink < 0 or window < 1:
        raise ValueError(f"sink must be >= 0 and window >= 1; got sink={sink}, window={window}")
    n = patterns.shape[-1]
    n_layers = patterns.shape[0]
    windows = _check_windows(layer_windows, n_layers)
    out = np.full(patterns.shape[:2], np.nan)
    # One layer and ``chunk`` query rows at a time: [head, rows, keys] in float64 stays small.
    for layer in range(n_layers):
        rows_read = unbound_rows(n, sink, window, windows[layer])
        total = np.zeros(patterns.shape[1], dtype=np.float64)
        for start in range(rows_read.start, rows_read.stop, chunk):
            stop = min(start + chunk, rows_read.stop)
            rows = np.asarray(patterns[layer, :, start:stop, :stop], dtype=np.float64)
            cums = np.concatenate([np.zeros(rows.shape[:-1] + (1,)), np.cumsum(rows, axis=-1)], axis=-1)
            i = np.arange(start, stop)
            r = np.arange(stop - start)
            window_mass = cums[:, r, i + 1] - cums[:, r, i + 1 - window]
            sink_mass = cums[:, r, sink] if sink else 0.0
            total += (window_mass + sink_mass).sum(-1)
        if len(rows_read):
            out[layer] = total / len(rows_read)
        if progress:
            progress((layer + 1) / n_layers)
    return out


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


def _later(shape: tuple[int, ...], layer_windows: Sequence[int | None] | None) -> np.ndarray:
    """:func:`visible_later` shaped to broadcast against ``[layer, head, N]`` (``[N]`` without windows)."""
    n = shape[-1]
    if layer_windows is None:
        return visible_later(n, None, 1)[0]
    if len(shape) != 3:
        raise ValueError(f"per-layer windows need [layer, head, N] arrays, got shape {shape}")
    return visible_later(n, layer_windows, shape[0])[:, None, :]


def received_from_columns(column: np.ndarray, layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """``[..., N]`` attention received per key position, averaged over the strictly later queries that
    see it: ``column[..., j] / min(N − 1 − j, W_l − 1)`` (:func:`visible_later`), where ``column`` sums
    each key's attention from strictly later queries; nan where no later query sees the key (the last
    position). ``layer_windows``: per layer the model's window (``column`` is then ``[layer, head, N]``)."""
    later = _later(column.shape, layer_windows).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(later > 0, column / np.maximum(later, 1), np.nan)


def sink_checked(shape: tuple[int, ...], min_later: int = SINK_MIN_LATER,
                 layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """Bool, broadcastable to ``shape`` (``[..., N]``): key j can be called a sink or not, i.e. at least
    ``min_later`` strictly later queries see it (:func:`visible_later`)."""
    if min_later < 1:
        raise ValueError(f"min_later must be >= 1; got {min_later}")
    return _later(shape, layer_windows) >= min_later


def sink_flags(received: np.ndarray, threshold: float = SINK_THRESHOLD, min_later: int = SINK_MIN_LATER,
               layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """``[..., N]`` bool: position j is a sink of its head when ``received >= threshold`` and at least
    ``min_later`` later queries see it (:func:`sink_checked`); nan counts as 0."""
    return (np.nan_to_num(received, nan=0.0) >= threshold) & sink_checked(received.shape, min_later, layer_windows)


def mid_sink_score(received: np.ndarray, min_later: int = SINK_MIN_LATER,
                   layer_windows: Sequence[int | None] | None = None) -> np.ndarray:
    """``[layer, head]`` the most attention a key after position 0 receives, over the keys that can be
    checked: ``max_{j ≥ 1, checked} received(l, h, j)`` (:func:`sink_checked`); nan on a layer with no
    such key (a short text, or a model window of at most ``min_later`` keys)."""
    checked = np.broadcast_to(sink_checked(received.shape, min_later, layer_windows), received.shape)[..., 1:]
    values = np.where(checked, np.nan_to_num(received[..., 1:], nan=-np.inf), -np.inf)
    best = values.max(-1, initial=-np.inf)
    return np.where(np.isfinite(best), best, np.nan)


@dataclass
class SinkMap:
    """Attention received per key position and the positions flagged as sinks.

    Attributes
    ----------
    received : ``[layer, head, N]`` mean attention from the later queries that see each key (nan at the
        last position).
    mean_received : ``[N]`` ``received`` averaged over the heads where it is defined.
    flags : ``[layer, head, N]`` bool, ``received >= threshold`` with at least ``min_later`` later
        queries that see the key.
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
    layer_windows: list[int | None] | None = None


def sink_map(
    patterns: np.ndarray,
    threshold: float = SINK_THRESHOLD,
    min_later: int = SINK_MIN_LATER,
    *,
    layer_windows: Sequence[int | None] | None = None,
    chunk: int = 256,
    progress: Callable[[float], None] | None = None,
) -> SinkMap:
    """Attention received per key position, averaged over later queries; sinks flagged anywhere.

    ``received(l, h, j) = Σ_{i>j} A[l, h][i, j] / v_l(j)`` with ``v_l(j) = N − 1 − j``, or
    ``min(N − 1 − j, W_l − 1)`` on a layer with a model window of ``W_l`` keys (the later queries that
    see key j; :func:`visible_later`) (Xiao et al. 2023, arXiv:2309.17453; Gu et al. 2024,
    arXiv:2410.10781). Position j is a sink of head (l, h) when ``received >= threshold`` and
    ``v_l(j) >= min_later``.

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax causal attention.
    threshold : mean received attention that makes a sink (default 0.2).
    min_later : fewest later queries that see a position for it to be flagged (default 16).
    layer_windows : per layer the model's sliding window in keys (None: full attention).

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
    windows = _check_windows(layer_windows, n_layers) if layer_windows is not None else None
    received = received_from_columns(column, windows)
    flags = sink_flags(received, threshold, min_later, windows)
    head_counts = flags.sum((0, 1))
    positions = [int(p) for p in np.flatnonzero(head_counts)]
    with np.errstate(invalid="ignore"):  # nan where no later query sees the key on any layer
        defined = (~np.isnan(received)).sum((0, 1))
        mean = np.where(defined > 0, np.nansum(received, axis=(0, 1)) / np.maximum(defined, 1), np.nan)
    return SinkMap(
        received=received,
        mean_received=mean,  # nan at the last position, for every head
        flags=flags,
        head_counts=head_counts,
        positions=positions,
        mid_sequence=[p for p in positions if p > 0],
        threshold=threshold,
        min_later=min_later,
        layer_windows=windows,
    )

"""Attention rollout for decoder-only (causal) models.

Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers" (ACL 2020, arXiv:2005.00928),
section 3. Each layer's attention, fused over heads and mixed with the identity that stands for the
residual connection, is one step of a Markov chain over token positions; rollout multiplies the
steps:

    Â_l = r·I + (1 − r)·Ā_l              (Ā_l: head-fused attention of layer l, rows renormalised)
    rollout = Â_L · Â_{L−1} ··· Â_1       (later layers on the left)

``rollout[i, j]`` is the share of output position i that traces back to input position j. With
causal attention every Â_l is lower-triangular and row-stochastic, hence so is the rollout.

:func:`augmented_attention` builds the Â_l; :mod:`headscope.analysis.flow` uses the same matrices as edge
capacities, so rollout and flow always describe the same graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

FUSIONS = ("mean", "max", "min")

# Softmax with a -inf mask gives exact zeros above the diagonal; this only absorbs rounding.
_CAUSAL_TOL = 1e-6


def _check_options(
    patterns: np.ndarray,
    residual: float,
    fusion: str,
    discard_ratio: float,
    drop_sinks: Sequence[int],
    start_layer: int,
    end_layer: int | None,
) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Validate the shared options once; return (patterns, sinks, end_layer) in canonical form."""
    patterns = np.asarray(patterns)
    if patterns.ndim != 4:
        raise ValueError(
            f"patterns must have 4 dimensions [layer, head, query, key], got shape {patterns.shape}; "
            "add a head axis of length 1 for single-head patterns"
        )
    n_layers, n_heads, n_query, n_key = patterns.shape
    if n_query != n_key:
        raise ValueError(
            f"patterns must be square in [query, key] (self-attention over one sequence), got {n_query} "
            f"queries and {n_key} keys"
        )
    if n_layers == 0 or n_heads == 0 or n_query == 0:
        raise ValueError(f"patterns is empty: shape {patterns.shape}")
    if not np.issubdtype(patterns.dtype, np.floating):
        raise ValueError(
            f"patterns must be a float array (post-softmax attention), got dtype {patterns.dtype}"
        )
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1] (weight of the identity in Â), got {residual}")
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}; got {fusion!r}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(
            f"discard_ratio must be in [0, 1) (fraction of each row to drop), got {discard_ratio}"
        )
    sinks = tuple(sorted({int(s) for s in drop_sinks}))
    bad = [s for s in sinks if not 0 <= s < n_key]
    if bad:
        raise ValueError(f"drop_sinks positions {bad} are outside the sequence (valid: 0 .. {n_key - 1})")
    end = n_layers if end_layer is None else int(end_layer)
    if not 0 <= start_layer < n_layers:
        raise ValueError(
            f"start_layer must be in 0 .. {n_layers - 1} for {n_layers} layers, got {start_layer}"
        )
    if not start_layer < end <= n_layers:
        raise ValueError(
            f"end_layer must be in {start_layer + 1} .. {n_layers} (exclusive end, like a slice) "
            f"for start_layer={start_layer}, got {end_layer}"
        )
    return patterns, sinks, end


def _fuse_layer(
    layer: np.ndarray,
    fusion: str,
    discard_ratio: float,
    sinks: tuple[int, ...],
    residual: float,
    layer_index: int,
) -> np.ndarray:
    """One layer [head, query, key] → Â [query, key], float64, lower-triangular, rows summing to 1."""
    a = np.asarray(layer, dtype=np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"patterns of layer {layer_index} contain NaN or infinity")
    if a.min() < 0:
        raise ValueError(
            f"patterns of layer {layer_index} contain negative values; pass post-softmax attention"
        )
    n = a.shape[-1]
    above = np.triu(np.ones((n, n), dtype=bool), k=1)
    if n > 1 and a[:, above].max() > _CAUSAL_TOL:
        raise ValueError(
            f"patterns of layer {layer_index} attend to later keys (mass above the diagonal); "
            "rollout and flow here assume a causal (decoder-only) model"
        )
    fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](a, axis=0)
    keep = ~above
    if sinks:
        keep[:, list(sinks)] = False
    fused = np.where(keep, fused, 0.0)

    if discard_ratio > 0:
        # Per row, drop the floor(ratio·m) smallest of the m kept keys; the diagonal is never dropped.
        diagonal = np.eye(n, dtype=bool)
        candidate = keep & ~diagonal
        ranked = np.where(candidate, fused, np.inf)
        order = np.argsort(ranked, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(n)[None, :].repeat(n, axis=0), axis=1)
        n_drop = np.minimum(np.floor(discard_ratio * keep.sum(axis=1)), candidate.sum(axis=1))
        fused = np.where(rank < n_drop[:, None], 0.0, fused)

    totals = fused.sum(axis=1, keepdims=True)
    empty = totals[:, 0] <= 0
    # A row with nothing left (e.g. query 0 when key 0 is a dropped sink) keeps only itself.
    fused = np.divide(fused, totals, out=np.zeros_like(fused), where=~empty[:, None])
    fused[empty, empty.nonzero()[0]] = 1.0
    return residual * np.eye(n) + (1.0 - residual) * fused


class _Steps:
    """The Â_l of a validated layer range, built one layer at a time (memory: one [query, key])."""

    def __init__(self, patterns, residual, fusion, discard_ratio, sinks, start, end):
        self._args = (patterns, residual, fusion, discard_ratio, sinks, start, end)
        self.n_positions = patterns.shape[-1]

    def __len__(self) -> int:
        return self._args[-1] - self._args[-2]

    def __iter__(self):
        patterns, residual, fusion, discard_ratio, sinks, start, end = self._args
        for layer in range(start, end):
            yield _fuse_layer(patterns[layer], fusion, discard_ratio, sinks, residual, layer)


def _steps(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer) -> _Steps:
    patterns, sinks, end = _check_options(
        patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer
    )
    return _Steps(patterns, residual, fusion, discard_ratio, sinks, start_layer, end)


def augmented_attention(
    patterns: np.ndarray,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Residual-augmented, head-fused attention Â_l of each layer: the steps of rollout and flow.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 3:
    ``Â_l = r·I + (1 − r)·Ā_l``. Per layer, in this order:

    1. fuse heads: Ā_l = mean (default), max or min over heads of A[l, h];
    2. drop sink columns: Ā_l[:, s] = 0 for s in ``drop_sinks``;
    3. discard: in each row i, of the m_i keys still kept (j ≤ i), the floor(``discard_ratio``·m_i)
       smallest off-diagonal entries are set to 0 (the diagonal is never discarded);
    4. renormalise each row of Ā_l to sum to 1 (a row with no mass left becomes e_i: the token keeps
       only itself);
    5. mix with the identity: Â_l = r·I + (1 − r)·Ā_l, so the residual weight is exactly r and rows
       sum to 1.

    With mean fusion and no discard or sinks, Ā_l is already row-stochastic and this is the paper's
    Â_l = 0.5·A_l + 0.5·I. For max/min fusion the rows are renormalised *before* the identity is
    added (implementations such as jacobgil/vit-explain renormalise after), so that ``residual``
    means the same thing under every fusion.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention; may be float16, computation is float64.
    residual : float in [0, 1]
        Weight r of the identity (the residual stream). 0.5 in the paper.
    fusion : {"mean", "max", "min"}
        How heads are fused into Ā_l.
    discard_ratio : float in [0, 1)
        Fraction of each row's lowest entries set to zero before renormalising.
    drop_sinks : sequence of int
        Key positions (e.g. ``(0,)``, the attention sink) removed before renormalising.
    start_layer, end_layer : int
        Layers ``start_layer <= l < end_layer`` (slice semantics; ``None`` is the last layer + 1).
    progress : callable(float) or None
        Called with the fraction of layers done.

    Returns
    -------
    np.ndarray, float64 [layer, query, key]
        Â_l for the selected layers; lower-triangular, rows sum to 1.

    Raises
    ------
    ValueError
        On a wrong shape, non-float, non-finite, negative or non-causal patterns, or an option out of
        range.
    """
    steps = _steps(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    n = steps.n_positions
    out = np.empty((len(steps), n, n), dtype=np.float64)
    for k, step in enumerate(steps):
        out[k] = step
        if progress is not None:
            progress((k + 1) / len(steps))
    return out


def rollout_per_layer(
    patterns: np.ndarray,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Cumulative attention rollout after each layer.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", eq. for attention rollout:
    ``R_l = Â_l · R_{l−1}`` with ``R_{start−1} = I``, so ``R_l = Â_l ··· Â_start``. Shows how an
    output position's relevance spreads over the inputs layer by layer. Options as in
    :func:`augmented_attention`.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention.
    residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer
        See :func:`augmented_attention`.
    progress : callable(float) or None
        Called with the fraction of layers done.

    Returns
    -------
    np.ndarray, float64 [layer, query, key]
        ``out[k]`` is the rollout through layer ``start_layer + k``; each slice is lower-triangular
        with rows summing to 1. ``out[-1]`` equals :func:`rollout`.
    """
    steps = _steps(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    n = steps.n_positions
    out = np.empty((len(steps), n, n), dtype=np.float64)
    for k, step in enumerate(steps):
        out[k] = step if k == 0 else step @ out[k - 1]
        if progress is not None:
            progress((k + 1) / len(steps))
    return out


def rollout_row_per_layer(
    patterns: np.ndarray,
    row: int,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
) -> np.ndarray:
    """One output position's row of the cumulative rollout after each layer.

    ``out[k] = (Â_{start+k} ··· Â_start)[row, : row + 1]``, i.e. ``rollout_per_layer(...)[:, row,
    : row + 1]``, computed on the ``[row + 1, row + 1]`` prefix (causal attention: later positions
    never reach ``row``) and keeping one running product instead of one per layer.

    Returns
    -------
    np.ndarray, float64 [layer, row + 1]
    """
    n = np.asarray(patterns).shape[-1]
    if not 0 <= row < n:
        raise ValueError(f"row must be in 0 .. {n - 1}, got {row}")
    prefix = np.asarray(patterns)[:, :, : row + 1, : row + 1]
    sinks = tuple(s for s in drop_sinks if int(s) <= row)
    steps = _steps(prefix, residual, fusion, discard_ratio, sinks, start_layer, end_layer)
    out = np.empty((len(steps), row + 1), dtype=np.float64)
    product = None
    for k, step in enumerate(steps):
        product = step if product is None else step @ product
        out[k] = product[row]
    return out


def rollout(
    patterns: np.ndarray,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Attention rollout: relevance of every input position for every output position.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 3:
    ``rollout = Â_end ··· Â_start`` (later layers on the left) with
    ``Â_l = r·I + (1 − r)·Ā_l`` built by :func:`augmented_attention`.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention; may be float16, computation is float64.
    residual : float in [0, 1]
        Weight of the identity (residual connection); 0.5 in the paper.
    fusion : {"mean", "max", "min"}
        Head fusion.
    discard_ratio : float in [0, 1)
        Fraction of each row's lowest off-diagonal entries dropped before renormalising.
    drop_sinks : sequence of int
        Key positions removed before renormalising (e.g. ``(0,)``).
    start_layer, end_layer : int
        Layers ``start_layer <= l < end_layer`` (``end_layer=None``: through the last layer).
    progress : callable(float) or None
        Called with the fraction done.

    Returns
    -------
    np.ndarray, float64 [query, key]
        ``out[i, j]``: share of output position i attributed to input position j. Lower-triangular,
        rows sum to 1.
    """
    steps = _steps(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    out = None
    for k, step in enumerate(steps):
        out = step if out is None else step @ out
        if progress is not None:
            progress((k + 1) / len(steps))
    return out

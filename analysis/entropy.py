"""Normalised attention entropy per head.

For a causal pattern row i (query i sees keys 0..i, or on a sliding-window layer of window W only
the last ``min(i + 1, W)`` of them), the row entropy is ``H_i = -Σ_j A[i, j] log A[i, j]``;
normalised by its maximum ``log(v_i)`` with ``v_i`` the number of visible keys (uniform over them) it
lies in [0, 1]: 0 = all attention on one key, 1 = uniform over what the query can see. A head's
score is the mean of ``H_i / log(v_i)`` over rows with at least two visible keys (row 0 has one key
and no entropy to normalise). See DESIGN.md, "Entropy". The pattern path
(:func:`normalised_entropy`) and statistics mode (:func:`headscope.analysis.statistics_run.statistics_score`)
both normalise with :func:`mean_normalised_entropy`; the windows come from
:attr:`headscope.analysis.model_facts.ModelFacts.windows`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def row_entropy(patterns: np.ndarray, chunk: int = 64, causal: bool = False) -> np.ndarray:
    """Row entropies in nats, ``[..., query]`` for ``patterns`` of shape ``[..., query, key]``.

    ``causal``: query i sees keys ≤ i only (queries and keys aligned), so a chunk of query rows reads
    only the keys up to its last row: about half the work on a square causal pattern (the keys past
    a row's own position hold zeros, which add nothing)."""
    patterns = np.asarray(patterns)
    if patterns.ndim == 4 and patterns.shape[0] > 1:
        return _by_layer(patterns, chunk, causal)
    n_q, n_k = patterns.shape[-2:]
    out = np.empty(patterns.shape[:-1], dtype=np.float64)
    # float16 (a stored run's patterns): p·log p of each of the 65,536 float16 values, looked up by
    # the weight's bits; the same float64 products as below, only their sum's order may differ in
    # the last few bits. Three times faster: no float64 copy and no log per weight (0.12 s against 0.40 s
    # on a 515-token SmolLM2 run).
    table = _p_log_p_float16() if patterns.dtype == np.float16 else None
    # Chunk over queries: a float64 copy of a whole [30, 9, N, N] array would be large.
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        if table is not None:
            bits = patterns[..., start:stop, : min(n_k, stop) if causal else n_k].view(np.uint16)
            out[..., start:stop] = -table[bits].sum(-1)
            continue
        a = np.array(patterns[..., start:stop, : min(n_k, stop) if causal else n_k], dtype=np.float64)
        logs = np.zeros_like(a)
        np.log(a, out=logs, where=a > 0)  # 0 · log 0 = 0 (scipy.special.entr measured 2× slower here)
        out[..., start:stop] = -np.einsum("...k,...k->...", a, logs)
    return out


def _by_layer(patterns: np.ndarray, chunk: int, causal: bool) -> np.ndarray:
    """:func:`row_entropy` of ``[layer, ...]`` one layer at a time (a layer's chunks stay in the CPU's
    cache), the layers shared among the process's compute threads as the CPU attention kernel shares
    its chunks (``torch.get_num_threads()``; one without torch). Each row is summed exactly as in one
    call, so the result is the same bit for bit. For a 483-token SmolLM2 run's float16 patterns
    (2-core Xeon): 0.10 s on one thread and 0.05 s on two, against 0.12 s in one call; the page's
    grid waits on it while a run is stored."""
    out = np.empty(patterns.shape[:-1], dtype=np.float64)

    def layer(i: int) -> None:
        out[i] = row_entropy(patterns[i], chunk, causal)

    torch = sys.modules.get("torch")
    workers = min(torch.get_num_threads() if torch is not None else 1, patterns.shape[0])
    if workers > 1:  # numpy's gathers and sums release the GIL
        with ThreadPoolExecutor(workers, thread_name_prefix="headscope-entropy") as pool:
            list(pool.map(layer, range(patterns.shape[0])))
    else:
        for i in range(patterns.shape[0]):
            layer(i)
    return out


@functools.cache
def _p_log_p_float16() -> np.ndarray:
    """``[65536]`` float64: ``p · log p`` for the float16 whose bits are the index (0 where ``p ≤ 0``, as
    :func:`row_entropy` counts ``0 · log 0``; nan stays nan)."""
    p = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    logs = np.zeros_like(p)
    with np.errstate(all="ignore"):
        np.log(p, out=logs, where=p > 0)
        return p * logs


def visible_keys(n: int, windows: Sequence[int | None] | None, n_layers: int) -> np.ndarray:
    """``[layer, n]`` keys query row i sees: ``i + 1``, or ``min(i + 1, W)`` on a layer with a sliding
    window of ``W`` keys (``windows[layer]``; None or 0 = full attention; ``windows`` None = all full)."""
    rows = np.arange(1, n + 1, dtype=np.int64)
    if windows is None:
        return np.broadcast_to(rows, (n_layers, n))
    if len(windows) != n_layers:
        raise ValueError(f"windows has {len(windows)} entries for {n_layers} layers")
    return np.stack([np.minimum(rows, w) if w else rows for w in windows])


def mean_normalised_entropy(entropy: np.ndarray, windows: Sequence[int | None] | None = None) -> np.ndarray:
    """``[layer, head]`` mean of ``H_i / log(v_i)`` over rows with ``v_i ≥ 2`` visible keys.

    Parameters
    ----------
    entropy : ``[layer, head, n]`` row entropies ``H_i`` in nats (:func:`row_entropy`, or the kernel's).
    windows : per layer the sliding window in keys (None or 0: full attention), or None (all full).

    Returns
    -------
    ``[layer, head]`` in [0, 1]; nan where no row sees two keys (a single token, or a window of 1).
    """
    h = np.asarray(entropy, dtype=np.float64)
    L, _, n = h.shape
    v = visible_keys(n, windows, L)[:, None, :]  # [layer, 1, n]
    counted = v >= 2
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(counted, h / np.log(np.maximum(v, 2)), 0.0)
        return ratio.sum(-1) / counted.sum(-1)


def normalised_entropy(patterns: np.ndarray, windows: Sequence[int | None] | None = None) -> np.ndarray:
    """Mean normalised row entropy per head.

    Parameters
    ----------
    patterns : ``[layer, head, query, key]`` causal post-softmax attention (query i sees keys ≤ i,
        queries and keys aligned: the run's own positions).
    windows : per layer the sliding window in keys (None or 0: full), e.g.
        ``model.facts.windows``; None: every layer attends to all earlier keys.

    Returns
    -------
    ``[layer, head]`` in [0, 1]; nan when the sequence has a single token.
    """
    patterns = np.asarray(patterns)
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [layer, head, n, n], got shape {patterns.shape}")
    return mean_normalised_entropy(row_entropy(patterns, causal=True), windows)

"""Previous-token, duplicate-token and induction scores, and how head scores are aggregated.

The three detectors are TransformerLens' ``head_detector`` (``transformer_lens/head_detector.py``;
Olsson et al. 2022, "In-context Learning and Induction Heads", for the head types), applied to a
run's captured patterns: the detection pattern ``D`` comes from TransformerLens'
``get_<kind>_detection_pattern(tokens)`` and the score from its
``compute_head_attention_similarity_score``:

- ``mul`` (TransformerLens' default): ``score = Σ_ij A[i, j]·D[i, j] / Σ_ij A[i, j]``, the share of
  the head's attention that falls where the detection pattern is 1;
- ``abs``: ``score = 1 − round(N · mean_ij |A[i, j] − D[i, j]|, 3)``.

Detection patterns (N tokens ``t``): previous-token ``D[i, i−1] = 1``; duplicate-token
``D[i, j] = 1`` for ``j < i`` with ``t_j = t_i``; induction ``D[i, j] = 1`` for ``0 < j ≤ i`` with
``t_{j−1} = t_i`` (the duplicate pattern shifted one key to the right).

Unlike ``detect_head`` these run on the token ids the model actually saw: no BOS is prepended.

Aggregation: :func:`aggregate_runs` (mean and spread of ``[layer, head]`` tables over runs) and
:func:`group_heads` (per key-value group under grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformer_lens.head_detector import (
    compute_head_attention_similarity_score,
    get_duplicate_token_head_detection_pattern,
    get_induction_head_detection_pattern,
    get_previous_token_head_detection_pattern,
)

DETECTORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "previous_token": get_previous_token_head_detection_pattern,
    "duplicate_token": get_duplicate_token_head_detection_pattern,
    "induction": get_induction_head_detection_pattern,
}
ERROR_MEASURES = ("mul", "abs")
GROUP_REDUCTIONS = ("max", "mean", "min")


def detection_pattern(kind: str, token_ids: Sequence[int]) -> torch.Tensor:
    """TransformerLens' detection pattern ``[N, N]`` (float, lower-triangular) for ``token_ids``."""
    if kind not in DETECTORS:
        raise ValueError(f"kind must be one of {', '.join(DETECTORS)}; got {kind!r}")
    tokens = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None, :]
    return DETECTORS[kind](tokens).float()


def head_detector_scores(
    patterns: np.ndarray,
    token_ids: Sequence[int],
    kind: str,
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    error_measure: str = "mul",
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Score every head against a detection pattern, exactly as TransformerLens' ``detect_head``.

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax causal attention of one run.
    token_ids : the N token ids the run saw (the detection pattern is built from them).
    kind : ``previous_token``, ``duplicate_token`` or ``induction``.
    exclude_bos, exclude_current_token : zero the attention to key 0 / the diagonal before scoring.
    error_measure : ``mul`` (share of attention on the pattern) or ``abs`` (1 − N·mean |A − D|).

    Returns
    -------
    ``[layer, head]`` float64 scores; ``mul`` in [0, 1].
    """
    patterns = np.asarray(patterns)
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [layer, head, N, N], got shape {patterns.shape}")
    n = patterns.shape[-1]
    if len(token_ids) != n:
        raise ValueError(f"{len(token_ids)} token ids for patterns over {n} positions")
    if n < 2:
        raise ValueError("the head detector needs at least two tokens")
    if error_measure not in ERROR_MEASURES:
        raise ValueError(f"error_measure must be 'mul' or 'abs'; got {error_measure!r}")
    det = detection_pattern(kind, token_ids)
    n_layers, n_heads = patterns.shape[:2]
    out = np.empty((n_layers, n_heads), dtype=np.float64)
    for layer in range(n_layers):
        layer_patterns = torch.from_numpy(np.asarray(patterns[layer], dtype=np.float32))
        for head in range(n_heads):
            out[layer, head] = compute_head_attention_similarity_score(
                layer_patterns[head],
                detection_pattern=det,
                exclude_bos=exclude_bos,
                exclude_current_token=exclude_current_token,
                error_measure=error_measure,
            )
        if progress:
            progress((layer + 1) / n_layers)
    return out


def detector_scores(
    patterns: np.ndarray,
    token_ids: Sequence[int],
    *,
    error_measure: str = "mul",
    progress: Callable[[float], None] | None = None,
) -> dict[str, np.ndarray]:
    """All three detectors on one run: ``{kind: [layer, head]}`` (see :func:`head_detector_scores`)."""
    out = {}
    for k, kind in enumerate(DETECTORS):
        sub = (lambda f, k=k: progress((k + f) / len(DETECTORS))) if progress else None
        out[kind] = head_detector_scores(patterns, token_ids, kind, error_measure=error_measure, progress=sub)
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation


@dataclass
class Aggregate:
    """A head score over several runs.

    Attributes
    ----------
    mean : ``[layer, head]`` mean over runs (runs where the score is nan are skipped).
    std : ``[layer, head]`` sample standard deviation (ddof=1; 0 with one run).
    sem : ``[layer, head]`` standard error of the mean, ``std / sqrt(n)``.
    minimum, maximum : ``[layer, head]`` range over runs.
    n : ``[layer, head]`` number of runs with a finite score.
    """

    mean: np.ndarray
    std: np.ndarray
    sem: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray
    n: np.ndarray


def aggregate_runs(tables: Sequence[np.ndarray]) -> Aggregate:
    """Mean and spread of ``[layer, head]`` score tables from several runs (nan entries skipped).

    ``mean = Σ_r s_r / n``, ``std = sqrt(Σ_r (s_r − mean)² / (n − 1))`` (0 when n = 1),
    ``sem = std / sqrt(n)``, with n the number of runs whose score is finite.
    """
    if len(tables) == 0:
        raise ValueError("aggregate_runs needs at least one score table")
    stack = np.stack([np.asarray(t, dtype=np.float64) for t in tables])
    if stack.ndim != 3:
        raise ValueError(f"each table must be [layer, head]; got shape {stack.shape[1:]}")
    finite = np.isfinite(stack)
    n = finite.sum(0)
    safe = np.where(finite, stack, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, safe.sum(0) / np.maximum(n, 1), np.nan)
        dev = np.where(finite, stack - mean, 0.0)
        var = np.where(n > 1, (dev**2).sum(0) / np.maximum(n - 1, 1), 0.0)
        std = np.where(n > 0, np.sqrt(var), np.nan)
        sem = np.where(n > 0, std / np.sqrt(np.maximum(n, 1)), np.nan)
        minimum = np.where(n > 0, np.where(finite, stack, np.inf).min(0), np.nan)
        maximum = np.where(n > 0, np.where(finite, stack, -np.inf).max(0), np.nan)
    return Aggregate(mean=mean, std=std, sem=sem, minimum=minimum, maximum=maximum, n=n)


def group_heads(scores: np.ndarray, n_kv_heads: int, how: str = "max") -> np.ndarray:
    """Aggregate a ``[..., head]`` score over each key-value group's query heads.

    With grouped-query attention query head h reads key-value head ``h // (H / H_kv)``, so the
    group of key-value head g is query heads ``g·G .. g·G + G − 1`` with ``G = H / H_kv``.

    Parameters
    ----------
    scores : ``[..., H]`` per query head (typically ``[layer, head]``).
    n_kv_heads : H_kv.
    how : ``max``, ``mean`` or ``min`` over the group (nan entries are ignored; all-nan gives nan).

    Returns
    -------
    ``[..., H_kv]``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    n_heads = scores.shape[-1]
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads cannot be split into {n_kv_heads} key-value groups")
    if how not in GROUP_REDUCTIONS:
        raise ValueError(f"how must be one of {', '.join(GROUP_REDUCTIONS)}; got {how!r}")
    grouped = scores.reshape(*scores.shape[:-1], n_kv_heads, n_heads // n_kv_heads)
    finite = np.isfinite(grouped)
    any_finite = finite.any(-1)
    if how == "mean":
        total = np.where(finite, grouped, 0.0).sum(-1)
        count = finite.sum(-1)
        return np.where(any_finite, total / np.maximum(count, 1), np.nan)
    fill = -np.inf if how == "max" else np.inf
    reduce = np.max if how == "max" else np.min
    return np.where(any_finite, reduce(np.where(finite, grouped, fill), axis=-1), np.nan)


def expand_groups(group_scores: np.ndarray, n_heads: int) -> np.ndarray:
    """Repeat a ``[..., H_kv]`` table to ``[..., H]`` (each query head gets its group's value)."""
    group_scores = np.asarray(group_scores)
    n_kv = group_scores.shape[-1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot be split into {n_kv} key-value groups")
    return np.repeat(group_scores, n_heads // n_kv, axis=-1)

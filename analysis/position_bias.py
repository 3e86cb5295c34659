"""Rollout and flow corrected for the positional bias of causal attention.

Abnar & Zuidema 2020 ("Quantifying Attention Flow in Transformers", ACL 2020, arXiv:2005.00928)
found that attention rollout and attention flow agree with ablation better than raw attention, on
encoders. In a causal decoder both favour early positions for a reason that has nothing to do with
what the model computes: input j is visible only to queries j .. N−1, so the earlier the input, the
more paths lead from it to the output and the larger its share of the rollout product and of every
cut of the flow graph. Even attention that looks everywhere equally ("uniform causal attention",
U[i, j] = 1/(i + 1) for j ≤ i) gives rollout and flow that fall steeply with j.

The correction divides each score by the same quantity computed on uniform causal attention of the
same length, through the same number of layers, with the same residual weight r and the same sink
columns dropped (uniform over the keys that are kept):

    corrected[j] = score[j] / score_U[j],    j ≤ t,    then divided by Σ_j so the row sums to 1

where score is the rollout row ``(Â_L ··· Â_1)[t, :]`` or the exact flow ``maxflow((0, j) → (L, t))``
and score_U the same with every Ā_l = U (:func:`uniform_causal_patterns`). A value above the mean
means the model routes more to j than position alone would; uniform attention itself maps to the
flat row 1/(t + 1) (the correction removes exactly the positional part). A dropped sink has
score_U = 0 and gets 0. Flow keeps its exactness: both flows are exact max-flows.

The baselines depend only on (layers, t, r, sinks), so they are computed once per process and
shared by the Flow page, the faithfulness protocol and exports.

This correction is headscope's own: Abnar & Zuidema define rollout and flow, not this division, and
no paper cited here proposes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from headscope.analysis.flow import attention_flow
from headscope.analysis.rollout import rollout_row_per_layer

CORRECTED = {"rollout_debiased": "rollout", "flow_debiased": "flow"}
"""Each position-corrected method and the plain method it corrects."""


def uniform_causal_patterns(n_layers: int, n: int) -> np.ndarray:
    """Uniform causal attention ``U[i, j] = 1/(i + 1)`` for j ≤ i (0 above the diagonal), as
    patterns ``[layer, 1 head, query, key]``, float64: every query spreads evenly over what it sees."""
    if n_layers < 1 or n < 1:
        raise ValueError(f"uniform causal attention needs at least one layer and one position, got {n_layers}, {n}")
    u = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    return np.broadcast_to(u, (n_layers, 1, n, n))


@lru_cache(maxsize=256)
def _uniform_scores(method: str, n_layers: int, target: int, residual: float, sinks: tuple[int, ...]) -> np.ndarray:
    u = uniform_causal_patterns(n_layers, target + 1)
    if method == "rollout":
        row = rollout_row_per_layer(u, target, residual=residual, drop_sinks=sinks)[-1]
    else:
        row = attention_flow(u, target=target, residual=residual, drop_sinks=sinks)
    row.setflags(write=False)
    return row


def uniform_baseline(method: str, n_layers: int, target: int, *, residual: float = 0.5,
                     drop_sinks: Sequence[int] = ()) -> np.ndarray:
    """``score_U``: the rollout row or exact flow into ``target`` of uniform causal attention over
    positions 0 .. target, through ``n_layers`` layers (see the module docstring); float64 ``[target + 1]``.
    Read-only (cached)."""
    if method not in ("rollout", "flow"):
        raise ValueError(f"a positional baseline exists for 'rollout' and 'flow', not {method!r}")
    sinks = tuple(sorted({int(s) for s in drop_sinks if int(s) <= target}))
    return _uniform_scores(method, int(n_layers), int(target), float(residual), sinks)


def position_corrected(scores: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """``scores / baseline``, 0 where the baseline is 0 (dropped sinks), normalised to sum 1."""
    scores = np.asarray(scores, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    if scores.shape != baseline.shape:
        raise ValueError(f"scores {scores.shape} and baseline {baseline.shape} differ in shape")
    ratio = np.divide(scores, baseline, out=np.zeros_like(scores), where=baseline > 0)
    total = ratio.sum()
    return ratio / total if total > 0 else ratio

"""Evidence score: how much a head's question tokens attend to a labelled evidence span.

As used to find retrieval heads in multimodal and long-document models (e.g. "MLLMs Know Where to
Look", Zhang et al. 2025, arXiv:2502.17422; Wu et al. 2024, arXiv:2404.15574, for the text case):
with Q the question's token positions and E the evidence positions,

    evidence(l, h) = (1 / |Q|) Σ_{i ∈ Q} Σ_{j ∈ E} A[l, h][i, j],

the attention mass from the question onto the evidence, averaged over question tokens (0 = none,
1 = every question token attends only to the evidence).

The scores of a whole model are summarised by the *cumulative-mass curve*: heads sorted by score,
the share of the total positive score mass held by the top k heads, against k / (number of heads).
"x% of heads hold 50% of the positive mass" reads the curve at 0.5: small x = the evidence is
gathered by a few specialised heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Span = tuple[int, int]


def _positions(spans: Span | Sequence[Span], n: int, what: str) -> np.ndarray:
    """Sorted unique positions covered by one ``(start, end)`` span or several (half-open)."""
    if len(spans) == 2 and all(isinstance(x, int | np.integer) for x in spans):
        spans = [spans]  # type: ignore[list-item]
    out: list[int] = []
    for span in spans:  # type: ignore[union-attr]
        start, end = (int(x) for x in span)
        if not 0 <= start < end <= n:
            raise ValueError(
                f"{what} span {span} is not inside the {n}-token sequence (half-open, non-empty)"
            )
        out.extend(range(start, end))
    if not out:
        raise ValueError(f"no {what} span given: name at least one (start, end) span")
    return np.unique(np.asarray(out, dtype=np.int64))


def evidence_score(
    patterns: np.ndarray,
    question: Span | Sequence[Span],
    evidence: Span | Sequence[Span],
) -> np.ndarray:
    """Attention mass from question tokens to an evidence span, averaged over question tokens.

    ``evidence(l, h) = mean_{i ∈ Q} Σ_{j ∈ E} A[l, h][i, j]`` (see the module docstring for sources).

    Parameters
    ----------
    patterns : ``[layer, head, N, N]`` post-softmax attention of one run.
    question : ``(start, end)`` half-open span of the question's tokens, or a list of spans.
    evidence : ``(start, end)`` span of the evidence tokens, or a list of spans. Under causal
        attention evidence after a question token receives nothing from it.

    Returns
    -------
    ``[layer, head]`` float64 in [0, 1].
    """
    patterns = np.asarray(patterns)
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [layer, head, N, N], got shape {patterns.shape}")
    n = patterns.shape[-1]
    q = _positions(question, n, "question")
    e = _positions(evidence, n, "evidence")
    rows = np.asarray(patterns[:, :, q, :], dtype=np.float64)  # [L, H, |Q|, N]
    return rows[..., e].sum(-1).mean(-1)


@dataclass
class MassCurve:
    """The cumulative positive-mass curve of a score table.

    Attributes
    ----------
    head_fraction : ``[K + 1]`` k / (number of heads), k = 0..K over heads with positive score.
    mass_fraction : ``[K + 1]`` share of the positive mass held by the top k heads (0 at k = 0).
    order : ``[K]`` flat indices (``layer * H + head``) of the positive heads, best first.
    half_mass_heads : fewest heads holding at least ``level`` of the positive mass.
    half_mass_fraction : ``half_mass_heads`` / (number of heads); nan when no score is positive.
    """

    head_fraction: np.ndarray
    mass_fraction: np.ndarray
    order: np.ndarray
    half_mass_heads: int
    half_mass_fraction: float
    level: float


def cumulative_mass(scores: np.ndarray, level: float = 0.5) -> MassCurve:
    """Cumulative share of the positive score mass held by the top-k heads.

    With ``s_(1) >= s_(2) >= ...`` the positive scores, ``mass(k) = Σ_{r<=k} s_(r) / Σ_r s_(r)``; the
    reported fraction is ``min{k : mass(k) >= level} / (number of heads)`` — "x% of heads hold 50%
    of the positive score mass". Non-positive and nan scores carry no mass but count as heads.

    Parameters
    ----------
    scores : ``[layer, head]`` (any shape; flattened).
    level : the mass share to read off (default 0.5).

    Returns
    -------
    :class:`MassCurve`.
    """
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level must be in (0, 1]; got {level}")
    flat = np.asarray(scores, dtype=np.float64).ravel()
    n_heads = flat.size
    if n_heads == 0:
        raise ValueError("scores is empty")
    positive = np.flatnonzero(np.nan_to_num(flat, nan=0.0) > 0)
    order = positive[np.argsort(-flat[positive], kind="stable")]
    values = flat[order]
    total = values.sum()
    if total <= 0:
        return MassCurve(np.zeros(1), np.zeros(1), order, 0, float("nan"), level)
    mass = np.concatenate([[0.0], np.cumsum(values) / total])
    k = int(np.searchsorted(mass, level - 1e-12))  # first k with mass[k] >= level
    return MassCurve(
        head_fraction=np.arange(len(mass)) / n_heads,
        mass_fraction=mass,
        order=order,
        half_mass_heads=k,
        half_mass_fraction=k / n_heads,
        level=level,
    )

r"""Eager reference attention: the full matrix, and every statistic read off it.

:math:`A = \operatorname{softmax}(\text{scale} \cdot Q K^\top + M)` with :math:`M_{ij} = -\infty`
for keys after query ``i``'s position :math:`p_i = n_k - n_q + i` when causal, then
:math:`O = A V` and each statistic of :func:`headscope.kernels.attention.attention` computed directly from
its definition on :math:`A` (log-sum-exp of the scores as in Dao et al. 2022, "FlashAttention",
arXiv:2205.14135; sink mass as in Xiao et al. 2023, arXiv:2309.17453; sink + recent-window mass as in
DuoAttention, Xiao et al. 2024, arXiv:2410.10819; the argmax key of Wu et al. 2024, arXiv:2404.15574).

This is what the tests, ``bench/gpu_check.py`` and ``bench/kernels_micro.py`` compare the kernels
with: it builds ``n_q × n_k`` per head (in float64 by default), so it is for checking small and
medium shapes, never for analysing long texts. It trusts its inputs; :func:`headscope.kernels.attention.attention`
is the entry that validates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from headscope.kernels import statistics as stat

#: Key of the attention output in :func:`reference_attention`'s dictionary.
OUT = "out"


def attention_scores(
    q: Tensor, k: Tensor, *, causal: bool = True, scale: float | None = None, dtype: torch.dtype = torch.float64,
    key_sink: int | Tensor | None = None, key_window: int | Tensor | None = None, softcap: float | None = None,
) -> Tensor:
    """Scaled scores ``[b, n_heads, n_q, n_k]`` in ``dtype``, ``-inf`` on masked keys.

    ``q`` is ``[b, n_heads, n_q, d]`` and ``k`` ``[b, n_kv_heads, n_k, d]``; with grouped-query
    attention K is repeated so that query head ``h`` meets key-value head ``h // (n_heads // n_kv_heads)``.
    ``softcap`` caps the scaled scores (``c · tanh(s / c)``) before the mask; ``key_sink`` and
    ``key_window`` (int or ``[n_heads]``) narrow the causal mask as in :func:`headscope.kernels.attention.attention`.
    """
    n_heads, n_q, d = q.shape[1:]
    n_kv, n_k = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kr = k.to(dtype).repeat_interleave(n_heads // n_kv, 1)
    scores = q.to(dtype) @ kr.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = _visible(n_q, n_k, causal, q.device, n_heads, key_sink, key_window)
    return scores.masked_fill(~visible, float("-inf"))


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``softmax(scores) @ V`` with the full matrix, in ``dtype`` (default: ``q``'s).

    What Hugging Face's ``attn_implementation="eager"`` does: repeat K/V per query head, build the
    matrix, one softmax. The timing baseline of ``bench/kernels_micro.py``.
    """
    dtype = dtype or q.dtype
    vr = v.to(dtype).repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.softmax(attention_scores(q, k, causal=causal, scale=scale, dtype=dtype), -1) @ vr


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    sink_size: int = stat.DEFAULT_SINK_SIZE,
    window: int = stat.DEFAULT_WINDOW,
    spans: Sequence[tuple[int, int]] = (),
    block_size: int | None = None,
    rows: Sequence[int] = (),
    topk: int = 1,
    dtype: torch.dtype = torch.float64,
    key_sink: int | Tensor | None = None,
    key_window: int | Tensor | None = None,
    softcap: float | None = None,
) -> dict[str, Tensor]:
    """The output and every statistic of :func:`headscope.kernels.attention.attention`, from the full matrix.

    Parameters
    ----------
    q, k, v, causal, scale, sink_size, window, spans, block_size, rows, topk, key_sink, key_window, softcap
        As for :func:`headscope.kernels.attention.attention`. ``"span_mass"`` is computed only with
        ``spans``, ``"pooled"`` only with ``block_size``, ``"rows"`` only with ``rows``, and
        ``"topk_index"`` / ``"topk_prob"`` only with ``topk > 1``.
    dtype : torch.dtype
        What everything is computed in (float64: exact enough to judge a float32 kernel).

    Returns
    -------
    dict[str, Tensor]
        ``"out"`` ``[b, h, n_q, d_v]`` and the statistics by name, with the shapes the kernels
        give, in ``dtype`` (indices int64).
    """
    b, n_heads, n_q, _ = q.shape
    n_kv, n_k = k.shape[1], k.shape[2]
    mask = dict(key_sink=key_sink, key_window=key_window)
    s = attention_scores(q, k, causal=causal, scale=scale, dtype=dtype, softcap=softcap, **mask)
    a = torch.softmax(s, -1)
    ref = {
        OUT: a @ v.to(dtype).repeat_interleave(n_heads // n_kv, 1),
        stat.LSE: torch.logsumexp(s, -1),
        stat.ENTROPY: torch.special.entr(a).sum(-1),  # -Σ A ln A, with 0 ln 0 = 0
        stat.ARGMAX: a.argmax(-1),
        stat.ARGMAX_PROB: a.amax(-1),
        stat.SINK_MASS: a[..., : min(sink_size, n_k)].sum(-1),
        stat.COL_SUM: a.sum(-2),
    }
    visible = _visible(n_q, n_k, causal, q.device, n_heads, **mask)
    if topk > 1:
        probs, idx = a.topk(topk, -1)
        dead = torch.arange(topk, device=q.device) >= visible.sum(-1, keepdim=True)  # [h, n_q, topk]
        ref[stat.TOPK_INDEX] = idx.masked_fill(dead, -1)
        ref[stat.TOPK_PROB] = probs.masked_fill(dead, 0.0)
    if spans:
        ref[stat.SPAN_MASS] = torch.stack([a[..., start:end].sum(-1) for start, end in spans], -1)
    pos = torch.arange(n_q, device=q.device) + (n_k - n_q)
    keys = torch.arange(n_k, device=q.device)
    recent = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
    ref[stat.RECENT_MASS] = (a * recent).sum(-1)
    if block_size:
        B = block_size
        nqb, nkb = -(-n_q // B), -(-n_k // B)
        padded = torch.zeros(b, n_heads, nqb * B, nkb * B, dtype=dtype, device=q.device)
        padded[..., :n_q, :n_k] = a
        cells = torch.zeros(nqb * B, nkb * B, dtype=dtype, device=q.device)
        cells[:n_q, :n_k] = 1
        ref[stat.POOLED] = padded.view(b, n_heads, nqb, B, nkb, B).sum((3, 5)) / cells.view(nqb, B, nkb, B).sum((1, 3))
    if rows:
        ref[stat.ROWS] = a[:, :, list(rows)]
    return ref


def _visible(n_q: int, n_k: int, causal: bool, device: torch.device, n_heads: int = 1,
             key_sink: int | Tensor | None = None, key_window: int | Tensor | None = None) -> Tensor:
    """``[n_heads, n_q, n_k]``: which keys each query row of each head sees, by the definition
    (row ``i`` sits at key position ``p = n_k - n_q + i``; key ``j`` is visible when ``j <= p`` and,
    for a head with window ``W > 0``, ``j < S`` or ``j > p - W``)."""
    if not causal:
        return torch.ones(n_heads, n_q, n_k, dtype=torch.bool, device=device)
    window = torch.as_tensor(0 if key_window is None else key_window, device=device).expand(n_heads)
    sink = torch.as_tensor(0 if key_sink is None else key_sink, device=device).expand(n_heads)
    window, sink = window.view(-1, 1, 1), sink.view(-1, 1, 1)
    p = (torch.arange(n_q, device=device) + (n_k - n_q)).view(1, -1, 1)
    j = torch.arange(n_k, device=device).view(1, 1, -1)
    return (j <= p) & ((window == 0) | (j < sink) | (j > p - window))

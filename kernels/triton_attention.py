"""Triton kernels for :func:`headscope.kernels.attention.attention` (the ``"triton"`` backend).

Two passes, in the spirit of Triton's fused-attention tutorial (``06-fused-attention.py``):

1. ``_attn_fwd``: online softmax over key tiles; writes the output and the per-row log-sum-exp.
2. ``_attn_stats``: recomputes the scores tile by tile and, knowing the row's lse, reads each
   probability exactly once: :math:`A_{ij} = \\exp(s_{ij} - \\text{lse}_i)`. It reduces entropy,
   argmax, span / sink / recent mass in registers, column sums and pooled block sums with atomics,
   and stores the chosen rows.

Pass 2 is one launch whatever the set of row statistics, and ``topk <= 16`` is part of it: each row
keeps a running list of its K best (score, index) pairs packed into sortable int64 keys
(``_order_key``), merged tile by tile by K steps of max-extraction (skipped for a block none of whose
rows has a tile key above its K-th), so its cost does not grow with the number of statistics. ``topk > 16`` takes ``topk - 1`` more launches of
``_attn_topk_next``, each finding the next key below the previous one in (score, index) order.
Column sums asked alone have their own pass (``_attn_colsum``, no atomics); with other statistics
they are atomics inside pass 2. Decode rows (few queries, many keys) take the split-K kernel of
:mod:`headscope.kernels.triton_decode` instead (see :func:`headscope.kernels.attention.attention`).

Grid: ``(ceil(n_q / BLOCK_M), batch · n_heads)``; the program for query head ``h`` reads key-value
head ``h // group`` directly, so grouped-query attention never repeats K/V. Scores are kept in
base-2 units (``s · scale · log2 e``) so that ``exp2`` does the exponentials.

The kernels are importable without a GPU. With ``TRITON_INTERPRET=1`` set before ``triton`` is
first imported they run on CPU tensors (slowly), which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from headscope.kernels import statistics as stat
from headscope.kernels.statistics import Plan, pool_counts, split_span_masses, triton_interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _load_q(Q, b, h, stride_qb, stride_qh, stride_qm, stride_qd, offs_m, offs_d, row_ok,
            HEAD_D: tl.constexpr, UPCAST: tl.constexpr):
    ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    if HEAD_D == offs_d.shape[0]:
        q = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    if UPCAST:  # the interpreter has no bfloat16 matmul
        q = q.to(tl.float32)
    return q


@triton.jit
def _key_range(pid_m, N_K, OFFSET, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOWED: tl.constexpr):
    """(free, hi): tiles in [0, free) need no mask; the block sees no key at or after hi."""
    if WINDOWED:  # a sliding window masks old keys too: every tile takes the masked path
        hi = tl.minimum(N_K, OFFSET + (pid_m + 1) * BLOCK_M)
        free = 0
    elif CAUSAL:
        hi = tl.minimum(N_K, OFFSET + (pid_m + 1) * BLOCK_M)
        # tiles wholly at or before the block's first query position (and inside n_k)
        free = tl.minimum(((OFFSET + pid_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N, (N_K // BLOCK_N) * BLOCK_N)
    else:
        hi = N_K
        free = (N_K // BLOCK_N) * BLOCK_N
    return free, hi


@triton.jit
def _window_tiles(pid_m, OFFSET, win, sink, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles a block of queries needs under a window: ``[0, s_hi)`` for the sink keys and
    ``[w_lo, hi)`` for the window (from the block's first query, whose window starts earliest);
    tiles in between hold only masked keys and are skipped, so a windowed layer costs O(n · W)."""
    first = OFFSET + pid_m * BLOCK_M
    w_lo = tl.where(win > 0, (tl.maximum(first - win + 1, 0) // BLOCK_N) * BLOCK_N, 0)
    s_hi = tl.minimum(((sink + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, w_lo)
    return w_lo, s_hi


@triton.jit
def _cap(s, cap):
    """Soft-capping of base-2 scores: c · tanh(s_nat / c) with s_nat = s / log2 e, back in base 2."""
    x = s * (2.0 * 0.6931471805599453 / cap)  # 2 · s_nat / c
    t = 1.0 - 2.0 / (tl.math.exp(x) + 1.0)  # tanh(s_nat / c); exp overflow gives ±1 exactly
    return t * (cap * 1.4426950408889634)


@triton.jit
def _score_tile(q, k_base, stride_kn, stride_kd, offs_d, start_n, offs_n, pos, N_K, qk_scale,
                win, sink, cap,
                HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores of one key tile in base-2 units (s · scale · log2 e), soft-capped when SOFTCAP, -inf
    where masked (causal, and with WINDOWED: outside this head's window ``win`` and sink ``sink``)."""
    cols = start_n + offs_n
    if MASKED:
        k = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=(cols[None, :] < N_K) & (offs_d[:, None] < HEAD_D), other=0.0,
        )
    elif HEAD_D == offs_d.shape[0]:  # interior tile, no padding: a plain load
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd)
    else:
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=offs_d[:, None] < HEAD_D, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s = _cap(s, cap)
    if MASKED:
        visible = cols[None, :] < N_K
        if CAUSAL:
            visible = visible & (cols[None, :] <= pos[:, None])
        if WINDOWED:
            visible = visible & ((win == 0) | (cols[None, :] < sink) | (cols[None, :] > pos[:, None] - win))
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_d, offs_dv, offs_n, pos, N_K, qk_scale, lo, hi, win, sink, cap,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax over the key tiles in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        s = _score_tile(q, k_base, stride_kn, stride_kd, offs_d, start_n, offs_n, pos, N_K, qk_scale,
                        win, sink, cap, HEAD_D, CAUSAL, MASKED, PRECISION, UPCAST, WINDOWED, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:  # a row may see no key of its first tiles yet: exp2(-inf - -inf) would be nan
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        cols = start_n + offs_n
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if MASKED:
            v = tl.load(v_ptrs, mask=(cols[:, None] < N_K) & (offs_dv[None, :] < HEAD_DV), other=0.0)
        elif HEAD_DV == offs_dv.shape[0]:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DV, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _head_mask(Win, Sink, h, WINDOWED: tl.constexpr):
    """This query head's key window and sink (0, 0 without windows)."""
    if WINDOWED:
        return tl.load(Win + h), tl.load(Sink + h)
    return 0, 0


@triton.jit
def _order_key(s, cols):
    """(score, key index) as one int64 whose signed order is score first, then the lower index: the
    IEEE bits of a float32 made monotone as an int32 (negative values' magnitude bits flipped) in the
    high word, ``2^31 − 1 − index`` in the low word. Keys are unique per row, so the largest keys are
    the (score desc, index asc) order: the first place is what ``torch.argmax`` picks on ties."""
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0, as in torch
    bits = s.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _order_key_empty(BLOCK_M: tl.constexpr, TOPK_P: tl.constexpr):
    """A running top-K list of nothing: key of (-inf, index 2^31 − 1), below every real key."""
    return tl.full([BLOCK_M, TOPK_P], -8388608 ^ 0x7FFFFFFF, tl.int64) << 32  # -inf's bits, made monotone


@triton.jit
def _argmax_merge(best, best_i, s, start_n):
    """Merge one tile's scores ``[BLOCK_M, BLOCK_N]`` (keys from ``start_n``) into each row's running
    (max score, its key index). Strict ``>``: on a tie the earlier (lower) key index is kept."""
    tile_best = tl.max(s, 1)
    tile_i = tl.argmax(s, 1).to(tl.int32) + start_n
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_i, best_i)


@triton.jit
def _topk_merge(top, s, cols, TOPK: tl.constexpr):
    """Merge one tile's scores ``[BLOCK_M, BLOCK_N]`` (key indices ``cols``) into the running top-K
    ``[BLOCK_M, TOPK_P]`` of :func:`_order_key` keys (sorted, best first; slots from ``TOPK`` on
    unused). K steps of max-extraction over the union of the list and the tile (keys are unique, so
    each step removes exactly one), skipped when no row of the block has a tile key above its K-th."""
    keys = _order_key(s, cols[None, :])
    slot = tl.arange(0, top.shape[1])[None, :]
    kth = tl.min(tl.where(slot < TOPK, top, 9223372036854775807), 1)
    if tl.max((tl.max(keys, 1) > kth).to(tl.int32), 0) > 0:
        new = top
        for r in tl.static_range(TOPK):
            best = tl.maximum(tl.max(keys, 1), tl.max(top, 1))
            new = tl.where(slot == r, best[:, None], new)
            keys = tl.where(keys == best[:, None], -9223372036854775807, keys)
            top = tl.where(top == best[:, None], -9223372036854775807, top)
        top = new
    return top


@triton.jit
def _order_key_unpack(top):
    """(base-2 score, key index) back out of :func:`_order_key` keys."""
    idx = 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32)
    ordered = (top >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), idx


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    qk_scale,  # scale · log2(e)
    H, GROUP, N_Q, N_K, OFFSET,
    Win, Sink, cap,  # per query head window and sink (WINDOWED), soft-cap (SOFTCAP)
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Pass 1: output and natural-log lse per row."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # grouped-query attention: this query head's key-value head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q
    q = _load_q(Q, b, h, stride_qb, stride_qh, stride_qm, stride_qd, offs_m, offs_d, row_ok, HEAD_D, UPCAST)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    pos = OFFSET + offs_m  # key position of each query row
    win, sink = _head_mask(Win, Sink, h, WINDOWED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    free, hi = _key_range(pid_m, N_K, OFFSET, CAUSAL, BLOCK_M, BLOCK_N, WINDOWED)
    if WINDOWED:  # [0, free) is empty: the sink tiles, then the window's, all masked
        w_lo, s_hi = _window_tiles(pid_m, OFFSET, win, sink, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_d, offs_dv, offs_n, pos, N_K, qk_scale, 0, s_hi, win, sink, cap,
                                   HEAD_D, HEAD_DV, CAUSAL, True, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP)
        free = w_lo
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_d, offs_dv, offs_n, pos, N_K, qk_scale, 0, free, win, sink, cap,
                                   HEAD_D, HEAD_DV, CAUSAL, False, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_d, offs_dv, offs_n, pos, N_K, qk_scale, free, hi, win, sink, cap,
                               HEAD_D, HEAD_DV, CAUSAL, True, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP)
    acc = acc / l_i[:, None]
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
        acc.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV),
    )
    tl.store(Lse + pid_bh * N_Q + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit
def _stats_tiles(
    ent, best, best_i, span_acc, recent, top,
    q, k_base, stride_kn, stride_kd, offs_d, offs_n, offs_m, pos, pos_lo, pos_hi, lse2, pid_m, pid_bh,
    N_K, qk_scale, lo, hi,
    Spans, span_ids, WINDOW, Col, Pool, POOL_B, N_QB, N_KB, slots, any_row, RowsOut, N_ROWS, win, sink, cap,
    HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    DO_ENT: tl.constexpr, DO_ARG: tl.constexpr, NUM_SPANS: tl.constexpr,
    DO_RECENT: tl.constexpr, DO_COL: tl.constexpr,
    POOL_MODE: tl.constexpr, POOL_PM: tl.constexpr, POOL_PN: tl.constexpr,
    POOL_QBP: tl.constexpr, POOL_KBP: tl.constexpr, DO_ROWS: tl.constexpr,
    DO_TOPK: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
):
    """Pass 2 over the key tiles in [lo, hi): every statistic from A = exp2(s - lse2), and the
    running top-K keys by score (DO_TOPK)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s = _score_tile(q, k_base, stride_kn, stride_kd, offs_d, start_n, offs_n, pos, N_K, qk_scale,
                        win, sink, cap, HEAD_D, CAUSAL, MASKED, PRECISION, UPCAST, WINDOWED, SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None])  # masked: exp2(-inf) = 0
        if DO_ENT:
            ent += tl.sum(p * tl.where(p > 0, s - lse2[:, None], 0.0), 1)  # no 0 · -inf
        if DO_ARG:
            best, best_i = _argmax_merge(best, best_i, s, start_n)
        if DO_TOPK:
            top = _topk_merge(top, s, cols, TOPK)
        if NUM_SPANS > 0:
            for si in tl.static_range(NUM_SPANS):
                a = tl.load(Spans + 2 * si)
                z = tl.load(Spans + 2 * si + 1)
                if (start_n < z) & (start_n + BLOCK_N > a):  # only tiles that touch the span
                    inside = (cols >= a) & (cols < z)
                    part = tl.sum(tl.where(inside[None, :], p, 0.0), 1)
                    span_acc += tl.where(span_ids[None, :] == si, part[:, None], 0.0)
        if DO_RECENT:
            if (start_n + BLOCK_N > pos_lo - WINDOW + 1) & (start_n <= pos_hi):
                band = (cols[None, :] <= pos[:, None]) & (cols[None, :] > pos[:, None] - WINDOW)
                recent += tl.sum(tl.where(band, p, 0.0), 1)
        if DO_COL:
            tl.atomic_add(Col + pid_bh * N_K + cols, tl.sum(p, 0), mask=cols < N_K)
        if POOL_MODE == 1:
            # tiles and pooled blocks nest (powers of two): sum sub-blocks in registers
            blk = tl.reshape(p, (POOL_PM, BLOCK_M // POOL_PM, POOL_PN, BLOCK_N // POOL_PN))
            sums = tl.sum(tl.sum(blk, 3), 1)
            qb = (pid_m * BLOCK_M + tl.arange(0, POOL_PM) * (BLOCK_M // POOL_PM)) // POOL_B
            kb = (start_n + tl.arange(0, POOL_PN) * (BLOCK_N // POOL_PN)) // POOL_B
            tl.atomic_add(
                Pool + pid_bh * N_QB * N_KB + qb[:, None] * N_KB + kb[None, :], sums,
                mask=(qb[:, None] < N_QB) & (kb[None, :] < N_KB),
            )
        if POOL_MODE == 2:
            # any block size: one-hot indicator matmuls, blocks_qᵀ · P · blocks_k
            qb0 = (pid_m * BLOCK_M) // POOL_B
            kb0 = start_n // POOL_B
            ind_q = (tl.arange(0, POOL_QBP)[:, None] == (offs_m // POOL_B - qb0)[None, :]).to(tl.float32)
            ind_k = ((cols // POOL_B - kb0)[:, None] == tl.arange(0, POOL_KBP)[None, :]).to(tl.float32)
            sums = tl.dot(tl.dot(ind_q, p, input_precision="ieee"), ind_k, input_precision="ieee")
            qb = qb0 + tl.arange(0, POOL_QBP)
            kb = kb0 + tl.arange(0, POOL_KBP)
            tl.atomic_add(
                Pool + pid_bh * N_QB * N_KB + qb[:, None] * N_KB + kb[None, :], sums,
                mask=(qb[:, None] < N_QB) & (kb[None, :] < N_KB)
                & (qb[:, None] * POOL_B < pid_m * BLOCK_M + BLOCK_M)
                & (kb[None, :] * POOL_B < start_n + BLOCK_N),
            )
        if DO_ROWS:
            if any_row:
                tl.store(
                    RowsOut + (pid_bh * N_ROWS + slots[:, None]) * N_K + cols[None, :], p,
                    mask=(slots[:, None] >= 0) & (cols[None, :] < N_K),
                )
    return ent, best, best_i, span_acc, recent, top


@triton.jit
def _attn_stats(
    Q, K, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    qk_scale,
    H, GROUP, N_Q, N_K, OFFSET,
    Ent, ArgIdx, ArgVal,
    Spans, SpanOut,
    Recent, WINDOW,
    Col,
    Pool, POOL_B, N_QB, N_KB,
    RowSlot, RowsOut, N_ROWS,
    TopVal, TopIdx,
    Win, Sink, cap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DO_ENT: tl.constexpr, DO_ARG: tl.constexpr, NUM_SPANS: tl.constexpr, SPAN_PAD: tl.constexpr,
    DO_RECENT: tl.constexpr, DO_COL: tl.constexpr,
    POOL_MODE: tl.constexpr, POOL_PM: tl.constexpr, POOL_PN: tl.constexpr,
    POOL_QBP: tl.constexpr, POOL_KBP: tl.constexpr,
    DO_ROWS: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    DO_TOPK: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
):
    """Pass 2: recompute scores with the known lse and reduce the requested statistics, top-K
    (K = TOPK <= 16, in TOPK_P >= K slots, a power of two) included: one pass for any number of them."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    q = _load_q(Q, b, h, stride_qb, stride_qh, stride_qm, stride_qd, offs_m, offs_d, row_ok, HEAD_D, UPCAST)
    k_base = K + b * stride_kb + hk * stride_kh
    # +inf lse on padding rows makes their probabilities exactly 0 everywhere
    lse2 = tl.load(Lse + pid_bh * N_Q + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    pos = OFFSET + offs_m
    win, sink = _head_mask(Win, Sink, h, WINDOWED)
    pos_lo = OFFSET + pid_m * BLOCK_M
    pos_hi = tl.minimum(OFFSET + (pid_m + 1) * BLOCK_M, OFFSET + N_Q) - 1

    ent = tl.zeros([BLOCK_M], tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_M], tl.int32)
    span_acc = tl.zeros([BLOCK_M, SPAN_PAD], tl.float32)
    span_ids = tl.arange(0, SPAN_PAD)
    recent = tl.zeros([BLOCK_M], tl.float32)
    top = _order_key_empty(BLOCK_M, TOPK_P)
    if DO_ROWS:
        slots = tl.load(RowSlot + offs_m, mask=row_ok, other=-1)
    else:
        slots = tl.full([BLOCK_M], -1, tl.int32)
    any_row = tl.max(slots, 0) >= 0
    free, hi = _key_range(pid_m, N_K, OFFSET, CAUSAL, BLOCK_M, BLOCK_N, WINDOWED)
    if WINDOWED:  # sink tiles, then the window's (see _window_tiles)
        w_lo, s_hi = _window_tiles(pid_m, OFFSET, win, sink, BLOCK_M, BLOCK_N)
        ent, best, best_i, span_acc, recent, top = _stats_tiles(
            ent, best, best_i, span_acc, recent, top,
            q, k_base, stride_kn, stride_kd, offs_d, offs_n, offs_m, pos, pos_lo, pos_hi, lse2, pid_m, pid_bh,
            N_K, qk_scale, 0, s_hi,
            Spans, span_ids, WINDOW, Col, Pool, POOL_B, N_QB, N_KB, slots, any_row, RowsOut, N_ROWS, win, sink, cap,
            HEAD_D, CAUSAL, True, BLOCK_M, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP, DO_ENT, DO_ARG, NUM_SPANS,
            DO_RECENT, DO_COL, POOL_MODE, POOL_PM, POOL_PN, POOL_QBP, POOL_KBP, DO_ROWS, DO_TOPK, TOPK, TOPK_P,
        )
        free = w_lo
    else:
        ent, best, best_i, span_acc, recent, top = _stats_tiles(
            ent, best, best_i, span_acc, recent, top,
            q, k_base, stride_kn, stride_kd, offs_d, offs_n, offs_m, pos, pos_lo, pos_hi, lse2, pid_m, pid_bh,
            N_K, qk_scale, 0, free,
            Spans, span_ids, WINDOW, Col, Pool, POOL_B, N_QB, N_KB, slots, any_row, RowsOut, N_ROWS, win, sink, cap,
            HEAD_D, CAUSAL, False, BLOCK_M, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP, DO_ENT, DO_ARG, NUM_SPANS,
            DO_RECENT, DO_COL, POOL_MODE, POOL_PM, POOL_PN, POOL_QBP, POOL_KBP, DO_ROWS, DO_TOPK, TOPK, TOPK_P,
        )
    ent, best, best_i, span_acc, recent, top = _stats_tiles(
        ent, best, best_i, span_acc, recent, top,
        q, k_base, stride_kn, stride_kd, offs_d, offs_n, offs_m, pos, pos_lo, pos_hi, lse2, pid_m, pid_bh,
        N_K, qk_scale, free, hi,
        Spans, span_ids, WINDOW, Col, Pool, POOL_B, N_QB, N_KB, slots, any_row, RowsOut, N_ROWS, win, sink, cap,
        HEAD_D, CAUSAL, True, BLOCK_M, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP, DO_ENT, DO_ARG, NUM_SPANS,
        DO_RECENT, DO_COL, POOL_MODE, POOL_PM, POOL_PN, POOL_QBP, POOL_KBP, DO_ROWS, DO_TOPK, TOPK, TOPK_P,
    )

    if DO_ENT:
        tl.store(Ent + pid_bh * N_Q + offs_m, -ent * 0.6931471805599453, mask=row_ok)
    if DO_ARG:
        tl.store(ArgIdx + pid_bh * N_Q + offs_m, best_i, mask=row_ok)
        tl.store(ArgVal + pid_bh * N_Q + offs_m, best, mask=row_ok)
    if NUM_SPANS > 0:
        tl.store(
            SpanOut + (pid_bh * N_Q + offs_m[:, None]) * NUM_SPANS + span_ids[None, :], span_acc,
            mask=row_ok[:, None] & (span_ids[None, :] < NUM_SPANS),
        )
    if DO_RECENT:
        tl.store(Recent + pid_bh * N_Q + offs_m, recent, mask=row_ok)
    if DO_TOPK:
        top_v, top_i = _order_key_unpack(top)
        slot = (pid_bh * N_Q + offs_m[:, None]) * TOPK_P + tl.arange(0, TOPK_P)[None, :]
        tl.store(TopVal + slot, top_v, mask=row_ok[:, None])
        tl.store(TopIdx + slot, top_i, mask=row_ok[:, None])


@triton.jit
def _attn_colsum(
    Q, K, Lse, Col,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    qk_scale,
    H, GROUP, N_Q, N_K, OFFSET,
    Win, Sink, cap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Pass 2 for column sums alone: one program per key tile walks the query blocks that see it
    (FlashAttention's backward loop order), so each column sum stays in registers, no atomics.
    ``Σ_i A[i, j]`` with ``A = exp2(s − lse2)`` from pass 1's lse."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < N_K
    kt_ptrs = K + b * stride_kb + hk * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    kt = tl.load(kt_ptrs, mask=col_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)  # [D, BLOCK_N]
    if UPCAST:
        kt = kt.to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    win, sink = _head_mask(Win, Sink, h, WINDOWED)
    m_lo = 0
    if CAUSAL:  # query i (at position OFFSET + i) sees key j when j <= OFFSET + i
        m_lo = (tl.maximum(pid_n * BLOCK_N - OFFSET, 0) // BLOCK_M) * BLOCK_M
    m_hi = N_Q
    if WINDOWED:  # past the sinks, key j is seen only by positions < j + win
        last_key = pid_n * BLOCK_N + BLOCK_N - 1
        m_hi = tl.where((win > 0) & (pid_n * BLOCK_N >= sink),
                        tl.minimum(tl.maximum(last_key + win - OFFSET, 0), N_Q), N_Q)
    for start_m in range(m_lo, m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_Q
        q = _load_q(Q, b, h, stride_qb, stride_qh, stride_qm, stride_qd, offs_m, offs_d, row_ok, HEAD_D, UPCAST)
        lse2 = tl.load(Lse + pid_bh * N_Q + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = _cap(s, cap)
        p = tl.math.exp2(s - lse2[:, None])
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= (OFFSET + offs_m)[:, None])
        if WINDOWED:
            pos = (OFFSET + offs_m)[:, None]
            valid = valid & ((win == 0) | (offs_n[None, :] < sink) | (offs_n[None, :] > pos - win))
        acc += tl.sum(tl.where(valid, p, 0.0), 0)
    tl.store(Col + pid_bh * N_K + offs_n, acc, mask=col_ok)


@triton.jit
def _topk_tiles(best, best_i, prev, prev_i, q, k_base, stride_kn, stride_kd, offs_d, offs_n, pos,
                N_K, qk_scale, lo, hi, win, sink, cap,
                HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s = _score_tile(q, k_base, stride_kn, stride_kd, offs_d, start_n, offs_n, pos, N_K, qk_scale,
                        win, sink, cap, HEAD_D, CAUSAL, MASKED, PRECISION, UPCAST, WINDOWED, SOFTCAP)
        after = (s < prev[:, None]) | ((s == prev[:, None]) & (cols[None, :] > prev_i[:, None]))
        s = tl.where(after & (s > float("-inf")), s, float("-inf"))
        best, best_i = _argmax_merge(best, best_i, s, start_n)
    return best, best_i


@triton.jit
def _attn_topk_next(
    Q, K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    qk_scale,
    H, GROUP, N_Q, N_K, OFFSET,
    PrevVal, PrevIdx, NextVal, NextIdx,
    Win, Sink, cap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """The best key strictly after (prev score, prev index) in (score desc, index asc) order."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_Q
    q = _load_q(Q, b, h, stride_qb, stride_qh, stride_qm, stride_qd, offs_m, offs_d, row_ok, HEAD_D, UPCAST)
    k_base = K + b * stride_kb + hk * stride_kh
    pos = OFFSET + offs_m
    win, sink = _head_mask(Win, Sink, h, WINDOWED)
    prev = tl.load(PrevVal + pid_bh * N_Q + offs_m, mask=row_ok, other=float("-inf"))
    prev_i = tl.load(PrevIdx + pid_bh * N_Q + offs_m, mask=row_ok, other=0)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_M], -1, tl.int32)
    free, hi = _key_range(pid_m, N_K, OFFSET, CAUSAL, BLOCK_M, BLOCK_N, WINDOWED)
    if WINDOWED:  # sink tiles, then the window's (see _window_tiles)
        w_lo, s_hi = _window_tiles(pid_m, OFFSET, win, sink, BLOCK_M, BLOCK_N)
        best, best_i = _topk_tiles(best, best_i, prev, prev_i, q, k_base, stride_kn, stride_kd, offs_d, offs_n,
                                   pos, N_K, qk_scale, 0, s_hi, win, sink, cap, HEAD_D, CAUSAL, True, BLOCK_N,
                                   PRECISION, UPCAST, WINDOWED, SOFTCAP)
        free = w_lo
    else:
        best, best_i = _topk_tiles(best, best_i, prev, prev_i, q, k_base, stride_kn, stride_kd, offs_d, offs_n,
                                   pos, N_K, qk_scale, 0, free, win, sink, cap, HEAD_D, CAUSAL, False, BLOCK_N,
                                   PRECISION, UPCAST, WINDOWED, SOFTCAP)
    best, best_i = _topk_tiles(best, best_i, prev, prev_i, q, k_base, stride_kn, stride_kd, offs_d, offs_n,
                               pos, N_K, qk_scale, free, hi, win, sink, cap, HEAD_D, CAUSAL, True, BLOCK_N,
                               PRECISION, UPCAST, WINDOWED, SOFTCAP)
    tl.store(NextVal + pid_bh * N_Q + offs_m, best, mask=row_ok)
    tl.store(NextIdx + pid_bh * N_Q + offs_m, best_i, mask=row_ok)


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) per pass, by largest head size. Chosen so that ptxas
#: reports no register spills for sm_90 (bf16, every statistic on), not yet timed on a GPU:
#: bench/gpu_check.py times alternatives through TILE_OVERRIDE.
TILES = {
    "fwd": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
    "stats": {64: (64, 64, 4, 3), 128: (64, 64, 8, 3), 256: (32, 32, 4, 2)},
    "cols": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (32, 32, 4, 2)},
}
TILE_OVERRIDE: dict[str, tuple[int, int, int, int]] = {}
#: Largest ``topk`` kept as a running list inside the statistics pass; above it, one pass per rank.
FUSED_TOPK_MAX = 16


def _tiles(d: int, which: str) -> tuple[int, int, int, int]:
    """Tile shape for a head size; small tiles under the interpreter (fast to emulate)."""
    if triton_interpreting():
        return 16, 16, 1, 1
    if which in TILE_OVERRIDE:
        return TILE_OVERRIDE[which]
    table = TILES[which]
    return next((table[size] for size in sorted(table) if d <= size), table[max(table)])


def _pool_config(B: int, block_m: int, block_n: int) -> dict:
    nests = all((B % t == 0) or (t % B == 0) for t in (block_m, block_n)) and B & (B - 1) == 0
    if nests:
        return dict(POOL_MODE=1, POOL_PM=max(block_m // B, 1), POOL_PN=max(block_n // B, 1),
                    POOL_QBP=1, POOL_KBP=1)
    qbp = max(16, triton.next_power_of_2(-(-block_m // B) + 1))
    kbp = max(16, triton.next_power_of_2(-(-block_n // B) + 1))
    return dict(POOL_MODE=2, POOL_PM=1, POOL_PN=1, POOL_QBP=qbp, POOL_KBP=kbp)


def triton_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: Plan, block_m: int | None = None, block_n: int | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run both passes on validated inputs; returns ``(out, stats)`` as the torch backend does.

    ``block_m`` / ``block_n`` override the tile sizes (powers of two, at least 16), for tests.
    """
    b, n_heads, n_q, d = q.shape
    n_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    group = n_heads // n_kv
    offset = n_k - n_q
    dev = q.device
    st = plan.stats
    upcast = triton_interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    qk_scale = plan.scale * LOG2E
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(d_v))
    windowed = plan.windowed
    win_t = torch.tensor(plan.key_window or (0,), dtype=torch.int32, device=dev)
    sink_t = torch.tensor(plan.key_sink or (0,), dtype=torch.int32, device=dev)
    mask_args = (win_t, sink_t, float(plan.softcap or 1.0))
    mask_flags = dict(WINDOWED=windowed, SOFTCAP=plan.softcap is not None)

    bm, bn, warps, stages = _tiles(max(d, d_v), "fwd")
    bm, bn = block_m or bm, block_n or bn
    out = torch.empty(b, n_heads, n_q, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(b, n_heads, n_q, dtype=torch.float32, device=dev)
    grid = (triton.cdiv(n_q, bm), b * n_heads)
    common = (*q.stride(), *k.stride())
    _attn_fwd[grid](
        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), qk_scale,
        n_heads, group, n_q, n_k, offset, *mask_args,
        HEAD_D=d, HEAD_DV=d_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        CAUSAL=plan.causal, BLOCK_M=bm, BLOCK_N=bn, PRECISION=precision, UPCAST=upcast, num_warps=warps, num_stages=stages,
        **mask_flags,
    )
    res: dict[str, Tensor] = {}
    if stat.LSE in st:
        res[stat.LSE] = lse
    second = st - {stat.LSE}
    if not second:
        return out, res
    if second == {stat.COL_SUM}:
        # column sums alone: walk queries per key tile (no atomics; one more recompute either way)
        bm, bn, warps, stages = _tiles(d, "cols")
        bm, bn = block_m or bm, block_n or bn
        col = torch.empty(b, n_heads, n_k, dtype=torch.float32, device=dev)
        _attn_colsum[(triton.cdiv(n_k, bn), b * n_heads)](
            q, k, lse, col, *q.stride(), *k.stride(), qk_scale, n_heads, group, n_q, n_k, offset, *mask_args,
            HEAD_D=d, BLOCK_D=block_d, CAUSAL=plan.causal, BLOCK_M=bm, BLOCK_N=bn, PRECISION=precision,
            UPCAST=upcast, num_warps=warps, num_stages=stages, **mask_flags,
        )
        res[stat.COL_SUM] = col
        return out, res

    bm, bn, warps, stages = _tiles(d, "stats")
    bm, bn = block_m or bm, block_n or bn
    grid = (triton.cdiv(n_q, bm), b * n_heads)
    f32 = dict(dtype=torch.float32, device=dev)
    dummy = lse
    fused_topk = stat.ARGMAX in st and 1 < plan.topk <= FUSED_TOPK_MAX
    do_arg = stat.ARGMAX in st and not fused_topk  # with the fused list, argmax is its first place
    ent = torch.empty(b, n_heads, n_q, **f32) if stat.ENTROPY in st else dummy
    arg_i = torch.empty(b, n_heads, n_q, dtype=torch.int32, device=dev) if do_arg else dummy
    arg_v = torch.empty(b, n_heads, n_q, **f32) if do_arg else dummy
    topk_p = triton.next_power_of_2(plan.topk) if fused_topk else 2
    top_v = torch.empty(b, n_heads, n_q, topk_p, **f32) if fused_topk else dummy
    top_i = torch.empty(b, n_heads, n_q, topk_p, dtype=torch.int32, device=dev) if fused_topk else dummy
    span_list = plan.mass_spans
    spans_t = torch.tensor(span_list or [(0, 0)], dtype=torch.int32, device=dev)
    span_out = torch.empty(b, n_heads, n_q, len(span_list), **f32) if span_list else dummy
    recent = torch.empty(b, n_heads, n_q, **f32) if stat.RECENT_MASS in st else dummy
    col = torch.zeros(b, n_heads, n_k, **f32) if stat.COL_SUM in st else dummy
    pool_cfg = dict(POOL_MODE=0, POOL_PM=1, POOL_PN=1, POOL_QBP=1, POOL_KBP=1)
    B = plan.block_size or 1
    n_qb, n_kb = -(-n_q // B), -(-n_k // B)
    if stat.POOLED in st:
        pool_cfg = _pool_config(B, bm, bn)
        pool = torch.zeros(b, n_heads, n_qb, n_kb, **f32)
    else:
        pool = dummy
    unique_rows, row_slot, rows_out = row_slots(plan, b, n_heads, n_q, n_k, dev, 0.0, dummy)

    _attn_stats[grid](
        q, k, lse, *common, qk_scale, n_heads, group, n_q, n_k, offset,
        ent, arg_i, arg_v, spans_t, span_out, recent, plan.window, col,
        pool, B, n_qb, n_kb, row_slot, rows_out, len(unique_rows), top_v, top_i, *mask_args,
        HEAD_D=d, BLOCK_D=block_d, CAUSAL=plan.causal, BLOCK_M=bm, BLOCK_N=bn, PRECISION=precision,
        DO_ENT=stat.ENTROPY in st, DO_ARG=do_arg, NUM_SPANS=len(span_list),
        SPAN_PAD=max(2, triton.next_power_of_2(max(len(span_list), 1))),
        DO_RECENT=stat.RECENT_MASS in st, DO_COL=stat.COL_SUM in st, DO_ROWS=stat.ROWS in st, UPCAST=upcast,
        DO_TOPK=fused_topk, TOPK=plan.topk if fused_topk else 1, TOPK_P=topk_p, **pool_cfg, **mask_flags,
        num_warps=warps, num_stages=stages,
    )

    if stat.ENTROPY in st:
        res[stat.ENTROPY] = ent
    if fused_topk:
        res.update(top_outputs(top_v[..., : plan.topk], top_i[..., : plan.topk], lse))
    elif stat.ARGMAX in st:
        res[stat.ARGMAX] = arg_i.long()
        res[stat.ARGMAX_PROB] = torch.exp2(arg_v - lse * LOG2E)
        if plan.topk > 1:
            pass_args = (q, k, common, qk_scale, n_heads, group, n_q, n_k, offset, mask_args, mask_flags)
            tiles = dict(HEAD_D=d, BLOCK_D=block_d, CAUSAL=plan.causal, BLOCK_M=bm, BLOCK_N=bn,
                         PRECISION=precision, UPCAST=upcast, num_warps=warps, num_stages=stages)
            res.update(_topk_by_passes(arg_v, arg_i, lse, plan.topk, grid, pass_args, tiles))
    if span_list:
        res.update(split_span_masses(plan, span_out))
    if stat.RECENT_MASS in st:
        res[stat.RECENT_MASS] = recent
    if stat.COL_SUM in st:
        res[stat.COL_SUM] = col
    if stat.POOLED in st:
        res[stat.POOLED] = pool / pool_counts(n_q, n_k, B, dev, torch.float32)
    if stat.ROWS in st:
        index = torch.tensor([unique_rows.index(r) for r in plan.rows], dtype=torch.long, device=dev)
        res[stat.ROWS] = rows_out.index_select(2, index)
    return out, res


def row_slots(plan: Plan, b: int, n_heads: int, n_q: int, n_k: int, dev: torch.device, fill: float,
              dummy: Tensor) -> tuple[list[int], Tensor, Tensor]:
    """For ``"rows"``: the distinct requested rows (sorted), each query row's slot among them (-1:
    not requested) and the output ``[b, h, n_rows, n_k]`` filled with ``fill``; ``dummy`` twice
    when rows are not asked for."""
    unique_rows = sorted(set(plan.rows))
    if stat.ROWS not in plan.stats:
        return unique_rows, dummy, dummy
    slot = torch.full((n_q,), -1, dtype=torch.int32)
    slot[unique_rows] = torch.arange(len(unique_rows), dtype=torch.int32)
    return unique_rows, slot.to(dev), torch.full((b, n_heads, len(unique_rows), n_k), fill, dtype=torch.float32,
                                                device=dev)


def top_outputs(top_v: Tensor, top_i: Tensor, lse: Tensor) -> dict[str, Tensor]:
    r"""``"argmax"``, ``"argmax_prob"``, ``"topk_index"`` and ``"topk_prob"`` from the top-k base-2
    scores ``[b, h, n_q, k]`` (by decreasing score, -inf where a row sees fewer than k keys), their
    key indices and the rows' natural-log lse: :math:`A = 2^{s_2 - \text{lse} \log_2 e}`."""
    prob = torch.exp2(top_v - (lse * LOG2E).unsqueeze(-1))  # -inf → 0
    index = top_i.long().masked_fill(top_v == float("-inf"), -1)
    res = {stat.ARGMAX: index[..., 0].contiguous(), stat.ARGMAX_PROB: prob[..., 0].contiguous()}
    if top_v.shape[-1] > 1:
        res[stat.TOPK_INDEX], res[stat.TOPK_PROB] = index, prob
    return res


def _topk_by_passes(arg_v: Tensor, arg_i: Tensor, lse: Tensor, topk: int, grid: tuple, pass_args: tuple,
                    tiles: dict) -> dict[str, Tensor]:
    """Top-k for k > :data:`FUSED_TOPK_MAX`: ``k − 1`` more passes of :func:`_attn_topk_next`, each
    the next key in (score desc, index asc) order after the previous one; nothing held per row."""
    q, k, common, qk_scale, n_heads, group, n_q, n_k, offset, mask_args, mask_flags = pass_args
    vals, idxs = [arg_v], [arg_i]
    for _ in range(topk - 1):
        nv, ni = torch.empty_like(arg_v), torch.empty_like(arg_i)
        _attn_topk_next[grid](
            q, k, *common, qk_scale, n_heads, group, n_q, n_k, offset, vals[-1], idxs[-1], nv, ni, *mask_args,
            **tiles, **mask_flags,
        )
        vals.append(nv)
        idxs.append(ni)
    top_v = torch.stack(vals, -1)
    return {stat.TOPK_INDEX: torch.stack(idxs, -1).long(),
            stat.TOPK_PROB: torch.exp2(top_v - (lse * LOG2E).unsqueeze(-1))}  # -inf → 0

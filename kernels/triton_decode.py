r"""Split-K attention for decode rows (few queries, many keys), with statistics, in Triton.

The two-pass kernels of :mod:`headscope.kernels.triton_attention` launch one program per (query block, head):
for a decode step (one query row per head, or a few) that is a few dozen programs for a GPU with over
a hundred SMs, each walking every key alone. Flash-decoding (Dao, Haziza, Massa and Sizov 2023,
"Flash-Decoding for long-context inference") cuts the keys into ``n_splits`` contiguous ranges, one
program per (range, key-value head, row block), and reduces the partial results afterwards. Inside a
range the softmax is FlashAttention-2's online one (Dao 2023, arXiv:2307.08691), in base-2 units
(``s = score · log2 e``). Each program writes, relative to its own final running max :math:`m_s`:

- :math:`l_s = \sum_j 2^{s_j - m_s}` and :math:`\text{acc}_s = \sum_j 2^{s_j - m_s} v_j`;
- span / sink / recent masses :math:`\sum_{j \in S} 2^{s_j - m_s}`;
- for entropy :math:`E_s = \sum_j 2^{s_j - m_s} (s_j - m_s)` (moving the max from m to m' turns E
  into :math:`2^{m - m'} (E + (m - m') l)`);
- its best (score, index), or its top-K candidates as sortable int64 keys
  (:func:`headscope.kernels.triton_attention._order_key`);
- for exact rows, the raw masked scores (their final value needs the row's lse).

The reduction (:func:`_combine`, torch ops on ``[b, h, n_q, n_splits]`` partials) takes
:math:`M = \max_s m_s`, :math:`\text{lse}_2 = M + \log_2 \sum_s 2^{m_s - M} l_s` and
:math:`c_s = 2^{m_s - \text{lse}_2}`; then :math:`o = \sum_s c_s \text{acc}_s`, a mass is
:math:`\sum_s c_s \,\text{mass}_s`, entropy is
:math:`-\ln 2 \sum_s c_s (E_s + (m_s - \text{lse}_2) l_s)`, argmax is the best of the ranges' bests
(the lowest index on ties: ranges are in key order) and top-K the K largest candidate keys.

Grouped-query attention: the rows of all query heads of one key-value group are packed into one
block (row ``r``: query head ``hk · G + r // n_q``, query ``r % n_q``), so each range of K and V is
read once per group, as flash-decoding does for multi-query attention. Masks (causal offset, per-head
window and sink, soft-capping) are the ones of :func:`headscope.kernels.triton_attention._score_tile`.

Column sums and pooled maps need every row's lse before a key's share is known; calls that ask for
them (or for ``topk > 16``) stay on the two-pass kernels (:func:`splits_keys` decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from headscope.kernels import statistics as stat
from headscope.kernels.statistics import Plan, split_span_masses, triton_interpreting
from headscope.kernels.triton_attention import (
    FUSED_TOPK_MAX,
    LOG2E,
    _argmax_merge,
    _order_key_empty,
    _score_tile,
    _topk_merge,
    row_slots,
    top_outputs,
)

#: Decode rows: at most this many query rows per head ...
DECODE_MAX_ROWS = 16
#: ... against at least this many keys (below it the two-pass kernels' one program per head is enough;
#: a guess, not timed on a GPU yet: bench/gpu_check.py times both).
DECODE_MIN_KEYS = 512
#: What the split-K kernel computes; anything else keeps the two-pass kernels.
DECODE_STATS = frozenset({stat.LSE, stat.ENTROPY, stat.ARGMAX, stat.SPAN_MASS, stat.SINK_MASS,
                          stat.RECENT_MASS, stat.ROWS})
LN2 = 0.6931471805599453


def splits_keys(plan: Plan, n_q: int, n_k: int) -> bool:
    """Whether a validated call goes to :func:`triton_decode`: few query rows, many keys, and only
    statistics that split over key ranges (not column sums or pooled maps; top-k up to 16)."""
    return (n_q <= DECODE_MAX_ROWS and n_k >= DECODE_MIN_KEYS and plan.stats <= DECODE_STATS
            and plan.topk <= FUSED_TOPK_MAX)


@triton.jit
def _decode_tiles(
    m_i, l_i, acc, ent, best, best_i, span_acc, recent, top,
    q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv, offs_n, pos,
    N_K, qk_scale, lo, hi, win, sink, cap, Spans, span_ids, WINDOW, raw_ptrs, slots,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    DO_ENT: tl.constexpr, DO_ARG: tl.constexpr, DO_TOPK: tl.constexpr, TOPK: tl.constexpr,
    NUM_SPANS: tl.constexpr, DO_RECENT: tl.constexpr, DO_ROWS: tl.constexpr,
):
    """Online softmax and every partial statistic over the key tiles in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s = _score_tile(q, k_base, stride_kn, stride_kd, offs_d, start_n, offs_n, pos, N_K, qk_scale,
                        win, sink, cap, HEAD_D, CAUSAL, True, PRECISION, UPCAST, WINDOWED, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2(-inf - 0) = 0, not nan
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        if DO_ENT:  # E = Σ p (s − m); a new max m' turns it into α (E + (m − m') l)
            shift = tl.where(l_i > 0, (m_i - m_use) * l_i, 0.0)
            ent = alpha * (ent + shift) + tl.sum(tl.where(p > 0, p * (s - m_use[:, None]), 0.0), 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=(cols[:, None] < N_K) & (offs_dv[None, :] < HEAD_DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        if DO_ARG:
            best, best_i = _argmax_merge(best, best_i, s, start_n)
        if DO_TOPK:
            top = _topk_merge(top, s, cols, TOPK)
        if NUM_SPANS > 0:
            span_acc = span_acc * alpha[:, None]
            for si in tl.static_range(NUM_SPANS):
                a = tl.load(Spans + 2 * si)
                z = tl.load(Spans + 2 * si + 1)
                if (start_n < z) & (start_n + BLOCK_N > a):  # only tiles that touch the span
                    inside = (cols >= a) & (cols < z)
                    part = tl.sum(tl.where(inside[None, :], p, 0.0), 1)
                    span_acc += tl.where(span_ids[None, :] == si, part[:, None], 0.0)
        if DO_RECENT:
            band = (cols[None, :] <= pos[:, None]) & (cols[None, :] > pos[:, None] - WINDOW)
            recent = recent * alpha + tl.sum(tl.where(band, p, 0.0), 1)
        if DO_ROWS:
            tl.store(raw_ptrs + cols[None, :], s, mask=(slots[:, None] >= 0) & (cols[None, :] < N_K))
    return m_i, l_i, acc, ent, best, best_i, span_acc, recent, top


@triton.jit
def _attn_decode_split(
    Q, K, V,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    qk_scale, H, GROUP, N_Q, N_K, OFFSET, SPLIT, N_SPLITS, N_MB,
    PartM, PartL, PartAcc, PartEnt, PartArgV, PartArgI, PartTop, Spans, PartSpan, WINDOW, PartRecent,
    RowSlot, RowsRaw, N_ROWS,
    Win, Sink, cap,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    DO_ENT: tl.constexpr, DO_ARG: tl.constexpr, DO_TOPK: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P: tl.constexpr, NUM_SPANS: tl.constexpr, SPAN_PAD: tl.constexpr, DO_RECENT: tl.constexpr,
    DO_ROWS: tl.constexpr,
):
    """One key range ``[pid_s · SPLIT, (pid_s + 1) · SPLIT)`` of one block of packed rows (the query
    heads of key-value head ``hk``): partials relative to the range's own max (module docstring)."""
    pid_s = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    mb = pid % N_MB
    b = (pid // N_MB) // (H // GROUP)
    hk = (pid // N_MB) % (H // GROUP)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < GROUP * N_Q
    h = hk * GROUP + tl.where(row_ok, r // N_Q, 0)  # packed row r: query head, then query row
    i = r % N_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    pos = OFFSET + i
    if WINDOWED:  # per packed row: its head's window and sink, as [BLOCK_M, 1] for _score_tile
        win_r = tl.load(Win + h, mask=row_ok, other=0)
        sink_r = tl.load(Sink + h, mask=row_ok, other=0)
    else:
        win_r = tl.zeros([BLOCK_M], tl.int32)
        sink_r = tl.zeros([BLOCK_M], tl.int32)
    rid = (b * H + h) * N_Q + i  # [b, H, n_q] row index of the partials
    if DO_ROWS:
        slots = tl.load(RowSlot + i, mask=row_ok, other=-1)
    else:
        slots = tl.full([BLOCK_M], -1, tl.int32)
    raw_ptrs = RowsRaw + ((b * H + h) * N_ROWS + slots)[:, None] * N_K

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    ent = tl.zeros([BLOCK_M], tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_M], tl.int32)
    span_ids = tl.arange(0, SPAN_PAD)
    span_acc = tl.zeros([BLOCK_M, SPAN_PAD], tl.float32)
    recent = tl.zeros([BLOCK_M], tl.float32)
    top = _order_key_empty(BLOCK_M, TOPK_P)
    lo = pid_s * SPLIT
    hi = tl.minimum(lo + SPLIT, N_K)
    if CAUSAL:
        hi = tl.minimum(hi, OFFSET + N_Q)
    if WINDOWED:  # keys in [s_hi, w_lo) are outside every packed row's window and sink: skipped
        w_lo = tl.min(tl.where(row_ok, tl.where(win_r > 0, tl.maximum(pos - win_r + 1, 0), 0), N_K), 0)
        w_lo = (w_lo // BLOCK_N) * BLOCK_N
        s_hi = tl.max(tl.where(row_ok & (win_r > 0), sink_r, 0), 0)
        s_hi = tl.minimum(((s_hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, w_lo)
        m_i, l_i, acc, ent, best, best_i, span_acc, recent, top = _decode_tiles(
            m_i, l_i, acc, ent, best, best_i, span_acc, recent, top,
            q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv, offs_n, pos,
            N_K, qk_scale, lo, tl.minimum(hi, s_hi), win_r[:, None], sink_r[:, None], cap, Spans, span_ids,
            WINDOW, raw_ptrs, slots, HEAD_D, HEAD_DV, CAUSAL, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP,
            DO_ENT, DO_ARG, DO_TOPK, TOPK, NUM_SPANS, DO_RECENT, DO_ROWS,
        )
        lo = tl.maximum(lo, w_lo)
    m_i, l_i, acc, ent, best, best_i, span_acc, recent, top = _decode_tiles(
        m_i, l_i, acc, ent, best, best_i, span_acc, recent, top,
        q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv, offs_n, pos,
        N_K, qk_scale, lo, hi, win_r[:, None], sink_r[:, None], cap, Spans, span_ids,
        WINDOW, raw_ptrs, slots, HEAD_D, HEAD_DV, CAUSAL, BLOCK_N, PRECISION, UPCAST, WINDOWED, SOFTCAP,
        DO_ENT, DO_ARG, DO_TOPK, TOPK, NUM_SPANS, DO_RECENT, DO_ROWS,
    )

    part = rid * N_SPLITS + pid_s
    tl.store(PartM + part, m_i, mask=row_ok)
    tl.store(PartL + part, l_i, mask=row_ok)
    tl.store(PartAcc + part[:, None] * HEAD_DV + offs_dv[None, :], acc,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    if DO_ENT:
        tl.store(PartEnt + part, ent, mask=row_ok)
    if DO_ARG:
        tl.store(PartArgV + part, best, mask=row_ok)
        tl.store(PartArgI + part, best_i, mask=row_ok)
    if DO_TOPK:
        tl.store(PartTop + part[:, None] * TOPK_P + tl.arange(0, TOPK_P)[None, :], top, mask=row_ok[:, None])
    if NUM_SPANS > 0:
        tl.store(PartSpan + part[:, None] * NUM_SPANS + span_ids[None, :], span_acc,
                 mask=row_ok[:, None] & (span_ids[None, :] < NUM_SPANS))
    if DO_RECENT:
        tl.store(PartRecent + part, recent, mask=row_ok)


def _decode_tiles_for(rows: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows`` packed rows per key-value head. Not
    timed on a GPU yet; small tiles under the interpreter (fast to emulate)."""
    block_m = max(16, triton.next_power_of_2(min(rows, 64)))
    if triton_interpreting():
        return min(block_m, 16), 16, 1, 1
    return (block_m, 64, 4, 3) if d <= 128 else (block_m, 32, 4, 2)


def _split_size(n_k: int, programs: int, block_n: int, device: torch.device) -> int:
    """Keys per range: enough ranges for about two waves of programs on the device, each range at
    least four tiles (so the partials stay small next to the keys read). Under the interpreter two
    tiles, so that small tests cross range boundaries."""
    if triton_interpreting() or device.type != "cuda":
        return 2 * block_n
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, -(-2 * sms // programs))
    per = -(-n_k // want)
    return max(4 * block_n, -(-per // block_n) * block_n)


def triton_decode(q: Tensor, k: Tensor, v: Tensor, plan: Plan, split: int | None = None,
                  block_n: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Split-K attention on validated inputs with statistics in :data:`DECODE_STATS`; returns
    ``(out, stats)`` as :func:`headscope.kernels.triton_attention.triton_attention` does.

    ``split`` (keys per range, a multiple of the key tile) and ``block_n`` override the defaults, for tests.
    """
    b, n_heads, n_q, d = q.shape
    n_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    group = n_heads // n_kv
    dev, st = q.device, plan.stats
    upcast = triton_interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    bm, bn, warps, stages = _decode_tiles_for(group * n_q, max(d, d_v))
    bn = block_n or bn
    n_mb = triton.cdiv(group * n_q, bm)
    split = split or _split_size(n_k, b * n_kv * n_mb, bn, dev)
    if split % bn:
        raise ValueError(f"split ({split}) must be a multiple of the key tile ({bn})")
    n_splits = triton.cdiv(n_k, split)

    f32 = dict(dtype=torch.float32, device=dev)
    part = (b, n_heads, n_q, n_splits)
    part_m, part_l = torch.empty(part, **f32), torch.empty(part, **f32)
    part_acc = torch.empty(*part, d_v, **f32)
    dummy = part_l
    fused_topk = stat.ARGMAX in st and plan.topk > 1
    do_arg = stat.ARGMAX in st and not fused_topk
    topk_p = triton.next_power_of_2(plan.topk) if fused_topk else 2
    part_ent = torch.empty(part, **f32) if stat.ENTROPY in st else dummy
    arg_v = torch.empty(part, **f32) if do_arg else dummy
    arg_i = torch.empty(part, dtype=torch.int32, device=dev) if do_arg else dummy
    part_top = torch.empty(*part, topk_p, dtype=torch.int64, device=dev) if fused_topk else dummy
    span_list = plan.mass_spans
    spans_t = torch.tensor(span_list or [(0, 0)], dtype=torch.int32, device=dev)
    part_span = torch.empty(*part, len(span_list), **f32) if span_list else dummy
    part_recent = torch.empty(part, **f32) if stat.RECENT_MASS in st else dummy
    unique_rows, row_slot, rows_raw = row_slots(plan, b, n_heads, n_q, n_k, dev, float("-inf"), dummy)
    win_t = torch.tensor(plan.key_window or (0,), dtype=torch.int32, device=dev)
    sink_t = torch.tensor(plan.key_sink or (0,), dtype=torch.int32, device=dev)

    _attn_decode_split[(n_splits, b * n_kv * n_mb)](
        q, k, v, *q.stride(), *k.stride(), *v.stride(), plan.scale * LOG2E,
        n_heads, group, n_q, n_k, n_k - n_q, split, n_splits, n_mb,
        part_m, part_l, part_acc, part_ent, arg_v, arg_i, part_top, spans_t, part_span, plan.window, part_recent,
        row_slot, rows_raw, len(unique_rows), win_t, sink_t, float(plan.softcap or 1.0),
        HEAD_D=d, HEAD_DV=d_v, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)), CAUSAL=plan.causal, BLOCK_M=bm, BLOCK_N=bn,
        PRECISION=precision, UPCAST=upcast, WINDOWED=plan.windowed, SOFTCAP=plan.softcap is not None,
        DO_ENT=stat.ENTROPY in st, DO_ARG=do_arg, DO_TOPK=fused_topk, TOPK=plan.topk if fused_topk else 1,
        TOPK_P=topk_p, NUM_SPANS=len(span_list), SPAN_PAD=max(2, triton.next_power_of_2(max(len(span_list), 1))),
        DO_RECENT=stat.RECENT_MASS in st, DO_ROWS=stat.ROWS in st, num_warps=warps, num_stages=stages,
    )
    parts = dict(m=part_m, l=part_l, acc=part_acc, ent=part_ent, arg_v=arg_v, arg_i=arg_i, top=part_top,
                 span=part_span, recent=part_recent, rows=rows_raw)
    return _combine(parts, plan, q.dtype, unique_rows, fused_topk)


def _combine(parts: dict[str, Tensor], plan: Plan, dtype: torch.dtype, unique_rows: list[int],
             fused_topk: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Reduce the ranges' partials ``[b, h, n_q, n_splits, ...]`` (module docstring for the formulas)."""
    st, m, mass = plan.stats, parts["m"], parts["l"]  # m_s, l_s
    big_m = m.amax(-1, keepdim=True)  # finite: every row sees at least its own key
    lse2 = big_m + torch.log2((torch.exp2(m - big_m) * mass).sum(-1, keepdim=True))  # [b, h, n_q, 1]
    c = torch.exp2(m - lse2)  # a range's share of the row's mass per unit of its partials; empty → 0
    out = (c.unsqueeze(-1) * parts["acc"]).sum(-2).to(dtype)
    lse = lse2.squeeze(-1) * LN2
    res: dict[str, Tensor] = {}
    if stat.LSE in st:
        res[stat.LSE] = lse
    if stat.ENTROPY in st:  # Σ_j A_j (s_j − lse2) = Σ_s c_s (E_s + (m_s − lse2) l_s), 0 for empty ranges
        inner = torch.where(mass > 0, parts["ent"] + (m - lse2) * mass, 0.0)
        res[stat.ENTROPY] = -(c * inner).sum(-1) * LN2
    if fused_topk:
        keys = parts["top"].flatten(-2).topk(plan.topk, -1).values  # unique keys: no ties to break
        top_i = 0x7FFFFFFF - (keys & 0xFFFFFFFF)
        ordered = (keys >> 32).to(torch.int32)
        top_v = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)
        res.update(top_outputs(top_v, top_i, lse))
    elif stat.ARGMAX in st:
        first = parts["arg_v"].argmax(-1, keepdim=True)  # the first range on ties: the lower index
        res[stat.ARGMAX] = parts["arg_i"].gather(-1, first).squeeze(-1).long()
        res[stat.ARGMAX_PROB] = torch.exp2(parts["arg_v"].gather(-1, first) - lse2).squeeze(-1)
    if plan.mass_spans:
        res.update(split_span_masses(plan, (c.unsqueeze(-1) * parts["span"]).sum(-2)))
    if stat.RECENT_MASS in st:
        res[stat.RECENT_MASS] = (c * parts["recent"]).sum(-1)
    if stat.ROWS in st:
        rows = torch.exp2(parts["rows"] - lse2[:, :, unique_rows])  # masked: exp2(-inf) = 0
        index = torch.tensor([unique_rows.index(r) for r in plan.rows], dtype=torch.long, device=m.device)
        res[stat.ROWS] = rows.index_select(2, index)
    return out, res

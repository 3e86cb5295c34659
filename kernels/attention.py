"""Attention that returns per-head statistics without building the N×N attention matrix.

One public entry, :func:`attention`, with two implementations of identical semantics:

- ``backend="torch"``: chunked over query rows (and key-value heads), so the largest temporary is
  a few MB of scores, never ``n_q × n_k`` per head. Computes in float32 (float64 inputs stay
  float64) whatever the input dtype. Runs on any device; it is the CPU path and the reference.
  Each chunk's statistics come from the chunk's probabilities, in the same pass as the output.
  On CPU the chunks are shared among ``torch.get_num_threads()`` worker threads that each run
  single-threaded ops (see :func:`_run_threaded` for why); with no statistics requested the
  output comes from ``scaled_dot_product_attention`` where its causal mask agrees with ours.
  When every head has a key window, a chunk scores only the keys its rows can see (the window
  band, and the sink keys before it), so a sliding-window or streaming layer costs O(n · (S + W)).
- ``backend="triton"``: two fused passes (:mod:`headscope.kernels.triton_attention`), for CUDA tensors;
  decode rows (at most 16 queries per head against 512 keys or more, statistics that split over
  keys) take one split-K pass and a reduction instead (:mod:`headscope.kernels.triton_decode`, flash-decoding).

The statistic names, their defaults and the validation of a request live in
:mod:`headscope.kernels.statistics` and are re-exported here. :mod:`headscope.kernels.reference` is the eager
full-matrix reference that both backends are tested against.

Grouped-query attention is native: query head ``h`` reads key-value head ``h // (n_heads //
n_kv_heads)``; the torch path views the queries of one group as ``[n_kv_heads, group · rows, d]``
so that one matmul serves the whole group, and K/V are never repeated.

Positions. Query row ``i`` sits at key position ``p_i = n_k - n_q + i``: with ``n_q < n_k`` the
queries are the last ``n_q`` positions, as when decoding with a KV cache. Causal attention lets
row ``i`` see keys ``j <= p_i``; a sliding window (``key_window``, per query head, with
``key_sink`` keys kept at the start) narrows that further, and every statistic is one of the masked
distribution. Gemma 2's ``softcap`` caps the scores before the mask.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from headscope.kernels import statistics as stat
from headscope.kernels.statistics import *  # noqa: F403  (re-exported: callers import the names with attention())
from headscope.kernels.statistics import Plan, pool_counts, split_span_masses, use_triton, validate

__all__ = [*stat.__all__, "AttentionResult", "attention"]

# Score elements per chunk on CPU: 2^19 float32 = 2 MiB per worker, so the chunk stays in cache
# (bench/kernels_micro.py at 4k tokens: 1-2 MiB beat 4 MiB by ~5%, 8 MiB and up lose 20-40%).
_CPU_CHUNK_ELEMENTS = 1 << 19
_CUDA_CHUNK_ELEMENTS = 1 << 26
_MIN_CHUNK_ROWS = 16
# What a chunk can compute when its score columns skip keys (sinks, then a window band): nothing
# that sums over key positions; argmax and top-k indices are mapped back to keys.
_GATHERED_STATS = frozenset({stat.LSE, stat.ENTROPY, stat.ARGMAX})


@dataclass(frozen=True)
class AttentionResult:
    """Output of :func:`attention`.

    Attributes
    ----------
    out : Tensor
        ``[batch, n_heads, n_q, d_v]``, the attention output, in the dtype of ``q``.
    stats : dict[str, Tensor]
        The requested statistics by name (see :func:`attention` for shapes). Also readable as
        attributes (``result.lse``) or items (``result["lse"]``).
    """

    out: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.stats[name]
        except KeyError:
            raise KeyError(f"statistic {name!r} was not requested; pass stats=({name!r}, ...)") from None

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("_") or name in ("out", "stats"):
            raise AttributeError(name)
        stats = object.__getattribute__(self, "stats")
        if name in stats:
            return stats[name]
        raise AttributeError(f"statistic {name!r} was not requested; pass stats=({name!r}, ...)")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    stats: str | Iterable[str] = (),
    sink_size: int = stat.DEFAULT_SINK_SIZE,
    window: int = stat.DEFAULT_WINDOW,
    spans: Sequence[tuple[int, int]] | None = None,
    block_size: int | None = None,
    rows: Sequence[int] | Tensor | None = None,
    topk: int = 1,
    backend: str = "auto",
    chunk_elements: int | None = None,
    key_sink: int | Tensor | None = None,
    key_window: int | Tensor | None = None,
    softcap: float | None = None,
) -> AttentionResult:
    r"""Scaled dot-product attention plus per-head statistics, without the ``n_q × n_k`` matrix.

    With scores :math:`s_{ij} = \text{scale} \cdot q_i \cdot k_j` (soft-capped to
    :math:`c \tanh(s_{ij} / c)` with ``softcap`` :math:`c`) over the visible keys and
    :math:`A_{ij} = \exp(s_{ij} - \text{lse}_i)`, the output is :math:`o_i = \sum_j A_{ij} v_j`.
    Masked keys have :math:`A_{ij} = 0`, and every statistic is one of this masked distribution.
    Visible keys: all of them, or when causal those with :math:`j \le p_i` (:math:`p_i = n_k - n_q + i`)
    and, for a query head :math:`h` with a key window :math:`W_h > 0`, also
    :math:`j < S_h` or :math:`j > p_i - W_h` (a sliding window of :math:`W_h` keys ending at the
    query, plus the first :math:`S_h` keys, the ``key_sink``).

    Parameters
    ----------
    q : Tensor
        ``[batch, n_heads, n_q, d]``.
    k, v : Tensor
        ``[batch, n_kv_heads, n_k, d]`` and ``[batch, n_kv_heads, n_k, d_v]``; same dtype and
        device as ``q``. ``n_heads`` must be a multiple of ``n_kv_heads``; query head ``h`` reads
        key-value head ``h // (n_heads // n_kv_heads)``.
    causal : bool
        Mask keys after each query's position. Requires ``n_q <= n_k``.
    scale : float, optional
        Score scale; default ``1 / sqrt(d)``.
    stats : str or iterable of str
        Statistics to return, from :data:`headscope.kernels.statistics.STATISTICS`:

        - ``"lse"`` ``[b, h, n_q]``: :math:`\text{lse}_i = \log \sum_j \exp(s_{ij})` (natural log).
        - ``"argmax"`` ``[b, h, n_q]`` (int64): :math:`\arg\max_j A_{ij}`, the lowest index on ties;
          also ``"argmax_prob"`` ``[b, h, n_q]`` = :math:`\max_j A_{ij}`. With ``topk > 1`` also
          ``"topk_index"`` and ``"topk_prob"`` ``[b, h, n_q, topk]``, by decreasing probability
          (the order among exactly tied scores is unspecified in the torch backend); slots
          beyond the number of visible keys hold index -1 and probability 0.
        - ``"span_mass"`` ``[b, h, n_q, n_spans]``: :math:`\sum_{j \in [a, e)} A_{ij}` for each span.
        - ``"recent_mass"`` ``[b, h, n_q]``: :math:`\sum_{p_i - W < j \le p_i} A_{ij}`, the last
          ``window`` keys up to and including the query's own position (also when not causal:
          keys after :math:`p_i` never count as recent).
        - ``"sink_mass"`` ``[b, h, n_q]``: :math:`\sum_{j < S} A_{ij}` with
          ``S = min(sink_size, n_k)``.
        - ``"entropy"`` ``[b, h, n_q]``: :math:`-\sum_j A_{ij} \ln A_{ij}` in nats
          (computed as :math:`\text{lse}_i - \sum_j A_{ij} s_{ij}`).
        - ``"col_sum"`` ``[b, h, n_k]``: attention received per key, :math:`\sum_i A_{ij}`.
        - ``"pooled"`` ``[b, h, ceil(n_q/B), ceil(n_k/B)]``: mean of :math:`A_{ij}` over each
          ``B × B`` block of (query index, key index). The mean is over every cell of the block
          that exists in the matrix, masked cells counted as zero (edge blocks have fewer cells),
          so the pooled map is exactly the average-pooled attention matrix.
        - ``"rows"`` ``[b, h, len(rows), n_k]``: the exact rows :math:`A_{r\cdot}` for the query
          indices in ``rows``.
    sink_size : int
        ``S`` for ``"sink_mass"``; clamped to ``n_k``.
    window : int
        ``W`` for ``"recent_mass"``.
    spans : sequence of (start, end), optional
        Half-open key spans for ``"span_mass"``, ``0 <= start < end <= n_k``.
    block_size : int, optional
        ``B`` for ``"pooled"`` (required for it).
    rows : sequence of int, optional
        Query indices (into ``q``'s ``n_q`` axis; negative counts from the end) for ``"rows"``.
    topk : int
        Number of top keys for ``"argmax"``.
    backend : {"auto", "torch", "triton"}
        ``"auto"``: Triton for CUDA tensors, torch otherwise.
    key_sink, key_window : int or Tensor, optional
        The key mask beyond causal: an int for every query head, or an int64 tensor ``[n_heads]``
        (one per query head). ``key_window`` 0 or None: unlimited (plain causal; ``key_sink``
        then changes nothing). Needs ``causal=True``. Mistral's and Gemma's sliding windows are
        ``key_window=sliding_window`` (``key_sink`` 0); StreamingLLM's cache is both.
    softcap : float, optional
        Gemma 2's attention logit soft-capping, applied to the scaled scores before the mask.
    chunk_elements : int, optional
        Torch backend only: score elements per chunk, 4 bytes each, one buffer per worker thread
        (two with ``"entropy"``). Default: 512 Ki on CPU (2 MiB), 64 Mi on CUDA.

    Returns
    -------
    AttentionResult
        ``out`` ``[b, h, n_q, d_v]`` in ``q``'s dtype and ``stats`` as float32 (int64 indices).
        Nothing is differentiable: the kernels are for analysis, not training.

    Raises
    ------
    ValueError
        On inconsistent shapes, dtypes or devices, an unknown statistic, a span, row or block
        size out of range, or an unknown backend.

    References
    ----------
    Dao et al. 2022, "FlashAttention" (online softmax, the per-row lse); Xiao et al. 2023,
    "Efficient Streaming Language Models with Attention Sinks" (sinks); Xiao et al. 2024,
    "DuoAttention" (sink + recent window mass); Wu et al. 2024, "Retrieval Head Mechanistically
    Explains Long-Context Factuality" (argmax of one decode row).

    Examples
    --------
    >>> q, k, v = torch.randn(1, 6, 10, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    >>> res = attention(q, k, v, stats=("entropy", "sink_mass"), sink_size=1)
    >>> res.out.shape, res.entropy.shape, res.sink_mass.shape
    (torch.Size([1, 6, 10, 16]), torch.Size([1, 6, 10]), torch.Size([1, 6, 10]))
    """
    plan = validate(q, k, v, causal, scale, stats, sink_size, window, spans, block_size, rows, topk, backend,
                    key_sink=key_sink, key_window=key_window, softcap=softcap)
    if chunk_elements is not None and (not isinstance(chunk_elements, int) or chunk_elements < 1):
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
    if use_triton(q, backend):
        out, out_stats = _triton_attention(q, k, v, plan)
    else:
        out, out_stats = _torch_attention(q, k, v, plan, chunk_elements)
    return AttentionResult(out=out, stats=out_stats)


def _triton_attention(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, dict[str, Tensor]]:
    """The Triton kernels: split-K for decode rows (:func:`headscope.kernels.triton_decode.splits_keys`), else two passes."""
    from headscope.kernels.triton_attention import triton_attention
    from headscope.kernels.triton_decode import splits_keys, triton_decode

    if splits_keys(plan, q.shape[2], k.shape[2]):
        return triton_decode(q, k, v, plan)
    return triton_attention(q, k, v, plan)


# --- torch backend ------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(start: int, n_q: int, offset: int, n_k: int, causal: bool, group: int, budget: int,
                window: int = 0, sink: int = 0) -> int:
    """Largest query chunk starting at ``start`` whose scores (``group`` heads) fit in ``budget``;
    ``window`` > 0: the chunk's scores cover ``sink`` keys and its rows' windows (``_Worker._first_keys``)."""
    if causal:
        # keys seen by the chunk: offset + start + c; solve group * c * (offset + start + c) <= budget
        # (under a window: at most sink + window - 1 + c of them)
        base = offset + start if not window else min(offset + start, sink + window - 1)
        c = int((-base + math.sqrt(base * base + 4.0 * budget / group)) / 2.0)
    else:
        c = budget // (group * n_k)
    if c >= 2 * _MIN_CHUNK_ROWS:
        c -= c % _MIN_CHUNK_ROWS  # few distinct sizes: per-size masks are reused across chunks
    return max(min(c, n_q - start), min(_MIN_CHUNK_ROWS, n_q - start), 1)


def _torch_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: Plan, chunk_elements: int | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Chunked exact attention with statistics; see :func:`attention` for the semantics."""
    b, n_heads, n_q, _ = q.shape
    n_kv, n_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    cdt = _compute_dtype(q.dtype)

    with torch.no_grad():  # an analysis kernel: no autograd graph, in-place writes into outputs
        plain = not plan.windowed and plan.softcap is None
        if plain and not plan.stats and (not plan.causal or n_q == n_k or n_q == 1):
            # Nothing but the output: SDPA's fused kernel is exact (float32) and faster. Its causal
            # mask is top-left aligned, which matches ours only for square or single-row inputs.
            out = F.scaled_dot_product_attention(
                q.to(cdt), k.to(cdt), v.to(cdt), is_causal=plan.causal and n_q > 1, scale=plan.scale,
                enable_gqa=group > 1,
            )
            return out.to(q.dtype), {}
        if plain and n_q == 1 and plan.stats <= {stat.ARGMAX} and plan.topk == 1:
            return _decode_row(q, k, v, plan)

        job = _Job(q, k, v, plan, chunk_elements)
        tasks = job.tasks()
        n_workers = min(torch.get_num_threads(), len(tasks)) if q.device.type == "cpu" else 1
        if n_workers <= 1:
            worker = _Worker(job)
            for task in tasks:
                worker.run(task)
        else:
            _run_threaded(job, tasks, n_workers)
        return job.results()


def _decode_row(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, dict[str, Tensor]]:
    """One query row that sees every key (a KV-cached decode step), with at most its argmax.

    The chunked path's operations on its single ``[units, group, n_k]`` score block (same order, so
    the same numbers), without its per-call set-up (job, worker, buffers: about 0.5 ms, which retrieval
    scoring paid once per layer and decode step)."""
    b, n_heads, _, d = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    cdt = _compute_dtype(q.dtype)
    qs = torch.mul(q.to(cdt).reshape(b * n_kv, group, d), plan.scale)
    sc = torch.bmm(qs, k.to(cdt).flatten(0, 1).transpose(1, 2))  # [units, group, n_k]
    # one row: a plain argmax (the first maximum, as _row_argmax's blocks give) beats the blocked search
    idx = sc.argmax(-1) if stat.ARGMAX in plan.stats else None
    torch.softmax(sc, -1, out=sc)
    out = torch.bmm(sc, v.to(cdt).flatten(0, 1)).to(q.dtype).view(b, n_heads, 1, v.shape[-1])
    if idx is None:
        return out, {}
    p_max = sc.gather(-1, idx.unsqueeze(-1))
    return out, {stat.ARGMAX: idx.view(b, n_heads, 1), stat.ARGMAX_PROB: p_max.view(b, n_heads, 1).float()}


def _run_threaded(job: _Job, tasks: list[tuple[int, int, int, int]], n_workers: int) -> None:
    """Share the chunks among threads that each run single-threaded torch ops.

    Why not torch's own intra-op threads: every op is a parallel region that ends in a barrier,
    and a chunk is a few dozen small ops. On a shared machine (more runnable threads than cores)
    each barrier waits for a descheduled thread, which made the chunked path 10-50× slower than
    SDPA. Independent workers never wait for each other, and the chunks balance themselves.
    """
    pending = iter(tasks)
    take = threading.Lock()
    n_threads = torch.get_num_threads()
    # grad and inference modes are thread-local: give the workers the caller's (tensors made
    # under inference_mode can only be written to inside it)
    inference = torch.is_inference_mode_enabled()

    def work() -> None:
        # OpenMP's setting is per thread, but torch also stores a process-wide default and MKL's
        # global count: both are restored for the caller below, once every worker has finished
        torch.set_num_threads(1)
        worker = _Worker(job)
        with torch.inference_mode(inference), torch.no_grad():
            while True:
                with take:
                    task = next(pending, None)
                if task is None:
                    return
                worker.run(task)

    try:
        with ThreadPoolExecutor(n_workers, thread_name_prefix="headscope-attention") as pool:
            for future in [pool.submit(work) for _ in range(n_workers)]:
                future.result()
    finally:
        torch.set_num_threads(n_threads)  # also resets the process-wide default and MKL's setting


class _Job:
    """Inputs, outputs and per-chunk constants of one call of the torch backend."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan, chunk_elements: int | None):
        b, n_heads, n_q, d = q.shape
        n_kv, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
        self.plan, self.st = plan, plan.stats
        self.b, self.n_heads, self.n_q, self.n_k, self.d, self.d_v = b, n_heads, n_q, n_k, d, d_v
        self.group = n_heads // n_kv
        self.units = b * n_kv  # one unit = one key-value head of one batch element
        self.offset = n_k - n_q  # query row i sits at key position offset + i
        self.cdt = cdt = _compute_dtype(q.dtype)
        self.dev = dev = q.device
        self.f32 = f32 = dict(dtype=cdt, device=dev)
        self.out_dtype = q.dtype
        self.budget = chunk_elements or (_CUDA_CHUNK_ELEMENTS if dev.type == "cuda" else _CPU_CHUNK_ELEMENTS)
        self.neg = torch.finfo(cdt).min
        if plan.windowed:  # [n_kv, group, 1, 1] per query head, as the chunks' unit × group axes
            as_heads = dict(dtype=torch.int64, device=dev)
            self.win = torch.tensor(plan.key_window, **as_heads).view(n_kv, self.group, 1, 1)
            self.sink = torch.tensor(plan.key_sink, **as_heads).view(n_kv, self.group, 1, 1)
            self.n_kv = n_kv
            # per key-value head, its query heads' (windows, sinks): chunks of heads with the same
            # masks share a mask bias
            self.head_masks = [(tuple(self.win[g].flatten().tolist()), tuple(self.sink[g].flatten().tolist()))
                               for g in range(n_kv)]
        # every head windowed: a chunk's scores cover its first row's window on (no sinks: Mistral,
        # Gemma) or the sink keys and that band (a policy's streaming heads), so the layer costs
        # O(n · (S + W)), not O(n²). With sinks the score columns skip keys, so only statistics that
        # index no key, or whose index maps back (argmax, top-k), take that path.
        windows, sinks = plan.key_window, plan.key_sink
        every = bool(windows) and min(windows) > 0
        gathers = every and max(sinks) > 0 and self.st <= _GATHERED_STATS
        self.win_max = max(windows) if every and (max(sinks) == 0 or gathers) else 0
        self.sink_max = min(max(sinks), n_k) if gathers else 0
        self.lock = threading.Lock()  # for sums that several chunks add into (col_sum, pooled)

        # [units, group, n_q, d]: a view when q's head axis allows it; K/V as [units, n_k, d]
        self.qu = q.to(cdt).unflatten(1, (n_kv, self.group)).flatten(0, 1)
        self.ku = k.to(cdt).flatten(0, 1)
        self.vu = v.to(cdt).flatten(0, 1)
        shape = (self.units, self.group, n_q)
        self.out = torch.empty(*shape, d_v, dtype=q.dtype, device=dev)
        st = self.st
        self.need_lse = stat.LSE in st or stat.ENTROPY in st
        self.lse = torch.empty(*shape, **f32) if stat.LSE in st else None
        self.ent = torch.empty(*shape, **f32) if stat.ENTROPY in st else None
        if stat.ARGMAX in st:
            self.arg = torch.empty(*shape, dtype=torch.int64, device=dev)
            self.arg_p = torch.empty(*shape, **f32)
            if plan.topk > 1:
                self.top_i = torch.full((*shape, plan.topk), -1, dtype=torch.int64, device=dev)
                self.top_p = torch.zeros(*shape, plan.topk, **f32)
        self.span_list = plan.mass_spans
        self.span_out = torch.empty(*shape, len(self.span_list), **f32) if self.span_list else None
        self.recent = torch.empty(*shape, **f32) if stat.RECENT_MASS in st else None
        self.col = torch.zeros(self.units, self.group, n_k, **f32) if stat.COL_SUM in st else None
        if stat.POOLED in st:
            B = plan.block_size
            self.pool = torch.zeros(self.units, self.group, -(-n_q // B), -(-n_k // B), **f32)
        if stat.ROWS in st:
            self.row_out = torch.zeros(self.units, self.group, len(plan.rows), n_k, **f32)
            self.row_slots: dict[int, list[int]] = {}
            for slot, r in enumerate(plan.rows):
                self.row_slots.setdefault(r, []).append(slot)

    def tasks(self) -> list[tuple[int, int, int, int]]:
        """``(first row, end row, first unit, end unit)`` per chunk, in order."""
        tasks = []
        s = 0
        while s < self.n_q:
            c = _chunk_rows(s, self.n_q, self.offset, self.n_k, self.plan.causal, self.group, self.budget,
                            self.win_max, self.sink_max)
            n_ke = self.offset + s + c if self.plan.causal else self.n_k
            if self.win_max:
                n_ke = min(n_ke, self.sink_max + c + self.win_max - 1)  # the chunk's score columns
            # small problems: several heads per matmul
            n_units = max(1, min(self.units, self.budget // (self.group * c * n_ke)))
            tasks += [(s, s + c, u0, min(self.units, u0 + n_units)) for u0 in range(0, self.units, n_units)]
            s += c
        return tasks

    def results(self) -> tuple[Tensor, dict[str, Tensor]]:
        def heads(t: Tensor) -> Tensor:  # [units, group, ...] -> [b, n_heads, ...], float32
            t = t.reshape(self.b, self.n_heads, *t.shape[2:])
            return t.to(torch.float32) if t.is_floating_point() else t

        st, res = self.st, {}
        if stat.LSE in st:
            res[stat.LSE] = heads(self.lse)
        if stat.ARGMAX in st:
            res[stat.ARGMAX] = heads(self.arg)
            res[stat.ARGMAX_PROB] = heads(self.arg_p)
            if self.plan.topk > 1:
                res[stat.TOPK_INDEX] = heads(self.top_i)
                res[stat.TOPK_PROB] = heads(self.top_p)
        if self.span_list:
            res.update({name: heads(mass) for name, mass in split_span_masses(self.plan, self.span_out).items()})
        if stat.RECENT_MASS in st:
            res[stat.RECENT_MASS] = heads(self.recent)
        if stat.ENTROPY in st:
            res[stat.ENTROPY] = heads(self.ent)
        if stat.COL_SUM in st:
            res[stat.COL_SUM] = heads(self.col)
        if stat.POOLED in st:
            counts = pool_counts(self.n_q, self.n_k, self.plan.block_size, self.dev, self.cdt)
            res[stat.POOLED] = heads(self.pool / counts)
        if stat.ROWS in st:
            res[stat.ROWS] = heads(self.row_out)
        out = self.out.reshape(self.b, self.n_heads, self.n_q, self.d_v)
        return out, res


class _Worker:
    """Scratch buffers and per-size masks of one thread; :meth:`run` does one chunk."""

    def __init__(self, job: _Job):
        self.job = job
        # reused buffers: fresh multi-MB allocations page-fault on every chunk on CPU
        self.score_buf = torch.empty(0, **job.f32)
        self.prob_buf = torch.empty(0, **job.f32)
        self.q_buf = torch.empty(0, **job.f32)
        self.k_buf = torch.empty(0, **job.f32)
        self.v_buf = torch.empty(0, **job.f32)
        self.tri: dict[int, Tensor] = {}
        self.ones: dict[int, Tensor] = {}
        self.band: dict[tuple[int, int, int], Tensor] = {}
        self.bias: dict[tuple, Tensor] = {}
        self.pool_rows: dict[tuple[int, int], Tensor] = {}

    def _buffer(self, name: str, size: int) -> Tensor:
        buf = getattr(self, name)
        if buf.numel() < size:
            buf = torch.empty(size, **self.job.f32)
            setattr(self, name, buf)
        return buf[:size]

    def run(self, task: tuple[int, int, int, int]) -> None:
        j, plan, st = self.job, self.job.plan, self.job.st
        s, e, u0, u1 = task
        c, nu, group, offset, dev = e - s, u1 - u0, j.group, j.offset, j.dev
        n_ke = offset + e if plan.causal else j.n_k  # keys any row of the chunk can see
        # score columns: keys 0 .. n_sink - 1, then k0 .. n_ke - 1 (n_sink, k0 > 0 only under windows)
        n_sink, k0 = self._first_keys(s)
        w = n_sink + n_ke - k0
        rows = nu * group * c
        if n_sink:  # the sinks and the band as one [nu, w, d] key block: one matmul each way
            keys = self._gather("k_buf", j.ku, u0, u1, n_sink, k0, n_ke)
            values = self._gather("v_buf", j.vu, u0, u1, n_sink, k0, n_ke)
        else:
            keys, values = j.ku[u0:u1, k0:n_ke], j.vu[u0:u1, k0:n_ke]

        # one matmul per key-value head serves all `group` query heads: rows = group × chunk
        qc = torch.mul(j.qu[u0:u1, :, s:e], plan.scale, out=self._buffer("q_buf", rows * j.d).view(nu, group, c, j.d))
        sc = self._buffer("score_buf", rows * w).view(nu, group * c, w)
        bias = self._steady_bias(s, c, n_sink, k0, u0, u1) if j.win_max and plan.softcap is None else None
        if bias is not None:  # the causal and window mask inside the matmul: scores = bias + q · kᵀ
            torch.baddbmm(bias, qc.view(nu, group * c, j.d), keys.transpose(1, 2), out=sc)
        else:
            torch.bmm(qc.view(nu, group * c, j.d), keys.transpose(1, 2), out=sc)
            if plan.softcap is not None:  # Gemma 2: cap the scores, then mask
                sc.div_(plan.softcap).tanh_().mul_(plan.softcap)
            if plan.causal:
                # keys before the chunk's first position are visible to every row; only the last c
                # columns form the triangle (also after sinks: the band holds at least the chunk's c keys)
                tri = self.tri.get(c)
                if tri is None:
                    tri = self.tri[c] = torch.ones(c, c, dtype=torch.bool, device=dev).triu_(1)
                sc.view(nu, group, c, w)[..., w - c :].masked_fill_(tri, j.neg)
            if plan.windowed:
                self._mask_window(sc.view(nu, group, c, w), s, e, u0, u1, n_sink, k0, n_ke)
        # row maxima (and argmax) from the raw scores, before anything overwrites them
        idx = None
        if stat.ARGMAX in st:
            m, idx = _row_argmax(sc)
            if plan.topk > 1:
                kk = min(plan.topk, w)
                top_val, top_idx = sc.topk(kk, -1)
        elif j.need_lse:
            m = sc.amax(-1)
        if stat.ENTROPY in st:
            sc.sub_(m.unsqueeze(-1))  # shift first so that sum(p · s) is computed near zero
        # in place unless entropy needs the scores (each row is read before it is written)
        p = self._buffer("prob_buf", rows * w).view(nu, group * c, w) if stat.ENTROPY in st else sc
        torch.softmax(sc, -1, out=p)
        j.out[u0:u1, :, s:e] = torch.bmm(p, values).view(nu, group, c, j.d_v)

        # statistics, from this chunk's probabilities (column t is key k0 + t; with sinks, t < n_sink
        # is key t and the rest k0 + t - n_sink: only lse, entropy, argmax and top-k are asked then)
        pv = p.view(nu, group, c, w)
        here = (slice(u0, u1), slice(None), slice(s, e))

        def put(target: Tensor, value: Tensor) -> None:
            target[here] = value.view(nu, group, c, *value.shape[2:])

        if idx is not None:
            p_max = p.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        elif j.need_lse:
            p_max = p.amax(-1)
        if j.need_lse:
            log_l = -torch.log(p_max)  # p_max = 1 / sum_j exp(s_j - m)
            if stat.LSE in st:
                put(j.lse, m + log_l)
        if stat.ARGMAX in st:
            put(j.arg, _column_keys(idx, n_sink, k0))
            put(j.arg_p, p_max)
            if plan.topk > 1:
                ti = _column_keys(top_idx, n_sink, k0).view(nu, group, c, kk)
                tp = p.gather(-1, top_idx).view(nu, group, c, kk)
                if plan.causal:  # rows with fewer than topk visible keys: no such key
                    dead = (top_val == j.neg).view(nu, group, c, kk)
                    ti, tp = ti.masked_fill(dead, -1), tp.masked_fill(dead, 0.0)
                j.top_i[u0:u1, :, s:e, :kk] = ti
                j.top_p[u0:u1, :, s:e, :kk] = tp
        for si, (a, z) in enumerate(j.span_list):
            a, z = max(a, k0) - k0, min(z, n_ke) - k0
            j.span_out[u0:u1, :, s:e, si] = pv[..., a:z].sum(-1) if a < z else 0.0
        if stat.RECENT_MASS in st:
            r_lo, band = self._band(s, e, n_ke)
            if r_lo < k0:  # keys before k0 are outside every head's window: zero weight
                band, r_lo = band[:, k0 - r_lo :], k0
            j.recent[here] = torch.linalg.vecdot(pv[..., r_lo - k0 : r_lo - k0 + band.shape[1]], band)
        if stat.POOLED in st:
            key = (s % plan.block_size, c)
            rows_ind = self.pool_rows.get(key)
            if rows_ind is None:
                rows_ind = self.pool_rows[key] = _pool_rows(s, e, plan.block_size, dev, j.cdt)
            row_blocks = torch.matmul(rows_ind, pv)
            with j.lock:  # k0 is a multiple of the block size here
                _pool_add(j.pool[u0:u1, :, :, k0 // plan.block_size :], row_blocks, s, w, plan.block_size)
                if stat.COL_SUM in st:
                    j.col[u0:u1, :, k0:n_ke] += row_blocks.sum(2)
        elif stat.COL_SUM in st:
            ones = self.ones.get(c)
            if ones is None:
                ones = self.ones[c] = torch.ones(1, 1, c, **j.f32)
            col = torch.matmul(ones, pv).squeeze(2)  # a ones-vector matmul: 2× faster than sum(2)
            with j.lock:
                j.col[u0:u1, :, k0:n_ke] += col
        if stat.ROWS in st:
            for r in range(s, e):
                for slot in j.row_slots.get(r, ()):
                    j.row_out[u0:u1, :, slot, k0:n_ke] = pv[:, :, r - s]
        if stat.ENTROPY in st:
            # last: overwrites the scores. H = lse - sum p s = log l - sum p (s - m)
            put(j.ent, log_l - sc.mul_(p).sum(-1))

    def _first_keys(self, s: int) -> tuple[int, int]:
        """``(n_sink, k0)``: a chunk starting at row ``s`` computes scores for keys ``0 .. n_sink - 1``
        and ``k0 ..`` on. Without a window ``(0, 0)``; with windows ``k0`` is the first key of row
        ``s``'s widest window (aligned down to a pooled block), and with sinks ``n_sink`` is the
        largest sink, or ``(0, 0)`` while that window still reaches the sinks (one contiguous block)."""
        j = self.job
        if not j.win_max:
            return 0, 0
        k0 = max(0, j.offset + s - j.win_max + 1)
        if j.sink_max:
            return (j.sink_max, k0) if k0 > j.sink_max else (0, 0)
        return 0, k0 - k0 % j.plan.block_size if stat.POOLED in j.st else k0

    def _steady_bias(self, s: int, c: int, n_sink: int, k0: int, u0: int, u1: int) -> Tensor | None:
        """The mask of a chunk whose columns start at its first row's widest window (after any
        sinks) as an additive bias ``[units, group · c, columns]`` (0 visible, the dtype's minimum
        hidden), or None for other chunks. Such chunks all see the same pattern, relative to ``k0``:
        row ``i`` is at position ``k0 + W_max − 1 + i``, so band column ``t`` (key ``k0 + t``) is
        visible to head ``h`` iff ``t ≤ W_max − 1 + i`` and ``t > W_max − 1 + i − W_h``, and sink
        column ``t`` iff ``t < S_h``: one bias per chunk size and heads' masks serves them all."""
        j = self.job
        if k0 != j.offset + s - j.win_max + 1 or bool(j.sink_max) != bool(n_sink):
            return None  # a window still reaching key 0 or the sinks, or aligned to pooled blocks
        kv = [u % j.n_kv for u in range(u0, u1)]
        key = (c, *(j.head_masks[g] for g in kv))
        bias = self.bias.get(key)
        if bias is None:
            win, sink = j.win[kv], j.sink[kv]  # [units, group, 1, 1]
            row = torch.arange(c, device=j.dev).view(1, 1, -1, 1) + (j.win_max - 1)
            col = torch.arange(n_sink + c + j.win_max - 1, device=j.dev).view(1, 1, 1, -1)
            band = col - n_sink
            visible = torch.where(col < n_sink, col < sink, (band <= row) & (band > row - win))
            bias = torch.zeros(visible.shape, **j.f32).masked_fill_(~visible, j.neg)
            self.bias[key] = bias = bias.view(len(kv), j.group * c, -1)
        return bias

    def _gather(self, name: str, x: Tensor, u0: int, u1: int, n_sink: int, k0: int, n_ke: int) -> Tensor:
        """Rows ``0 .. n_sink - 1`` and ``k0 .. n_ke - 1`` of ``x[u0:u1]`` ``[units, n_k, d]``, in a
        reused buffer ``[u1 - u0, n_sink + n_ke - k0, d]``."""
        d = x.shape[-1]
        buf = self._buffer(name, (u1 - u0) * (n_sink + n_ke - k0) * d).view(u1 - u0, -1, d)
        return torch.cat([x[u0:u1, :n_sink], x[u0:u1, k0:n_ke]], 1, out=buf)

    def _mask_window(self, sc: Tensor, s: int, e: int, u0: int, u1: int, n_sink: int, k0: int, n_ke: int) -> None:
        """Mask keys outside each head's window and sink: ``S_h <= j <= p_i − W_h`` (``W_h > 0``)
        in scores ``[units, group, c, columns]`` of rows ``s..e``, columns keys ``0..n_sink`` then
        ``k0..n_ke`` (masking the last key of a row never happens: ``p_i > p_i − W_h``)."""
        j = self.job
        first = j.offset + s  # position of the chunk's first row
        if first + (e - s) - 1 - int(j.win[j.win > 0].min()) < 0:
            return  # every window reaches back to key 0 for every row of this chunk
        kv = torch.arange(u0, u1, device=j.dev) % j.n_kv
        win, sink = j.win[kv], j.sink[kv]  # [units, group, 1, 1]
        pos = torch.arange(first, j.offset + e, device=j.dev).view(1, 1, -1, 1)
        keys = torch.arange(k0, n_ke, device=j.dev)
        if n_sink:
            keys = torch.cat([torch.arange(n_sink, device=j.dev), keys])
        keys = keys.view(1, 1, 1, -1)
        sc.masked_fill_((win > 0) & (keys >= sink) & (keys <= pos - win), j.neg)

    def _band(self, s: int, e: int, n_ke: int) -> tuple[int, Tensor]:
        """First key and 0/1 matrix ``[c, width]`` of the keys in (p_i - W, p_i] for rows s..e."""
        j = self.job
        c, base = e - s, j.offset + s
        r_lo, r_hi = max(0, base - j.plan.window + 1), min(n_ke, j.offset + e)
        key = (c, r_lo - base, max(0, r_hi - r_lo))
        band = self.band.get(key)
        if band is None:
            rel = torch.arange(r_lo - base, max(r_hi, r_lo) - base, device=j.dev).unsqueeze(0)
            i = torch.arange(c, device=j.dev).unsqueeze(1)
            band = self.band[key] = ((rel <= i) & (rel > i - j.plan.window)).to(j.cdt)
        return r_lo, band


def _column_keys(col: Tensor, n_sink: int, k0: int) -> Tensor:
    """Key index of score columns ``col``: keys ``0 .. n_sink - 1``, then ``k0`` on."""
    if not n_sink:
        return col + k0
    return torch.where(col < n_sink, col, col + (k0 - n_sink))


def _row_argmax(x: Tensor, width: int = 64) -> tuple[Tensor, Tensor]:
    """Row max and the first index reaching it, over the last axis of ``x`` ``[..., n]``.

    Same result as ``x.max(-1)``, about three times faster on CPU: maxima of ``width``-wide
    blocks (a vectorised ``amax``), the first block holding the row max, then an argmax inside it.
    """
    n = x.shape[-1]
    full = (n // width) * width
    if full == 0:
        return x.max(-1)
    block_max = x[..., :full].unflatten(-1, (full // width, width)).amax(-1)
    if full < n:
        block_max = torch.cat([block_max, x[..., full:].amax(-1, keepdim=True)], -1)
    m, block = block_max.max(-1)  # first block on ties
    cols = (block.unsqueeze(-1) * width + torch.arange(width, device=x.device)).clamp_(max=n - 1)
    return m, block * width + x.gather(-1, cols).argmax(-1)


def _pool_rows(s: int, e: int, B: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Indicator ``[row blocks touched, e - s]``: which pooled row block each chunk row falls in."""
    blocks = torch.arange(s, e, device=device) // B - s // B
    return (blocks.unsqueeze(0) == torch.arange((e - 1) // B + 1 - s // B, device=device).unsqueeze(1)).to(dtype)


def _pool_add(pool: Tensor, row_blocks: Tensor, s: int, n_ke: int, B: int) -> None:
    """Add row-block sums ``[units, group, row blocks, n_ke]`` of a chunk starting at row ``s``."""
    qb0 = s // B
    qb1 = qb0 + row_blocks.shape[2]
    full = (n_ke // B) * B
    if full:
        pool[:, :, qb0:qb1, : full // B] += row_blocks[..., :full].unflatten(-1, (full // B, B)).sum(-1)
    if full < n_ke:
        pool[:, :, qb0:qb1, full // B] += row_blocks[..., full:].sum(-1)

"""The statistics :func:`headscope.kernels.attention.attention` can return, their defaults, and the checked request.

Both backends (the chunked torch path in :mod:`headscope.kernels.attention`, the fused kernels in
:mod:`headscope.kernels.triton_attention`) and the eager reference (:mod:`headscope.kernels.reference`) read the names
from here, so a statistic is spelled once. :func:`validate` turns the arguments of one call into a
:class:`Plan` that every backend trusts: shapes, dtypes, spans, rows and block sizes are checked
here, once, with messages that say what to pass instead.

What each statistic is (formulas, shapes, and the papers they come from: FlashAttention's per-row
log-sum-exp, StreamingLLM's attention sinks, DuoAttention's sink + recent-window mass, the
retrieval-head argmax) is written in the docstring of :func:`headscope.kernels.attention.attention`.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: The vocabulary: what ``headscope.kernels.attention`` re-exports (callers import the names with ``attention``).
__all__ = [
    "ARGMAX",
    "ARGMAX_PROB",
    "BACKENDS",
    "COL_SUM",
    "DEFAULT_SINK_SIZE",
    "DEFAULT_WINDOW",
    "ENTROPY",
    "LSE",
    "POOLED",
    "RECENT_MASS",
    "ROWS",
    "SINK_MASS",
    "SPAN_MASS",
    "STATISTICS",
    "TOPK_INDEX",
    "TOPK_PROB",
]

# --- statistic names: the one place that spells them --------------------------------------------
LSE = "lse"
ARGMAX = "argmax"
SPAN_MASS = "span_mass"
RECENT_MASS = "recent_mass"
SINK_MASS = "sink_mass"
ENTROPY = "entropy"
COL_SUM = "col_sum"
POOLED = "pooled"
ROWS = "rows"
#: Everything ``stats=`` accepts.
STATISTICS: tuple[str, ...] = (LSE, ARGMAX, SPAN_MASS, RECENT_MASS, SINK_MASS, ENTROPY, COL_SUM, POOLED, ROWS)
#: Extra outputs that come with ARGMAX (the top-k pair only with ``topk > 1``).
ARGMAX_PROB = "argmax_prob"
TOPK_INDEX = "topk_index"
TOPK_PROB = "topk_prob"

#: What ``backend=`` accepts.
BACKENDS = ("auto", "torch", "triton")
#: ``S`` of ``"sink_mass"``: StreamingLLM's four attention sinks (Xiao et al. 2023, arXiv:2309.17453).
DEFAULT_SINK_SIZE = 4
#: ``W`` of ``"recent_mass"``: the last W keys up to each query (DuoAttention's streaming heads keep
#: sinks plus such a window; Xiao et al. 2024, arXiv:2410.10819).
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class Plan:
    """One call's validated, normalised arguments; every backend trusts them as they are.

    ``sink_size`` is already clamped to ``n_k``, ``rows`` are non-negative query indices, ``spans``
    are half-open key ranges inside the sequence, and ``block_size`` is set whenever ``"pooled"``
    is asked for.
    """

    causal: bool
    scale: float
    stats: frozenset[str]
    sink_size: int
    window: int
    spans: tuple[tuple[int, int], ...]
    block_size: int | None
    rows: tuple[int, ...]
    topk: int
    #: Per query head: keys ``j < key_sink[h]`` stay visible outside the window (all 0: none).
    key_sink: tuple[int, ...] = ()
    #: Per query head: row ``i`` sees keys ``j > p_i − key_window[h]`` (0: unlimited). Empty
    #: tuple: no head has a window, the mask is plain causal.
    key_window: tuple[int, ...] = ()
    #: Gemma 2's logit soft-capping: ``s ← softcap · tanh(s / softcap)`` before the mask.
    softcap: float | None = None

    @property
    def windowed(self) -> bool:
        """Whether some head's key mask is narrower than causal (a sliding window)."""
        return any(self.key_window)

    @property
    def mass_spans(self) -> list[tuple[int, int]]:
        """Key spans whose mass a backend sums per row: the ``spans``, then ``(0, S)`` for
        ``"sink_mass"``. :func:`split_span_masses` takes the sums apart again."""
        return list(self.spans) + ([(0, self.sink_size)] if SINK_MASS in self.stats else [])


def split_span_masses(plan: Plan, masses: Tensor) -> dict[str, Tensor]:
    """``"span_mass"`` and ``"sink_mass"`` out of sums ``[..., len(plan.mass_spans)]`` over
    :attr:`Plan.mass_spans` (whichever of the two was requested)."""
    res = {}
    if SPAN_MASS in plan.stats:
        res[SPAN_MASS] = masses[..., : len(plan.spans)]
    if SINK_MASS in plan.stats:
        res[SINK_MASS] = masses[..., -1]
    return res


# --- validation ------------------------------------------------------------------------------------


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is set: Triton then runs its kernels on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(q: Tensor, backend: str) -> bool:
    """Whether ``backend`` (already one of :data:`BACKENDS`) means the Triton kernels for ``q``.

    ``"auto"`` picks Triton for CUDA tensors of a dtype it supports when triton is installed (the
    ``[gpu]`` extra); ``"triton"`` without triton, or on anything else, is a :class:`ValueError` that
    says what to use instead.
    """
    if backend == "torch":
        return False
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("backend='triton' needs the triton package, which is not installed: install "
                             "headscope[gpu] (pip install 'headscope[gpu]'), or use backend='torch' or 'auto'")
        if q.device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {q.device}); use backend='torch' or 'auto', "
                "or set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU (slow)"
            )
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"backend='triton' supports float16, bfloat16 and float32, got {q.dtype}")
        return True
    # auto
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # triton is the [gpu] extra: without it (or where it cannot load), the torch path
        return False
    return True


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        as_int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an int, got {value!r}") from None
    if as_int != value:
        raise ValueError(f"{what} must be an int, got {value!r}")
    return as_int


def validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float | None,
    stats: str | Iterable[str],
    sink_size: int,
    window: int,
    spans: Sequence[tuple[int, int]] | None,
    block_size: int | None,
    rows: Sequence[int] | Tensor | None,
    topk: int,
    backend: str,
    key_sink: int | Tensor | None = None,
    key_window: int | Tensor | None = None,
    softcap: float | None = None,
) -> Plan:
    """Check the arguments of :func:`headscope.kernels.attention.attention` (same meanings) and normalise them.

    Raises
    ------
    ValueError
        With a message that says what was wrong and what to pass: inconsistent shapes, dtypes or
        devices, an unknown statistic or backend, a span, row, window, sink or block size out of
        range, or a statistic asked for without the argument it needs; a key window on
        non-causal attention, or a key sink / window that is negative or not one value per query head.
    """
    n_q, n_k, d = _check_tensors(q, k, v, causal)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    scale = _check_scale(scale, d)

    names = (stats,) if isinstance(stats, str) else tuple(stats)
    unknown = [s for s in names if s not in STATISTICS]
    if unknown:
        raise ValueError(f"unknown statistic(s) {unknown}; choose from {list(STATISTICS)}")
    wanted = frozenset(names)

    sink_size = _as_int(sink_size, "sink_size")
    if sink_size < 1:
        raise ValueError(f"sink_size must be >= 1, got {sink_size}")
    window = _as_int(window, "window")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    topk = _as_int(topk, "topk")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if topk > n_k:
        raise ValueError(f"topk ({topk}) exceeds the number of keys ({n_k})")

    norm_spans = _check_spans(spans, n_k)
    if SPAN_MASS in wanted and not norm_spans:
        raise ValueError("'span_mass' needs spans=[(start, end), ...] with at least one span")

    if block_size is not None:
        block_size = _as_int(block_size, "block_size")
        if block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size}")
    if POOLED in wanted and block_size is None:
        raise ValueError("'pooled' needs block_size=B (a positive int)")

    norm_rows = _check_rows(rows, n_q)
    if ROWS in wanted and rows is None:
        raise ValueError("'rows' needs rows=[query index, ...]")

    n_heads = q.shape[1]
    windows = _per_head(key_window, n_heads, "key_window")
    sinks = _per_head(key_sink, n_heads, "key_sink")
    if any(windows) and not causal:
        raise ValueError("key_window needs causal attention (a window counts back from each query's position)")
    if not any(windows):
        windows, sinks = (), ()  # sinks only matter outside a window
    elif not sinks:
        sinks = (0,) * n_heads
    if softcap is not None:
        try:
            softcap = float(softcap)
        except (TypeError, ValueError):
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}") from None
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a positive number or None, got {softcap}")

    return Plan(
        causal=bool(causal),
        scale=scale,
        stats=wanted,
        sink_size=min(sink_size, n_k),
        window=window,
        spans=tuple(norm_spans),
        block_size=block_size,
        rows=tuple(norm_rows),
        topk=topk,
        key_sink=sinks,
        key_window=windows,
        softcap=softcap,
    )


def _per_head(value: int | Tensor | None, n_heads: int, what: str) -> tuple[int, ...]:
    """``key_sink`` / ``key_window`` as one non-negative int per query head (``()`` for None)."""
    if value is None:
        return ()
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.shape != (n_heads,):
            raise ValueError(f"{what} as a tensor must be int64 of shape [n_heads] = [{n_heads}], "
                             f"got {value.dtype} {tuple(value.shape)}")
        values = tuple(int(x) for x in value.tolist())
    else:
        values = (_as_int(value, what),) * n_heads
    if min(values) < 0:
        raise ValueError(f"{what} must be >= 0 (0 or None: no {what.removeprefix('key_')}), got {min(values)}")
    return values


def _check_tensors(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[int, int, int]:
    """Shapes, dtypes and devices of q, k, v (see :func:`validate`); ``(n_q, n_k, d_head)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, heads, positions, d_head], got shape {tuple(t.shape)}"
            )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, n_heads, n_q, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, kv_heads, n_k], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must share d_head, got {d} and {k.shape[3]}")
    n_kv, n_k = k.shape[1], k.shape[2]
    if n_kv == 0 or n_heads % n_kv != 0:
        raise ValueError(
            f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv}) for grouped-query attention"
        )
    if n_q == 0 or n_k == 0 or d == 0 or b == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and n_q > n_k:
        raise ValueError(
            f"causal attention needs n_q <= n_k (queries are the last n_q positions), got n_q={n_q}, n_k={n_k}"
        )
    return n_q, n_k, d


def _check_scale(scale: float | None, d: int) -> float:
    """The logit scale: ``1/sqrt(d_head)`` by default, else a finite number."""
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"scale must be a number, got {scale!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_spans(spans: Sequence[tuple[int, int]] | None, n_k: int) -> list[tuple[int, int]]:
    """Key spans as ``(start, end)`` int pairs inside ``0 .. n_k``."""
    norm_spans: list[tuple[int, int]] = []
    if spans is not None:
        for span in spans:
            try:
                start, end = span
            except (TypeError, ValueError):
                raise ValueError(f"each span must be a (start, end) pair, got {span!r}") from None
            start, end = _as_int(start, "span start"), _as_int(end, "span end")
            if not 0 <= start < end <= n_k:
                raise ValueError(
                    f"span ({start}, {end}) is outside the sequence: need 0 <= start < end <= n_k = {n_k}"
                )
            norm_spans.append((start, end))
    return norm_spans


def _check_rows(rows: Sequence[int] | Tensor | None, n_q: int) -> list[int]:
    """Query rows as non-negative indices (negative ones count from the end)."""
    norm_rows: list[int] = []
    if rows is not None:
        row_list = rows.tolist() if isinstance(rows, Tensor) else list(rows)
        for r in row_list:
            r = _as_int(r, "row index")
            if not -n_q <= r < n_q:
                raise ValueError(f"row {r} is out of range for n_q = {n_q} (use -n_q <= row < n_q)")
            norm_rows.append(r % n_q)
    return norm_rows


def pool_counts(n_q: int, n_k: int, B: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Cells per pooled block: ``rows_in_block × cols_in_block`` (edge blocks are smaller).

    ``"pooled"`` is a block's sum of attention divided by this, so that it is exactly the
    average-pooled attention matrix, masked cells counted as zero.
    """
    rq = torch.clamp(n_q - torch.arange(0, n_q, B, device=device), max=B)
    rk = torch.clamp(n_k - torch.arange(0, n_k, B, device=device), max=B)
    return (rq.unsqueeze(1) * rk.unsqueeze(0)).to(dtype)

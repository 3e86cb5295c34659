"""Long runs: one forward pass in statistics mode, per-head statistics stored instead of patterns.

A :class:`StatsRun` is what :func:`capture_statistics` keeps of one forward pass whose attention ran
through :func:`headscope.kernels.attention` (:mod:`headscope.analysis.attention_statistics`): per layer, head and query
row the statistics the per-head scores need, the attention received per key, a block-pooled map of
every head, plus the per-token loss and top-5 predictions (from the final hidden state, a chunk of
positions at a time: :mod:`headscope.analysis.token_predictions`, so never an ``[n, vocab]`` array). Memory is
O(layers · heads · n) plus the pooled maps (at most ``MAX_BLOCKS²`` per head): a 4,096-token run of
the embedded model stores about 60 MB where its float16 patterns would take 9 GB.

Per-head scores from statistics (:mod:`headscope.analysis.statistics_scores`, dispatched by the
registry :data:`headscope.analysis.score_registry.HEAD_SCORES`: :func:`statistics_score`) follow the same
definitions as the pattern-based ones (tested equal on a 512-token run), from these statistics:

- entropy: the kernel's row entropy ``H_i``; max_attention: its argmax probability;
- first_token, previous_token: ``A[i, 0]`` and ``A[i, i−1]`` (a span mass and a pair term);
- streaming: the masses on the first S keys and on the last W keys up to the query;
- received (sink map) and mid_sink: the column sums and the diagonal pair term;
- evidence: the mass of each query row on the evidence spans;
- duplicate-token and induction (TransformerLens' ``head_detector``, ``mul``): the detection
  pattern's cells (``t_j = t_i, j < i``; induction the same cells shifted one key right) read exactly
  from the lse (pair terms over listed cells); nan above :data:`MAX_DETECTOR_CELLS` cells.

Exact values of a region (:func:`exact_region`) come from the kernel too: the forward pass is run
again in statistics mode with the region's query rows requested as exact rows in one layer, and
stopped after that layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from headscope.analysis.attention_statistics import (
    LayerRequest,
    LayerStats,
    statistics_mode,
    statistics_supported,
)
from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.models import LoadedModel
from headscope.analysis.runs import RunRecord
from headscope.analysis.score_registry import (
    HEAD_SCORES,
    STATISTICS_SCORES,
    ScoreInput,
    run_metrics,
    score_run,
)
from headscope.analysis.statistics_scores import (
    evidence_from_statistics as evidence_from_statistics,  # callers import it here
)
from headscope.analysis.statistics_scores import received
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result
from headscope.analysis.streaming import (
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    SINK_MIN_LATER,
    SINK_THRESHOLD,
    sink_flags,
)
from headscope.analysis.token_predictions import final_hidden_state, token_predictions
from headscope.kernels.attention import (
    ARGMAX,
    ARGMAX_PROB,
    COL_SUM,
    ENTROPY,
    LSE,
    POOLED,
    RECENT_MASS,
    ROWS,
    SINK_MASS,
    SPAN_MASS,
)

STATS_RUN_VERSION = 2  # 2: duplicate-token and induction cells
MAX_BLOCKS = 128
"""Pooled maps have at most this many blocks per side: block size ``B = ceil(n / MAX_BLOCKS)``."""
MAX_REGION = 256
"""Largest side of a region whose exact attention is recomputed."""
#: Per-row statistics kept per layer: name → what it is.
ROW_STATS = {
    "entropy": "row entropy H_i (nats)",
    "argmax": "argmax key",
    "argmax_prob": "largest weight of the row",
    "sink_mass": "mass on the first S keys",
    "recent_mass": "mass on the last W keys up to the query",
    "first": "A[i, 0]",
    "diag": "A[i, i]",
    "prev": "A[i, i-1]",
}
STATS_METRICS = STATISTICS_SCORES
"""Scores of one text that statistics give (the registry's :data:`headscope.analysis.score_registry.STATISTICS_SCORES`)."""
DETECTORS = ("duplicate_token", "induction")
MAX_DETECTOR_CELLS = 4_000_000
"""Most (query, key) cells the duplicate-token and induction scores read (a text that repeats one
token thousands of times has ~N²/2 of them); above it those two scores are nan."""


@dataclass
class StatsRun(RunRecord):
    """What one statistics-mode forward pass kept (see the module docstring); an
    :class:`headscope.analysis.runs.AttentionRun` without full patterns.

    Attributes
    ----------
    rows : name (:data:`ROW_STATS`) → ``[layer, head, n]``.
    detectors : ``duplicate_token`` / ``induction`` → ``[layer, head]`` attention on the detection
        pattern's cells, summed (absent when there were too many cells).
    col_sum : ``[layer, head, n]`` attention received per key, ``Σ_i A[i, j]``.
    pooled : ``[layer, head, ceil(n/B), ceil(n/B)]`` mean attention per ``B × B`` block.
    span_mass : ``[layer, head, n, n_spans]`` mass on ``settings["spans"]`` (absent without spans).
    """

    rows: dict[str, np.ndarray]
    col_sum: np.ndarray
    pooled: np.ndarray
    token_loss: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    span_mass: np.ndarray | None = None
    detectors: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: float = float("nan")
    _memo: dict = field(default_factory=dict, repr=False)

    kind = "stats_run"
    has_patterns = False

    @property
    def block_size(self) -> int:
        return int(self.settings["block_size"])

    @property
    def n_layers(self) -> int:
        return self.col_sum.shape[0]

    @property
    def n_heads(self) -> int:
        return self.col_sum.shape[1]

    @property
    def metrics(self) -> tuple[str, ...]:
        """The scores this run gives (:func:`headscope.analysis.score_registry.run_metrics`): those with a
        statistics mode, and those that need only the model on a text short enough for them."""
        return run_metrics(self)

    @property
    def mode(self) -> str:
        return f"statistics mode, no patterns kept, pooled block {self.block_size}"

    def require_patterns(self, what: str) -> None:
        """An ``InputError``: ``what`` needs full patterns, which a statistics run does not keep."""
        raise InputError(f"{what} needs full attention patterns; this {self.n_tokens:,}-token run kept statistics "
                         "only (longer than HEADSCOPE_MAX_TOKENS). Run a shorter text.")

    def head_scores(self, metric: str, model: LoadedModel | None = None) -> np.ndarray:
        """``[layer, head]`` score ``metric`` (:func:`headscope.analysis.score_registry.score_run`: from the
        statistics, or with ``model``, default the run's own, for a score that needs the model)."""
        return score_run(self, metric, model)

    def received_attention(self) -> np.ndarray:
        """``[layer, head, n]`` :func:`received`."""
        return received(self)

    def sink_counts(self) -> np.ndarray:
        """``[n]`` :func:`sink_positions`."""
        return sink_positions(self)

    def attention_overview(self, layer: int, head: int) -> np.ndarray:
        """``[ceil(n/B), ceil(n/B)]`` the head's mean attention per ``B × B`` block (float64)."""
        return np.asarray(self.pooled[layer, head], dtype=np.float64)

    def attention_region(self, layer: int, head: int, queries: tuple[int, int], keys: tuple[int, int],
                         model: LoadedModel | None = None) -> np.ndarray:
        """Exact ``A[l, h][q0:q1, k0:k1]`` recomputed through the kernel (:func:`exact_region`) with
        ``model`` (default: the run's model, loaded)."""
        if model is None:
            from headscope.analysis.models import load_model

            model = load_model(self.model_name)
        return exact_region(model, self, layer, head, queries, keys)

    def kept_arrays(self) -> dict[str, np.ndarray]:
        """The per-row statistics, column sums and pooled maps (no patterns)."""
        arrays = {f"row_{name}": a for name, a in self.rows.items()}
        arrays.update(col_sum=self.col_sum, pooled=self.pooled)
        return arrays

    def meta(self) -> dict[str, Any]:
        return {**self.common_meta(), "seconds": self.seconds, "version": STATS_RUN_VERSION}


def block_size_for(n: int) -> int:
    return max(1, -(-n // MAX_BLOCKS))


def _merge_spans(spans: Sequence[Sequence[int]], n: int, what: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in spans:
        a, e = int(s[0]), int(s[1])
        if not 0 <= a < e <= n:
            raise InputError(f"The {what} span ({a}, {e}) is outside the {n}-token input.")
        out.append((a, e))
    return out


def detection_cells(token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The duplicate-token detection pattern's cells ``(i, j)``, ``j < i``, ``t_j = t_i`` (rows,
    keys; the induction cells are the same with ``j + 1``); None above :data:`MAX_DETECTOR_CELLS`."""
    positions: dict[int, list[int]] = {}
    for i, t in enumerate(token_ids):
        positions.setdefault(int(t), []).append(i)
    total = sum(len(p) * (len(p) - 1) // 2 for p in positions.values())
    if total > MAX_DETECTOR_CELLS:
        return None
    rows = np.empty(total, dtype=np.int64)
    keys = np.empty(total, dtype=np.int64)
    at = 0
    for pos in positions.values():
        for a in range(1, len(pos)):
            rows[at : at + a] = pos[a]
            keys[at : at + a] = pos[:a]
            at += a
    return rows, keys


def stats_key(model: LoadedModel, token_ids: Sequence[int], settings: dict[str, Any]) -> str:
    return content_key("stats_run", STATS_RUN_VERSION, model.digest, list(map(int, token_ids)), settings)


def capture_statistics(
    model: LoadedModel,
    text_or_ids: str | Sequence[int],
    *,
    sink: int = DEFAULT_SINK,
    window: int = DEFAULT_WINDOW,
    spans: Sequence[Sequence[int]] = (),
    store: Store | None = None,
    max_tokens: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> StatsRun:
    """One forward pass of ``model`` in statistics mode; statistics kept, patterns never built.

    Parameters
    ----------
    text_or_ids : text (tokenised by :func:`headscope.analysis.capture.tokenize_input`: a BOS only where the
        model expects one) or token ids, used exactly as given.
    sink, window : S and W of the sink and recent-window masses (the streaming score).
    spans : half-open key spans whose mass each query row puts on them (e.g. a needle).
    store : a stored run with the same key is loaded instead of recomputed; a new one is stored.
    max_tokens : longest input accepted (default: the model's context).
    """
    from headscope.analysis.capture import tokenize_input

    if sink < 0 or window < 1:
        raise InputError(f"The sink size must be >= 0 and the window >= 1; got S={sink}, W={window}.")
    ids = tokenize_input(model, text_or_ids, max_tokens or model.n_ctx)
    n = len(ids)
    spans = _merge_spans(spans, n, "key")
    B = block_size_for(n)
    settings = {"sink": int(sink), "window": int(window), "spans": [list(s) for s in spans], "block_size": B}
    if model.facts.windowed:  # per-layer sliding windows (entropy's visible keys); absent: all full
        settings["layer_windows"] = model.facts.run_windows()
    key = stats_key(model, ids, settings)
    if (stored := stored_result(store, key, load_stats_run, progress)) is not None:
        return stored

    L, H = model.n_layers, model.n_heads
    rows = {name: np.zeros((L, H, n), dtype=np.int64 if name == "argmax" else np.float32) for name in ROW_STATS}
    col_sum = np.zeros((L, H, n), dtype=np.float32)
    n_b = -(-n // B)
    pooled = np.zeros((L, H, n_b, n_b), dtype=np.float32)
    span_mass = np.zeros((L, H, n, len(spans)), dtype=np.float32) if spans else None
    kernel_spans = [(0, 1), *spans]
    cells = detection_cells(ids)
    detectors = {name: np.zeros((L, H), dtype=np.float64) for name in DETECTORS} if cells is not None else {}
    pair_index = None
    n_dup = 0
    if cells is not None:
        n_dup = len(cells[0])  # induction cells: the duplicate cells one key to the right
        pair_index = (torch.from_numpy(np.concatenate([cells[0], cells[0]])),
                      torch.from_numpy(np.concatenate([cells[1], cells[1] + 1])))
    request = LayerRequest(
        kernel={"stats": (ENTROPY, ARGMAX, SINK_MASS, RECENT_MASS, SPAN_MASS, COL_SUM, POOLED, LSE),
                "sink_size": max(int(sink), 1) if sink else 1, "window": int(window), "spans": kernel_spans,
                "block_size": B},
        pairs=(0, 1),
        pair_index=pair_index,
    )

    def keep(ls: LayerStats) -> None:
        s, la = ls.stats, ls.layer
        rows["entropy"][la] = s[ENTROPY][0].cpu().numpy()
        rows["argmax"][la] = s[ARGMAX][0].cpu().numpy()
        rows["argmax_prob"][la] = s[ARGMAX_PROB][0].cpu().numpy()
        rows["sink_mass"][la] = s[SINK_MASS][0].cpu().numpy() if sink else 0.0
        rows["recent_mass"][la] = s[RECENT_MASS][0].cpu().numpy()
        sm = s[SPAN_MASS][0].cpu().numpy()
        rows["first"][la] = sm[..., 0]
        if span_mass is not None:
            span_mass[la] = sm[..., 1:]
        rows["diag"][la] = ls.pairs[0][0].cpu().numpy()
        rows["prev"][la] = ls.pairs[1][0].cpu().numpy()
        col_sum[la] = s[COL_SUM][0].cpu().numpy()
        pooled[la] = s[POOLED][0].cpu().numpy()
        if ls.cells is not None:
            w = ls.cells[0].double()
            detectors["duplicate_token"][la] = w[:, :n_dup].sum(-1).cpu().numpy()
            detectors["induction"][la] = w[:, n_dup:].sum(-1).cpu().numpy()
        if progress:
            progress((la + 1) / (L + 1))

    import time

    t0 = time.perf_counter()
    tokens_t = torch.tensor([ids], dtype=torch.long, device=model.device)
    # The last position's logits only: loss and top-5 come from the final hidden state, a chunk of
    # positions at a time (analysis.token_predictions), never an [n, vocab] array (8 GiB for Gemma 3 at 8k).
    with (torch.inference_mode(), statistics_mode(model, lambda layer, n_q, n_k: request, keep),
          final_hidden_state(model) as kept):
        last = model.bridge(tokens_t, return_type="logits", logits_to_keep=1)
    predicted = token_predictions(model, kept.hidden, ids, last_logits=last[0, -1])
    token_loss, top_ids, top_probs = predicted.token_loss, predicted.top_ids, predicted.top_probs
    del kept, last
    run = StatsRun(
        key=key, model_name=model.name, model_digest=model.digest, token_ids=ids,
        tokens=model.token_strings(ids), text=text_or_ids if isinstance(text_or_ids, str) else None,
        settings=settings, rows=rows, col_sum=col_sum, pooled=pooled, token_loss=token_loss,
        top_ids=top_ids, top_probs=top_probs, span_mass=span_mass, detectors=detectors,
        seconds=time.perf_counter() - t0,
    )
    if store is not None:
        save_stats_run(store, run)
    if progress:
        progress(1.0)
    return run


def save_stats_run(store: Store, run: StatsRun) -> None:
    arrays = {f"row_{name}": arr for name, arr in run.rows.items()}
    arrays.update(col_sum=run.col_sum, pooled=run.pooled, token_loss=run.token_loss, top_ids=run.top_ids,
                  top_probs=run.top_probs)
    if run.span_mass is not None:
        arrays["span_mass"] = run.span_mass
    for name, table in run.detectors.items():
        arrays[f"det_{name}"] = table
    store.put(run.key, StatsRun.kind, run.meta(), arrays)


def load_stats_run(store: Store, key: str) -> StatsRun | None:
    """A stored statistics run, or ``None`` when absent or corrupt."""
    record = stored_record(store, key, StatsRun.kind)
    if record is None:
        return None
    m = record.meta
    names = record.array_info
    return StatsRun(
        key=key, model_name=m["model_name"], model_digest=m["model_digest"], token_ids=m["token_ids"],
        tokens=m["tokens"], text=m.get("text"), settings=m["settings"],
        rows={n[4:]: record.array(n, mmap=False) for n in names if n.startswith("row_")},
        col_sum=record.array("col_sum", mmap=False), pooled=record.array("pooled", mmap=False),
        token_loss=record.array("token_loss", mmap=False), top_ids=record.array("top_ids", mmap=False),
        top_probs=record.array("top_probs", mmap=False),
        span_mass=record.array("span_mass", mmap=False) if "span_mass" in names else None,
        detectors={n[4:]: record.array(n, mmap=False) for n in names if n.startswith("det_")},
        seconds=float(m.get("seconds", float("nan"))),
    )


def capture_for_page(model: LoadedModel, text: str, store: Store | None, max_tokens: int,
                     progress: Callable[[float], None] | None = None,
                     before_store: Callable[[Any], None] | None = None) -> Any:
    """What the Attention page runs: full patterns (:func:`headscope.analysis.capture.capture`) up to
    ``max_tokens`` tokens on CPU, a statistics run above that (up to ``HEADSCOPE_MAX_STATS_TOKENS``
    and the model's context), and a statistics run at any length on CUDA, where it is the default.
    ``progress(fraction)`` is called as layers finish; ``before_store(run)`` with a newly computed
    pattern run before it is stored (:func:`headscope.analysis.capture.capture`; a statistics run is not passed)."""
    from headscope.analysis.capture import capture, tokenize_input
    from headscope.analysis.limits import limit

    long_limit = min(limit("HEADSCOPE_MAX_STATS_TOKENS"), model.n_ctx)
    ids = tokenize_input(model, text, max(long_limit, max_tokens), variable="HEADSCOPE_MAX_STATS_TOKENS",
                         limited=f"runs (statistics mode above {max_tokens:,} tokens; the model's context is "
                                 f"{model.n_ctx:,}) are limited to")
    if statistics_supported(model) and (len(ids) > max_tokens or str(model.device).startswith("cuda")):
        return capture_statistics(model, text, store=store, max_tokens=long_limit, progress=progress)
    return capture(model, text, store=store, max_tokens=max_tokens, max_tokens_variable="HEADSCOPE_MAX_TOKENS",
                   progress=progress, before_store=before_store)


# --- scores from statistics -----------------------------------------------------------------------


def sink_positions(run: StatsRun, threshold: float = SINK_THRESHOLD, min_later: int = SINK_MIN_LATER) -> np.ndarray:
    """``[n]`` number of heads for which each position is a sink (as in :func:`headscope.analysis.streaming.sink_map`)."""
    return sink_flags(received(run), threshold, min_later, run.layer_windows).sum((0, 1))


def statistics_score(run: StatsRun, name: str, sink: int | None = None, window: int | None = None) -> np.ndarray:
    """``[layer, head]`` score ``name`` (:data:`STATS_METRICS`) from the run's statistics, by the
    registry's statistics mode of that score.

    ``sink``/``window`` must match the run's (the masses were taken with them); nan where the
    pattern-based definition is nan (too short a run)."""
    if name not in STATS_METRICS:
        raise InputError(f"Unknown score {str(name)[:40]!r}; statistics give: {', '.join(STATS_METRICS)}.")
    return HEAD_SCORES[name].of_statistics(ScoreInput(token_ids=run.token_ids, stats=run, windows=run.layer_windows,
                                                      sink=sink, window=window))


# --- exact values of a region -----------------------------------------------------------------------


def parse_region(region: str, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``"q0-q1,k0-k1"`` (half-open, as written in a page's URL) → ``((q0, q1), (k0, k1))``."""
    import re

    m = re.fullmatch(r"(\d{1,7})-(\d{1,7}),(\d{1,7})-(\d{1,7})", str(region).strip())
    if not m:
        raise InputError(f"The region {str(region)[:40]!r} is not of the form q0-q1,k0-k1.")
    q0, q1, k0, k1 = (int(x) for x in m.groups())
    if not (q0 < q1 <= n and k0 < k1 <= n):
        raise InputError(f"The region {region} is outside the {n:,}-token run.")
    return (q0, q1), (k0, k1)


class _Stop(Exception):
    pass


def exact_region(model: LoadedModel, run: StatsRun, layer: int, head: int,
                 queries: tuple[int, int], keys: tuple[int, int]) -> np.ndarray:
    """Exact attention ``A[q0:q1, k0:k1]`` of one head, recomputed through the kernel.

    The forward pass runs again in statistics mode; layer ``layer`` returns the region's query
    rows (``"rows"``), and the pass stops there (later layers are not computed).
    """
    n = run.n_tokens
    layer, head = check_head_index(run.n_layers, run.n_heads, layer, head)
    q0, q1 = max(0, int(queries[0])), min(n, int(queries[1]))
    k0, k1 = max(0, int(keys[0])), min(n, int(keys[1]))
    if q1 <= q0 or k1 <= k0:
        raise InputError(f"The region {queries} × {keys} holds no cell of the {n}-token run.")
    if q1 - q0 > MAX_REGION or k1 - k0 > MAX_REGION:
        raise InputError(f"The region is {q1 - q0} × {k1 - k0} cells; exact values are shown for at most "
                         f"{MAX_REGION} × {MAX_REGION}. Zoom in further.")
    if model.digest != run.model_digest:
        raise InputError("This run was made with another model (its digest differs): load that model.")
    out: dict[str, np.ndarray] = {}

    def request(la: int, n_q: int, n_k: int) -> LayerRequest | None:
        return LayerRequest(kernel={"stats": (ROWS,), "rows": list(range(q0, q1))}) if la == layer else None

    def keep(ls: LayerStats) -> None:
        out["rows"] = ls.stats[ROWS][0, head, :, k0:k1].cpu().numpy()
        raise _Stop

    tokens_t = torch.tensor([run.token_ids], dtype=torch.long, device=model.device)
    try:
        with torch.inference_mode(), statistics_mode(model, request, keep):
            model.bridge(tokens_t, return_type="logits")
    except _Stop:
        pass
    return out["rows"]

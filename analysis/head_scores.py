"""Per-head scores over several prompts, aggregated with mean and spread.

For each prompt one forward pass runs in statistics mode (:mod:`headscope.analysis.statistics_run`: attention
through the kernels, per-row statistics kept, never an N × N matrix), which gives every score of
:data:`headscope.analysis.head_summary.HEAD_METRICS` (entropy, first-token and mid-sequence sinks,
previous-token, duplicate-token, induction, max attention, streaming) and the evidence score at any
length, equal to their pattern-based definitions (models that cannot run in statistics mode capture
full patterns instead). The scores are computed
with the streaming score's sink size S and recent window W as parameters
(:func:`headscope.analysis.streaming.streaming_score`), plus the evidence score when the prompt names a
question span and an evidence span (:func:`headscope.analysis.evidence.evidence_score`: question tokens →
the needle, as in a needle-in-a-haystack prompt). The per-prompt tables are aggregated with
:func:`headscope.analysis.detectors.aggregate_runs` (mean, sample standard deviation, n) and stored, so the
Heads page and ``headscope scan`` read them back instantly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headscope.analysis.attention_statistics import statistics_supported
from headscope.analysis.capture import capture
from headscope.analysis.detectors import aggregate_runs
from headscope.analysis.errors import InputError
from headscope.analysis.evidence import evidence_score
from headscope.analysis.head_summary import HEAD_METRICS
from headscope.analysis.models import LoadedModel
from headscope.analysis.statistics_run import (
    STATS_METRICS,
    capture_statistics,
    evidence_from_statistics,
    statistics_score,
)
from headscope.analysis.store import Store, content_key
from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW, streaming_score

HEAD_SCORES_VERSION = 3  # 2: statistics mode; 3: streaming and sinks read windowed layers where the window lets them
EVIDENCE = "evidence"
LABELS = {**{name: m.label for name, m in HEAD_METRICS.items()}, EVIDENCE: "Evidence score (question → needle)"}


@dataclass(frozen=True)
class ScoredPrompt:
    """One prompt to score: its exact token ids and, optionally, the evidence score's spans."""

    token_ids: list[int]
    question_span: tuple[int, int] | None = None
    evidence_span: tuple[int, int] | None = None


@dataclass
class HeadScores:
    """Every per-head score over ``n_prompts`` prompts.

    Attributes
    ----------
    runs : score name → ``[prompt, layer, head]`` the per-prompt tables.
    mean, std : score name → ``[layer, head]`` mean and sample standard deviation over prompts
        (prompts where a score is nan are skipped; std is 0 with one prompt).
    sink, window : the streaming score's S and W.
    """

    runs: dict[str, np.ndarray]
    mean: dict[str, np.ndarray]
    std: dict[str, np.ndarray]
    sink: int
    window: int
    n_prompts: int
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.mean)

    @property
    def layer_windows(self) -> list[int | None] | None:
        """The model's sliding window per layer the scores were taken with (None: all full attention)."""
        return self.meta.get("layer_windows")


def _key(model: LoadedModel, prompts: Sequence[ScoredPrompt], sink: int, window: int) -> str:
    return content_key(
        "head_scores", HEAD_SCORES_VERSION, model.digest,
        [[p.token_ids, p.question_span, p.evidence_span] for p in prompts], sink, window,
    )


def score_prompts(
    model: LoadedModel,
    prompts: Sequence[ScoredPrompt],
    *,
    sink: int = DEFAULT_SINK,
    window: int = DEFAULT_WINDOW,
    store: Store | None = None,
    progress: Callable[[float], None] | None = None,
) -> HeadScores:
    """Score every head on every prompt and aggregate (see the module docstring).

    Parameters
    ----------
    prompts : at least one; each is captured with its ids exactly as given.
    sink, window : S >= 0 first tokens and W >= 1 most recent tokens of the streaming score.
    store : results are loaded from / saved to it under a key of the model digest, the prompts, S and W.

    Returns
    -------
    :class:`HeadScores`; ``evidence`` is present when every prompt has both spans.
    """
    if not prompts:
        raise InputError("Give at least one prompt to score heads on.")
    if sink < 0 or window < 1:
        raise InputError(f"The streaming score needs a sink size >= 0 and a window >= 1; got S={sink}, W={window}.")
    key = _key(model, prompts, sink, window)
    if store is not None:
        stored = load_head_scores(store, key)
        if stored is not None:
            if progress:
                progress(1.0)
            return stored
    with_evidence = all(p.question_span and p.evidence_span for p in prompts)
    kernel = statistics_supported(model)
    per_run: dict[str, list[np.ndarray]] = {}
    for k, prompt in enumerate(prompts):
        n = len(prompt.token_ids)
        tables: dict[str, np.ndarray] = {}
        if kernel:
            # statistics mode: one forward pass, O(n) memory, whatever the prompt's length
            spans = [tuple(prompt.evidence_span)] if with_evidence else []
            stats = capture_statistics(model, prompt.token_ids, sink=sink, window=window, spans=spans,
                                       max_tokens=max(n, 1))
            for name in STATS_METRICS:
                tables[name] = statistics_score(stats, name)
            if with_evidence:
                tables[EVIDENCE] = evidence_from_statistics(stats, tuple(prompt.question_span), [0])
            del stats
        need_patterns = [name for name in HEAD_METRICS if name not in tables]
        if need_patterns:  # a model that cannot run in statistics mode: full patterns, as before
            run = capture(model, prompt.token_ids, max_tokens=max(n, 1))
            for name in need_patterns:
                if name == "streaming":
                    tables[name] = streaming_score(run.patterns, sink=sink, window=window,
                                                   layer_windows=run.layer_windows)
                else:
                    tables[name] = HEAD_METRICS[name].compute(run.patterns, run.token_ids,
                                                              run.layer_windows)
            if with_evidence and EVIDENCE not in tables:
                tables[EVIDENCE] = evidence_score(run.patterns, tuple(prompt.question_span),
                                                  tuple(prompt.evidence_span))
            del run
        for name in [*HEAD_METRICS, EVIDENCE]:
            if name == EVIDENCE and not with_evidence:
                continue
            table = tables.get(name, np.full((model.n_layers, model.n_heads), np.nan))
            per_run.setdefault(name, []).append(np.asarray(table, dtype=np.float64))
        if progress:
            progress((k + 1) / len(prompts))
    runs = {name: np.stack(tables) for name, tables in per_run.items()}
    mean, std = {}, {}
    for name, stack in runs.items():
        agg = aggregate_runs(list(stack))
        mean[name], std[name] = agg.mean, agg.std
    meta = {"model_name": model.name, "model_digest": model.digest, "sink": sink, "window": window,
            "n_prompts": len(prompts), "n_tokens": [len(p.token_ids) for p in prompts],
            "names": list(runs), "layer_windows": model.facts.run_windows(), "version": HEAD_SCORES_VERSION}
    result = HeadScores(runs, mean, std, sink, window, len(prompts), key=key, meta=meta)
    if store is not None:
        store.put(key, "head_scores", meta, {f"runs_{n}": a.astype(np.float32) for n, a in runs.items()})
    return result


def load_head_scores(store: Store, key: str) -> HeadScores | None:
    """Stored head scores, or None when absent or corrupt."""
    record = store.get(key)
    if record is None or record.kind != "head_scores":
        return None
    m = record.meta
    runs = {n: record.array(f"runs_{n}", mmap=False).astype(np.float64) for n in m["names"]}
    mean, std = {}, {}
    for name, stack in runs.items():
        agg = aggregate_runs(list(stack))
        mean[name], std[name] = agg.mean, agg.std
    return HeadScores(runs, mean, std, int(m["sink"]), int(m["window"]), int(m["n_prompts"]), key=key, meta=m)


def trial_prompts(trials: Sequence[Any]) -> list[ScoredPrompt]:
    """The distinct prompts of needle-in-a-haystack trials, with question → needle as the evidence spans.

    ``trials`` are :class:`headscope.analysis.retrieval.Trial` (anything with ``prompt_ids`` and ``settings``
    holding ``question_span`` and ``needle_span``); a prompt repeated across trials is scored once.
    """
    seen: set[tuple[int, ...]] = set()
    out = []
    for t in trials:
        ids = tuple(int(i) for i in t.prompt_ids)
        if ids in seen:
            continue
        seen.add(ids)
        q, e = t.settings.get("question_span"), t.settings.get("needle_span")
        out.append(ScoredPrompt(list(ids), tuple(q) if q else None, tuple(e) if e else None))
    return out

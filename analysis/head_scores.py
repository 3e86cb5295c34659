"""Per-head scores over several prompts, aggregated with mean and spread.

Every score of the registry (:data:`headscope.analysis.score_registry.HEAD_SCORES`) is computed on each
prompt; those that need a question and an evidence span (the evidence score, question → needle, as
in a needle-in-a-haystack prompt) when every prompt has both. One forward pass per prompt runs in
statistics mode (:mod:`headscope.analysis.statistics_run`: attention through the kernels, per-row
statistics kept, never an N × N matrix) and gives every score that has a statistics mode at any
length, equal to its pattern-based definition; a score without one is computed from the prompt's
full patterns, or from the model itself when that is what it needs, on prompts within its limit
(nan beyond). Models that cannot run in statistics mode capture full patterns instead. The streaming
score takes its sink size S and recent window W as parameters
(:func:`headscope.analysis.streaming.streaming_score`). The per-prompt tables are aggregated with
:func:`headscope.analysis.detectors.aggregate_runs` (mean, sample standard deviation, n) and stored,
so the Heads page and ``headscope scan`` read them back instantly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from headscope.analysis.attention_statistics import statistics_supported
from headscope.analysis.capture import capture
from headscope.analysis.detectors import aggregate_runs
from headscope.analysis.errors import InputError
from headscope.analysis.limits import limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.score_registry import HEAD_SCORES, HeadScore, ScoreInput
from headscope.analysis.statistics_run import capture_statistics
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result
from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW

HEAD_SCORES_VERSION = 3  # 2: statistics mode; 3: streaming and sinks read windowed layers where the window lets them


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


def _key(model: LoadedModel, prompts: Sequence[ScoredPrompt], sink: int, window: int, names: Sequence[str]) -> str:
    """The content key: the model, the prompts and their spans, S and W, and the scores computed (a
    score added to the registry is computed afresh rather than missing from a stored result)."""
    return content_key(
        "head_scores", HEAD_SCORES_VERSION, model.digest,
        [[p.token_ids, p.question_span, p.evidence_span] for p in prompts], sink, window, list(names),
    )


def _fits(score: HeadScore, n_tokens: int) -> bool:
    return score.max_tokens is None or n_tokens <= limit(score.max_tokens)


def _score_prompt(model: LoadedModel, prompt: ScoredPrompt, scores: Sequence[HeadScore], sink: int, window: int,
                  kernel: bool) -> dict[str, np.ndarray]:
    """Each score's ``[layer, head]`` table on one prompt (a score past its :attr:`HeadScore.max_tokens`
    limit is left out: nan in the result)."""
    ids, n = prompt.token_ids, len(prompt.token_ids)
    given = ScoreInput(token_ids=ids, model=model, question_span=prompt.question_span,
                       evidence_span=prompt.evidence_span, sink=sink, window=window)
    tables: dict[str, np.ndarray] = {}
    if kernel:  # statistics mode: one forward pass, O(n) memory, whatever the prompt's length
        spanned = any("spans" in s.needs for s in scores) and prompt.evidence_span
        stats = capture_statistics(model, ids, sink=sink, window=window, max_tokens=max(n, 1),
                                   spans=[tuple(prompt.evidence_span)] if spanned else [])
        at = replace(given, stats=stats, windows=stats.layer_windows)
        tables = {s.name: s.of_statistics(at) for s in scores if s.of_statistics is not None}
        del stats, at
    rest = [s for s in scores if s.name not in tables and _fits(s, n)]
    if any("patterns" in s.needs for s in rest):  # a model that cannot run in statistics mode: full patterns
        run = capture(model, ids, max_tokens=max(n, 1))
        given = replace(given, patterns=run.patterns, windows=run.layer_windows)
    for s in rest:
        tables[s.name] = s.of_run(given)
    return tables


def score_prompts(
    model: LoadedModel,
    prompts: Sequence[ScoredPrompt],
    *,
    sink: int = DEFAULT_SINK,
    window: int = DEFAULT_WINDOW,
    store: Store | None = None,
    progress: Callable[[float], None] | None = None,
    names: Sequence[str] | None = None,
) -> HeadScores:
    """Score every head on every prompt and aggregate (see the module docstring).

    Parameters
    ----------
    prompts : at least one; each is captured with its ids exactly as given.
    sink, window : S >= 0 first tokens and W >= 1 most recent tokens of the streaming score.
    store : results are loaded from / saved to it under a key of the model digest, the prompts, S, W and
        the scores.
    names : the scores to compute (default: every score of the registry the prompts allow).

    Returns
    -------
    :class:`HeadScores`, one table per score asked for; those that need spans (``evidence``) only when
    every prompt has both.
    """
    if not prompts:
        raise InputError("Give at least one prompt to score heads on.")
    if sink < 0 or window < 1:
        raise InputError(f"The streaming score needs a sink size >= 0 and a window >= 1; got S={sink}, W={window}.")
    with_spans = all(p.question_span and p.evidence_span for p in prompts)
    unknown = [name for name in names or () if name not in HEAD_SCORES]
    if unknown:
        raise InputError(f"Unknown score {str(unknown[0])[:40]!r}; choose from {', '.join(HEAD_SCORES)}.")
    chosen = [name for name, s in HEAD_SCORES.items()
              if (names is None or name in names) and ("spans" not in s.needs or with_spans)]
    key = _key(model, prompts, sink, window, chosen)
    if (stored := stored_result(store, key, load_head_scores, progress)) is not None:
        return stored
    scores = [HEAD_SCORES[name] for name in chosen]
    kernel = statistics_supported(model)
    per_run: dict[str, list[np.ndarray]] = {name: [] for name in chosen}
    for k, prompt in enumerate(prompts):
        tables = _score_prompt(model, prompt, scores, sink, window, kernel)
        for name, stack in per_run.items():
            stack.append(np.asarray(tables.get(name, np.full((model.n_layers, model.n_heads), np.nan)),
                                    dtype=np.float64))
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
    record = stored_record(store, key, "head_scores")
    if record is None:
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

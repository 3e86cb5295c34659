"""The head-score registry: every per-head score ``[layer, head]`` headscope computes, declared once.

Each :class:`HeadScore` declares its name (the word links, the command line and exports use), its
label, whether it is signed (a signed score is drawn on a diverging colour scale centred at 0), what
it needs (:data:`NEEDS`), how it is computed from a run with the model at hand (``of_run``), how in
statistics mode (``of_statistics``; None: it has none), how float16 storage of the patterns bounds it
(``rounding``, the Compare page's resolution), and, when it ranks key-value groups for a compressed
cache, how (:class:`KVRanking`). Everything that lists scores derives from :data:`HEAD_SCORES`: the
URL's ``metric=``, ``score=`` and ``by=`` values, the Attention, Heads, Compare and Ablation menus,
``headscope ablate --by`` and ``headscope compare --metric``, statistics-mode dispatch
(:func:`score_run`), the score tables over a sweep's prompts
(:func:`headscope.analysis.head_scores.score_prompts`) and the compression rankings
(:mod:`headscope.analysis.kv_compression_choices`).

This module imports nothing heavy (not numpy either), so the command line checks its arguments
against these names before torch loads. Each computation is a short function here that imports the
analysis function it calls: from a score's entry to its definition is one hop.

To add a score: its analysis function (a docstring that cites the paper and writes the formula) with
a test against an independent reference, and one :class:`HeadScore` in :data:`HEAD_SCORES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from headscope.analysis.errors import InputError

NEEDS = {
    "patterns": "the run's attention: full patterns, or a statistics run's statistics where the score has a "
                "statistics mode",
    "spans": "a question span and an evidence span, as every prompt of a needle-in-a-haystack sweep has",
    "model": "the model itself: its weights and a forward pass of the text",
}
"""What a score can need, in words (:attr:`HeadScore.needs`)."""

ROUNDINGS = {
    "sublinear": "a mean of weights, row maxima or column means: |f(A) − f(Â)| ≤ f(u)",
    "ratio": "a ratio Σ A·D / Σ A of TransformerLens' detectors",
    "entropy": "normalised entropy, term by term",
    "exact": "computed afresh from the model, not from stored weights: storage rounds nothing",
}
"""How storage rounding of a run's weights bounds a score
(:func:`headscope.analysis.run_comparison.score_resolution` gives each bound)."""


@dataclass(frozen=True)
class ScoreInput:
    """One text to score, and what is at hand for it.

    Attributes
    ----------
    token_ids : the ids the model saw.
    patterns : ``[layer, head, query, key]`` full attention (a pattern run), or None.
    stats : a :class:`headscope.analysis.statistics_run.StatsRun` (statistics mode), or None.
    windows : the model's sliding window per layer (None: full attention on every layer).
    model : the :class:`headscope.analysis.models.LoadedModel` (for scores that need it), or None.
    question_span, evidence_span : half-open spans (for scores that need spans), or None.
    sink, window : the streaming score's S and W (None: its defaults, or a statistics run's own).
    """

    token_ids: Sequence[int] = ()
    patterns: Any = None
    stats: Any = None
    windows: Sequence[int | None] | None = None
    model: Any = None
    question_span: tuple[int, int] | None = None
    evidence_span: tuple[int, int] | None = None
    sink: int | None = None
    window: int | None = None


Compute = Callable[[ScoreInput], Any]
"""``compute(input) -> [layer, head]`` float64 array (nan where the score is undefined)."""


@dataclass(frozen=True)
class KVRanking:
    """How a score ranks key-value groups for a compressed cache: the group's maximum (a group stays
    full if any of its query heads needs it), of the score or, with ``invert``, of ``1 − score`` (a
    score in [0, 1] whose high values say a head may stream); ``label`` names the ranking."""

    label: str
    invert: bool = False


@dataclass(frozen=True)
class HeadScore:
    """One per-head score (see the module docstring).

    Attributes
    ----------
    name, label, description : its word, its title, one sentence on what it measures.
    needs : a subset of :data:`NEEDS`.
    of_run : computes it from a run with full patterns (``patterns`` set) or, for a score that needs
        no patterns, from the ids and the model.
    of_statistics : computes it from a statistics run (``stats`` set); None: no statistics mode.
    signed : negative values mean something (a diverging colour scale centred at 0).
    windowed : in one phrase, how it treats a layer the model windows ("" when like any other).
    rounding : a key of :data:`ROUNDINGS` (None: no bound known; the Compare page cannot say which
        changes rounding alone can make).
    kv_ranking : how it ranks KV groups for compression (None: it is no ranking).
    mass_curve : exported with its cumulative-mass curve by ``headscope scan``.
    max_tokens : the limit (a variable of :mod:`headscope.analysis.limits`) on a text's tokens, for a
        score that builds full attention itself.
    """

    name: str
    label: str
    description: str
    needs: frozenset[str]
    of_run: Compute
    of_statistics: Compute | None = None
    signed: bool = False
    windowed: str = ""
    rounding: str | None = None
    kv_ranking: KVRanking | None = None
    mass_curve: bool = False
    max_tokens: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", frozenset(self.needs))
        unknown = sorted(self.needs - set(NEEDS))
        if unknown or (self.rounding is not None and self.rounding not in ROUNDINGS):
            raise ValueError(f"score {self.name!r}: unknown needs {unknown} or rounding {self.rounding!r}")

    def compute(self, patterns: Any = None, token_ids: Sequence[int] = (), windows: Sequence[int | None] | None = None,
                **given: Any) -> Any:
        """``[layer, head]`` on one text, as a notebook calls it: ``compute(run.patterns, run.token_ids)``;
        ``given`` sets the other fields of :class:`ScoreInput` (``model=``, ``question_span=``, ...)."""
        return self.of_run(ScoreInput(token_ids=list(token_ids), patterns=patterns, windows=windows, **given))


# --- the computations: each imports the analysis function that defines its score --------------------------


def _entropy(s: ScoreInput) -> Any:
    from headscope.analysis.entropy import normalised_entropy

    return normalised_entropy(s.patterns, s.windows)


def _entropy_statistics(s: ScoreInput) -> Any:
    from headscope.analysis.statistics_scores import entropy_from_statistics

    return entropy_from_statistics(s.stats)


def _first_token(s: ScoreInput) -> Any:
    from headscope.analysis.head_summary import first_token_mass

    return first_token_mass(s.patterns, s.windows)


def _first_token_statistics(s: ScoreInput) -> Any:
    from headscope.analysis.statistics_scores import first_token_from_statistics

    return first_token_from_statistics(s.stats)


def _mid_sink(s: ScoreInput) -> Any:
    from headscope.analysis.head_summary import mid_sequence_sink

    return mid_sequence_sink(s.patterns, s.windows)


def _mid_sink_statistics(s: ScoreInput) -> Any:
    from headscope.analysis.statistics_scores import mid_sink_from_statistics

    return mid_sink_from_statistics(s.stats)


def _previous_token(s: ScoreInput) -> Any:
    from headscope.analysis.head_summary import previous_token_mass

    return previous_token_mass(s.patterns)


def _max_attention(s: ScoreInput) -> Any:
    from headscope.analysis.head_summary import max_attention

    return max_attention(s.patterns)


def _row_statistic(name: str) -> Compute:
    def compute(s: ScoreInput) -> Any:
        from headscope.analysis.statistics_scores import row_mean_from_statistics

        return row_mean_from_statistics(s.stats, name)

    return compute


def _detector(kind: str) -> tuple[Compute, Compute]:
    def of_run(s: ScoreInput) -> Any:
        from headscope.analysis.head_summary import detection_score

        return detection_score(s.patterns, s.token_ids, kind)

    def of_statistics(s: ScoreInput) -> Any:
        from headscope.analysis.statistics_scores import detector_from_statistics

        return detector_from_statistics(s.stats, kind)

    return of_run, of_statistics


def _streaming(s: ScoreInput) -> Any:
    from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW, streaming_score

    return streaming_score(s.patterns, sink=DEFAULT_SINK if s.sink is None else s.sink,
                           window=DEFAULT_WINDOW if s.window is None else s.window, layer_windows=s.windows)


def _streaming_statistics(s: ScoreInput) -> Any:
    from headscope.analysis.statistics_scores import streaming_from_statistics

    return streaming_from_statistics(s.stats, s.sink, s.window)


def _spans(s: ScoreInput) -> tuple[tuple[int, int], tuple[int, int]]:
    if not (s.question_span and s.evidence_span):
        raise InputError("The evidence score needs a question span and an evidence span: it is computed on the "
                         "prompts of a needle-in-a-haystack sweep (the Heads page, headscope scan).")
    return tuple(s.question_span), tuple(s.evidence_span)  # type: ignore[return-value]


def _evidence(s: ScoreInput) -> Any:
    from headscope.analysis.evidence import evidence_score

    return evidence_score(s.patterns, *_spans(s))


def _evidence_statistics(s: ScoreInput) -> Any:
    from headscope.analysis.statistics_scores import evidence_span_from_statistics

    return evidence_span_from_statistics(s.stats, *_spans(s))


def _copy_suppression(s: ScoreInput) -> Any:
    from headscope.analysis.copy_suppression import copy_suppression

    if s.model is None:
        raise InputError("Copy suppression needs the model: give model= (a run's scores load the run's own).")
    return copy_suppression(s.model, s.token_ids)


_duplicate, _duplicate_statistics = _detector("duplicate_token")
_induction, _induction_statistics = _detector("induction")
_PATTERNS = frozenset({"patterns"})

HEAD_SCORES: dict[str, HeadScore] = {s.name: s for s in [
    HeadScore("entropy", "Normalised entropy", "Mean row entropy / log(visible keys): 0 = one key, 1 = uniform.",
              _PATTERNS, _entropy, _entropy_statistics, windowed="normalised by the keys the window leaves visible",
              rounding="entropy"),
    HeadScore("first_token", "Attention on first token", "Mean attention on position 0 (sink share).",
              _PATTERNS, _first_token, _first_token_statistics,
              windowed="averaged over the queries the window lets see position 0", rounding="sublinear"),
    HeadScore("mid_sink", "Mid-sequence sink",
              "Largest mean attention received by any key after position 0 (a mid-sequence sink).",
              _PATTERNS, _mid_sink, _mid_sink_statistics,
              windowed="each key averaged over the queries that see it; blank: a window of 16 keys or fewer checks "
                       "none", rounding="sublinear"),
    HeadScore("previous_token", "Previous-token attention", "Mean attention from token i to token i-1.",
              _PATTERNS, _previous_token, _row_statistic("prev"), rounding="sublinear"),
    HeadScore("duplicate_token", "Duplicate-token score",
              "Share of attention on earlier copies of the current token (TransformerLens head_detector).",
              _PATTERNS, _duplicate, _duplicate_statistics, rounding="ratio"),
    HeadScore("induction", "Induction score",
              "Share of attention on the token after an earlier copy of the current token "
              "(TransformerLens head_detector; needs repeated text to fire).",
              _PATTERNS, _induction, _induction_statistics, rounding="ratio"),
    HeadScore("max_attention", "Max attention", "Mean of each row's largest weight.",
              _PATTERNS, _max_attention, _row_statistic("argmax_prob"), rounding="sublinear"),
    HeadScore("streaming", "Streaming score",
              "Share of attention on the first 4 tokens plus the last 64 (DuoAttention's sink + recent window): "
              "high = streaming head, low = needs full context.",
              _PATTERNS, _streaming, _streaming_statistics,
              windowed="scored only on rows from S+W until the window binds (they still see every key), so "
                       "locality the model forces is not counted; blank: the window binds before row S+W",
              rounding="sublinear", kv_ranking=KVRanking("Streaming score (group max of 1 − score)", invert=True)),
    HeadScore("evidence", "Evidence score (question → needle)",
              "Attention mass from the question's tokens onto the needle, averaged over question tokens.",
              frozenset({"patterns", "spans"}), _evidence, _evidence_statistics,
              rounding="sublinear", kv_ranking=KVRanking("Evidence score (group max)"), mass_curve=True),
    HeadScore("copy_suppression", "Copy suppression",
              "How much the head's output lowers the logits of the tokens it attends to (McDougall et al. 2023), "
              "in logits: positive = it suppresses them, negative = it copies them.",
              frozenset({"model"}), _copy_suppression, signed=True, rounding="exact",
              kv_ranking=KVRanking("Copy suppression (group max)"), max_tokens="HEADSCOPE_MAX_TOKENS"),
]}
"""Every per-head score, in menu order."""

RUN_SCORES = tuple(name for name, s in HEAD_SCORES.items() if "spans" not in s.needs)
"""Scores of one text (the Attention page's metrics, the Ablation page's rankings by a score of the text)."""
PATTERN_SCORES = tuple(name for name, s in HEAD_SCORES.items() if s.needs == _PATTERNS)
"""Scores computed from a run's attention patterns alone."""
STATISTICS_SCORES = tuple(name for name in RUN_SCORES if HEAD_SCORES[name].of_statistics is not None)
"""Scores of one text that statistics mode gives at any length."""
KV_SCORES = tuple(name for name, s in HEAD_SCORES.items() if s.kv_ranking is not None)
"""Scores that rank KV groups for compression (:mod:`headscope.analysis.kv_compression`)."""
HEAD_METRICS = {name: HEAD_SCORES[name] for name in PATTERN_SCORES}
"""The scores computed from a run's patterns alone, by name: ``HEAD_METRICS["induction"].compute(run.patterns,
run.token_ids)`` (the notebook API's ``hs.HEAD_METRICS``)."""


# --- scoring a run ------------------------------------------------------------------------------------------


def head_score(name: Any, word: str = "score") -> HeadScore:
    """The score named ``name``; an ``InputError`` ("Unknown ``word`` ...") naming those of one text otherwise."""
    score = HEAD_SCORES.get(name) if isinstance(name, str) else None
    if score is None:
        raise InputError(f"Unknown {word} {str(name)[:40]!r}; choose one of: {', '.join(RUN_SCORES)}.")
    return score


def unavailable(score: HeadScore, run: Any) -> str | None:
    """Why ``run`` (an :class:`headscope.analysis.runs.AttentionRun`) cannot give ``score``, as a sentence
    without its full stop; None when it can."""
    if "spans" in score.needs:
        return (f"{score.label} needs a question span and an evidence span: it is computed over the prompts of a "
                "needle-in-a-haystack sweep (the Heads page, headscope scan)")
    if not run.has_patterns and score.of_statistics is None and "patterns" in score.needs:
        return f"{score.label} needs full attention patterns, which a {run.n_tokens:,}-token run does not keep"
    if score.max_tokens:
        from headscope.analysis.limits import limit

        most = limit(score.max_tokens)
        if run.n_tokens > most:
            return (f"{score.label} runs the model with full attention, on texts of at most {most:,} tokens "
                    f"({score.max_tokens}); this run has {run.n_tokens:,}")
    return None


def run_metrics(run: Any) -> tuple[str, ...]:
    """The names of :data:`RUN_SCORES` that ``run`` can give (:attr:`headscope.analysis.runs.AttentionRun.metrics`)."""
    return tuple(name for name in RUN_SCORES if unavailable(HEAD_SCORES[name], run) is None)


def model_of(run: Any) -> Any:
    """The model ``run`` was made with, loaded (memoised per process); an ``InputError`` when the
    weights loaded under its name are not the ones that made it."""
    from headscope.analysis.models import load_model

    model = load_model(run.model_name)
    if model.digest != run.model_digest:
        raise InputError(f"This run was made with other weights than the {run.model_name} loaded now (their digests "
                         "differ): run the text again.")
    return model


def score_run(run: Any, name: Any, model: Any = None, *, word: str = "score") -> Any:
    """``[layer, head]`` score ``name`` of ``run``: from its patterns, from its statistics (statistics
    mode), or from its ids and ``model`` (default: the run's own, :func:`model_of`) for a score that
    needs the model. An ``InputError`` says why a run cannot give it (:func:`unavailable`)."""
    score = head_score(name, word)
    why = unavailable(score, run)
    if why:
        raise InputError(why + ".")
    given = ScoreInput(token_ids=list(run.token_ids), windows=run.layer_windows)
    if not run.has_patterns and score.of_statistics is not None:
        return score.of_statistics(replace(given, stats=run))
    if run.has_patterns:
        given = replace(given, patterns=run.patterns)
    if "model" in score.needs:
        given = replace(given, model=model if model is not None else model_of(run))
    return score.of_run(given)

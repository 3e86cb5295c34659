"""Two stored runs, head by head: the difference of a per-head score, and of one head's attention.

What changes between two prompts on one model (a clean and a corrupted prompt, a name swapped, a
fact changed), or between two models on one prompt (a base model and its fine-tune, which share a
tokenizer)? Activation patching (:mod:`headscope.analysis.patching`) says which heads *cause* a change in the
output; this says where each head's *behaviour* changes. Every difference is **second − first**.

Both runs must have the same number of tokens, so that position ``i`` is one position in both (as
activation patching needs, Heimersheim & Nanda 2024, §2), and models of the same shape (layers ×
query heads). Two different models must also have tokenized the text alike (equal token ids): the
same text under two tokenizers gives positions that do not correspond. The per-head score is any
score of one text (:data:`headscope.analysis.score_registry.RUN_SCORES`) both runs can compute (full patterns or statistics mode,
:class:`headscope.analysis.runs.AttentionRun`); a head's attention difference is ``A₂[l, h] − A₁[l, h]``, of the
patterns, or of the block means when both runs kept pooled maps of the same block size.

**Resolution.** A run keeps its patterns as float16 (or float32) and a long run its statistics as
float32, so each stored weight ``Â`` stands for any weight within half a spacing of it:
``|A − Â| ≤ u(Â) = spacing(Â) / 2`` (``2^-11 Â`` for a float16 weight, ``2^-25`` for one stored as 0;
future keys and keys outside a model's window are exactly 0). :func:`score_resolution` bounds how far
a score can move over those intervals, and a change second − first within the sum of both runs'
bounds is indistinguishable from rounding (:attr:`RunComparison.within_rounding`). The bound, per kind
of score (each score's ``rounding`` in the registry, :data:`headscope.analysis.score_registry.ROUNDINGS`):

- scores that are means of weights, or of row maxima or column means (first-token, previous-token,
  max attention, mid-sequence sink, streaming): the score is monotone and subadditive in the weights,
  so ``|f(A) − f(Â)| ≤ f(u)``, the same score of the half-spacings (reached when every weight sits at
  the top of its interval);
- TransformerLens' detector scores ``R = Σ A·D / Σ A`` (duplicate-token, induction):
  ``|ΔR| ≤ Σu · (f(u) + R) / (Σ Â − Σu)``;
- normalised entropy: ``|ΔH_i| ≤ Σ_j max_{|x − Â_ij| ≤ u_ij} |φ(x) − φ(Â_ij)|`` with ``φ(x) = −x log x``
  (the largest change of each term over its interval: at an end, or at 1/e where φ peaks), averaged
  like the score (:func:`headscope.analysis.entropy.mean_normalised_entropy`);
- a statistics run: its scores are means of float32 row statistics, ``2^-24 |score|``;
- a score computed afresh from the model (``exact``): storage rounds nothing, 0.

This is a bound on storage rounding only, not on the model's own float32 arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.runs import AttentionRun
from headscope.analysis.score_registry import head_score

TWO_PROMPTS = "two prompts on one model"
TWO_MODELS = "one prompt on two models"
ONE_TEXT = "one text on one model"  # the same tokens on the same model: a rerun, or other settings
SAME_RUN = "one run with itself"


@dataclass(frozen=True)
class HeadChange:
    """One head's score in both runs, its change (second − first) and how far rounding alone can
    move that change (:attr:`RunComparison.resolution`)."""

    layer: int
    head: int
    first: float
    second: float
    resolution: float = 0.0

    @property
    def change(self) -> float:
        return self.second - self.first

    @property
    def within_rounding(self) -> bool:
        """Whether the change is no larger than rounding alone can make it (its sign too)."""
        return abs(self.change) <= self.resolution


@dataclass(frozen=True)
class RunComparison:
    """A per-head score of two runs (``[layer, head]`` each) and where their tokens differ."""

    first: AttentionRun
    second: AttentionRun
    metric: str
    first_scores: np.ndarray
    second_scores: np.ndarray
    differ: tuple[int, ...]  # positions whose token ids differ
    kind: str  # TWO_PROMPTS, TWO_MODELS, ONE_TEXT or SAME_RUN
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def difference(self) -> np.ndarray:
        """``[layer, head]`` second − first (nan where either score is nan)."""
        return self.second_scores - self.first_scores

    @property
    def resolution(self) -> np.ndarray:
        """``[layer, head]`` how far the change can be from the change of the unrounded attention: the
        sum of both runs' :func:`score_resolution` (each run's score may be off by its own)."""
        if "resolution" not in self._memo:
            self._memo["resolution"] = (score_resolution(self.first, self.metric)
                                        + score_resolution(self.second, self.metric))
        return self._memo["resolution"]

    @property
    def within_rounding(self) -> np.ndarray:
        """``[layer, head]`` True where ``|change| ≤ resolution``: its size, and even its sign, may be
        rounding alone (False where a score is nan)."""
        with np.errstate(invalid="ignore"):
            return np.abs(self.difference) <= self.resolution

    @property
    def stored(self) -> str:
        """What the scores were computed from, as stored: "float16 patterns", "float32 statistics", …
        (both runs', joined with "and" when they differ)."""
        kinds = dict.fromkeys(stored_precision(run) for run in (self.first, self.second))
        return " and ".join(kinds)

    def largest_changes(self, k: int = 10) -> list[HeadChange]:
        """The ``k`` heads whose score changed most (by absolute change; heads with a nan score last)."""
        diff = self.difference
        order = np.argsort(-np.nan_to_num(np.abs(diff), nan=-1.0), axis=None, kind="stable")[:k]
        return [HeadChange(int(i // diff.shape[1]), int(i % diff.shape[1]), float(self.first_scores.flat[i]),
                           float(self.second_scores.flat[i]), float(self.resolution.flat[i])) for i in order]


def _comparable(first: AttentionRun, second: AttentionRun) -> tuple[tuple[int, ...], str]:
    if (first.n_layers, first.n_heads) != (second.n_layers, second.n_heads):
        raise InputError(f"The runs' models differ in shape ({first.n_layers} layers × {first.n_heads} heads against "
                         f"{second.n_layers} × {second.n_heads}): their heads do not correspond.")
    if first.n_tokens != second.n_tokens:
        raise InputError(f"The runs have {first.n_tokens} and {second.n_tokens} tokens: compare runs of equal "
                         "length, so that each position is the same position in both (pad or shorten one text).")
    differ = tuple(int(i) for i in np.flatnonzero(np.asarray(first.token_ids) != np.asarray(second.token_ids)))
    same_model = first.model_digest == second.model_digest
    if not same_model and differ:
        raise InputError(f"The runs come from two models ({first.model_name}, {second.model_name}) and their tokens "
                         f"differ at {len(differ)} position(s): compare one text on two models that share a "
                         "tokenizer, or two texts on one model.")
    kind = (TWO_PROMPTS if differ else ONE_TEXT) if same_model else TWO_MODELS
    return differ, kind


def compare_runs(first: AttentionRun, second: AttentionRun, metric: str) -> RunComparison:
    """Per-head ``metric`` of both runs and its change; an ``InputError`` when the runs do not
    correspond position by position and head by head (see the module docstring) or a run cannot
    compute ``metric``."""
    differ, kind = _comparable(first, second)
    common = [m for m in first.metrics if m in second.metrics]
    for name, run in (("first", first), ("second", second)):
        if metric not in run.metrics:
            raise InputError(f"The {name} run ({run.mode}) cannot compute {metric!r}; "
                             + (f"choose one of: {', '.join(common)}." if common else
                                "no per-head score is computable on both runs."))
    if first.key == second.key:
        kind = SAME_RUN
    return RunComparison(first, second, metric, np.asarray(first.head_scores(metric), dtype=float),
                         np.asarray(second.head_scores(metric), dtype=float), differ, kind)


def attention_difference(first: AttentionRun, second: AttentionRun, layer: int, head: int) -> np.ndarray:
    """``A₂[l, h] − A₁[l, h]`` (float32): of the full patterns, or of the means per ``B × B`` block when
    both runs kept pooled maps of the same block size ``B``. Future keys are 0 in both runs, so 0 above
    the diagonal (figures blank them)."""
    _comparable(first, second)
    layer, head = check_head_index(first.n_layers, first.n_heads, layer, head)
    if first.block_size != second.block_size:
        raise InputError(f"One run keeps {first.mode} (blocks of {first.block_size}) and the other {second.mode} "
                         f"(blocks of {second.block_size}): their attention maps do not align. Run both in the "
                         "same mode.")
    return (np.asarray(second.attention_overview(layer, head), dtype=np.float32)
            - np.asarray(first.attention_overview(layer, head), dtype=np.float32))


FLOAT32_ROUNDING = 2.0**-24  # half a float32 spacing, relative: the rounding of a statistics run's values


def stored_precision(run: AttentionRun) -> str:
    """The dtype of what ``run``'s scores are computed from, in words ("float16 patterns")."""
    if run.has_patterns:
        return f"{np.asarray(run.patterns).dtype} patterns"
    return "float32 statistics"


def _visible(n: int, window: int | None) -> np.ndarray:
    """``[n, n]`` True where query i sees key j: ``j ≤ i`` and, on a windowed layer, ``i − j < W``."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) & ((i - j < window) if window else True)


def _entropy_term_change(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``max_{|x − a| ≤ u, x ≥ 0} |φ(x) − φ(a)|`` with ``φ(x) = −x log x``, per weight (float64): φ is
    concave with its peak at 1/e, so the largest change is at an end of the interval or at 1/e."""
    a = np.asarray(weights, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)

    def phi(x):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x > 0, -x * np.log(np.where(x > 0, x, 1.0)), 0.0)

    lo, hi = np.clip(a - u, 0, None), a + u
    peak = np.clip(1 / np.e, lo, hi)
    base = phi(a)
    return np.maximum(np.maximum(np.abs(phi(lo) - base), np.abs(phi(hi) - base)), np.abs(phi(peak) - base))


@functools.cache
def _float16_tables() -> tuple[np.ndarray, np.ndarray]:
    """For each of the 65,536 float16 values, by its bits: its half-spacing ``u`` (float32; 2^-25 for
    0) and its entropy term's largest change over its interval (float64), read by table lookup."""
    values = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    with np.errstate(all="ignore"):  # inf and nan bit patterns give nan: no weight is stored so
        u = np.spacing(np.abs(values)).astype(np.float64) / 2
        return u.astype(np.float32), _entropy_term_change(values.astype(np.float64), u)


def _half_spacings(weights: np.ndarray) -> np.ndarray:
    """``u = spacing(|Â|) / 2`` of each stored weight, in the dtype it was stored in. A key a query
    cannot see holds exactly 0 and gets the u of a stored 0 too: a bound only widens by it."""
    if weights.dtype == np.float16:
        return _float16_tables()[0][np.ascontiguousarray(weights).view(np.uint16)]
    return np.spacing(np.abs(weights)).astype(np.float64) / 2


def _entropy_row_change(weights: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """``[head, n]`` bound on each row's entropy change: the sum of its visible weights' term changes.
    Keys a query cannot see hold exactly 0 and are not rounded: their terms (those of a stored 0) are
    taken back out of the row's sum."""
    if weights.dtype == np.float16:
        table = _float16_tables()[1]
        rows, zero = table[np.ascontiguousarray(weights).view(np.uint16)].sum(-1), table[0]
    else:
        rows = _entropy_term_change(weights, _half_spacings(weights)).sum(-1)
        zero = float(_entropy_term_change(np.zeros(1), _half_spacings(np.zeros(1, weights.dtype)))[0])
    return np.clip(rows - (weights.shape[-1] - visible.sum(-1)) * zero, 0, None)


def score_resolution(run: AttentionRun, metric: str) -> np.ndarray:
    """``[layer, head]`` bound on how far ``run``'s score ``metric`` can be from the same score of the
    attention before it was rounded to the stored dtype (the module docstring gives the bound per score).

    Parameters
    ----------
    run : a stored run (float16 or float32 patterns, or float32 statistics).
    metric : a score the run can compute (:attr:`headscope.analysis.runs.AttentionRun.metrics`).

    Returns
    -------
    ``[layer, head]`` float64 ≥ 0; nan where the score is nan.
    """
    from headscope.analysis.entropy import mean_normalised_entropy

    kind = head_score(metric, "metric")
    score = np.asarray(run.head_scores(metric), dtype=np.float64)
    if kind.rounding is None:  # a score declared without a bound: tests/analysis fails on it
        raise NotImplementedError(f"no rounding bound for the score {metric!r}")
    if kind.rounding == "exact":
        return np.where(np.isfinite(score), 0.0, np.nan)
    if not run.has_patterns:
        return FLOAT32_ROUNDING * np.abs(score)
    patterns, compute = run.patterns, kind.compute
    n_layers, n_heads, n, _ = patterns.shape
    windows: Sequence[int | None] = run.layer_windows or [None] * n_layers
    out = np.empty((n_layers, n_heads), dtype=np.float64)
    for layer in range(n_layers):  # one layer's half-spacings at a time: [head, n, n]
        weights = np.asarray(patterns[layer])
        one = [windows[layer]] if run.layer_windows else None
        if kind.rounding == "entropy":
            rows = _entropy_row_change(weights, _visible(n, windows[layer]))  # [head, n]
            out[layer] = mean_normalised_entropy(rows[None], one)[0]
            continue
        u = _half_spacings(weights)
        if kind.rounding == "sublinear":
            out[layer] = compute(u[None], run.token_ids, one)[0]
        else:  # "ratio"
            total_u = u.sum((-1, -2), dtype=np.float64)
            total = np.asarray(weights, dtype=np.float64).sum((-1, -2))
            with np.errstate(divide="ignore", invalid="ignore"):
                out[layer] = total_u * (compute(u[None], run.token_ids, one)[0] + score[layer]) / (total - total_u)
    return np.where(np.isfinite(score), out, np.nan)


def shown_decimals(resolution: np.ndarray | float, most: int = 4) -> np.ndarray:
    """Decimals to print a number whose resolution is ``resolution``: the last printed digit is no finer
    than the resolution (``floor(−log10 r)``), between 1 and ``most``."""
    r = np.asarray(resolution, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        digits = np.floor(-np.log10(np.where(r > 0, r, np.inf)))
    return np.clip(np.where(np.isfinite(digits), digits, most), 1, most).astype(int)

"""Top-k ablation curves: ablate the k heads a score ranks highest, against k random heads.

The retrieval-head paper's test (Wu et al. 2024, "Retrieval Head Mechanistically Explains
Long-Context Factuality", arXiv:2404.15574, §4): masking the top retrieval heads breaks
needle-in-a-haystack retrieval, masking as many random heads does not. For each k,

    top(k)    = metric(model with order[:k] ablated),        order = heads by descending score
    random(k) = metric(model with k heads drawn from outside order[:N] ablated), one draw per seed

with N = max(``outside_top``, largest k) (:data:`~headscope.analysis.ablation_choices.CONTROL_TOP_N` by
default). The metric is the mean next-token loss on a run (:func:`headscope.analysis.ablation.loss_metric_fn`)
or the NIAH accuracy on a retrieval sweep's prompts (:func:`retrieval_accuracy`).

:func:`ablation_curve` is the user action (the page's "Run curve", ``headscope ablate --curve``):
it owns the store key, reuses every metric value already measured for the same head set, and takes
``progress`` and ``cancel``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headscope.analysis.ablation import (
    ABLATION_VERSION,
    AblationSpec,
    Cancel,
    Head,
    Hook,
    MetricFn,
    Progress,
    _spec_template,
    ablation_hooks,
    greedy_continuation,
    loss_metric_fn,
)
from headscope.analysis.ablation_choices import CONTROL_TOP_N, CURVE_METRICS, MAX_SEEDS
from headscope.analysis.capture import Run
from headscope.analysis.errors import InputError
from headscope.analysis.intervals import Proportion, SeedBand, from_accuracy, seed_band, wilson
from headscope.analysis.long_context_tasks import NEEDLE_MAX_NEW_TOKENS, max_new_tokens_for, task_of
from headscope.analysis.models import LoadedModel
from headscope.analysis.niah import NiahPrompt
from headscope.analysis.retrieval import (
    ROUGE_GATE,
    Cancelled,
    RetrievalSweep,
    cancel_requested,
    rouge1_recall,
    stop_ids,
    trial_prompt,
)
from headscope.analysis.statistics_run import StatsRun
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record


@dataclass
class TopkCurve:
    """Metric after ablating the top-k heads by a score, against k random heads.

    Attributes
    ----------
    k_values : the k of each column.
    top : ``[k]`` metric with the k highest-scoring heads ablated.
    random : ``[seed, k]`` metric with k random heads, drawn from outside the top ``outside_top``,
        ablated.
    random_mean, random_std : over seeds (``std`` with ddof 0; 0 for one seed).
    order : the heads ranked by score, best first (the first K are the ones ablated by ``top``).
    outside_top : the random control's heads come from outside ``order[:outside_top]``; None in
        curves stored before this was a setting, where it was the largest k.
    n_prompts : the needle-in-a-haystack prompts each value is the accuracy on (one per trial of the
        sweep); None when the metric is a loss.
    Entries not reached before a cancel are nan; ``complete`` says whether all were.
    """

    k_values: list[int]
    top: np.ndarray
    random: np.ndarray
    seeds: list[int]
    order: list[Head]
    method: str
    complete: bool
    outside_top: int | None = None
    n_prompts: int | None = None

    def top_accuracy(self) -> list[Proportion]:
        """Per k, the top-k accuracy as answered of ``n_prompts`` with its 95 % Wilson interval
        (:mod:`headscope.analysis.intervals`); empty for a loss curve."""
        if self.n_prompts is None:
            return []
        return [from_accuracy(float(v), self.n_prompts) for v in self.top]

    def random_pooled(self) -> list[Proportion]:
        """Per k, the random control's prompts of every seed that reached k pooled: ``Σ answered`` of
        ``seeds × n_prompts``, with its Wilson interval (the seeds share their prompts, so this is the
        prompts' spread; :meth:`random_band` is the draws'). Empty for a loss curve."""
        if self.n_prompts is None:
            return []
        out = []
        for j in range(len(self.k_values)):
            column = self.random[:, j] if self.random.size else np.zeros(0)
            done = column[np.isfinite(column)]
            out.append(from_accuracy(float(done.mean()) if done.size else float("nan"), self.n_prompts * done.size))
        return out

    def random_band(self) -> list[SeedBand]:
        """Per k, the random control's seed band: mean, lowest and highest seed's value."""
        return [seed_band(self.random[:, j] if self.random.size else []) for j in range(len(self.k_values))]

    @property
    def random_mean(self) -> np.ndarray:
        with np.errstate(all="ignore"):
            return (
                np.nanmean(self.random, axis=0) if self.random.size else np.full(len(self.k_values), np.nan)
            )

    @property
    def random_std(self) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.nanstd(self.random, axis=0) if self.random.size else np.full(len(self.k_values), np.nan)


def rank_heads(scores: np.ndarray) -> list[Head]:
    """Heads with a finite score, highest first; ties keep (layer, head) order."""
    scores = np.asarray(scores, dtype=np.float64)
    flat = scores.reshape(-1)
    keep = np.flatnonzero(np.isfinite(flat))
    order = keep[np.argsort(-flat[keep], kind="stable")]
    n_heads = scores.shape[1]
    return [(int(i // n_heads), int(i % n_heads)) for i in order]


MAX_SEED = 2**32 - 1


def random_control(scores: np.ndarray, k: int, seed: int, outside_top: int = CONTROL_TOP_N) -> list[Head]:
    """k random heads from outside the top N by ``scores``: the random control of a top-k curve, and
    what the Ablation page's "Random k" draws (both call this, so the same seed, k and N give the
    same heads).

    N = max(``outside_top``, k); the top N are :func:`rank_heads`' first N (heads without a finite
    score are never in the top, so they can be drawn). The draw is the first k of a permutation of
    the remaining heads, in (layer, head) order, by ``numpy.random.default_rng(seed)``: for one seed
    and one N the sets are nested across k, as the curve's are.

    Parameters
    ----------
    scores : ``[layer, head]`` the score heads are ranked by.
    k : how many heads, 1 ≤ k ≤ the heads outside the top N.
    seed : 0 ≤ seed ≤ :data:`MAX_SEED`.
    outside_top : N above (≥ 0; :data:`~headscope.analysis.ablation_choices.CONTROL_TOP_N` by default).

    Returns
    -------
    The k heads ``(layer, head)``, in the order drawn.

    Raises
    ------
    InputError
        k, N or the seed out of range, or fewer than k heads outside the top N.
    """
    scores = np.asarray(scores, dtype=np.float64)
    n_heads = scores.size
    k, outside_top, seed = _whole(k, "k"), _whole(outside_top, "The random control's top-N"), _whole(seed, "The seed")
    if not 1 <= k <= n_heads:
        raise InputError(f"k must be between 1 and {n_heads} (the heads of the model), got {k}.")
    if outside_top < 0:
        raise InputError(f"The random control's top-N must be at least 0, got {outside_top}.")
    if not 0 <= seed <= MAX_SEED:
        raise InputError(f"The seed must be between 0 and {MAX_SEED:,}, got {seed}.")
    n_out = max(outside_top, k)
    top = set(rank_heads(scores)[:n_out])
    pool = [(layer, h) for layer in range(scores.shape[0]) for h in range(scores.shape[1]) if (layer, h) not in top]
    if k > len(pool):
        ranked = len(rank_heads(scores))  # the heads that can be in a top
        most = max((j for j in range(k) if j <= n_heads - min(max(outside_top, j), ranked)), default=0)
        advice = f"use k up to {most}, or a smaller top-N for the control" if most else "use a smaller top-N for the control"
        raise InputError(f"The random control draws {k} heads from outside the top {n_out} by the score, but only "
                         f"{len(pool)} remain: {advice}.")
    return [pool[i] for i in np.random.default_rng(seed).permutation(len(pool))[:k]]


def _whole(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InputError(f"{what} must be a whole number, got {value!r}.")
    return int(value)


def topk_curve(
    model: LoadedModel,
    scores: np.ndarray,
    k_values: Sequence[int],
    metric_fn: MetricFn,
    method: str | AblationSpec = "zero",
    random_seeds: Sequence[int] = (0, 1, 2, 3, 4),
    *,
    outside_top: int | None = None,
    known: MutableMapping[tuple[Head, ...], float] | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> TopkCurve:
    """Ablate the top-k heads by ``scores`` for each k, and k random heads as the control.

    The retrieval-head paper's test (Wu et al. 2024, section 4, "masking out the top K retrieval
    heads" vs K random heads): if the score finds the heads a behaviour needs, the metric moves
    much more with the top k than with k random heads.

    - top: ``metric_fn(model, hooks(order[:k]))`` for each k, ``order`` = heads by descending score
      (nan scores are never in the top).
    - random: for each seed, :func:`random_control` with N = max(``outside_top``, max(k_values)): the
      first k of a permutation of the heads *outside* the top N, so the random sets are nested across
      k for one seed (the page's "Random k" draws the same way). Outside only the top k, the control would ablate heads ranked just below k, high-scoring
      heads that can break the model on their own (early layers under uniform ablation do), and
      would no longer be a control; the paper's control draws from outside its top heads.

    Parameters
    ----------
    scores : ``[layer, head]`` any head score (retrieval, streaming, a sweep's effect...).
    k_values : the k to evaluate (0 gives the clean metric).
    metric_fn : ``metric_fn(model, hooks) → float``: runs the model with the given forward hooks
        active (e.g. :func:`loss_metric_fn`, or a retrieval accuracy that generates under
        ``model.bridge.hooks(hooks)``).
    method : a method name or an :class:`AblationSpec` template (its options are used).
    random_seeds : one random curve per seed; empty for none.
    outside_top : N above (default: the largest k, the rule of curves stored before it was a
        setting; :func:`ablation_curve` passes :data:`~headscope.analysis.ablation_choices.CONTROL_TOP_N`).
    known : metric values by ablated head set (sorted tuple), read before and written after each
        evaluation, e.g. a :class:`StoredValues`: a cancelled curve run again resumes where it stopped.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != (model.n_layers, model.n_heads):
        raise InputError(
            f"scores must have shape [layer, head] = {(model.n_layers, model.n_heads)}, got {scores.shape}."
        )
    ks = [int(k) for k in k_values]
    if not ks:
        raise InputError("Give at least one k.")
    order = rank_heads(scores)
    k_max = max(ks)
    if min(ks) < 0 or k_max > len(order):
        raise InputError(f"k must be between 0 and {len(order)} (the heads with a finite score); got {ks}.")
    n_out = max(k_max, int(outside_top) if outside_top is not None else k_max)
    if n_out < 0:
        raise InputError(f"The random control's top-N must be at least 0, got {outside_top}.")
    seeds = [int(s) for s in random_seeds]
    template = _spec_template(method)
    template.with_heads(order[:k_max]).validate(model)
    top = np.full(len(ks), np.nan)
    rand = np.full((len(seeds), len(ks)), np.nan)
    jobs: list[tuple[int | None, int, list[Head]]] = [(None, j, order[:k]) for j, k in enumerate(ks)]
    for s_i, seed in enumerate(seeds):  # the control's sets, all drawn (and checked) before any work
        jobs += [(s_i, j, random_control(scores, k, seed, n_out) if k else []) for j, k in enumerate(ks)]
    cache: MutableMapping[tuple[Head, ...], float] = known if known is not None else {}
    complete = True
    for done, (s_i, j, heads) in enumerate(jobs):
        if cancel_requested(cancel):
            complete = False
            break
        key = tuple(sorted(heads))
        if key not in cache:
            hooks = ablation_hooks(model, template.with_heads(heads))
            with model.lock:
                cache[key] = float(metric_fn(model, hooks))
        if s_i is None:
            top[j] = cache[key]
        else:
            rand[s_i, j] = cache[key]
        if progress:
            progress((done + 1) / len(jobs))
    return TopkCurve(ks, top, rand, seeds, order, template.method, complete,
                     n_out if outside_top is not None else None, getattr(metric_fn, "n_prompts", None))


# ---------------------------------------------------------------------------------------------
# Retrieval accuracy under an ablation


@dataclass
class RetrievalAccuracy:
    """Needle-in-a-haystack accuracy of a (possibly ablated) model: ``accuracy`` is the share of
    prompts whose greedy response recalls the answer (ROUGE-1 recall > 0.5, the gate of
    :mod:`headscope.analysis.retrieval`)."""

    accuracy: float
    recalls: list[float]
    responses: list[str]

    @property
    def n(self) -> int:
        """The prompts the accuracy is measured on."""
        return len(self.recalls)

    @property
    def answered(self) -> int:
        """The prompts answered (ROUGE-1 recall > 0.5)."""
        return sum(r > ROUGE_GATE for r in self.recalls)

    def proportion(self) -> Proportion:
        """``answered`` of ``n`` with its 95 % Wilson interval."""
        return wilson(self.answered, self.n)


def retrieval_accuracy(
    model: LoadedModel,
    prompts: Sequence[NiahPrompt],
    hooks: Sequence[Hook] = (),
    *,
    max_new_tokens: int = NEEDLE_MAX_NEW_TOKENS,
    cancel: Cancel | None = None,
    continuation: Callable[[Sequence[int], int], list[int]] | None = None,
) -> RetrievalAccuracy:
    """Greedy-decode every prompt with ``hooks`` active and score its answer (Wu et al. 2024, §4:
    masking retrieval heads breaks needle-in-a-haystack retrieval). ``continuation(ids, max_new_tokens)``
    decodes instead of :func:`headscope.analysis.ablation.greedy_continuation` (the KV-cache policy
    backend's own decoding), scored the same way."""
    if not prompts:
        raise InputError("No needle-in-a-haystack prompts to measure retrieval accuracy on.")
    stops = stop_ids(model)
    recalls, responses = [], []
    for prompt in prompts:
        if cancel_requested(cancel):
            raise Cancelled("cancelled")
        if continuation is not None:
            out = continuation(prompt.token_ids, max_new_tokens)
        else:
            out = greedy_continuation(model, prompt.token_ids, hooks, max_new_tokens)
        text = model.tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=True)
        responses.append(text)
        recalls.append(rouge1_recall(prompt.needle.answer, text))
    return RetrievalAccuracy(float(np.mean([r > ROUGE_GATE for r in recalls])), recalls, responses)


def retrieval_accuracy_fn(prompts: Sequence[NiahPrompt],
                          max_new_tokens: int | None = NEEDLE_MAX_NEW_TOKENS) -> MetricFn:
    """A ``metric_fn(model, hooks)`` for :func:`topk_curve`: NIAH accuracy on ``prompts``, each decoded for
    ``max_new_tokens`` or, with None, for its own task's answer length (:func:`decode_lengths`, as a task
    sweep decodes its trials)."""
    prompts = list(prompts)
    if not prompts:
        raise InputError("No needle-in-a-haystack prompts to measure retrieval accuracy on.")
    steps = decode_lengths(prompts) if max_new_tokens is None else [max_new_tokens] * len(prompts)

    def metric_fn(m: LoadedModel, hooks: list[Hook]) -> float:
        if len(set(steps)) == 1:
            return retrieval_accuracy(m, prompts, hooks, max_new_tokens=steps[0]).accuracy
        # the share of answered prompts, each decoded for its own length
        return float(np.mean([retrieval_accuracy(m, [p], hooks, max_new_tokens=n).accuracy
                              for p, n in zip(prompts, steps, strict=True)]))

    metric_fn.n_prompts = len(prompts)  # type: ignore[attr-defined]  # the n of every value (TopkCurve)
    return metric_fn


# ---------------------------------------------------------------------------------------------
# Stored results


class StoredValues(MutableMapping):
    """Metric values by ablated head set, kept in the store under a scope (the model, the metric's
    subject and the ablation method), so finished evaluations survive a cancel or a crash."""

    def __init__(self, store: Store, scope: Any) -> None:
        self.store, self.scope = store, content_key("ablation_values", ABLATION_VERSION, scope)

    def _key(self, heads: tuple[Head, ...]) -> str:
        return content_key("ablation_value", self.scope, [list(h) for h in heads])

    def __getitem__(self, heads: tuple[Head, ...]) -> float:
        record = stored_record(self.store, self._key(heads), "ablation_value")
        if record is None:
            raise KeyError(heads)
        return float(record.meta["value"])

    def __setitem__(self, heads: tuple[Head, ...], value: float) -> None:
        self.store.put(self._key(heads), "ablation_value", {"value": float(value), "heads": [list(h) for h in heads]}, {})

    def __delitem__(self, heads: tuple[Head, ...]) -> None:
        self.store.remove(self._key(heads))

    def __iter__(self):
        raise TypeError("StoredValues cannot be listed; look values up by head set")

    def __len__(self) -> int:
        raise TypeError("StoredValues cannot be counted")

    def __contains__(self, heads: object) -> bool:
        try:
            self[heads]  # type: ignore[index]
        except KeyError:
            return False
        return True


def save_curve(store: Store, key: str, curve: TopkCurve, meta: dict[str, Any]) -> None:
    """Store a top-k curve (a cancelled, partial curve too: its missing entries are nan)."""
    store.put(key, "ablation_curve", {
        **meta, "k_values": curve.k_values, "seeds": curve.seeds, "order": [list(h) for h in curve.order],
        "method": curve.method, "complete": curve.complete, "version": ABLATION_VERSION,
        **({"random_outside_top": curve.outside_top} if curve.outside_top is not None else {}),
        **({"n_prompts": curve.n_prompts} if curve.n_prompts is not None else {}),
    }, {"top": np.asarray(curve.top, dtype=np.float64), "random": np.asarray(curve.random, dtype=np.float64)})


def load_curve(store: Store, key: str) -> tuple[TopkCurve, dict[str, Any]] | None:
    record = stored_record(store, key, "ablation_curve")
    if record is None:
        return None
    m = record.meta
    curve = TopkCurve(list(m["k_values"]), record.array("top", mmap=False), record.array("random", mmap=False),
                      list(m["seeds"]), [tuple(h) for h in m["order"]], m["method"], bool(m["complete"]),
                      m.get("random_outside_top"), _n_prompts(store, m))
    if curve.n_prompts is not None:  # accuracies: shares of n prompts, or the record is not a curve's
        values = np.concatenate([np.ravel(curve.top), np.ravel(curve.random)]).astype(np.float64)
        done = values[~np.isnan(values)]  # nan: not reached before a cancel
        counts = done * curve.n_prompts
        if np.any(~np.isfinite(done) | (done < 0) | (done > 1)) or np.any(np.abs(counts - np.round(counts)) > 1e-6):
            return None
    return curve, m


def _n_prompts(store: Store, meta: dict[str, Any]) -> int | None:
    """A stored curve's ``n_prompts``; for a NIAH curve stored before curves kept it, the trials of
    the sweep it was measured on (its prompts, one per trial), when that sweep is still stored."""
    n = meta.get("n_prompts")
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_PROMPTS:
        return n
    subject = meta.get("subject")
    if not (isinstance(subject, list) and len(subject) == 2 and subject[0] == "sweep" and isinstance(subject[1], str)):
        return None
    record = stored_record(store, subject[1], "retrieval_sweep")
    keys = record.meta.get("trial_keys") if record is not None else None
    return len(keys) if isinstance(keys, list) and 1 <= len(keys) <= MAX_PROMPTS else None


MAX_PROMPTS = 10**7
"""The most prompts a stored curve's ``n_prompts`` may claim (far above any sweep's trial limit): a
record claiming more, or values that are no share of its n, is not read as a curve."""


def check_curve(model: LoadedModel, k_values: Sequence[int], n_seeds: int, outside_top: int) -> list[int]:
    """Check a curve's k values, seed count and control before any work; return the sorted k.

    0 ≤ k ≤ the model's heads; with random seeds, the largest k must fit outside the control's
    top N = max(``outside_top``, largest k). (Heads without a finite score are checked again by
    :func:`topk_curve`, once the scores are known.)
    """
    ks = sorted({int(k) for k in k_values})
    n_heads = model.n_layers * model.n_heads
    if not ks:
        raise InputError("Give at least one k value.")
    if ks[0] < 0 or ks[-1] > n_heads:
        bad = ks[0] if ks[0] < 0 else ks[-1]
        raise InputError(f"k must be between 0 and {n_heads} (the heads of the model), got {bad}.")
    if not 0 <= int(n_seeds) <= MAX_SEEDS:
        raise InputError(f"The number of random seeds must be between 0 and {MAX_SEEDS}, got {n_seeds}.")
    if int(outside_top) < 0:
        raise InputError(f"The random control's top-N must be at least 0, got {outside_top}.")
    n_out = max(ks[-1], int(outside_top))
    if n_seeds and ks[-1] > n_heads - n_out:
        raise InputError(f"The random control draws {ks[-1]} heads from outside the top {n_out}, but the model has "
                         f"{n_heads} heads: use k up to {max(0, min(n_heads - int(outside_top), n_heads // 2))} "
                         "or a smaller top-N for the control.")
    return ks


def decode_lengths(prompts: Sequence[NiahPrompt]) -> list[int]:
    """Tokens each prompt decodes: its own task's answer length (24 for a needle; a task sweep's trials
    decode as many, :func:`headscope.analysis.task_retrieval.task_sweep`)."""
    return [max_new_tokens_for([p]) for p in prompts]


def _decoded_part(decoded: Sequence[int]) -> list:
    """The key part naming the prompts' decode lengths: none where every prompt decodes a needle's 24, so
    needle curves keep the keys they were stored under."""
    decoded = [int(n) for n in decoded]
    return [decoded] if any(n != NEEDLE_MAX_NEW_TOKENS for n in decoded) else []


def curve_key(model: LoadedModel, subject: tuple[str, str], scores: np.ndarray, ks: Sequence[int],
              seeds: Sequence[int], spec: AblationSpec, source_id: str | None, outside_top: int,
              decoded: Sequence[int] = ()) -> str:
    """The store key of :func:`ablation_curve`: everything the curve's numbers depend on (``decoded``: the
    tokens each prompt decodes, :func:`decode_lengths`)."""
    ref = spec.means.key[:16] if spec.means is not None else None
    return content_key("ablation_curve", ABLATION_VERSION, model.digest, list(subject),
                       np.round(np.asarray(scores, dtype=np.float64), 6).tolist(), [int(k) for k in ks],
                       [int(s) for s in seeds], spec.method, ref, source_id, int(outside_top),
                       *_decoded_part(decoded))


def ablation_curve(
    model: LoadedModel,
    scores: np.ndarray,
    k_values: Sequence[int],
    spec: AblationSpec,
    store: Store,
    *,
    on: Run | StatsRun | RetrievalSweep,
    by_label: str,
    seeds: Sequence[int] = (0, 1, 2),
    outside_top: int = CONTROL_TOP_N,
    source_id: str | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> tuple[str, TopkCurve, dict[str, Any]]:
    """The top-k vs random curve of ``scores`` on a run (mean loss) or a sweep (NIAH accuracy), stored.

    Every metric value is stored by ablated head set as it finishes (:class:`StoredValues`): a
    cancelled curve run again resumes, and a curve with other k, seeds or control reuses the values
    it shares. The curve itself is stored (partial when cancelled) under :func:`curve_key`.

    Parameters
    ----------
    scores : ``[layer, head]`` the score heads are ranked by (nan: never in the top).
    k_values : the k to evaluate, 0 ≤ k ≤ the heads with a finite score.
    spec : the method and its options (mean reference, resample source); its heads are ignored.
    on : a run, with patterns or in statistics mode (metric: its mean next-token loss), or a
        :class:`~headscope.analysis.retrieval.RetrievalSweep` (metric: NIAH accuracy on its prompts).
    by_label : what the score is, for the figure and the summary.
    outside_top : the random control draws from outside this many top heads (see :func:`topk_curve`).
    source_id : the store id of the resample source run (part of the key).

    Returns
    -------
    The store key, the curve, and its stored metadata (``metric_label``, ``by_label``, ``subject``).
    """
    ks = check_curve(model, k_values, len(seeds), outside_top)
    decoded: list[int] = []
    if isinstance(on, RetrievalSweep):
        metric = "niah"
        prompts = [trial_prompt(t) for t in on.trials]
        decoded = decode_lengths(prompts)  # each its task's whole answer, as the sweep's trials decoded
        fn = retrieval_accuracy_fn(prompts, None)
        subject = ("sweep", on.key)
    elif isinstance(on, Run | StatsRun):
        metric = "loss"
        fn = loss_metric_fn(on.token_ids, model)
        subject = ("run", on.key)
    else:
        raise InputError("A curve is measured on a run (its loss) or on a retrieval sweep (NIAH accuracy).")
    seeds = [int(s) for s in seeds]
    key = curve_key(model, subject, scores, ks, seeds, spec, source_id, outside_top, decoded)
    ref = spec.means.key[:16] if spec.means is not None else None
    known = StoredValues(store, (model.digest, subject, spec.method, ref, source_id, *_decoded_part(decoded)))
    curve = topk_curve(model, scores, ks, fn, spec, seeds, outside_top=outside_top, known=known,
                       progress=progress, cancel=cancel)
    meta = {"metric_label": CURVE_METRICS[metric], "by_label": by_label, "subject": list(subject),
            "model_digest": model.digest,
            **({"decoded_tokens": dict(zip(map(task_of, prompts), decoded, strict=True))} if decoded else {})}
    save_curve(store, key, curve, meta)
    return key, curve, {**meta, "random_outside_top": curve.outside_top,
                        **({"n_prompts": curve.n_prompts} if curve.n_prompts is not None else {})}

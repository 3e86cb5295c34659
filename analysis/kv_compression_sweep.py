"""KV-cache compression curves on a needle-in-a-haystack sweep, stored whole: the user action of the
Compress page and ``headscope compress``.

:func:`compress_sweep` takes a stored sweep (:func:`headscope.analysis.retrieval.sweep`), obtains the per-head
scores its rankings need (retrieval from the sweep; the registry's scores that rank KV groups, such as
streaming and evidence, from :func:`headscope.analysis.head_scores.score_prompts` over the sweep's prompts,
the streaming score with the policy's own S and W), and calls :func:`headscope.analysis.kv_compression.evaluate_policies` on the sweep's
prompts. The finished curve is stored as one record keyed by its inputs (:func:`curve_key`), so a
link that names it reopens the curve without computing (:func:`load_curve`); each policy's numbers
are also stored by ``evaluate_policies`` itself, so a cancelled run resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from headscope.analysis.ablation import Cancel, Progress
from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import (
    KV_COMPRESSION_VERSION,
    RANKINGS,
    CompressionCurve,
    KVMemory,
    Policy,
    PolicyEvaluation,
    evaluate_policies,
)
from headscope.analysis.kv_compression_choices import (
    DEFAULT_FRACTIONS,
    DEFAULT_RANKINGS,
    DEFAULT_RECENT_SIZE,
    DEFAULT_SINK_SIZE,
)
from headscope.analysis.long_context_tasks import max_new_tokens_for
from headscope.analysis.models import LoadedModel
from headscope.analysis.niah import NiahPrompt
from headscope.analysis.retrieval import RetrievalSweep, trial_prompt
from headscope.analysis.score_registry import KV_SCORES
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import loaded_by_prefix, stored_record, stored_result

if TYPE_CHECKING:
    from headscope.analysis.long_context_tasks import MeasuredSuite, TaskSuite

CURVE_KIND = "kv_compression_curve"
SCORES_SHARE = 0.2  # of the progress bar, for the head scores over the prompts when they are computed
TASKS_SHARE = 0.3  # of the progress bar, for the task suite's uncompressed answers when a suite is scored


@dataclass
class StoredCurve:
    """A compression curve and the key it is stored under (empty when it was not stored: cancelled)."""

    key: str
    curve: CompressionCurve
    sweep_key: str


def curve_key(model: LoadedModel, sweep_key: str, rankings: Sequence[str], fractions: Sequence[float],
              seeds: Sequence[int], sink_size: int, recent_size: int,
              texts: Sequence[Sequence[int]] | None = None, backend: str = "auto",
              suite: TaskSuite | None = None) -> str:
    """The content key of a curve: model, sweep, every choice, the loss text (None: the sweep's prompts),
    the backend asked for and the task suite scored (None: the sweep's prompts)."""
    return content_key(CURVE_KIND, KV_COMPRESSION_VERSION, model.digest, sweep_key, list(rankings),
                       sorted({float(f) for f in fractions}), [int(s) for s in seeds], int(sink_size),
                       int(recent_size), None if texts is None else [[int(t) for t in ids] for ids in texts],
                       *([backend] if backend != "auto" or suite is not None else []),
                       *([suite.key()] if suite is not None else []))


def sweep_scores(model: LoadedModel, sweep: RetrievalSweep, rankings: Sequence[str], sink_size: int,
                 recent_size: int, store: Store | None = None, progress: Progress | None = None
                 ) -> dict[str, np.ndarray]:
    """The ``[layer, head]`` tables the rankings need: the sweep's retrieval scores, and the means over its
    prompts of the head scores the rankings name (the streaming score with S = ``sink_size``, W = ``recent_size``)."""
    from headscope.analysis.head_scores import score_prompts, trial_prompts

    scores = {"retrieval": np.asarray(sweep.scores)}
    wanted = [r for r in rankings if r in KV_SCORES]
    if wanted:
        head_scores = score_prompts(model, trial_prompts(sweep.trials), sink=sink_size, window=recent_size,
                                    store=store, progress=progress, names=wanted)
        scores.update({k: head_scores.mean[k] for k in wanted if k in head_scores.mean})
    return scores


def compress_sweep(
    model: LoadedModel,
    sweep: RetrievalSweep,
    rankings: Sequence[str] = DEFAULT_RANKINGS,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    sink_size: int = DEFAULT_SINK_SIZE,
    recent_size: int = DEFAULT_RECENT_SIZE,
    texts: Sequence[Sequence[int]] | None = None,
    backend: str = "auto",
    suite: TaskSuite | None = None,
    store: Store | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> StoredCurve:
    """Evaluate KV-cache policies on ``sweep``'s prompts (NIAH accuracy; loss and agreement on ``texts``,
    default the sweep's distinct prompts) and store the finished curve as one record.

    With a task ``suite`` (:class:`headscope.analysis.long_context_tasks.TaskSuite`) the accuracy is
    measured on the suite's prompts instead, those of the tasks the uncompressed model can do
    (:func:`headscope.analysis.long_context_tasks.measured_suite`: every task's answer rate is in
    ``curve.meta["tasks"]``, a task below ``suite.min_rate`` is dropped); the sweep still ranks the heads
    (its retrieval scores, and the scores over its prompts) and gives the loss texts, so the policies are
    chosen on one set of prompts and scored on another.

    A curve already stored under the same inputs is read back, not computed. A cancelled evaluation
    returns the finished policies (``curve.complete`` False) and stores no curve record. ``backend``
    is :func:`headscope.analysis.kv_compression.evaluate_policies`' (``auto``, ``eager`` or ``statistics``).
    """
    from headscope.analysis.head_scores import trial_prompts

    if not sweep.trials:
        raise InputError("The sweep has no finished trial: run it again, or with more needles or lengths.")
    rankings = list(dict.fromkeys(rankings))
    seeds = [int(s) for s in seeds] or [0]
    prompts = [trial_prompt(t) for t in sweep.trials]
    _check_window(prompts, sink_size, recent_size, "sweep's")
    key = curve_key(model, sweep.key, rankings, fractions, seeds, sink_size, recent_size, texts, backend, suite)
    if (found := stored_result(store, key, load_curve)) is not None:
        return StoredCurve(key, found, sweep.key)
    needs_scores = any(r in KV_SCORES for r in rankings)
    tasks_share = TASKS_SHARE if suite is not None else 0.0
    share = tasks_share + (SCORES_SHARE if needs_scores else 0.0)

    def part(lo: float, hi: float) -> Progress | None:
        return None if progress is None else (lambda f: progress(lo + (hi - lo) * float(f)))

    measured = None
    if suite is not None:
        measured = _measured(model, suite, store, part(0.0, tasks_share), cancel)
        _check_window(measured.kept, sink_size, recent_size, "task suite's")
    scores = sweep_scores(model, sweep, rankings, sink_size, recent_size, store, part(tasks_share, share))
    loss_texts = [list(t) for t in texts] if texts is not None else [p.token_ids for p in trial_prompts(sweep.trials)]
    curve = evaluate_policies(model, scores, rankings, fractions, texts=loss_texts,
                              prompts=measured.kept if measured else prompts, seeds=seeds,
                              sink_size=sink_size, recent_size=recent_size,
                              max_new_tokens=measured.max_new_tokens if measured else max_new_tokens_for(prompts),
                              backend=backend, baseline_answered=measured.kept_answered if measured else None,
                              store=store, progress=part(share, 1.0), cancel=cancel)
    curve.meta.setdefault("sweep", sweep.key)
    curve.meta["backend_asked"] = backend  # "auto" resolves to a masking backend: a rerun asks the same
    if measured is not None:
        curve.meta["tasks"] = measured.summary()
    if store is not None and curve.complete:
        save_curve(store, key, curve)
        return StoredCurve(key, curve, sweep.key)
    return StoredCurve("" if not curve.complete else key, curve, sweep.key)


def _check_window(prompts: Sequence[NiahPrompt], sink_size: int, recent_size: int, whose: str) -> None:
    shortest = min(p.n_tokens for p in prompts)
    if sink_size + recent_size >= shortest:
        raise InputError(f"S + W = {sink_size + recent_size} keeps every key of the {whose} {shortest}-token "
                         "prompts: nothing to compress. Lower S or W, or use longer contexts.")


def _measured(model: LoadedModel, suite: TaskSuite, store: Store | None, progress: Progress | None,
              cancel: Cancel | None) -> MeasuredSuite:
    """:func:`headscope.analysis.long_context_tasks.measured_suite`; a cancel while it decodes is said as such."""
    from headscope.analysis.long_context_tasks import measured_suite
    from headscope.analysis.retrieval import Cancelled

    try:
        return measured_suite(model, suite, store, progress=progress, cancel=cancel)
    except Cancelled:
        raise InputError("Cancelled while the uncompressed model answered the task suite's prompts: no policy "
                         "was evaluated. Run starts again.") from None


# ---------------------------------------------------------------------------------------------
# One record per curve


def _evaluation_json(e: PolicyEvaluation) -> dict[str, Any]:
    m = e.memory
    return {"policy": e.policy.to_json(), "n_tokens": m.n_tokens, "bytes": m.bytes, "full_bytes": m.full_bytes,
            "loss": e.loss, "agreement": e.agreement, "niah_accuracy": e.niah_accuracy, "niah_n": e.niah_n,
            "seconds": e.seconds}


def _evaluation(d: dict[str, Any], n_prompts: int) -> PolicyEvaluation:
    """One evaluation of a curve record; a record stored before evaluations carried ``niah_n`` has the
    curve's ``n_prompts`` (every policy is evaluated on all of the curve's prompts)."""
    p = d["policy"]
    if p["ranking"] not in RANKINGS:
        raise ValueError(f"unknown ranking {p['ranking']!r}")
    policy = Policy(np.asarray(p["full"], dtype=bool), int(p["sink_size"]), int(p["recent_size"]), str(p["ranking"]),
                    float(p["fraction"]), None if p["seed"] is None else int(p["seed"]))
    accuracy, n = float(d["niah_accuracy"]), d.get("niah_n", n_prompts)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or not (accuracy != accuracy or 0 <= accuracy <= 1):
        raise ValueError(f"a NIAH accuracy of {accuracy!r} on {n!r} prompts")
    return PolicyEvaluation(policy, KVMemory(int(d["n_tokens"]), int(d["bytes"]), int(d["full_bytes"])),
                            float(d["loss"]), float(d["agreement"]), accuracy, float(d["seconds"]), n)


def save_curve(store: Store, key: str, curve: CompressionCurve) -> None:
    """Store ``curve`` (every evaluation with its policy) as one record under ``key``."""
    store.put(key, CURVE_KIND, {
        "baseline": _evaluation_json(curve.baseline), "evaluations": [_evaluation_json(e) for e in curve.evaluations],
        "sink_size": curve.sink_size, "recent_size": curve.recent_size, "n_texts": curve.n_texts,
        "n_prompts": curve.n_prompts, "complete": curve.complete, "meta": curve.meta}, {})


def load_curve(store: Store, key: str) -> CompressionCurve | None:
    """The curve stored under ``key`` (a full key), or None (absent, or not a curve record)."""
    record = stored_record(store, key, CURVE_KIND)
    if record is None:
        return None
    m = record.meta
    try:
        n = int(m["n_prompts"])
        return CompressionCurve([_evaluation(d, n) for d in m["evaluations"]], _evaluation(m["baseline"], n),
                                int(m["sink_size"]), int(m["recent_size"]), int(m["n_texts"]), int(m["n_prompts"]),
                                bool(m["complete"]), dict(m["meta"]))
    except (KeyError, TypeError, ValueError, InputError):
        return None


def find_curve(store: Store, prefix: str) -> tuple[str, CompressionCurve]:
    """The stored curve whose key starts with ``prefix`` (a link's id); an ``InputError`` when none does."""
    found = loaded_by_prefix(store, prefix, load_curve)
    if found is None:
        raise InputError(f"No stored compression curve has the id {prefix!r}: run the evaluation again.")
    return found

"""Retrieval heads from needle-in-a-haystack sweeps.

Wu, Wang, Xiao, Peng & Fu 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"
(arXiv:2404.15574), section 2. A needle is hidden in a haystack (:mod:`headscope.analysis.niah`), the model
decodes greedily, and at every decode step t with generated token ``y_t`` head (l, h)
*copy-pastes* when

    j* = argmax_j A[l, h][t, j]   lies inside the needle span   and   prompt_ids[j*] == y_t.

Here row t of ``A`` is the query that *produces* ``y_t`` (as in the paper's code: the prompt's last
token is the first decode input, so every generated token is scored). The trial score of a head is

    score(l, h) = |{t : head (l, h) copy-pastes at step t}| / |needle|     (|needle| in tokens),

a trial counts only when the model retrieved the answer, i.e. ROUGE-1 recall of the answer in the
response > 0.5 (:func:`rouge1_recall`), and a head's retrieval score is the mean of its trial
scores over counted trials. Scores are per query head ``[layer, head]``; with grouped-query
attention they are also aggregated per key-value group (max and mean over the group's query heads).

Decoding stops at an EOS token or after ``max_new_tokens``; with ``stop_at_newline`` it also stops at
the first newline after some text, the rule of the paper's code (its responses are one line; a chat
model's leading newline does not stop it). The default keeps every stored trial and sweep valid.
The needle's depth rule (nearest or previous sentence boundary) is :data:`headscope.analysis.niah.DEPTH_RULES`.

Only one attention row per head per decode step is read: the prompt (all but its last token) is
pre-filled through the KV cache in statistics mode (:mod:`headscope.analysis.attention_statistics`: attention
through :func:`headscope.kernels.attention`, so no N x N matrix is ever built, not even per layer), and at
each decode step the kernel reduces the single query row ``[head, key]`` to its argmax and maximum
in the same pass as the output. Models that cannot run in statistics mode use the eager path with a
hook on ``hook_pattern`` (same numbers).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headscope.analysis.detectors import group_heads
from headscope.analysis.errors import InputError
from headscope.analysis.greedy_decoding import (
    DEFAULT_MAX_NEW_TOKENS,
    Cancel,
    Cancelled,
    Progress,
    cancel_requested,
    greedy_decode,
    stop_ids,
)
from headscope.analysis.intervals import Proportion, wilson
from headscope.analysis.limits import hint, limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.niah import DEFAULT_DEPTH_RULE, DEFAULT_TEMPLATE, Needle, NiahPrompt, build_prompt
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result

RETRIEVAL_VERSION = 1
ROUGE_GATE = 0.5
"""A trial counts when ROUGE-1 recall of the answer in the response is strictly above this."""


# ---------------------------------------------------------------------------------------------
# Pure pieces


_WORD = re.compile(r"[a-z0-9]+")


def rouge1_recall(reference: str, response: str) -> float:
    """ROUGE-1 recall of ``reference`` in ``response`` (Lin 2004, "ROUGE", section 3).

    ``recall = Σ_w min(c_ref(w), c_resp(w)) / Σ_w c_ref(w)`` over unigrams ``w``, where words are the
    runs of ``[a-z0-9]`` in the lower-cased text (the tokenisation of Google's ``rouge_score``, without
    its optional Porter stemming: "metres" and "metre" are different words here).

    Returns
    -------
    float in [0, 1]; 0 when the reference has no words.
    """
    ref = Counter(_WORD.findall(reference.lower()))
    if not ref:
        return 0.0
    hyp = Counter(_WORD.findall(response.lower()))
    overlap = sum(min(c, hyp[w]) for w, c in ref.items())
    return overlap / sum(ref.values())


def copy_paste_hits(
    argmax_keys: np.ndarray,
    generated: Sequence[int],
    prompt_ids: Sequence[int],
    needle_span: tuple[int, int],
) -> np.ndarray:
    """Which heads copy-paste at which decode step (Wu et al. 2024, section 2).

    Parameters
    ----------
    argmax_keys : ``[step, layer, head]`` int, ``j*`` = argmax over keys of the attention row of the
        query that produced generated token ``step``.
    generated : ``[step]`` the generated token ids ``y_t``.
    prompt_ids : the prompt's token ids (keys past the prompt are generated tokens, never the needle).
    needle_span : ``(start, end)`` half-open token span of the needle in the prompt.

    Returns
    -------
    ``[step, layer, head]`` bool: ``start <= j* < end`` and ``prompt_ids[j*] == y_t``.
    """
    argmax_keys = np.asarray(argmax_keys)
    generated = np.asarray(generated, dtype=np.int64)
    if argmax_keys.ndim != 3 or argmax_keys.shape[0] != generated.shape[0]:
        raise ValueError(
            f"argmax_keys must be [step, layer, head] with one step per generated token; got "
            f"{argmax_keys.shape} for {generated.shape[0]} tokens"
        )
    start, end = needle_span
    if not 0 <= start < end <= len(prompt_ids):
        raise ValueError(f"needle_span {needle_span} is not a span of the {len(prompt_ids)}-token prompt")
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    inside = (argmax_keys >= start) & (argmax_keys < end)
    token_at = prompt[np.clip(argmax_keys, 0, len(prompt) - 1)]
    return inside & (token_at == generated[:, None, None])


def trial_scores(hits: np.ndarray, needle_length: int) -> np.ndarray:
    """Trial score per head: copy-paste steps / needle length in tokens (Wu et al. 2024, eq. 1).

    Parameters
    ----------
    hits : ``[step, layer, head]`` bool from :func:`copy_paste_hits`.
    needle_length : |needle| in tokens.

    Returns
    -------
    ``[layer, head]`` float32.
    """
    if needle_length < 1:
        raise ValueError("needle_length must be at least 1")
    return (np.asarray(hits).sum(0) / float(needle_length)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Trials


@dataclass
class Trial:
    """One needle-in-a-haystack trial and everything needed to audit its score.

    Attributes
    ----------
    settings : the prompt's settings (length, depth, needle, spans) and the decode settings.
    response : the decoded response (special tokens dropped).
    recall : ROUGE-1 recall of the answer in the response; ``counted = recall > 0.5``.
    scores : ``[layer, head]`` this trial's copy-paste score (also kept for trials not counted).
    argmax_keys, argmax_weight : ``[step, layer, head]`` per-step argmax key and its attention weight.
    hits : ``[(step, layer, head), ...]`` every copy-paste event.
    """

    key: str
    settings: dict[str, Any]
    prompt_ids: list[int]
    generated: list[int]
    response: str
    recall: float
    counted: bool
    scores: np.ndarray
    argmax_keys: np.ndarray
    argmax_weight: np.ndarray
    hits: list[tuple[int, int, int]]
    seconds: float
    reused: bool = False

    @property
    def length(self) -> int:
        return int(self.settings["length"])

    @property
    def depth(self) -> float:
        return float(self.settings["depth"])

    def meta(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "prompt_ids": self.prompt_ids,
            "generated": self.generated,
            "response": self.response,
            "recall": self.recall,
            "counted": self.counted,
            "hits": [list(h) for h in self.hits],
            "seconds": self.seconds,
            "version": RETRIEVAL_VERSION,
        }


def trial_key(model: LoadedModel, prompt: NiahPrompt, max_new_tokens: int, stop_at_newline: bool = False) -> str:
    """The store key of a trial: model digest, prompt ids, needle span, answer and decode length
    (and the newline stop when on: keys of trials decoded without it are unchanged)."""
    return content_key(
        "retrieval_trial",
        RETRIEVAL_VERSION,
        model.digest,
        prompt.token_ids,
        list(prompt.needle_span),
        prompt.needle.answer,
        max_new_tokens,
        *(["stop_at_newline"] if stop_at_newline else []),
    )


def load_trial(store: Store, key: str) -> Trial | None:
    """A stored trial, or None when absent or corrupt."""
    record = stored_record(store, key, "retrieval_trial")
    if record is None:
        return None
    m = record.meta
    return Trial(
        key=key,
        settings=m["settings"],
        prompt_ids=m["prompt_ids"],
        generated=m["generated"],
        response=m["response"],
        recall=float(m["recall"]),
        counted=bool(m["counted"]),
        scores=record.array("scores", mmap=False),
        argmax_keys=record.array("argmax_keys", mmap=False),
        argmax_weight=record.array("argmax_weight", mmap=False).astype(np.float32),
        hits=[tuple(h) for h in m["hits"]],
        seconds=float(m["seconds"]),
        reused=True,
    )


def run_trial(
    model: LoadedModel,
    prompt: NiahPrompt,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    store: Store | None = None,
    cancel: Cancel | None = None,
    progress: Progress | None = None,
    stop_at_newline: bool = False,
) -> Trial:
    """Decode one needle-in-a-haystack prompt and score every head on it (Wu et al. 2024, §2).

    ``scores[l, h] = |{t : j*_t ∈ needle and prompt_ids[j*_t] == y_t}| / |needle|``; the trial counts
    when ``rouge1_recall(answer, response) > 0.5``. A stored trial with the same key (model digest,
    prompt ids, needle span, answer, ``max_new_tokens``, ``stop_at_newline``) is loaded instead of
    decoded. ``stop_at_newline``: see :func:`greedy_decode`.

    Returns
    -------
    :class:`Trial`.
    """
    key = trial_key(model, prompt, max_new_tokens, stop_at_newline)
    if (stored := stored_result(store, key, load_trial, progress)) is not None:
        return stored
    decoded = greedy_decode(model, prompt.token_ids, max_new_tokens, cancel=cancel, progress=progress,
                            stop_at_newline=stop_at_newline)
    stops = stop_ids(model)
    response_ids = [t for t in decoded.generated if t not in stops]
    response = model.tokenizer.decode(response_ids, skip_special_tokens=True)
    recall = rouge1_recall(prompt.needle.answer, response)
    hits = copy_paste_hits(decoded.argmax_keys, decoded.generated, prompt.token_ids, prompt.needle_span)
    start, end = prompt.needle_span
    settings = prompt.settings() | {"max_new_tokens": max_new_tokens}
    if stop_at_newline:
        settings["stop_at_newline"] = True
    trial = Trial(
        key=key,
        settings=settings,
        prompt_ids=list(prompt.token_ids),
        generated=decoded.generated,
        response=response,
        recall=recall,
        counted=recall > ROUGE_GATE,
        scores=trial_scores(hits, end - start),
        argmax_keys=decoded.argmax_keys,
        argmax_weight=decoded.argmax_weight,
        hits=[tuple(int(x) for x in h) for h in np.argwhere(hits)],
        seconds=decoded.seconds,
    )
    if store is not None:
        store.put(
            key,
            "retrieval_trial",
            trial.meta(),
            {
                "scores": trial.scores,
                "argmax_keys": trial.argmax_keys,
                "argmax_weight": trial.argmax_weight.astype(np.float16),
            },
        )
    return trial


def trial_prompt(trial: Trial) -> NiahPrompt:
    """The prompt a stored trial decoded, rebuilt from its record (ids, spans, needle)."""
    st = trial.settings
    return NiahPrompt(
        token_ids=list(trial.prompt_ids), needle_span=tuple(st["needle_span"]),
        question_span=tuple(st.get("question_span", (0, 0))), needle=Needle(**st["needle"]),
        length=int(st["length"]), depth=float(st["depth"]), actual_depth=float(st.get("actual_depth", st["depth"])),
        haystack_tokens=0, text="", depth_rule=st.get("depth_rule", DEFAULT_DEPTH_RULE),
    )


def decode_rows(model: LoadedModel, trial: Trial, layer: int, head: int) -> np.ndarray:
    """One head's whole attention row at every decode step of a trial, by replaying its decode.

    The trial keeps only each step's argmax; this replays the same prefill and KV-cached steps
    feeding the tokens the trial generated (:func:`greedy_decode` with ``force``), so the rows are
    the ones the score was computed from. Row t (over keys ``0 .. n_prompt − 1 + t``) is the query
    that produced ``generated[t]``.

    Returns
    -------
    ``[steps, n_prompt + steps − 1]`` float32; row t is zero past key ``n_prompt − 1 + t``.
    """
    if not trial.generated:
        raise InputError("This trial generated no tokens.")
    decoded = greedy_decode(model, trial.prompt_ids, force=trial.generated, keep_row=(int(layer), int(head)))
    steps, n = len(trial.generated), len(trial.prompt_ids)
    out = np.zeros((steps, n + steps - 1), dtype=np.float32)
    for t, row in enumerate(decoded.rows or []):
        out[t, : row.shape[0]] = row
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation and sweeps


AGGREGATES = {
    "query": "per query head",
    "group_max": "per key-value group (max over its query heads)",
    "group_mean": "per key-value group (mean over its query heads)",
}
"""How retrieval scores are shown: per query head, or per key-value group (the fields of
:class:`RetrievalScores`), with their labels."""


@dataclass
class RetrievalScores:
    """Retrieval scores over a set of trials.

    Attributes
    ----------
    scores : ``[layer, head]`` mean trial score over counted trials (nan when none counted).
    group_max, group_mean : ``[layer, kv_head]`` max / mean of ``scores`` over each key-value group's
        query heads (query head h reads key-value head ``h // (H / H_kv)``).
    n_trials, n_counted : trials run and trials that passed the ROUGE gate.
    """

    scores: np.ndarray
    group_max: np.ndarray
    group_mean: np.ndarray
    n_trials: int
    n_counted: int

    def share_above(self, threshold: float = 0.1) -> float:
        """Fraction of query heads whose score exceeds ``threshold`` (0.1 in Wu et al. 2024)."""
        s = np.nan_to_num(self.scores, nan=0.0)
        return float((s > threshold).mean())


def retrieval_scores(trials: Sequence[Trial], n_kv_heads: int) -> RetrievalScores:
    """Mean trial score over counted trials, per query head and per key-value group.

    Wu et al. 2024, section 2: ``R(l, h) = mean_{trials with ROUGE-1 recall > 0.5} score_trial(l, h)``.

    Parameters
    ----------
    trials : the trials (counted and not); all from one model.
    n_kv_heads : key-value heads per layer, for the per-group tables.

    Returns
    -------
    :class:`RetrievalScores`.
    """
    if not trials:
        raise InputError("No trials to score: run at least one needle-in-a-haystack trial.")
    shape = trials[0].scores.shape
    counted = [t.scores for t in trials if t.counted]
    if counted:
        scores = np.mean(np.stack(counted).astype(np.float64), axis=0)
    else:
        scores = np.full(shape, np.nan)
    return RetrievalScores(
        scores=scores,
        group_max=group_heads(scores, n_kv_heads, "max"),
        group_mean=group_heads(scores, n_kv_heads, "mean"),
        n_trials=len(trials),
        n_counted=len(counted),
    )


@dataclass
class RetrievalSweep(RetrievalScores):
    """A needle-in-a-haystack sweep: retrieval scores plus the accuracy grid.

    The grid's rows are the context lengths; its columns are the needle depths, or, for a sweep over the
    long-context task suite's prompts (:func:`headscope.analysis.task_retrieval.task_sweep`), the tasks
    (:attr:`columns`, :attr:`column_name`).

    Attributes
    ----------
    accuracy : ``[length, column]`` fraction of prompts answered (ROUGE-1 recall > 0.5); nan where no
        trial finished.
    recall : ``[length, column]`` mean ROUGE-1 recall.
    depths : the needle depths in percent (the columns); empty for a task-suite sweep.
    tasks : the task-suite tasks (the columns); empty for a needle sweep.
    trials : every finished trial, in sweep order.
    cancelled : True when ``cancel`` stopped the sweep (the finished trials are kept and scored).
    key : the stored sweep record's key (empty without a store).
    depth_rule, stop_at_newline : the needle placement and the decode stop (see :func:`sweep`).
    """

    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    accuracy: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    recall: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    trials: list[Trial] = field(default_factory=list)
    cancelled: bool = False
    key: str = ""
    depth_rule: str = DEFAULT_DEPTH_RULE
    stop_at_newline: bool = False
    tasks: list[str] = field(default_factory=list)

    @property
    def column_name(self) -> str:
        """What the accuracy grid's columns are: ``"task"`` or ``"depth"``."""
        return "task" if self.tasks else "depth"

    @property
    def columns(self) -> list:
        """The accuracy grid's columns: the task names, or the depths in percent."""
        return list(self.tasks) if self.tasks else list(self.depths)

    def grid_text(self) -> str:
        """The grid's rows and columns in words: ``lengths [512], depths [10.0, 90.0]`` or
        ``lengths [1024], tasks passkey, multi_key``."""
        cols = ", ".join(self.tasks) if self.tasks else str(self.depths)
        return f"lengths {self.lengths}, {self.column_name}s {cols}"

    def settings_text(self) -> str:
        """The sweep's prompts (needle placement) and decode stop, in words (shown with the sweep)."""
        stop = "stops at EOS or the first newline" if self.stop_at_newline else "stops at EOS"
        placed = "prompts of the long-context task suite" if self.tasks else \
            f"needle at the {self.depth_rule} sentence boundary"
        return f"{placed}; decoding {stop}"

    def cell_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(answered, n)``, each ``[length, column]``: the counts behind :attr:`accuracy` (see :func:`cell_counts`)."""
        return cell_counts(self.trials, self.lengths, self.depths, self.tasks or None)

    def accuracy_intervals(self) -> list[list[Proportion]]:
        """``[length][column]`` each cell's accuracy as answered of n with its 95 % Wilson interval
        (:mod:`headscope.analysis.intervals`); ``n = 0`` where no trial finished."""
        answered, n = self.cell_counts()
        return [[wilson(answered[i, j], n[i, j]) for j in range(n.shape[1])] for i in range(n.shape[0])]

    def overall_accuracy(self) -> Proportion:
        """The whole sweep's accuracy: trials answered of trials finished, with its Wilson interval."""
        return wilson(self.n_counted, self.n_trials)


def trial_task(trial: Trial) -> str:
    """The task-suite task a trial's prompt belongs to (its needle's ``kind``; see
    :func:`headscope.analysis.long_context_tasks.task_of`)."""
    return str(trial.settings["needle"].get("kind", ""))


def cell_counts(trials: Sequence[Trial], lengths: Sequence[int], depths: Sequence[float],
                tasks: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Trials answered (ROUGE-1 recall > 0.5) and trials finished per ``[length, depth]`` cell, or per
    ``[length, task]`` cell when ``tasks`` are given (a task-suite sweep's columns; ``depths`` unused).

    A sweep decodes every prompt once per cell (greedy decoding is deterministic, so a repeat would
    give the same answer): a cell's accuracy is ``answered / n`` with ``n`` the prompts whose trial
    finished there (all of them, unless the sweep was cancelled; a needle given twice counts twice).

    Returns
    -------
    ``(answered, n)``, int ``[length, column]``.

    Raises
    ------
    ValueError
        A trial whose length, depth or task is not one of the sweep's.
    """
    row = {int(x): i for i, x in enumerate(lengths)}
    col = {str(x): j for j, x in enumerate(tasks)} if tasks else {float(x): j for j, x in enumerate(depths)}
    answered = np.zeros((len(row), len(col)), dtype=np.int64)
    n = np.zeros_like(answered)
    for t in trials:
        at = trial_task(t) if tasks else t.depth
        if t.length not in row or at not in col:
            shown_at = f"task {at[:40]!r}" if tasks else f"depth {at:g}"
            raise InputError(f"A trial at length {t.length}, {shown_at} is not in this sweep's grid: run the "
                             "sweep again.")
        n[row[t.length], col[at]] += 1
        answered[row[t.length], col[at]] += bool(t.counted)
    return answered, n


def sweep(
    model: LoadedModel,
    needles: Sequence[Needle],
    lengths: Sequence[int],
    depths: Sequence[float],
    haystack: str,
    *,
    store: Store | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    template: str = DEFAULT_TEMPLATE,
    depth_rule: str = DEFAULT_DEPTH_RULE,
    stop_at_newline: bool = False,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> RetrievalSweep:
    """Run needle-in-a-haystack trials over lengths × depths × needles and score retrieval heads.

    Wu et al. 2024 (arXiv:2404.15574), section 2: for every (length, depth, needle) a prompt is built
    (:func:`headscope.analysis.niah.build_prompt`), decoded greedily and scored (:func:`run_trial`); a head's
    score is its mean trial score over trials whose ROUGE-1 recall of the answer exceeds 0.5.

    All prompts are built (and so validated) before anything is decoded. With a ``store`` every trial
    is stored as it finishes and reused when the sweep is run again; the sweep's tables are stored
    too. ``cancel`` (a callable, or an object with ``is_set``) is checked between decode steps: the
    sweep stops, drops the unfinished trial, and returns what finished with ``cancelled=True``.

    ``depth_rule`` places the needle (:data:`headscope.analysis.niah.DEPTH_RULES`); ``stop_at_newline`` stops
    each decode at the first newline after some text (the paper's rule; :func:`greedy_decode`).
    Both default to the behaviour of every stored sweep, whose keys they leave unchanged.

    Returns
    -------
    :class:`RetrievalSweep`.

    Raises
    ------
    InputError
        Empty needles, lengths or depths, or any prompt that cannot be built (see ``build_prompt``).
    """
    if not needles:
        raise InputError("Choose at least one needle.")
    if not lengths or not depths:
        raise InputError("Choose at least one context length and one depth.")
    lengths = [int(x) for x in lengths]
    depths = [float(x) for x in depths]
    n_planned = len(lengths) * len(depths) * len(needles)
    if n_planned > limit("HEADSCOPE_MAX_SWEEP_TRIALS"):
        raise InputError(f"This sweep would run {n_planned:,} trials (needles × lengths × depths) "
                         f"{hint('HEADSCOPE_MAX_SWEEP_TRIALS')}. Choose fewer needles, lengths or depths.")
    plan = [
        (i, j, build_prompt(model, needle, haystack, length, depth, template=template, depth_rule=depth_rule),
         max_new_tokens)
        for i, length in enumerate(lengths)
        for j, depth in enumerate(depths)
        for needle in needles
    ]
    result = decode_plan(model, plan, lengths, depths=depths, store=store, stop_at_newline=stop_at_newline,
                         progress=progress, cancel=cancel)
    result.depth_rule = depth_rule
    if store is not None and result.trials:
        key = _sweep_key(model.digest, [nd.to_dict() for nd in needles], lengths, depths, content_key(haystack),
                         template, max_new_tokens, depth_rule, stop_at_newline)
        put_sweep(store, model, result, key, {"needles": [nd.to_dict() for nd in needles],
                                              "max_new_tokens": max_new_tokens})
    return result


def decode_plan(model: LoadedModel, plan: Sequence[tuple[int, int, NiahPrompt, int]], lengths: Sequence[int], *,
                depths: Sequence[float] = (), tasks: Sequence[str] = (), store: Store | None = None,
                stop_at_newline: bool = False, progress: Progress | None = None,
                cancel: Cancel | None = None) -> RetrievalSweep:
    """Decode and score each ``(row, column, prompt, max_new_tokens)`` of ``plan`` in order
    (:func:`run_trial`, each trial stored and reused), and the sweep they make: retrieval scores over the
    answered trials (Wu et al. 2024, section 2) and the ``[length, column]`` accuracy grid, whose columns
    are ``depths`` or ``tasks``. A cancel stops between trials or decode steps: what finished is kept."""
    n_cols = len(tasks) if tasks else len(depths)
    trials: list[Trial] = []
    cells: dict[tuple[int, int], list[Trial]] = {}
    cancelled = False
    n = len(plan)
    for k, (i, j, prompt, steps) in enumerate(plan):
        if cancel_requested(cancel):
            cancelled = True
            break
        step_progress = (lambda f, k=k: progress((k + f) / n)) if progress else None
        try:
            trial = run_trial(model, prompt, max_new_tokens=steps, store=store, cancel=cancel,
                              progress=step_progress, stop_at_newline=stop_at_newline)
        except Cancelled:
            cancelled = True
            break
        trials.append(trial)
        cells.setdefault((i, j), []).append(trial)
        if progress:
            progress((k + 1) / n)

    accuracy = np.full((len(lengths), n_cols), np.nan)
    recall = np.full((len(lengths), n_cols), np.nan)
    for (i, j), cell in cells.items():
        accuracy[i, j] = np.mean([t.counted for t in cell])
        recall[i, j] = np.mean([t.recall for t in cell])
    if trials:
        base = retrieval_scores(trials, model.n_kv_heads)
    else:
        nan = np.full((model.n_layers, model.n_heads), np.nan)
        base = RetrievalScores(
            nan, group_heads(nan, model.n_kv_heads, "max"), group_heads(nan, model.n_kv_heads, "mean"), 0, 0
        )
    return RetrievalSweep(
        scores=base.scores, group_max=base.group_max, group_mean=base.group_mean, n_trials=base.n_trials,
        n_counted=base.n_counted, lengths=list(lengths), depths=list(depths), accuracy=accuracy, recall=recall,
        trials=trials, cancelled=cancelled, stop_at_newline=bool(stop_at_newline), tasks=list(tasks),
    )


def put_sweep(store: Store, model: LoadedModel, result: RetrievalSweep, key: str, meta: dict[str, Any]) -> None:
    """Store a sweep's tables under ``key`` (set on ``result``), with ``meta`` saying what it ran (its
    needles or its task suite); its trials are stored already."""
    result.key = key
    store.put(
        key,
        "retrieval_sweep",
        {
            "model_name": model.name,
            "model_digest": model.digest,
            **meta,
            "lengths": result.lengths,
            "depths": result.depths,
            **({"tasks": result.tasks} if result.tasks else {}),
            "trial_keys": [t.key for t in result.trials],
            "n_trials": result.n_trials,
            "n_counted": result.n_counted,
            "cancelled": result.cancelled,
            "depth_rule": result.depth_rule,
            "stop_at_newline": bool(result.stop_at_newline),
            "version": RETRIEVAL_VERSION,
        },
        {
            "scores": result.scores.astype(np.float32),
            "group_max": result.group_max.astype(np.float32),
            "group_mean": result.group_mean.astype(np.float32),
            "accuracy": result.accuracy.astype(np.float32),
            "recall": result.recall.astype(np.float32),
        },
    )


def _sweep_key(model_digest: str, needles: list[dict], lengths: Sequence[int], depths: Sequence[float],
               haystack_digest: str, template: str, max_new_tokens: int, depth_rule: str,
               stop_at_newline: bool) -> str:
    return content_key(
        "retrieval_sweep",
        RETRIEVAL_VERSION,
        model_digest,
        needles,
        lengths,
        depths,
        haystack_digest,
        template,
        max_new_tokens,
        # only when not the default: keys of sweeps stored before these were options stay
        *([depth_rule] if depth_rule != DEFAULT_DEPTH_RULE else []),
        *(["stop_at_newline"] if stop_at_newline else []),
    )


@dataclass(frozen=True)
class SweepSettings:
    """What a stored sweep was run with, to show it and run it again (:func:`sweep` takes them).

    ``haystack`` is the name of the shipped haystack (:data:`headscope.analysis.niah.HAYSTACK_NAMES`) the sweep
    used, or None when it used the user's own text, which is stored only as its digest.
    """

    needles: list[Needle]
    lengths: list[int]
    depths: list[float]
    haystack: str | None
    depth_rule: str
    stop_at_newline: bool


def sweep_settings(store: Store, key: str) -> SweepSettings | None:
    """The settings of the stored needle sweep ``key``, or None when no needle sweep is stored under it
    (a task-suite sweep's are :func:`headscope.analysis.task_retrieval.task_sweep_settings`).

    The haystack is found by recomputing the sweep's key (as :func:`sweep` computes it, with the
    default template) for each shipped haystack: the one whose key matches is the one it used.
    """
    from headscope.analysis.niah import HAYSTACK_NAMES, named_haystack

    record = stored_record(store, key, "retrieval_sweep")
    if record is None or "suite" in record.meta:  # a task-suite sweep: task_retrieval.task_sweep_settings
        return None
    m = record.meta
    depth_rule, stop = m.get("depth_rule", DEFAULT_DEPTH_RULE), bool(m.get("stop_at_newline", False))
    haystack = next((name for name in HAYSTACK_NAMES
                     if _sweep_key(m["model_digest"], m["needles"], m["lengths"], m["depths"],
                                   content_key(named_haystack(name)), DEFAULT_TEMPLATE, m["max_new_tokens"],
                                   depth_rule, stop) == key), None)
    return SweepSettings(needles=[Needle(**nd) for nd in m["needles"]], lengths=[int(x) for x in m["lengths"]],
                         depths=[float(x) for x in m["depths"]], haystack=haystack, depth_rule=depth_rule,
                         stop_at_newline=stop)


def load_sweep(store: Store, key: str) -> RetrievalSweep | None:
    """A stored sweep with its trials, or None when it (or one of its trials) is missing."""
    record = stored_record(store, key, "retrieval_sweep")
    if record is None:
        return None
    m = record.meta
    trials = [load_trial(store, k) for k in m["trial_keys"]]
    if any(t is None for t in trials):
        return None
    return RetrievalSweep(
        scores=record.array("scores", mmap=False).astype(np.float64),
        group_max=record.array("group_max", mmap=False).astype(np.float64),
        group_mean=record.array("group_mean", mmap=False).astype(np.float64),
        n_trials=int(m["n_trials"]),
        n_counted=int(m["n_counted"]),
        lengths=list(m["lengths"]),
        depths=list(m["depths"]),
        accuracy=record.array("accuracy", mmap=False).astype(np.float64),
        recall=record.array("recall", mmap=False).astype(np.float64),
        trials=trials,  # type: ignore[arg-type]
        cancelled=bool(m["cancelled"]),
        key=key,
        depth_rule=m.get("depth_rule", DEFAULT_DEPTH_RULE),
        stop_at_newline=bool(m.get("stop_at_newline", False)),
        tasks=[str(t) for t in m.get("tasks", [])],
    )

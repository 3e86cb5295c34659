"""Retrieval heads on the long-context task suite: which heads copy-paste the answer on passkey,
single-needle, multi-key, multi-value, variable-tracking and common-words prompts, and each task's accuracy.

Wu, Wang, Xiao, Peng & Fu 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"
(arXiv:2404.15574), section 2, as :mod:`headscope.analysis.retrieval` computes it, on the prompts of
:mod:`headscope.analysis.long_context_tasks` (RULER-style, Hsieh et al. 2024, arXiv:2404.06654) instead of
needles placed at chosen depths. Each prompt is decoded greedily and scored by
:func:`~headscope.analysis.retrieval.run_trial`: at decode step t with generated token ``y_t``, head (l, h)
copy-pastes when ``j* = argmax_j A[l, h][t, j]`` lies in the prompt's needle span (the asked sentence: for
multi-key the asked key's, for multi-value and variable tracking the first of its sentences, for common
words the whole list) and ``prompt_ids[j*] == y_t``; a trial's score is copy-paste steps / needle tokens,
and a head's retrieval score is the mean over the trials answered (ROUGE-1 recall of the answer > 0.5):

    R(l, h) = mean_{answered trials} |{t : head (l, h) copy-pastes at t}| / |needle|.

The accuracy grid is ``[length, task]``: each cell is the task's prompts answered of those decoded at that
length, with its 95 % Wilson interval (:meth:`~headscope.analysis.retrieval.RetrievalSweep.accuracy_intervals`).
Each prompt decodes :func:`~headscope.analysis.long_context_tasks.max_new_tokens_for` its own task's
tokens, so a task's accuracy does not depend on which other tasks were asked with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from headscope.analysis.errors import InputError
from headscope.analysis.greedy_decoding import Cancel, Progress
from headscope.analysis.limits import hint, limit
from headscope.analysis.long_context_tasks import (
    TASKS_VERSION,
    TaskSuite,
    checked_suite,
    max_new_tokens_for,
    task_of,
)
from headscope.analysis.models import LoadedModel
from headscope.analysis.retrieval import RETRIEVAL_VERSION, RetrievalSweep, decode_plan, put_sweep
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record


def check_task_sweep(suite: TaskSuite) -> TaskSuite:
    """``suite`` checked (:func:`~headscope.analysis.long_context_tasks.checked_suite`: tasks and lengths
    without duplicates) with its trials, one per prompt, within ``HEADSCOPE_MAX_SWEEP_TRIALS``: what
    :func:`task_sweep` refuses, said before a model loads or a prompt is built."""
    checked = checked_suite(suite)
    n_planned = len(checked.tasks) * len(checked.lengths) * checked.n_per_task
    if n_planned > limit("HEADSCOPE_MAX_SWEEP_TRIALS"):
        raise InputError(f"This sweep would run {n_planned:,} trials (tasks × lengths × prompts per task) "
                         f"{hint('HEADSCOPE_MAX_SWEEP_TRIALS')}. Choose fewer tasks, lengths or prompts per task.")
    return checked


def task_sweep_key(model_digest: str, suite: TaskSuite, stop_at_newline: bool = False) -> str:
    """The store key of a task sweep: the model, the suite's prompts (:meth:`TaskSuite.key` without the
    rate a compression needs, which a retrieval sweep does not use) and the decode stop."""
    return content_key("retrieval_sweep", RETRIEVAL_VERSION, model_digest, "task_suite", suite.key()[:-1],
                       *(["stop_at_newline"] if stop_at_newline else []))


def task_sweep(
    model: LoadedModel,
    suite: TaskSuite,
    *,
    store: Store | None = None,
    stop_at_newline: bool = False,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> RetrievalSweep:
    """Decode every prompt of ``suite`` and score retrieval heads on them (Wu et al. 2024, section 2).

    Parameters
    ----------
    model : the model to decode with; the suite's lengths must fit its context.
    suite : tasks, lengths (1,024 to 8,192 tokens), prompts per task and length, seed
        (:class:`~headscope.analysis.long_context_tasks.TaskSuite`; its ``min_rate`` is not used here:
        a task the model cannot do shows as its accuracy, and its trials do not count towards the scores).
    store : every trial is stored as it finishes and reused when asked again (the same store as the
        needle sweeps': a prompt decoded before is not decoded again); the sweep's tables are stored under
        :func:`task_sweep_key`, with the suite, so :func:`~headscope.analysis.retrieval.load_sweep` gives it
        back with its task columns and :func:`task_sweep_settings` says what ran.
    stop_at_newline : stop each decode at its first newline after some text (the paper's rule).
    progress : ``progress(fraction)`` of the trials; cancel : checked between decode steps (a cancelled
        sweep keeps what finished, ``cancelled=True``).

    Returns
    -------
    :class:`~headscope.analysis.retrieval.RetrievalSweep` whose ``tasks`` are its columns and ``depths`` empty.

    Raises
    ------
    InputError
        A suite value out of range or unknown, more trials than ``HEADSCOPE_MAX_SWEEP_TRIALS`` (checked
        before any prompt is built), or a length the model's context cannot hold.
    """
    checked = check_task_sweep(suite)
    prompts = checked.prompts(model)
    tasks, lengths = list(checked.tasks), list(checked.lengths)
    plan = [(lengths.index(p.length), tasks.index(task_of(p)), p, max_new_tokens_for([p])) for p in prompts]
    result = decode_plan(model, plan, lengths, tasks=tasks, store=store, stop_at_newline=stop_at_newline,
                         progress=progress, cancel=cancel)
    if store is not None and result.trials:
        suite_meta = {"tasks": tasks, "lengths": lengths, "n_per_task": checked.n_per_task, "seed": checked.seed,
                      "version": TASKS_VERSION}
        put_sweep(store, model, result, task_sweep_key(model.digest, checked, stop_at_newline),
                  {"suite": suite_meta, "max_new_tokens": max(steps for *_, steps in plan)})
    return result


@dataclass(frozen=True)
class TaskSweepSettings:
    """What a stored task sweep ran: its suite and decode stop (:func:`task_sweep` takes them)."""

    suite: TaskSuite
    stop_at_newline: bool


def task_sweep_settings(store: Store, key: str) -> TaskSweepSettings | None:
    """The settings of the stored task sweep ``key``, or None when no task sweep is stored under it (a
    needle sweep's are :func:`headscope.analysis.retrieval.sweep_settings`)."""
    record = stored_record(store, key, "retrieval_sweep")
    suite = record.meta.get("suite") if record is not None else None
    if not isinstance(suite, dict):
        return None
    try:
        checked = checked_suite(TaskSuite(tuple(suite["tasks"]), tuple(suite["lengths"]), suite["n_per_task"],
                                          suite["seed"]))
    except (KeyError, TypeError, InputError):  # not a record this module wrote
        return None
    return TaskSweepSettings(checked, bool(record.meta.get("stop_at_newline", False)))

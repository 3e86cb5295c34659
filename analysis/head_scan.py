"""Scan every head of a model on a needle-in-a-haystack sweep: the user action of the Heads page's
*Run sweep* and of ``headscope scan``.

:func:`scan` computes two things, each stored as it is finished, so a scan run again (after a cancel,
a crash, or with another S and W) computes only what is missing:

1. the sweep (:func:`headscope.analysis.retrieval.sweep`): Wu et al. 2024, "Retrieval Head Mechanistically
   Explains Long-Context Factuality" (arXiv:2404.15574), §2. For each (length, depth, needle) the model
   decodes greedily; at step t with generated token y_t, head (l, h) copy-pastes when
   ``j* = argmax_j A[l,h][t, j]`` lies in the needle and ``prompt_ids[j*] == y_t``. A trial's score is
   (copy-paste steps) / (needle tokens); a head's retrieval score is the mean over the trials whose
   answer was retrieved (ROUGE-1 recall > 0.5). Each trial is stored as it finishes.
2. every other registered per-head score over the sweep's distinct prompts (:func:`sweep_head_scores`:
   :func:`headscope.analysis.head_scores.score_prompts`, mean and spread over prompts), among them the
   streaming score with sink size S and recent window W (the training-free form of DuoAttention's
   split, Xiao et al. 2024, arXiv:2410.10819: the share of a head's attention on the first S and the
   last W keys; :mod:`headscope.analysis.streaming`) and the evidence score (question → needle
   attention mass). Stored under the model, the prompts, S and W.

The page's job and the CLI both call :func:`scan` and only translate its inputs and draw or write its
result; the Heads page's figures read the same stored scores back through :func:`sweep_head_scores`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from headscope.analysis.errors import InputError, shown
from headscope.analysis.greedy_decoding import DEFAULT_MAX_NEW_TOKENS
from headscope.analysis.head_scores import HeadScores, load_head_scores, score_prompts, trial_prompts
from headscope.analysis.models import LoadedModel
from headscope.analysis.niah import DEFAULT_DEPTH_RULE, Needle, check_streaming_window
from headscope.analysis.retrieval import RetrievalSweep, cancel_requested, sweep
from headscope.analysis.store import Store
from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW

Progress = Callable[[float], None]


@dataclass
class HeadScan:
    """What a scan found.

    Attributes
    ----------
    sweep : the needle-in-a-haystack sweep: retrieval scores ``[layer, head]`` (nan where no trial
        counted), KV-group aggregates, the accuracy grid and every finished trial; ``sweep.key`` names it
        in the store (and in the Heads page's link).
    scores : every other per-head score over the sweep's distinct prompts; None when no trial finished
        (there is no prompt to score) or the scan was cancelled before the scores.
    """

    sweep: RetrievalSweep
    scores: HeadScores | None


def sweep_head_scores(model: LoadedModel, found: RetrievalSweep, *, sink: int = DEFAULT_SINK,
                      window: int = DEFAULT_WINDOW, store: Store | None = None,
                      progress: Progress | None = None) -> HeadScores:
    """Every registered per-head score on each distinct prompt of ``found``'s trials, aggregated (mean,
    spread) over them, with question → needle as the evidence score's spans; the streaming score with
    S = ``sink`` and W = ``window``. Read back from ``store`` when stored there, else computed and stored.

    With a ``store`` the tables returned are the stored ones (float32 per prompt), also when just
    computed: the numbers a scan returns, writes and shows are then the same on its first run and on
    every later one.

    Parameters
    ----------
    found : a sweep with at least one finished trial.
    sink, window : the streaming score's S >= 0 and W >= 1.
    """
    scores = score_prompts(model, trial_prompts(found.trials), sink=sink, window=window, store=store,
                           progress=progress)
    if store is None:
        return scores
    return load_head_scores(store, scores.key) or scores


def _check_streaming_score(sink: object, window: object) -> None:
    """S and W are whole numbers of tokens, S >= 0 and W >= 1."""
    for value, name, least in ((sink, "sink size S", 0), (window, "window W", 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
            raise InputError(f"The streaming score's {name} must be a whole number of tokens >= {least}, "
                             f"got {shown(value)}.")


def scan(
    model: LoadedModel,
    needles: Sequence[Needle],
    lengths: Sequence[int],
    depths: Sequence[float],
    haystack: str,
    *,
    sink: int = DEFAULT_SINK,
    window: int = DEFAULT_WINDOW,
    depth_rule: str = DEFAULT_DEPTH_RULE,
    stop_at_newline: bool = False,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    store: Store | None = None,
    progress: Progress | None = None,
    scores_progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> HeadScan:
    """Run the needle-in-a-haystack sweep of ``needles`` × ``lengths`` × ``depths`` in ``haystack`` and
    score every head on its prompts (module docstring).

    Parameters
    ----------
    needles, lengths, depths, haystack, depth_rule, stop_at_newline, max_new_tokens :
        the sweep's, as :func:`headscope.analysis.retrieval.sweep` takes them (a haystack is text,
        never a path).
    sink, window : the streaming score's S and W; S + W must leave query rows to score in the shortest
        prompt, checked against ``lengths`` before anything runs and against the prompts as built.
    store : trials, the sweep and the scores are stored in it as they finish, and read back from it.
    progress : ``progress(fraction)`` of the sweep's trials (``i / n`` as each trial finishes).
    scores_progress : ``progress(fraction)`` of the prompts scored, after the sweep.
    cancel : checked between decode steps; a cancelled scan returns the finished trials, unscored.

    Returns
    -------
    :class:`HeadScan`.

    Raises
    ------
    InputError
        An S or W that is not a whole number in range, an S + W that leaves no query row to score, or what the sweep refuses (no needle, length or
        depth; a prompt that cannot be built; too many trials).
    """
    _check_streaming_score(sink, window)
    if lengths:  # none: the sweep says so
        check_streaming_window(int(sink), int(window), [int(n) for n in lengths])
    found = sweep(model, needles, lengths, depths, haystack, store=store, max_new_tokens=max_new_tokens,
                  depth_rule=depth_rule, stop_at_newline=stop_at_newline, progress=progress, cancel=cancel)
    if not found.trials or cancel_requested(cancel):
        return HeadScan(found, None)
    check_streaming_window(int(sink), int(window), [len(t.prompt_ids) for t in found.trials])  # as built
    return HeadScan(found, sweep_head_scores(model, found, sink=int(sink), window=int(window), store=store,
                                             progress=scores_progress))


def task_scan(model: LoadedModel, suite, *, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
              stop_at_newline: bool = False, store: Store | None = None, progress: Progress | None = None,
              scores_progress: Progress | None = None, cancel: Callable[[], bool] | None = None) -> HeadScan:
    """:func:`scan` on the long-context task suite's prompts instead of needles: the retrieval sweep of
    :func:`headscope.analysis.task_retrieval.task_sweep` (a ``[length, task]`` accuracy grid), then every
    other per-head score over its prompts. ``suite`` is a
    :class:`~headscope.analysis.long_context_tasks.TaskSuite`; the other arguments are :func:`scan`'s."""
    from headscope.analysis.task_retrieval import task_sweep

    _check_streaming_score(sink, window)
    found = task_sweep(model, suite, store=store, stop_at_newline=stop_at_newline, progress=progress, cancel=cancel)
    if not found.trials or cancel_requested(cancel):
        return HeadScan(found, None)
    check_streaming_window(int(sink), int(window), [len(t.prompt_ids) for t in found.trials])  # as built
    return HeadScan(found, sweep_head_scores(model, found, sink=int(sink), window=int(window), store=store,
                                             progress=scores_progress))

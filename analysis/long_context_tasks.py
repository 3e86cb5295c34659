"""A long-context task suite made here, offline: RULER-style prompts generated from shipped text with a seed.

The tasks follow Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?" (arXiv:2404.06654), section 3 (retrieval: NIAH single, multi-key, multi-value; multi-hop
tracing: variable tracking; aggregation: common-words extraction), with the passkey test of Mohtashami
& Jaggi 2023 (arXiv:2305.16300) beside them. Every prompt is a :class:`~headscope.analysis.niah.NiahPrompt`
built with :mod:`headscope.analysis.niah`'s own machinery (the haystack cut at sentence boundaries to
fit ``length`` tokens, the asked sentence placed at a depth, its token span located exactly), so
:func:`headscope.analysis.ablation_curve.retrieval_accuracy` and
:func:`headscope.analysis.kv_compression.evaluate_policies` score them unchanged: a prompt is answered
when the ROUGE-1 recall of ``prompt.needle.answer`` in the greedy answer exceeds 0.5.

========================  ===================================================================================
task                      prompt (``needle`` = the sentence whose span is ``needle_span``)
========================  ===================================================================================
``single_needle``         prose; one "One of the special magic numbers for {key} is {7 digits}."; asks it
``multi_key``             prose; four such sentences with different keys; asks one key's number
``multi_value``           prose; four sentences for one key, four numbers; asks all (needle: the first)
``variable_tracking``     passkey filler; ``VAR A = 52931.`` then ``VAR B = VAR A.`` … (4 hops, in order);
                          asks every variable holding the value (needle: the first assignment)
``common_words``          a list of words from the prose: 3 words 30 times each, the rest 3 times each,
                          shuffled; asks the 3 most common (needle: the whole list)
``passkey``               passkey filler; "The pass key is {5 digits}. Remember it. {…} is the pass key.";
                          asks "What is the pass key number?"
========================  ===================================================================================

Differences from RULER, for a small model and a CPU: one variable chain without distractor chains,
three common words asked rather than ten, an unnumbered word list, and numbers of 7 (5 for values a
model must list) digits. Keys are two words of the shipped prose joined by a hyphen (RULER: words or
UUIDs). A prompt's task is its needle's ``kind`` (:func:`task_of`); its ``id`` is
``task/length/seed/index``.

Every prompt is drawn from ``random.Random("headscope-tasks:{seed}:{task}:{length}:{index}")``, so the
suite is the same for the same seed on every machine. :func:`answer_rates` measures the uncompressed
model's answer rate per task with a Wilson interval, and :func:`doable` drops the tasks the model cannot
do uncompressed (scoring a compression on them would score noise), keeping their rate for the report.

Example
-------
>>> from headscope.analysis.models import load_model                           # doctest: +SKIP
>>> from headscope.analysis.long_context_tasks import task_prompts, answer_rates, doable
>>> model = load_model("smollm2-135m")                                          # doctest: +SKIP
>>> prompts = task_prompts(model, ["single_needle", "passkey"], [1024], 5)      # doctest: +SKIP
>>> rates = answer_rates(model, prompts)                                        # doctest: +SKIP
>>> kept, dropped = doable(prompts, rates, min_rate=0.5)                        # doctest: +SKIP
>>> rates["passkey"].text()                                                     # doctest: +SKIP
'1.00 [0.57, 1.00] n=5'
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from headscope.analysis.errors import InputError, shown
from headscope.analysis.niah import (
    DEFAULT_DEPTH_RULE,
    DEFAULT_TEMPLATE,
    Needle,
    NiahPrompt,
    _assemble,
    _check_prompt_args,
    _fill,
    _haystack_pieces,
    build_prompt,
    locate,
    named_haystack,
    prompt_text,
)

if TYPE_CHECKING:
    from headscope.analysis.intervals import Proportion
    from headscope.analysis.models import LoadedModel
    from headscope.analysis.store import Store

TASKS_VERSION = 1
"""Part of every stored key built from the suite's prompts: raised when a builder changes its prompts."""
MIN_LENGTH = 1024
MAX_LENGTH = 8192
"""The context lengths the suite builds, in tokens (RULER's shortest is 4k; 1k-2k fit a CPU)."""
MAX_PER_TASK = 500
"""The most prompts per task and length a request may ask for."""
DEFAULT_MIN_RATE = 0.5
"""A task is dropped when the uncompressed model answers fewer than this share of its prompts."""
NEEDLE_MAX_NEW_TOKENS = 24
"""Tokens a needle's answer (and a task's, unless it says otherwise) is decoded for."""

Builder = Callable[["LoadedModel", int, random.Random, str], NiahPrompt]


@dataclass(frozen=True)
class Task:
    """One task of the suite: what a page shows (``label``, ``description``), how a prompt is built
    (``builder(model, length, rng, id) -> NiahPrompt``) and how many tokens its answer may need."""

    label: str
    description: str
    builder: Builder
    max_new_tokens: int = NEEDLE_MAX_NEW_TOKENS


# ---------------------------------------------------------------------------------------------
# Shipped words


@lru_cache(maxsize=1)
def prose_words() -> tuple[str, ...]:
    """The distinct lower-case words of 4 to 10 letters of the shipped prose haystack, sorted: the
    vocabulary of keys and of the common-words list."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", named_haystack("prose")))))


def _key(rng: random.Random, taken: set[str]) -> str:
    words = prose_words()
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in taken:
            taken.add(key)
            return key


def _magic(key: str, value: int) -> str:
    return f"One of the special magic numbers for {key} is {value}."


def _depths(rng: random.Random, n: int) -> list[float]:
    """``n`` increasing depths in percent, one in the middle half of each of ``n`` equal parts of
    [5, 95], so that sentences placed at them keep their order and never touch."""
    part = 90.0 / n
    return [5.0 + part * (i + rng.uniform(0.25, 0.75)) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Assembly: niah's haystack cut, with more sentences than the asked one


def _insert_at(chosen: list[str], chosen_len: list[int], inserts: Sequence[tuple[str, int, float]]
               ) -> tuple[list[str], list[int]]:
    """``chosen`` with each ``(sentence, n_tokens, depth)`` inserted at the sentence boundary nearest to
    ``depth`` percent of the haystack's tokens (as :func:`headscope.analysis.niah._assemble` places a needle)."""
    total = sum(chosen_len)
    cum = [0]
    for n in chosen_len:
        cum.append(cum[-1] + n)
    candidates = [0] + [j for j in range(1, len(cum)) if chosen[j - 1].rstrip().endswith((".", "!", "?", '."'))]
    at = [min(candidates, key=lambda j: (abs(cum[j] - d / 100.0 * total), j)) for _, _, d in inserts]
    pieces, lens = list(chosen), list(chosen_len)
    # insert from the last position back, so earlier indices stay valid; equal positions keep their order
    for (sentence, n, _), j in sorted(zip(inserts, at, strict=True), key=lambda x: x[1], reverse=True):
        pieces.insert(j, " " + sentence)
        lens.insert(j, n)
    return pieces, lens


def with_sentences(model: LoadedModel, needle: Needle, others: Sequence[tuple[str, float]], haystack: str,
                   length: int, depth: float, template: str = DEFAULT_TEMPLATE) -> NiahPrompt:
    """:func:`headscope.analysis.niah.build_prompt` with more sentences: ``needle`` at ``depth`` and each
    ``(sentence, depth)`` of ``others`` at its depth (percent of the haystack's tokens), in a haystack
    cut to at most ``length`` tokens. Each of the other sentences must be located exactly once too."""
    length = _check_prompt_args(model, needle, haystack, length, depth, template, DEFAULT_DEPTH_RULE)
    sentences = [needle.needle.strip(), *(s.strip() for s, _ in others)]
    question = needle.question.strip()
    overhead = len(model.chat_ids(prompt_text(model, template, " ".join(sentences), question)))
    budget = length - overhead
    if budget < 1:
        raise InputError(f"length {length:,} is too short: the template, sentences and question alone take "
                         f"{overhead:,} tokens.")
    pieces, lengths = _haystack_pieces(model, haystack)
    chosen, chosen_len = _fill(pieces, lengths, budget)
    inserts = [(s.strip(), len(model.encode(" " + s.strip())), float(d)) for s, d in others]
    while True:
        merged, merged_len = _insert_at(chosen, chosen_len, inserts)
        prompt = _assemble(model, needle, merged, merged_len, depth, template, length)
        if prompt.n_tokens <= length or not chosen:
            break
        chosen.pop()
        chosen_len.pop()
    if prompt.n_tokens > length:
        raise InputError(f"length {length:,} is too short: the prompt without any haystack has "
                         f"{prompt.n_tokens:,} tokens.")
    for sentence, _ in others:
        locate(model, prompt.token_ids, sentence, "inserted sentence")
    return prompt


# ---------------------------------------------------------------------------------------------
# The tasks


def _single_needle(model: LoadedModel, length: int, rng: random.Random, id: str) -> NiahPrompt:
    key, value = _key(rng, set()), rng.randint(10**6, 10**7 - 1)
    needle = Needle(_magic(key, value), f"What is the special magic number for {key} mentioned in the text?",
                    str(value), id=id, kind="single_needle")
    return build_prompt(model, needle, named_haystack("prose"), length, rng.uniform(0, 100))


def _multi_key(model: LoadedModel, length: int, rng: random.Random, id: str) -> NiahPrompt:
    taken: set[str] = set()
    keys = [_key(rng, taken) for _ in range(4)]
    values = rng.sample(range(10**6, 10**7), 4)
    depths = _depths(rng, 4)
    rng.shuffle(depths)  # the asked key is any of the four places
    needle = Needle(_magic(keys[0], values[0]),
                    f"What is the special magic number for {keys[0]} mentioned in the text?",
                    str(values[0]), id=id, kind="multi_key")
    others = [(_magic(k, v), d) for k, v, d in zip(keys[1:], values[1:], depths[1:], strict=True)]
    return with_sentences(model, needle, others, named_haystack("prose"), length, depths[0])


def _multi_value(model: LoadedModel, length: int, rng: random.Random, id: str) -> NiahPrompt:
    key = _key(rng, set())
    values = rng.sample(range(10**4, 10**5), 4)
    depths = _depths(rng, 4)
    needle = Needle(_magic(key, values[0]), f"What are all the special magic numbers for {key} mentioned in the text?",
                    " ".join(map(str, values)), id=id, kind="multi_value")
    others = [(_magic(key, v), d) for v, d in zip(values[1:], depths[1:], strict=True)]
    return with_sentences(model, needle, others, named_haystack("prose"), length, depths[0])


def _variable_tracking(model: LoadedModel, length: int, rng: random.Random, id: str) -> NiahPrompt:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choice(letters) for _ in range(5))
        if name not in names and "VAR" not in name:
            names.append(name)
    value = rng.randint(10**4, 10**5 - 1)
    depths = _depths(rng, 5)
    needle = Needle(f"VAR {names[0]} = {value}.",
                    f"Which variables are assigned the value {value}, directly or through other variables, "
                    "in the text above?", " ".join(names), id=id, kind="variable_tracking")
    others = [(f"VAR {b} = VAR {a}.", d) for a, b, d in zip(names[:-1], names[1:], depths[1:], strict=True)]
    prompt = with_sentences(model, needle, others, named_haystack("passkey"), length, depths[0])
    starts = [prompt.needle_span[0]] + [locate(model, prompt.token_ids, s)[0] for s, _ in others]
    if starts != sorted(starts):
        raise InputError("The variable chain did not keep its order in the prompt; try another seed.")
    return prompt


COMMON_WORDS, COMMON_REPEATS, RARE_REPEATS = 3, 30, 3


def _common_words(model: LoadedModel, length: int, rng: random.Random, id: str,
                  template: str = DEFAULT_TEMPLATE) -> NiahPrompt:
    words = list(prose_words())
    rng.shuffle(words)
    common, rare = words[:COMMON_WORDS], words[COMMON_WORDS:]
    question = f"What are the {COMMON_WORDS} words that appear most often in the list above?"
    overhead = len(model.chat_ids(prompt_text(model, template, "", question)))
    cost = dict(zip(words, (len(x) for x in model.tokenizer([" " + w for w in words], add_special_tokens=False)
                            ["input_ids"]), strict=True))
    items = [w for w in common for _ in range(COMMON_REPEATS)]
    used = sum(cost[w] for w in items) + 2  # the full stop, and a first word that loses its space
    budget = length - overhead
    if used > budget:
        raise InputError(f"length {length:,} is too short for the common-words list.")
    k = 0
    while True:  # the rare words, each RARE_REPEATS times (more when the vocabulary runs out)
        w = rare[k % len(rare)]
        if used + RARE_REPEATS * cost[w] > budget:
            break
        items += [w] * RARE_REPEATS
        used += RARE_REPEATS * cost[w]
        k += 1
    rng.shuffle(items)
    while True:
        listed = " ".join(items) + "."
        needle = Needle(listed, question, " ".join(common), id=id, kind="common_words")
        text = prompt_text(model, template, listed, question)
        ids = model.chat_ids(text)
        if len(ids) <= length:
            break
        items.remove(next(w for w in reversed(items) if w not in common))
    return NiahPrompt(token_ids=ids, needle_span=locate(model, ids, listed, "word list"),
                      question_span=locate(model, ids, question, "question"), needle=needle, length=length,
                      depth=0.0, actual_depth=0.0, haystack_tokens=0, text=text)


def _passkey(model: LoadedModel, length: int, rng: random.Random, id: str) -> NiahPrompt:
    key = rng.randint(10**4, 10**5 - 1)
    needle = Needle(f"The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key number?",
                    str(key), id=id, kind="passkey")
    return build_prompt(model, needle, named_haystack("passkey"), length, rng.uniform(0, 100))


TASKS: dict[str, Task] = {
    "single_needle": Task("single needle", "one key's magic number hidden in prose (RULER NIAH single)",
                          _single_needle),
    "multi_key": Task("multi-key", "four keys with magic numbers in prose, one asked (RULER NIAH multi-key)",
                      _multi_key),
    "multi_value": Task("multi-value", "one key with four magic numbers in prose, all asked (RULER NIAH "
                                       "multi-value)", _multi_value, max_new_tokens=48),
    "variable_tracking": Task("variable tracking", "a chain VAR A = 52931, VAR B = VAR A, ... in filler; every "
                                                   "variable holding the value asked (RULER VT)",
                              _variable_tracking, max_new_tokens=48),
    "common_words": Task("common words", "a word list where three words recur 30 times; the three asked "
                                         "(RULER CWE)", _common_words, max_new_tokens=32),
    "passkey": Task("passkey", "a five-digit pass key in repetitive filler (Mohtashami & Jaggi 2023)", _passkey),
}
"""The suite's tasks by name; a new task is one entry (a builder returning a :class:`NiahPrompt`
whose needle's ``kind`` is the task's name)."""


# ---------------------------------------------------------------------------------------------
# The suite


def _whole(value: object, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        given = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) and len(str(value)) < 16 \
            else shown(value)
        raise InputError(f"{what} must be a whole number from {lo:,} to {hi:,}, got {given}.")
    return value


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """Task names a request gives, each one of :data:`TASKS`, duplicates dropped (order kept)."""
    if isinstance(tasks, str) or not isinstance(tasks, Sequence):
        raise InputError(f"Give the tasks as a list of names from {', '.join(TASKS)}.")
    if not tasks:
        raise InputError(f"Give at least one task, from {', '.join(TASKS)}.")
    unknown = [shown(t) if not isinstance(t, str) else repr(t[:40]) for t in tasks
               if not isinstance(t, str) or t not in TASKS]
    if unknown:
        raise InputError(f"Unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}.")
    return list(dict.fromkeys(tasks))


def task_prompts(model: LoadedModel, tasks: Sequence[str], lengths: Sequence[int], n_per_task: int,
                 seed: int = 0) -> list[NiahPrompt]:
    """The suite's prompts: ``n_per_task`` prompts of every task at every length (task-major order).

    Parameters
    ----------
    model : whose tokenizer and chat template build the prompts; every length must fit its context.
    tasks : names from :data:`TASKS`.
    lengths : context lengths in tokens, each from :data:`MIN_LENGTH` to :data:`MAX_LENGTH`; every prompt
        has at most that many tokens (and is filled close to it).
    n_per_task : prompts per task and length, from 1 to :data:`MAX_PER_TASK`.
    seed : a whole number >= 0; the same seed gives the same prompts.

    Returns
    -------
    list of :class:`NiahPrompt`; :func:`task_of` gives each prompt's task.
    """
    names = check_tasks(tasks)
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence) or not lengths:
        raise InputError(f"Give one or more context lengths from {MIN_LENGTH:,} to {MAX_LENGTH:,} tokens.")
    lengths = list(dict.fromkeys(_whole(n, MIN_LENGTH, MAX_LENGTH, "Context lengths of the task suite") for n in lengths))
    n_per_task = _whole(n_per_task, 1, MAX_PER_TASK, "The number of prompts per task")
    seed = _whole(seed, 0, 2**63 - 1, "The task suite's seed")
    too_long = [n for n in lengths if n > model.n_ctx]
    if too_long:
        raise InputError(f"length {max(too_long):,} is above the model's context of {model.n_ctx:,} tokens; "
                         "choose a shorter length.")
    prompts = []
    for name in names:
        for length in lengths:
            for i in range(n_per_task):
                prompts.append(_one_prompt(model, name, length, seed, i))
    return prompts


def _one_prompt(model: LoadedModel, name: str, length: int, seed: int, index: int) -> NiahPrompt:
    """One prompt; a draw whose sentences tokenisation merges with their neighbours is drawn again
    (from a seeded stream of its own, so the suite stays deterministic)."""
    error = None
    for attempt in range(4):
        rng = random.Random(f"headscope-tasks:{seed}:{name}:{length}:{index}" + (f":{attempt}" if attempt else ""))
        try:
            return TASKS[name].builder(model, length, rng, f"{name}/{length}/{seed}/{index}")
        except InputError as e:
            if "too short" in str(e) or "above the model's context" in str(e):
                raise
            error = e
    raise InputError(f"No {name} prompt of {length:,} tokens could be built: {error}")


def task_of(prompt: NiahPrompt) -> str:
    """The suite task a prompt belongs to (its needle's ``kind``)."""
    return prompt.needle.kind


def max_new_tokens_for(prompts: Sequence[NiahPrompt]) -> int:
    """Tokens to decode so that every prompt's task can give its whole answer (24 for other prompts)."""
    return max((TASKS[task_of(p)].max_new_tokens if task_of(p) in TASKS else NEEDLE_MAX_NEW_TOKENS for p in prompts),
               default=NEEDLE_MAX_NEW_TOKENS)


def answered(model: LoadedModel, prompts: Sequence[NiahPrompt], max_new_tokens: int | None = None, *,
             progress: Callable[[float], None] | None = None, cancel=None) -> list[bool]:
    """Whether the uncompressed model answers each prompt (greedy decoding; ROUGE-1 recall of the
    answer > 0.5, :func:`headscope.analysis.ablation_curve.retrieval_accuracy`).

    Decoding runs through :func:`headscope.analysis.greedy_decoding.greedy_decode` without recording (on
    the families statistics mode supports, the Hugging Face modules with the attention kernel: a 2,048-token
    prompt in less than half the bridge's time, whose eager attention builds every N × N pattern); the
    same tokens as the bridge's greedy decoding (``tests/analysis/test_long_context_tasks.py``)."""
    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.greedy_decoding import greedy_decode

    if not prompts:
        raise InputError("No task prompts to measure an answer rate on.")
    steps = max_new_tokens if max_new_tokens is not None else max_new_tokens_for(prompts)

    def decode(ids: Sequence[int], n: int) -> list[int]:
        return greedy_decode(model, ids, n, record=False, cancel=cancel).generated

    out = []
    for i, prompt in enumerate(prompts):
        out.append(retrieval_accuracy(model, [prompt], max_new_tokens=steps, cancel=cancel,
                                      continuation=decode).accuracy > 0.5)
        if progress is not None:
            progress((i + 1) / len(prompts))
    return out


def rates_of(prompts: Sequence[NiahPrompt], outcomes: Sequence[bool]) -> dict[str, Proportion]:
    """Per task (in first-seen order), the share of ``outcomes`` that are True, with its Wilson interval."""
    from headscope.analysis.intervals import proportion_of

    by_task: dict[str, list[bool]] = {}
    for prompt, ok in zip(prompts, outcomes, strict=True):
        by_task.setdefault(task_of(prompt), []).append(bool(ok))
    return {task: proportion_of(v) for task, v in by_task.items()}


def answer_rates(model: LoadedModel, prompts: Sequence[NiahPrompt], max_new_tokens: int | None = None, *,
                 progress: Callable[[float], None] | None = None, cancel=None) -> dict[str, Proportion]:
    """The uncompressed model's answer rate per task, with its n and 95 % Wilson interval
    (:mod:`headscope.analysis.intervals`). ``max_new_tokens`` defaults to :func:`max_new_tokens_for`."""
    return rates_of(prompts, answered(model, prompts, max_new_tokens, progress=progress, cancel=cancel))


@dataclass(frozen=True)
class TaskSuite:
    """What a request asks of the suite: the tasks, the lengths, prompts per task and length, the seed,
    and the lowest uncompressed answer rate a task needs to be kept (:func:`doable`)."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    n_per_task: int
    seed: int = 0
    min_rate: float = DEFAULT_MIN_RATE

    def prompts(self, model: LoadedModel) -> list[NiahPrompt]:
        """:func:`task_prompts` of this suite."""
        return task_prompts(model, list(self.tasks), list(self.lengths), self.n_per_task, self.seed)

    def key(self) -> list:
        """What identifies the suite's prompts and choice in a stored key."""
        return [TASKS_VERSION, list(self.tasks), list(self.lengths), self.n_per_task, self.seed, float(self.min_rate)]


def doable(prompts: Sequence[NiahPrompt], rates: dict[str, Proportion], min_rate: float = DEFAULT_MIN_RATE
           ) -> tuple[list[NiahPrompt], dict[str, Proportion]]:
    """The prompts of the tasks the model can do uncompressed, and the tasks dropped with their rate.

    A task is dropped when its answer rate is below ``min_rate`` (a number in [0, 1]): a compression
    scored on prompts the full model already fails would measure noise (RULER, section 4, reports a
    task only against the model's own baseline).
    """
    if isinstance(min_rate, bool) or not isinstance(min_rate, int | float) or not 0.0 <= min_rate <= 1.0:
        raise InputError(f"The lowest answer rate kept must be a number from 0 to 1, got {shown(min_rate)}.")
    missing = sorted({task_of(p) for p in prompts} - rates.keys())
    if missing:
        raise InputError(f"No answer rate for the task(s) {', '.join(missing)}: measure them with answer_rates.")
    dropped = {t: r for t, r in rates.items() if not r.n or r.value < min_rate}
    return [p for p in prompts if task_of(p) not in dropped], dropped


@dataclass(frozen=True)
class MeasuredSuite:
    """A suite's prompts checked against the uncompressed model: the ``kept`` prompts (of the tasks it can
    do), every task's answer ``rates``, the ``dropped`` tasks with their rate, the tokens decoded, and
    whether the uncompressed model answered each kept prompt (``kept_answered``, in order)."""

    kept: list[NiahPrompt]
    rates: dict[str, Proportion]
    dropped: dict[str, Proportion]
    max_new_tokens: int
    kept_answered: list[bool]

    def summary(self) -> dict[str, dict]:
        """Per task: answered, n, rate, its 95 % interval and whether it was dropped (JSON-ready)."""
        return {t: {"answered": r.successes, "n": r.n, "rate": r.value, "low": r.low, "high": r.high,
                    "dropped": t in self.dropped} for t, r in self.rates.items()}


RATES_KIND = "task_answer_rates"


def measured_suite(model: LoadedModel, suite: TaskSuite, store: Store | None = None, *,
                   progress: Callable[[float], None] | None = None, cancel=None) -> MeasuredSuite:
    """:meth:`TaskSuite.prompts`, their uncompressed answer rates (:func:`answer_rates`, stored under the
    model and the suite when a store is given) and :func:`doable`'s choice.

    Raises
    ------
    InputError
        when no task of the suite reaches ``suite.min_rate``: the message gives every task's rate.
    """
    from headscope.analysis.store import content_key
    from headscope.analysis.stored_results import stored_record

    prompts = suite.prompts(model)
    steps = max_new_tokens_for(prompts)
    # the device joins the key off the CPU (a GPU's kernels round differently); CPU keys stay as stored
    key = content_key(RATES_KIND, model.digest, suite.key()[:-1], steps,
                      *([model.device] if model.device != "cpu" else []))
    record = stored_record(store, key, RATES_KIND) if store is not None else None
    outcomes = record.meta.get("answered") if record is not None else None
    if not (isinstance(outcomes, list) and len(outcomes) == len(prompts) and all(isinstance(x, bool) for x in outcomes)):
        outcomes = answered(model, prompts, steps, progress=progress, cancel=cancel)
        if store is not None:
            store.put(key, RATES_KIND, {"answered": outcomes, "tasks": [task_of(p) for p in prompts]}, {})
    elif progress is not None:
        progress(1.0)
    rates = rates_of(prompts, outcomes)
    kept, dropped = doable(prompts, rates, suite.min_rate)
    if not kept:
        said = "; ".join(f"{t} {r.text()}" for t, r in rates.items())
        raise InputError(f"The uncompressed model answers no task of the suite often enough (at least "
                         f"{suite.min_rate:g} of its prompts): {said}. Choose other tasks or shorter lengths, or "
                         "lower the rate a task needs.")
    answered_kept = [bool(ok) for p, ok in zip(prompts, outcomes, strict=True) if task_of(p) not in dropped]
    return MeasuredSuite(kept, rates, dropped, steps, answered_kept)


def checked_suite(suite: TaskSuite) -> TaskSuite:
    """``suite`` with its values checked as :func:`task_prompts` checks them, without a model and before
    any prompt is built (tasks and lengths without duplicates), so a caller can count its prompts,
    ``len(tasks) * len(lengths) * n_per_task``, before building them."""
    if not isinstance(suite, TaskSuite):
        raise InputError("Give the task suite as a TaskSuite.")
    lengths = suite.lengths
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence) or not lengths:
        raise InputError(f"Give one or more context lengths from {MIN_LENGTH:,} to {MAX_LENGTH:,} tokens.")
    return TaskSuite(tuple(check_tasks(suite.tasks)),
                     tuple(dict.fromkeys(_whole(n, MIN_LENGTH, MAX_LENGTH, "Context lengths of the task suite")
                                         for n in lengths)),
                     _whole(suite.n_per_task, 1, MAX_PER_TASK, "The number of prompts per task"),
                     _whole(suite.seed, 0, 2**63 - 1, "The task suite's seed"), suite.min_rate)

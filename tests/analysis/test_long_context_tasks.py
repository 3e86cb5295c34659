"""The long-context task suite (analysis/long_context_tasks.py): RULER-style prompts from shipped text.

Unit tests build prompts with the embedded tokenizer on a tiny random Llama with 8,192 positions (the
builders read only the tokenizer, the chat template and the context); the integration test measures
the embedded model's uncompressed answer rate on two tasks at 1k tokens.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.intervals import wilson
from headscope.analysis.long_context_tasks import (
    MAX_LENGTH,
    MIN_LENGTH,
    TASKS,
    answer_rates,
    doable,
    task_of,
    task_prompts,
)
from headscope.analysis.niah import Needle


@pytest.fixture(scope="module")
def model8k(make_tiny_model):
    return make_tiny_model(max_positions=8192, name="tiny-8k")


@pytest.fixture(scope="module")
def suite(model8k):
    return task_prompts(model8k, list(TASKS), [1024, 2048], 3, seed=7)


def _span_text(model, prompt):
    start, end = prompt.needle_span
    return model.tokenizer.decode(prompt.token_ids[start:end]).strip()


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others(model8k, suite):
    again = task_prompts(model8k, list(TASKS), [1024, 2048], 3, seed=7)
    assert [p.token_ids for p in again] == [p.token_ids for p in suite]
    assert [p.needle for p in again] == [p.needle for p in suite]
    other = task_prompts(model8k, list(TASKS), [1024, 2048], 3, seed=8)
    for a, b in zip(suite, other, strict=True):
        assert a.needle.answer != b.needle.answer and a.token_ids != b.token_ids
    # prompts of one task differ from each other
    for task in TASKS:
        answers = [p.needle.answer for p in suite if task_of(p) == task]
        assert len(set(answers)) == len(answers), task


def test_every_task_and_length_is_there_in_order(suite):
    assert [task_of(p) for p in suite] == [t for t in TASKS for _ in range(6)]
    assert [p.length for p in suite] == [n for _ in TASKS for n in (1024, 1024, 1024, 2048, 2048, 2048)]
    assert len({p.needle.id for p in suite}) == len(suite)


def test_the_needle_span_spells_the_asked_sentence_and_the_answer_is_in_the_prompt(model8k, suite):
    for p in suite:
        assert _span_text(model8k, p) == p.needle.needle.strip(), p.needle.id
        qs, qe = p.question_span
        assert model8k.tokenizer.decode(p.token_ids[qs:qe]).strip() == p.needle.question, p.needle.id
        context = model8k.tokenizer.decode(p.token_ids[: p.question_span[0]])
        for word in p.needle.answer.split():
            assert word in context, (p.needle.id, word)
        assert p.needle.needle.strip() in p.text


def test_lengths_are_respected_and_filled(model8k, suite):
    for p in suite:
        assert p.n_tokens <= p.length
        assert p.n_tokens >= p.length - 64, (p.needle.id, p.n_tokens)
    long = task_prompts(model8k, list(TASKS), [MAX_LENGTH], 1, seed=1)
    assert all(MAX_LENGTH - 64 <= p.n_tokens <= MAX_LENGTH for p in long)


def test_multi_key_hides_four_keys_and_asks_one(suite):
    for p in (p for p in suite if task_of(p) == "multi_key"):
        keys = re.findall(r"special magic numbers for (\S+) is (\d+)\.", p.text)
        assert len(keys) == 4 and len({k for k, _ in keys}) == 4
        asked = re.search(r"number for (\S+) mentioned", p.needle.question).group(1)
        assert dict(keys)[asked] == p.needle.answer


def test_multi_value_lists_four_values_of_one_key(suite):
    for p in (p for p in suite if task_of(p) == "multi_value"):
        found = re.findall(r"special magic numbers for (\S+) is (\d+)\.", p.text)
        assert len(found) == 4 and len({k for k, _ in found}) == 1
        assert sorted(v for _, v in found) == sorted(p.needle.answer.split())


def test_variable_tracking_keeps_the_chain_in_order(suite):
    for p in (p for p in suite if task_of(p) == "variable_tracking"):
        names = p.needle.answer.split()
        value = re.search(r"VAR \w+ = (\d+)\.", p.needle.needle).group(1)
        assert p.needle.needle == f"VAR {names[0]} = {value}."
        where = [p.text.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:], strict=False)]
        assert p.text.index(p.needle.needle) < where[0] and where == sorted(where)
        assert value in p.needle.question


def test_common_words_asks_the_words_that_recur_most(suite):
    for p in (p for p in suite if task_of(p) == "common_words"):
        counts = Counter(p.needle.needle.rstrip(".").split())
        top = [w for w, _ in counts.most_common(3)]
        assert sorted(top) == sorted(p.needle.answer.split())
        assert min(counts[w] for w in top) > 2 * max(c for w, c in counts.items() if w not in top)


def test_a_prompt_round_trips_through_its_stored_settings(suite):
    for p in suite[::3]:
        settings = json.loads(json.dumps(p.settings()))
        assert Needle(**settings["needle"]) == p.needle and task_of(p) in TASKS


@pytest.mark.parametrize("kwargs, message", [
    ({"tasks": ["no_such_task"]}, "Unknown task"),
    ({"tasks": []}, "at least one task"),
    ({"tasks": "passkey"}, "list of names"),
    ({"tasks": [None]}, "Unknown task"),
    ({"tasks": [["passkey"]]}, "Unknown task"),
    ({"tasks": [{"passkey": 1}]}, "Unknown task"),
    ({"tasks": ["passkey", "passkey\x00"]}, "Unknown task"),
    ({"tasks": ["passkey", "../../etc/passwd"]}, "Unknown task"),
    ({"lengths": [0]}, "Context lengths"),
    ({"lengths": [MIN_LENGTH - 1]}, "from 1,024"),
    ({"lengths": [10**12]}, "Context lengths"),
    ({"lengths": [10**400]}, "Context lengths"),
    ({"lengths": [1024.5]}, "whole number"),
    ({"lengths": ["1024"]}, "whole number"),
    ({"lengths": [True]}, "whole number"),
    ({"lengths": [[1024]]}, "whole number"),
    ({"lengths": [float("nan")]}, "whole number"),
    ({"lengths": []}, "context lengths"),
    ({"lengths": "1024"}, "context lengths"),
    ({"n_per_task": 0}, "prompts per task"),
    ({"n_per_task": 10**9}, "prompts per task"),
    ({"n_per_task": -1}, "prompts per task"),
    ({"n_per_task": 2.0}, "prompts per task"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": None}, "seed"),
])
def test_hostile_requests_get_a_clear_message(model8k, kwargs, message):
    args = {"tasks": ["passkey"], "lengths": [1024], "n_per_task": 1, "seed": 0, **kwargs}
    with pytest.raises(InputError, match=message):
        task_prompts(model8k, **args)


def test_a_length_past_the_models_context_is_refused(tiny_model):
    with pytest.raises(InputError, match="above the model's context"):
        task_prompts(tiny_model, ["passkey"], [1024], 1)


def test_doable_drops_the_tasks_the_model_cannot_do_and_keeps_their_rate(suite):
    rates = {t: wilson(k, 6) for t, k in zip(TASKS, (6, 3, 2, 0, 1, 5), strict=True)}
    kept, dropped = doable(suite, rates, min_rate=0.5)
    assert set(dropped) == {"multi_value", "variable_tracking", "common_words"}
    assert dropped["multi_value"].successes == 2 and dropped["multi_value"].n == 6
    assert {task_of(p) for p in kept} == {"single_needle", "multi_key", "passkey"}
    assert kept == [p for p in suite if task_of(p) in {"single_needle", "multi_key", "passkey"}]
    assert doable(suite, rates, min_rate=0.0)[1] == {}
    for bad in (-0.1, 1.5, float("nan"), "0.5", None):
        with pytest.raises(InputError, match="lowest answer rate"):
            doable(suite, rates, min_rate=bad)
    with pytest.raises(InputError, match="No answer rate"):
        doable(suite, {"passkey": wilson(1, 1)})


def test_the_embedded_model_answers_single_needle_and_passkey_at_1k(real_model, one_thread):
    prompts = task_prompts(real_model, ["single_needle", "passkey"], [1024], 2, seed=0)
    rates = answer_rates(real_model, prompts)
    assert set(rates) == {"single_needle", "passkey"}
    for task, rate in rates.items():
        assert rate.n == 2 and rate.successes > 0, (task, rate)
        assert 0 <= rate.low <= rate.value <= rate.high <= 1


@pytest.mark.timeout(900)  # four decodings of six 1k prompts: about 2 minutes quiet, over 300 s beside two benches
def test_answered_gives_the_bridges_and_each_compression_backends_uncompressed_answers(real_model, one_thread):
    """The answer rates decode through the fastest exact path; the reference is the bridge's plain greedy
    decoding (:func:`headscope.analysis.ablation_curve.retrieval_accuracy` without hooks), prompt by prompt.
    A task curve's uncompressed baseline is those rates (compress_sweep does not decode the uncompressed
    model twice): statistics mode (the kernels, the curve's backend) and the cache backend with every group
    full answer each prompt as they do."""
    from headscope.analysis import kv_cache
    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.kv_compression import build_policy, policy_applied
    from headscope.analysis.long_context_tasks import answered, max_new_tokens_for

    prompts = task_prompts(real_model, ["single_needle", "passkey", "multi_key"], [1024], 2, seed=5)
    steps = max_new_tokens_for(prompts)
    got = answered(real_model, prompts, steps)
    assert 0 < sum(got) < len(prompts)  # both outcomes are compared
    reference = retrieval_accuracy(real_model, prompts, max_new_tokens=steps)
    assert [r > 0.5 for r in reference.recalls] == got
    with policy_applied(real_model, None, "statistics") as hooks:
        statistics = retrieval_accuracy(real_model, prompts, hooks, max_new_tokens=steps)
    assert [r > 0.5 for r in statistics.recalls] == got
    full = build_policy(real_model, "all_full", 1.0)

    def cached(ids, n):
        return kv_cache.greedy_continuation(real_model, full.full, ids, n, full.sink_size, full.recent_size).generated

    cache = retrieval_accuracy(real_model, prompts, max_new_tokens=steps, continuation=cached)
    assert [r > 0.5 for r in cache.recalls] == got


def test_compress_sweep_scores_the_suite_and_refuses_a_suite_the_model_cannot_do(model8k, store, one_thread):
    """On a tiny random model (it answers nothing): with min_rate 0 every task is kept, the curve's accuracy
    rests on the suite's prompts and carries each task's rate, and it reopens from the store; with the
    default min_rate no task is doable, which is said with every task's rate."""
    from headscope.analysis import kv_compression_sweep as kvs
    from headscope.analysis.long_context_tasks import TaskSuite
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep

    swept = sweep(model8k, load_needles()[:1], [1024], [50], load_haystack("prose"), store=store, max_new_tokens=4)
    suite = TaskSuite(("passkey", "single_needle"), (1024,), 1, seed=3, min_rate=0.0)
    args = dict(rankings=["retrieval"], fractions=[0.5], seeds=[0], sink_size=16, recent_size=64, store=store)
    stored = kvs.compress_sweep(model8k, swept, suite=suite, **args)
    curve = stored.curve
    assert curve.n_prompts == 2 and stored.key
    assert set(curve.meta["tasks"]) == {"passkey", "single_needle"}
    assert all(t["n"] == 1 and not t["dropped"] for t in curve.meta["tasks"].values())
    plain = kvs.compress_sweep(model8k, swept, **args)
    assert plain.key != stored.key and plain.curve.n_prompts == 1 and "tasks" not in plain.curve.meta
    again = kvs.compress_sweep(model8k, swept, suite=suite, **args)
    assert again.key == stored.key and again.curve.meta["tasks"] == curve.meta["tasks"]
    strict = TaskSuite(("passkey", "single_needle"), (1024,), 1, seed=3)
    with pytest.raises(InputError, match=r"answers no task of the suite.*passkey 0\.00 \[0\.00, 0\.\d+\] n=1"):
        kvs.compress_sweep(model8k, swept, suite=strict, **args)


def curve_prompts(suite, model):
    return [p for p in suite.prompts(model) if p.needle.kind == "passkey"]


def test_a_task_curves_baseline_is_the_suites_answer_rate_not_a_second_decoding(model8k, store, one_thread,
                                                                                monkeypatch):
    """The uncompressed model's answers were decoded to measure the suite's rates; its curve's baseline is
    their share over the kept tasks (n and interval included), and only the policies decode the prompts."""
    from headscope.analysis import kv_compression as kc
    from headscope.analysis import kv_compression_sweep as kvs
    from headscope.analysis import long_context_tasks as lct
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import content_key

    swept = sweep(model8k, load_needles()[:1], [1024], [50], load_haystack("prose"), store=store, max_new_tokens=4)
    # the tiny model answers nothing: made-up stored answers show where the baseline comes from
    suite = lct.TaskSuite(("single_needle", "passkey", "common_words"), (1024,), 3, seed=4, min_rate=0.5)
    prompts = suite.prompts(model8k)
    assert lct.task_of(prompts[0]) != "passkey"  # the kept task's answers are not the first ones
    said = {"single_needle": [True, False, False], "passkey": [False, True, True], "common_words": [False] * 3}
    told = [said[lct.task_of(p)][[q for q in prompts if lct.task_of(q) == lct.task_of(p)].index(p)] for p in prompts]
    key = content_key(lct.RATES_KIND, model8k.digest, suite.key()[:-1], lct.max_new_tokens_for(prompts))
    store.put(key, lct.RATES_KIND, {"answered": told, "tasks": [lct.task_of(p) for p in prompts]}, {})
    decoded = []
    measured = kc._measured

    def counted(model, policy, texts, prompts, *rest):
        decoded.append((policy is None or bool(policy.full.all()), len(prompts)))
        return measured(model, policy, texts, prompts, *rest)

    monkeypatch.setattr(kc, "_measured", counted)
    curve = kvs.compress_sweep(model8k, swept, rankings=["retrieval"], fractions=[0.5], seeds=[0], sink_size=16,
                               recent_size=64, suite=suite, store=store).curve
    assert curve.meta["tasks"]["single_needle"]["dropped"] and curve.meta["tasks"]["common_words"]["dropped"]
    base = curve.baseline.niah
    assert (base.successes, base.n) == (2, 3)  # the kept task, passkey: 2 of its 3 prompts
    assert curve.meta["baseline_niah"] == "answer rates"
    from headscope.analysis.head_scores import trial_prompts
    texts = [p.token_ids for p in trial_prompts(swept.trials)]
    assert curve.baseline.agreement == 1.0  # its text metrics are the uncompressed model's own
    assert curve.baseline.loss == pytest.approx(kc.text_metrics(model8k, texts).loss, abs=1e-6)
    assert curve.n_prompts == 3 and curve.evaluations[0].niah.n == 3
    assert all(n == 0 for uncompressed, n in decoded if uncompressed), decoded
    assert any(n == 3 for uncompressed, n in decoded if not uncompressed), decoded
    for wrong in ([True, True], [1, 0, 1], "yes", 3, (x for x in [True] * 3), [True, None, False]):
        with pytest.raises(InputError, match="outcome \\(True or False\\) for each of the 3 prompts"):
            kc.evaluate_policies(model8k, None, ["random"], [0.5], prompts=curve_prompts(suite, model8k),
                                 sink_size=16, recent_size=64, baseline_answered=wrong)


def test_measured_suite_stores_the_answers_and_reads_them_back(model8k, store, one_thread, monkeypatch):
    from headscope.analysis import long_context_tasks as lct

    suite = lct.TaskSuite(("passkey", "common_words"), (1024,), 1, seed=5, min_rate=0.0)
    with pytest.raises(InputError, match="No task prompts"):
        answer_rates(model8k, [])
    first = lct.measured_suite(model8k, suite, store)
    assert set(first.rates) == {"passkey", "common_words"} and first.dropped == {}
    assert first.max_new_tokens == 32 and len(first.kept) == 2  # common words' answer needs up to 32 tokens

    def no_decoding(*args, **kwargs):
        raise AssertionError("the stored answers should have been read back")

    monkeypatch.setattr(lct, "answered", no_decoding)
    again = lct.measured_suite(model8k, suite, store)
    assert again.rates == first.rates

"""Retrieval heads on the long-context task suite (analysis/task_retrieval.py, #42 item 3): a sweep over the
suite's prompts gives a [length, task] accuracy grid with n and Wilson intervals, scores heads on answered
trials only (Wu et al. 2024), stores and reuses trials in the needle sweeps' store, loads back with its task
columns, refuses bad suites before building a prompt; needle sweeps keep their keys and records."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.intervals import wilson
from headscope.analysis.long_context_tasks import TASKS, TaskSuite, max_new_tokens_for, task_of
from headscope.analysis.niah import Needle, named_haystack
from headscope.analysis.retrieval import (
    Trial,
    _sweep_key,
    cell_counts,
    load_sweep,
    retrieval_scores,
    run_trial,
    sweep,
    sweep_settings,
)
from headscope.analysis.store import Store
from headscope.analysis.task_retrieval import (
    TaskSweepSettings,
    check_task_sweep,
    task_sweep,
    task_sweep_key,
    task_sweep_settings,
)
from tests.analysis.forced_decoding import forcing_hooks


@pytest.fixture(scope="module")
def tiny2k(make_tiny_model):
    """A random 2-layer Llama with 2,048 positions: the suite's shortest prompts have 1,024 tokens."""
    return make_tiny_model(max_positions=2048, name="tiny-task-retrieval")


SUITE = TaskSuite(("passkey", "single_needle"), (1024,), 2, seed=3)


def test_a_task_sweep_has_one_column_per_task_and_n_prompts_per_cell(tiny2k, tmp_path):
    store = Store(tmp_path)
    seen = []
    swept = task_sweep(tiny2k, SUITE, store=store, progress=seen.append)
    assert swept.tasks == ["passkey", "single_needle"] and swept.depths == [] and swept.lengths == [1024]
    assert swept.column_name == "task" and swept.columns == ["passkey", "single_needle"]
    assert swept.accuracy.shape == swept.recall.shape == (1, 2)
    answered, n = swept.cell_counts()
    assert n.tolist() == [[2, 2]]
    cells = swept.accuracy_intervals()
    assert [c.n for c in cells[0]] == [2, 2] and cells[0][0] == wilson(int(answered[0, 0]), 2)
    assert [t.settings["needle"]["kind"] for t in swept.trials] == ["passkey"] * 2 + ["single_needle"] * 2
    # each prompt decodes its own task's answer length
    assert all(t.settings["max_new_tokens"] == TASKS[t.settings["needle"]["kind"]].max_new_tokens for t in swept.trials)
    assert seen[-1] == pytest.approx(1.0)
    assert swept.grid_text() == "lengths [1024], tasks passkey, single_needle"
    assert "task suite" in swept.settings_text()
    # stored: loads back with its task columns, the same grid and intervals, and says which suite ran
    assert swept.key == task_sweep_key(tiny2k.digest, SUITE)
    loaded = load_sweep(store, swept.key)
    assert loaded.tasks == swept.tasks and loaded.depths == []
    assert loaded.accuracy_intervals() == swept.accuracy_intervals()
    assert task_sweep_settings(store, swept.key) == TaskSweepSettings(SUITE, False)
    assert sweep_settings(store, swept.key) is None  # not a needle sweep's settings
    # run again: every trial is the stored one
    again = task_sweep(tiny2k, SUITE, store=store)
    assert again.key == swept.key and all(t.reused for t in again.trials)
    assert [t.key for t in again.trials] == [t.key for t in swept.trials]
    # the same suite asked with duplicates is the same sweep; the newline stop is another
    doubled = TaskSuite(("passkey", "single_needle", "passkey"), (1024, 1024), 2, seed=3)
    assert task_sweep(tiny2k, doubled, store=store).key == swept.key
    assert task_sweep_key(tiny2k.digest, SUITE, stop_at_newline=True) != swept.key


def test_only_answered_task_trials_score_heads_and_each_task_has_its_accuracy(tiny2k, tmp_path):
    """Two passkey prompts decoded with forced heads and tokens: one copies the needle (answered), one says
    banana (not); the sweep reuses those stored trials, so its scores are the answered trial's alone."""
    store = Store(tmp_path)
    suite = TaskSuite(("passkey",), (1024,), 2, seed=5)
    first, second = suite.prompts(tiny2k)
    steps = max_new_tokens_for([first])
    start, end = first.needle_span
    with tiny2k.bridge.hooks(fwd_hooks=forcing_hooks(tiny2k, first, first.token_ids[start:end])):
        good = run_trial(tiny2k, first, max_new_tokens=steps, store=store)
    banana = tiny2k.tokenizer.encode(" banana banana", add_special_tokens=False)
    with tiny2k.bridge.hooks(fwd_hooks=forcing_hooks(tiny2k, second, banana)):
        bad = run_trial(tiny2k, second, max_new_tokens=steps, store=store)
    assert good.counted and not bad.counted
    assert good.scores[0, 0] == pytest.approx(min(steps, end - start) / (end - start))
    swept = task_sweep(tiny2k, suite, store=store)
    assert [t.key for t in swept.trials] == [good.key, bad.key] and all(t.reused for t in swept.trials)
    assert (swept.n_counted, swept.n_trials) == (1, 2)
    np.testing.assert_allclose(swept.scores, good.scores)  # the unanswered trial does not count
    np.testing.assert_allclose(swept.scores, retrieval_scores(swept.trials, tiny2k.n_kv_heads).scores)
    assert swept.accuracy.tolist() == [[0.5]]
    assert swept.accuracy_intervals() == [[wilson(1, 2)]]
    assert swept.accuracy_intervals()[0][0].text() == "0.50 [0.09, 0.91] n=2"


def test_cell_counts_by_task_refuse_a_trial_of_another_task():
    def trial(task, counted):
        empty = np.zeros((0, 2, 4))
        return Trial(key="", settings={"length": 1024, "depth": 40.0, "needle": {"kind": task}}, prompt_ids=[],
                     generated=[], response="", recall=float(counted), counted=counted, scores=np.zeros((2, 4)),
                     argmax_keys=empty, argmax_weight=empty, hits=[], seconds=0.0)

    trials = [trial("passkey", True), trial("passkey", False), trial("multi_key", True)]
    answered, n = cell_counts(trials, [1024], [], ["passkey", "multi_key"])
    assert n.tolist() == [[2, 1]] and answered.tolist() == [[1, 1]]
    with pytest.raises(InputError, match="task 'common_words'"):
        cell_counts([trial("common_words", True)], [1024], [], ["passkey"])


HOSTILE_SUITES = [  # (tasks, lengths, prompts per task, seed, what the message says)
    (("nope",), (1024,), 1, 0, "Unknown task"), (("<script>alert(1)</script>",), (1024,), 1, 0, "Unknown task"),
    ((), (1024,), 1, 0, "at least one task"), ("passkey", (1024,), 1, 0, "list of names"),
    ((None,), (1024,), 1, 0, "Unknown task"), (("passkey",), (512,), 1, 0, "1,024 to 8,192"),
    (("passkey",), (8193,), 1, 0, "1,024 to 8,192"), (("passkey",), ("1024",), 1, 0, "1,024 to 8,192"),
    (("passkey",), (), 1, 0, "one or more context lengths"), (("passkey",), "1024", 1, 0, "one or more"),
    (("passkey",), (1024.0,), 1, 0, "1,024 to 8,192"), (("passkey",), (True,), 1, 0, "1,024 to 8,192"),
    (("passkey",), (1024,), 0, 0, "prompts per task"), (("passkey",), (1024,), -1, 0, "prompts per task"),
    (("passkey",), (1024,), "3", 0, "prompts per task"), (("passkey",), (1024,), 10**30, 0, "prompts per task"),
    (("passkey",), (1024,), 2.5, 0, "prompts per task"), (("passkey",), (1024,), True, 0, "prompts per task"),
    (("passkey",), (1024,), float("nan"), 0, "prompts per task"), (("passkey",), (1024,), 1, -1, "seed"),
    (("passkey",), (1024,), 1, "7", "seed"), (("passkey",), (1024,), 1, 2**64, "seed"),
]


@pytest.mark.parametrize("tasks, lengths, n, seed, said", HOSTILE_SUITES, ids=range(len(HOSTILE_SUITES)))
def test_a_bad_suite_is_refused_with_a_message_before_any_prompt(tiny2k, tasks, lengths, n, seed, said):
    with pytest.raises(InputError, match=said):
        task_sweep(tiny2k, TaskSuite(tasks, lengths, n, seed))


def test_the_trial_limit_is_checked_before_any_prompt_is_built(tiny2k, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_MAX_SWEEP_TRIALS", "5")
    suite = TaskSuite(("passkey", "multi_key", "common_words"), (1024, 2048), 1)
    for refuse in (check_task_sweep, lambda s: task_sweep(tiny2k, s)):
        with pytest.raises(InputError, match="6 trials .*limit is 5"):
            refuse(suite)
    assert check_task_sweep(TaskSuite(("passkey", "passkey"), (1024, 1024), 5)) == TaskSuite(("passkey",), (1024,), 5)
    with pytest.raises(InputError, match="above the model's context"):  # 4 trials: within, but 8k is too long
        task_sweep(tiny2k, TaskSuite(("passkey",), (1024, 8192), 2))
    assert task_of(TaskSuite(("passkey",), (1024,), 1).prompts(tiny2k)[0]) == "passkey"


NEEDLE = Needle("The vault code is 7731.", "What is the vault code?", "7731", id="vault")
OLD_META_KEYS = {"model_name", "model_digest", "needles", "lengths", "depths", "max_new_tokens", "trial_keys",
                 "n_trials", "n_counted", "cancelled", "depth_rule", "stop_at_newline", "version"}


def test_needle_sweeps_keep_their_keys_records_and_depth_columns(make_tiny_model, tmp_path):
    # the keys of sweeps stored before task sweeps existed (computed with the code of that time)
    needles = [{"needle": "a", "question": "b", "answer": "c", "id": "x", "kind": "fact"}]
    assert _sweep_key("digest0", needles, [512], [10.0, 50.0], "hay", "tmpl", 24, "nearest", False) == \
        "aceb8329cee1c4460b91a22646e70252047792ca28631d9cc52eeb3ac503b9b9"
    assert _sweep_key("digest0", needles, [512], [10.0], "hay", "tmpl", 24, "previous", True) == \
        "d1e4cf238bde49de0af4f43a0cedab709f4ac906058bacb2f90fe105b7d8c99a"
    tiny = make_tiny_model(max_positions=512, name="tiny-old-sweeps")
    store = Store(tmp_path)
    swept = sweep(tiny, [NEEDLE], [160], [25, 75], named_haystack("passkey"), store=store, max_new_tokens=2)
    assert set(store.get(swept.key).meta) == OLD_META_KEYS  # the record a needle sweep always wrote
    loaded = load_sweep(store, swept.key)
    assert loaded.tasks == [] and loaded.depths == [25.0, 75.0] and loaded.columns == [25.0, 75.0]
    assert loaded.column_name == "depth" and loaded.grid_text() == "lengths [160], depths [25.0, 75.0]"
    assert loaded.cell_counts()[1].tolist() == [[1, 1]]
    assert sweep_settings(store, swept.key).needles == [NEEDLE]
    assert task_sweep_settings(store, swept.key) is None


def test_a_cancelled_task_sweep_keeps_what_finished_and_loads_as_it_was(tiny2k, tmp_path):
    import threading

    store = Store(tmp_path)
    stop = threading.Event()
    part = task_sweep(tiny2k, SUITE, store=store, progress=lambda f: stop.set() if f >= 0.5 - 1e-9 else None,
                      cancel=stop)
    answered, n = part.cell_counts()
    assert part.cancelled and n.tolist() == [[2, 0]] and len(part.trials) == 2
    assert np.isnan(part.accuracy[0, 1]) and part.accuracy_intervals()[0][1].n == 0
    loaded = load_sweep(store, part.key)
    assert loaded.cancelled and loaded.cell_counts()[1].tolist() == [[2, 0]] and loaded.tasks == part.tasks


FORGED_SUITES = [{"tasks": "passkey", "lengths": [1024], "n_per_task": 2, "seed": 3},
                 {"tasks": ["passkey"], "lengths": None, "n_per_task": 2, "seed": 3},
                 {"tasks": ["passkey"], "lengths": [1024], "n_per_task": "2", "seed": 3},
                 {"tasks": ["rm -rf"], "lengths": [1024], "n_per_task": 2, "seed": 3},
                 {"lengths": [1024], "n_per_task": 2, "seed": 3}, "passkey", None, [1, 2]]


@pytest.mark.parametrize("forged", FORGED_SUITES, ids=range(len(FORGED_SUITES)))
def test_a_stored_record_with_a_forged_suite_has_no_task_settings(tiny2k, tmp_path, forged):
    store = Store(tmp_path)
    swept = task_sweep(tiny2k, TaskSuite(("passkey",), (1024,), 1, seed=3), store=store)
    record = store.get(swept.key)
    store.put(swept.key, "retrieval_sweep", {**record.meta, "suite": forged},
              {name: record.array(name, mmap=False) for name in ("scores", "group_max", "group_mean", "accuracy",
                                                                 "recall")})
    assert task_sweep_settings(store, swept.key) is None


def test_a_compression_curve_on_a_task_sweep_decodes_each_tasks_answer_length(tiny2k, tmp_path):
    """The Compress page given a task sweep scores its prompts as the sweep decoded them: a multi-value answer
    needs 48 tokens (four numbers), not the 24 a needle gets; a needle sweep's curve still decodes 24."""
    from headscope.analysis.kv_compression_sweep import compress_sweep

    store = Store(tmp_path)
    args = dict(rankings=["retrieval"], fractions=[0.5], seeds=[0], sink_size=16, recent_size=64, store=store)
    swept = task_sweep(tiny2k, TaskSuite(("multi_value",), (1024,), 1, seed=3), store=store)
    curve = compress_sweep(tiny2k, swept, **args).curve
    assert curve.meta["max_new_tokens"] == TASKS["multi_value"].max_new_tokens == 48
    needles = sweep(tiny2k, [Needle("The code is 7.", "What is the code?", "7")], [256], [50],
                    named_haystack("prose"), store=store, max_new_tokens=4)
    assert compress_sweep(tiny2k, needles, **args).curve.meta["max_new_tokens"] == 24


def test_an_ablation_curve_on_a_task_sweep_decodes_each_tasks_answer_length(tiny2k, tmp_path, monkeypatch):
    """An ablation curve scores a task sweep's prompts as the sweep decoded them, each for its own task's
    answer: 48 tokens for a multi-value answer (four numbers), 24 for a single needle beside it. A needle
    sweep's curve decodes 24 and keeps the key its stored curves have."""
    from collections import Counter

    from headscope.analysis import ablation_curve as ac
    from headscope.analysis.ablation import ABLATION_VERSION, AblationSpec
    from headscope.analysis.store import content_key

    store = Store(tmp_path)
    decoded = []
    greedy = ac.greedy_continuation

    def counted(model, ids, hooks, n, *args, **kwargs):
        decoded.append(n)
        return greedy(model, ids, hooks, n, *args, **kwargs)

    monkeypatch.setattr(ac, "greedy_continuation", counted)
    scores = np.arange(tiny2k.n_layers * tiny2k.n_heads, dtype=float).reshape(tiny2k.n_layers, tiny2k.n_heads)
    swept = task_sweep(tiny2k, TaskSuite(("single_needle", "multi_value"), (1024,), 1, seed=3), store=store)
    mixed_key, _, meta = ac.ablation_curve(tiny2k, scores, [0, 1], AblationSpec((), "zero"), store, on=swept,
                                           by_label="s", seeds=[0], outside_top=2)
    counts = Counter(decoded)
    assert set(counts) == {24, 48} and counts[24] == counts[48]  # one prompt of each task per curve point
    assert meta["decoded_tokens"] == {"single_needle": 24, "multi_value": TASKS["multi_value"].max_new_tokens}
    decoded.clear()
    needles = sweep(tiny2k, [Needle("The code is 7.", "What is the code?", "7")], [256], [50],
                    named_haystack("prose"), store=store, max_new_tokens=4)
    spec = AblationSpec((), "zero")
    key, _, _ = ac.ablation_curve(tiny2k, scores, [0, 1], spec, store, on=needles, by_label="s", seeds=[0],
                                  outside_top=2)
    assert decoded and set(decoded) == {24}
    # the key a needle curve was stored under before curves named their decode lengths
    assert key == content_key("ablation_curve", ABLATION_VERSION, tiny2k.digest, ["sweep", needles.key],
                              scores.round(6).tolist(), [0, 1], [0], "zero", None, None, 2) != mixed_key

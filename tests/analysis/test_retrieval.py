"""Retrieval score (Wu et al. 2024): hand-computed copy-paste cases, forced heads on a tiny model,
the ROUGE gate, KV-group aggregation, stored trials, cancel, and a small sweep on the real model."""

import threading

import numpy as np
import pytest
import torch

from headscope.analysis.errors import InputError
from headscope.analysis.niah import DEFAULT_TEMPLATE, Needle, build_prompt, load_haystack, load_needles
from headscope.analysis.retrieval import (
    Trial,
    copy_paste_hits,
    greedy_decode,
    load_sweep,
    retrieval_scores,
    rouge1_recall,
    run_trial,
    stop_ids,
    sweep,
    sweep_settings,
    trial_key,
    trial_prompt,
    trial_scores,
)
from headscope.analysis.store import Store, content_key
from tests.analysis.forced_decoding import forcing_hooks

NEEDLE = Needle(
    needle="The combination for the blue locker is 4817.",
    question="What is the combination for the blue locker?",
    answer="The combination for the blue locker is 4817",
    id="test",
)


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    """A random 2-layer Llama (4 query heads, 2 key-value heads) with SmolLM2's tokenizer."""
    return make_tiny_model(max_positions=1024, name="tiny-retrieval")


@pytest.fixture(scope="module")
def prompt(tiny):
    return build_prompt(tiny, NEEDLE, load_haystack("prose"), 200, 50)


def make_trial(scores, counted, recall=1.0):
    scores = np.asarray(scores, dtype=np.float32)
    empty = np.zeros((0,) + scores.shape)
    return Trial(
        "k", {"length": 1, "depth": 0.0}, [1], [], "", recall, counted, scores, empty, empty, [], 0.0
    )


# -- pure pieces, by hand ----------------------------------------------------------------------


def test_rouge1_recall_by_hand():
    assert rouge1_recall("Ottilie Brandvold", "It was ottilie BRANDVOLD.") == 1.0
    assert rouge1_recall("eat a pear tart", "a tart") == 0.5  # {a, tart} of {eat, a, pear, tart}
    assert rouge1_recall("41 metres", "41 meters") == 0.5  # no stemming, no spelling variants
    assert rouge1_recall("6:45", "at 6 45") == 1.0  # words are runs of [a-z0-9]
    assert rouge1_recall("the the cat", "the cat") == 2 / 3  # counts are clipped
    assert rouge1_recall("", "anything") == 0.0


def test_copy_paste_hits_by_hand():
    # Prompt: positions 0..5 ; needle span (2, 5) = tokens [30, 40, 50]. Three decode steps, one
    # layer, three heads. Generated tokens: 30, 40, 99.
    prompt_ids = [10, 20, 30, 40, 50, 60]
    generated = [30, 40, 99]
    argmax = np.array(
        [
            [[2, 0, 2]],  # step 0: head 0 on needle pos 2 (token 30 == y) hit; head 1 on pos 0 no; head 2 hit
            [[3, 3, 2]],  # step 1: heads 0, 1 on pos 3 (40 == y) hit; head 2 on 30 != 40 no
            [[4, 6, 5]],  # step 2: y = 99 matches nothing; pos 6 is a generated token, pos 5 outside needle
        ]
    )
    hits = copy_paste_hits(argmax, generated, prompt_ids, (2, 5))
    expected = np.array([[[True, False, True]], [[True, True, False]], [[False, False, False]]])
    np.testing.assert_array_equal(hits, expected)
    np.testing.assert_allclose(trial_scores(hits, 3), [[2 / 3, 1 / 3, 1 / 3]], rtol=1e-6)


def test_copy_paste_needs_the_token_inside_the_span():
    # Token 30 also occurs outside the needle (position 0): attending there is no copy-paste.
    hits = copy_paste_hits(np.array([[[0, 2]]]), [30], [30, 1, 30, 2], (2, 3))
    np.testing.assert_array_equal(hits, [[[False, True]]])
    with pytest.raises(ValueError, match="needle_span"):
        copy_paste_hits(np.array([[[0]]]), [1], [1, 2], (1, 5))


def test_rouge_gate_discards_failed_trials_and_groups_aggregate_query_heads():
    # 1 layer, 4 query heads, 2 key-value heads (heads 0-1 read kv 0, heads 2-3 read kv 1).
    good1 = make_trial([[1.0, 0.0, 0.2, 0.4]], counted=True)
    good2 = make_trial([[0.5, 0.0, 0.4, 0.0]], counted=True)
    failed = make_trial([[0.0, 1.0, 1.0, 1.0]], counted=False, recall=0.5)
    r = retrieval_scores([good1, failed, good2], n_kv_heads=2)
    assert (r.n_trials, r.n_counted) == (3, 2)
    np.testing.assert_allclose(r.scores, [[0.75, 0.0, 0.3, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(r.group_max, [[0.75, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(r.group_mean, [[0.375, 0.25]], rtol=1e-6)
    assert r.share_above(0.1) == 0.75
    none = retrieval_scores([failed], n_kv_heads=2)
    assert none.n_counted == 0 and np.isnan(none.scores).all()
    with pytest.raises(InputError):
        retrieval_scores([], n_kv_heads=2)


# -- decoding on a tiny random model -----------------------------------------------------------


def test_greedy_decode_matches_generate_and_full_forward_rows(tiny, prompt):
    d = greedy_decode(tiny, prompt.token_ids, max_new_tokens=6)
    ids = torch.tensor([prompt.token_ids])
    with torch.inference_mode():
        ref = tiny.hf_model.generate(
            ids, max_new_tokens=6, do_sample=False, eos_token_id=sorted(stop_ids(tiny))
        )
    assert d.generated == ref[0, len(prompt.token_ids) :].tolist()
    # The kept row t is the attention row of the query that produced token t: compare with the
    # patterns of one full forward pass over prompt + generated tokens.
    full = torch.tensor([prompt.token_ids + d.generated])
    with torch.inference_mode():
        _, cache = tiny.bridge.run_with_cache(full, names_filter=lambda n: n.endswith("hook_pattern"))
    n = len(prompt.token_ids)
    for layer in range(tiny.n_layers):
        rows = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, n - 1 : n - 1 + len(d.generated), :]
        w, j = rows.max(-1)  # [head, step]
        np.testing.assert_array_equal(d.argmax_keys[:, layer, :], j.T.numpy())
        np.testing.assert_allclose(d.argmax_weight[:, layer, :], w.T.numpy(), atol=1e-5)


def test_forced_needle_head_scores_one_and_elsewhere_head_scores_zero(tiny, prompt):
    start, end = prompt.needle_span
    copy = prompt.token_ids[start:end]
    with tiny.bridge.hooks(fwd_hooks=forcing_hooks(tiny, prompt, copy)):
        trial = run_trial(tiny, prompt, max_new_tokens=end - start + 4)
    assert trial.generated[: end - start] == copy and trial.generated[-1] == tiny.tokenizer.eos_token_id
    assert trial.response.strip() == NEEDLE.needle
    assert trial.recall == 1.0 and trial.counted
    assert trial.scores[0, 0] == pytest.approx(1.0)  # every needle token copied from the needle
    assert trial.scores[0, 1] == 0.0  # attends to position 0, outside the needle
    assert {(s, h) for s, layer, h in trial.hits if layer == 0 and h == 0} == {
        (s, 0) for s in range(end - start)
    }
    r = retrieval_scores([trial], tiny.n_kv_heads)
    assert r.group_max[0, 0] == pytest.approx(1.0)
    assert r.group_mean[0, 0] == pytest.approx(0.5)


def test_trial_without_the_answer_is_discarded(tiny, prompt):
    start, end = prompt.needle_span
    banana = tiny.encode(" banana") * 3
    with tiny.bridge.hooks(fwd_hooks=forcing_hooks(tiny, prompt, banana)):
        failed = run_trial(tiny, prompt, max_new_tokens=6)
    assert failed.response.strip() == "banana banana banana"
    assert failed.recall == 0.0 and not failed.counted
    with tiny.bridge.hooks(fwd_hooks=forcing_hooks(tiny, prompt, prompt.token_ids[start:end])):
        good = run_trial(tiny, prompt, max_new_tokens=end - start + 2)
    r = retrieval_scores([failed, good], tiny.n_kv_heads)
    assert r.n_counted == 1
    np.testing.assert_array_equal(r.scores, good.scores)


def test_trials_are_stored_and_reused(tiny, prompt, tmp_path):
    store = Store(tmp_path)
    first = run_trial(tiny, prompt, max_new_tokens=4, store=store)
    again = run_trial(tiny, prompt, max_new_tokens=4, store=store)
    assert not first.reused and again.reused
    assert again.generated == first.generated and again.response == first.response
    np.testing.assert_array_equal(again.scores, first.scores)
    np.testing.assert_array_equal(again.argmax_keys, first.argmax_keys)
    assert store.get(first.key).meta["settings"]["needle_span"] == list(prompt.needle_span)


def test_sweep_grid_progress_cancel_and_resume(tiny, tmp_path):
    store = Store(tmp_path)
    needles = [NEEDLE, load_needles()[0]]
    hay = load_haystack("prose")
    seen = []
    stop = threading.Event()

    def progress(f):
        seen.append(f)
        if f >= 0.5:  # two of four trials finished
            stop.set()

    part = sweep(
        tiny, needles, [160], [0, 100], hay, store=store, max_new_tokens=3, progress=progress, cancel=stop
    )
    assert part.cancelled and len(part.trials) == 2
    assert not np.isnan(part.accuracy[0, 0]) and np.isnan(part.accuracy[0, 1])
    assert seen == sorted(seen) and seen[-1] == 0.5
    full = sweep(tiny, needles, [160], [0, 100], hay, store=store, max_new_tokens=3)
    assert not full.cancelled and len(full.trials) == 4
    assert [t.reused for t in full.trials] == [True, True, False, False]
    assert full.accuracy.shape == (1, 2) and full.scores.shape == (2, 4) and full.group_max.shape == (2, 2)
    assert store.get(full.key).meta["trial_keys"] == [t.key for t in full.trials]
    loaded = load_sweep(store, full.key)
    np.testing.assert_array_equal(loaded.accuracy, full.accuracy)
    np.testing.assert_allclose(loaded.scores, full.scores, rtol=1e-6)
    assert [t.response for t in loaded.trials] == [t.response for t in full.trials]


def test_sweep_validates_every_prompt_before_decoding(tiny):
    hay = load_haystack("prose")
    with pytest.raises(InputError, match="depth"):
        sweep(tiny, [NEEDLE], [160], [50, 120], hay)
    with pytest.raises(InputError, match="context"):
        sweep(tiny, [NEEDLE], [160, 5000], [50], hay)
    with pytest.raises(InputError, match="needle"):
        sweep(tiny, [], [160], [50], hay)


# -- the embedded model ------------------------------------------------------------------------


@pytest.mark.integration
def test_small_sweep_finds_few_retrieval_heads(small_retrieval_sweep):
    """Wu et al. 2024 find retrieval heads (score > 0.1) to be under 5% of heads. On SmolLM2-135M a
    small sweep (3 needles × 2 depths at 256 tokens, see conftest) answers most needles and a few
    heads (about 3%) pass 0.1."""
    result = small_retrieval_sweep
    assert result.n_trials == 6
    assert result.n_counted >= 4, [(t.response, t.recall) for t in result.trials]
    scores = np.nan_to_num(result.scores)
    assert scores.max() > 0.1
    assert result.share_above(0.1) < 0.10
    # GQA tables agree with the per-query-head table
    np.testing.assert_allclose(result.group_max, scores.reshape(30, 3, 3).max(-1))


def test_decode_rows_replay_the_scored_steps(tiny, prompt):
    from headscope.analysis.retrieval import decode_rows

    trial = run_trial(tiny, prompt, max_new_tokens=5)
    n = len(prompt.token_ids)
    for layer, head in [(0, 0), (1, 3)]:
        rows = decode_rows(tiny, trial, layer, head)
        assert rows.shape == (len(trial.generated), n + len(trial.generated) - 1)
        for t, row in enumerate(rows):
            visible = n + t
            assert row[visible:].sum() == 0.0
            assert row[:visible].sum() == pytest.approx(1.0, abs=1e-5)
            assert row.argmax() == trial.argmax_keys[t, layer, head]
            assert row.max() == pytest.approx(float(trial.argmax_weight[t, layer, head]), abs=1e-5)


def test_decode_rows_show_a_forced_head_reading_the_needle(tiny, prompt):
    from headscope.analysis.retrieval import decode_rows

    start, end = prompt.needle_span
    copy = prompt.token_ids[start:end]
    with tiny.bridge.hooks(fwd_hooks=forcing_hooks(tiny, prompt, copy)):
        trial = run_trial(tiny, prompt, max_new_tokens=end - start + 2)
        rows = decode_rows(tiny, trial, 0, 0)
    for t in range(end - start):
        assert rows[t, start + t] == 1.0  # step t reads needle token t, which it then copies
    with pytest.raises(InputError, match="Head 9 is out of range in layer 0: the model has query heads 0..3"):
        decode_rows(tiny, trial, 0, 9)


def test_statistics_mode_decode_equals_the_eager_pattern_hook_path(real_model, monkeypatch, one_thread):
    """The kernel path (prefill and decode rows through kernels.attention) gives the eager numbers."""
    import headscope.analysis.greedy_decoding as decoding

    text = open("data/niah/haystack_prose.txt", encoding="utf-8").read()
    ids = real_model.encode(text)[:300]
    assert decoding.statistics_supported(real_model)
    kernel = decoding.greedy_decode(real_model, ids, 6, keep_row=(17, 3))
    monkeypatch.setattr(decoding, "statistics_supported", lambda model: False)
    eager = decoding.greedy_decode(real_model, ids, 6, keep_row=(17, 3))
    assert kernel.generated == eager.generated
    np.testing.assert_array_equal(kernel.argmax_keys, eager.argmax_keys)
    np.testing.assert_allclose(kernel.argmax_weight, eager.argmax_weight, atol=1e-5)
    for a, b in zip(kernel.rows, eager.rows, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_decoding_without_the_bridges_wrappers_keeps_tokens_and_argmax_keys(real_model, monkeypatch, one_thread):
    """With nothing hooked, decoding runs on the Hugging Face modules under the bridge (analysis.bare_model):
    on a needle prompt of the embedded model the tokens, argmax keys and weights and the kept row are
    those of the bridge's statistics-mode pass bit for bit, and those of the eager pattern hook."""
    import headscope.analysis.greedy_decoding as decoding

    prompt = build_prompt(real_model, load_needles()[0], load_haystack("prose"), 400, 50)
    assert decoding.bare_supported(real_model)
    bare = decoding.greedy_decode(real_model, prompt.token_ids, 10, keep_row=(17, 3))
    monkeypatch.setattr(decoding, "bare_supported", lambda model: False)
    bridge = decoding.greedy_decode(real_model, prompt.token_ids, 10, keep_row=(17, 3))
    monkeypatch.setattr(decoding, "statistics_supported", lambda model: False)
    eager = decoding.greedy_decode(real_model, prompt.token_ids, 10, keep_row=(17, 3))
    assert len(bare.generated) >= 5
    assert bare.generated == bridge.generated == eager.generated
    np.testing.assert_array_equal(bare.argmax_keys, bridge.argmax_keys)
    np.testing.assert_array_equal(bare.argmax_weight, bridge.argmax_weight)
    np.testing.assert_array_equal(bare.argmax_keys, eager.argmax_keys)
    np.testing.assert_allclose(bare.argmax_weight, eager.argmax_weight, atol=1e-5)
    for a, b, c in zip(bare.rows, bridge.rows, eager.rows, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, atol=1e-5)


def test_a_hook_on_the_bridge_keeps_decoding_on_the_bridge(tiny, prompt):
    """A hook (an ablation, a capture) must fire: decoding then runs through the bridge, not its modules."""
    import headscope.analysis.greedy_decoding as decoding

    fired = []
    assert decoding.bare_supported(tiny)
    with tiny.bridge.hooks(fwd_hooks=[("blocks.1.attn.hook_z", lambda z, hook: fired.append(z.shape[1]))]):
        assert not decoding.bare_supported(tiny)
        decoding.greedy_decode(tiny, prompt.token_ids, 3, force=[11, 12, 13])
    assert fired == [len(prompt.token_ids) - 1, 1, 1, 1]
    assert decoding.bare_supported(tiny)


def test_newline_stop_ends_the_decode_at_the_first_newline_after_text_and_keys_stay(tiny, prompt, tmp_path):
    """The retrieval-head paper's rule, as an option: a leading newline does not stop the decode, the
    first newline after the answer does; the default decodes on (to EOS) and keeps its old trial key."""
    nl = tiny.tokenizer.encode("\n")
    answer = tiny.tokenizer.encode("4817")
    more = tiny.tokenizer.encode(" The combination")
    output = nl + answer + nl + more
    store = Store(tmp_path)
    with tiny.bridge.hooks(fwd_hooks=forcing_hooks(tiny, prompt, output)):
        stopped = run_trial(tiny, prompt, max_new_tokens=len(output) + 4, store=store, stop_at_newline=True)
        default = run_trial(tiny, prompt, max_new_tokens=len(output) + 4, store=store)
    assert stopped.generated == nl + answer + nl  # the newline that ends the line is kept, like an EOS
    assert stopped.response.strip() == "4817"
    assert stopped.settings["stop_at_newline"] is True and "stop_at_newline" not in default.settings
    assert default.generated == output + [tiny.tokenizer.eos_token_id]
    assert default.key == trial_key(tiny, prompt, len(output) + 4) != stopped.key


def test_sweep_settings_are_stored_and_defaults_keep_the_sweep_key(tiny, tmp_path):
    store = Store(tmp_path)
    needle = [NEEDLE]
    hay = load_haystack("prose")
    plain = sweep(tiny, needle, [160], [50], hay, store=store, max_new_tokens=2)
    assert plain.depth_rule == "nearest" and not plain.stop_at_newline
    assert plain.key == content_key("retrieval_sweep", 1, tiny.digest, [NEEDLE.to_dict()], [160], [50.0],
                                    content_key(hay), DEFAULT_TEMPLATE, 2)  # the key of sweeps stored before
    other = sweep(tiny, needle, [160], [50], hay, store=store, max_new_tokens=2, depth_rule="previous",
                  stop_at_newline=True)
    assert other.key != plain.key
    loaded = load_sweep(store, other.key)
    assert loaded.depth_rule == "previous" and loaded.stop_at_newline
    assert "previous sentence boundary" in loaded.settings_text() and "newline" in loaded.settings_text()
    assert trial_prompt(loaded.trials[0]).depth_rule == "previous"


def test_stored_sweep_settings_run_the_same_sweep_again(tiny, tmp_path):
    """What the Heads page fills its form with from a sweep's link: the sweep's own settings, so
    Run computes the same sweep (same key), never the form's defaults."""
    from headscope.analysis.niah import named_haystack

    store = Store(tmp_path)
    own = Needle("The vault code is 4412.", "What is the vault code?", "4412", id="custom-1", kind="custom")
    first = sweep(tiny, [own], [160], [40], named_haystack("passkey"), store=store, max_new_tokens=2,
                  depth_rule="previous", stop_at_newline=True)
    settings = sweep_settings(store, first.key)
    assert settings.needles == [own] and settings.lengths == [160] and settings.depths == [40.0]
    assert settings.haystack == "passkey" and settings.depth_rule == "previous" and settings.stop_at_newline
    again = sweep(tiny, settings.needles, settings.lengths, settings.depths, named_haystack(settings.haystack),
                  store=store, max_new_tokens=2, depth_rule=settings.depth_rule,
                  stop_at_newline=settings.stop_at_newline)
    assert again.key == first.key
    mine = sweep(tiny, [NEEDLE], [160], [50], "My own words. " * 200, store=store, max_new_tokens=2)
    assert sweep_settings(store, mine.key).haystack is None  # own text is stored only as its digest
    assert sweep_settings(store, "0" * 64) is None


# -- n and the 95 % interval of every accuracy shown (#42 item 4) -----------------------------


def counted_trial(length, depth, counted):
    trial = make_trial(np.zeros((2, 4)), counted)
    trial.settings = {"length": length, "depth": depth}
    return trial


def test_cell_counts_are_the_trials_finished_in_each_cell_one_per_needle():
    from headscope.analysis.intervals import wilson
    from headscope.analysis.retrieval import cell_counts

    trials = [counted_trial(160, 25.0, True), counted_trial(160, 25.0, False), counted_trial(160, 25.0, True),
              counted_trial(160, 75.0, False), counted_trial(320, 75.0, True)]
    answered, n = cell_counts(trials, [160, 320], [25.0, 75.0])
    assert n.tolist() == [[3, 1], [0, 1]] and answered.tolist() == [[2, 0], [0, 1]]
    assert n.dtype.kind == "i" and answered.dtype.kind == "i"
    with pytest.raises(ValueError, match="length 512"):
        cell_counts([counted_trial(512, 25.0, True)], [160], [25.0])
    # the whole sweep's proportion and its cells', from the same counts
    swept = retrieval_scores(trials, 2)
    assert (swept.n_counted, swept.n_trials) == (3, 5)
    assert wilson(3, 5).text() == "0.60 [0.23, 0.88] n=5"


def test_a_sweeps_cells_carry_n_and_a_wilson_interval_partial_and_reloaded(tiny, tmp_path):
    from headscope.analysis.intervals import wilson

    store = Store(tmp_path)
    needles = [NEEDLE, load_needles()[0], NEEDLE]  # a needle given twice is decoded (and counted) twice
    hay = load_haystack("prose")
    stop = threading.Event()
    part = sweep(tiny, needles, [160], [0, 100], hay, store=store, max_new_tokens=2,
                 progress=lambda f: stop.set() if f >= 4 / 6 - 1e-9 else None, cancel=stop)
    answered, n = part.cell_counts()
    assert part.cancelled and n.tolist() == [[3, 1]]  # the partial cell rests on the one trial that finished
    cells = part.accuracy_intervals()
    for j in range(2):
        k = int(answered[0, j])
        assert cells[0][j] == wilson(k, int(n[0, j]))
        assert part.accuracy[0, j] == pytest.approx(k / n[0, j])
    assert part.overall_accuracy() == wilson(part.n_counted, part.n_trials)
    full = sweep(tiny, needles, [160], [0, 100], hay, store=store, max_new_tokens=2)
    loaded = load_sweep(store, full.key)
    assert loaded.cell_counts()[1].tolist() == full.cell_counts()[1].tolist() == [[3, 3]]
    assert loaded.accuracy_intervals() == full.accuracy_intervals()
    assert loaded.overall_accuracy().n == 6

"""The ``cache`` backend (analysis/kv_cache.py): a KV cache physically as small as the policy says, giving
the masking backends' tokens and losses, on every tiny family and the embedded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headscope.analysis import kv_cache
from headscope.analysis.ablation import greedy_continuation
from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import (
    Policy,
    build_policy,
    dtype_bytes,
    evaluate_policies,
    kv_memory,
    policy_applied,
    smallest_model_window,
    text_metrics,
)
from headscope.analysis.models import wrap_model
from tests.tiny_families import FAMILIES, tiny_family_model

RNG_SEED = 11


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, embedded_tokenizer):
    hf = tiny_family_model(request.param, len(embedded_tokenizer))
    return wrap_model(hf, embedded_tokenizer, name=f"tiny-{request.param}", digest=f"tiny-{request.param}-kv-cache")


def _policy(model, sink: int, recent: int, seed: int = 0) -> Policy:
    """A policy with both kinds of group on every layer where the layout allows (one KV head: full and
    streaming layers in turn)."""
    rng = np.random.default_rng(seed)
    full = rng.random((model.n_layers, model.n_kv_heads)) < 0.5
    if model.n_kv_heads > 1:
        full[:, 0], full[:, -1] = True, False
    else:
        full[:, 0] = np.arange(model.n_layers) % 2 == seed % 2
    return Policy(full, sink, recent)


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 2000, size=n).tolist()


def _masked_continuation(model, policy: Policy, ids: list[int], n: int) -> list[int]:
    """The masking backends' greedy tokens: eager, except where eager cannot place the sinks in a
    sliding-window layer's shortened cache (statistics mode knows the positions there)."""
    window = smallest_model_window(model)
    backend = "statistics" if window and policy.sink_size and len(ids) + n > window else "eager"
    with policy_applied(model, policy, backend) as hooks:
        return greedy_continuation(model, ids, hooks, n, stop_at_eos=False)


def test_loss_and_argmax_equal_eager_on_every_family(family):
    for seed, (sink, recent, chunk) in enumerate([(3, 5, 7), (0, 4, 64), (2, 9, 1)]):
        policy = _policy(family, sink, recent, seed)
        ids = _ids(40, seed)
        with policy_applied(family, policy, "eager") as hooks:
            ref = text_metrics(family, [ids], hooks)
        got = kv_cache.text_metrics(family, policy.full, [ids], sink, recent, chunk=chunk)
        assert abs(got.loss - ref.loss) < 1e-5
        assert np.array_equal(got.argmax[0], ref.argmax[0])


def test_greedy_tokens_equal_the_masking_backends_on_every_family(family):
    for seed, (sink, recent, chunk) in enumerate([(3, 5, 8), (0, 4, 3), (2, 20, 512)]):
        policy = _policy(family, sink, recent, seed)
        ids = _ids(30, 100 + seed)
        want = _masked_continuation(family, policy, ids, 12)
        got = kv_cache.greedy_continuation(family, policy.full, ids, 12, sink, recent, chunk=chunk)
        assert got.generated == want


def test_eager_with_no_sinks_decodes_the_same_tokens_on_the_window_families(family):
    """With S = 0 eager can decode past a model's sliding window: the comparison is against eager itself."""
    policy = _policy(family, 0, 3, 5)
    ids = _ids(30, 7)
    with policy_applied(family, policy, "eager") as hooks:
        want = greedy_continuation(family, ids, hooks, 10, stop_at_eos=False)
    assert kv_cache.greedy_continuation(family, policy.full, ids, 10, 0, 3, chunk=4).generated == want


def test_the_cache_holds_exactly_what_the_policy_keeps(tiny_model):
    """Between passes a streaming group holds min(n, S + W) keys and a full group n: the bytes kept are
    kv_memory's count after the prefill and at every decode step, and the storage allocated adds at most
    the full groups' headroom (a streaming group's storage is exactly what it keeps)."""
    sink, recent = 4, 6
    policy = _policy(tiny_model, sink, recent)
    ids = _ids(37, 3)
    per = []
    out = kv_cache.greedy_continuation(
        tiny_model, policy.full, ids, 8, sink, recent, chunk=5,
        on_step=lambda step, cache: per.append((cache.get_seq_length(), cache.kept_bytes(), cache.nbytes(),
                                                cache.kept())))
    element = dtype_bytes(tiny_model)
    per_token = 2 * tiny_model.d_head * element  # K and V of one group
    headroom = kv_cache.HEADROOM * per_token * int(policy.full.any(axis=1).sum())
    counted = kv_memory(policy, len(ids), tiny_model.d_head, element).bytes
    assert out.prefill_kept_bytes == counted <= out.prefill_bytes <= counted + headroom
    assert len(per) == len(out.generated) - 1
    for n, kept_bytes, nbytes, kept in per:
        counted = kv_memory(policy, n, tiny_model.d_head, element)
        assert kept_bytes == counted.bytes <= nbytes <= counted.bytes + headroom
        assert (kept[policy.full] == n).all() and (kept[~policy.full] == sink + recent).all()
    streaming = build_policy(tiny_model, "all_streaming", 0.0, sink_size=sink, recent_size=recent)
    alone = kv_cache.greedy_continuation(tiny_model, streaming.full, ids, 3, sink, recent, chunk=5)
    assert alone.prefill_bytes == alone.final_bytes == kv_memory(streaming, len(ids), tiny_model.d_head, element).bytes


def test_a_long_cache_is_physically_smaller_and_decodes_without_copying_itself(tiny_model):
    """At 480 tokens the all-streaming cache allocates (S + W) / 480 of the full one; the full cache's
    storage grows in steps of the headroom, so most decode steps leave its buffers where they were."""
    sink, recent = 4, 12
    ids = _ids(480, 5)
    full = build_policy(tiny_model, "all_full", 1.0)
    streaming = build_policy(tiny_model, "all_streaming", 0.0, sink_size=sink, recent_size=recent)
    pointers = []

    def seen(step, cache):
        pointers.append(cache.layers[0].parts[0].keys.data_ptr())

    got_full = kv_cache.greedy_continuation(tiny_model, full.full, ids, 12, sink, recent, on_step=seen)
    got_stream = kv_cache.greedy_continuation(tiny_model, streaming.full, ids, 12, sink, recent)
    assert got_stream.prefill_bytes * 480 == got_full.prefill_kept_bytes * (sink + recent)
    assert len(set(pointers)) <= 2  # at most one regrowth in 11 steps


def test_a_streaming_cache_decodes_in_place_and_keeps_the_window(family):
    """Once a streaming part holds its S + W keys, each decoded token takes the slot of a key no later
    query sees: no layer's storage moves during the decode, and every layer keeps exactly its sinks
    (those inside the model's own window) and the last W positions. That the tokens stay the masking
    backends' is the tests above."""
    sink, recent = 3, 7
    streaming = build_policy(family, "all_streaming", 0.0, sink_size=sink, recent_size=recent)
    seen = []

    def step(_, cache):
        last = cache.get_seq_length() - 1
        for index, layer in enumerate(cache.layers):
            # what the policy and the model say the layer keeps, not the part's own fields
            model_window = family.facts.windows[index] or 0
            window = min(recent, model_window) if model_window else recent
            want = [j for j in range(sink) if not model_window or j > last - model_window]
            want += [j for j in range(last - window + 1, last + 1) if j >= sink]
            for part in layer.parts:
                seen.append(((index, part.groups[0]), part.keys.data_ptr(), sorted(part.positions.tolist()), want))

    kv_cache.greedy_continuation(family, streaming.full, _ids(40, 2), 12, sink, recent, chunk=16, on_step=step)
    assert len(seen) >= 11
    pointers = {}
    for where, pointer, positions, want in seen:
        assert positions == want, where
        pointers.setdefault(where, set()).add(pointer)
    assert all(len(p) == 1 for p in pointers.values()), pointers


def test_all_streaming_on_the_embedded_layout_keeps_a_constant_cache(real_model):
    """On SmolLM2 (30 layers × 3 KV groups, d_head 64, float32) an all-streaming cache of S=8, W=16 is
    30·3·24·2·64·4 = 1,105,920 bytes however long the prompt."""
    policy = build_policy(real_model, "all_streaming", 0.0, sink_size=8, recent_size=16)
    for n in (40, 90):
        out = kv_cache.greedy_continuation(real_model, policy.full, _ids(n, n), 1, 8, 16, chunk=32)
        assert out.prefill_bytes == out.prefill_kept_bytes == 30 * 3 * 24 * 2 * 64 * 4 == 1_105_920


def test_the_embedded_model_gives_eagers_tokens_and_loss_on_a_needle_prompt(real_model, one_thread):
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    prompt = build_prompt(real_model, load_needles()[0], load_haystack("prose"), 300, 50)
    rng = np.random.default_rng(RNG_SEED)
    full = rng.random((real_model.n_layers, real_model.n_kv_heads)) < 0.5
    policy = Policy(full, 16, 48)
    with policy_applied(real_model, policy, "eager") as hooks:
        ref = text_metrics(real_model, [prompt.token_ids], hooks)
        want = greedy_continuation(real_model, prompt.token_ids, hooks, 16)
    got = kv_cache.text_metrics(real_model, full, [prompt.token_ids], 16, 48, chunk=128)
    assert abs(got.loss - ref.loss) < 1e-5
    assert np.array_equal(got.argmax[0], ref.argmax[0])
    decoded = kv_cache.greedy_continuation(real_model, full, prompt.token_ids, 16, 16, 48, chunk=100)
    assert decoded.generated == want


def test_evaluate_policies_on_the_cache_backend_equals_eager(tiny_model):
    from headscope.analysis.niah import Needle, NiahPrompt

    texts = [_ids(30, 1), _ids(25, 2)]
    needle = Needle("The code is 4417.", "What is the code?", "4417")
    ids = _ids(28, 9)
    prompts = [NiahPrompt(ids, (3, 6), (20, 24), needle, 28, 50.0, 50.0, 20, "x")]
    kw = dict(texts=texts, prompts=prompts, sink_size=2, recent_size=5, max_new_tokens=6, seeds=[0, 1])
    eager = evaluate_policies(tiny_model, None, ["random", "all_full", "all_streaming"], [0.5], backend="eager", **kw)
    cache = evaluate_policies(tiny_model, None, ["random", "all_full", "all_streaming"], [0.5], backend="cache", **kw)
    assert cache.meta["backend"] == "cache"
    for a, b in zip(eager.evaluations + [eager.baseline], cache.evaluations + [cache.baseline], strict=True):
        assert a.policy.mask_key() == b.policy.mask_key()
        assert abs(a.loss - b.loss) < 1e-5 and a.agreement == b.agreement
        assert a.niah_accuracy == b.niah_accuracy or (np.isnan(a.niah_accuracy) and np.isnan(b.niah_accuracy))


@pytest.mark.parametrize("chunk", [0, -3])
def test_a_chunk_without_tokens_is_refused(tiny_model, chunk):
    with pytest.raises(InputError, match="at least one token"):
        kv_cache.text_metrics(tiny_model, np.ones((2, 2), bool), [_ids(5, 0)], 1, 2, chunk=chunk)


@pytest.mark.parametrize("shape", [(1, 2), (2, 3), (3, 2)])
def test_a_policy_of_another_layout_is_refused(tiny_model, shape):
    with pytest.raises(InputError, match="layers × KV heads"):
        kv_cache.greedy_continuation(tiny_model, np.ones(shape, bool), _ids(5, 0), 2, 1, 2)


def test_an_empty_prompt_and_negative_lengths_are_refused(tiny_model):
    with pytest.raises(InputError, match="empty"):
        kv_cache.greedy_continuation(tiny_model, np.ones((2, 2), bool), [], 2, 1, 2)
    with pytest.raises(InputError, match="between 0 and"):
        kv_cache.greedy_continuation(tiny_model, np.ones((2, 2), bool), [1, 2], -1, 1, 2)


def test_hooks_on_the_bridge_are_refused_not_ignored(tiny_model):
    """The passes run on the modules under the bridge: a user's hook would silently not fire."""
    def hook(x, hook=None):
        return x

    with tiny_model.bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", hook)]):
        with pytest.raises(InputError, match="hooks are attached"):
            kv_cache.greedy_continuation(tiny_model, np.ones((2, 2), bool), [1, 2, 3], 2, 1, 2)
        with pytest.raises(InputError, match="hooks are attached"):
            evaluate_policies(tiny_model, None, ["all_streaming"], [0.0], texts=[[1, 2, 3]], backend="cache")


def test_the_attention_outside_a_policy_cache_is_an_error_not_a_wrong_answer(tiny_model):
    twin = kv_cache.bare_twin(tiny_model, kv_cache.ATTENTION)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="without a PolicyCache"):
        twin(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_the_bytes_kept_are_the_window_aware_count_on_every_family(family):
    """kv_memory with the model's windows counts what the cache keeps after the prefill and every step:
    on a sliding-window layer a full group keeps the model's window and a streaming group drops the
    sinks that window has passed."""
    for seed, (sink, recent) in enumerate([(3, 5), (2, 30), (0, 4)]):
        policy = _policy(family, sink, recent, seed)
        ids = _ids(40, 50 + seed)
        steps: list[tuple[int, int]] = []

        def seen(step, cache, steps=steps):
            steps.append((cache.get_seq_length(), cache.kept_bytes()))

        out = kv_cache.greedy_continuation(family, policy.full, ids, 6, sink, recent, chunk=9, on_step=seen)
        windows = family.facts.windows
        assert out.prefill_kept_bytes == kv_memory(policy, len(ids), family.d_head, dtype_bytes(family), windows).bytes
        for n, kept in steps:
            assert kept == kv_memory(policy, n, family.d_head, dtype_bytes(family), windows).bytes


def test_window_aware_counts_by_hand():
    """A 2-layer layout, layer 1 with a model window of 7; S = 3, W = 5, one full and one streaming group."""
    policy = Policy(np.array([[True, False], [True, False]]), 3, 5)
    m = kv_memory(policy, 40, 1, 1, [None, 7])
    per = 2  # K and V, d_head 1, 1 byte
    # layer 0: full 40 + streaming 3 + 5; layer 1: full 7 + streaming last 5 (the sinks left the window)
    assert m.bytes == (40 + 8 + 7 + 5) * per and m.full_bytes == (40 + 40 + 7 + 7) * per
    short = kv_memory(policy, 9, 1, 1, [None, 7])  # positions 2..8 in the window: sink 2 still inside
    assert short.bytes == (9 + 8 + 7 + 6) * per
    assert kv_memory(policy, 40, 1, 1) == kv_memory(policy, 40, 1, 1, [None, None])
    with pytest.raises(InputError, match="layer windows"):
        kv_memory(policy, 40, 1, 1, [7])


def test_the_responses_are_eagers_word_for_word(tiny_model):
    """retrieval_accuracy through the cache backend's decoding gives eager's responses, not only its score."""
    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.niah import Needle, NiahPrompt

    policy = _policy(tiny_model, 2, 5, 1)
    needle = Needle("The code is 4417.", "What is the code?", "4417")
    prompts = [NiahPrompt(_ids(28, k), (3, 6), (20, 24), needle, 28, 50.0, 50.0, 20, "x") for k in range(4)]
    with policy_applied(tiny_model, policy, "eager") as hooks:
        want = retrieval_accuracy(tiny_model, prompts, hooks, max_new_tokens=8)

    def decode(ids, n):
        return kv_cache.greedy_continuation(tiny_model, policy.full, ids, n, 2, 5).generated

    got = retrieval_accuracy(tiny_model, prompts, max_new_tokens=8, continuation=decode)
    assert got.responses == want.responses and all(r.strip() for r in want.responses)


@pytest.mark.parametrize("sink,recent", [(40, 5), (2, 40), (40, 40), (0, 1)])
def test_sinks_or_windows_as_long_as_the_prompt(tiny_model, sink, recent):
    """S or W covering the whole prompt keeps every key (the full model's tokens); W = 1 sees itself only."""
    policy = _policy(tiny_model, sink, recent, 2)
    ids = _ids(30, 8)
    want = _masked_continuation(tiny_model, policy, ids, 6)
    assert kv_cache.greedy_continuation(tiny_model, policy.full, ids, 6, sink, recent, chunk=7).generated == want


def test_no_new_tokens_and_lengths_past_the_context_or_the_cap(tiny_model):
    full = np.ones((2, 2), bool)
    got = kv_cache.greedy_continuation(tiny_model, full, _ids(10, 1), 0, 1, 2)
    assert got.generated == [] and got.prefill_kept_bytes == kv_memory(Policy(full, 1, 2), 10, tiny_model.d_head,
                                                                        dtype_bytes(tiny_model)).bytes
    with pytest.raises(InputError, match="context of"):
        kv_cache.greedy_continuation(tiny_model, full, _ids(tiny_model.n_ctx, 1), 1, 1, 2)
    with pytest.raises(InputError, match="between 0 and"):
        kv_cache.greedy_continuation(tiny_model, full, _ids(10, 1), 10**6, 1, 2)
    with pytest.raises(InputError, match="two tokens"):
        kv_cache.text_metrics(tiny_model, full, [[5]], 1, 2)


def test_a_run_waits_for_an_ablation_holding_the_model_instead_of_refusing(tiny_model):
    """Another job's hooks are attached under the model's lock: the cache run waits for the lock, then
    finds no hook, rather than failing part-way on a hook that is about to go."""
    import threading
    import time

    attached, release = threading.Event(), threading.Event()

    def ablation():
        with tiny_model.lock, tiny_model.bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook=None: x)]):
            attached.set()
            release.wait(10)

    t = threading.Thread(target=ablation)
    t.start()
    attached.wait(10)
    threading.Timer(0.3, release.set).start()
    t0 = time.perf_counter()
    out = kv_cache.greedy_continuation(tiny_model, np.ones((2, 2), bool), _ids(12, 3), 3, 1, 2)
    t.join()
    assert len(out.generated) == 3 and time.perf_counter() - t0 >= 0.25


def test_a_second_cache_passed_by_hand_is_the_one_attended(tiny_model):
    """The attention reads the cache the pass updated, not a thread's current one."""
    policy = _policy(tiny_model, 1, 3)
    ids = _ids(20, 4)
    want = kv_cache.greedy_continuation(tiny_model, policy.full, ids, 1, 1, 3).generated
    with kv_cache.policy_cache(tiny_model, np.ones((2, 2), bool), 1, 3) as (twin, _outer):
        other = kv_cache.new_cache(tiny_model, policy.full, 1, 3)
        logits = kv_cache.run_chunks(twin, other, ids, tiny_model.device)
    assert [int(logits.argmax())] == want

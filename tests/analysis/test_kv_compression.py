"""KV-cache policies: the mask against a hand-written Llama forward with the same per-head mask (tiny
GQA model, prefill and KV-cached decode), the two ends, memory by hand (the pattern folder: test_pattern_folder)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headscope.analysis.kv_compression import (
    Policy,
    build_policy,
    evaluate_policies,
    group_priority,
    kv_memory,
    policy_hooks,
    smallest_model_window,
    streaming_key_mask,
)
from tests.conftest import tiny_hf_model

SEED = 3


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model(seed=SEED, name="tiny-kv")


@pytest.fixture(scope="module")
def reference(embedded_tokenizer):
    """A second, untouched copy of the same random Llama (the bridge rewires the one it wraps)."""
    return tiny_hf_model(len(embedded_tokenizer), seed=SEED)


def brute_visible(full: np.ndarray, n: int, sink: int, recent: int, group: int) -> torch.Tensor:
    """``[layer, head, n, n]`` by loops: causal, and for a streaming group j < S or i − j < W."""
    n_layers, n_kv = full.shape
    vis = torch.zeros((n_layers, n_kv * group, n, n), dtype=torch.bool)
    for la in range(n_layers):
        for h in range(n_kv * group):
            for i in range(n):
                for j in range(i + 1):
                    vis[la, h, i, j] = bool(full[la, h // group]) or j < sink or i - j < recent
    return vis


@torch.inference_mode()
def reference_logits(hf, ids: list[int], visible: torch.Tensor) -> torch.Tensor:
    """A Llama forward written out by hand from the weights, each head masked by ``visible``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = hf.config
    n, n_h, n_kv = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // n_h
    x = hf.model.embed_tokens(torch.tensor([ids]))
    cos, sin = hf.model.rotary_emb(x, torch.arange(n)[None])
    for la, layer in enumerate(hf.model.layers):
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.q_proj(h).view(1, n, n_h, d).transpose(1, 2)
        k = att.k_proj(h).view(1, n, n_kv, d).transpose(1, 2)
        v = att.v_proj(h).view(1, n, n_kv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(n_h // n_kv, 1), v.repeat_interleave(n_h // n_kv, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        p = torch.softmax(s.masked_fill(~visible[la][None], float("-inf")), dim=-1)
        x = x + att.o_proj((p @ v).transpose(1, 2).reshape(1, n, n_h * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(hf.model.norm(x))[0]


def bridge_logits(model, ids, hooks) -> torch.Tensor:
    with torch.inference_mode():
        return model.bridge.run_with_hooks(torch.tensor([ids]), fwd_hooks=hooks, return_type="logits")[0]


IDS = [int(t) for t in np.random.default_rng(0).integers(100, 5000, size=14)]
MIXED = np.array([[True, False], [False, True]])


def test_streaming_key_mask_matches_loops_with_and_without_cache():
    n, s, w = 11, 2, 3
    vis = brute_visible(np.zeros((1, 1), bool), n, s, w, 1)[0, 0]
    assert torch.equal(streaming_key_mask(n, n, s, w), vis)
    assert torch.equal(streaming_key_mask(1, n, s, w), vis[-1:])  # a decode row is the last position
    assert torch.equal(streaming_key_mask(4, n, s, w), vis[-4:])
    # a streaming row keeps exactly S + W keys once i >= S + W - 1
    assert vis[-1].sum() == s + w


def test_policy_mask_equals_a_hand_written_forward_with_the_same_mask_prefill(model, reference):
    """GQA (4 query heads on 2 KV heads): groups 0.1 and 1.0 stream, the others stay full."""
    policy = Policy(MIXED, sink_size=2, recent_size=3)
    got = bridge_logits(model, IDS, policy_hooks(model, policy))
    want = reference_logits(reference, IDS, brute_visible(MIXED, len(IDS), 2, 3, model.group_size))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    clean = reference_logits(reference, IDS, brute_visible(np.ones_like(MIXED), len(IDS), 2, 3, model.group_size))
    assert (got - clean).abs().max() > 1e-3  # the mask changes the numbers: the check has teeth


def test_policy_mask_holds_at_every_kv_cached_decode_step(model, reference):
    """Prefill the first 8 tokens with the cache, then feed one token at a time: each step's logits equal
    the hand-written forward over everything so far, with the same mask (decode rows are masked too)."""
    policy = Policy(MIXED, sink_size=2, recent_size=3)
    hooks = policy_hooks(model, policy)
    prompt, rest = IDS[:8], IDS[8:]
    with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
        logits, past = model.bridge(torch.tensor([prompt]), return_type="logits_and_cache", use_cache=True)
        steps = [logits[0, -1]]
        for t in rest:
            logits, past = model.bridge(torch.tensor([[t]]), return_type="logits_and_cache", past_key_values=past)
            steps.append(logits[0, -1])
    for k, got in enumerate(steps):
        seq = IDS[: 8 + k]
        want = reference_logits(reference, seq, brute_visible(MIXED, len(seq), 2, 3, model.group_size))[-1]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_all_full_reproduces_the_uncompressed_logits_exactly(model):
    policy = build_policy(model, "all_full", 0.3, sink_size=2, recent_size=3)
    assert policy.full.all() and policy_hooks(model, policy) == []
    clean = bridge_logits(model, IDS, [])
    assert torch.equal(bridge_logits(model, IDS, policy_hooks(model, policy)), clean)
    # streaming groups whose S + W covers the whole text see every key: the hooks run and change nothing
    wide = Policy(np.zeros((2, 2), bool), sink_size=4, recent_size=len(IDS))
    assert len(policy_hooks(model, wide)) == 2
    assert torch.equal(bridge_logits(model, IDS, policy_hooks(model, wide)), clean)


def test_all_streaming_equals_an_eager_streaming_llm_mask(model, reference):
    policy = build_policy(model, "all_streaming", 0.9, sink_size=1, recent_size=4)
    assert not policy.full.any()
    got = bridge_logits(model, IDS, policy_hooks(model, policy))
    n = len(IDS)
    sllm = torch.tensor([[j <= i and (j < 1 or j >= i - 3) for j in range(n)] for i in range(n)])
    want = reference_logits(reference, IDS, sllm.expand(2, 4, n, n))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_rankings_aggregate_query_heads_per_kv_group_and_keep_the_top_fraction(model):
    retrieval = np.array([[0.0, 0.9, 0.1, 0.2], [0.3, 0.0, 0.0, 0.05]])  # groups: [0.9, 0.2], [0.3, 0.05]
    streaming = np.array([[0.9, 0.95, 0.2, 0.99], [0.99, 0.9, 0.8, 0.7]])  # max(1 − s): [0.1, 0.8], [0.1, 0.3]
    scores = {"retrieval": retrieval, "streaming": streaming}
    np.testing.assert_allclose(group_priority(model, "retrieval", scores), [[0.9, 0.2], [0.3, 0.05]])
    np.testing.assert_allclose(group_priority(model, "streaming", scores), [[0.1, 0.8], [0.1, 0.3]])
    assert build_policy(model, "retrieval", 0.5, scores).full.tolist() == [[True, False], [True, False]]
    assert build_policy(model, "streaming", 0.25, scores).full.tolist() == [[False, True], [False, False]]
    a, b = (build_policy(model, "random", 0.5, seed=s).full for s in (0, 0))
    assert np.array_equal(a, b) and a.sum() == 2
    assert {build_policy(model, "random", 0.5, seed=s).full.tobytes() for s in range(8)} != {a.tobytes()}


def test_kv_memory_by_hand_for_the_embedded_layout():
    """SmolLM2-135M: 30 layers × 3 KV heads × d_head 64, float32; 45 of 90 groups full, 2,048 tokens,
    S = 128, W = 256: a full group keeps 2,048 tokens, a streaming one 384."""
    full = np.zeros((30, 3), bool)
    full.reshape(-1)[::2] = True
    m = kv_memory(Policy(full, 128, 256), 2048, 64, 4)
    per_token = 2 * 64 * 4  # K and V, 64 dims, 4 bytes
    assert m.full_bytes == 30 * 3 * 2048 * per_token == 94_371_840
    assert m.bytes == (45 * 2048 + 45 * 384) * per_token == 56_033_280
    assert m.fraction == pytest.approx((2048 + 384) / (2 * 2048))  # 0.59375
    short = kv_memory(Policy(full, 128, 256), 300, 64, 4)  # shorter than S + W: nothing is dropped
    assert short.bytes == short.full_bytes and short.fraction == 1.0
    none_full = kv_memory(Policy(np.zeros((30, 3), bool), 128, 256), 2048, 64, 2)
    assert none_full.fraction == pytest.approx(384 / 2048)


def test_evaluate_policies_on_texts_baseline_ends_and_resume(model, store):
    texts = [IDS, IDS[::-1]]
    scores = {"retrieval": np.array([[0.0, 0.9, 0.1, 0.2], [0.3, 0.0, 0.0, 0.05]])}
    seen = []
    curve = evaluate_policies(model, scores, ["retrieval", "random", "all_full", "all_streaming"], [0.5],
                              texts=texts, seeds=[0, 1], sink_size=2, recent_size=3, store=store,
                              progress=seen.append)
    assert curve.complete and seen[-1] == pytest.approx(1.0)
    rows = {(r["ranking"], r["seed"]): r for r in curve.rows()}
    assert set(rows) == {("retrieval", None), ("random", 0), ("random", 1), ("all_full", None),
                         ("all_streaming", None)}
    base = curve.baseline
    assert base.agreement == 1.0 and base.memory.fraction == 1.0
    assert rows[("all_full", None)]["loss"] == base.loss
    # the baseline loss is the plain model's mean loss over both texts (token-weighted)
    from headscope.analysis.ablation import loss_metric

    want = np.mean([float(loss_metric(t)(bridge_logits(model, t, [])[None])[0]) for t in texts])
    assert base.loss == pytest.approx(want, rel=1e-6)
    alls = rows[("all_streaming", None)]
    assert alls["kv_fraction"] == pytest.approx(5 / 14) and alls["agreement"] < 1.0
    assert rows[("retrieval", None)]["kv_fraction"] == pytest.approx((2 * 14 + 2 * 5) / (4 * 14))
    # run again: every policy is read back from the store, the same numbers
    again = evaluate_policies(model, scores, ["retrieval", "random", "all_full", "all_streaming"], [0.5],
                              texts=texts, seeds=[0, 1], sink_size=2, recent_size=3, store=store)
    assert [r["loss"] for r in again.rows()] == [r["loss"] for r in curve.rows()]
    assert all(e.seconds == 0.0 for e in again.evaluations)


def test_evaluate_policies_cancel_keeps_what_finished(model):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 3

    curve = evaluate_policies(model, None, ["random"], [0.25, 0.5, 0.75], texts=[IDS], seeds=[0],
                              sink_size=2, recent_size=3, cancel=cancel)
    assert not curve.complete and len(curve.evaluations) < 3


@pytest.mark.parametrize("kwargs, message", [
    ({"rankings": ["bogus"]}, "Unknown ranking"),
    ({"rankings": ["retrieval"]}, "needs the retrieval score"),
    ({"fractions": [1.5]}, "between 0 and 1"),
    ({"texts": []}, "Give a text"),
    ({"recent_size": 0}, "W >= 1"),
])
def test_evaluate_policies_refuses_bad_input_before_any_work(model, kwargs, message):
    from headscope.analysis.errors import InputError

    args = {"rankings": ["random"], "fractions": [0.5], "texts": [IDS], **kwargs}
    with pytest.raises(InputError, match=message):
        evaluate_policies(model, None, args.pop("rankings"), args.pop("fractions"), **args)


# ---------------------------------------------------------------------------------------------
# The statistics backend: the policy as the kernels' per-head key mask (O(n) memory)


@pytest.mark.parametrize("n_q, n_k, sink, recent", [(11, 11, 2, 3), (1, 11, 2, 3), (4, 11, 0, 5), (9, 9, 4, 1),
                                                    (6, 20, 3, 30)])
def test_the_kernels_key_sink_and_window_are_streaming_key_mask(n_q, n_k, sink, recent):
    """One definition of the mask: the kernel's visible keys (read off its exact rows) and the eager
    reference's are :func:`streaming_key_mask`'s, also for decode rows (n_q < n_k)."""
    from headscope.kernels.attention import attention
    from headscope.kernels.reference import attention_scores

    g = torch.Generator().manual_seed(n_q * 100 + n_k)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (n_q, n_k, n_k))
    want = streaming_key_mask(n_q, n_k, sink, recent)
    rows = attention(q, k, v, stats="rows", rows=list(range(n_q)), key_sink=sink, key_window=recent,
                     backend="torch").stats["rows"]
    assert torch.equal(rows[0, 0] > 0, want) and torch.equal(rows[0, 1] > 0, want)
    scores = attention_scores(q, k, key_sink=sink, key_window=recent)
    assert torch.equal(torch.isfinite(scores[0, 0]), want)


def _decode_logits(model, ids: list[int], n_prompt: int, hooks=()) -> list[torch.Tensor]:
    """Prefill ``ids[:n_prompt]`` with the KV cache, then one token at a time: each step's last logits."""
    with torch.inference_mode(), model.bridge.hooks(fwd_hooks=list(hooks)):
        logits, past = model.bridge(torch.tensor([ids[:n_prompt]]), return_type="logits_and_cache", use_cache=True)
        steps = [logits[0, -1]]
        for t in ids[n_prompt:]:
            logits, past = model.bridge(torch.tensor([[t]]), return_type="logits_and_cache", past_key_values=past)
            steps.append(logits[0, -1])
    return steps


def test_statistics_backend_equals_a_hand_written_forward_prefill_and_decode(model, reference):
    """The same GQA policy through the kernels: prefill logits and every KV-cached decode step equal
    the hand-written forward with :func:`brute_visible`'s mask."""
    from headscope.analysis.kv_compression import policy_applied, policy_key_masks

    policy = Policy(MIXED, sink_size=2, recent_size=3)
    masks = policy_key_masks(model, policy)
    assert sorted(masks) == [0, 1] and masks[0].window == (0, 0, 3, 3) and masks[1].sink == (2, 2, 0, 0)
    with policy_applied(model, policy, "statistics") as hooks:
        assert hooks == []
        got = bridge_logits(model, IDS, hooks)
        steps = _decode_logits(model, IDS, 8)
    want = reference_logits(reference, IDS, brute_visible(MIXED, len(IDS), 2, 3, model.group_size))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for k, step in enumerate(steps):
        seq = IDS[: 8 + k]
        want = reference_logits(reference, seq, brute_visible(MIXED, len(seq), 2, 3, model.group_size))[-1]
        torch.testing.assert_close(step, want, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def windowed(request, embedded_tokenizer):
    """Sliding-window families (tests/tiny_families.py): Mistral, window 7 on every layer; Gemma 3,
    window 6 on layers 0 and 2, one KV head for four query heads, soft scale, QK-norm."""
    from headscope.analysis.models import wrap_model
    from tests.tiny_families import tiny_family_model

    name = request.param
    return wrap_model(tiny_family_model(name, len(embedded_tokenizer)), embedded_tokenizer, name=f"tiny-{name}",
                      digest=f"tiny-{name}-kv")


LONG = [int(t) for t in np.random.default_rng(5).integers(100, 5000, size=30)]


def test_statistics_backend_intersects_the_models_sliding_window_prefill_and_decode(windowed):
    """S = 2, W = 3 on a model window of 6-7 keys and 30 tokens: the sinks leave the model's window
    part-way (rows that run one at a time). Prefill equals the eager path's masked scores (which hold
    the model's own window); each KV-cached decode step, whose sliding cache has dropped early keys,
    equals the last row of an uncached eager forward over the same tokens."""
    from headscope.analysis.attention_statistics import layer_mask, masked_segments
    from headscope.analysis.kv_compression import policy_applied, policy_key_masks

    full = np.zeros((windowed.n_layers, windowed.n_kv_heads), bool)
    full[0, 0] = windowed.n_kv_heads > 1  # Mistral: one full group in layer 0
    policy = Policy(full, sink_size=2, recent_size=3)
    window = layer_mask(windowed.bridge.blocks[0].attn.original_component).window
    assert window in (6, 7) and len(masked_segments(policy_key_masks(windowed, policy)[0], window, 30, 30)) > 2
    with policy_applied(windowed, policy, "eager") as hooks:
        want = bridge_logits(windowed, LONG, hooks)
    with policy_applied(windowed, policy, "statistics") as hooks:
        got = bridge_logits(windowed, LONG, hooks)
        steps = _decode_logits(windowed, LONG, 12)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    clean = bridge_logits(windowed, LONG, [])
    assert (got - clean).abs().max() > 1e-3
    for k, step in enumerate(steps):
        torch.testing.assert_close(step, want[11 + k], atol=2e-5, rtol=1e-4)


def _metrics(curve):
    return [(r["ranking"], r["seed"], r["loss"], r["agreement"], r["niah_accuracy"], r["kv_bytes"])
            for r in [curve.baseline.row(), *curve.rows()]]


def _check_backends_agree(m) -> None:
    """Loss within 1e-4, agreement, NIAH accuracy and KV bytes exactly, on texts and on prompts decoded
    with the cache (6 new tokens each)."""
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    texts = [LONG, LONG[::-1]]
    prompts = [build_prompt(m, n, load_haystack("prose"), 160, 50.0) for n in load_needles()[:2]]
    # on a sliding-window model the eager hook cannot place sinks once the cache drops keys: no sinks
    sink = 0 if smallest_model_window(m) else 2
    kw = dict(texts=texts, prompts=prompts, seeds=[0, 1], sink_size=sink, recent_size=3, max_new_tokens=6)
    eager = evaluate_policies(m, None, ["random", "all_full", "all_streaming"], [0.5], backend="eager", **kw)
    stats = evaluate_policies(m, None, ["random", "all_full", "all_streaming"], [0.5], backend="statistics", **kw)
    assert (eager.meta["backend"], stats.meta["backend"]) == ("eager", "statistics")
    for a, b in zip(_metrics(eager), _metrics(stats), strict=True):
        assert a[:2] == b[:2] and a[3:] == b[3:]
        assert b[2] == pytest.approx(a[2], abs=1e-4)
    assert min(r["agreement"] for r in stats.rows()) < 1.0  # the policies change predictions


def test_statistics_backend_metrics_equal_eager_metrics_tiny_llama(model):
    _check_backends_agree(model)


def test_statistics_backend_metrics_equal_eager_metrics_sliding_window_families(windowed):
    _check_backends_agree(windowed)


def test_all_full_on_the_statistics_backend_is_the_uncompressed_statistics_run(model):
    """The all-full policy gives no key masks: its loss and predictions are exactly those of a plain
    statistics-mode run (the baseline), and a policy whose S + W covers every text changes nothing."""
    from headscope.analysis.attention_statistics import statistics_mode
    from headscope.analysis.kv_compression import policy_key_masks, text_metrics

    assert policy_key_masks(model, build_policy(model, "all_full", 1.0)) == {}
    with statistics_mode(model):
        plain = text_metrics(model, [IDS, IDS[::-1]])
    curve = evaluate_policies(model, None, ["all_full"], [1.0], texts=[IDS, IDS[::-1]], backend="statistics",
                              sink_size=4, recent_size=len(IDS))
    assert curve.baseline.loss == plain.loss and curve.evaluations[0].loss == plain.loss
    wide = evaluate_policies(model, None, ["all_streaming"], [0.0], texts=[IDS, IDS[::-1]], backend="statistics",
                             sink_size=4, recent_size=len(IDS))
    assert wide.evaluations[0].agreement == 1.0
    assert wide.evaluations[0].loss == pytest.approx(plain.loss, abs=1e-6)


def test_auto_backend_follows_the_page_rule(model, monkeypatch):
    """``auto``: eager up to HEADSCOPE_MAX_TOKENS tokens on CPU, statistics mode above."""
    from headscope.analysis.errors import InputError
    from headscope.analysis.kv_compression import choose_backend

    assert choose_backend(model, "auto", 100) == "eager"
    monkeypatch.setenv("HEADSCOPE_MAX_TOKENS", "10")
    assert choose_backend(model, "auto", 100) == "statistics"
    curve = evaluate_policies(model, None, ["all_streaming"], [0.0], texts=[IDS], sink_size=2, recent_size=3)
    assert curve.meta["backend"] == "statistics"
    with pytest.raises(InputError, match="backend"):
        choose_backend(model, "flash", 100)


def test_eager_decode_past_a_sliding_window_with_sinks_is_refused_and_auto_uses_the_kernels(windowed):
    """The eager hook sees only the shortened sliding-window cache and would take its first keys for the
    sinks (its decode steps differ from the uncached forward by ~0.3-0.5 in the logits): asked for,
    it is refused; ``auto`` evaluates such prompts in statistics mode."""
    from headscope.analysis.errors import InputError
    from headscope.analysis.kv_compression import policy_applied
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    policy = Policy(np.zeros((windowed.n_layers, windowed.n_kv_heads), bool), sink_size=2, recent_size=3)
    with policy_applied(windowed, policy, "eager") as hooks:
        want = bridge_logits(windowed, LONG, hooks)
        steps = _decode_logits(windowed, LONG, 12, hooks)
    assert max(float((s - want[11 + k]).abs().max()) for k, s in enumerate(steps)) > 1e-2
    prompts = [build_prompt(windowed, load_needles()[0], load_haystack("prose"), 160, 50.0)]
    kw = dict(texts=[LONG], prompts=prompts, sink_size=2, recent_size=3, max_new_tokens=4)
    with pytest.raises(InputError, match="statistics backend"):
        evaluate_policies(windowed, None, ["all_streaming"], [0.0], backend="eager", **kw)
    assert evaluate_policies(windowed, None, ["all_streaming"], [0.0], **kw).meta["backend"] == "statistics"


# ---------------------------------------------------------------------------------------------
# Intervals (#42 item 4): every NIAH accuracy carries its n and its 95 % Wilson interval


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """Wilson 1927 with z = 1.959964 (Φ⁻¹(0.975)), written out: an independent check of scipy's."""
    z, p = 1.959963984540054, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def _made(ranking: str, fraction: float, accuracy: float, n: int, seed: int | None = None, loss: float = 2.0):
    from headscope.analysis.kv_compression import KVMemory, PolicyEvaluation

    full = np.zeros((2, 2), dtype=bool)
    full.reshape(-1)[:round(fraction * 4)] = True
    return PolicyEvaluation(Policy(full, 4, 8, ranking, fraction, seed), KVMemory(100, int(100 * fraction), 100),
                            loss, 0.9, accuracy, 0.0, n)


def _curve(baseline_accuracy: float, n: int, points: list[tuple], n_prompts: int | None = None):
    from headscope.analysis.kv_compression import CompressionCurve

    return CompressionCurve([_made(*p[:3], n, *p[3:]) for p in points], _made("all_full", 1.0, baseline_accuracy, n),
                            4, 8, 1, n if n_prompts is None else n_prompts)


def test_rows_carry_n_and_the_wilson_interval_of_the_niah_accuracy():
    e = _made("retrieval", 0.5, 0.5, 4)
    row = e.row()
    low, high = wilson_by_hand(2, 4)
    assert row["niah_accuracy"] == 0.5 and row["niah_accuracy_n"] == 4
    assert row["niah_accuracy_low"] == pytest.approx(low, abs=1e-9) and row["niah_accuracy_high"] == pytest.approx(high)
    assert e.niah.text() == "0.50 [0.15, 0.85] n=4"
    # loss and agreement stay points; no prompts: no interval
    assert not any(k.startswith(("loss_", "agreement_")) for k in row)
    empty = _made("retrieval", 0.5, math.nan, 0).row()
    assert empty["niah_accuracy_n"] == 0 and math.isnan(empty["niah_accuracy_low"])


def test_smallest_within_decides_on_the_interval_where_the_point_rule_disagrees():
    # uncompressed 2/4; retrieval at 0.25 answers 1/4: 0.25 < 0.5 − 0.05 as points, but its interval
    # [0.05, 0.70] reaches the uncompressed one's lower bound 0.15 − 0.05: on 4 prompts they are not told apart
    curve = _curve(0.5, 4, [("retrieval", 0.25, 0.25), ("retrieval", 0.5, 0.75)])
    best = curve.smallest_within("retrieval", 0.05)
    assert best is not None and best.policy.fraction == 0.25
    # 3/4 against 2/4 on n = 4 is no difference either: both pass, neither is "better"
    assert curve.within_tolerance(curve.find("retrieval", 0.5), 0.0)
    assert curve.within_tolerance(curve.find("retrieval", 0.25), 0.0)
    # with 100 prompts the same points are told apart: 25/100 is well below 50/100
    big = _curve(0.5, 100, [("retrieval", 0.25, 0.25), ("retrieval", 0.5, 0.46)])
    assert not big.within_tolerance(big.find("retrieval", 0.25), 0.05)
    assert big.smallest_within("retrieval", 0.0).policy.fraction == 0.5  # 0.46 [0.37, 0.56] reaches 0.40
    # the rule by hand: upper bound of the policy ≥ lower bound of the uncompressed − tolerance
    for k in range(0, 101, 5):
        e = _made("retrieval", 0.1, k / 100, 100)
        want = wilson_by_hand(k, 100)[1] >= wilson_by_hand(50, 100)[0] - 0.05 if k else \
            wilson_by_hand(0, 100)[1] >= wilson_by_hand(50, 100)[0] - 0.05
        assert big.within_tolerance(e, 0.05) == want, k
    # random: every seed must pass; one seed at 10/100 fails the fraction
    rnd = _curve(0.5, 100, [("random", 0.25, 0.45, 0), ("random", 0.25, 0.10, 1),
                            ("random", 0.5, 0.48, 0), ("random", 0.5, 0.44, 1)])
    assert rnd.smallest_within("random", 0.05).policy.fraction == 0.5
    # loss keeps the point rule (it has no interval here)
    loss = _curve(0.5, 4, [("retrieval", 0.25, 0.5, None, 2.2), ("retrieval", 0.5, 0.5, None, 2.04)])
    assert loss.smallest_within("retrieval", 0.05, metric="loss").policy.fraction == 0.5
    # no prompts: no accuracy decision
    assert _curve(math.nan, 0, [("retrieval", 0.25, math.nan)]).smallest_within("retrieval", 1.0) is None


def test_seed_bands_of_the_random_ranking_per_fraction():
    curve = _curve(0.5, 4, [("random", 0.25, 0.25, 0), ("random", 0.25, 0.75, 1), ("random", 0.25, 0.5, 2),
                            ("random", 0.5, 1.0, 0), ("random", 0.5, 0.5, 1), ("random", 0.5, 0.5, 2)])
    bands = curve.seed_bands()
    assert [b["fraction_full"] for b in bands] == [0.25, 0.5]
    first = bands[0]
    assert (first["n_seeds"], first["niah_accuracy_seed_mean"], first["niah_accuracy_seed_low"],
            first["niah_accuracy_seed_high"]) == (3, pytest.approx(0.5), 0.25, 0.75)
    # beside it, the pooled Wilson interval of the seeds' 12 prompts (6 answered)
    assert first["niah_accuracy_pooled_n"] == 12
    assert (first["niah_accuracy_pooled_low"], first["niah_accuracy_pooled_high"]) == pytest.approx(wilson_by_hand(6, 12))
    assert _curve(0.5, 4, [("retrieval", 0.25, 0.25)]).seed_bands() == []


def test_a_stored_curve_without_n_loads_with_the_curves_n_prompts(tmp_path):
    """A curve record written before evaluations carried n: n comes from the curve's n_prompts."""
    import headscope.analysis.kv_compression_sweep as kvs
    from headscope.analysis.store import Store

    store = Store(tmp_path / "store")
    policy = {"sink_size": 4, "recent_size": 8, "ranking": "retrieval", "fraction": 0.5, "seed": None, "n_full": 2,
              "full_share": 0.5, "full": [[1, 0], [1, 0]]}
    old = {"policy": policy, "n_tokens": 100, "bytes": 60, "full_bytes": 100, "loss": 2.0, "agreement": 0.9,
           "niah_accuracy": 0.25, "seconds": 1.0}
    base = {**old, "policy": {**policy, "ranking": "all_full", "fraction": 1.0, "full": [[1, 1], [1, 1]]},
            "niah_accuracy": 0.5}
    store.put("c" * 64, kvs.CURVE_KIND, {"baseline": base, "evaluations": [old], "sink_size": 4, "recent_size": 8,
                                         "n_texts": 1, "n_prompts": 4, "complete": True, "meta": {}}, {})
    curve = kvs.load_curve(store, "c" * 64)
    assert curve is not None and curve.evaluations[0].niah_n == 4 and curve.baseline.niah_n == 4
    row = curve.rows()[0]
    assert (row["niah_accuracy_n"], row["niah_accuracy_low"]) == (4, pytest.approx(wilson_by_hand(1, 4)[0]))
    # saved again, n is in the record
    kvs.save_curve(store, "d" * 64, curve)
    assert store.get("d" * 64).meta["evaluations"][0]["niah_n"] == 4



@pytest.mark.parametrize("forged", [{"niah_n": -1}, {"niah_n": "4"}, {"niah_n": True}, {"niah_n": 2.5},
                                    {"niah_accuracy": 1.5}, {"niah_accuracy": -0.25}, {"n_prompts": -3}])
def test_a_curve_record_with_a_forged_n_or_accuracy_is_no_curve(tmp_path, forged):
    """A record whose n or accuracy cannot be a proportion is not read as a curve (the page says no curve
    has that id) rather than failing when its interval is drawn."""
    import headscope.analysis.kv_compression_sweep as kvs
    from headscope.analysis.store import Store

    store = Store(tmp_path / "store")
    policy = {"sink_size": 4, "recent_size": 8, "ranking": "retrieval", "fraction": 0.5, "seed": None, "n_full": 2,
              "full_share": 0.5, "full": [[1, 0], [1, 0]]}
    evaluation = {"policy": policy, "n_tokens": 100, "bytes": 60, "full_bytes": 100, "loss": 2.0, "agreement": 0.9,
                  "niah_accuracy": 0.25, "seconds": 1.0, "niah_n": 4}
    meta = {"baseline": {**evaluation, "policy": {**policy, "ranking": "all_full"}},
            "evaluations": [{**evaluation, **{k: v for k, v in forged.items() if k != "n_prompts"}}],
            "sink_size": 4, "recent_size": 8, "n_texts": 1, "n_prompts": forged.get("n_prompts", 4),
            "complete": True, "meta": {}}
    if "n_prompts" in forged:
        for e in (meta["baseline"], *meta["evaluations"]):
            del e["niah_n"]
    store.put("e" * 64, kvs.CURVE_KIND, meta, {})
    assert kvs.load_curve(store, "e" * 64) is None

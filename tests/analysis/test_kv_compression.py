"""KV-cache policies: the mask against a hand-written Llama forward with the same per-head mask (tiny
GQA model, prefill and KV-cached decode), the two ends, memory by hand, the pattern-folder export."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from analysis.kv_compression import (
    PATTERN_CONFIG,
    PATTERN_TSV,
    Policy,
    build_policy,
    evaluate_policies,
    export_policy,
    group_priority,
    kv_memory,
    load_policy,
    policy_hooks,
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


def test_exported_pattern_folder_round_trips_with_layers_by_kv_heads(tmp_path):
    full = np.random.default_rng(1).random((30, 3)) > 0.6
    policy = Policy(full, 128, 256, "retrieval", 0.4)
    export_policy(policy, tmp_path / "pattern", model_name="smollm2-135m")
    table = np.loadtxt(tmp_path / "pattern" / PATTERN_TSV, delimiter="\t")
    assert table.shape == (30, 3)
    assert ((table >= 0) & (table <= 1)).all()
    assert np.array_equal(table > 0.5, full)
    config = json.loads((tmp_path / "pattern" / PATTERN_CONFIG).read_text())
    assert (config["sink_size"], config["recent_size"]) == (128, 256)
    assert config["head_compression_ratio"] == pytest.approx(1 - full.mean())
    back = load_policy(tmp_path / "pattern")
    assert np.array_equal(back.full, full) and (back.sink_size, back.recent_size) == (128, 256)
    # kvpress' DuoAttentionPress rule: the lowest head_compression_ratio share of scores stream
    n_pruned = round(table.size * config["head_compression_ratio"])
    streaming = np.zeros(table.size, bool)
    streaming[np.argsort(table, axis=None, kind="stable")[:n_pruned]] = True
    assert np.array_equal(~streaming.reshape(table.shape), full)


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
    from analysis.ablation import loss_metric

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
    from analysis.errors import InputError

    args = {"rankings": ["random"], "fractions": [0.5], "texts": [IDS], **kwargs}
    with pytest.raises(InputError, match=message):
        evaluate_policies(model, None, args.pop("rankings"), args.pop("fractions"), **args)

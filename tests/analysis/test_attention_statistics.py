"""Statistics mode: the model's forward pass through kernels.attention, checked against eager."""

from __future__ import annotations

import pytest
import torch

from headscope.analysis.attention_statistics import (
    LayerRequest,
    StatisticsModeError,
    _check_causal_mask,
    statistics_mode,
)
from headscope.kernels.attention import ARGMAX, ENTROPY, ROWS, attention


@pytest.fixture(scope="module")
def ids(real_model):
    text = open("data/niah/haystack_prose.txt", encoding="utf-8").read()
    return torch.tensor([real_model.encode(text)[:300]])


def logits(model, ids, **kw):
    with torch.inference_mode():
        return model.bridge(ids, return_type="logits", **kw)


def test_logits_equal_eager_and_every_layer_runs_through_the_kernel(real_model, ids):
    eager = logits(real_model, ids)
    seen = []
    with statistics_mode(real_model, lambda layer, n_q, n_k: LayerRequest({"stats": (ENTROPY,)}), seen.append):
        stats = logits(real_model, ids)
    assert (stats - eager).abs().max().item() < 1e-4
    assert [s.layer for s in seen] == list(range(real_model.n_layers))
    assert seen[0].stats[ENTROPY].shape == (1, real_model.n_heads, ids.shape[1])
    # restored on exit: the eager path (and its pattern hook) works again
    assert all("forward" not in block.attn.__dict__ for block in real_model.bridge.blocks)
    assert torch.equal(logits(real_model, ids), eager)


def test_z_ablation_and_q_hooks_work_in_statistics_mode(real_model, ids):
    def zero_head(z, hook):
        z[:, :, 2] = 0.0  # head 2 (hook_z is [batch, pos, head, d_head])
        return z

    seen_q = []
    hooks = [("blocks.5.attn.hook_z", zero_head), ("blocks.5.attn.hook_q", lambda q, hook: seen_q.append(q.shape))]
    with torch.inference_mode():
        eager = real_model.bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type="logits")
        with statistics_mode(real_model):
            stats = real_model.bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type="logits")
    clean = logits(real_model, ids)
    assert (eager - clean).abs().max().item() > 0.1  # the ablation changes the logits...
    assert (stats - eager).abs().max().item() < 1e-4  # ...by the same amount in both modes
    assert len(seen_q) == 2 and seen_q[0] == seen_q[1]


def test_kv_cached_decoding_matches_eager_and_returns_decode_row_statistics(real_model, ids):
    with torch.inference_mode():
        _, past = real_model.bridge(ids[:, :-1], return_type="logits_and_cache", use_cache=True)
        eager, _ = real_model.bridge(ids[:, -1:], return_type="logits_and_cache", past_key_values=past)
        rows = []
        req = LayerRequest({"stats": (ARGMAX, ROWS), "rows": [0]})
        with statistics_mode(real_model, lambda layer, n_q, n_k: req if n_q == 1 else None, rows.append):
            _, past = real_model.bridge(ids[:, :-1], return_type="logits_and_cache", use_cache=True)
            stats, _ = real_model.bridge(ids[:, -1:], return_type="logits_and_cache", past_key_values=past)
    assert (stats - eager).abs().max().item() < 1e-4
    assert len(rows) == real_model.n_layers and rows[0].n_q == 1 and rows[0].n_k == ids.shape[1]
    # the decode row's argmax is the argmax of the eager pattern of the full sequence's last row
    pattern = {}
    with torch.inference_mode():
        real_model.bridge.run_with_hooks(
            ids, fwd_hooks=[("blocks.9.attn.hook_pattern", lambda p, hook: pattern.update(p=p[0, :, -1].clone()))])
    assert torch.equal(rows[9].stats[ARGMAX][0, :, 0], pattern["p"].argmax(-1))
    assert torch.allclose(rows[9].stats[ROWS][0, :, 0], pattern["p"], atol=1e-6)


def test_pair_terms_are_the_diagonal_and_previous_token_weights(real_model, ids):
    seen = []
    with statistics_mode(real_model, lambda layer, n_q, n_k: LayerRequest(pairs=(0, 1)), seen.append):
        logits(real_model, ids)
    pattern = {}
    with torch.inference_mode():
        real_model.bridge.run_with_hooks(
            ids, fwd_hooks=[("blocks.3.attn.hook_pattern", lambda p, hook: pattern.update(p=p[0].clone()))])
    p, n = pattern["p"], ids.shape[1]
    i = torch.arange(n)
    assert torch.allclose(seen[3].pairs[0][0], p[:, i, i], atol=1e-6)
    assert torch.allclose(seen[3].pairs[1][0, :, 1:], p[:, i[1:], i[1:] - 1], atol=1e-6)
    assert torch.all(seen[3].pairs[1][0, :, 0] == 0)


def test_a_pattern_hook_is_refused_not_ignored(real_model, ids):
    with pytest.raises(StatisticsModeError, match="patterns are not built in statistics mode"):
        with torch.inference_mode(), statistics_mode(real_model):
            real_model.bridge.run_with_hooks(ids, fwd_hooks=[("blocks.2.attn.hook_pattern", lambda p, hook: None)])
    # restored after the error
    assert all("forward" not in block.attn.__dict__ for block in real_model.bridge.blocks)
    assert not real_model.bridge.blocks[2].attn.hook_pattern._forward_hooks


def test_masks_that_are_not_plain_causal_are_refused():
    n = 6
    causal = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)[None, None]
    _check_causal_mask(causal, n, n)  # fine
    _check_causal_mask(None, n, n)
    _check_causal_mask(causal[..., -1:, :], 1, n)  # a decode step
    padded = causal.clone()
    padded[..., :, 0] = torch.finfo(torch.float32).min  # left padding
    with pytest.raises(StatisticsModeError, match="not plain causal"):
        _check_causal_mask(padded, n, n)
    with pytest.raises(StatisticsModeError, match="Padded"):
        _check_causal_mask(torch.tensor([[0, 1, 1, 1, 1, 1]]), n, n)
    window = causal.clone()
    window[..., 5, 0] = torch.finfo(torch.float32).min  # a sliding window hides key 0 from the last row
    with pytest.raises(StatisticsModeError):
        _check_causal_mask(window, n, n)


def test_nested_use_is_refused(real_model):
    with statistics_mode(real_model):
        with pytest.raises(StatisticsModeError, match="already active"):
            with statistics_mode(real_model):
                pass


def test_masked_segments_apply_a_policy_mask_within_the_models_window_as_the_definition_says():
    """Brute force over random layouts (prefill and cached decode rows, caches that dropped keys the
    model's window no longer shows): the keys each segment's kernel call shows each query head are
    exactly ``j ≤ p`` and ``j > p − W_model`` (if any) and ``j < S_h or j > p − W_h`` (if ``W_h``)."""
    import numpy as np

    from headscope.analysis.attention_statistics import HeadKeyMask, masked_segments

    rng = np.random.default_rng(0)
    for _ in range(300):
        n_heads = int(rng.integers(1, 5))
        wm = int(rng.choice([0, 1, 3, 6, 9]))
        sink = tuple(int(x) for x in rng.integers(0, 5, n_heads))
        window = tuple(int(x) for x in rng.choice([0, 1, 2, 4, 7, 12], n_heads))
        n_k = int(rng.integers(1, 30))
        n_q = int(rng.integers(1, n_k + 1))
        dropped = 0
        if wm and n_q == 1 and n_k >= wm:  # a sliding cache holds the window and nothing older
            dropped = int(rng.integers(0, 10))
            n_k = wm
        segs = masked_segments(HeadKeyMask(sink, window), wm, n_q, n_k, dropped)
        got = np.zeros((n_heads, n_q, n_k), bool)
        covered = []
        for seg in segs:
            key_end = n_k - (n_q - seg.row_end)
            n_s = key_end - seg.key_start
            for i, r in enumerate(range(seg.row_start, seg.row_end)):
                covered.append(r)
                p_s = n_s - (seg.row_end - seg.row_start) + i  # the kernel's position of this row
                for h in range(n_heads):
                    for js in range(n_s):
                        w, s = seg.window[h], seg.sink[h]
                        got[h, r, seg.key_start + js] = js <= p_s and (w == 0 or js < s or js > p_s - w)
        assert covered == list(range(n_q))
        want = np.zeros_like(got)
        for r in range(n_q):
            p = dropped + n_k - n_q + r
            for jc in range(n_k):
                j = dropped + jc
                for h in range(n_heads):
                    want[h, r, jc] = (j <= p and (wm == 0 or j > p - wm)
                                      and (window[h] == 0 or j < sink[h] or j > p - window[h]))
        assert np.array_equal(got, want), (wm, sink, window, n_q, n_k, dropped, segs)


def _dense_masked_attention(q, k, v, scale, softcap, wm, sink, window, dropped):
    """softmax over the keys the definition shows (module docstring of analysis.attention_statistics),
    ``[b, n_q, h, d_v]``: row ``r`` at position ``p = dropped + n_k − n_q + r`` sees cache key ``jc``
    (position ``j = dropped + jc``) iff ``j ≤ p``, ``j > p − W_m`` (if any) and ``j < S_h or j > p − W_h``
    (if ``W_h``)."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    group = h // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = (dropped + n_k - n_q + torch.arange(n_q)).view(1, -1, 1)
    j = (dropped + torch.arange(n_k)).view(1, 1, -1)
    w, sk = torch.tensor(window).view(-1, 1, 1), torch.tensor(sink).view(-1, 1, 1)
    visible = (j <= p) & ((j > p - wm) if wm else True) & ((w == 0) | (j < sk) | (j > p - w))
    a = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return (a @ v.double().repeat_interleave(group, 1)).transpose(1, 2)


@pytest.mark.parametrize("seed", range(40))
def test_a_policy_mask_runs_full_groups_apart_and_equals_the_definition(seed, monkeypatch):
    """Random GQA layouts (model windows or none, prefill and decode rows, caches that dropped keys,
    some KV groups full and some streaming): the output equals a dense softmax under the definition's
    mask, and the full groups' heads run in a kernel call without a key mask (SDPA where it applies)."""
    import numpy as np

    from headscope.analysis import attention_statistics as mod
    from headscope.analysis.attention_statistics import HeadKeyMask, LayerMask, _attend_masked

    rng = np.random.default_rng(seed)
    n_kv, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3]))
    h = n_kv * group
    wm = int(rng.choice([0, 0, 3, 6, 9]))
    n_k = int(rng.integers(1, 40))
    n_q = int(rng.choice([n_k, 1, rng.integers(1, n_k + 1)]))
    dropped = 0
    if wm and n_q == 1 and n_k >= wm:  # a sliding cache holds the window and nothing older
        dropped, n_k = int(rng.integers(0, 10)), wm
    full = rng.random(n_kv) < 0.5
    streaming_sink, streaming_window = int(rng.integers(0, 5)), int(rng.choice([1, 2, 4, 7]))
    sink = tuple(0 if full[g // group] else streaming_sink for g in range(h))
    window = tuple(0 if full[g // group] else streaming_window for g in range(h))
    dtype = torch.float64 if seed % 2 else torch.float32
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n_q, 8, generator=g, dtype=dtype) * 2
    k, v = torch.randn(1, n_kv, n_k, 8, generator=g, dtype=dtype), torch.randn(1, n_kv, n_k, 4, generator=g, dtype=dtype)
    mask = LayerMask(scale=0.4, softcap=None if seed % 3 else 3.0, window=wm)

    calls = []

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], kw.get("key_window")))
        return attention(q, k, v, **kw)

    monkeypatch.setattr(mod, "attention", spy)
    got = _attend_masked(0, q, k, v, mask, HeadKeyMask(sink, window), dropped, (), {}, None, None)
    want = _dense_masked_attention(q, k, v, mask.scale, mask.softcap, wm, sink, window, dropped)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.double() - want).abs().max() < (1e-10 if dtype == torch.float64 else 2e-5)
    if 0 < full.sum() < n_kv:  # the full groups' heads in one call with the model's mask alone
        unmasked = [c for c in calls if not isinstance(c[1], torch.Tensor)]
        assert unmasked == [(int(full.sum()) * group, wm or None)]
        assert all(c[0] == (n_kv - int(full.sum())) * group for c in calls if isinstance(c[1], torch.Tensor))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("layout", ["prefill", "decode-rows", "window-softcap", "float16-int32"])
def test_listed_cells_equal_the_dense_softmax_at_those_cells(layout, batch):
    """cell_weights on GQA heads: the equal-token cells of a repetitive text and scattered cells, listed
    in no particular order, equal the dense softmax read at those cells (0 where the window hides the
    key), with the weights finished a small ``chunk`` at a time."""
    from headscope.analysis.attention_statistics import cell_weights
    from headscope.analysis.statistics_run import detection_cells

    g = torch.Generator().manual_seed(len(layout) + batch)
    n_kv, group, d, n_k = 2, 3, 16, 203
    n_q = 150 if layout == "decode-rows" else n_k
    window, softcap = (24, 5.0) if layout == "window-softcap" else (0, None)
    dtype = torch.float16 if layout.startswith("float16") else torch.float32
    q = torch.randn(batch, n_kv * group, n_q, d, generator=g).to(dtype)
    k = torch.randn(batch, n_kv, n_k, d, generator=g).to(dtype)
    scale, offset = 0.3, n_k - n_q
    tokens = torch.randint(0, 6, (n_k,), generator=g).tolist()  # six tokens: most cells are in dense tiles
    rows, keys = map(torch.from_numpy, detection_cells(tokens))
    lone_r = torch.randint(0, n_k, (300,), generator=g)
    lone_c = (torch.rand(300, generator=g) * (lone_r + 1)).long()  # j <= i
    rows, keys = torch.cat([rows, lone_r]), torch.cat([keys, lone_c])
    shuffled = torch.randperm(rows.numel(), generator=g)
    rows, keys = rows[shuffled], keys[shuffled]
    queried = rows >= offset
    rows, keys = rows[queried] - offset, keys[queried]  # query rows count from the first query
    if layout.endswith("int32"):
        rows, keys = rows.int(), keys.int()
    s = scale * q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.arange(n_q).view(-1, 1) + offset
    j = torch.arange(n_k)
    visible = (j <= p) & ((j > p - window) if window else True)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    want = torch.exp(s - lse[..., None])[:, :, rows.long(), keys.long()]
    got = cell_weights(q, k, lse.float(), scale, rows, keys, softcap=softcap, window=window, chunk=97)
    assert got.shape == (batch, n_kv * group, rows.numel()) and rows.numel() > 2000
    assert (got.double() - want).abs().max() < 2e-6
    if window:
        assert (want == 0).sum() > 100 and (got[want == 0] == 0).all()  # cells the window hides

"""Key masks beyond causal (sliding windows with sinks, per query head) and soft-capping in the
torch kernel, against the eager reference built from the definition."""

from __future__ import annotations

import pytest
import torch

from headscope.kernels.attention import STATISTICS, attention
from headscope.kernels.reference import attention_scores, reference_attention

# name: (n_heads, n_kv_heads, n_q, n_k, key_window, key_sink, softcap)
CASES = {
    "mistral-window": (4, 2, 37, 37, 5, None, None),
    "per-head-window-sink-decode": (4, 2, 5, 41, [0, 3, 7, 1], [0, 1, 2, 0], 3.0),
    "softcap-only": (2, 1, 20, 20, None, None, 2.0),
    "window-2-fewer-keys-than-topk": (4, 1, 33, 33, 2, 0, None),
    "gemma2-window-softcap": (4, 2, 40, 40, 6, 0, 5.0),
    "sinks-over-a-chunk-short-window": (2, 1, 50, 50, 3, 18, None),
    # every head windowed, no sink: chunks skip the keys before their window (pooled blocks aligned)
    "per-head-windows-no-sink": (4, 2, 45, 45, [3, 8, 5, 2], None, None),
    "window-decode-rows": (4, 2, 3, 40, 6, None, 4.0),
}


def _inputs(n_heads, n_kv, n_q, n_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n_heads, n_q, 16, generator=g) * 2
    k = torch.randn(1, n_kv, n_k, 16, generator=g)
    v = torch.randn(1, n_kv, n_k, 8, generator=g)
    return q, k, v


def _as_arg(x):
    return torch.tensor(x, dtype=torch.int64) if isinstance(x, list) else x


@pytest.mark.parametrize("chunk_elements", [None, 150, 37])
@pytest.mark.parametrize("name", list(CASES))
def test_every_statistic_is_the_masked_distributions(name, chunk_elements):
    h, h_kv, n_q, n_k, window, sink, cap = CASES[name]
    q, k, v = _inputs(h, h_kv, n_q, n_k)
    kw = dict(spans=[(0, 1), (n_k // 2, n_k)], block_size=4, rows=[0, n_q - 1], topk=3, sink_size=3, window=7,
              key_window=_as_arg(window), key_sink=_as_arg(sink), softcap=cap)
    got = attention(q, k, v, stats=STATISTICS, chunk_elements=chunk_elements, **kw)
    ref = reference_attention(q, k, v, **kw)
    assert (got.out.double() - ref["out"]).abs().max() < 1e-5
    for stat_name, value in got.stats.items():
        assert torch.allclose(value.double(), ref[stat_name].double(), atol=2e-6), stat_name


def test_reference_mask_is_the_definition():
    """Window 2 with one sink key, five positions: row i sees key 0, i − 1 and i (by hand)."""
    q, k, _ = _inputs(1, 1, 5, 5)
    s = attention_scores(q, k, key_window=2, key_sink=1)
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 0, 1, 1]]).bool()
    assert torch.equal(torch.isfinite(s[0, 0]), want)
    capped = attention_scores(q * 100, k, softcap=3.0)
    assert capped[torch.isfinite(capped)].abs().max() <= 3.0


def test_window_changes_what_a_head_sees():
    """A window of 4 keys puts no mass on older keys; a window as long as the text is plain causal."""
    q, k, v = _inputs(2, 1, 30, 30)
    win = attention(q, k, v, stats=("rows", "entropy"), rows=[29], key_window=4)
    assert win.rows[0, :, 0, :26].abs().max() == 0
    assert torch.allclose(win.rows[0, :, 0, 26:].sum(-1), torch.ones(2))
    full = attention(q, k, v, stats="entropy")
    same = attention(q, k, v, stats="entropy", key_window=30, key_sink=3)
    assert torch.allclose(full.entropy, same.entropy) and torch.allclose(full.out, same.out)
    assert not torch.allclose(full.entropy, win.entropy)
    per_head = attention(q, k, v, stats="entropy", key_window=torch.tensor([4, 0]))
    assert torch.allclose(per_head.entropy[:, 0], win.entropy[:, 0])
    assert torch.allclose(per_head.entropy[:, 1], full.entropy[:, 1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(key_window=3, causal=False), "causal"),
    (dict(key_window=torch.tensor([1, 2, 3])), "n_heads"),
    (dict(key_window=torch.tensor([1.0, 2.0])), "int64"),
    (dict(key_window=-1), ">= 0"),
    (dict(key_window=4, key_sink=-2), ">= 0"),
    (dict(softcap=0.0), "positive"),
])
def test_bad_masks_are_refused(kwargs, message):
    q, k, v = _inputs(2, 1, 6, 6)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **kwargs)


# Every head windowed and some sinks (a KV-cache policy's streaming heads): a chunk's scores cover the
# sink keys and its rows' window band only, O(n · (S + W)); statistics that do not index keys, or
# whose key indices map back (lse, entropy, argmax, top-k), take that path.
GATHERED_STATS = [(), ("lse",), ("entropy",), ("argmax",), ("lse", "entropy", "argmax")]


def _random_sink_window_case(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (), generator=g))]

    def ints(lo, hi, n=None):
        return torch.randint(lo, hi + 1, (n,) if n else (), generator=g)

    n_kv = pick(1, 2, 3)
    group = pick(1, 2, 4)
    h = n_kv * group
    n_k = int(ints(1, 90))
    n_q = pick(n_k, n_k, 1, int(ints(1, n_k)))  # prefill, one decode row, or rows after a cache
    # per KV group, as a policy gives them; windows from 1 (the query alone) up; sinks mostly a few keys,
    # sometimes more than there are positions
    window = ints(1, 12, n_kv).repeat_interleave(group)
    sink = torch.where(ints(0, 4, n_kv) == 0, ints(0, n_k + 5, n_kv), ints(0, 4, n_kv)).repeat_interleave(group)
    if pick(True, False):  # heads of one group may differ too
        window, sink = ints(1, 12, h), ints(0, 6, h)
    dtype = pick(torch.float32, torch.float64)
    b = pick(1, 2)
    q = torch.randn(b, h, n_q, 16, generator=g, dtype=dtype) * 2
    k = torch.randn(b, n_kv, n_k, 16, generator=g, dtype=dtype)
    v = torch.randn(b, n_kv, n_k, 8, generator=g, dtype=dtype)
    kw = dict(key_window=window, key_sink=sink, softcap=pick(None, 4.0), topk=min(n_k, pick(1, 3)))
    return q, k, v, kw, pick(None, 7, 40, 300, 3000)


@pytest.mark.parametrize("stats", GATHERED_STATS, ids=lambda s: "+".join(s) or "out-only")
@pytest.mark.parametrize("seed", range(24))
def test_sink_and_window_heads_equal_the_masked_reference(seed, stats):
    """Random shapes (GQA, decode rows after a cache, sinks past the last position, W = 1, chunks down
    to one row, float64): the output and each statistic equal the dense masked softmax."""
    q, k, v, kw, chunk = _random_sink_window_case(seed)
    got = attention(q, k, v, stats=stats, chunk_elements=chunk, **kw)
    ref = reference_attention(q, k, v, **kw)
    tol = 1e-10 if q.dtype == torch.float64 else 2e-5
    assert got.out.dtype == q.dtype
    assert (got.out.double() - ref["out"]).abs().max() < tol
    want = set(stats) | ({"argmax_prob"} if "argmax" in stats else set())
    if "argmax" in stats and kw["topk"] > 1:
        want |= {"topk_index", "topk_prob"}
    assert set(got.stats) == want
    for name, value in got.stats.items():
        if value.dtype == torch.int64:
            assert torch.equal(value, ref[name]), name
        else:
            assert torch.allclose(value.double(), ref[name].double(), atol=max(tol, 2e-6)), name


@pytest.mark.parametrize("stats", GATHERED_STATS[:3] + [("argmax",)], ids=lambda s: "+".join(s) or "out-only")
def test_sink_and_window_heads_never_read_keys_no_row_can_see(stats):
    """Four decode rows after a cache of 200 keys, sinks 3 and windows of 6 to 10: keys 3 .. 186 are
    hidden from every row of every head, so poisoning them (NaN keys and values) changes nothing: the
    kernel reads S + W keys per row, not all earlier ones."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h, n, d in ((4, 4, 16), (2, 200, 16), (2, 200, 8)))
    kw = dict(key_window=torch.tensor([6, 6, 10, 10]), key_sink=3, topk=2)
    ref = reference_attention(q, k, v, **kw)
    k[:, :, 3:187], v[:, :, 3:187] = float("nan"), float("nan")
    got = attention(q, k, v, stats=stats, chunk_elements=16, **kw)
    assert torch.isfinite(got.out).all()
    assert (got.out.double() - ref["out"]).abs().max() < 1e-5
    for name, value in got.stats.items():
        assert torch.allclose(value.double(), ref[name].double(), atol=2e-6), name
    assert "argmax" not in stats or int(got.stats["topk_index"].min()) >= 0

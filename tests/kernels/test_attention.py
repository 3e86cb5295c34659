"""The torch attention kernel against plain eager attention in float64 (the full matrix: kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from headscope.kernels import statistics as stat
from headscope.kernels.attention import AttentionResult, attention
from headscope.kernels.reference import reference_attention


def make_qkv(b, n_heads, n_kv, n_q, n_k, d, dtype=torch.float32, seed=0, d_v=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_heads, n_q, d, generator=g).to(dtype)
    k = torch.randn(b, n_kv, n_k, d, generator=g).to(dtype)
    v = torch.randn(b, n_kv, n_k, d_v or d, generator=g).to(dtype)
    return q, k, v


def assert_matches(result: AttentionResult, ref: dict, names, atol=2e-5, out_atol=2e-5):
    torch.testing.assert_close(result.out.double(), ref["out"], atol=out_atol, rtol=0)
    for name in names:
        got = result[name]
        if name in (stat.ARGMAX, stat.TOPK_INDEX):
            assert got.dtype == torch.int64
            assert torch.equal(got, ref[name]), name
        else:
            assert got.dtype == torch.float32, name
            torch.testing.assert_close(got.double(), ref[name], atol=atol, rtol=0, msg=name)


# (batch, n_heads, n_kv_heads, n_q, n_k, d, causal)
SHAPES = [
    pytest.param(2, 6, 2, 37, 37, 16, True, id="gqa-causal-odd"),
    pytest.param(1, 4, 4, 33, 33, 8, False, id="mha-bidirectional"),
    pytest.param(1, 6, 2, 1, 1, 16, True, id="one-token"),
    pytest.param(1, 6, 3, 5, 41, 16, True, id="decode-rows"),
    pytest.param(1, 2, 2, 1, 50, 8, True, id="one-decode-row"),
    pytest.param(2, 4, 1, 20, 29, 8, False, id="mqa-cross-lengths"),
    pytest.param(1, 3, 1, 30, 12, 8, False, id="more-queries-than-keys"),
]


@pytest.mark.parametrize("chunk_elements", [None, 300], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("b,n_heads,n_kv,n_q,n_k,d,causal", SHAPES)
def test_every_statistic_matches_eager(b, n_heads, n_kv, n_q, n_k, d, causal, chunk_elements):
    q, k, v = make_qkv(b, n_heads, n_kv, n_q, n_k, d, seed=n_q * 100 + n_k)
    spans = [(0, 1), (n_k // 3, n_k // 3 + max(1, n_k // 4)), (n_k - 1, n_k)]
    rows = sorted({0, n_q // 2, n_q - 1}) + [-1]
    topk = min(3, n_k)
    kw = dict(causal=causal, sink_size=3, window=5, spans=spans, block_size=4, rows=rows, topk=topk)
    result = attention(q, k, v, stats=stat.STATISTICS, backend="torch", chunk_elements=chunk_elements, **kw)
    ref = reference_attention(q, k, v, **{**kw, "rows": [r % n_q for r in rows]})
    names = [*stat.STATISTICS, stat.ARGMAX_PROB] + ([stat.TOPK_INDEX, stat.TOPK_PROB] if topk > 1 else [])
    assert_matches(result, ref, names)
    assert result[stat.POOLED].shape == (b, n_heads, -(-n_q // 4), -(-n_k // 4))
    assert result[stat.ROWS].shape == (b, n_heads, len(rows), n_k)
    assert result[stat.SPAN_MASS].shape == (b, n_heads, n_q, len(spans))
    assert result[stat.COL_SUM].shape == (b, n_heads, n_k)


@pytest.mark.parametrize("name", stat.STATISTICS)
def test_each_statistic_alone(name):
    """Statistics share intermediate work; each must also be right when asked for alone."""
    q, k, v = make_qkv(1, 6, 2, 23, 23, 16, seed=7)
    kw = dict(causal=True, sink_size=2, window=4, spans=[(3, 9)], block_size=5, rows=[4, 22], topk=2)
    result = attention(q, k, v, stats=name, backend="torch", chunk_elements=200, **kw)
    assert set(result.stats) >= {name}
    ref = reference_attention(q, k, v, **kw)
    assert_matches(result, ref, [name])


@pytest.mark.parametrize(
    "n_q,n_k,causal", [(31, 31, True), (31, 31, False), (1, 40, True), (7, 40, True), (9, 40, False)]
)
def test_output_without_statistics(n_q, n_k, causal):
    """No statistics: square / single-row / bidirectional cases go to SDPA, others stay chunked."""
    q, k, v = make_qkv(2, 6, 2, n_q, n_k, 16, seed=3, d_v=8)
    result = attention(q, k, v, causal=causal, backend="torch")
    assert result.stats == {}
    assert result.out.shape == (2, 6, n_q, 8)
    assert_matches(result, reference_attention(q, k, v, causal=causal), [])


@pytest.mark.parametrize("n", [64, 150, 257])
def test_longer_rows_cross_argmax_blocks(n):
    """Rows longer than the 64-wide argmax blocks, with chunks that end mid-block."""
    q, k, v = make_qkv(1, 6, 2, n, n, 16, seed=n)
    stats = (stat.ARGMAX, stat.LSE, stat.ENTROPY, stat.COL_SUM, stat.POOLED, stat.ROWS)
    kw = dict(block_size=7, rows=[n - 1, n // 2])
    result = attention(q, k, v, stats=stats, backend="torch", chunk_elements=5000, **kw)
    assert_matches(result, reference_attention(q, k, v, causal=True, **kw), [*stats, stat.ARGMAX_PROB])


def test_ties_go_to_the_lowest_key_index():
    """Uniform attention (all scores equal): argmax is the first visible key, as torch.argmax says."""
    q, k, v = make_qkv(1, 4, 2, 9, 130, 16)
    result = attention(torch.zeros_like(q), k, v, stats=(stat.ARGMAX, stat.ENTROPY), backend="torch")
    assert torch.equal(result[stat.ARGMAX], torch.zeros(1, 4, 9, dtype=torch.int64))
    visible = torch.arange(130 - 9, 130) + 1.0
    torch.testing.assert_close(result[stat.ARGMAX_PROB], (1 / visible).expand(1, 4, 9))
    torch.testing.assert_close(result[stat.ENTROPY], visible.log().expand(1, 4, 9))


def test_worker_threads_give_the_same_numbers_and_restore_the_thread_count():
    """On CPU the chunks are shared among single-threaded workers (one per torch thread)."""
    q, k, v = make_qkv(2, 6, 2, 45, 45, 16, seed=4)
    kw = dict(stats=stat.STATISTICS, spans=[(2, 9)], block_size=6, rows=[44], topk=2, backend="torch",
              chunk_elements=400)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        inline = attention(q, k, v, **kw)
        torch.set_num_threads(3)
        threaded = attention(q, k, v, **kw)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(threaded.out, inline.out, atol=0, rtol=0)
    for name, value in inline.stats.items():
        torch.testing.assert_close(threaded[name], value, atol=1e-6, rtol=0, msg=name)
    assert_matches(threaded, reference_attention(q, k, v, causal=True, spans=[(2, 9)], block_size=6, rows=[44],
                                             topk=2), stat.STATISTICS)


@pytest.mark.parametrize("mode", ["inference_mode", "requires_grad"])
def test_works_under_inference_mode_and_with_grad_inputs(mode):
    """Model hooks run under inference_mode (thread-local: the worker threads must inherit it)."""
    q, k, v = make_qkv(1, 6, 2, 40, 40, 16, seed=8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if mode == "inference_mode":
            with torch.inference_mode():
                qi, ki, vi = q.clone(), k.clone(), v.clone()
                res = attention(qi, ki, vi, stats=(stat.LSE, stat.COL_SUM), backend="torch", chunk_elements=300)
        else:
            q.requires_grad_(True)
            res = attention(q, k, v, stats=(stat.LSE, stat.COL_SUM), backend="torch", chunk_elements=300)
            assert not res.out.requires_grad
            assert not attention(q, k, v, backend="torch").out.requires_grad  # the SDPA route too
    finally:
        torch.set_num_threads(before)
    assert_matches(res, reference_attention(q.detach(), k, v, causal=True), [stat.LSE, stat.COL_SUM])


def test_low_precision_inputs_computed_in_float32():
    q, k, v = make_qkv(1, 4, 2, 19, 19, 16, dtype=torch.bfloat16, seed=5)
    result = attention(q, k, v, stats=(stat.LSE, stat.ENTROPY, stat.COL_SUM), backend="torch")
    assert result.out.dtype == torch.bfloat16
    ref = reference_attention(q, k, v, causal=True)  # same bf16 values, exact arithmetic
    assert_matches(result, ref, [stat.LSE, stat.ENTROPY, stat.COL_SUM], out_atol=1e-2)


def test_float64_and_strided_inputs():
    """Hook tensors come as [batch, pos, head, d]; a transposed view must work without copies upstream."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 17, 6, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 17, 3, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, 17, 3, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    names = (stat.LSE, stat.ENTROPY, stat.ROWS)
    result = attention(q, k, v, stats=names, rows=[3], backend="torch", chunk_elements=100)
    assert result.out.dtype == torch.float64
    assert_matches(result, reference_attention(q, k, v, causal=True, rows=[3]), names, atol=1e-6)


def test_large_scores_stay_finite():
    """Peaked rows (scores ~ 1e3) must not overflow the lse or give NaN entropy."""
    q, k, v = make_qkv(1, 2, 1, 12, 12, 8, seed=2)
    result = attention(q * 30, k * 30, v, stats=(stat.LSE, stat.ENTROPY, stat.ARGMAX), backend="torch")
    ref = reference_attention(q * 30, k * 30, v, causal=True)
    assert torch.isfinite(result[stat.ENTROPY]).all()
    assert_matches(result, ref, [stat.LSE, stat.ARGMAX], atol=1e-3)
    torch.testing.assert_close(result[stat.ENTROPY].double(), ref[stat.ENTROPY], atol=1e-4, rtol=0)


def test_scale_and_attribute_access():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8)
    result = attention(q, k, v, scale=0.5, stats=[stat.LSE], backend="torch")
    ref = reference_attention(q, k, v, causal=True, scale=0.5)
    torch.testing.assert_close(result.lse.double(), ref[stat.LSE], atol=1e-5, rtol=0)
    with pytest.raises(AttributeError, match="not requested"):
        _ = result.entropy
    with pytest.raises(KeyError, match="not requested"):
        _ = result["entropy"]


def test_rows_match_decode_step_argmax():
    """Retrieval scoring reads argmax of the last row: the same key as the full row's argmax."""
    q, k, v = make_qkv(1, 6, 2, 4, 30, 16, seed=9)
    res = attention(q, k, v, stats=(stat.ARGMAX, stat.ROWS), rows=[-1], backend="torch")
    assert torch.equal(res[stat.ROWS][:, :, 0].argmax(-1), res[stat.ARGMAX][:, :, -1])
    assert torch.allclose(res[stat.ROWS].sum(-1), torch.ones(1, 6, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n_heads,n_kv", [(9, 3), (4, 4)])
def test_one_decode_row_with_its_argmax_equals_the_chunked_path_and_eager(dtype, n_heads, n_kv):
    """A decode step asking only for the argmax takes a short path (no chunk set-up): the same numbers,
    bit for bit, as the chunked path computing more statistics, and eager attention's."""
    q, k, v = make_qkv(1, n_heads, n_kv, 1, 530, 64, dtype=dtype, seed=11)
    fast = attention(q, k, v, stats=stat.ARGMAX, backend="torch")
    chunked = attention(q, k, v, stats=(stat.ARGMAX, stat.LSE), backend="torch")
    assert torch.equal(fast.out, chunked.out) and fast.out.dtype == dtype
    for name in (stat.ARGMAX, stat.ARGMAX_PROB):
        assert torch.equal(fast[name], chunked[name]), name
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    assert_matches(fast, reference_attention(q, k, v, causal=True), [stat.ARGMAX, stat.ARGMAX_PROB], tol, tol)
    tied = attention(torch.zeros_like(q), k, v, stats=stat.ARGMAX, backend="torch")  # every score equal
    assert torch.equal(tied[stat.ARGMAX], torch.zeros(1, n_heads, 1, dtype=torch.int64))


def _qkv():
    return make_qkv(1, 6, 2, 8, 8, 16)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(spans=[(0, 9)], stats=stat.SPAN_MASS), "outside the sequence"),
        (dict(spans=[(-1, 3)], stats=stat.SPAN_MASS), "outside the sequence"),
        (dict(spans=[(4, 4)], stats=stat.SPAN_MASS), "outside the sequence"),
        (dict(spans=[(1,)], stats=stat.SPAN_MASS), r"\(start, end\) pair"),
        (dict(stats=stat.SPAN_MASS), "needs spans"),
        (dict(block_size=0, stats=stat.POOLED), "block_size must be a positive int"),
        (dict(block_size=-4, stats=stat.POOLED), "block_size must be a positive int"),
        (dict(stats=stat.POOLED), "needs block_size"),
        (dict(stats=("lse", "attention")), "unknown statistic"),
        (dict(rows=[8], stats=stat.ROWS), "out of range"),
        (dict(rows=[-9], stats=stat.ROWS), "out of range"),
        (dict(stats=stat.ROWS), "needs rows"),
        (dict(topk=0, stats=stat.ARGMAX), "topk must be >= 1"),
        (dict(topk=9, stats=stat.ARGMAX), "exceeds the number of keys"),
        (dict(window=0, stats=stat.RECENT_MASS), "window must be >= 1"),
        (dict(sink_size=0, stats=stat.SINK_MASS), "sink_size must be >= 1"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(backend="triton"), "needs CUDA tensors"),
        (dict(chunk_elements=0), "chunk_elements"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **change)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16)), "multiple of n_kv_heads"),
        (((1, 6, 8, 16), (1, 2, 8, 8), (1, 2, 8, 8)), "share d_head"),
        (((1, 6, 8, 16), (1, 2, 8, 16), (1, 2, 7, 16)), "k and v must agree"),
        (((2, 6, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), "batch sizes differ"),
        (((6, 8, 16), (2, 8, 16), (2, 8, 16)), "must be 4-D"),
        (((1, 6, 9, 16), (1, 2, 8, 16), (1, 2, 8, 16)), "n_q <= n_k"),
    ],
)
def test_bad_shapes_raise_clear_errors(shapes, message):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v)


def test_mismatched_dtypes_and_devices_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="share one dtype"):
        attention(q, k.double(), v)
    with pytest.raises(ValueError, match="one device"):
        attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="floating point"):
        attention(q.long(), k.long(), v.long())


def test_statistic_names_are_reexported_for_callers():
    """analysis/ imports the names with attention() from headscope.kernels.attention; they are kernels.statistics'."""
    import headscope.kernels.attention

    for name in stat.__all__:
        assert getattr(headscope.kernels.attention, name) is getattr(stat, name), name
    assert set(stat.__all__) <= set(headscope.kernels.attention.__all__)

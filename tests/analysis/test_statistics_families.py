"""Statistics mode on tiny random models of every supported family, against the eager path.

Llama, Mistral (sliding window on every layer), Qwen 2 (q/k/v biases), Qwen 3 (QK-norm),
Gemma 2 (soft-capping, windows on alternate layers, ``query_pre_attn_scalar``), Gemma 3 (QK-norm,
windows and a RoPE base per layer, head_dim 256, one KV head for four query heads), GPT-2
(absolute positions, fused qkv), StableLM (partial RoPE) and OLMo 2 (QK-norm across heads): built
from transformers configs (``tests/tiny_families.py``), no downloads. Texts are longer than the
windows, so the masks matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headscope.analysis.attention_statistics import (
    LayerRequest,
    StatisticsModeError,
    _check_causal_mask,
    check_supported,
    statistics_mode,
)
from headscope.analysis.capture import capture
from headscope.analysis.models import wrap_model
from headscope.analysis.statistics_run import STATS_METRICS, capture_statistics, statistics_score
from headscope.kernels.attention import ARGMAX, ARGMAX_PROB, COL_SUM, ENTROPY, RECENT_MASS, ROWS, SINK_MASS
from tests.tiny_families import FAMILIES, tiny_family_model

TEXT = ("The keeper of the lighthouse wrote every evening in a small blue notebook. She counted the ships, "
        "the gulls and the storms, and once a year she sent the notebook to her sister in the city, who "
        "read it aloud to the children. The children asked about the storms, the gulls and the ships.")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, embedded_tokenizer):
    name = request.param
    model = wrap_model(tiny_family_model(name, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{name}", digest=f"tiny-{name}-seed0")
    ids = torch.tensor([embedded_tokenizer.encode(TEXT)[:60]])
    return name, model, ids


def _eager(model, ids):
    with torch.inference_mode():
        logits, cache = model.bridge.run_with_cache(ids)
    return logits, [cache[f"blocks.{layer}.attn.hook_pattern"].double() for layer in range(model.n_layers)]


def test_the_bridge_boots_with_hugging_faces_logits(embedded_tokenizer):
    """Full-pattern mode: TransformerLens' bridge wraps every family with Hugging Face's own logits
    (a fresh model each: the bridge rewires the one it wraps)."""
    ids = torch.tensor([embedded_tokenizer.encode(TEXT)[:60]])
    for name in FAMILIES:
        hf = tiny_family_model(name, len(embedded_tokenizer))
        with torch.inference_mode():
            want = hf(ids).logits.clone()
        model = wrap_model(hf, embedded_tokenizer, name=f"tiny-{name}-hf", digest=f"tiny-{name}-hf")
        with torch.inference_mode():
            got = model.bridge(ids, return_type="logits")
        assert (got - want).abs().max().item() < 1e-4, name


def test_logits_equal_eager_and_every_layer_runs_through_the_kernel(family):
    name, model, ids = family
    check_supported(model.bridge)  # no refusal
    eager, _ = _eager(model, ids)
    seen = []
    with torch.inference_mode(), statistics_mode(model, lambda *a: LayerRequest({"stats": (ENTROPY,)}), seen.append):
        stats = model.bridge(ids, return_type="logits")
    assert (stats - eager).abs().max().item() < 1e-4
    assert [s.layer for s in seen] == list(range(model.n_layers))


def test_statistics_equal_those_of_the_eager_patterns(family):
    """Entropy, argmax, sink / recent masses, column sums and the pair terms from the kernel equal
    the same numbers read off the eager patterns (which carry the model's own mask)."""
    name, model, ids = family
    _, patterns = _eager(model, ids)
    req = LayerRequest({"stats": (ENTROPY, ARGMAX, SINK_MASS, RECENT_MASS, COL_SUM), "sink_size": 2, "window": 5},
                       pairs=(0, 1, 6))
    seen = []
    with torch.inference_mode(), statistics_mode(model, lambda *a: req, seen.append):
        model.bridge(ids, return_type="logits")
    n = ids.shape[1]
    i = torch.arange(n)
    for ls, a in zip(seen, patterns, strict=True):
        got = {k: v.double() for k, v in ls.stats.items()}
        assert torch.allclose(got[ENTROPY], torch.special.entr(a).sum(-1), atol=1e-5)
        assert torch.equal(ls.stats[ARGMAX], a.argmax(-1))
        assert torch.allclose(got[ARGMAX_PROB], a.amax(-1), atol=1e-5)
        assert torch.allclose(got[SINK_MASS], a[..., :2].sum(-1), atol=1e-5)
        recent = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 5)
        assert torch.allclose(got[RECENT_MASS], (a * recent).sum(-1), atol=1e-5)
        assert torch.allclose(got[COL_SUM], a.sum(-2), atol=1e-5)
        for offset in (0, 1, 6):
            want = torch.zeros_like(a[..., 0])
            want[..., offset:] = a[..., i[offset:], i[offset:] - offset]
            assert torch.allclose(ls.pairs[offset].double(), want, atol=1e-5), offset


def test_kv_cached_decode_equals_eager(family):
    """A decode step through the KV cache (a sliding layer's cache keeps only its window) gives the
    eager logits, and its argmax key and row are in the model's positions: those of the full pattern."""
    name, model, ids = family
    eager, patterns = _eager(model, ids)
    seen = []
    req = LayerRequest({"stats": (ARGMAX, ROWS), "rows": [0]})
    with torch.inference_mode(), statistics_mode(model, lambda layer, n_q, n_k: req if n_q == 1 else None,
                                                 seen.append):
        _, past = model.bridge(ids[:, :-1], return_type="logits_and_cache", use_cache=True)
        step, _ = model.bridge(ids[:, -1:], return_type="logits_and_cache", past_key_values=past)
    assert (step[0, -1] - eager[0, -1]).abs().max().item() < 1e-4
    assert len(seen) == model.n_layers
    for ls, a in zip(seen, patterns, strict=True):
        last = a[0, :, -1]  # [head, key]
        assert ls.n_k == ids.shape[1]
        assert torch.equal(ls.stats[ARGMAX][0, :, 0], last.argmax(-1))
        assert torch.allclose(ls.stats[ROWS][0, :, 0].double(), last, atol=1e-5)


def test_scores_of_a_statistics_run_equal_those_of_patterns(family):
    """Every per-head score of a statistics run (what a long page run shows) equals the
    pattern-based score of the same text."""
    name, model, ids = family
    tokens = ids[0].tolist()
    run = capture(model, tokens, pattern_dtype="float32", max_tokens=len(tokens))
    stats = capture_statistics(model, tokens, sink=4, window=16)
    for metric in STATS_METRICS:
        if metric == "streaming":
            from headscope.analysis.streaming import streaming_score

            expected = streaming_score(run.patterns, sink=4, window=16, layer_windows=run.layer_windows)
        else:
            expected = run.head_scores(metric)
        got = statistics_score(stats, metric)
        np.testing.assert_allclose(got, expected, atol=5e-6, rtol=0, err_msg=metric)


def test_what_still_cannot_run_is_refused_by_name(embedded_tokenizer):
    phi3 = wrap_model(tiny_family_model("phi3", len(embedded_tokenizer)), embedded_tokenizer,
                      name="tiny-phi3", digest="tiny-phi3")
    with pytest.raises(StatisticsModeError, match="JointQKVPositionEmbeddingsAttentionBridge"):
        check_supported(phi3.bridge)
    model = wrap_model(tiny_family_model("llama", len(embedded_tokenizer)), embedded_tokenizer,
                       name="tiny-llama-sinks", digest="tiny-llama-sinks")
    hf_attn = model.bridge.blocks[1].attn.original_component
    hf_attn.sinks = torch.nn.Parameter(torch.zeros(model.n_heads))
    with pytest.raises(StatisticsModeError, match="learned sinks in layer 1"):
        check_supported(model.bridge)
    del hf_attn.sinks
    model.bridge.cfg.qk_norm_after_rope = True
    with pytest.raises(StatisticsModeError, match="qk_norm_after_rope"):
        check_supported(model.bridge)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_retrieval_argmax_rows_equal_eager_and_the_full_pattern(name, embedded_tokenizer, monkeypatch):
    """Greedy decoding records each step's argmax key per head (the retrieval score's input): the
    statistics-mode path, the eager hook path and the full pattern of the whole sequence (no cache,
    brute force) agree, in the model's positions, also past a sliding window's cache. Nothing is hooked,
    so the statistics-mode decode runs on the Hugging Face modules without the bridge's wrappers
    (analysis.bare_model): every family's twin is checked here."""
    import headscope.analysis.greedy_decoding as gd

    model = wrap_model(tiny_family_model(name, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{name}-decode", digest=f"tiny-{name}-decode")
    prompt = embedded_tokenizer.encode(TEXT)[:30]
    assert gd.statistics_supported(model) and gd.bare_supported(model)
    kernel = gd.greedy_decode(model, prompt, max_new_tokens=6, keep_row=(1, 2))
    monkeypatch.setattr(gd, "statistics_supported", lambda model: False)
    eager = gd.greedy_decode(model, prompt, max_new_tokens=6, keep_row=(1, 2))
    assert kernel.generated == eager.generated
    _, patterns = _eager(model, torch.tensor([prompt + kernel.generated[:-1]]))
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(kernel.generated))
    full = np.stack([a[0][:, rows].argmax(-1).T.numpy() for a in patterns], 1)  # [step, layer, head]
    np.testing.assert_array_equal(kernel.argmax_keys, full)
    np.testing.assert_array_equal(eager.argmax_keys, full)
    for t, (row_k, row_e) in enumerate(zip(kernel.rows, eager.rows, strict=True)):
        want = patterns[1][0, 2, rows[t], : rows[t] + 1].numpy()
        np.testing.assert_allclose(row_k, want, atol=1e-5)
        np.testing.assert_allclose(row_e, want, atol=1e-5)


def test_a_mask_that_disagrees_with_the_layers_window_is_refused():
    """The window read off the module is held against the mask the model built: a plain causal mask
    on a layer said to have a window (or another window) stops the run instead of computing something else."""
    n, neg = 12, torch.finfo(torch.float32).min
    i = torch.arange(n)
    window4 = torch.where((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4), 0.0, neg)[None, None]
    _check_causal_mask(window4, n, n, window=4)
    _check_causal_mask(window4[..., -1:, :], 1, n, window=4)  # a decode row
    causal = torch.where(i[None, :] <= i[:, None], 0.0, neg)[None, None]
    with pytest.raises(StatisticsModeError, match="sliding window of 4 keys"):
        _check_causal_mask(causal, n, n, window=4)
    with pytest.raises(StatisticsModeError, match="sliding window of 5 keys"):
        _check_causal_mask(window4, n, n, window=5)
    with pytest.raises(StatisticsModeError, match="not plain causal"):
        _check_causal_mask(window4, n, n)

"""Composition scores (Elhage et al. 2021, as TransformerLens' all_composition_scores): a K-composition planted
by construction ranks first, and every score equals a brute-force computation from the Hugging Face weights of a
fresh copy (norm gains folded by hand; GQA, Gemma's offset gains and post-norms, GPT-2's fused qkv and LayerNorm)."""

import numpy as np
import pytest
import torch

from headscope.analysis.composition import composition_scores
from headscope.analysis.errors import InputError
from headscope.analysis.models import wrap_model
from tests.tiny_families import REFUSED, tiny_family_model


def _weights(hf, family):
    """Per layer: W_Q, W_K, W_V ``[H, d_model, d_head]`` (KV heads repeated), W_O ``[H, d_head, d_model]``, with
    the input norm's gain (and LayerNorm's centring) and the post-attention norm's gain folded, by hand."""
    cfg = hf.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    out = []
    blocks = hf.transformer.h if family == "gpt2" else hf.model.layers
    for block in blocks:
        if family == "gpt2":
            d = cfg.n_embd
            w = block.attn.c_attn.weight.detach().double()  # Conv1D: [d_in, 3 d]
            wq, wk, wv = w[:, :d], w[:, d:2 * d], w[:, 2 * d:]
            wo = block.attn.c_proj.weight.detach().double()  # [d_in, d_out]
            gamma, centre, post = block.ln_1.weight.detach().double(), True, None
        else:
            attn = block.self_attn
            wq, wk, wv = (m.weight.detach().double().T for m in (attn.q_proj, attn.k_proj, attn.v_proj))
            wo = attn.o_proj.weight.detach().double().T
            offset = 1.0 if family.startswith("gemma") else 0.0
            gamma, centre = block.input_layernorm.weight.detach().double() + offset, False
            post = block.post_attention_layernorm.weight.detach().double() + offset if family.startswith("gemma") else None
        folded = []
        for m in (wq, wk, wv):
            m = gamma[:, None] * m
            folded.append(m - m.mean(0, keepdim=True) if centre else m)
        if post is not None:
            wo = wo * post
        d_head = wq.shape[1] // n_heads
        heads = lambda m, n, d_head=d_head: m.reshape(m.shape[0], n, d_head).permute(1, 0, 2)  # noqa: E731
        group = n_heads // n_kv
        out.append({"Q": heads(folded[0], n_heads), "K": heads(folded[1], n_kv).repeat_interleave(group, 0),
                    "V": heads(folded[2], n_kv).repeat_interleave(group, 0), "O": wo.reshape(n_heads, d_head, -1)})
    return out


def _brute_force(weights, kind):
    f = torch.linalg.matrix_norm
    n_layers, n_heads = len(weights), weights[0]["Q"].shape[0]
    out = np.zeros((n_layers, n_heads, n_layers, n_heads))
    for a in range(n_layers):
        for b in range(a + 1, n_layers):
            for h in range(n_heads):
                ov = weights[a]["V"][h] @ weights[a]["O"][h]
                for g in range(n_heads):
                    qk = weights[b]["Q"][g] @ weights[b]["K"][g].T
                    right = {"q": qk, "k": qk.T, "v": weights[b]["V"][g] @ weights[b]["O"][g]}[kind]
                    out[a, h, b, g] = float(f(ov @ right) / (f(ov) * f(right)))
    return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "gpt2"])
def test_every_score_equals_a_brute_force_computation_from_the_weights(family, embedded_tokenizer):
    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer), seed=1), embedded_tokenizer,
                       name=f"tiny-{family}", digest=f"tiny-{family}-seed1")
    scores = composition_scores(model)
    weights = _weights(tiny_family_model(family, len(embedded_tokenizer), seed=1), family)
    for kind in ("q", "k", "v"):
        np.testing.assert_allclose(scores.of(kind), _brute_force(weights, kind), rtol=1e-9, atol=1e-12)
        assert np.all(scores.of(kind)[1:, :, 0] == 0)  # no head composes into an earlier or the same layer


def test_a_planted_k_composition_ranks_first(embedded_tokenizer):
    """Head 0.1's output projection writes only along e_0; the key projection of layer 1's second key-value
    group (query heads 2 and 3) reads only e_0. So OV^{0.1} (QK^{1.2})ᵀ is a product of two rank-1 maps
    through e_0 and its K-composition is exactly 1, above every unplanted pair (they write only a part of
    their output along e_0)."""
    hf = tiny_family_model("llama", len(embedded_tokenizer), seed=4)
    d_head = 16
    with torch.no_grad():
        o = hf.model.layers[0].self_attn.o_proj.weight  # [d_model, H · d_head]
        o[:, d_head:2 * d_head] = 0.0
        o[0, d_head:2 * d_head] = torch.randn(d_head)
        k = hf.model.layers[1].self_attn.k_proj.weight  # [H_kv · d_head, d_model]
        k[d_head:2 * d_head, 1:] = 0.0
    model = wrap_model(hf, embedded_tokenizer, name="tiny-planted", digest="tiny-planted-k-composition")
    scores = composition_scores(model).k
    order = np.argsort(scores, axis=None)[::-1]
    top = [np.unravel_index(i, scores.shape) for i in order[:2]]
    assert {tuple(int(x) for x in t) for t in top} == {(0, 1, 1, 2), (0, 1, 1, 3)}
    assert scores[0, 1, 1, 2] == pytest.approx(1.0, abs=1e-9)
    assert np.sort(scores, axis=None)[-3] < 0.9
    weights = _weights(tiny_family_model("llama", len(embedded_tokenizer), seed=4), "llama")  # unplanted copy
    assert _brute_force(weights, "k")[0, 1, 1, 2] < 0.9


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_the_decomposition_does_not_know_is_refused(family, embedded_tokenizer):
    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer)), embedded_tokenizer, name=family, digest=family)
    with pytest.raises(InputError, match="statistics mode"):
        composition_scores(model)


def test_an_unknown_kind_is_refused(embedded_tokenizer):
    model = wrap_model(tiny_family_model("llama", len(embedded_tokenizer)), embedded_tokenizer, name="l", digest="l")
    with pytest.raises(InputError, match="not one of"):
        composition_scores(model).of("o")

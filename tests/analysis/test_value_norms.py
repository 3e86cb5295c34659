"""Norm-based attention (Kobayashi et al. 2020), checked against the layer's own output."""

from __future__ import annotations

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.attribution import attribute
from headscope.analysis.value_norms import contribution_norms, contributions, value_weighted_patterns


def layer_activations(model, ids, layer):
    acts = {}

    def keep(name):
        def hook(x, hook=None):
            acts[name] = x[0].detach().clone()

        return hook

    hooks = [(get_act_name(n, layer), keep(n)) for n in ("v", "pattern", "attn_out")]
    with torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([ids]), fwd_hooks=hooks, return_type=None)
    return acts


def test_contributions_add_up_to_the_attention_layers_output(tiny_model):
    """Σ_j Σ_h α^h_ij v^{g(h)}_j W_O^h is the layer's output: the grouped-query mapping and W_O are right."""
    ids = [5, 17, 3, 99, 42, 7]
    for layer in range(tiny_model.n_layers):
        acts = layer_activations(tiny_model, ids, layer)
        assert acts["v"].shape[1] < acts["pattern"].shape[0]  # grouped-query: fewer value groups than heads
        c = contributions(acts["pattern"], acts["v"], tiny_model.bridge.blocks[layer].attn.W_O.detach())
        assert torch.allclose(c.sum(dim=1), acts["attn_out"].float(), atol=1e-5)


def test_norms_equal_a_loop_over_heads_and_tokens(tiny_model):
    ids = [9, 8, 7, 6, 5]
    acts = layer_activations(tiny_model, ids, 0)
    w_o = tiny_model.bridge.blocks[0].attn.W_O.detach().float()
    pattern, v = acts["pattern"].float(), acts["v"].float()
    rep = pattern.shape[0] // v.shape[1]
    by_loop = torch.zeros(len(ids), len(ids))
    for i in range(len(ids)):
        for j in range(len(ids)):
            vec = sum(pattern[h, i, j] * (v[j, h // rep] @ w_o[h]) for h in range(pattern.shape[0]))
            by_loop[i, j] = torch.linalg.vector_norm(vec)
    assert torch.allclose(contribution_norms(acts["pattern"], acts["v"], w_o), by_loop, atol=1e-5)


def test_value_weighted_patterns_are_causal_rows_that_sum_to_one(tiny_model):
    p = value_weighted_patterns(tiny_model, [1, 2, 3, 4, 5, 6, 7])
    assert p.shape == (tiny_model.n_layers, 1, 7, 7)
    assert np.allclose(p.sum(-1), 1) and np.triu(p[:, 0], 1).max() == 0
    # weighting by value norms changes the picture: it is not the head-mean attention
    acts = layer_activations(tiny_model, [1, 2, 3, 4, 5, 6, 7], 0)
    assert not np.allclose(p[0, 0], acts["pattern"].float().mean(0).numpy(), atol=1e-3)


def test_attribute_scores_value_weighted_and_position_corrected_methods(tiny_model):
    a = attribute(tiny_model, [11, 12, 13, 14, 15, 16], position=4)
    for m in ("value_attention", "value_rollout", "rollout_debiased", "flow_debiased"):
        assert a.scores[m].shape == (5,) and np.isclose(a.scores[m].sum(), 1), m
    rho = a.correlations(["value_rollout", "flow_debiased"])
    assert set(rho) == {"value_rollout", "flow_debiased"}

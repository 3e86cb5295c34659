"""Norm-based ("value-aware") attention: how much each token's value actually moves the output.

Kobayashi, Kuribayashi, Yokoi & Inui 2020, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms" (EMNLP 2020, arXiv:2004.10102), section 3. An attention layer's
output at position i is a sum of transformed inputs,

    y_i = Σ_j Σ_h α^h_ij · f^h(x_j),      f^h(x_j) = v^h_j W_O^h

(v^h_j: head h's value vector of token j, the ``hook_v`` activation after the layer's input norm;
W_O^h: head h's block of the output projection; the model has no value or output biases). A large
weight α on a token whose f(x) is nearly zero moves nothing, which is why attention weights alone
can mislead. The paper's layer-level measure is the norm of each token's whole contribution:

    N_l[i, j] = ‖ Σ_h α^h_ij · f^h(x_j) ‖₂

With grouped-query attention head h reads the value of key-value group ⌊h / (H / G)⌋ (the
``repeat_kv`` layout of Hugging Face Llama). :func:`value_weighted_patterns` returns N_l with each
row divided by its sum, shaped like attention patterns with one head, so raw attention, rollout
and flow (:mod:`headscope.analysis.rollout`, :mod:`headscope.analysis.flow`) run on it unchanged.

Where each part comes from: the norms N_l are Kobayashi et al. 2020 ("Attention is Not Only a
Weight: Analyzing Transformers with Vector Norms", EMNLP 2020), who read them one layer at a time.
"Value-weighted attention" is their measure at one layer, rows renormalised. "Value-weighted
rollout" multiplies those rows across layers as attention rollout does (Abnar & Zuidema 2020,
arXiv:2005.00928): that combination is headscope's own, defined in neither paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel


def contributions(pattern: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each token's contribution to each output of one attention layer, ``Σ_h α^h_ij · v^{g(h)}_j W_O^h``.

    Summed over j it is the layer's output at i (``hook_attn_out``; the embedded model has no output
    bias), which is how the tests check it.

    Parameters
    ----------
    pattern : ``[head, query, key]`` post-softmax attention α.
    v : ``[key, group, d_head]`` value vectors (``hook_v`` of one sequence).
    w_o : ``[head, d_head, d_model]`` the output projection split by head.

    Returns
    -------
    torch.Tensor, float32 ``[query, key, d_model]``
    """
    n_heads, n_groups = pattern.shape[0], v.shape[1]
    if n_heads % n_groups:
        raise ValueError(f"{n_heads} query heads cannot share {n_groups} value groups evenly")
    values = v.float().repeat_interleave(n_heads // n_groups, dim=1)  # [key, head, d_head]
    f = torch.einsum("jhd,hdm->hjm", values, w_o.float())  # f^h(x_j): [head, key, d_model]
    return torch.einsum("hij,hjm->ijm", pattern.float(), f)


def contribution_norms(pattern: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``N[i, j] = ‖Σ_h α^h_ij · v^{g(h)}_j W_O^h‖₂``, float32 ``[query, key]`` (see :func:`contributions`)."""
    return torch.linalg.vector_norm(contributions(pattern, v, w_o), dim=-1)


def value_weighted_patterns(model: LoadedModel, token_ids: Sequence[int]) -> np.ndarray:
    """Row-normalised norm-based attention N_l of every layer (module docstring), float64
    ``[layer, 1, query, key]``, from one forward pass of ``token_ids`` (used as given)."""
    ids = [int(i) for i in token_ids]
    if not ids:
        raise InputError("The input is empty: there are no tokens to weight.")
    n_layers = model.n_layers
    values: dict[int, torch.Tensor] = {}
    out = np.zeros((n_layers, 1, len(ids), len(ids)), dtype=np.float64)

    def keep_v(layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            values[layer] = tensor[0].detach()

        return hook

    def weigh(layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            w_o = model.bridge.blocks[layer].attn.W_O.detach()
            norms = contribution_norms(tensor[0].detach(), values.pop(layer), w_o).double().numpy()
            totals = norms.sum(axis=1, keepdims=True)
            out[layer, 0] = np.divide(norms, totals, out=np.zeros_like(norms), where=totals > 0)

        return hook

    hooks = []
    for layer in range(n_layers):
        hooks += [(get_act_name("v", layer), keep_v(layer)), (get_act_name("pattern", layer), weigh(layer))]
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([ids], device=model.device), fwd_hooks=hooks, return_type=None)
    return out

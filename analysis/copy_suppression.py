"""Copy suppression: how much a head's output lowers the logits of the tokens it attends to.

McDougall, Conmy, Rushing, McGrath & Nanda 2023, "Copy Suppression: Comprehensively Understanding an
Attention Head" (arXiv:2310.04625). Head L10H7 of GPT-2 Small attends to earlier tokens that the model
is about to predict and writes, through its OV circuit, the negative of their unembeddings, so their
logits fall (§3). The paper's copy-suppression-preserving ablation keeps, of what each source token
sends, only its projection onto the unembedding of that same token (§4). This score measures that
direct effect, for every head, on one text.

**Definition.** Freeze the final norm at the run explained, as direct logit attribution does: at
position i it is the linear map ``c ↦ (P c) ⊙ γ / σ_i``, with σ_i its scale there (``ln_final.hook_scale``:
the root mean square of the residual stream, centred for LayerNorm, ε included), γ its weight
(``1 + weight`` where the model stores an offset, as Gemma does) and P the centring over d_model
(LayerNorm; the identity for RMSNorm). Head h of layer l reads the value vectors ``v_j^g`` of its
key-value group ``g = ⌊h / (H / G)⌋`` (grouped-query attention: SmolLM2-135M's 9 query heads read 3
groups) and writes ``A[i, j] · v_j^g W_O^h`` from source j into position i. Its direct effect on the
logit of the source's own token ``t_j``, against the mean logit over the vocabulary (softmax ignores a
shift of every logit alike: a head that moves them all together suppresses nothing), is

    e(i, j) = A[i, j] · ((P v_j^g W_O^h) ⊙ γ / σ_i) · (W_U[:, t_j] − ū),     ū = (1/V) Σ_t W_U[:, t],

and the score is its negative, summed over the sources a query attends to, averaged over the queries:

    CS(l, h) = −(1/n) Σ_{i=0}^{n−1} Σ_{j=0}^{i} e(i, j)        (in logits)

Positive: the head lowers the logits of what it attends to (copy suppression); negative: it raises
them (copying, as name-mover heads do); near 0: it writes little along those tokens' unembeddings.
Every key counts as the head weighs it, the first (often a sink, whose value is small) and the query's
own included, and a model's sliding window is already in A. The value vectors include the value
bias; the output bias b_O belongs to no head and the unembedding bias to no direction, so neither
counts. A final logit soft-capping (Gemma 2) is left out: these are the logits before it.

**Computation.** One forward pass with the model's eager attention, hooked: ``e(i, j) = A[i, j] ·
s^h_j / σ_i`` with ``s^h_j = v_j^g · (W_O^h ũ_j)`` and ``ũ_j = P(γ ⊙ (W_U[:, t_j] − ū))``
(:func:`logit_directions`), so each layer's row sums ``r[h, i] = Σ_j A[h, i, j] s^h_j`` are taken while
its pattern passes, and divided by σ_i once the final norm has run. Nothing ``n × n`` is kept beyond
the model's own attention of one layer, which is why a text is limited to ``HEADSCOPE_MAX_TOKENS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.errors import InputError
from headscope.analysis.limits import hint, limit
from headscope.analysis.models import LoadedModel

LIMIT = "HEADSCOPE_MAX_TOKENS"
"""The limit on a scored text's tokens: the forward pass builds each layer's full attention."""


def logit_directions(model: LoadedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """``[n, d_model]`` float32 ``ũ_j = P(γ ⊙ (W_U[:, t_j] − ū))``: a vector c written at position i moves
    the logit of ``t_j``, against the vocabulary's mean logit, by ``c · ũ_j / σ_i`` (module docstring)."""
    norm = model.bridge.ln_final
    w_u = model.bridge.W_U.detach().float()  # [d_model, vocab]
    gamma = norm.weight.detach().float()
    if norm.uses_weight_offset:
        gamma = 1.0 + gamma
    ids = torch.as_tensor([int(t) for t in token_ids], dtype=torch.long, device=w_u.device)
    u = (w_u[:, ids] - w_u.mean(1, keepdim=True)).T * gamma
    if not norm.uses_rms_norm:  # LayerNorm centres what it reads: (P c) · w = c · (P w)
        u = u - u.mean(-1, keepdim=True)
    return u


def copy_suppression(model: LoadedModel, token_ids: Sequence[int]) -> np.ndarray:
    """``[layer, head]`` copy-suppression score ``CS(l, h)`` of every head on one text (module docstring).

    Parameters
    ----------
    model : the model, run on ``token_ids`` with its eager attention.
    token_ids : the ids the model sees, used as given (at most ``HEADSCOPE_MAX_TOKENS``).

    Returns
    -------
    np.ndarray
        float64 ``[layer, head]``, in logits: positive where a head lowers the logits of the tokens it
        attends to.
    """
    ids = [int(t) for t in token_ids]
    if not ids:
        raise InputError("The text is empty: there are no tokens to score.")
    outside = [t for t in ids if not 0 <= t < model.vocab_size]
    if outside:
        raise InputError(f"Token ids {outside[:5]} are not in the model's vocabulary (0..{model.vocab_size - 1}).")
    most = limit(LIMIT)
    if len(ids) > most:
        raise InputError(f"Copy suppression runs the model with full attention, on texts of at most {most:,} tokens "
                         f"{hint(LIMIT)}; this one has {len(ids):,}. Use a shorter text.")
    n_heads, n_groups = model.n_heads, model.n_kv_heads
    if n_heads % n_groups:
        raise InputError(f"{n_heads} query heads cannot share {n_groups} key-value groups evenly.")
    directions = logit_directions(model, ids)  # [n, d_model]
    rows = torch.zeros((model.n_layers, n_heads, len(ids)), dtype=torch.float64)
    values: dict[int, torch.Tensor] = {}
    scale: dict[str, torch.Tensor] = {}

    def keep_values(layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            values[layer] = tensor[0].detach().float()  # [n, group, d_head]

        return hook

    def sum_rows(layer: int):
        def hook(pattern: torch.Tensor, hook: Any = None) -> None:
            v = values.pop(layer).repeat_interleave(n_heads // n_groups, dim=1)  # [n, head, d_head]
            w_o = model.bridge.blocks[layer].attn.W_O.detach().float()  # [head, d_head, d_model]
            along = torch.einsum("hdm,jm->hjd", w_o, directions)  # W_O^h ũ_j
            s = torch.einsum("jhd,hjd->hj", v, along)  # s^h_j
            rows[layer] = torch.einsum("hij,hj->hi", pattern[0].detach().float(), s).double().cpu()

        return hook

    def keep_scale(tensor: torch.Tensor, hook: Any = None) -> None:
        scale["sigma"] = tensor[0, :, 0].detach().double().cpu()

    hooks = [("ln_final.hook_scale", keep_scale)]
    for layer in range(model.n_layers):
        hooks += [(get_act_name("v", layer), keep_values(layer)), (get_act_name("pattern", layer), sum_rows(layer))]
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([ids], device=model.device), fwd_hooks=hooks, return_type=None)
    return (-(rows / scale["sigma"]).mean(-1)).numpy()

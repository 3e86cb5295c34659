"""Q-, K- and V-composition scores of every earlier head into every later head, from the weights.

Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits" (§"Composition": "we measure the
amount of composition as ``||W_A W_B||_F / (||W_A||_F ||W_B||_F)``"), computed as TransformerLens'
``HookedTransformer.all_composition_scores`` does, in its row-vector convention (``x W``):

    OV^h = W_V^h W_O^h                  [d_model, d_model]   (what head h reads → what it writes)
    QK^h = W_Q^h (W_K^h)ᵀ               [d_model, d_model]   (score = x_i QK^h x_jᵀ)
    Q-composition(A → B) = ||OV^A QK^B||_F    / (||OV^A||_F ||QK^B||_F)
    K-composition(A → B) = ||OV^A (QK^B)ᵀ||_F / (||OV^A||_F ||QK^B||_F)
    V-composition(A → B) = ||OV^A OV^B||_F    / (||OV^A||_F ||OV^B||_F)

for a sender head A in an earlier layer than the receiver head B; the other entries are 0, as in
TransformerLens. Norm gains are folded in as TransformerLens' ``fold_ln`` does: the receiver's input norm
(``W_Q``, ``W_K``, ``W_V`` ← ``P diag(γ) W``, P the centring of LayerNorm, the identity for RMSNorm) and,
where a model normalises the attention output before adding it (Gemma 2/3, OLMo 2), the sender's post-norm
gain (``W_O ← W_O diag(γ_post)``); the norms' scales, which depend on the input, are not. Biases are left
out. **RoPE is ignored**: the scores are those of the un-rotated ``W_Q``, ``W_K``, as TransformerLens
computes them (a rotation by the relative position would change ``QK`` per pair of positions). A QK-norm
(Qwen 3, Gemma 3, OLMo 2) is not folded either: its scale is per token. Grouped-query attention: each
query head uses its key-value group's ``W_K`` and ``W_V``.

The norm of a product of two low-rank factored matrices is computed in ``d_head`` dimensions:
``||L_A R_A L_B R_B||_F = ||(T_A R_A)(L_B U_Bᵀ)||_F`` with ``L_A = Q T_A`` and ``R_Bᵀ = Q' U_B`` (QR), since
orthonormal factors keep the Frobenius norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel
from headscope.analysis.residual_components import affine_map, check_structure, frozen_norm

KINDS = ("q", "k", "v")


@dataclass
class CompositionScores:
    """Composition scores ``[sender layer, sender head, receiver layer, receiver head]`` (float64), 0 where
    the sender's layer is not earlier than the receiver's: ``q``, ``k``, ``v`` (module docstring)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray

    def of(self, kind: str) -> np.ndarray:
        """The scores of one kind, ``"q"``, ``"k"`` or ``"v"``."""
        if kind not in KINDS:
            raise InputError(f"Composition kind {kind!r} is not one of {', '.join(KINDS)}.")
        return getattr(self, kind)


def head_weights(model: LoadedModel, layer: int) -> dict[str, Tensor]:
    """Layer ``layer``'s per-query-head weights, float64, norm gains folded (module docstring):
    ``W_Q``, ``W_K``, ``W_V`` ``[H, d_model, d_head]`` (key-value heads repeated per query head) and
    ``W_O`` ``[H, d_head, d_model]``."""
    block = model.bridge.blocks[layer]
    attn = block.attn
    out = {}
    for name, side in (("W_Q", "q"), ("W_K", "k"), ("W_V", "v")):
        w = affine_map(getattr(attn, side))[0]  # [d_model, n · d_head]
        if hasattr(block, "ln1"):
            norm = frozen_norm(block.ln1)
            w = norm.gain[:, None] * w
            if norm.centred:
                w = w - w.mean(0, keepdim=True)
        n = model.n_heads if side == "q" else model.n_kv_heads
        w = w.reshape(w.shape[0], n, -1).permute(1, 0, 2)
        out[name] = w if side == "q" else w.repeat_interleave(model.group_size, dim=0)
    w_o = affine_map(attn.o)[0]  # [H · d_head, d_model]
    if hasattr(block, "ln1_post"):
        w_o = w_o * frozen_norm(block.ln1_post).gain
    out["W_O"] = w_o.reshape(model.n_heads, -1, w_o.shape[1])
    return out


def _r(m: Tensor) -> Tensor:
    """The triangular factor of a batch's thin QR (``[..., n, k]`` → ``[..., k, k]``)."""
    return torch.linalg.qr(m, mode="r")[1]


def composition_scores(model: LoadedModel) -> CompositionScores:
    """Q-, K- and V-composition of every earlier head into every later head (module docstring).

    Parameters
    ----------
    model : the model (its weights only; nothing is run).

    Returns
    -------
    CompositionScores
        ``[L, H, L, H]`` arrays per kind, 0 where the sender is not in an earlier layer.
    """
    check_structure(model)
    layers = [head_weights(model, layer) for layer in range(model.n_layers)]
    # sender factor OV = W_V W_O: X = T(W_V) W_O [H, d_head, d_model], ||OV||_F = ||X||_F
    senders = torch.stack([_r(w["W_V"]) @ w["W_O"] for w in layers])  # [L, H, dh, dm]
    # receiver factors Y [H, d_model, d_head] with ||B||_F = ||Y||_F: QK = W_Q W_Kᵀ, QKᵀ = W_K W_Qᵀ, OV
    receivers = {
        "q": torch.stack([w["W_Q"] @ _r(w["W_K"]).transpose(-1, -2) for w in layers]),
        "k": torch.stack([w["W_K"] @ _r(w["W_Q"]).transpose(-1, -2) for w in layers]),
        "v": torch.stack([w["W_V"] @ _r(w["W_O"].transpose(-1, -2)).transpose(-1, -2) for w in layers]),
    }
    sender_norm = torch.linalg.matrix_norm(senders)  # [L, H]
    n_layers, n_heads = model.n_layers, model.n_heads
    scores = {}
    for kind, y in receivers.items():
        out = torch.zeros(n_layers, n_heads, n_layers, n_heads, dtype=torch.float64)
        receiver_norm = torch.linalg.matrix_norm(y)
        for b in range(1, n_layers):
            product = torch.einsum("lhdm,gme->lhgde", senders[:b], y[b])  # [b, H, H, dh, dh]
            num = torch.linalg.matrix_norm(product)
            den = sender_norm[:b, :, None] * receiver_norm[b][None, None]
            out[:b, :, b] = torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros((), dtype=torch.float64))
        scores[kind] = out.numpy()
    return CompositionScores(**scores)

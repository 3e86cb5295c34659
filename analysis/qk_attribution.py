"""QK attribution: why head (l, h) gives query i its score on key j, as a sum over pairs of components.

Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits" (§"Attention heads": the score
is a bilinear form ``x_i W_Q W_Kᵀ x_jᵀ`` of the residual stream at the two positions, so it splits over
their components; §"Composition": what the earlier heads contribute to it is Q- and K-composition).

**Definition.** Freeze every normalisation at its scale in the run (:mod:`headscope.analysis.residual_components`).
The residual stream at the input of layer ``l`` is ``x(p) = Σ_c x_c(p)`` over the components ``c`` written by
the earlier layers (``embed``, heads ``L.H``, MLPs ``mlp.L``, ``bias``). Then head ``h``'s query at ``i`` is

    q(i) = Σ_c q_c(i) + q_0(i),   q_c(i) = R_i( g_q ⊙ (γ ⊙ P(x_c(i)) / σ_i) W_Q^h / ρ_i ),
    q_0(i) = R_i( g_q ⊙ (β W_Q^h + b_Q^h) / ρ_i ),

with σ_i the input norm's scale (γ its gain, P its centring, β its bias; OLMo 2 has no input norm: the
identity), ``b_Q`` the projection's bias (Qwen 2, GPT-2), ``ρ_i`` the QK-norm's scale at the run (Qwen 3 and
Gemma 3: the root mean square of the head's q; OLMo 2: of all heads' q together) with its gain ``g_q`` (both 1
without QK-norm) and ``R_i`` the rotary embedding at position ``i`` (linear for a fixed position; a part of the
dimensions where the rotation is partial; the identity for GPT-2's absolute positions, which are in ``embed``).
The key ``k(j)`` is the same with ``W_K``, ``b_K``, ``g_k`` and ``R_j`` of the head's key-value group
``⌊h / (H / H_kv)⌋`` (grouped-query attention). The constant parts ``q_0``, ``k_0`` are the component
``input_bias``. The score before softmax is

    s_ij = scale · q(i) · k(j) = Σ_{c, c'} scale · q_c(i) · k_{c'}(j)

with ``scale`` the module's own (``1/√d_head``, Gemma's ``query_pre_attn_scalar^-1/2``): a ``[C_q, C_k]``
matrix of terms whose row sums say what builds the query and column sums what builds the key. Attention
logit soft-capping (Gemma 2) is applied after: ``s_ij`` is the score before it, and
:attr:`QKAttribution.capped_score` the capped one the softmax sees.

**The model's own score** is recomputed from the q and k the model itself produced in the same forward
pass (hooked after QK-norm and RoPE: ``hook_rot_q``/``hook_rot_k``, or the projections' outputs for GPT-2),
``scale · q(i) · k(j)``: the bridge's ``hook_attn_scores`` is taken after soft-capping and masking. Every
call checks that the rebuilt q and k equal the model's (1e-4 of their largest entry) and that the terms add
up to its score to 1e-4 of ``scale · |q(i)| |k(j)|`` (the bound of the score, and the scale of its float32
rounding: a score near 0 is a cancellation, known no better than that), and refuses (:class:`InputError`)
where they do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.models import LoadedModel
from headscope.analysis.residual_components import (
    INPUT_BIAS,
    TOLERANCE,
    AttentionCapture,
    ComponentCapture,
    affine_map,
    capture_components,
    check_sum,
    frozen_norm,
)


@dataclass
class QKAttribution:
    """The score of head ``(layer, head)`` at ``(query, key)`` as a sum of component pairs.

    Attributes
    ----------
    query_names, key_names : component names (``embed``, ``L.H``, ``mlp.L``, ``bias``, ``input_bias``).
    terms : float64 ``[C_q, C_k]``, ``scale · q_c(i) · k_c'(j)``.
    score : the model's own score before softmax and before any soft-capping, recomputed from its hooked
        q and k (module docstring); ``terms.sum()`` equals it to 1e-4.
    capped_score : the score the softmax sees (``softcap · tanh(score / softcap)``; ``score`` without).
    softcap : the layer's attention logit soft-capping (Gemma 2), None without.
    scale : the layer's score scale.
    """

    layer: int
    head: int
    query: int
    key: int
    query_names: list[str]
    key_names: list[str]
    terms: np.ndarray
    score: float
    capped_score: float
    softcap: float | None
    scale: float

    @property
    def query_sums(self) -> np.ndarray:
        """``[C_q]`` row sums: what each query-side component contributes (with every key component)."""
        return self.terms.sum(1)

    @property
    def key_sums(self) -> np.ndarray:
        """``[C_k]`` column sums: what each key-side component contributes."""
        return self.terms.sum(0)


def qk_attribution(model: LoadedModel, token_ids: Sequence[int], layer: int, head: int, query: int, key: int,
                   capture: ComponentCapture | None = None) -> QKAttribution:
    """The pre-softmax score of head ``(layer, head)`` for query ``query`` on key ``key``, split over pairs of
    residual-stream components (module docstring).

    Parameters
    ----------
    model : the model.
    token_ids : the ids the model sees, as given.
    layer, head : the query head.
    query, key : token positions, ``key ≤ query`` and inside the layer's sliding window.
    capture : a :func:`headscope.analysis.residual_components.capture_components` of the same ids that kept
        both positions and ``layer``'s attention (its forward pass is then not run again).

    Returns
    -------
    QKAttribution
        ``terms.sum()`` equals the model's own ``score`` to 1e-4 (else :class:`InputError`).
    """
    from headscope.analysis.model_facts import attention_window

    ids = [int(t) for t in token_ids]
    layer, head = check_head_index(model.n_layers, model.n_heads, layer, head)
    query, key = _position(query, len(ids), "query"), _position(key, len(ids), "key")
    if key > query:
        raise InputError(f"Key {key} comes after query {query}: a causal head never scores it. Pick a key ≤ the query.")
    hf_attn = model.bridge.blocks[layer].attn.original_component
    window = attention_window(hf_attn)
    if window and key <= query - window:
        raise InputError(f"Key {key} is outside layer {layer}'s sliding window of {window} keys for query {query}: "
                         "the head never scores it. Pick a key closer to the query.")
    if capture is None or capture.token_ids != ids or not {query, key} <= set(capture.positions) \
            or layer not in capture.attention:
        capture = capture_components(model, ids, [query, key], attention_layers=[layer])
    names, vectors = capture.components(layer, [query, key])
    att = capture.attention[layer]
    group = model.kv_head(head)
    q_parts = _side(model, layer, att, vectors[0], capture.index(query), "q", head)
    k_parts = _side(model, layer, att, vectors[1], capture.index(key), "k", group)
    scale = float(hf_attn.scaling)
    terms = scale * (q_parts @ k_parts.T)
    q_own, k_own = att.q[capture.index(query), head].double(), att.k[capture.index(key), group].double()
    score = scale * float(q_own @ k_own)
    total = float(terms.sum())
    # the model's own score carries float32 rounding of about 1e-7 · scale · |q| |k|, whatever its size
    size = max(abs(scale) * float(q_own.norm() * k_own.norm()), 1e-12)
    if abs(total - score) > TOLERANCE * size:
        raise InputError(f"The QK terms add up to {total:.6g}, not to the model's own score {score:.6g}: this "
                         "model's attention is not the bilinear form headscope decomposes.")
    softcap = getattr(hf_attn, "attn_logit_softcapping", None)
    softcap = None if softcap is None else float(softcap)
    capped = score if softcap is None else softcap * float(np.tanh(score / softcap))
    all_names = [*names, INPUT_BIAS]
    return QKAttribution(layer=layer, head=head, query=query, key=key, query_names=all_names, key_names=list(all_names),
                         terms=terms.numpy(), score=score, capped_score=capped, softcap=softcap, scale=scale)


def _position(value: int, n: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < n:
        raise InputError(f"The {what} position {value!r} is outside the text: pick one in 0..{n - 1}.")
    return int(value)


def _side(model: LoadedModel, layer: int, att: AttentionCapture, parts: Tensor, p: int, side: str,
          head: int) -> Tensor:
    """``[C + 1, d_head]`` the q (``side="q"``) or k of ``head`` (a key-value head for k) made by each
    component ``parts [C, d_model]`` at captured index ``p``, and the constant part last: through the frozen
    input norm, the projection, the frozen QK-norm and the rotary embedding at that position."""
    attn = model.bridge.blocks[layer].attn
    block = model.bridge.blocks[layer]
    if hasattr(block, "ln1"):
        norm = frozen_norm(block.ln1)
        normed, constant = norm.apply(parts, att.sigma[p].double()), norm.bias
    else:
        normed, constant = parts, torch.zeros(parts.shape[1], dtype=torch.float64)
    w, b = affine_map(getattr(attn, side))
    projected = torch.cat([normed @ w, (constant @ w + b)[None]])  # [C + 1, n · d_head]
    own = (att.q_proj if side == "q" else att.k_proj).double()
    n_heads, d_head = own.shape[1], own.shape[2]
    check_sum(projected.sum(0), own[p].reshape(-1), f"layer {layer}'s {side} projection")
    projected = _qk_norm(attn, side, projected, own[p]).reshape(-1, n_heads, d_head)[:, head]
    if att.cos is not None:
        projected = _rotate(attn, projected, att.cos[p].double(), att.sin[p].double())
    final = att.q if side == "q" else att.k
    check_sum(projected.sum(0), final[p, head].double(), f"layer {layer}'s {side} of head {head} after QK-norm and RoPE")
    return projected


def _qk_norm(attn: object, side: str, projected: Tensor, own: Tensor) -> Tensor:
    """``projected [C + 1, n · d_head]`` through the layer's QK-norm frozen at the model's own q or k
    ``own [n, d_head]`` (the identity without one): ``g ⊙ x / ρ`` with ``ρ`` the root mean square of the
    head's row (per head) or of every head's row together (OLMo 2), ε included."""
    name = f"{side}_norm"
    if name not in getattr(attn, "submodules", {}) and getattr(attn, name, None) is None:
        return projected
    module = getattr(attn, name)
    inner = getattr(module, "original_component", module)
    eps = float(getattr(inner, "variance_epsilon", getattr(inner, "eps", 0.0)))
    norm = frozen_norm(module)
    if norm.centred:
        raise InputError("This model's QK-norm is a LayerNorm; attributions freeze an RMS QK-norm only.")
    width = norm.gain.shape[0]
    rows = own.reshape(-1, width)  # per head: [n, d_head]; across heads: [1, n · d_head]
    rho = (rows.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    shaped = projected.reshape(projected.shape[0], -1, width)
    return (shaped * norm.gain / rho).reshape(projected.shape)


def _rotate(attn: object, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE at one position on ``x [C, d_head]`` with that position's ``cos``/``sin`` as the model
    used them: full width, half-width tables (duplicated), or partial (the first ``rotary_dim`` dimensions)."""
    from transformer_lens.utilities.hf_utils import get_rotary_pct_from_config

    d_head, rotary = x.shape[-1], cos.shape[-1]
    if rotary * 2 == d_head and get_rotary_pct_from_config(attn.config) == 1.0:
        cos, sin, rotary = torch.cat([cos, cos]), torch.cat([sin, sin]), d_head
    turned, kept = x[:, :rotary], x[:, rotary:]
    half = rotary // 2
    rotated = torch.cat([-turned[:, half:], turned[:, :half]], -1)
    return torch.cat([turned * cos + rotated * sin, kept], -1)

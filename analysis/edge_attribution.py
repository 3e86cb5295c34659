"""Edge attribution patching: a first-order estimate of patching each sender → receiver edge.

Syed, Rager & Conmy 2023, "Attribution Patching Outperforms Automated Circuit Discovery" (arXiv:2310.10348),
after Nanda 2023, "Attribution Patching: Activation Patching At Industrial Scale". The residual stream at the input of layer ``l`` is a sum of what earlier components wrote into it
(:mod:`headscope.analysis.residual_components`): the embedding ``e``, each head's output ``r_h = z_h W_O^h``
and each MLP's output (a post-norm, as Gemma's, frozen at each run's own scale; the output biases are no sender).
An *edge* ``s → (r, site)`` is the path from sender ``s`` (the embedding, a head or an
MLP) into one input of receiver ``r``: the query (site ``q``), key (``k``) or value (``v``) input of a later
head, or the final norm, i.e. the logits (site ``logits``). Patching that edge alone replaces ``a_s`` by its
corrupted value in that one input and nowhere else. Its first-order effect on the metric
``m = logit[A] − logit[B]`` at the last position is

    score(s → r, site) = Σ_p (a_s^corrupt(p) − a_s^clean(p)) · ∂m/∂x_{r,site}(p)   (evaluated on the clean run)

with ``x_{r,site}`` the copy of the residual stream that feeds only receiver ``r``'s ``site`` projection.
**Sign and run, as in the paper:** the gradient is taken on the clean run and the difference is corrupted
minus clean, so ``score ≈ m(clean with that edge corrupted) − m(clean)`` (the effect of *noising* the edge):
an edge the clean answer relies on has a negative score. Edges are ranked by ``|score|``, as the paper ranks them.

**How the per-receiver gradient is formed.** The bridge computes one normalised input for all of a layer's
heads, so no hook carries a per-head copy of the residual stream. One backward pass gives the gradient at
each head's q, k and v projection outputs (after it come RoPE, QK-norm, the softmax and everything
downstream: all differentiated by autograd); mapping it back through that head's projection and the input
norm's Jacobian at the clean run gives ``∂m/∂x_{r,site}`` exactly:

    ∂m/∂x_{r,q} = J_norm(x)ᵀ (W_Q^r ∂m/∂q^r),   J_normᵀ g = P(γ ⊙ g / σ − x̃ (x̃ · γ ⊙ g) / (d σ³))

(``x̃ = P(x)`` the centred input for LayerNorm, ``P`` the identity for RMSNorm, ``σ`` the norm's scale).
With ``freeze_norms`` every normalisation's scale is held at its clean value (detached in the backward pass,
and the second term above dropped): the standard linearisation of direct logit attribution, under which a
sender → logits edge equals the difference, corrupted minus clean, of that sender's direct logit attribution
(:mod:`headscope.analysis.logit_attribution`) with the final norm frozen at the clean run. Without it
(the default, as the paper) the gradient is the model's true one.

**Grouped-query attention:** a k or v edge ends in the receiver's key-value head (its KV group), as
:func:`headscope.analysis.path_patching.path_patching` patches it: receiver ``L.G`` at sites ``k``/``v`` names
key-value head ``G``, read by query heads ``G·g … G·g + g − 1``.

Cost: one forward and one backward pass on the clean prompt, one forward pass on the corrupted one, whatever
the number of edges.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel
from headscope.analysis.patching import PromptPair, prompt_pair
from headscope.analysis.residual_components import (
    EMBED,
    FrozenNorm,
    OutputMap,
    affine_map,
    check_structure,
    check_sum,
    check_tokens,
    frozen_norm,
    head_name,
    mlp_name,
)

SITES = ("q", "k", "v", "logits")
"""Where an edge ends: a later head's query, key or value input, or the logits."""

LOGITS = "logits"


@dataclass
class EdgeAttribution:
    """Edge attribution scores as a long table, sorted by ``|score|``, largest first.

    Attributes
    ----------
    senders, receivers, sites : per edge, the sender (``embed``, ``L.H``, ``mlp.L``), the receiver (``L.H``:
        a query head at site ``q``, a key-value head at ``k``/``v``; ``logits`` at site ``logits``) and the site.
    scores : float64 ``[E]``, ``≈ m(clean with the edge corrupted) − m(clean)`` (module docstring).
    clean, corrupted : the logit difference on each prompt (the model's own, from the passes used).
    freeze_norms : whether the norms' scales were frozen at the clean run.
    pair : the checked prompts and answers.
    """

    senders: list[str]
    receivers: list[str]
    sites: list[str]
    scores: np.ndarray
    clean: float
    corrupted: float
    freeze_norms: bool
    pair: PromptPair

    def rows(self, top: int | None = None) -> list[tuple[str, str, str, float]]:
        """``(sender, receiver, site, score)`` of the ``top`` highest-ranked edges (all by default)."""
        n = len(self.scores) if top is None else min(top, len(self.scores))
        return [(self.senders[i], self.receivers[i], self.sites[i], float(self.scores[i])) for i in range(n)]

    def score(self, sender: str, receiver: str, site: str) -> float:
        """One edge's score; KeyError when there is no such edge."""
        for s, r, t, v in self.rows():
            if (s, r, t) == (sender, receiver, site):
                return v
        raise KeyError((sender, receiver, site))


CHUNK_BYTES = 64 * 2**20
"""Bytes of float64 sender writes (and as many of receiver gradients) formed at once: positions go in chunks of
this size, so memory grows with the text only through what the passes keep (per layer, float32), never as
senders × positions × d_model."""


@dataclass
class _Pass:
    """What one pass kept (``[n, …]`` on the CPU, by hook name) and its metric."""

    kept: dict[str, Tensor]
    metric: float


def _hook_names(model: LoadedModel) -> list[str]:
    """The hook points whose values a pass keeps (as in :func:`~headscope.analysis.residual_components.capture_components`)."""
    names = ["blocks.0.hook_in", "ln_final.hook_in"]
    for layer, block in enumerate(model.bridge.blocks):
        names += [f"blocks.{layer}.attn.o.hook_in",
                  f"blocks.{layer}.{'ln2_post' if hasattr(block, 'ln2_post') else 'mlp'}.hook_out"]
        if hasattr(block, "ln1_post"):
            names.append(f"blocks.{layer}.ln1_post.hook_scale")
    return names


def _senders(model: LoadedModel) -> tuple[list[str], list[int]]:
    """The senders' names (the embedding, every head, every MLP) and the layer each writes from (−1: the embedding)."""
    names = [EMBED] + [head_name(a, h) for a in range(model.n_layers) for h in range(model.n_heads)]
    names += [mlp_name(a) for a in range(model.n_layers)]
    layers = [-1] + [a for a in range(model.n_layers) for _ in range(model.n_heads)] + list(range(model.n_layers))
    return names, layers


def _sender_writes(model: LoadedModel, kept: dict[str, Tensor], rows: Tensor) -> Tensor:
    """``[S, len(rows), d_model]`` float64: each sender's write (:func:`_senders`' order) at positions ``rows``,
    checked to add up (with the output biases) to the model's own stream before the final norm there."""
    n_heads = model.n_heads
    parts = [kept["blocks.0.hook_in"][rows].double()[None]]
    bias = torch.zeros_like(parts[0][0])
    for layer, block in enumerate(model.bridge.blocks):
        w_o, b_o = affine_map(block.attn.o)
        out = OutputMap(w_o=w_o.reshape(n_heads, -1, w_o.shape[1]), b_o=b_o)
        if hasattr(block, "ln1_post"):
            out.post_gain = frozen_norm(block.ln1_post).gain
            out.post_sigma = kept[f"blocks.{layer}.ln1_post.hook_scale"][:, 0].double()
        z = kept[f"blocks.{layer}.attn.o.hook_in"]
        parts.append(out.heads(z.reshape(z.shape[0], n_heads, -1), rows))
        bias = bias + out.bias(rows)
    for layer, block in enumerate(model.bridge.blocks):
        parts.append(kept[f"blocks.{layer}.{'ln2_post' if hasattr(block, 'ln2_post') else 'mlp'}.hook_out"][rows]
                     .double()[None])
    writes = torch.cat(parts)
    check_sum(writes.sum(0) + bias, kept["ln_final.hook_in"][rows].double(), "the residual stream before the final norm")
    return writes


def _forward(model: LoadedModel, ids: Sequence[int], answers: tuple[int, int], grads: dict[str, Tensor] | None,
             freeze_norms: bool) -> tuple[dict[str, Tensor], Tensor]:
    """One pass on ``ids``; returns what :func:`_hook_names` kept (``[n, …]`` detached float32 CPU) and the metric
    (a graph when ``grads`` is given: then ``grads`` receives, live, the q/k/v projection outputs and the final
    norm's input, and with ``freeze_norms`` every norm's scale is detached)."""
    kept: dict[str, Tensor] = {}

    def keep(name: str):
        def hook(t: Tensor, hook: Any = None) -> None:
            kept[name] = t[0].detach().float().cpu()

        return hook

    def live(name: str):
        def hook(t: Tensor, hook: Any = None) -> Tensor:
            grads[name] = t
            return t  # returned, so that the tensor seen here (a per-head view of q/k/v) is the one used downstream

        return hook

    def detach(t: Tensor, hook: Any = None) -> Tensor:
        return t.detach()

    def leaf(t: Tensor, hook: Any = None) -> Tensor:  # gradients to activations only, never to the weights
        return t.detach().requires_grad_(True)

    hooks = [(n, keep(n)) for n in _hook_names(model)]
    if grads is not None:
        hooks += [("blocks.0.hook_in", leaf), ("ln_final.hook_in", live(LOGITS))]
        for layer, block in enumerate(model.bridge.blocks):
            hooks += [(f"blocks.{layer}.attn.{s}.hook_out", live(f"{s}{layer}")) for s in "qkv"]
            if hasattr(block, "ln1"):
                hooks += [(f"blocks.{layer}.ln1.hook_in", keep(f"x{layer}")),
                          (f"blocks.{layer}.ln1.hook_scale", keep(f"sigma{layer}"))]
        if freeze_norms:
            hooks += [(name, detach) for name, _ in model.bridge.hook_dict.items() if name.endswith("hook_scale")]
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="A forward hook edited hook_scale")  # the freeze, on purpose
        logits = model.bridge.run_with_hooks(tokens, fwd_hooks=hooks, return_type="logits")
    last = logits[0, -1]
    return kept, last[answers[0]] - last[answers[1]]


def _norm_vjp(norm: FrozenNorm, x: Tensor, sigma: Tensor, g: Tensor, frozen: bool) -> Tensor:
    """``J_normᵀ g`` for ``g [R, n, d]`` at input ``x [n, d]`` with scale ``sigma [n]`` (module docstring)."""
    v = g * norm.gain
    xc = x - x.mean(-1, keepdim=True) if norm.centred else x
    s = sigma[:, None]
    out = v / s
    if not frozen:
        out = out - xc * (v * xc).sum(-1, keepdim=True) / (x.shape[-1] * s**3)
    return out - out.mean(-1, keepdim=True) if norm.centred else out


@dataclass
class _Receivers:
    """Every receiver's ``∂m/∂x_{r,site}``, formed for the positions asked (:meth:`at`): per receiver its name,
    layer (``n_layers`` for the logits) and site; per (layer, site) the gradient at the projection output
    ``[n, R, d_head]``, the projection ``[d_model, R, d_head]``, the input norm (None where there is none) with
    its input ``[n, d_model]`` and scale ``[n]``; the logits' gradient at the final norm's input ``[n, d_model]``."""

    names: list[str]
    layers: list[int]
    sites: list[str]
    parts: list[tuple[Tensor, Tensor, FrozenNorm | None, Tensor | None, Tensor | None]]
    logits: Tensor
    frozen: bool

    def at(self, rows: Tensor) -> Tensor:
        """``[R, len(rows), d_model]`` float64, in the order of ``names``."""
        out = []
        for g, w, norm, x, sigma in self.parts:
            into = torch.einsum("nhe,dhe->hnd", g[rows].double(), w)
            if norm is not None:
                into = _norm_vjp(norm, x[rows].double(), sigma[rows].double(), into, self.frozen)
            out.append(into)
        return torch.cat(out + [self.logits[rows].double()[None]])


def _receiver_gradients(model: LoadedModel, kept: dict[str, Tensor], live: dict[str, Tensor],
                        metric: Tensor, freeze_norms: bool) -> _Receivers:
    """The backward pass: the gradient at every layer's q (query heads), k and v (key-value heads) projection
    outputs and at the final norm's input, with what :class:`_Receivers` needs to carry it to each input."""
    order = [LOGITS] + [f"{s}{layer}" for layer in range(model.n_layers) for s in "qkv"]
    missing = [n for n in order if n not in live or not live[n].requires_grad]
    if missing:
        raise InputError("No gradient reaches this model's query, key or value projections; edge attribution "
                         "needs a model whose weights are differentiable.")
    grads = dict(zip(order, torch.autograd.grad(metric, [live[n] for n in order]), strict=True))
    names, layers, sites, parts = [], [], [], []
    for layer, block in enumerate(model.bridge.blocks):
        norm = frozen_norm(block.ln1) if hasattr(block, "ln1") else None
        x, sigma = (kept[f"x{layer}"], kept[f"sigma{layer}"][:, 0]) if norm is not None else (None, None)
        for site in "qkv":
            w = affine_map(getattr(block.attn, site))[0]  # [d_model, heads · d_head]
            n_heads = w.shape[1] // model.d_head
            g = grads[f"{site}{layer}"][0].detach().cpu()
            parts.append((g.reshape(g.shape[0], n_heads, model.d_head), w.reshape(w.shape[0], n_heads, model.d_head),
                          norm, x, sigma))
            names += [head_name(layer, r) for r in range(n_heads)]
            layers += [layer] * n_heads
            sites += [site] * n_heads
    return _Receivers(names=names + [LOGITS], layers=layers + [model.n_layers], sites=sites + [LOGITS], parts=parts,
                      logits=grads[LOGITS][0].detach().cpu(), frozen=freeze_norms)


def edge_attribution(model: LoadedModel, clean: str | Sequence[int], corrupted: str | Sequence[int],
                     answers: Sequence[str | int], *, freeze_norms: bool = False) -> EdgeAttribution:
    """Edge attribution patching of every sender → receiver edge on a clean/corrupted pair (module docstring).

    Parameters
    ----------
    model : the model (its eager attention).
    clean, corrupted : the two prompts, texts or token ids, of the same token length
        (:func:`headscope.analysis.patching.prompt_pair`).
    answers : the clean answer and the corrupted one, single tokens (``[" Mary", " John"]``) or token ids.
    freeze_norms : hold every normalisation's scale at the clean run (the direct-logit-attribution
        linearisation) instead of differentiating through it.

    Returns
    -------
    EdgeAttribution
        Every edge (embedding, heads and MLPs into later heads' q, k, v and into the logits), sorted by
        ``|score|``; the scores use one forward and backward pass on the clean prompt and one forward pass on
        the corrupted one.

    Raises
    ------
    InputError
        See :func:`~headscope.analysis.patching.prompt_pair` (unequal lengths, empty prompts, answers that
        are not single tokens); a single answer; a model whose blocks are not sums of components.
    """
    for prompt in (clean, corrupted):
        if not isinstance(prompt, str):
            check_tokens(model, prompt)  # whole numbers only: prompt_pair would truncate 1.5 to 1
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        raise InputError(f"Give the answers as a list of two (the clean one, then the corrupted one), got {answers!r}.")
    wrong = [a for a in answers if isinstance(a, bool) or not isinstance(a, (str, int, np.integer))]
    if wrong:
        raise InputError(f"An answer is a text (\" Mary\") or a token id (a whole number); got {wrong[0]!r}.")
    pair = prompt_pair(model, clean, corrupted, answers)
    if len(pair.answers) != 2:
        raise InputError("Edge attribution explains a logit difference: give two answers (the clean one, "
                         "then the corrupted one).")
    check_structure(model)
    with model.lock:
        with torch.inference_mode():
            kept, metric = _forward(model, pair.corrupted_ids, pair.answers, None, False)
            bad = _Pass(kept, float(metric))
        live: dict[str, Tensor] = {}
        with torch.enable_grad():
            kept, metric = _forward(model, pair.clean_ids, pair.answers, live, freeze_norms)
            receivers = _receiver_gradients(model, kept, live, metric, freeze_norms)
        good = _Pass(kept, float(metric.detach()))
        del live
    return _table(model, good, bad, receivers, pair, freeze_norms)


def _table(model: LoadedModel, good: _Pass, bad: _Pass, receivers: _Receivers, pair: PromptPair,
           freeze_norms: bool) -> EdgeAttribution:
    """Every edge's score: the product of all sender differences with all receiver gradients, summed over
    positions in chunks of :data:`CHUNK_BYTES`, kept where the sender writes before the receiver reads, sorted
    by ``|score|``."""
    names, layers = _senders(model)
    n, d = good.kept["blocks.0.hook_in"].shape
    chunk = max(1, CHUNK_BYTES // (8 * d * max(len(names), len(receivers.names))))
    products = torch.zeros(len(names), len(receivers.names), dtype=torch.float64)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(n, start + chunk))
        delta = _sender_writes(model, bad.kept, rows) - _sender_writes(model, good.kept, rows)  # corrupted − clean
        products += delta.flatten(1) @ receivers.at(rows).flatten(1).T
    s, r = np.nonzero(np.array(layers)[:, None] < np.array(receivers.layers)[None, :])
    scores = products.numpy()[s, r]
    order = np.argsort(-np.abs(scores), kind="stable")
    s, r = s[order], r[order]
    return EdgeAttribution(senders=np.array(names, dtype=object)[s].tolist(),
                           receivers=np.array(receivers.names, dtype=object)[r].tolist(),
                           sites=np.array(receivers.sites, dtype=object)[r].tolist(), scores=scores[order],
                           clean=good.metric, corrupted=bad.metric, freeze_norms=freeze_norms, pair=pair)

"""Token attribution, and how faithful each method is to what removing a token actually does.

Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers" (ACL 2020, arXiv:2005.00928),
section 5: a relevance method is *faithful* to the degree that its per-token scores rank the
input tokens like their ablation importance does; the paper reports Spearman's rank correlation
of raw attention, attention rollout and attention flow with blank-out (ablation) scores and with
input gradients. This module runs that protocol on a causal language model.

The target quantity
-------------------
For an input x_0 .. x_{N−1}, a position t and a target token y (by default the model's own top
prediction at t), the target quantity is the log-probability of y as the token after t:

    f(e) = log p(y | e_0 .. e_t)        (e_j: the input embedding of token j, ``hook_embed``)

Tokens after t cannot influence f (causal attention), so every score covers positions 0 .. t.

The methods, per input position j ≤ t
-------------------------------------
The three attention methods are exactly what the Flow page's strips show, computed by one function,
:func:`token_relevance`, with the page's head fusion (mean, max or min over heads) and sink option
(``drop_sinks``: those key columns removed, each row renormalised): the faithfulness protocol scores
each method as the user sees it, not a fixed variant of it.

- ``attention`` — raw attention: the head-fused pattern of one layer (the last by default), row t,
  sink columns dropped and the row renormalised: ``Ā_{L−1}[t, j]`` (the rollout of that layer alone
  with no residual term; with mean fusion and no sink dropped, ``mean_h A[L−1, h][t, j]``).
- ``rollout`` — attention rollout row t, ``(Â_L ··· Â_1)[t, j]`` (:func:`headscope.analysis.rollout.rollout`).
- ``flow`` — exact attention flow into output t, ``maxflow((0, j) → (L, t))``
  (:func:`headscope.analysis.flow.attention_flow`).
- ``rollout_debiased``, ``flow_debiased`` — rollout and flow divided by their values on uniform
  causal attention of the same length, layers, residual and sinks, then normalised
  (:mod:`headscope.analysis.position_bias`): in a causal model early inputs reach more outputs, so plain
  rollout and flow favour them whatever the attention does; the ratio removes that head start.
- ``value_attention``, ``value_rollout`` — raw attention and rollout of norm-based attention
  ``N_l[i, j] = ‖Σ_h α^h_ij v_j W_O^h‖`` (Kobayashi et al. 2020, "Attention is Not Only a
  Weight", :mod:`headscope.analysis.value_norms`), rows renormalised: a token is relevant only as far as
  its value actually moves the output. One "head" per layer, so the fusion option does not apply.
- ``ixg_norm`` — input×gradient, norm: ``‖e_j ⊙ ∂f/∂e_j‖₂`` (Kindermans et al. 2016,
  "Investigating the influence of noise and distractors on the interpretation of neural
  networks", arXiv:1611.07270; Shrikumar et al. 2017, "Learning Important Features Through
  Propagating Activation Differences", ICML, arXiv:1704.02685). Non-negative, like the attention
  scores, and what Abnar & Zuidema compare with.
- ``ixg_sum`` — input×gradient, signed: ``Σ_d e_{j,d} · ∂f/∂e_{j,d} = e_j · ∇_{e_j} f``. This is
  the first-order Taylor estimate of ``f(e) − f(e with e_j = 0)``, i.e. of zero ablation.

The reference: leave-one-out ablation importance
------------------------------------------------
``ablation[j] = f(e) − f(e with e_j replaced by b)``: positive when the token supports the target.
Only the token's *content* is removed; the sequence keeps its length, so no other token changes
position (RoPE is applied inside attention, after ``hook_embed``). The replacement b is

- ``"zero"`` (default): the zero vector, the baseline input×gradient linearises around;
- ``"mean"``: the mean input embedding over the whole vocabulary, ``b = mean_v W_E[v]``.

All N ablated copies (plus the unablated input) run as one batch through the model.

Faithfulness
------------
Per input, Spearman's ρ (``scipy.stats.spearmanr``) between each method's scores and the ablation
importance over positions 0 .. t; over a set of inputs, the mean and standard deviation of ρ. The
first token is usually the attention sink: attention-based scores give it a large share, and
removing it disrupts the model, which by itself inflates ρ; :meth:`Attribution.correlations` can
leave positions out (``exclude=(0,)``) to measure the rest.

In a causal model rollout and flow favour early positions (input j reaches only outputs ≥ j, so
earlier inputs have more paths and larger cuts), while ablation favours the last content words
and the target position itself. ``bench/faithfulness.py`` measures the consequence on the embedded
model and the built-in set (:data:`EVAL_SET`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.capture import MAX_TOKENS_PATTERNS, capture, tokenize_input
from headscope.analysis.errors import InputError
from headscope.analysis.flow import attention_flow
from headscope.analysis.limits import limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.paths import DATA_DIR
from headscope.analysis.position_bias import CORRECTED, position_corrected, uniform_baseline
from headscope.analysis.rollout import FUSIONS, rollout, rollout_row_per_layer
from headscope.analysis.value_norms import value_weighted_patterns

MAX_TOKENS_FLOW = 128
"""Longest input for an attribution: exact flow and N ablated copies grow fast with length."""

METHODS = ("attention", "value_attention", "rollout", "rollout_debiased", "value_rollout", "flow", "flow_debiased",
           "ixg_norm", "ixg_sum")
"""Relevance methods compared with the ablation importance, in table order."""

PLAIN_METHODS = {
    "attention": "Raw attention (last layer, head-fused)",
    "rollout": "Attention rollout",
    "flow": "Attention flow (exact max-flow)",
}
"""Raw attention, rollout and flow as Abnar & Zuidema define them, with their titles."""

CORRECTED_METHODS = {
    "rollout_debiased": "Rollout, position-corrected (÷ rollout of uniform causal attention)",
    "flow_debiased": "Flow, position-corrected (÷ flow of uniform causal attention)",
}
"""Rollout and flow divided by their values on uniform causal attention
(:mod:`headscope.analysis.position_bias`), with their titles."""

RELEVANCE_METHODS = {**PLAIN_METHODS, **CORRECTED_METHODS}
"""The Flow page's strips, in order, with their titles: the plain methods (one shared colour
scale), then the position-corrected ones (ratios normalised to sum 1: a scale of their own)."""

LABELS = {
    "attention": "raw attention (last layer)",
    "rollout": "attention rollout",
    "value_attention": "value-weighted attention (last layer)",
    "rollout_debiased": "rollout ÷ uniform-causal rollout",
    "value_rollout": "value-weighted rollout",
    "flow": "attention flow",
    "flow_debiased": "flow ÷ uniform-causal flow",
    "ixg_norm": "input×gradient ‖·‖",
    "ixg_sum": "input×gradient Σ (signed)",
    "ablation": "leave-one-out ablation",
}

ABLATIONS = ("zero", "mean")

EVAL_SET = DATA_DIR / "attribution" / "eval_set.json"
COPY_SET = DATA_DIR / "attribution" / "copy_set.json"
"""A second set of another kind: the answer is copied from one earlier token (names, IOI-style; words)."""


@dataclass
class Attribution:
    """Per-token relevance of one input for one target, by every method and by ablation.

    Attributes
    ----------
    token_ids, tokens : the whole input as the model saw it (with the BOS it expects, if any).
    position : t, the position whose next-token log-probability is explained.
    target_id, target_token : y, the explained next token.
    target_logprob : ``log p(y | x_0 .. x_t)`` of the unablated input.
    ablation : ``"zero"`` or ``"mean"``, what replaced a token's embedding.
    scores : method → float64 ``[t + 1]``, relevance of positions 0 .. t; the keys are
        :data:`METHODS` plus ``"ablation"``, the leave-one-out importance.
    """

    token_ids: list[int]
    tokens: list[str]
    position: int
    target_id: int
    target_token: str
    target_logprob: float
    ablation: str
    scores: dict[str, np.ndarray]
    settings: dict[str, Any] = field(default_factory=dict)

    def correlations(
        self,
        methods: Sequence[str] = METHODS,
        *,
        exclude: Sequence[int] = (),
        magnitude: bool = False,
    ) -> dict[str, float]:
        """Spearman's ρ of each method's scores with the ablation importance.

        Parameters
        ----------
        methods : names in :attr:`scores`.
        exclude : positions left out of the correlation (e.g. ``(0,)``, the attention sink).
        magnitude : correlate with ``|ablation|`` instead of the signed importance (a token that
            hurts the target is then as important as one that helps it).

        Returns
        -------
        dict
            method → ρ in [−1, 1]; NaN where fewer than 3 positions remain or either side is
            constant (ρ is undefined).
        """
        keep = np.ones(self.position + 1, dtype=bool)
        keep[[p for p in exclude if 0 <= p <= self.position]] = False
        reference = self.scores["ablation"][keep]
        if magnitude:
            reference = np.abs(reference)
        return {m: spearman(self.scores[m][keep], reference) for m in methods}


def spearman(scores: np.ndarray, reference: np.ndarray) -> float:
    """Spearman's rank correlation (``scipy.stats.spearmanr``; ties get their mean rank).

    ρ is Pearson's correlation of the ranks. Returns NaN, without a warning, when there are
    fewer than 3 values (any two distinct values give ±1) or when either side is constant.
    """
    from scipy.stats import spearmanr

    a = np.asarray(scores, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"scores and reference must be 1-D of equal length, got {a.shape} and {b.shape}")
    if a.size < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(a, b).statistic)


# ---------------------------------------------------------------------------------------------
# The Flow page's numbers: raw attention, rollout and flow for one target


@dataclass(frozen=True)
class TokenRelevance:
    """Raw attention, rollout and flow of every input position for one output position.

    Attributes
    ----------
    target : t, the output position explained.
    fusion, drop_sinks, residual, raw_layer : the options they were computed with.
    scores : method → float64 ``[t + 1]``, relevance of positions 0 .. t, for each method of
        :data:`RELEVANCE_METHODS` that was computed.
    rollout_layers : float64 ``[layer, t + 1]``, the rollout to t after each layer; its last row
        is ``scores["rollout"]``.
    unavailable : method → why it was not computed (flow past its token limit, and with it corrected flow).
    """

    target: int
    fusion: str
    drop_sinks: tuple[int, ...]
    residual: float
    raw_layer: int
    scores: dict[str, np.ndarray]
    rollout_layers: np.ndarray
    unavailable: dict[str, str] = field(default_factory=dict)


def max_flow_tokens() -> int:
    """Longest input for exact attention flow (``HEADSCOPE_MAX_FLOW_TOKENS``, default 128)."""
    return limit("HEADSCOPE_MAX_FLOW_TOKENS")


def token_relevance(
    patterns: np.ndarray,
    target: int,
    *,
    fusion: str = "mean",
    drop_sinks: Sequence[int] = (),
    residual: float = 0.5,
    raw_layer: int = -1,
    flow_limit: int | None = None,
    corrected: bool = False,
) -> TokenRelevance:
    """Every number of the Flow page for one target: raw attention, rollout (also per layer), flow.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers" (ACL 2020,
    arXiv:2005.00928), sections 3–4. With Ā_l the head-fused attention of layer l (``fusion`` over
    heads, the ``drop_sinks`` columns set to zero, rows renormalised) and Â_l = r·I + (1 − r)·Ā_l
    (:func:`headscope.analysis.rollout.augmented_attention`), for positions j ≤ t:

    - ``attention[j] = Ā_raw_layer[t, j]`` (no residual term);
    - ``rollout[j] = (Â_L ··· Â_1)[t, j]`` and ``rollout_layers[l, j] = (Â_l ··· Â_1)[t, j]``;
    - ``flow[j] = maxflow((0, j) → (L, t))`` with capacities Â_l (:func:`headscope.analysis.flow.attention_flow`).

    The Flow page's strips, its per-layer heatmap and the faithfulness protocol (:func:`attribute`,
    :func:`evaluate`) all take their attention-based scores from here, with the page's options, so
    the faithfulness chart scores exactly what the strips show. Causal attention means only the
    ``[t + 1, t + 1]`` prefix of ``patterns`` is read.

    Parameters
    ----------
    patterns : float array [layer, head, query, key], post-softmax causal attention of the input.
    target : t, 0 <= t < number of positions.
    fusion : ``"mean"``, ``"max"`` or ``"min"`` over heads.
    drop_sinks : key positions removed before renormalising (``(0,)``: the attention sink).
    residual : r, the weight of the identity in rollout and flow (0.5 in the paper).
    raw_layer : the layer whose attention is ``attention`` (negative counts from the end).
    flow_limit : flow is left out (with the reason in ``unavailable``) when ``patterns`` has more
        positions than this; ``None``: :func:`max_flow_tokens`.
    corrected : also ``rollout_debiased`` and ``flow_debiased`` (:data:`CORRECTED_METHODS`): each
        divided by its value on uniform causal attention with the same layers, residual and sinks,
        then normalised (:func:`headscope.analysis.position_bias.position_corrected`); removes the head start
        early positions have in a causal model.

    Returns
    -------
    TokenRelevance

    Raises
    ------
    InputError
        A target out of range, an unknown fusion, sink positions outside the input, a residual
        outside [0, 1] or a layer out of range; each message says what to use instead.
    """
    patterns = np.asarray(patterns)
    if patterns.ndim != 4:
        raise InputError(f"patterns must be [layer, head, query, key], got shape {patterns.shape}.")
    n_layers, n = patterns.shape[0], patterns.shape[-1]
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= int(target) < n:
        raise InputError(f"Target position {target!r} is out of range: the input has positions 0..{n - 1}.")
    t = int(target)
    if fusion not in FUSIONS:
        raise InputError(f"Unknown head fusion {fusion!r}; choose one of {', '.join(FUSIONS)}.")
    if not -n_layers <= raw_layer < n_layers:
        raise InputError(f"raw_layer {raw_layer} is out of range: the model has layers 0 .. {n_layers - 1}.")
    sinks = tuple(sorted({int(s) for s in drop_sinks}))
    bad = [s for s in sinks if not 0 <= s < n]
    if bad:
        raise InputError(f"drop_sinks positions {bad} are outside the input (valid: 0 .. {n - 1}).")
    limit_ = max_flow_tokens() if flow_limit is None else flow_limit
    prefix = patterns[:, :, : t + 1, : t + 1]
    # A sink after t does not touch rows 0 .. t.
    graph = {"residual": residual, "fusion": fusion, "drop_sinks": tuple(s for s in sinks if s <= t)}
    try:
        layers = rollout_row_per_layer(prefix, t, **graph)
        scores = {
            "attention": rollout(prefix, residual=0.0, fusion=fusion, drop_sinks=graph["drop_sinks"],
                                 start_layer=raw_layer % n_layers, end_layer=raw_layer % n_layers + 1)[t],
            "rollout": layers[-1].copy(),
        }
        unavailable = {}
        if n > limit_:
            unavailable["flow"] = (
                f"Attention flow is limited to {limit_} tokens and this input has {n} "
                "(set HEADSCOPE_MAX_FLOW_TOKENS to change it). Rollout and raw attention still work."
            )
        else:
            scores["flow"] = attention_flow(prefix, target=t, **graph)
        if corrected:
            for name, plain in CORRECTED.items():
                if plain in scores:
                    baseline = uniform_baseline(plain, n_layers, t, residual=residual, drop_sinks=graph["drop_sinks"])
                    scores[name] = position_corrected(scores[plain], baseline)
                elif plain in unavailable:  # corrected flow needs flow: the same reason
                    unavailable[name] = unavailable[plain]
    except ValueError as error:  # patterns that are not causal attention, a residual out of range
        raise InputError(f"Rollout and flow options: {error}.") from None
    return TokenRelevance(target=t, fusion=fusion, drop_sinks=sinks, residual=float(residual),
                          raw_layer=raw_layer, scores=scores, rollout_layers=layers, unavailable=unavailable)


# ---------------------------------------------------------------------------------------------
# Validation


def resolve_input(
    model: LoadedModel,
    text_or_ids: str | Sequence[int],
    position: int | None = None,
    target: int | str | None = None,
    *,
    max_tokens: int = MAX_TOKENS_FLOW,
) -> tuple[list[int], int, int | None]:
    """Validate an attribution request once; return (token ids, position t, target id or None).

    Raises
    ------
    InputError
        Empty text, more than ``max_tokens`` tokens, token ids outside the vocabulary, a position
        outside the input, or a target that is not one token of the vocabulary.
    """
    ids = tokenize_input(model, text_or_ids, max(MAX_TOKENS_PATTERNS, max_tokens))
    n = len(ids)
    if n > max_tokens:
        raise InputError(
            f"The input has {n:,} tokens; token attribution (exact attention flow and one ablated "
            f"copy per token) is limited to {max_tokens:,} tokens. Shorten the text."
        )
    if position is None:
        t = n - 1
    elif isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise InputError(f"The target position must be a whole number, got {position!r}.")
    elif -n <= int(position) < n:
        t = int(position) % n
    else:
        raise InputError(
            f"Target position {position} is outside the input: it has {n} tokens, so use 0 .. {n - 1} "
            "(or −1 for the last)."
        )
    if target is None:
        return ids, t, None
    if isinstance(target, str):
        target_ids = model.encode(target)
        if len(target_ids) != 1:
            pieces = " + ".join(repr(s) for s in model.token_strings(target_ids)) or "nothing"
            raise InputError(
                f"The target {target!r} is {len(target_ids)} tokens ({pieces}); give text that is exactly "
                "one token (mind the leading space, e.g. ' Paris') or a token id."
            )
        return ids, t, target_ids[0]
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)):
        raise InputError(f"The target must be a token id or a one-token string, got {target!r}.")
    if not 0 <= int(target) < model.vocab_size:
        raise InputError(f"Target token id {target} is outside the vocabulary (0 .. {model.vocab_size - 1}).")
    return ids, t, int(target)


def _check_ablation(ablation: str) -> str:
    if ablation not in ABLATIONS:
        raise InputError(f"ablation must be one of {', '.join(ABLATIONS)}; got {ablation!r}")
    return ablation


# ---------------------------------------------------------------------------------------------
# Gradient and ablation scores (these run the model)


def _embedding_matrix(model: LoadedModel) -> torch.Tensor:
    return model.hf_model.get_input_embeddings().weight


def ablation_baseline(model: LoadedModel, ablation: str = "zero") -> torch.Tensor:
    """The vector b that replaces an ablated token's embedding: 0, or ``mean_v W_E[v]``. Shape [d_model]."""
    weight = _embedding_matrix(model)
    if _check_ablation(ablation) == "zero":
        return torch.zeros(weight.shape[1], dtype=weight.dtype, device=weight.device)
    return weight.detach().mean(dim=0)


def ablation_importance(
    model: LoadedModel,
    token_ids: Sequence[int],
    position: int,
    target_id: int,
    *,
    ablation: str = "zero",
    batch_size: int | None = None,
) -> tuple[np.ndarray, float]:
    """Leave-one-out ablation importance of every input position for one target.

    Abnar & Zuidema 2020, section 5 (their "blank-out" scores): with f the target log-probability
    (see the module docstring), ``importance[j] = f(e) − f(e_0 .. e_{j−1}, b, e_{j+1} .. e_t)``.
    The embedding output (``hook_embed``) of copy j is overwritten at position j with b
    (:func:`ablation_baseline`); the N copies and the unablated input run as one batch.

    Parameters
    ----------
    token_ids : the input; only positions 0 .. ``position`` are run.
    position : t.
    target_id : y.
    ablation : ``"zero"`` or ``"mean"`` (the mean embedding over the vocabulary).
    batch_size : copies per forward pass; ``None`` runs all t + 2 at once.

    Returns
    -------
    (np.ndarray float64 [t + 1], float)
        The importance per position and f(e) of the unablated input.
    """
    n = position + 1
    ids = torch.tensor(list(token_ids)[:n], dtype=torch.long, device=model.device)
    b = ablation_baseline(model, ablation)
    # Row r of the batch ablates position rows[r]; −1 is the unablated input.
    rows = np.arange(-1, n)
    size = len(rows) if batch_size is None else max(1, int(batch_size))
    out = np.empty(len(rows))
    with model.lock, torch.inference_mode():
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]

            def replace(embed: torch.Tensor, hook: Any = None, chunk=chunk) -> torch.Tensor:
                embed = embed.clone()
                which = np.nonzero(chunk >= 0)[0]
                embed[torch.as_tensor(which), torch.as_tensor(chunk[which])] = b.to(embed.dtype)
                return embed

            logits = model.bridge.run_with_hooks(
                ids[None].expand(len(chunk), n),
                fwd_hooks=[(get_act_name("embed"), replace)],
                return_type="logits",
            )
            logp = torch.log_softmax(logits[:, -1].double(), dim=-1)[:, target_id]
            out[start : start + len(chunk)] = logp.cpu().numpy()
    return out[0] - out[1:], float(out[0])


def input_x_gradient(
    model: LoadedModel, token_ids: Sequence[int], position: int, target_id: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Input×gradient of the target log-probability for every input position.

    Shrikumar et al. 2017 (arXiv:1704.02685); Kindermans et al. 2016 (arXiv:1611.07270). With
    g_j = ∂f/∂e_j, the gradient of the target log-probability with respect to the input embedding
    of token j (``hook_embed``, computed by autograd through the bridge):

        norm[j] = ‖e_j ⊙ g_j‖₂            sum[j] = e_j · g_j = Σ_d e_{j,d} g_{j,d}

    ``sum`` is the first-order Taylor estimate of zero-ablating token j.

    Returns
    -------
    (norm float64 [t + 1], sum float64 [t + 1], f(e))
    """
    n = position + 1
    kept: dict[str, torch.Tensor] = {}

    def leaf(embed: torch.Tensor, hook: Any = None) -> torch.Tensor:
        kept["e"] = embed.detach().clone().requires_grad_(True)
        return kept["e"]

    # inference_mode(False): gradients work even when the caller is inside torch.inference_mode().
    with model.lock, torch.inference_mode(False), torch.enable_grad():
        ids = torch.tensor([list(token_ids)[:n]], dtype=torch.long, device=model.device)
        logits = model.bridge.run_with_hooks(
            ids, fwd_hooks=[(get_act_name("embed"), leaf)], return_type="logits"
        )
        logp = torch.log_softmax(logits[0, -1], dim=-1)[target_id]
        # autograd.grad, not backward(): no .grad is written into the model's parameters.
        (grad,) = torch.autograd.grad(logp, kept["e"])
    e = kept["e"].detach()[0].double()
    g = grad[0].double()
    product = e * g
    return (
        torch.linalg.vector_norm(product, dim=-1).cpu().numpy(),
        product.sum(dim=-1).cpu().numpy(),
        float(logp.detach()),
    )


# ---------------------------------------------------------------------------------------------
# One input, every method


def attribute(
    model: LoadedModel,
    text_or_ids: str | Sequence[int],
    *,
    position: int | None = None,
    target: int | str | None = None,
    ablation: str = "zero",
    residual: float = 0.5,
    fusion: str = "mean",
    drop_sinks: Sequence[int] = (),
    raw_layer: int = -1,
    max_tokens: int = MAX_TOKENS_FLOW,
    batch_size: int | None = None,
    patterns: np.ndarray | None = None,
    progress: Callable[[float], None] | None = None,
) -> Attribution:
    """Relevance of every input token for one next-token prediction, by every method.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 5. Computes, for
    positions j ≤ t (see the module docstring for the formulas): raw attention of ``raw_layer``,
    attention rollout and exact attention flow into t, all three from :func:`token_relevance` with
    the given ``fusion`` and ``drop_sinks`` (exactly the Flow page's strips), input×gradient
    (norm and signed sum; Shrikumar et al. 2017, Kindermans et al. 2016) and the leave-one-out
    ablation importance they are judged against.

    Parameters
    ----------
    text_or_ids : text (tokenised as `tokenize_input` does: a BOS only where the model expects one) or token ids, used as given.
    position : t, the position whose next token is explained; ``None``: the last (negative counts
        from the end).
    target : y, a token id or a one-token string such as ``" Paris"``; ``None``: the model's top
        prediction at t.
    ablation : ``"zero"`` or ``"mean"``: what replaces an ablated token's embedding.
    residual, fusion, drop_sinks : options of all three attention methods, raw attention included
        (:func:`token_relevance`); ``drop_sinks=(0,)`` removes the first token's column before
        renormalising, which keeps 30 layers of rollout from collapsing onto it.
    raw_layer : the layer whose attention is the ``attention`` method (default: the last).
    max_tokens : longest input accepted (:data:`MAX_TOKENS_FLOW`).
    batch_size : ablated copies per forward pass (``None``: all in one).
    patterns : attention already captured for these token ids, ``[layer, head, ≥ t + 1, ≥ t + 1]``
        (a stored run's, e.g. float16), so the scores are exactly the ones a page drew from it;
        ``None``: captured here in float32.
    progress : called with the fraction done.

    Returns
    -------
    Attribution

    Raises
    ------
    InputError
        Empty text, too many tokens, position or target out of range, unknown ablation.
    """
    ids, t, target_id = resolve_input(model, text_or_ids, position, target, max_tokens=max_tokens)
    _check_ablation(ablation)

    def step(fraction: float) -> None:
        if progress is not None:
            progress(fraction)

    run = capture(model, ids[: t + 1], pattern_dtype="float32", max_tokens=max(MAX_TOKENS_PATTERNS, max_tokens))
    if target_id is None:
        target_id = int(run.top_ids[t, 0])
    if patterns is None:
        patterns = run.patterns
    else:
        patterns = np.asarray(patterns)
        if patterns.ndim != 4 or patterns.shape[:2] != run.patterns.shape[:2] or patterns.shape[-1] <= t:
            raise InputError(f"patterns of shape {patterns.shape} are not this model's attention over positions "
                             f"0 .. {t}: expected [{model.n_layers}, heads, ≥{t + 1}, ≥{t + 1}].")
    step(0.2)
    graph = {"residual": residual, "fusion": fusion, "drop_sinks": tuple(drop_sinks)}
    relevance = token_relevance(patterns, t, **graph, raw_layer=raw_layer, flow_limit=max(max_tokens, t + 1),
                                corrected=True)
    scores: dict[str, np.ndarray] = dict(relevance.scores)
    # Norm-based attention has one "head" per layer (the norm of the summed contribution), so the
    # head fusion does not apply; residual and sinks do. Flow over it is not computed.
    valued = token_relevance(value_weighted_patterns(model, ids[: t + 1]), t, residual=residual,
                             drop_sinks=drop_sinks, raw_layer=raw_layer, flow_limit=0)
    scores["value_attention"], scores["value_rollout"] = valued.scores["attention"], valued.scores["rollout"]
    step(0.6)
    scores["ixg_norm"], scores["ixg_sum"], _ = input_x_gradient(model, ids, t, target_id)
    step(0.7)
    scores["ablation"], logprob = ablation_importance(
        model, ids, t, target_id, ablation=ablation, batch_size=batch_size
    )
    step(1.0)
    return Attribution(
        token_ids=ids,
        tokens=model.token_strings(ids),
        position=t,
        target_id=target_id,
        target_token=model.token_strings([target_id])[0],
        target_logprob=logprob,
        ablation=ablation,
        scores=scores,
        settings={**graph, "raw_layer": raw_layer},
    )


# ---------------------------------------------------------------------------------------------
# A set of inputs


@dataclass(frozen=True)
class EvalItem:
    """One prompt of an evaluation set and the next token it should be explained for."""

    id: str
    kind: str
    text: str
    target: str


def load_eval_set(path: str | Path = EVAL_SET) -> list[EvalItem]:
    """The prompts of an evaluation set (default: headscope's built-in ``data/attribution/eval_set.json``)."""
    data = json.loads(Path(path).read_text())
    return [EvalItem(id=i["id"], kind=i["kind"], text=i["text"], target=i["target"]) for i in data["items"]]


@dataclass(frozen=True)
class MethodSummary:
    """Spearman's ρ of one method over a set: mean, sample standard deviation, median, count."""

    mean: float
    std: float
    median: float
    n: int


@dataclass
class Faithfulness:
    """Attributions of a set of inputs and how well each method agrees with ablation."""

    items: list[EvalItem]
    attributions: list[Attribution]
    seconds: list[float]

    def correlations(
        self, methods: Sequence[str] = METHODS, *, exclude: Sequence[int] = (), magnitude: bool = False
    ) -> np.ndarray:
        """ρ per input and method, float64 ``[input, method]`` (see :meth:`Attribution.correlations`)."""
        rows = [a.correlations(methods, exclude=exclude, magnitude=magnitude) for a in self.attributions]
        return np.array([[row[m] for m in methods] for row in rows], dtype=np.float64).reshape(-1, len(methods))

    def summary(
        self, methods: Sequence[str] = METHODS, *, exclude: Sequence[int] = (), magnitude: bool = False
    ) -> dict[str, MethodSummary]:
        """Mean ± standard deviation (ddof 1) of ρ per method over the inputs where ρ is defined."""
        table = self.correlations(methods, exclude=exclude, magnitude=magnitude)
        out = {}
        for k, m in enumerate(methods):
            rho = table[:, k][np.isfinite(table[:, k])]
            out[m] = MethodSummary(
                mean=float(rho.mean()) if rho.size else float("nan"),
                std=float(rho.std(ddof=1)) if rho.size > 1 else float("nan"),
                median=float(np.median(rho)) if rho.size else float("nan"),
                n=int(rho.size),
            )
        return out


def evaluate(
    model: LoadedModel,
    items: Sequence[EvalItem] | None = None,
    *,
    ablation: str = "zero",
    residual: float = 0.5,
    fusion: str = "mean",
    drop_sinks: Sequence[int] = (),
    progress: Callable[[float], None] | None = None,
) -> Faithfulness:
    """Abnar & Zuidema 2020's faithfulness protocol over a set of prompts.

    Each item is attributed at its last position for its target token (:func:`attribute`);
    :meth:`Faithfulness.summary` then gives, per method, the mean and spread of Spearman's ρ
    with the ablation importance.

    Parameters
    ----------
    items : prompts and targets; ``None``: the built-in set (:func:`load_eval_set`).
    ablation, residual, fusion, drop_sinks : see :func:`attribute`.
    progress : called with the fraction of items done.
    """
    import time

    items = list(load_eval_set() if items is None else items)
    attributions, seconds = [], []
    for k, item in enumerate(items):
        start = time.perf_counter()
        attributions.append(
            attribute(
                model,
                item.text,
                target=item.target,
                ablation=ablation,
                residual=residual,
                fusion=fusion,
                drop_sinks=drop_sinks,
            )
        )
        seconds.append(time.perf_counter() - start)
        if progress is not None:
            progress((k + 1) / len(items))
    return Faithfulness(items=items, attributions=attributions, seconds=seconds)


def stored_evaluation(
    model: LoadedModel,
    store: Any,
    *,
    ablation: str = "zero",
    fusion: str = "mean",
    drop_sinks: Sequence[int] = (),
    progress: Callable[[float], None] | None = None,
    compute: bool = True,
) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """The built-in evaluation's ρ table ``[input, method]``, from the store or computed and stored.

    Returns ``(item ids, rho, seconds)``, or ``None`` when ``compute`` is false and nothing is stored.
    The key is the model digest, the evaluation set's contents and the settings.
    """
    from headscope.analysis.store import content_key
    from headscope.analysis.stored_results import stored_record

    items = load_eval_set()
    # "definition": 2 is raw attention with the fusion and sink options; definition 1 (a head mean of
    # the whole row) has other keys, so a result stored under it is never shown as this one.
    settings = {"ablation": ablation, "fusion": fusion, "drop_sinks": sorted(int(s) for s in drop_sinks),
                "definition": 2}
    key = content_key("faithfulness", model.digest, [(i.id, i.text, i.target) for i in items], settings, METHODS)
    record = stored_record(store, key, "faithfulness")
    if record is not None:
        return record.meta["items"], record.array("rho", mmap=False), record.array("seconds", mmap=False)
    if not compute:
        return None
    result = evaluate(model, items, ablation=ablation, fusion=fusion, drop_sinks=drop_sinks, progress=progress)
    rho = result.correlations(METHODS)
    seconds = np.asarray(result.seconds, dtype=np.float64)
    ids = [i.id for i in items]
    store.put(key, "faithfulness", {"items": ids, "methods": list(METHODS), "settings": settings,
                                    "model_digest": model.digest}, {"rho": rho, "seconds": seconds})
    return ids, rho, seconds

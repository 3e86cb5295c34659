"""Activation patching and attribution patching between a clean and a corrupted prompt.

Two prompts of equal token length differ in a few tokens (the *clean* one, e.g. "… John gave a drink
to", whose answer is " Mary"; the *corrupted* one with the names swapped, whose answer is " John").
Patching copies one activation from one run into the other and measures how much of the clean
behaviour comes back (Meng et al. 2022, "Locating and Editing Factual Associations in GPT",
arXiv:2202.05262, causal tracing; Wang et al. 2022, "Interpretability in the Wild: a Circuit for
Indirect Object Identification in GPT-2 small", arXiv:2211.00593; Heimersheim & Nanda 2024, "How to
use and interpret activation patching", arXiv:2404.15255).

Metric (DESIGN.md, *Activation patching*). With answers A (clean) and B (corrupted) and ``x`` the
logits at the last position,

    LD(x) = x[A] − x[B]                                 (``logit_diff``, needs two answers)
    L(x)  = −log softmax(x)[A]                          (``loss``, the loss on the clean answer)

and for either metric m the reported value is normalised so that 0 = corrupted and 1 = clean:

    value = (m_patched − m_corrupted) / (m_clean − m_corrupted).

*Denoising* runs the corrupted prompt and copies in one clean activation (value near 1: that
activation suffices to restore the clean answer); *noising* runs the clean prompt and copies in one
corrupted activation (value near 0: the clean behaviour needs it). Heimersheim & Nanda 2024 §3
explain why the two answer different questions (sufficiency vs necessity).

Sites (what is copied; ``[batch, pos, …]`` activations of TransformerLens' canonical hook names):

=========  ==============================  =============================================================
site       hook                            unit
=========  ==============================  =============================================================
``z``      ``blocks.l.attn.hook_z``        query head (l, h): its output before ``W_O``, all positions
``q``      ``blocks.l.attn.hook_q``        query head (l, h): its query vectors (before rotary)
``k``      ``blocks.l.attn.hook_k``        key-value head (l, g): with grouped-query attention one key
                                           head is read by the query heads ``g·G .. g·G + G − 1``
                                           (G = H / H_kv), so patching it moves all G of them
``v``      ``blocks.l.attn.hook_v``        key-value head (l, g), as for ``k``
``resid``  ``blocks.l.hook_resid_pre``     (layer, position): the residual stream entering layer l at
           (row L: the last layer's        one position; row L is the stream after the last layer
           ``hook_resid_post``)
=========  ==============================  =============================================================

With a chosen head (``head=(l, h)``) a head site is patched one position at a time instead.

Exact patching is batched like the single-head ablation sweep (:mod:`headscope.analysis.head_sweep`): a batch
holds one copy of the receiving prompt per unit and a hook patches unit ``b`` in batch element b only;
layers below the batch's first patched layer run once and are broadcast.

*Attribution patching* (Nanda 2023, "Attribution Patching: Activation Patching At Industrial Scale";
Syed, Rager & Conmy 2023, "Attribution Patching Outperforms Automated Circuit Discovery",
arXiv:2310.10348) is the first-order Taylor term of the same change,

    m(patched) − m(receiving) ≈ Σ_{pos, d} (a_source − a_receiving) · ∂m/∂a |_receiving,

for every unit from one forward and one backward pass on the receiving prompt (and one forward pass
on the source prompt for its activations), normalised like the exact value. :class:`Agreement`
compares the two over units (Pearson, Spearman, overlap of the top k by |effect|).

:func:`activation_patching` is the user action (CLI ``headscope patch``): it checks the pair, owns
the store key, and takes ``progress`` and ``cancel``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.ablation import Cancel, Hook, Progress, _tensor
from headscope.analysis.answer_tokens import answer_id
from headscope.analysis.capture import tokenize_input
from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.greedy_decoding import cancel_requested
from headscope.analysis.limits import hint, limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.patching_choices import (
    DIRECTIONS,
    KV_SITES,
    METRIC_LABELS,
    METRICS,
    SITES,
)
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result

PATCHING_VERSION = 1
TOP_K = 10
MIN_DENOMINATOR = 1e-6
ATTRIBUTION_SHARE = 0.1
"""With exact and attribution patching both asked for, the share of ``progress`` that attribution
patching reports (it finishes first); exact patching reports the rest, unit by unit."""


# ---------------------------------------------------------------------------------------------
# The prompt pair and the metric


@dataclass(frozen=True)
class PromptPair:
    """A checked clean/corrupted pair: equal token lengths, single-token answers.

    ``answers[0]`` is the clean answer (A), ``answers[1]`` (when given) the corrupted one (B).
    ``differ`` lists the positions where the two prompts' tokens differ.
    """

    clean_ids: tuple[int, ...]
    corrupted_ids: tuple[int, ...]
    answers: tuple[int, ...]
    clean_tokens: tuple[str, ...]
    corrupted_tokens: tuple[str, ...]
    answer_tokens: tuple[str, ...]
    differ: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.clean_ids)


PATCH_TOKENS = "HEADSCOPE_MAX_PATCH_TOKENS"
"""The limit on each prompt's tokens (:mod:`headscope.analysis.limits`): read when a pair is checked."""


def _prompt_ids(model: LoadedModel, prompt: str | Sequence[int], which: str) -> list[int]:
    """One prompt's ids (:func:`~headscope.analysis.capture.tokenize_input`: not empty, within the model's
    context), at most :data:`PATCH_TOKENS` of them."""
    ids = tokenize_input(model, prompt, model.n_ctx)
    if len(ids) > limit(PATCH_TOKENS):
        raise InputError(f"The {which} prompt has {len(ids):,} tokens, more than patching takes "
                         f"{hint(PATCH_TOKENS)}. Shorten the prompts.")
    return ids


def prompt_pair(
    model: LoadedModel,
    clean: str | Sequence[int],
    corrupted: str | Sequence[int],
    answers: Sequence[str | int],
) -> PromptPair:
    """Tokenise and check a clean/corrupted prompt pair and its one or two answer tokens.

    Prompts are tokenised as written, after the BOS the model expects if any (DESIGN.md, *Conventions*);
    answers as written, so an answer that follows a space is written with it (``" Mary"``).

    Raises
    ------
    InputError
        An empty prompt, one over the model's context or over ``HEADSCOPE_MAX_PATCH_TOKENS`` (read now;
        the message names it), unequal token lengths (the message gives both lengths and the first
        position where the tokens differ), identical prompts, an empty or multi-token answer, more than two answers, or two
        equal answers.
    """
    clean_ids = _prompt_ids(model, clean, "clean")
    corrupted_ids = _prompt_ids(model, corrupted, "corrupted")
    clean_tokens, corrupted_tokens = model.token_strings(clean_ids), model.token_strings(corrupted_ids)
    first = next((i for i, (a, b) in enumerate(zip(clean_ids, corrupted_ids, strict=False)) if a != b),
                 min(len(clean_ids), len(corrupted_ids)))
    if len(clean_ids) != len(corrupted_ids):
        at = (f"they first differ at token {first} ({clean_tokens[first]!r} vs {corrupted_tokens[first]!r})"
              if first < min(len(clean_ids), len(corrupted_ids))
              else f"one is the other followed by more tokens from token {first}")
        raise InputError(
            f"The clean prompt has {len(clean_ids)} tokens and the corrupted prompt {len(corrupted_ids)}; "
            f"patching copies activations position by position, so they need the same number of tokens "
            f"({at}). Change words for words of the same token count (e.g. one name for another)."
        )
    differ = tuple(i for i, (a, b) in enumerate(zip(clean_ids, corrupted_ids, strict=True)) if a != b)
    if not differ:
        raise InputError("The clean and corrupted prompts are the same tokens: corrupt the clean prompt "
                         "(e.g. swap a name) so that the answer changes.")
    answers = list(answers)
    if not 1 <= len(answers) <= 2:
        raise InputError(f"Give one or two answers (the clean answer, then the corrupted one), got {len(answers)}.")
    ids = [answer_id(model, a, which, "patching") for a, which in zip(answers, ("clean", "corrupted"), strict=False)]
    if len(ids) == 2 and ids[0] == ids[1]:
        raise InputError("The two answers are the same token: give the clean answer, then a different one.")
    return PromptPair(tuple(clean_ids), tuple(corrupted_ids), tuple(ids), tuple(clean_tokens),
                      tuple(corrupted_tokens), tuple(model.token_strings(ids)), differ)


MetricFn = Callable[[torch.Tensor], torch.Tensor]
"""``logits [batch, pos, vocab] → [batch]``: the un-normalised metric at the last position."""


def _last_position(resid: torch.Tensor, hook: Any = None) -> torch.Tensor:
    """Only the last position reaches the final norm and the unembedding: the metric reads nothing
    else, and the ``[batch, pos, vocab]`` logits of a big batch would cost more than the layers."""
    return resid[:, -1:]


LAST_POSITION: Hook = ("ln_final.hook_in", _last_position)


def patching_metric(metric: str, answers: Sequence[int]) -> MetricFn:
    """The metric of the module docstring on the last position's logits, not yet normalised.

    ``logit_diff``: ``x[A] − x[B]`` (needs two answers); ``loss``: ``−log softmax(x)[A]``.
    """
    if metric not in METRICS:
        raise InputError(f"Unknown patching metric {metric!r}: choose one of {', '.join(METRICS)}.")
    a = int(answers[0])
    if metric == "logit_diff":
        if len(answers) != 2:
            raise InputError("The logit difference needs two answers (the clean one, then the corrupted one); "
                             "with one answer use the loss metric.")
        b = int(answers[1])
        return lambda logits: logits[:, -1, a].float() - logits[:, -1, b].float()
    return lambda logits: -torch.log_softmax(logits[:, -1].float(), dim=-1)[:, a]


# ---------------------------------------------------------------------------------------------
# Units: what one batch element patches


def _site_hook(model: LoadedModel, site: str, layer: int) -> str:
    if site == "resid":
        if layer == model.n_layers:
            return get_act_name("resid_post", model.n_layers - 1)
        return get_act_name("resid_pre", layer)
    return get_act_name(site, layer)


def _hook_layers(model: LoadedModel, site: str) -> list[int]:
    return list(range(model.n_layers + 1 if site == "resid" else model.n_layers))


def _head_kind(site: str) -> str:
    """What a head index counts at ``site``, for messages."""
    return "key-value heads" if site in KV_SITES else "query heads"


def _n_heads(model: LoadedModel, site: str) -> int:
    return model.n_kv_heads if site in KV_SITES else model.n_heads


Unit = tuple[int, int | None, int | None]
"""``(layer, head or None, position or None)``: a head at every position, a head at one position, or
the residual stream at one position (head None)."""


def _units(model: LoadedModel, site: str, n_tokens: int, head: tuple[int, int] | None) -> tuple[list[Unit], tuple]:
    """The units to patch and the shape of the result they fill (in the same order)."""
    if site == "resid":
        layers = _hook_layers(model, site)
        return [(la, None, p) for la in layers for p in range(n_tokens)], (len(layers), n_tokens)
    if head is not None:
        return [(head[0], head[1], p) for p in range(n_tokens)], (n_tokens,)
    n = _n_heads(model, site)
    return [(la, h, None) for la in range(model.n_layers) for h in range(n)], (model.n_layers, n)


def _source_activations(model: LoadedModel, ids: Sequence[int], site: str, layers: Sequence[int]
                        ) -> dict[int, torch.Tensor]:
    """The source run's activation at ``site`` for each of ``layers``: layer → ``[pos, …]``."""
    acts: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(t: torch.Tensor, hook: Any = None) -> None:
            acts[layer] = t[0].detach().clone()

        return hook

    hooks = [(_site_hook(model, site, la), keep(la)) for la in sorted(set(layers))]
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(_tensor(model, [ids]), fwd_hooks=hooks, return_type=None)
    return acts


def _patch_hooks(model: LoadedModel, site: str, chunk: Sequence[Unit], source: dict[int, torch.Tensor]) -> list[Hook]:
    """Hooks that make batch element b copy ``source`` into unit ``chunk[b]`` (and nothing else)."""
    by_layer: dict[int, list[tuple[int, int | None, int | None]]] = {}
    for b, (layer, h, p) in enumerate(chunk):
        by_layer.setdefault(layer, []).append((b, h, p))
    hooks: list[Hook] = []
    for layer, items in sorted(by_layer.items()):
        src = source[layer]

        def patch(t: torch.Tensor, hook: Any = None, items=items, src=src) -> torch.Tensor:
            t = t.clone()
            for b, h, p in items:
                where = (b, slice(None) if p is None else p) + (() if h is None else (h,))
                t[where] = src[where[1:]].to(t.dtype)
            return t

        hooks.append((_site_hook(model, site, layer), patch))
    return hooks


def _exact(
    model: LoadedModel,
    receive_ids: Sequence[int],
    source: dict[int, torch.Tensor],
    site: str,
    units: Sequence[Unit],
    fn: MetricFn,
    batch_size: int,
    progress: Progress | None,
    cancel: Cancel | None,
) -> tuple[np.ndarray, bool]:
    """The metric with each unit patched alone (nan where not reached before a cancel)."""
    raw = np.full(len(units), np.nan, dtype=np.float64)
    order = sorted(range(len(units)), key=lambda i: (units[i][0], i))
    for start in range(0, len(order), batch_size):
        if cancel_requested(cancel):
            return raw, False
        idx = order[start : start + batch_size]
        chunk = [units[i] for i in idx]
        n = len(chunk)
        hooks = _patch_hooks(model, site, chunk, source)
        first = min(layer for layer, _, _ in chunk)
        # Layers below the first patched one are the same for every element: run them once.
        shared = min(first, model.n_layers - 1)
        if shared > 0:

            def broadcast(resid: torch.Tensor, hook: Any = None, n: int = n) -> torch.Tensor:
                return resid.expand(n, *resid.shape[1:]).contiguous()

            hooks.insert(0, (get_act_name("resid_pre", shared), broadcast))
            inp = _tensor(model, [receive_ids])
        else:
            inp = _tensor(model, [receive_ids] * n)
        with model.lock, torch.inference_mode():
            logits = model.bridge.run_with_hooks(inp, fwd_hooks=hooks + [LAST_POSITION], return_type="logits")
            values = fn(logits).double().cpu().numpy()
        del logits
        raw[idx] = values
        if progress:
            progress(min(start + n, len(order)) / len(order))
    return raw, True


def _attribution(
    model: LoadedModel,
    receive_ids: Sequence[int],
    source: dict[int, torch.Tensor],
    site: str,
    units: Sequence[Unit],
    fn: MetricFn,
) -> np.ndarray:
    """First-order estimate of ``m(patched) − m(receiving)`` per unit: one forward and one backward
    pass on the receiving prompt, ``Σ (a_source − a_receiving) · ∂m/∂a`` over the unit's entries."""
    layers = sorted({u[0] for u in units})
    acts: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(t: torch.Tensor, hook: Any = None) -> torch.Tensor:
            acts[layer] = t
            return t

        return hook

    hooks = [(_site_hook(model, site, la), keep(la)) for la in layers]
    with model.lock, torch.enable_grad():
        logits = model.bridge.run_with_hooks(_tensor(model, [receive_ids]), fwd_hooks=hooks + [LAST_POSITION],
                                             return_type="logits")
        value = fn(logits)[0]
        missing = [la for la in layers if la not in acts or not acts[la].requires_grad]
        if missing:
            raise RuntimeError(f"attribution patching: no gradient reaches {site} in layers {missing}")
        grads = torch.autograd.grad(value, [acts[la] for la in layers])
    # per layer: (source − receiving) · gradient, summed over d (and over positions per unit below)
    prod = {la: ((source[la] - acts[la][0].detach()) * g[0]).double() for la, g in zip(layers, grads, strict=True)}
    out = np.empty(len(units), dtype=np.float64)
    for i, (layer, h, p) in enumerate(units):
        where = (slice(None) if p is None else p,) + (() if h is None else (h,))
        t = prod[layer][where]  # [pos, head, d] or [pos, d] indexed like the exact patch
        out[i] = float(t.sum())
    return out


# ---------------------------------------------------------------------------------------------
# Agreement and the result


@dataclass(frozen=True)
class Agreement:
    """How well attribution patching ranks the units the exact patching ranks.

    ``pearson`` and ``spearman`` over all units (finite values); ``overlap`` = |top-k exact ∩ top-k
    attribution| / k, each top k by the size of the effect ``|value − baseline|`` (baseline 0 for
    denoising, 1 for noising).
    """

    pearson: float
    spearman: float
    k: int
    overlap: float
    n_units: int


def agreement(exact: np.ndarray, approx: np.ndarray, baseline: float, k: int = TOP_K) -> Agreement:
    """:class:`Agreement` of two same-shaped arrays of normalised values (scipy's pearsonr/spearmanr)."""
    from scipy.stats import pearsonr, spearmanr

    x, y = np.asarray(exact, dtype=float).ravel(), np.asarray(approx, dtype=float).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    k = max(1, min(k, x.size))
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        pearson = spearman = float("nan")
    else:
        pearson, spearman = float(pearsonr(x, y)[0]), float(spearmanr(x, y)[0])
    top_x = set(np.argsort(-np.abs(x - baseline), kind="stable")[:k].tolist())
    top_y = set(np.argsort(-np.abs(y - baseline), kind="stable")[:k].tolist())
    return Agreement(pearson, spearman, k, len(top_x & top_y) / k, int(x.size))


@dataclass
class PatchingResult:
    """Normalised patching values (0 = corrupted, 1 = clean) for every unit of one site.

    Attributes
    ----------
    values : exact patching. ``[layer, head]`` for ``z``/``q``; ``[layer, kv_head]`` for ``k``/``v``;
        ``[layer + 1, position]`` for ``resid`` (row L: after the last layer); ``[position]`` for one
        head (``head``). nan where a cancel stopped it (``complete`` False); None when not computed.
    raw : the un-normalised metric of each exact patch, same shape.
    attribution : the attribution-patching estimate, normalised the same way (None unless asked).
    clean, corrupted : the metric on the clean and the corrupted prompt (the normalisation's 1 and 0).
    unit : what one cell is, in words (says when a cell is a key-value head shared by query heads).
    """

    site: str
    direction: str
    metric: str
    values: np.ndarray | None
    raw: np.ndarray | None
    attribution: np.ndarray | None
    clean: float
    corrupted: float
    pair: PromptPair
    unit: str
    head: tuple[int, int] | None = None
    agreement: Agreement | None = None
    complete: bool = True
    seconds: float = 0.0
    attribution_seconds: float = 0.0
    key: str = ""

    @property
    def baseline(self) -> float:
        """The value of patching nothing: 0 when denoising, 1 when noising."""
        return 0.0 if self.direction == "denoise" else 1.0

    def top_units(self, k: int = TOP_K, attribution: bool = False) -> list[tuple[tuple[int, ...], float]]:
        """The k cells with the largest effect ``|value − baseline|``: (index, value), largest first."""
        arr = self.attribution if attribution else self.values
        if arr is None:
            return []
        flat = np.where(np.isfinite(arr), np.abs(arr - self.baseline), -np.inf).ravel()
        order = np.argsort(-flat, kind="stable")[: min(k, flat.size)]
        return [(tuple(int(i) for i in np.unravel_index(j, arr.shape)), float(arr.ravel()[j]))
                for j in order if np.isfinite(flat[j])]


def _unit_text(model: LoadedModel, site: str, head: tuple[int, int] | None) -> str:
    if site == "resid":
        return "residual stream of one position entering a layer (last row: after the last layer)"
    what = {"z": "output z", "q": "queries", "k": "keys", "v": "values"}[site]
    if site in KV_SITES:
        g = model.group_size
        kind = (f"key-value head (grouped-query attention: key-value head g is read by query heads "
                f"g·{g} .. g·{g}+{g - 1})" if g > 1 else "key-value head (one per query head)")
    else:
        kind = "query head"
    if head is not None:
        return f"the {what} of {kind} {head[0]}.{head[1]} at one position"
    return f"the {what} of one {kind} at every position"


def patching_key(model: LoadedModel, pair: PromptPair, site: str, direction: str, metric: str,
                 head: tuple[int, int] | None, attribution: bool, exact: bool) -> str:
    """The store key of :func:`activation_patching`: model digest, token ids, answers and settings."""
    return content_key("patching", PATCHING_VERSION, model.digest, list(pair.clean_ids), list(pair.corrupted_ids),
                       list(pair.answers), site, direction, metric, head, attribution, exact)


def save_patching(store: Store, result: PatchingResult, model_digest: str) -> None:
    arrays = {name: np.asarray(arr, dtype=np.float64)
              for name, arr in (("values", result.values), ("raw", result.raw), ("attribution", result.attribution))
              if arr is not None}
    meta = {"site": result.site, "direction": result.direction, "metric": result.metric,
            "clean": result.clean, "corrupted": result.corrupted, "pair": asdict(result.pair),
            "unit": result.unit, "head": list(result.head) if result.head else None,
            "agreement": asdict(result.agreement) if result.agreement else None, "complete": result.complete,
            "seconds": result.seconds, "attribution_seconds": result.attribution_seconds,
            "model_digest": model_digest, "version": PATCHING_VERSION}
    store.put(result.key, "patching", meta, arrays)


def load_patching(store: Store, key: str) -> PatchingResult | None:
    """A stored :class:`PatchingResult` under ``key``, or None."""
    record = stored_record(store, key, "patching")
    if record is None:
        return None
    m = record.meta
    arrays = {name: record.array(name, mmap=False) for name in ("values", "raw", "attribution")
              if name in record.array_info}
    pair = PromptPair(**{k: tuple(v) for k, v in m["pair"].items()})
    return PatchingResult(m["site"], m["direction"], m["metric"], arrays.get("values"), arrays.get("raw"),
                          arrays.get("attribution"), float(m["clean"]), float(m["corrupted"]), pair, m["unit"],
                          tuple(m["head"]) if m["head"] else None,
                          Agreement(**m["agreement"]) if m["agreement"] else None, bool(m["complete"]),
                          float(m["seconds"]), float(m["attribution_seconds"]), key)


def _check_choices(site: str, direction: str, metric: str) -> None:
    for value, allowed, what in ((site, SITES, "site"), (direction, DIRECTIONS, "direction"),
                                 (metric, METRICS, "metric")):
        if value not in allowed:
            raise InputError(f"Unknown patching {what} {value!r}: choose one of {', '.join(allowed)}.")


def activation_patching(
    model: LoadedModel,
    clean: str | Sequence[int],
    corrupted: str | Sequence[int],
    answers: Sequence[str | int],
    *,
    site: str = "z",
    direction: str = "denoise",
    metric: str = "logit_diff",
    head: tuple[int, int] | None = None,
    attribution: bool = False,
    exact: bool = True,
    batch_size: int | None = None,
    store: Store | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> PatchingResult:
    """Patch every unit of ``site`` between a clean and a corrupted prompt, exactly and/or by attribution.

    Implements the module docstring: value = (m_patched − m_corrupted) / (m_clean − m_corrupted) with
    m the logit difference x[A] − x[B] or the loss −log p(A) at the last position (Heimersheim & Nanda
    2024, arXiv:2404.15255; Wang et al. 2022, arXiv:2211.00593; Meng et al. 2022, arXiv:2202.05262);
    attribution patching is the first-order term Σ (a_source − a_receiving)·∂m/∂a (Nanda 2023;
    Syed et al. 2023, arXiv:2310.10348).

    Parameters
    ----------
    clean, corrupted : texts (tokenised as written, after the BOS the model expects if any) or token ids, of equal token length.
    answers : the clean answer, then optionally the corrupted one: single tokens as text (with their
        leading space, ``" Mary"``) or ids. ``logit_diff`` needs both.
    site : ``z``, ``q``, ``k``, ``v`` (per head; k and v per key-value head) or ``resid``
        (layer × position map).
    direction : ``denoise`` (clean into the corrupted run) or ``noise`` (corrupted into the clean run).
    head : ``(layer, head)``: patch that head's ``site`` one position at a time (for k and v, the
        key-value head). Not with ``resid``.
    attribution : also compute attribution patching and, with ``exact``, their :class:`Agreement`.
    exact : compute exact patching (False with ``attribution``: the fast estimate alone).
    batch_size : units per forward pass (default: as many as keep one layer's attention patterns of
        the batch under 1 GiB, at most 64).
    store : when given, a stored result is returned at once and a complete new one stored.
    cancel : checked between batches; the result then holds what finished (nan elsewhere) and
        ``complete`` is False (not stored).

    Returns
    -------
    :class:`PatchingResult`.

    Raises
    ------
    InputError
        See :func:`prompt_pair`; unknown site, direction or metric; a head out of range; prompts whose
        metric is the same on both (nothing to normalise by).
    """
    t0 = time.perf_counter()
    _check_choices(site, direction, metric)
    if not exact and not attribution:
        raise InputError("Nothing to compute: ask for exact patching, attribution patching, or both.")
    pair = prompt_pair(model, clean, corrupted, answers)
    fn = patching_metric(metric, pair.answers)
    if head is not None:
        if site == "resid":
            raise InputError("The residual stream map is already per position: choose a head site (z, q, k, v) "
                             "to patch one head by position.")
        n = _n_heads(model, site)
        layer, h = check_head_index(model.n_layers, n, *head, kind=_head_kind(site))
        head = (layer, h)
    key = patching_key(model, pair, site, direction, metric, head, attribution, exact)
    if (found := stored_result(store, key, load_patching, progress)) is not None:
        return found
    with model.lock, torch.inference_mode():
        both = model.bridge.run_with_hooks(_tensor(model, [pair.clean_ids, pair.corrupted_ids]), fwd_hooks=[LAST_POSITION],
                                           return_type="logits")
        m_clean, m_corrupted = (float(v) for v in fn(both))
    denominator = m_clean - m_corrupted
    if abs(denominator) < MIN_DENOMINATOR:
        raise InputError(
            f"The {METRIC_LABELS[metric]} is the same on the clean and the corrupted prompt ({m_clean:.4g}): "
            "there is no difference to restore. Corrupt the prompt so that the answer changes."
        )
    receive, source_ids = ((pair.corrupted_ids, pair.clean_ids) if direction == "denoise"
                           else (pair.clean_ids, pair.corrupted_ids))
    m_receive = m_corrupted if direction == "denoise" else m_clean
    units, shape = _units(model, site, pair.n_tokens, head)
    source = _source_activations(model, source_ids, site, sorted({u[0] for u in units}))
    if batch_size is None:
        n = pair.n_tokens
        batch_size = max(1, min(64, (1 << 28) // (n * n * model.n_heads)))  # a layer's patterns ≤ 1 GiB
    if batch_size < 1:
        raise InputError("batch_size must be at least 1.")

    def normalise(m: np.ndarray) -> np.ndarray:
        return ((m - m_corrupted) / denominator).reshape(shape)

    share = 1.0 - ATTRIBUTION_SHARE if exact and attribution else 1.0
    values = raw = approx = None
    complete, t_attr = True, 0.0
    if attribution:
        t1 = time.perf_counter()
        delta = _attribution(model, receive, source, site, units, fn)
        approx = normalise(m_receive + delta)
        t_attr = time.perf_counter() - t1
        if progress:
            progress(1.0 - share if exact else 1.0)
    if exact:
        sub = (lambda f: progress(1.0 - share + share * f)) if progress else None
        raw_flat, complete = _exact(model, receive, source, site, units, fn, batch_size, sub, cancel)
        raw, values = raw_flat.reshape(shape), normalise(raw_flat)
    agree = None
    if values is not None and approx is not None and complete:
        agree = agreement(values, approx, 0.0 if direction == "denoise" else 1.0)
    result = PatchingResult(site, direction, metric, values, raw, approx, m_clean, m_corrupted, pair,
                            _unit_text(model, site, head), head, agree, complete, time.perf_counter() - t0,
                            t_attr, key)
    if store is not None and complete:
        save_patching(store, result, model.digest)
    return result

"""KV-cache compression policies from head classes, evaluated exactly, and exported for deployment.

DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
and Streaming Heads", arXiv:2410.10819, §3) keeps the full KV cache only for *retrieval* heads and,
for *streaming* heads, the first S tokens (attention sinks, StreamingLLM: Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453) plus the last W tokens.
RazorAttention (Tang et al. 2024, "RazorAttention: Efficient KV Cache Compression Through Retrieval
Heads", arXiv:2407.15891) does the same with retrieval heads found by a training-free score. The
cache is stored per key-value head, so a policy here is one decision per (layer, KV group):

    full(l, g) ∈ {True, False};  a streaming group's query heads see key j from query i iff
    j ≤ i  and  (j < S  or  j > i − W)                                  (:func:`streaming_key_mask`)

i.e. S sinks and a window of W keys ending at the query itself, in the prefill and at every decode
step (a real compressed cache holds exactly these S + W keys). A policy is built from a *ranking*
of the groups and a fraction kept full (:func:`build_policy`): the ``round(fraction · L · H_kv)``
groups ranked highest are full. Rankings (:data:`RANKINGS`) turn a per-query-head score ``[layer,
head]`` into a per-group priority with :func:`headscope.analysis.detectors.group_heads`, the aggregation the
Heads page shows: the retrieval score and every head score the registry ranks by
(:attr:`headscope.analysis.score_registry.HeadScore.kv_ranking`: evidence, streaming, ...) by their group
maximum (a group must stay full if any of its query heads retrieves), or, for a score whose high values
say a head may stream, of ``1 − score`` (streaming: a group may stream only if all its heads do);
``random`` draws a priority per seed; ``all_full`` and ``all_streaming`` are the two ends. ``all_streaming`` keeps StreamingLLM's cache (its sinks and window) with the positions the
model saw; StreamingLLM itself renumbers positions within its cache (Xiao et al. 2023, positions
"within the cache rather than in the original text"), which this masking does not.

KV memory kept (:func:`kv_memory`), exact for the model's layout, for a cache of n tokens:

    bytes = Σ_{l, g} kept(l, g) · 2 (K and V) · d_head · dtype bytes,
    kept = n for a full group, min(n, S + W) for a streaming group,

reported with the fraction of the full cache (every group full). On a model with sliding-window
layers each layer's own window W_m bounds both, as the model's cache and the ``cache`` backend keep
them (:func:`kv_memory`'s ``windows``).

Evaluation (:func:`evaluate_policies`) runs the model with the policy's mask in the prefill and at
every KV-cached decode step, on one of three backends (:data:`BACKENDS`):

- ``eager``: the model's eager path with a hook on ``hook_attn_scores`` that sets the scores of keys
  a streaming group cannot see to −inf before the softmax (:func:`policy_hooks`); O(n²) memory per layer;
- ``statistics``: statistics mode (:mod:`headscope.analysis.attention_statistics`), the model's own forward
  pass with its attention in :func:`headscope.kernels.attention.attention`, the mask given to the kernel as
  per-query-head ``key_sink``/``key_window`` (:func:`policy_key_masks`; intersected with a
  sliding-window model's own window); O(n) memory;
- ``cache``: no mask: each KV group keeps the cache the policy says, physically (a streaming group
  its S sinks and last W keys), through :mod:`headscope.analysis.kv_cache`; the same tokens and losses
  as the masks, with the memory the policy saves;
- ``auto`` (default): statistics mode where the model supports it and the longest input is over
  ``HEADSCOPE_MAX_TOKENS`` (the Attention page's rule for full patterns) or the model is on CUDA,
  else eager; and statistics mode where prompts with sinks decode past a sliding window, which the
  eager hook cannot mask (:func:`check_eager_decode`).

Both measure mean next-token loss and
next-token agreement with the uncompressed model on texts, and needle-in-a-haystack accuracy on a
sweep's prompts (:func:`headscope.analysis.ablation_curve.retrieval_accuracy`, the same decoding and answer
scoring as the ablation curves). The policy can be exported as the pattern folder DuoAttention ships
and NVIDIA kvpress' ``DuoAttentionPress`` reads (:func:`headscope.analysis.pattern_folder.export_policy`).

Defaults S = 128 sinks and W = 256 recent tokens are those of DuoAttention's shipped patterns
(``attn_patterns/*/config.json`` in mit-han-lab/duo-attention: ``"sink_size": 128, "recent_size":
256`` for Llama-3-8B-Instruct-Gradient-1048k and Meta-Llama-3.1-8B-Instruct), also the values
kvpress' ``DuoAttentionPress`` uses for its on-the-fly scores.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis import kv_cache
from headscope.analysis.ablation import Cancel, Hook, Progress, loss_metric
from headscope.analysis.ablation_curve import retrieval_accuracy
from headscope.analysis.attention_statistics import HeadKeyMask, statistics_mode, statistics_supported
from headscope.analysis.detectors import group_heads
from headscope.analysis.errors import InputError
from headscope.analysis.intervals import (
    Proportion,
    from_accuracy,
    reaches,
    seed_band,
    smallest_passing,
    wilson,
)
from headscope.analysis.kv_cache import check_cache_backend
from headscope.analysis.kv_compression_choices import (
    BACKENDS,
    DEFAULT_RANKINGS,
    DEFAULT_RECENT_SIZE,
    DEFAULT_SINK_SIZE,
    RANKING_LABELS,
)
from headscope.analysis.kv_memory import KVMemory, dtype_bytes, kv_memory
from headscope.analysis.models import LoadedModel
from headscope.analysis.niah import NiahPrompt
from headscope.analysis.retrieval import Cancelled, cancel_requested
from headscope.analysis.score_registry import HEAD_SCORES, KV_SCORES
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record

KV_COMPRESSION_VERSION = 1


@dataclass(frozen=True)
class Ranking:
    """How one ranking orders KV groups: ``priority(scores [layer, head], n_kv, seed) -> [layer, n_kv]``
    (higher = kept full first); ``score`` names the per-head table it needs (None: none), ``invert``
    ranks by ``1 − score``."""

    name: str
    score: str | None
    fixed_fraction: float | None = None  # the two ends ignore the fraction asked for
    seeded: bool = False
    invert: bool = False

    @property
    def label(self) -> str:
        return RANKING_LABELS[self.name]


RANKINGS: dict[str, Ranking] = {r.name: r for r in [
    Ranking("retrieval", "retrieval"),
    *[Ranking(name, name, invert=HEAD_SCORES[name].kv_ranking.invert) for name in KV_SCORES],
    Ranking("random", None, seeded=True),
    Ranking("all_full", None, fixed_fraction=1.0),
    Ranking("all_streaming", None, fixed_fraction=0.0),
]}
assert tuple(RANKINGS) == tuple(RANKING_LABELS)


def group_priority(model: LoadedModel, ranking: str, scores: Mapping[str, np.ndarray] | None = None,
                   seed: int = 0) -> np.ndarray:
    """``[layer, kv_head]`` priority of ``ranking`` (higher = kept full first); see the module docstring.

    Query-head scores are aggregated with :func:`headscope.analysis.detectors.group_heads` (nan counts as 0).
    """
    if ranking not in RANKINGS:
        raise InputError(f"Unknown ranking {ranking!r}: choose from {', '.join(RANKINGS)}.")
    r = RANKINGS[ranking]
    shape = (model.n_layers, model.n_kv_heads)
    if r.seeded:
        return np.random.default_rng(int(seed)).random(shape)
    if r.score is None:
        return np.zeros(shape)
    table = (scores or {}).get(r.score)
    if table is None:
        raise InputError(f"The {ranking} ranking needs the {r.score} score, which was not computed here.")
    table = np.asarray(table, dtype=np.float64)
    if table.shape != (model.n_layers, model.n_heads):
        raise InputError(f"The {r.score} score must have shape [layer, head] = {(model.n_layers, model.n_heads)}, "
                         f"got {table.shape}.")
    if r.invert:
        table = 1.0 - table
    return group_heads(np.nan_to_num(table, nan=0.0), model.n_kv_heads, "max")


def priority_name(ranking: str, seed: int | None) -> str:
    """``RANKING``, or ``RANKING:SEED`` for a seeded ranking's policy: how a curve names a priority."""
    return ranking if seed is None else f"{ranking}:{seed}"


def group_priorities(model: LoadedModel, rankings: Sequence[str], seeds: Sequence[int],
                     scores: Mapping[str, np.ndarray] | None) -> dict[str, list[list[float]]]:
    """Each ranking's :func:`group_priority` (a seeded one's per seed) as JSON lists, by ``RANKING`` or
    ``RANKING:SEED``: what a curve keeps so an export from it writes the ranking's scores."""
    return {priority_name(r, s if RANKINGS[r].seeded else None): group_priority(model, r, scores, s).tolist()
            for r in rankings for s in (seeds if RANKINGS[r].seeded else [0])}


@dataclass(frozen=True)
class Policy:
    """Per (layer, KV group): full cache or streaming (S sinks + W recent keys).

    Attributes
    ----------
    full : ``[layer, kv_head]`` bool, True = full cache.
    sink_size, recent_size : S and W of the streaming groups.
    ranking, fraction, seed : how it was built (fraction = share of groups asked to stay full).
    """

    full: np.ndarray
    sink_size: int = DEFAULT_SINK_SIZE
    recent_size: int = DEFAULT_RECENT_SIZE
    ranking: str = ""
    fraction: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "full", np.asarray(self.full, dtype=bool))
        if self.full.ndim != 2:
            raise InputError(f"A policy is a [layer, kv_head] table; got shape {self.full.shape}.")
        if self.sink_size < 0 or self.recent_size < 1:
            raise InputError(f"A streaming group needs S >= 0 sinks and W >= 1 recent tokens; got S={self.sink_size}, "
                             f"W={self.recent_size}.")

    @property
    def n_full(self) -> int:
        return int(self.full.sum())

    @property
    def full_share(self) -> float:
        """Share of KV groups kept full."""
        return float(self.full.mean())

    def mask_key(self) -> str:
        """What the evaluation depends on: which groups stream, and S and W."""
        return content_key(np.packbits(self.full).tolist(), list(self.full.shape), self.sink_size, self.recent_size)

    def to_json(self) -> dict[str, Any]:
        return {"sink_size": self.sink_size, "recent_size": self.recent_size, "ranking": self.ranking,
                "fraction": self.fraction, "seed": self.seed, "n_full": self.n_full,
                "full_share": self.full_share, "full": self.full.astype(int).tolist()}


def build_policy(model: LoadedModel, ranking: str, fraction: float, scores: Mapping[str, np.ndarray] | None = None,
                 *, seed: int = 0, sink_size: int = DEFAULT_SINK_SIZE,
                 recent_size: int = DEFAULT_RECENT_SIZE) -> Policy:
    """The policy keeping the ``round(fraction · L · H_kv)`` highest-priority groups full.

    Ties keep (layer, group) order. ``all_full`` and ``all_streaming`` ignore ``fraction``.
    """
    if not (isinstance(fraction, int | float) and 0.0 <= float(fraction) <= 1.0):
        raise InputError(f"The fraction of KV groups kept full must be between 0 and 1, got {fraction!r}.")
    priority = group_priority(model, ranking, scores, seed)
    fixed = RANKINGS[ranking].fixed_fraction
    fraction = float(fixed if fixed is not None else fraction)
    n_groups = priority.size
    k = int(math.floor(fraction * n_groups + 0.5))
    order = np.argsort(-priority.reshape(-1), kind="stable")
    full = np.zeros(n_groups, dtype=bool)
    full[order[:k]] = True
    return Policy(full.reshape(priority.shape), sink_size, recent_size, ranking, fraction,
                  int(seed) if RANKINGS[ranking].seeded else None)


# ---------------------------------------------------------------------------------------------
# The mask


def streaming_key_mask(n_queries: int, n_keys: int, sink_size: int, recent_size: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """``[n_queries, n_keys]`` bool: keys a streaming head may see.

    Query row r is absolute position ``i = n_keys − n_queries + r`` (with the KV cache the rows are
    the last positions); key j is visible iff ``j ≤ i and (j < S or j > i − W)``. This is the one
    place the mask is defined: a kernel backend (``headscope.kernels.attention(..., key_sink=, key_window=)``)
    can replace :func:`policy_hooks` and must agree with it.
    """
    i = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    j = torch.arange(n_keys, device=device)[None, :]
    return (j <= i) & ((j < sink_size) | (j > i - recent_size))


_score_seam_ok: weakref.WeakKeyDictionary[LoadedModel, bool] = weakref.WeakKeyDictionary()


def check_score_seam(model: LoadedModel) -> None:
    """Check once per model that a ``hook_attn_scores`` edit reaches the softmax and the output.

    On three tokens, every key but 0 of layer 0 is set to −inf; each query head's last output
    ``z[0, h]_2`` must then be ``v_0`` of its KV group. Raises :class:`InputError` for a bridge that
    reports scores after the fact (the policy would silently change nothing).
    """
    if _score_seam_ok.get(model):
        return
    got: dict[str, torch.Tensor] = {}

    def only_first(scores: torch.Tensor, hook: Any = None) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        out[..., 0] = scores[..., 0]
        return out

    def keep(name: str):
        def hook(t: torch.Tensor, hook: Any = None) -> None:
            got[name] = t.detach().clone()

        return hook

    hooks = [(get_act_name("attn_scores", 0), only_first), (get_act_name("v", 0), keep("v")),
             (get_act_name("z", 0), keep("z"))]
    ids = torch.tensor([[min(i, model.vocab_size - 1) for i in (1, 2, 3)]], device=model.device)
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type=None)
    ok = "v" in got and "z" in got
    if ok:
        expected = got["v"][0, 0][[model.kv_head(h) for h in range(model.n_heads)]]
        ok = torch.allclose(got["z"][0, -1], expected, atol=1e-5, rtol=1e-4)
    if not ok:
        raise InputError(f"KV-cache policies cannot be evaluated on {model.architecture}: its bridge reports "
                         "attention scores after computing the output, so masking them changes nothing.")
    _score_seam_ok[model] = True


def policy_hooks(model: LoadedModel, policy: Policy) -> list[Hook]:
    """Forward hooks that apply ``policy`` on the eager path: for each layer with streaming groups,
    ``hook_attn_scores`` (``[batch, head, query, key]``, after the causal mask, before the softmax)
    gets −inf where a streaming group's query heads may not look (:func:`streaming_key_mask`).
    Prefill and KV-cached decode steps alike. The all-full policy gives no hooks."""
    if policy.full.shape != (model.n_layers, model.n_kv_heads):
        raise InputError(f"The policy has shape {policy.full.shape}, the model's layers × KV heads are "
                         f"{(model.n_layers, model.n_kv_heads)}.")
    hooks: list[Hook] = []
    if not policy.full.all():
        check_score_seam(model)
    for layer in range(model.n_layers):
        heads = [h for h in range(model.n_heads) if not policy.full[layer, model.kv_head(h)]]
        if not heads:
            continue

        def hook(scores: torch.Tensor, hook: Any = None, heads: list[int] = heads) -> torch.Tensor:
            hidden = ~streaming_key_mask(scores.shape[-2], scores.shape[-1], policy.sink_size, policy.recent_size,
                                         scores.device)
            hs = torch.tensor(heads, device=scores.device)
            scores = scores.clone()
            scores[:, hs] = scores[:, hs].masked_fill(hidden, float("-inf"))
            return scores

        hooks.append((get_act_name("attn_scores", layer), hook))
    return hooks


def policy_key_masks(model: LoadedModel, policy: Policy) -> dict[int, HeadKeyMask]:
    """The policy as statistics mode's per-layer, per-query-head key masks: a streaming group's query
    heads get ``key_sink = S`` and ``key_window = W`` (the kernel's visible keys ``j ≤ p`` and
    ``(j < S or j > p − W)`` are :func:`streaming_key_mask`'s), a full group's ``0``/``0`` (no limit).
    Layers whose groups are all full are left out; the all-full policy gives no masks."""
    if policy.full.shape != (model.n_layers, model.n_kv_heads):
        raise InputError(f"The policy has shape {policy.full.shape}, the model's layers × KV heads are "
                         f"{(model.n_layers, model.n_kv_heads)}.")
    masks = {}
    for layer in range(model.n_layers):
        streaming = [not policy.full[layer, model.kv_head(h)] for h in range(model.n_heads)]
        if any(streaming):
            masks[layer] = HeadKeyMask(tuple(policy.sink_size if s else 0 for s in streaming),
                                       tuple(policy.recent_size if s else 0 for s in streaming))
    return masks


def choose_backend(model: LoadedModel, backend: str, n_tokens: int) -> str:
    """The backend to run: ``backend`` itself once checked, or for ``auto`` ``eager`` or ``statistics``
    (see the module docstring)."""
    from headscope.analysis.limits import limit

    if backend not in BACKENDS:
        raise InputError(f"Unknown backend {backend!r}: choose from {', '.join(BACKENDS)}.")
    if backend == "statistics" and not statistics_supported(model):
        raise InputError(f"{model.name} cannot run in statistics mode (its attention is not supported by the "
                         "kernels, or a hook edits its patterns): use the eager backend.")
    if backend == "cache":
        check_cache_backend(model)
    if backend != "auto":
        return backend
    long = n_tokens > limit("HEADSCOPE_MAX_TOKENS") or str(model.device).startswith("cuda")
    return "statistics" if long and statistics_supported(model) else "eager"


def smallest_model_window(model: LoadedModel) -> int:
    """The narrowest sliding window of ``model``'s attention layers (0: none has one)."""
    return min((w for w in model.facts.windows if w), default=0)


def check_eager_decode(model: LoadedModel, sink_size: int, n_decoded: int) -> None:
    """Refuse the eager backend where it would be wrong: decoding past a sliding window with sinks.

    The KV cache of a sliding-window layer drops keys older than its window, and the scores hook
    sees only the cache, so it would take the cache's first keys for the sinks. Statistics mode
    knows the positions (:func:`headscope.analysis.attention_statistics.masked_segments`)."""
    window = smallest_model_window(model)
    if sink_size > 0 and window and n_decoded > window:
        raise InputError(f"{model.name} has a sliding window of {window} keys and the prompts decode past it: the eager "
                         "backend cannot place the sinks in its shortened KV cache. Use the statistics backend"
                         + ("." if statistics_supported(model) else
                            " (this model's attention is not supported in statistics mode yet), or S = 0."))


@contextlib.contextmanager
def policy_applied(model: LoadedModel, policy: Policy | None, backend: str) -> Iterator[list[Hook]]:
    """Within the block, ``model``'s forward passes (prefill and cached decoding) run under
    ``policy`` (None: uncompressed) on ``backend`` (``eager`` or ``statistics``); yields the hooks to
    pass to each run (eager: :func:`policy_hooks`; statistics: none, the kernel applies the mask)."""
    if backend == "statistics":
        masks = policy_key_masks(model, policy) if policy is not None else {}
        with statistics_mode(model, key_masks=masks):
            yield []
    else:
        yield policy_hooks(model, policy) if policy is not None else []


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class TextMetrics:
    """Loss and next-token argmax on a set of texts (token-weighted over all of them)."""

    loss: float
    argmax: list[np.ndarray]


def text_metrics(model: LoadedModel, texts: Sequence[Sequence[int]], hooks: Sequence[Hook] = (),
                 cancel: Cancel | None = None) -> TextMetrics:
    """Mean next-token loss ``(1/Σ(n−1)) Σ_texts Σ_{i≥1} −log p(t_i | t_<i)`` with ``hooks`` active,
    and each position's most likely next token."""
    total, count, argmax = 0.0, 0, []
    for ids in texts:
        if cancel_requested(cancel):
            raise Cancelled("cancelled")
        x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
        with model.lock, torch.inference_mode():
            logits = model.bridge.run_with_hooks(x, fwd_hooks=list(hooks), return_type="logits")
        n = len(ids) - 1
        total += float(loss_metric(ids)(logits)[0]) * n
        count += n
        argmax.append(logits[0].argmax(-1).cpu().numpy())
        del logits
    return TextMetrics(total / count if count else math.nan, argmax)


@dataclass
class PolicyEvaluation:
    """One policy's numbers; ``agreement`` = share of positions whose most likely next token is the
    uncompressed model's; ``niah_accuracy`` nan without prompts, else the share of ``niah_n`` prompts
    answered, with its 95 % Wilson interval (:attr:`niah`). Loss and agreement are points: they are
    means over token positions, not proportions of independent prompts."""

    policy: Policy
    memory: KVMemory
    loss: float
    agreement: float
    niah_accuracy: float
    seconds: float = 0.0
    niah_n: int = 0

    @property
    def niah(self) -> Proportion:
        """The NIAH accuracy as answered prompts of ``niah_n`` with its Wilson interval
        (:func:`headscope.analysis.intervals.from_accuracy`); empty (nan) without prompts."""
        return from_accuracy(self.niah_accuracy, self.niah_n)

    def row(self) -> dict[str, Any]:
        p, niah = self.policy, self.niah
        return {"ranking": p.ranking, "seed": p.seed, "fraction_full": p.fraction, "n_full_groups": p.n_full,
                "kv_tokens": self.memory.n_tokens, "kv_bytes": self.memory.bytes,
                "kv_full_bytes": self.memory.full_bytes, "kv_fraction": self.memory.fraction,
                "loss": self.loss, "agreement": self.agreement, "niah_accuracy": self.niah_accuracy,
                "niah_accuracy_n": niah.n, "niah_accuracy_low": niah.low, "niah_accuracy_high": niah.high}


@dataclass
class CompressionCurve:
    """Every evaluated policy, the uncompressed baseline, and how they were measured.

    ``complete`` is False when ``cancel`` stopped the evaluation (finished policies are kept). Every
    policy's NIAH accuracy rests on the curve's ``n_prompts`` prompts: an evaluation built without its
    ``niah_n`` (a record stored before evaluations carried it) gets ``n_prompts``.
    """

    evaluations: list[PolicyEvaluation]
    baseline: PolicyEvaluation
    sink_size: int
    recent_size: int
    n_texts: int
    n_prompts: int
    complete: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for e in [self.baseline, *self.evaluations]:
            if not e.niah_n and math.isfinite(e.niah_accuracy):
                e.niah_n = int(self.n_prompts)

    def rows(self) -> list[dict[str, Any]]:
        return [e.row() for e in self.evaluations]

    def find(self, ranking: str, fraction: float | None = None, seed: int | None = None) -> PolicyEvaluation | None:
        """The evaluation of ``ranking`` at ``fraction`` (any, for the two ends) and ``seed`` (random: the
        first seed when None), or None."""
        for e in self.evaluations:
            p = e.policy
            if p.ranking != ranking:
                continue
            if fraction is not None and RANKINGS[ranking].fixed_fraction is None and abs(p.fraction - fraction) > 1e-9:
                continue
            if seed is not None and p.seed is not None and p.seed != seed:
                continue
            return e
        return None

    def within_tolerance(self, e: PolicyEvaluation, tolerance: float, metric: str = "niah_accuracy") -> bool:
        """Whether ``e`` is within ``tolerance`` of the uncompressed model on ``metric``.

        NIAH accuracy is decided on the 95 % Wilson intervals (:mod:`headscope.analysis.intervals`), not
        the points: ``e`` passes when its upper bound reaches the uncompressed accuracy's lower bound less
        the tolerance,

            high(e) ≥ low(uncompressed) − tolerance,

        i.e. its interval overlaps ``[low(uncompressed) − tolerance, 1]``. A policy fails only when the
        prompts show it worse than the uncompressed model by more than the tolerance: two accuracies whose
        intervals overlap are not told apart (0.75 against 0.50 on n = 4 is no difference either way), and
        a policy above the uncompressed one passes. With few prompts the intervals are wide and the rule
        passes small caches, which is why every decision states its n. At tolerance 0 it is the overlap of
        the two intervals. Loss has no interval here (a mean over token positions of
        a few texts, not independent trials) and keeps the point rule ``loss ≤ uncompressed + tolerance``;
        any other metric ``≥ uncompressed − tolerance``. Without prompts (n = 0) no accuracy passes.
        """
        if metric == "niah_accuracy":
            return reaches(e.niah, self.baseline.niah, tolerance)
        v, base_value = getattr(e, metric), getattr(self.baseline, metric)
        return v <= base_value + tolerance if metric == "loss" else v >= base_value - tolerance - 1e-12

    def smallest_within(self, ranking: str, tolerance: float = 0.05, metric: str = "niah_accuracy"
                        ) -> PolicyEvaluation | None:
        """The policy of ``ranking`` with the smallest KV fraction within ``tolerance`` of the uncompressed
        model (:meth:`within_tolerance`: NIAH accuracy on the intervals, loss on the points); for
        ``random`` every seed must pass, and the seed with the largest KV fraction is returned. None when
        none passes. The decision rests on ``n_prompts`` prompts."""
        by_fraction: dict[float, list[PolicyEvaluation]] = {}
        for e in self.evaluations:
            if e.policy.ranking == ranking:
                by_fraction.setdefault(e.policy.fraction, []).append(e)
        return smallest_passing(by_fraction.values(), lambda e: e.memory.fraction,
                                lambda e: self.within_tolerance(e, tolerance, metric))

    def seed_bands(self, ranking: str = "random") -> list[dict[str, Any]]:
        """Per fraction of a seeded ranking, the spread over seeds (:func:`headscope.analysis.intervals.seed_band`:
        mean, lowest and highest seed) of NIAH accuracy and loss, beside the pooled Wilson interval of all
        the seeds' prompts (``niah_accuracy_pooled*``). Empty for a ranking with no seeds."""
        by_fraction: dict[float, list[PolicyEvaluation]] = {}
        for e in self.evaluations:
            if e.policy.ranking == ranking and e.policy.seed is not None:
                by_fraction.setdefault(e.policy.fraction, []).append(e)
        out = []
        for fraction, es in sorted(by_fraction.items()):
            accuracy, loss = seed_band([e.niah_accuracy for e in es]), seed_band([e.loss for e in es])
            counted = [e.niah for e in es if e.niah.n]
            pooled = wilson(sum(p.successes for p in counted), sum(p.n for p in counted))
            out.append({"ranking": ranking, "fraction_full": fraction,
                        "kv_fraction": float(np.mean([e.memory.fraction for e in es])), "n_seeds": len(es),
                        "niah_accuracy_seed_mean": accuracy.mean, "niah_accuracy_seed_low": accuracy.low,
                        "niah_accuracy_seed_high": accuracy.high, **pooled.columns("niah_accuracy_pooled"),
                        "loss_seed_mean": loss.mean, "loss_seed_low": loss.low, "loss_seed_high": loss.high})
        return out


def _measured(model: LoadedModel, policy: Policy | None, texts: Sequence[Sequence[int]],
              prompts: Sequence[NiahPrompt], max_new_tokens: int, cancel: Cancel | None, backend: str
              ) -> tuple[TextMetrics, float]:
    """Loss and argmax on ``texts`` and NIAH accuracy on ``prompts`` (nan without) under ``policy``
    (None: uncompressed) on ``backend``: masks (eager, statistics) or the policy's own cache (cache)."""
    acc = math.nan
    if backend == "cache":
        policy = policy or build_policy(model, "all_full", 1.0)
        size = (policy.sink_size, policy.recent_size)
        tm = kv_cache.text_metrics(model, policy.full, texts, *size, cancel=cancel)
        if prompts:
            def decode(ids: Sequence[int], n: int) -> list[int]:
                return kv_cache.greedy_continuation(model, policy.full, ids, n, *size, cancel=cancel).generated

            acc = retrieval_accuracy(model, prompts, (), max_new_tokens=max_new_tokens, cancel=cancel,
                                     continuation=decode).accuracy
        return TextMetrics(tm.loss, tm.argmax), acc
    with policy_applied(model, policy, backend) as hooks:
        tm = text_metrics(model, texts, hooks, cancel)
        if prompts:
            acc = retrieval_accuracy(model, prompts, hooks, max_new_tokens=max_new_tokens, cancel=cancel).accuracy
    return tm, acc


def _evaluate_one(model: LoadedModel, policy: Policy, texts: Sequence[Sequence[int]],
                  prompts: Sequence[NiahPrompt], clean_argmax: list[np.ndarray], n_tokens: int,
                  max_new_tokens: int, cancel: Cancel | None, backend: str = "eager") -> PolicyEvaluation:
    t0 = time.perf_counter()
    tm, acc = _measured(model, policy, texts, prompts, max_new_tokens, cancel, backend)
    same = sum(int((a == b).sum()) for a, b in zip(tm.argmax, clean_argmax, strict=True))
    positions = sum(len(a) for a in clean_argmax)
    memory = kv_memory(policy, n_tokens, model.d_head, dtype_bytes(model), model.facts.windows)
    return PolicyEvaluation(policy, memory, tm.loss, same / positions if positions else math.nan, acc,
                            time.perf_counter() - t0, len(prompts))


def _checked_choices(rankings: Sequence[str], fractions: Sequence[float], texts: Sequence[Sequence[int]],
                     prompts: Sequence[NiahPrompt], sink_size: int, recent_size: int
                     ) -> tuple[list[str], list[float], list[list[int]]]:
    """:func:`evaluate_policies`' rankings (unique, in order), fractions (sorted) and texts (int lists),
    checked before any work; an ``InputError`` that says what to change otherwise."""
    rankings = list(dict.fromkeys(rankings))
    if not rankings:
        raise InputError("Choose at least one ranking.")
    for name in rankings:
        if name not in RANKINGS:
            raise InputError(f"Unknown ranking {name!r}: choose from {', '.join(RANKINGS)}.")
    fractions = sorted({float(f) for f in fractions})
    if not fractions or fractions[0] < 0 or fractions[-1] > 1:
        raise InputError(f"Give fractions of KV groups kept full between 0 and 1; got {fractions}.")
    texts = [[int(t) for t in ids] for ids in texts]
    if not texts and not prompts:
        raise InputError("Give a text (for loss and agreement) or needle-in-a-haystack prompts to evaluate on.")
    if any(len(ids) < 2 for ids in texts):
        raise InputError("Each text needs at least two tokens to have a loss.")
    if sink_size < 0 or recent_size < 1:
        raise InputError(f"A streaming group needs S >= 0 sinks and W >= 1 recent tokens; got S={sink_size}, "
                         f"W={recent_size}.")
    return rankings, fractions, texts


def _evaluation_backend(model: LoadedModel, backend: str, n_tokens: int, prompts: Sequence[NiahPrompt],
                        sink_size: int, max_new_tokens: int) -> str:
    """The backend :func:`evaluate_policies` runs on: :func:`choose_backend`'s, or statistics mode where
    ``auto`` chose eager and the eager decode cannot hold the prompts' streaming window."""
    n_decoded = max([p.n_tokens for p in prompts], default=0) + max_new_tokens if prompts else 0
    wanted = backend
    backend = choose_backend(model, backend, max(n_tokens, n_decoded))
    if backend == "eager" and prompts:
        try:
            check_eager_decode(model, sink_size, n_decoded)
        except InputError:
            if wanted != "auto" or not statistics_supported(model):
                raise
            backend = "statistics"
    return backend


def _policies(model: LoadedModel, rankings: Sequence[str], fractions: Sequence[float], seeds: Sequence[int],
              scores: Mapping[str, np.ndarray] | None, sink_size: int, recent_size: int) -> list[Policy]:
    """Every (ranking, fraction[, seed]) policy to evaluate, in order: a fixed-fraction ranking once, a
    seeded one once per seed."""
    policies: list[Policy] = []
    for name in rankings:
        r = RANKINGS[name]
        for f in ([r.fixed_fraction] if r.fixed_fraction is not None else fractions):
            for seed in (seeds if r.seeded else [0]):
                policies.append(build_policy(model, name, f, scores, seed=seed, sink_size=sink_size,
                                             recent_size=recent_size))
    return policies


def _evaluated_in_turn(evaluate: Callable[[Policy], PolicyEvaluation], baseline_policy: Policy,
                       policies: Sequence[Policy], progress: Progress | None, cancel: Cancel | None
                       ) -> tuple[PolicyEvaluation, list[PolicyEvaluation], bool]:
    """The baseline, then each policy in turn, with progress: ``(baseline, evaluations, complete)``. A
    cancel (asked between policies, or raised inside one) keeps what finished, unless the baseline itself
    did not finish."""
    evaluations: list[PolicyEvaluation] = []
    complete = True
    baseline = None
    try:
        baseline = evaluate(baseline_policy)
        if progress:
            progress(1 / (len(policies) + 1))
        for done, policy in enumerate(policies):
            if cancel_requested(cancel):
                complete = False
                break
            evaluations.append(evaluate(policy))
            if progress:
                progress((done + 2) / (len(policies) + 1))
    except Cancelled:
        if baseline is None:
            raise
        complete = False
    return baseline, evaluations, complete


def evaluate_policies(
    model: LoadedModel,
    scores: Mapping[str, np.ndarray] | None,
    rankings: Sequence[str] = DEFAULT_RANKINGS,
    fractions: Sequence[float] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0),
    *,
    texts: Sequence[Sequence[int]] = (),
    prompts: Sequence[NiahPrompt] = (),
    seeds: Sequence[int] = (0, 1, 2),
    sink_size: int = DEFAULT_SINK_SIZE,
    recent_size: int = DEFAULT_RECENT_SIZE,
    max_new_tokens: int = 24,
    backend: str = "auto",
    baseline_answered: Sequence[bool] | None = None,
    store: Store | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> CompressionCurve:
    """Evaluate every (ranking, fraction[, seed]) policy against the uncompressed model.

    The user action of ``headscope compress`` (and, later, the Compress page and its job): builds
    each policy with :func:`build_policy`, runs it with :func:`policy_hooks` and measures mean loss
    and next-token agreement on ``texts`` and NIAH accuracy on ``prompts`` (module docstring), and
    the KV memory kept for a cache as long as the longest input. ``all_full`` and ``all_streaming``
    are evaluated once each; a policy equal to one already measured is not run again.

    Parameters
    ----------
    scores : per-query-head tables ``[layer, head]`` by name (``retrieval`` and the registry's scores
        that rank KV groups, e.g. ``streaming``) for the rankings that need them.
    rankings : names from :data:`RANKINGS`.
    fractions : shares of KV groups kept full, each in [0, 1].
    texts : token-id lists for loss and agreement (at least one, or ``prompts``).
    prompts : needle-in-a-haystack prompts (e.g. a sweep's, :func:`headscope.analysis.retrieval.trial_prompt`).
    seeds : one random policy per seed and fraction.
    backend : ``eager`` (masked scores, O(n²) memory), ``statistics`` (the kernels' key mask, O(n)),
        ``cache`` (each group's cache as the policy keeps it, :mod:`headscope.analysis.kv_cache`) or
        ``auto`` (statistics mode above ``HEADSCOPE_MAX_TOKENS`` tokens or on CUDA where the model
        supports it); the uncompressed baseline runs on the same backend. Recorded in ``meta``.
    baseline_answered : whether the uncompressed model answered each of ``prompts``, where that is
        measured already (a task suite's answer rates, :func:`headscope.analysis.long_context_tasks.measured_suite`):
        the baseline's NIAH accuracy is their share and the prompts are not decoded uncompressed again
        (its loss and agreement still come from ``texts``); ``meta["baseline_niah"]`` says so. On the
        CPU every backend's uncompressed decoding answers each prompt as the rates' decoding does
        (``tests/analysis/test_long_context_tasks.py``); rates measured on another device are not reused.
    store : each policy's numbers are stored as they finish, under the model, the inputs and the
        policy's mask: a cancelled evaluation run again resumes, other curves reuse shared policies.
    progress, cancel : as every long analysis; a cancel returns what finished (``complete=False``).

    Returns
    -------
    :class:`CompressionCurve`.
    """
    rankings, fractions, texts = _checked_choices(rankings, fractions, texts, prompts, sink_size, recent_size)
    for name in rankings:  # a missing score is reported before any work
        group_priority(model, name, scores, 0)
    n_tokens = max([len(t) for t in texts] + [p.n_tokens for p in prompts])
    backend = _evaluation_backend(model, backend, n_tokens, prompts, sink_size, max_new_tokens)
    seeds = [int(s) for s in seeds] or [0]
    policies = _policies(model, rankings, fractions, seeds, scores, sink_size, recent_size)
    inputs = content_key(texts, [p.token_ids for p in prompts], max_new_tokens)
    full_policy = build_policy(model, "all_full", 1.0, sink_size=sink_size, recent_size=recent_size)

    if baseline_answered is not None:
        if (not isinstance(baseline_answered, Sequence) or isinstance(baseline_answered, str)
                or len(baseline_answered) != len(prompts) or not all(isinstance(x, bool) for x in baseline_answered)):
            raise InputError(f"Give the uncompressed model's outcome (True or False) for each of the {len(prompts)} "
                             "prompts, as a list.")
    clean, _ = _measured(model, None, texts, (), max_new_tokens, cancel, backend)
    memo: dict[str, PolicyEvaluation] = {}

    def evaluate(policy: Policy) -> PolicyEvaluation:
        mk = policy.mask_key()
        if policy is full_policy and baseline_answered is not None:
            # every group full is the uncompressed model: its text metrics are ``clean``'s, already measured
            share = sum(baseline_answered) / len(prompts) if prompts else math.nan
            memory = kv_memory(policy, n_tokens, model.d_head, dtype_bytes(model), model.facts.windows)
            agreement = 1.0 if any(len(a) for a in clean.argmax) else math.nan
            memo[mk] = PolicyEvaluation(policy, memory, clean.loss, agreement, share, 0.0, len(prompts))
            return memo[mk]
        if mk in memo:
            e = memo[mk]
            return PolicyEvaluation(policy, e.memory, e.loss, e.agreement, e.niah_accuracy, 0.0, e.niah_n)
        # an eager evaluation's key names no backend (the key results stored before backends existed
        # have, so they are found); the kernel's rounding differs slightly, so it is keyed apart
        key = content_key("kv_policy_eval", KV_COMPRESSION_VERSION, model.digest, inputs, mk,
                          *([backend] if backend != "eager" else []))
        record = stored_record(store, key, "kv_policy_eval") if store is not None else None
        if record is not None:
            m = record.meta
            e = PolicyEvaluation(policy, kv_memory(policy, n_tokens, model.d_head, dtype_bytes(model),
                                                   model.facts.windows),
                                 float(m["loss"]), float(m["agreement"]), float(m["niah_accuracy"]), 0.0,
                                 len(prompts))  # the key names the prompts, so n is theirs
        else:
            e = _evaluate_one(model, policy, texts, prompts, clean.argmax, n_tokens, max_new_tokens, cancel, backend)
            if store is not None:
                store.put(key, "kv_policy_eval", {"loss": e.loss, "agreement": e.agreement,
                                                  "niah_accuracy": e.niah_accuracy, "seconds": e.seconds}, {})
        memo[mk] = e
        return e

    baseline, evaluations, complete = _evaluated_in_turn(evaluate, full_policy, policies, progress, cancel)
    meta = {"model_name": model.name, "model_digest": model.digest, "rankings": rankings, "fractions": fractions,
            "seeds": seeds, "n_tokens": n_tokens, "dtype_bytes": dtype_bytes(model), "backend": backend,
            "max_new_tokens": max_new_tokens,
            "baseline_niah": "answer rates" if baseline_answered is not None else "decoded",
            "layout": {"n_layers": model.n_layers, "n_kv_heads": model.n_kv_heads, "d_head": model.d_head},
            "priorities": group_priorities(model, rankings, seeds, scores), "version": KV_COMPRESSION_VERSION}
    return CompressionCurve(evaluations, baseline, sink_size, recent_size, len(texts), len(prompts), complete, meta)

"""Head ablation: remove what chosen attention heads contribute and measure what breaks.

Every method says exactly which activation it replaces. Notation: ``A = A[l, h]`` the post-softmax
attention of query head h in layer l (``hook_pattern``, ``[batch, head, query, key]``),
``v_j`` the value vector of key j for the key-value head that h reads (``h // (H / H_kv)``), and

    z[l, h]_i = Σ_j A[l, h][i, j] · v_j          (``hook_z``, ``[batch, pos, head, d_head]``)

the head's output *before* the output projection; the attention layer adds ``Σ_h z[l, h] W_O[h]``
to the residual stream. Methods acting on ``z`` replace that head's share of the sum; methods acting
on ``A`` change how the head mixes values but keep its values and its output projection.
Nothing is ever zeroed after the output projection.

==============  ==========  =========================================================================
method          acts on     replacement
==============  ==========  =========================================================================
``zero``        ``hook_z``  ``z[l, h]_i ← 0`` at every position i (Olsson et al. 2022; Wang et al.
                            2022 discuss why this leaves the model off its distribution)
``mean``        ``hook_z``  ``z[l, h]_i ← z̄[l, h] = (1/N) Σ_runs Σ_i z[l, h]_i`` over every position
                            of a reference set of runs the user chooses (N tokens in all): one
                            position-independent vector per head (Wang et al. 2022, "Interpretability
                            in the Wild", IOI, section 3), computed once and stored
                            (:func:`head_means`)
``resample``    ``hook_z``  ``z[l, h]_i ← z'[l, h]_{min(i, n' − 1)}`` from a clean run of another input
                            of n' tokens, position-aligned (Chan et al. 2022, "Causal Scrubbing";
                            resampling ablation): positions past the source's end take the source's
                            last position; a longer source's extra positions are unused
``uniform``     ``A``       ``A[l, h][i, j] ← 1 / |V_i|`` for j in V_i, else 0, with V_i the keys
                            query i may see (causal: ``V_i = {0..i}``, so ``1/(i+1)``): the masking
                            of Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
                            Factuality" (arXiv:2404.15574), which makes the head an average of values
``first_token`` ``A``       ``A[l, h][i, j] ← [j = 0]``: all attention on key 0, the usual attention
                            sink (Xiao et al. 2023, "StreamingLLM"), so ``z[l, h]_i = v_0``
==============  ==========  =========================================================================

``V_i`` is read from the model's own mask (the entries of ``hook_attn_scores`` that are not masked),
so sliding windows and padding are respected; with the KV cache (generation) query row r is
absolute position ``n_keys − n_queries + r``. Pattern edits are real interventions in the bridge:
its Llama-style attention runs ``hook_pattern`` inside the computation and multiplies the edited
pattern with the values (checked once per model by :func:`check_pattern_seam`; TransformerLens'
post-hoc pattern hooks of other architectures would not propagate and are refused).

Ablations compose: one :class:`AblationSpec` names any set of heads, several specs (different
methods) can be combined, and all of it runs as hooks in a single forward pass.
With grouped-query attention a whole key-value group can be named (``kv:12.1``): it expands to its
query heads. Only the query heads' outputs (or patterns) change; the shared keys and values do not.

This module holds the methods, the head lists, the hooks and the effects of one ablation
(:func:`ablation_effects`). Ablating every head alone is :mod:`headscope.analysis.head_sweep`; the top-k vs
random curve is :mod:`headscope.analysis.ablation_curve`; the names a user chooses from are
:mod:`headscope.analysis.ablation_choices`.
"""

from __future__ import annotations

import math
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.ablation_choices import METHOD_DESCRIPTIONS, METHODS, PATTERN_METHODS
from headscope.analysis.capture import tokenize_input
from headscope.analysis.errors import InputError, check_head, check_head_index, check_layer, shown
from headscope.analysis.limits import limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.retrieval import cancel_requested, stop_ids
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result

ABLATION_VERSION = 1
Head = tuple[int, int]
Hook = tuple[str, Callable[..., Any]]
Progress = Callable[[float], None]
Cancel = Callable[[], bool]
SweepMetric = Callable[[torch.Tensor], torch.Tensor]
"""``logits [batch, pos, vocab] → [batch]`` values; the sweep reports ablated minus clean."""
MetricFn = Callable[[LoadedModel, list[Hook]], float]
"""``metric_fn(model, hooks)``: run the model with ``hooks`` active and return one number."""

#: The limit on an ablated text's tokens (:mod:`headscope.analysis.limits`), read each time a text is checked.
LIMIT = "HEADSCOPE_MAX_ABLATION_TOKENS"


def ablation_ids(model: LoadedModel, text_or_ids: str | Sequence[int]) -> list[int]:
    """Token ids of a text to ablate on (:func:`~headscope.analysis.capture.tokenize_input`), at most
    ``HEADSCOPE_MAX_ABLATION_TOKENS``; a refusal names that variable."""
    return tokenize_input(model, text_or_ids, limit(LIMIT), limited="ablation takes at most", variable=LIMIT)
MAX_NEW_TOKENS = 256


def kv_group_heads(model: LoadedModel, layer: int, group: int | str) -> list[Head]:
    """The query heads of key-value group ``group`` (an int, or a numeral as typed) in ``layer``:
    ``g·G .. g·G + G − 1``, G = H / H_kv."""
    check_layer(model.n_layers, layer)
    try:
        group = check_head(model.n_kv_heads, group)
    except InputError:
        raise InputError(
            f"Key-value group {shown(group)} is out of range: layer {layer} has key-value heads "
            f"0..{model.n_kv_heads - 1}."
        ) from None
    g = model.group_size
    return [(layer, h) for h in range(group * g, (group + 1) * g)]


_HEAD_FORMS = (
    "Write heads as layer.head (12.3) or L12H3, a whole key-value group as kv:12.1 or L12KV1, "
    "a whole layer as 12.* or L12, separated by commas or spaces."
)
# ASCII digits only ("٣" or "３" are digits to int(), not a head a user meant); the numbers are checked,
# however long, by analysis.errors
_DOTTED = re.compile(r"([0-9]+)\.([0-9]+|\*)")
_LETTERED = re.compile(r"l([0-9]+)(?:h([0-9]+))?")
_KV_DOTTED = re.compile(r"kv:([0-9]+)\.([0-9]+)")
_KV_LETTERED = re.compile(r"l([0-9]+)kv([0-9]+)")


def parse_heads(model: LoadedModel, text: str) -> list[Head]:
    """Parse a head list typed by a user into sorted, de-duplicated ``(layer, head)`` pairs.

    Accepted items (case-insensitive, separated by commas, semicolons or whitespace):
    ``12.3`` or ``L12H3`` (query head 3 of layer 12), ``kv:12.1`` or ``L12KV1`` (every query head of
    key-value group 1 of layer 12, see :func:`kv_group_heads`), ``12.*`` or ``L12`` (all of layer 12).
    Layers and heads count from 0.

    Raises
    ------
    InputError
        Empty list, an item that is none of these forms, or a layer, head or group out of range;
        the message names the item and the valid ranges.
    """
    items = [s for s in re.split(r"[,;\s]+", (text or "").strip()) if s]
    if not items:
        raise InputError(f"No heads given. {_HEAD_FORMS}")
    heads: set[Head] = set()
    for item in items:
        s = item.lower()
        if m := _KV_DOTTED.fullmatch(s) or _KV_LETTERED.fullmatch(s):
            heads.update(kv_group_heads(model, check_layer(model.n_layers, m[1]), m[2]))
        elif m := _DOTTED.fullmatch(s) or _LETTERED.fullmatch(s):
            layer = check_layer(model.n_layers, m[1])
            if m[2] is None or m[2] == "*":
                heads.update((layer, h) for h in range(model.n_heads))
            else:
                heads.add(check_head_index(model.n_layers, model.n_heads, layer, m[2]))
        else:
            raise InputError(f"Cannot read {item!r} as a head. {_HEAD_FORMS}")
    return sorted(heads)


def format_heads(heads: Sequence[Head]) -> str:
    """The inverse of :func:`parse_heads` for plain heads: ``"12.3,14.1"``."""
    return ",".join(f"{layer}.{head}" for layer, head in heads)


# ---------------------------------------------------------------------------------------------
# Mean activations


@dataclass
class HeadMeans:
    """Position-independent mean of every head's output ``z`` over a reference set.

    ``mean[l, h] = (1/N) Σ_runs Σ_i z[l, h]_i`` with N the total number of reference tokens (every
    token of every run weighs the same; position 0 included).

    Attributes
    ----------
    key : store key (model digest + reference token ids).
    mean : ``[layer, head, d_head]`` float32.
    """

    key: str
    model_digest: str
    mean: np.ndarray
    n_runs: int
    n_tokens: int

    def meta(self) -> dict[str, Any]:
        return {
            "model_digest": self.model_digest,
            "n_runs": self.n_runs,
            "n_tokens": self.n_tokens,
            "version": ABLATION_VERSION,
        }


def head_means_key(model: LoadedModel, reference_ids: Sequence[Sequence[int]]) -> str:
    return content_key(
        "head_means", ABLATION_VERSION, model.digest, [list(map(int, r)) for r in reference_ids]
    )


def load_head_means(store: Store, key: str) -> HeadMeans | None:
    """Stored head means under ``key`` (see :func:`head_means`), or None."""
    record = stored_record(store, key, "head_means")
    if record is None:
        return None
    m = record.meta
    return HeadMeans(key, m["model_digest"], record.array("mean", mmap=False), m["n_runs"], m["n_tokens"])


def head_means(
    model: LoadedModel,
    reference: Sequence[str | Sequence[int]],
    *,
    store: Store | None = None,
    progress: Progress | None = None,
) -> HeadMeans:
    """Mean of ``hook_z`` per head over the reference runs, for ``mean`` ablation.

    Wang et al. 2022 ("Interpretability in the Wild: a Circuit for Indirect Object Identification in
    GPT-2 small", arXiv:2211.00593) replace a head's output by its mean over a reference
    distribution. Here the mean is over every position of every reference run,

        z̄[l, h] = (1/N) Σ_r Σ_{i < n_r} z_r[l, h]_i,    N = Σ_r n_r,

    accumulated in float64. Stored under (model digest, reference token ids): asking again loads.

    Parameters
    ----------
    reference : texts (tokenised as `tokenize_input` does: a BOS only where the model expects one) or token-id lists; the user's choice of what
        "typical" input means.
    store : when given, a stored mean is loaded, a new one stored.
    """
    if isinstance(reference, str) or not len(reference):
        raise InputError("The reference set for mean ablation is empty: give one or more texts.")
    if any(isinstance(r, int | np.integer) for r in reference):
        raise InputError("The reference set is a list of inputs: wrap a single list of token ids in a list.")
    ids_list = [ablation_ids(model, r) for r in reference]
    key = head_means_key(model, ids_list)
    if (stored := stored_result(store, key, load_head_means, progress)) is not None:
        return stored
    total = torch.zeros((model.n_layers, model.n_heads, model.d_head), dtype=torch.float64)

    def add(layer: int):
        def hook(z: torch.Tensor, hook: Any = None) -> None:
            total[layer] += z[0].to(torch.float64).sum(0)

        return hook

    hooks = [(get_act_name("z", layer), add(layer)) for layer in range(model.n_layers)]
    n_tokens = 0
    for i, ids in enumerate(ids_list):
        with model.lock, torch.inference_mode():
            model.bridge.run_with_hooks(_tensor(model, [ids]), fwd_hooks=hooks, return_type=None)
        n_tokens += len(ids)
        if progress:
            progress((i + 1) / len(ids_list))
    means = HeadMeans(
        key, model.digest, (total / n_tokens).to(torch.float32).numpy(), len(ids_list), n_tokens
    )
    if store is not None:
        store.put(key, "head_means", means.meta(), {"mean": means.mean})
    return means


# ---------------------------------------------------------------------------------------------
# Specs and hooks


@dataclass(frozen=True)
class AblationSpec:
    """Which heads to ablate, how, and what the method needs.

    Attributes
    ----------
    heads : ``(layer, head)`` query heads; normalised to a sorted tuple without repeats. Empty
        means no ablation (the clean model).
    method : one of :data:`METHODS` (see the module docstring for the exact replacement).
    means : required by ``mean``: from :func:`head_means` on the same model.
    source_ids : required by ``resample``: the token ids of the input whose ``z`` is patched in.
    """

    heads: tuple[Head, ...] = ()
    method: str = "zero"
    means: HeadMeans | None = field(default=None, compare=False)
    source_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"Unknown ablation method {self.method!r}: choose one of {', '.join(METHODS)}.")
        try:
            heads = tuple(sorted({(int(layer), int(head)) for layer, head in self.heads}))
        except (TypeError, ValueError):
            raise InputError("heads must be (layer, head) pairs of integers.") from None
        object.__setattr__(self, "heads", heads)
        if self.source_ids is not None:
            object.__setattr__(self, "source_ids", tuple(int(i) for i in self.source_ids))

    def with_heads(self, heads: Sequence[Head]) -> AblationSpec:
        """The same method and options on other heads."""
        return replace(self, heads=tuple(heads))

    def describe(self) -> str:
        heads = format_heads(self.heads) or "no heads"
        return f"{self.method} ablation of {heads}: {METHOD_DESCRIPTIONS[self.method]}"

    def validate(self, model: LoadedModel) -> None:
        """Check the heads and the method's options against ``model``; raise :class:`InputError`."""
        for layer, head in self.heads:
            check_head_index(model.n_layers, model.n_heads, layer, head)
        if self.method == "mean":
            if self.means is None:
                raise InputError("Mean ablation needs a reference set: compute head_means() and pass means=.")
            if self.means.model_digest != model.digest or self.means.mean.shape != (
                model.n_layers,
                model.n_heads,
                model.d_head,
            ):
                raise InputError("The head means were computed on another model: compute them for this one.")
        if self.method == "resample":
            if not self.source_ids:
                raise InputError(
                    "Resample ablation needs a source input: pass source_ids (a different text)."
                )
            bad = [i for i in self.source_ids if not 0 <= i < model.vocab_size]
            if bad:
                raise InputError(
                    f"Source token ids outside the vocabulary (0..{model.vocab_size - 1}): {bad[:5]}"
                )
        if self.method in PATTERN_METHODS and self.heads:
            check_pattern_seam(model)


def _tensor(model: LoadedModel, ids: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor([list(r) for r in ids], dtype=torch.long, device=model.device)


_seam_ok: weakref.WeakKeyDictionary[LoadedModel, bool] = weakref.WeakKeyDictionary()


def check_pattern_seam(model: LoadedModel) -> None:
    """Check once per model that editing ``hook_pattern`` changes the attention output.

    On three tokens, sets every head of layer 0 to attend only to key 0 and checks that
    ``z[0, h]_2 = v_0`` of the head's key-value group, i.e. the edited pattern really multiplies
    the values. Raises :class:`InputError` for architectures whose bridge fires the pattern hook
    after the fact (the edit would silently change nothing).
    """
    if _seam_ok.get(model):
        return
    got: dict[str, torch.Tensor] = {}

    def onto_first(pattern: torch.Tensor, hook: Any = None) -> torch.Tensor:
        out = torch.zeros_like(pattern)
        out[..., 0] = 1
        return out

    def keep(name: str):
        def hook(t: torch.Tensor, hook: Any = None) -> None:
            got[name] = t.detach().clone()

        return hook

    hooks = [
        (get_act_name("attn_scores", 0), keep("scores")),
        (get_act_name("pattern", 0), onto_first),
        (get_act_name("v", 0), keep("v")),
        (get_act_name("z", 0), keep("z")),
    ]
    ids = [[min(i, model.vocab_size - 1) for i in (1, 2, 3)]]
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(_tensor(model, ids), fwd_hooks=hooks, return_type=None)
    ok = all(name in got for name in ("scores", "v", "z"))
    if ok:
        v0 = got["v"][0, 0]  # [kv_head, d_head]
        expected = v0[[model.kv_head(h) for h in range(model.n_heads)]]
        ok = torch.allclose(got["z"][0, -1], expected, atol=1e-5, rtol=1e-4)
    if not ok:
        raise InputError(
            f"Pattern ablations (uniform, first_token) do not work on {model.architecture}: its bridge "
            "reports attention patterns after computing the output, so editing them changes nothing. "
            "Use zero, mean or resample ablation."
        )
    _seam_ok[model] = True


_SOURCE_CACHE: OrderedDict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = OrderedDict()
_SOURCE_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _SOURCE_LOCK
    _SOURCE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def source_z(model: LoadedModel, source_ids: Sequence[int]) -> list[torch.Tensor]:
    """``z`` of every layer on a clean run of ``source_ids``: layer → ``[pos, head, d_head]``.

    The last four sources are kept in memory, so a curve or sweep runs the source once.
    """
    key = (model.digest, tuple(int(i) for i in source_ids))
    with _SOURCE_LOCK:
        if key in _SOURCE_CACHE:
            _SOURCE_CACHE.move_to_end(key)
            return _SOURCE_CACHE[key]
    zs: list[torch.Tensor | None] = [None] * model.n_layers

    def keep(layer: int):
        def hook(z: torch.Tensor, hook: Any = None) -> None:
            zs[layer] = z[0].detach().clone()

        return hook

    hooks = [(get_act_name("z", layer), keep(layer)) for layer in range(model.n_layers)]
    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(_tensor(model, [key[1]]), fwd_hooks=hooks, return_type=None)
    out = [z for z in zs if z is not None]
    with _SOURCE_LOCK:
        _SOURCE_CACHE[key] = out
        while len(_SOURCE_CACHE) > 4:
            _SOURCE_CACHE.popitem(last=False)
    return out


# A masked score is the dtype's minimum (or -inf): anything below half of it is masked.
def _visible(scores: torch.Tensor) -> torch.Tensor:
    return scores > torch.finfo(scores.dtype).min / 2


def _pairs(rows: torch.Tensor | None, heads: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, head) pairs: explicit rows, or every batch element for every head."""
    if rows is not None:
        return rows, heads
    return torch.arange(batch, device=heads.device).repeat_interleave(len(heads)), heads.repeat(batch)


def _layer_hooks(
    model: LoadedModel,
    spec: AblationSpec,
    layer: int,
    heads: list[int],
    rows: list[int] | None,
) -> list[Hook]:
    """Hooks that ablate ``heads`` of ``layer`` with ``spec.method``.

    ``rows`` (one batch index per entry of ``heads``) makes batch element ``rows[k]`` ablate head
    ``heads[k]`` only; ``None`` ablates every head in every batch element.
    """
    device = model.device
    hs = torch.tensor(heads, dtype=torch.long, device=device)
    bs = None if rows is None else torch.tensor(rows, dtype=torch.long, device=device)
    state: dict[str, Any] = {"offset": 0}
    hooks: list[Hook] = []
    method = spec.method

    if method in ("uniform", "resample"):
        # hook_attn_scores fires just before hook_pattern and z in the same layer call: it gives the
        # model's own mask and, with the KV cache, the absolute position of the first query row.
        def read_scores(scores: torch.Tensor, hook: Any = None) -> None:
            state["offset"] = scores.shape[-1] - scores.shape[-2]
            if method == "uniform":
                b, h = _pairs(bs, hs, scores.shape[0])
                state["visible"] = _visible(scores[b, h])

        hooks.append((get_act_name("attn_scores", layer), read_scores))

    if method in PATTERN_METHODS:

        def edit_pattern(pattern: torch.Tensor, hook: Any = None) -> torch.Tensor:
            b, h = _pairs(bs, hs, pattern.shape[0])
            pattern = pattern.clone()
            if method == "uniform":
                vis = state.pop("visible").to(pattern.dtype)
                pattern[b, h] = vis / vis.sum(-1, keepdim=True).clamp_min(1)
            else:
                onehot = torch.zeros(pattern.shape[-2:], dtype=pattern.dtype, device=pattern.device)
                onehot[:, 0] = 1
                pattern[b, h] = onehot
            return pattern

        hooks.append((get_act_name("pattern", layer), edit_pattern))
        return hooks

    if method == "mean":
        assert spec.means is not None
        mean_l = torch.as_tensor(np.asarray(spec.means.mean[layer]), device=device)  # [head, d_head]
    elif method == "resample":
        assert spec.source_ids is not None
        src_l = source_z(model, spec.source_ids)[layer]  # [pos', head, d_head]

    def edit_z(z: torch.Tensor, hook: Any = None) -> torch.Tensor:
        # z: [batch, pos, head, d_head]; z[b, :, h] is [n_pairs, pos, d_head]
        b, h = _pairs(bs, hs, z.shape[0])
        z = z.clone()
        if method == "zero":
            z[b, :, h] = 0
        elif method == "mean":
            z[b, :, h] = mean_l[h].to(z.dtype)[:, None, :]
        else:
            pos = torch.arange(z.shape[1], device=z.device) + state["offset"]
            pos = pos.clamp(max=src_l.shape[0] - 1)
            z[b, :, h] = src_l[pos][:, h].to(z.dtype).transpose(0, 1)
        return z

    hooks.append((get_act_name("z", layer), edit_z))
    return hooks


def ablation_hooks(model: LoadedModel, specs: AblationSpec | Sequence[AblationSpec]) -> list[Hook]:
    """Forward hooks for ``bridge.run_with_hooks`` / ``bridge.hooks`` that apply ``specs`` together.

    All heads of all specs are ablated in the same forward pass (and at every step of a generation,
    when used with :func:`greedy_continuation`). No spec, or specs without heads, give ``[]``: the
    clean model. Specs are validated here (:meth:`AblationSpec.validate`).
    """
    if isinstance(specs, AblationSpec):
        specs = [specs]
    hooks: list[Hook] = []
    for spec in specs:
        spec.validate(model)
        by_layer: dict[int, list[int]] = {}
        for layer, head in spec.heads:
            by_layer.setdefault(layer, []).append(head)
        for layer, heads in sorted(by_layer.items()):
            hooks += _layer_hooks(model, spec, layer, heads, None)
    return hooks


def _spec_template(method: str | AblationSpec) -> AblationSpec:
    return method if isinstance(method, AblationSpec) else AblationSpec((), method)


# ---------------------------------------------------------------------------------------------
# Effects on one input


def _logits(model: LoadedModel, ids: Sequence[int], hooks: list[Hook]) -> torch.Tensor:
    with model.lock, torch.inference_mode():
        logits = model.bridge.run_with_hooks(_tensor(model, [ids]), fwd_hooks=hooks, return_type="logits")
    return logits[0].float()


def _token_loss(logprobs: torch.Tensor, ids: Sequence[int]) -> np.ndarray:
    """``loss[i] = −log p(ids[i] | ids[:i])``, nan at position 0 (nothing predicts it)."""
    loss = np.full(len(ids), np.nan, dtype=np.float32)
    if len(ids) > 1:
        target = torch.tensor(ids[1:], dtype=torch.long, device=logprobs.device)
        loss[1:] = (-logprobs[:-1].gather(1, target[:, None])[:, 0]).cpu().numpy()
    return loss


def greedy_continuation(
    model: LoadedModel,
    ids: Sequence[int],
    hooks: Sequence[Hook] = (),
    max_new_tokens: int = 20,
    *,
    stop_at_eos: bool = True,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> list[int]:
    """Greedy continuation of ``ids`` with ``hooks`` active during the prefill and every step.

    Uses the bridge's KV cache (``return_type="logits_and_cache"``): the prompt is run once, then
    one token per step; pattern hooks see ``[batch, head, 1, n_keys]`` rows, which the ablation
    hooks handle (see the module docstring). Stops after an EOS token (kept) when ``stop_at_eos``,
    and early, returning what was generated, when ``cancel()`` is true.
    """
    if not ids:
        raise InputError("The prompt is empty.")
    if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be between 0 and {MAX_NEW_TOKENS}.")
    if len(ids) + max_new_tokens > model.n_ctx:
        raise InputError(
            f"The prompt and continuation would pass the model's context of {model.n_ctx:,} tokens."
        )
    stops = stop_ids(model) if stop_at_eos else set()
    bridge = model.bridge
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    with model.lock, torch.inference_mode(), bridge.hooks(fwd_hooks=list(hooks)):
        # the last position's logits only: a [n, vocab] array is gigabytes with Gemma 3's vocabulary
        logits, past = bridge(_tensor(model, [ids]), return_type="logits_and_cache", use_cache=True,
                              logits_to_keep=1)
        for step in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if progress:
                progress(len(out) / max_new_tokens)
            if token in stops or step == max_new_tokens - 1 or cancel_requested(cancel):
                break
            logits, past = bridge(
                _tensor(model, [[token]]), return_type="logits_and_cache", past_key_values=past
            )
    return out


@dataclass
class AblationEffects:
    """What ablating ``specs`` (together) changes on one input (``clean`` = no ablation).

    Attributes
    ----------
    loss_clean, loss_ablated, loss_diff : ``[pos]`` per-token loss ``−log p(t_i | t_<i)`` (nan at 0)
        and ablated − clean.
    top_ids_*, top_probs_* : ``[pos, k]`` the k most likely next tokens after each position.
    target_* : for the next-token distribution at ``target_position`` (predicting position
        ``target_position + 1``), the logit and probability of ``target_token``; None without a target.
    continuation_* : greedy continuations (token ids), empty when ``max_new_tokens`` is 0.
    """

    specs: list[AblationSpec]
    token_ids: list[int]
    loss_clean: np.ndarray
    loss_ablated: np.ndarray
    top_ids_clean: np.ndarray
    top_probs_clean: np.ndarray
    top_ids_ablated: np.ndarray
    top_probs_ablated: np.ndarray
    target_position: int | None = None
    target_token: int | None = None
    target_logit_clean: float | None = None
    target_logit_ablated: float | None = None
    target_prob_clean: float | None = None
    target_prob_ablated: float | None = None
    continuation_clean: list[int] = field(default_factory=list)
    continuation_ablated: list[int] = field(default_factory=list)

    @property
    def loss_diff(self) -> np.ndarray:
        return self.loss_ablated - self.loss_clean

    @property
    def mean_loss_clean(self) -> float:
        return float(np.nanmean(self.loss_clean)) if len(self.loss_clean) > 1 else math.nan

    @property
    def mean_loss_ablated(self) -> float:
        return float(np.nanmean(self.loss_ablated)) if len(self.loss_ablated) > 1 else math.nan


def ablation_effects(
    model: LoadedModel,
    text_or_ids: str | Sequence[int],
    specs: AblationSpec | Sequence[AblationSpec],
    *,
    target_position: int | None = None,
    target_token: int | None = None,
    top_k: int = 5,
    max_new_tokens: int = 0,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> AblationEffects:
    """Per-token loss, a target token's logit and probability, top-k and greedy continuation,
    before and after ablating ``specs`` (all at once) on one input.

    Parameters
    ----------
    text_or_ids : the input, tokenised as `tokenize_input` does (a BOS only where the model expects one), or exact token ids.
    target_position, target_token : read ``logit`` and ``p = softmax(logits)`` of ``target_token``
        in the prediction made at ``target_position`` (negative counts from the end).
    max_new_tokens : length of the greedy continuations (0: none), generated with the ablation
        active at every step.
    """
    ids = ablation_ids(model, text_or_ids)
    spec_list = [specs] if isinstance(specs, AblationSpec) else list(specs)
    hooks = ablation_hooks(model, spec_list)
    if not 1 <= top_k <= model.vocab_size:
        raise InputError(f"top_k must be between 1 and {model.vocab_size}.")
    if (target_position is None) != (target_token is None):
        raise InputError("Give both a target position and a target token, or neither.")
    if target_position is not None:
        if not -len(ids) <= target_position < len(ids):
            raise InputError(
                f"Target position {target_position} is outside the input (positions 0..{len(ids) - 1})."
            )
        target_position %= len(ids)
        if not 0 <= int(target_token) < model.vocab_size:
            raise InputError(
                f"Target token id {target_token} is outside the vocabulary (0..{model.vocab_size - 1})."
            )
    steps = 2 + 2 * (max_new_tokens > 0)
    results = {}
    for i, (name, h) in enumerate((("clean", []), ("ablated", hooks))):
        logprobs = torch.log_softmax(logits := _logits(model, ids, h), dim=-1)
        top = torch.topk(logprobs, k=top_k, dim=-1)
        results[name] = {
            "loss": _token_loss(logprobs, ids),
            "top_ids": top.indices.cpu().numpy().astype(np.int64),
            "top_probs": top.values.exp().cpu().numpy().astype(np.float32),
        }
        if target_position is not None:
            results[name]["logit"] = float(logits[target_position, target_token])
            results[name]["prob"] = float(logprobs[target_position, target_token].exp())
        if progress:
            progress((i + 1) / steps)
    effects = AblationEffects(
        specs=spec_list,
        token_ids=ids,
        loss_clean=results["clean"]["loss"],
        loss_ablated=results["ablated"]["loss"],
        top_ids_clean=results["clean"]["top_ids"],
        top_probs_clean=results["clean"]["top_probs"],
        top_ids_ablated=results["ablated"]["top_ids"],
        top_probs_ablated=results["ablated"]["top_probs"],
    )
    if target_position is not None:
        effects.target_position = target_position
        effects.target_token = int(target_token)
        effects.target_logit_clean = results["clean"]["logit"]
        effects.target_logit_ablated = results["ablated"]["logit"]
        effects.target_prob_clean = results["clean"]["prob"]
        effects.target_prob_ablated = results["ablated"]["prob"]
    if max_new_tokens > 0 and not cancel_requested(cancel):
        effects.continuation_clean = greedy_continuation(model, ids, [], max_new_tokens, cancel=cancel)
        if progress:
            progress(3 / steps)
        effects.continuation_ablated = greedy_continuation(model, ids, hooks, max_new_tokens, cancel=cancel)
        if progress:
            progress(1.0)
    return effects


# ---------------------------------------------------------------------------------------------
# Metrics


def loss_metric(ids: Sequence[int]) -> SweepMetric:
    """Mean next-token loss ``(1/(n−1)) Σ_{i≥1} −log p(t_i | t_<i)`` per batch element."""
    target = torch.tensor(list(ids[1:]), dtype=torch.long)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        t = target.to(lp.device)
        return -lp.gather(-1, t.expand(lp.shape[0], -1)[..., None])[..., 0].mean(-1)

    return metric


def kl_metric(clean_logits: torch.Tensor) -> SweepMetric:
    """Mean over positions of ``KL(p_clean ‖ p_ablated)`` per batch element (0 for the clean run)."""
    clean_lp = torch.log_softmax(clean_logits.float(), dim=-1)  # [pos, vocab]
    clean_p = clean_lp.exp()

    def metric(logits: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits.float(), dim=-1)
        return (clean_p * (clean_lp - lp)).sum(-1).mean(-1)

    return metric


def loss_metric_fn(text_or_ids: str | Sequence[int], model: LoadedModel) -> MetricFn:
    """A ``metric_fn(model, hooks)`` for :func:`headscope.analysis.ablation_curve.topk_curve`: mean next-token loss on one input."""
    ids = ablation_ids(model, text_or_ids)
    if len(ids) < 2:
        raise InputError("The loss needs at least two tokens.")
    metric = loss_metric(ids)

    def metric_fn(m: LoadedModel, hooks: list[Hook]) -> float:
        with m.lock, torch.inference_mode():
            logits = m.bridge.run_with_hooks(_tensor(m, [ids]), fwd_hooks=hooks, return_type="logits")
        return float(metric(logits)[0])

    return metric_fn

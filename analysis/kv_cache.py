"""A KV cache that keeps what a compression policy says, and no more: the ``cache`` backend.

The ``eager`` and ``statistics`` backends of :func:`headscope.analysis.kv_compression.evaluate_policies`
apply a policy as a mask over a cache as large as ever, so the memory they report is accounting. Here
each (layer, KV group) physically keeps the cache its :class:`~headscope.analysis.kv_compression.Policy`
says, as DuoAttention's decoding does (Xiao et al. 2024, arXiv:2410.10819, §3.3: retrieval heads keep
the full cache, streaming heads "a constant-length" one of attention sinks and recent tokens):

- a full group keeps every key and value (on a layer with the model's own sliding window of W_m keys,
  the last W_m, as transformers' ``DynamicSlidingWindowLayer`` does);
- a streaming group keeps its first S keys (the sinks) and the last W (intersected with W_m), and
  forgets the rest after each pass. Positions stay those the model saw (RoPE was applied before the
  cache), as in the masking backends.

A query at position p of a streaming group sees key j iff ``j ≤ p`` and ``(j < S or j > p − W)``
(and ``j > p − W_m`` on a window layer): :func:`headscope.analysis.kv_compression.streaming_key_mask`'s
visible keys, which is why this backend produces the masking backends' tokens and losses. Between
passes a streaming group holds ``min(n, S + W)`` keys in storage of exactly that size; a full group
holds its n keys in buffers that grow :data:`HEADROOM` tokens at a time, so a decode step writes in
place instead of copying the cache. The bytes kept are those
:func:`headscope.analysis.kv_compression.kv_memory` counts (:meth:`PolicyCache.kept_bytes`); the bytes
allocated (:meth:`PolicyCache.nbytes`, the storages' sizes) add at most the headroom per layer.

Prompts run in chunks of ``chunk`` tokens (DuoAttention's chunked pre-filling, §3.3): a chunk's
queries read the cache as it stands plus the chunk itself, so a streaming group's window never needs
keys it has already forgotten, and no pass builds more than a ``chunk × (kept keys)`` score block.
Each kind of group attends with PyTorch's SDPA (grouped-query, a boolean mask from the kept keys'
positions; none where every kept key is visible, as in a full group's decode step); a layer that
soft-caps its scores (Gemma 2) has them written out.

The passes run on the Hugging Face modules under the bridge (:func:`headscope.analysis.bare_model.bare_twin`)
with :data:`ATTENTION` as the attention implementation and a :class:`PolicyCache` as transformers'
``past_key_values``: the cache's ``update`` stores the new keys and values, the attention function
reads them back by layer. Hooks on the bridge do not fire here; :func:`check_cache_backend` refuses a
model with hooks attached or outside statistics mode's families.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from headscope.analysis.attention_statistics import LayerMask, layer_mask, statistics_supported
from headscope.analysis.bare_model import bare_supported, bare_twin
from headscope.analysis.errors import InputError
from headscope.analysis.greedy_decoding import Cancelled, cancel_requested, stop_ids

ATTENTION = "headscope_policy_cache"
"""The twin's attention implementation in transformers' ``AttentionInterface`` (no mask function is
registered under it, so Hugging Face builds no mask: :func:`_attention` masks by positions)."""

DEFAULT_CHUNK = 512
"""Tokens per pre-filling pass: bounds the transient score block, not the result."""

HEADROOM = 256
"""Tokens a full part's buffers grow by at a time: at most this many tokens per layer allocated and not
yet used, against a copy of the whole cache per decode step."""

_state = threading.local()  # .updated: the PolicyLayer whose update ran last in this thread (its attention follows)


class _Part:
    """The keys and values of one layer's groups of one kind (full or streaming), their positions,
    and which positions a later query can still see.

    A part without a window (full groups on a layer without the model's own window) grows its buffers
    :data:`HEADROOM` tokens at a time and writes each pass into them, so a decode step copies nothing
    (a copy of the whole cache per step, as transformers' ``DynamicCache`` makes, would dominate a
    long decode); a windowed part (a streaming part, or a full part on a layer with the model's own
    window) is cut to what it keeps after a pass, into new storage, and once it holds its S + W keys each
    decoded token takes the slot of a key no later query sees (:meth:`_overwrite_stale`): from then on a
    decode step writes in place (a sink that leaves the model's own window is still cut away)."""

    def __init__(self, groups: list[int], streaming: bool, sink: int, window: int, model_window: int = 0) -> None:
        # window 0: every key (a full group on a layer without the model's own window); a sink past the
        # model's own window (model_window > 0) is seen by no later query, so it is forgotten too
        self.groups, self.streaming, self.sink, self.window = groups, streaming, sink, window
        self.model_window = model_window
        self.reserved = 0  # keys a coming prefill will hold (reserve)
        self._keys: Tensor | None = None  # [b, groups, capacity, d]; the first n tokens are kept
        self._values: Tensor | None = None
        self._positions: Tensor | None = None
        self.n = 0
        self._written_at = -1  # the position the last in-place write left nothing stale at

    @property
    def keys(self) -> Tensor | None:
        return None if self._keys is None else self._keys[:, :, :self.n]

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values[:, :, :self.n]

    @property
    def positions(self) -> Tensor | None:
        return None if self._positions is None else self._positions[:self.n]

    def append(self, k: Tensor, v: Tensor, positions: Tensor, first: int) -> None:
        """The pass's keys and values (``positions`` = ``first``, ``first`` + 1, …) into the part."""
        if len(self.groups) < k.shape[1]:
            idx = torch.tensor(self.groups, device=k.device)
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        m = k.shape[2]
        if m == 1 and self.window and self.n and self._overwrite_stale(k, v, positions, first):
            return
        if self._keys is None or self.n + m > self._keys.shape[2]:
            capacity = self.n + m if self.window else max(self.n + m, self.reserved) + HEADROOM
            self._keys = self._grown(self._keys, k, capacity)
            self._values = self._grown(self._values, v, capacity)
            grown = positions.new_empty(capacity)
            if self.n:
                grown[:self.n] = self._positions[:self.n]
            self._positions = grown
        self._keys[:, :, self.n:self.n + m] = k
        self._values[:, :, self.n:self.n + m] = v
        self._positions[self.n:self.n + m] = positions
        self.n += m

    def _stale(self, last: int) -> Tensor:
        """Which kept keys no query at position ``last`` or after can see (what :meth:`forget` drops)."""
        sinks = self.positions < self.sink
        if self.model_window:
            sinks &= self.positions > last - self.model_window
        return ~(sinks | (self.positions > last - self.window))

    def _overwrite_stale(self, k: Tensor, v: Tensor, positions: Tensor, p: int) -> bool:
        """The token decoded at position ``p`` into the slot of a key that neither it nor any later query
        sees, in place (a ring), instead of a copy into a longer buffer and another into a shorter one per
        step. The slots are not kept in position order, which nothing reads: visibility is decided
        by each slot's position (:func:`_visible`). False (nothing written) while no kept key is stale.
        One device sync (the stale slots' indices); without the model's own window nothing else can go
        stale at ``p``, so :meth:`forget` then has nothing to look at."""
        stale = self._stale(p).nonzero()
        if not stale.numel():
            return False
        slot = int(stale[0, 0])
        self._keys[:, :, slot] = k[:, :, 0]
        self._values[:, :, slot] = v[:, :, 0]
        self._positions[slot] = positions[0]
        self._written_at = p if not self.model_window and stale.shape[0] == 1 else -1
        return True

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more keys in a part without a window, allocated at its next growth (a
        prompt's prefill then allocates once, not once per chunk)."""
        self.reserved = max(self.reserved, self.n + tokens)

    def _grown(self, old: Tensor | None, new: Tensor, capacity: int) -> Tensor:
        out = new.new_empty(*new.shape[:2], capacity, new.shape[3])
        if old is not None and self.n:
            out[:, :, :self.n] = old[:, :, :self.n]
        return out

    def forget(self, last: int) -> None:
        """Keep the keys a query after position ``last`` may see, plus the key at ``last − W + 1``
        (the cache holds S + W keys between passes, as DuoAttention's does): j < S or j > last − W, and a
        sink only while it is inside the model's own window (j > last − W_m)."""
        if self._keys is None or not self.window or self._written_at == last:
            return
        keep = ~self._stale(last)
        if bool(keep.all()) and self.n == self._keys.shape[2]:
            return
        idx = keep.nonzero().reshape(-1)
        # index_select copies into new storage: the forgotten keys' memory is freed, not kept under a view
        self._keys = self._keys.index_select(2, idx)
        self._values = self._values.index_select(2, idx)
        self._positions = self._positions.index_select(0, idx)
        self.n = int(idx.numel())

    def nbytes(self) -> int:
        """Bytes the part's key and value buffers allocate (with a full part's headroom)."""
        return sum(t.untyped_storage().nbytes() for t in (self._keys, self._values) if t is not None)

    def kept_bytes(self) -> int:
        """Bytes of the keys and values kept: what :func:`headscope.analysis.kv_compression.kv_memory` counts."""
        if self._keys is None:
            return 0
        return self.n * sum(t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() for t in (self._keys, self._values))


class PolicyLayer(CacheLayerMixin):
    """One layer's cache under a policy: its full groups and its streaming groups kept apart."""

    is_sliding = False

    def __init__(self, full: Sequence[bool], sink: int, recent: int, mask: LayerMask, index: int = 0) -> None:
        super().__init__()
        self.mask, self.index = mask, index
        model_window = mask.window
        stream_window = min(recent, model_window) if model_window else recent
        self.parts = [p for p in (_Part([g for g, f in enumerate(full) if f], False, 0, model_window),
                                  _Part([g for g, f in enumerate(full) if not f], True, sink, stream_window,
                                        model_window))
                      if p.groups]
        self.n_groups = len(full)
        self.seen = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        n = key_states.shape[2]
        positions = torch.arange(self.seen, self.seen + n, device=key_states.device)
        for part in self.parts:
            part.append(key_states, value_states, positions, self.seen)
        self.seen += n
        self.is_initialized = True
        _state.updated = self  # the attention call that follows in this module reads this layer
        return key_states, value_states

    def forget(self) -> None:
        """After a pass: a streaming part keeps its sinks and last W keys, a full part on a window layer
        its last W_m, any other full part everything."""
        for part in self.parts:
            part.forget(self.seen - 1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def kept_bytes(self) -> int:
        return sum(p.kept_bytes() for p in self.parts)

    def reserve(self, tokens: int) -> None:
        for part in self.parts:
            part.reserve(tokens)


class PolicyCache(Cache):
    """transformers' ``past_key_values`` for a model under a policy: one :class:`PolicyLayer` per layer."""

    def __init__(self, layers: list[PolicyLayer]) -> None:
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    def nbytes(self) -> int:
        """Bytes the cache's key and value tensors allocate (their storages' sizes, with the full parts'
        headroom of at most :data:`HEADROOM` tokens)."""
        return sum(layer.nbytes() for layer in self.layers)

    def kept_bytes(self) -> int:
        """Bytes of the keys and values kept: :func:`headscope.analysis.kv_compression.kv_memory`'s count."""
        return sum(layer.kept_bytes() for layer in self.layers)

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more keys in every full group, allocated at its next growth."""
        for layer in self.layers:
            layer.reserve(tokens)

    def kept(self) -> np.ndarray:
        """``[layer, kv_head]`` keys each group holds now."""
        out = np.zeros((len(self.layers), self.layers[0].n_groups), dtype=np.int64)
        for i, layer in enumerate(self.layers):
            for part in layer.parts:
                out[i, part.groups] = part.n
        return out


def check_cache_backend(model: Any) -> None:
    """An ``InputError`` unless ``model`` can run the cache backend: a family statistics mode supports
    and no hook attached to the bridge (the passes run on the modules under it, where hooks do not fire)."""
    if not statistics_supported(model):
        raise InputError(f"The cache backend does not run {getattr(model, 'architecture', 'this model')}: it needs "
                         "an architecture statistics mode supports. Use the eager backend.")
    if not bare_supported(model):
        raise InputError("The cache backend runs the model without the bridge's hooks, and hooks are attached "
                         "(an ablation or a capture): remove them, or use the eager or statistics backend.")


def new_cache(model: Any, full: np.ndarray, sink_size: int, recent_size: int) -> PolicyCache:
    """An empty :class:`PolicyCache` for ``full`` (``[layer, kv_head]``, True = full) with S and W."""
    full = np.asarray(full, dtype=bool)
    if full.shape != (model.n_layers, model.n_kv_heads):
        raise InputError(f"The policy has shape {full.shape}, the model's layers × KV heads are "
                         f"{(model.n_layers, model.n_kv_heads)}.")
    twin = bare_twin(model, ATTENTION)
    attns = [m for m in twin.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    masks = {int(m.layer_idx): layer_mask(m) for m in attns}
    return PolicyCache([PolicyLayer(full[layer].tolist(), int(sink_size), int(recent_size), masks[layer], layer)
                        for layer in range(model.n_layers)])


@contextlib.contextmanager
def policy_cache(model: Any, full: np.ndarray, sink_size: int, recent_size: int) -> Iterator[tuple[Any, PolicyCache]]:
    """``(twin, cache)``: passes of ``twin(input_ids=..., past_key_values=cache, use_cache=True)`` inside
    the block keep ``cache`` as the policy says. Holds ``model.lock`` from before the check for hooks (a
    job ablating on the same model attaches its hooks under the lock: this waits for it to end)."""
    with model.lock, torch.inference_mode():
        check_cache_backend(model)
        cache = new_cache(model, full, sink_size, recent_size)
        try:
            yield bare_twin(model, ATTENTION), cache
        finally:
            _state.updated = None


def run_chunks(twin: Any, cache: PolicyCache, ids: Sequence[int], device: Any, chunk: int = DEFAULT_CHUNK,
               on_logits: Callable[[int, Tensor], None] | None = None, cancel: Any = None) -> Tensor:
    """Feed ``ids`` through ``twin`` in passes of ``chunk`` tokens with ``cache`` as its ``past_key_values``
    (a :class:`PolicyCache`, or any of transformers' caches); ``on_logits(start, logits [n, vocab])``
    receives every position's logits when given, else only the last position's are computed. Returns
    the last position's logits ``[vocab]``."""
    if chunk < 1:
        raise InputError(f"A pre-filling chunk needs at least one token; got {chunk}.")
    if isinstance(cache, PolicyCache):  # its full groups' buffers allocated once for the prompt, not per chunk
        cache.reserve(len(ids))
    last = None
    for start in range(0, len(ids), chunk):
        if cancel_requested(cancel):
            raise Cancelled("cancelled")
        x = torch.tensor([list(ids[start:start + chunk])], dtype=torch.long, device=device)
        out = twin(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=0 if on_logits else 1)
        logits = out.logits[0]
        if on_logits is not None:
            on_logits(start, logits)
        last = logits[-1]
        del out
    return last


@dataclass
class CachedText:
    """Mean next-token loss and each position's most likely next token, through the cache."""

    loss: float
    argmax: list[np.ndarray]


def text_metrics(model: Any, full: np.ndarray, texts: Sequence[Sequence[int]], sink_size: int, recent_size: int,
                 chunk: int = DEFAULT_CHUNK, cancel: Any = None) -> CachedText:
    """:func:`headscope.analysis.kv_compression.text_metrics` through a :class:`PolicyCache`: each text
    pre-filled in chunks, every position's logits kept. Same definition: ``(1/Σ(n−1)) Σ −log p(t_i | t_<i)``."""
    if any(len(ids) < 2 for ids in texts):
        raise InputError("Each text needs at least two tokens to have a loss.")
    _check_length(model, max((len(ids) for ids in texts), default=0))
    total, count, argmax = 0.0, 0, []
    for ids in texts:
        ids = list(ids)
        losses: list[Tensor] = []
        best: list[Tensor] = []
        target = torch.tensor(ids[1:] + [0], dtype=torch.long)

        def keep(start: int, logits: Tensor, target: Tensor = target, losses: list = losses, best: list = best) -> None:
            t = target[start:start + logits.shape[0]].to(logits.device)
            logp = torch.log_softmax(logits.float(), -1)
            losses.append(-logp.gather(-1, t[:, None])[:, 0].cpu())
            best.append(logits.argmax(-1).cpu())

        with policy_cache(model, full, sink_size, recent_size) as (twin, cache):
            run_chunks(twin, cache, ids, model.device, chunk, keep, cancel)
        nll = torch.cat(losses)[:-1]
        total += float(nll.double().sum())
        count += len(ids) - 1
        argmax.append(torch.cat(best).numpy())
    return CachedText(total / count if count else math.nan, argmax)


@dataclass
class CachedDecode:
    """A greedy continuation through the cache; the bytes its tensors allocate after the prefill and at
    the end (:meth:`PolicyCache.nbytes`), the bytes of what it keeps after the prefill
    (:meth:`PolicyCache.kept_bytes`), and the keys each group holds at the end."""

    generated: list[int]
    prefill_bytes: int
    final_bytes: int
    kept: np.ndarray
    prefill_kept_bytes: int = 0


def greedy_continuation(model: Any, full: np.ndarray, ids: Sequence[int], max_new_tokens: int, sink_size: int,
                        recent_size: int, chunk: int = DEFAULT_CHUNK, cancel: Any = None,
                        on_step: Callable[[int, PolicyCache], None] | None = None) -> CachedDecode:
    """:func:`headscope.analysis.ablation.greedy_continuation` (prefill, then one token per step, stop
    after an EOS, kept) through a :class:`PolicyCache`; ``on_step(step, cache)`` after each pass."""
    from headscope.analysis.ablation import MAX_NEW_TOKENS

    if not ids:
        raise InputError("The prompt is empty.")
    if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be between 0 and {MAX_NEW_TOKENS}.")
    _check_length(model, len(ids) + max_new_tokens)
    stops = stop_ids(model)
    out: list[int] = []
    with policy_cache(model, full, sink_size, recent_size) as (twin, cache):
        logits = run_chunks(twin, cache, ids, model.device, chunk, cancel=cancel)
        prefill_bytes, prefill_kept = cache.nbytes(), cache.kept_bytes()
        if not max_new_tokens:
            return CachedDecode(out, prefill_bytes, prefill_bytes, cache.kept(), prefill_kept)
        for step in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if token in stops or step == max_new_tokens - 1 or cancel_requested(cancel):
                break
            x = torch.tensor([[token]], dtype=torch.long, device=model.device)
            logits = twin(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            if on_step is not None:
                on_step(step, cache)
        return CachedDecode(out, prefill_bytes, cache.nbytes(), cache.kept(), prefill_kept)


def _check_length(model: Any, n: int) -> None:
    if n > model.n_ctx:
        raise InputError(f"The prompt and continuation would pass the model's context of {model.n_ctx:,} tokens.")


# ---------------------------------------------------------------------------------------------
# The attention function


def _attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature; reads the kept keys of the :class:`PolicyLayer` this
    module's cache update just wrote (``key``/``value`` are the pass's new ones, already stored there)
    → ``[b, n_q, h, d_v]``."""
    layer: PolicyLayer | None = getattr(_state, "updated", None)
    _state.updated = None
    if layer is None or layer.index != module.layer_idx:
        raise RuntimeError("The policy-cache attention ran without a PolicyCache as past_key_values "
                           "(use policy_cache()).")
    b, n_heads, n_q, _ = query.shape
    group = n_heads // layer.n_groups
    out = query.new_empty(b, n_heads, n_q, value.shape[-1])
    q_pos = torch.arange(layer.seen - n_q, layer.seen, device=query.device)
    mask = layer.mask
    for part in layer.parts:
        if len(layer.parts) == 1:
            out = _attend_part(query, part, q_pos, mask)
            break
        heads = torch.tensor([g * group + i for g in part.groups for i in range(group)], device=query.device)
        out[:, heads] = _attend_part(query.index_select(1, heads), part, q_pos, mask)
    layer.forget()
    return out.transpose(1, 2), None


def _visible(part: _Part, q_pos: Tensor, mask: LayerMask) -> Tensor | None:
    """``[n_q, n_k]``: key j (a kept position) visible from query p iff j ≤ p, (j < S or j > p − W) for a
    streaming part and, on a layer with the model's own window, j > p − W_m; None when every key is."""
    kp, qp = part.positions[None, :], q_pos[:, None]
    visible = kp <= qp
    if part.window:
        visible &= (kp < part.sink) | (kp > qp - part.window)
    if mask.window:
        visible &= kp > qp - mask.window
    return None if bool(visible.all()) else visible


def _attend_part(q: Tensor, part: _Part, q_pos: Tensor, mask: LayerMask) -> Tensor:
    """Softmax attention of ``q`` ``[b, h, n_q, d]`` (a part's query heads, grouped as its KV groups) over
    the part's kept keys by their positions (:func:`_visible`) → ``[b, h, n_q, d_v]``: SDPA, or the
    scores written out where the layer soft-caps them (Gemma 2), which SDPA cannot."""
    visible = _visible(part, q_pos, mask)
    if not mask.softcap:
        return torch.nn.functional.scaled_dot_product_attention(q, part.keys, part.values, attn_mask=visible,
                                                                scale=mask.scale, enable_gqa=True)
    b, h, n_q, d = q.shape
    g = part.keys.shape[1]
    r = h // g
    scores = torch.matmul(q.reshape(b, g, r * n_q, d), part.keys.transpose(-1, -2)).float() * mask.scale
    scores = mask.softcap * torch.tanh(scores / mask.softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible.repeat(r, 1), float("-inf"))
    weights = torch.softmax(scores, -1).to(part.values.dtype)
    return torch.matmul(weights, part.values).reshape(b, h, n_q, -1)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


_register()

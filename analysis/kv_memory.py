"""The bytes a KV cache keeps under a compression policy, exact for the model's layout.

For a cache of n tokens (DuoAttention, Xiao et al. 2024, arXiv:2410.10819, §3: a retrieval head's full
cache against a streaming head's S sinks and W recent tokens):

    bytes = Σ_{l, g} kept(l, g) · 2 (K and V) · d_head · dtype bytes,
    kept = n for a full group, min(n, S + W) for a streaming group,

and on a layer with the model's own sliding window W_m both are bounded by it (:func:`kv_memory`'s
``windows``). :mod:`headscope.analysis.kv_cache` keeps exactly these bytes (``PolicyCache.kept_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headscope.analysis.errors import InputError

if TYPE_CHECKING:
    from headscope.analysis.kv_compression import Policy


@dataclass(frozen=True)
class KVMemory:
    """KV cache bytes under a policy for ``n_tokens`` cached tokens, and of the full cache."""

    n_tokens: int
    bytes: int
    full_bytes: int

    @property
    def fraction(self) -> float:
        return self.bytes / self.full_bytes if self.full_bytes else math.nan


def dtype_bytes(model: Any) -> int:
    """Bytes per cached K or V element: the model's parameter dtype (the cache is kept in it)."""
    return int(next(model.hf_model.parameters()).element_size())


def kv_memory(policy: Policy, n_tokens: int, d_head: int, element_bytes: int,
              windows: Sequence[int | None] | None = None) -> KVMemory:
    """``Σ_{l,g} kept(l, g) · 2 · d_head · bytes`` with kept = n (full) or min(n, S + W) (streaming).

    ``windows`` (per layer, the model's own sliding window W_m; None or 0: none) makes it the count of a
    cache that also drops what the model's window hides, as the cache backend and transformers' sliding
    layers do: a full group keeps min(n, W_m), a streaming group its last min(W, W_m) keys and the sinks
    still inside the window (j < S and j > n − 1 − W_m); the full cache is then the model's own."""
    n = int(n_tokens)
    per_token = 2 * int(d_head) * int(element_bytes)
    n_layers = policy.full.shape[0]
    windows = list(windows or [None] * n_layers)
    if len(windows) != n_layers:
        raise InputError(f"{len(windows)} layer windows for a policy of {n_layers} layers.")
    kept = full = 0
    for layer in range(n_layers):
        w_m = int(windows[layer] or 0)
        whole = min(n, w_m) if w_m else n
        recent = min(n, min(policy.recent_size, w_m) if w_m else policy.recent_size)
        first_sink = max(0, n - w_m) if w_m else 0  # sinks before it are outside the model's window
        sinks = max(0, min(policy.sink_size, n, n - recent) - first_sink)
        n_full = int(policy.full[layer].sum())
        kept += n_full * whole + (policy.full.shape[1] - n_full) * (recent + sinks)
        full += policy.full.shape[1] * whole
    return KVMemory(n, kept * per_token, full * per_token)

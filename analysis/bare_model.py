"""The Hugging Face model under the bridge, without the bridge's wrappers: hook-free statistics-mode passes.

TransformerLens' ``TransformerBridge`` wraps every module of the Hugging Face model it is given (each
decoder layer, attention, MLP, norm, linear, embedding) in a component with its hook points, so a
forward pass of the embedded model makes about 1,700 module calls where Hugging Face makes about 400.
In a KV-cached decode step, whose arithmetic is small, that costs 40-50 % on top of Hugging Face's
own step (measured with one CPU thread: ~200 ms against ~130 ms on a loaded 2-core machine), and
retrieval scoring is mostly decode steps. When nothing is hooked, the hooks change nothing, so a
pass can run on the modules the bridge wraps.

:func:`bare_statistics` gives that model: a *twin* of ``model.hf_model`` built once per model, whose
module tree has every bridge component replaced by the module it wraps. The twin shares every
parameter and buffer with the bridge (no copy of the weights); only its config is its own, with
:data:`ATTENTION` as the attention implementation, so its attention layers call
:func:`headscope.analysis.attention_statistics`'s kernel step (``_attend``: the same kernel, mask, scale,
soft-cap and sliding-window handling as statistics mode) with the request of the enclosing block.
Nothing of the bridge's module tree is changed, so a forked job or another thread never sees a
half-swapped model.

Use it only when :func:`bare_supported` says so: statistics mode supports the architecture and no hook
(a user's ablation, a capture) is attached anywhere on the bridge, and the bridge is not in
TransformerLens' compatibility mode (whose processed weights the bridge's components would use).
``tests/analysis/test_retrieval.py`` checks on the embedded model that decoding through the twin
gives the bridge's tokens and argmax keys; ``tests/analysis/test_statistics_families.py`` does it
for every supported family.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from headscope.analysis.attention_statistics import OnLayer, Request, _attend, layer_mask

ATTENTION = "headscope_statistics"
"""The name of the twin's attention implementation in transformers' ``AttentionInterface``. It has no
mask function registered under that name, so Hugging Face builds no attention mask: the kernel applies
the causal mask and each layer's window itself (statistics mode checks the mask the model built; here
there is none to check)."""

_state = threading.local()  # the (request, on_layer) of the innermost bare_statistics block, per thread
_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_twins_lock = threading.Lock()


def bare_supported(model: Any) -> bool:
    """Whether a pass through the twin computes what the bridge would: no hook on any of the bridge's
    hook points, and no compatibility mode. (The architecture is checked by the caller with
    :func:`headscope.analysis.attention_statistics.statistics_supported`.)

    Hook points are where every TransformerLens hook is attached (``run_with_hooks``, ``hooks()``,
    ``add_hook``). The forward pre-hooks TransformerLens leaves on a block's norms once hooks have been
    used (``BlockBridge._maybe_wire_capture_hooks``) only keep inputs for those hook points, so they
    do not count."""
    from transformer_lens.hook_points import HookPoint

    bridge = model.bridge
    if getattr(bridge, "compatibility_mode", False):
        return False
    return not any(isinstance(m, HookPoint) and (m._forward_hooks or m._forward_pre_hooks) for m in bridge.modules())


@contextlib.contextmanager
def bare_statistics(model: Any, request: Request | None = None, on_layer: OnLayer | None = None) -> Iterator[nn.Module]:
    """Within the block, the twin of ``model.hf_model`` (a Hugging Face causal LM to call as usual:
    ``twin(input_ids=..., past_key_values=..., use_cache=True)``) runs its attention through the kernel,
    with ``request(layer, n_q, n_k)`` and ``on_layer`` as in :func:`headscope.analysis.attention_statistics.statistics_mode`.

    The caller holds ``model.lock`` when the KV cache or the request's state are shared."""
    twin = bare_twin(model)
    outer = getattr(_state, "calls", None)
    _state.calls = (request, on_layer)
    try:
        yield twin
    finally:
        _state.calls = outer


def bare_twin(model: Any, attn_implementation: str = ATTENTION) -> nn.Module:
    """The twin of ``model.hf_model`` (module docstring), built on first use and kept while the model lives.

    ``attn_implementation`` another of transformers' implementations (``"sdpa"``) gives Hugging Face's own
    model on the same weights, unwrapped: the baseline ``bench/scale.py`` times statistics mode against."""
    with _twins_lock:
        twins = _twins.setdefault(model, {})
        if attn_implementation not in twins:
            twins[attn_implementation] = _build_twin(model.hf_model, attn_implementation)
        return twins[attn_implementation]


def _build_twin(hf_model: nn.Module, attn_implementation: str) -> nn.Module:
    from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

    config = copy.deepcopy(hf_model.config)
    config._attn_implementation = attn_implementation  # the setter passes it on to sub-configs
    configs = {id(hf_model.config): config}
    for key in getattr(hf_model.config, "sub_configs", {}) or {}:
        if getattr(hf_model.config, key, None) is not None:
            configs[id(getattr(hf_model.config, key))] = getattr(config, key)
    twins: dict[int, nn.Module] = {}

    def twin_of(module: nn.Module) -> nn.Module:
        if id(module) in twins:  # a module reachable twice (shared) stays shared
            return twins[id(module)]
        inner = module
        while isinstance(inner, GeneralizedComponent) and inner.original_component is not None:
            inner = inner.original_component
        new = copy.copy(inner)  # a new module object; parameters, buffers and hooks are the same objects
        twins[id(module)] = twins[id(inner)] = new
        new._modules = {name: None if child is None else twin_of(child) for name, child in inner._modules.items()}
        own_config = new.__dict__.get("config")
        if own_config is not None and id(own_config) in configs:
            new.__dict__["config"] = configs[id(own_config)]
        return new

    return twin_of(hf_model).eval()


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature (``query`` ``[b, h, n_q, d]``, ``key``/``value``
    ``[b, h_kv, n_k, d]`` after the KV cache) → ``([b, n_q, h, d_v], None)``, through the kernel."""
    request, on_layer = getattr(_state, "calls", None) or (None, None)
    out = _attend(None, module.layer_idx, request, on_layer, query, key, value, attention_mask,
                  layer_mask(module), kwargs.get("position_ids"))
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


_register()

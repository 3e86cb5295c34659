"""Statistics mode: the model's own forward pass runs its attention through :func:`headscope.kernels.attention`.

Every attention layer of a TransformerLens ``TransformerBridge`` computes its output with the
kernel (torch on CPU, Triton on CUDA), which returns the per-head statistics asked for in the same
pass, so no ``n × n`` attention matrix is ever built: the forward pass itself, not a recomputation
beside it. Everything around the attention is the bridge's own code path, with its hooks:
``hook_in``, ``hook_q``/``hook_k``/``hook_v`` (the q/k/v projections), ``hook_cos``/``hook_sin``,
``hook_rot_q``/``hook_rot_k``, the KV cache, ``hook_z`` (the o projection's input) and ``hook_out``
fire as they do in the eager path, so z-ablations and activation patching work in this mode.
``hook_attn_scores`` and ``hook_pattern`` cannot fire (there is no matrix): a hook on them is an
error, never silently ignored.

Why patch the bridge and not transformers' attention-function registry: the bridge's
``PositionEmbeddingsAttentionBridge.forward`` re-implements attention itself (matmul, mask,
softmax) to fire its hooks, and never calls the Hugging Face attention function, so a registry entry
would not run. This module replaces that one method, per attention module instance, for the
duration of a ``with statistics_mode(...)`` block, with the same steps up to the scores and the
kernel after them.

Supported: causal self-attention of the families in the README's table, tested on tiny random
models of each (``tests/analysis/test_statistics_families.py``):

- rotary attention (``PositionEmbeddingsAttentionBridge``): rotate-half RoPE, full or partial
  width, with whatever ``cos``/``sin`` the decoder layer hands down (Gemma 3's per-layer RoPE base
  comes that way); q/k/v biases (Qwen 2: they live in the projections); QK-norm before RoPE
  (Qwen 3, Gemma 3, OLMo 2); sliding windows per layer (Mistral, Gemma 2/3, Qwen 2 with windows),
  as the kernel's key mask ``key_window``, checked against the mask the model built; attention
  logit soft-capping (Gemma 2); the module's own ``scaling`` (Gemma's ``query_pre_attn_scalar``);
- GPT-2's fused-qkv attention (``JointQKVAttentionBridge``) with absolute positions: the bridge's
  ``_reconstruct_attention`` is replaced instead of ``forward``;
- grouped-query attention natively (K/V never repeated), any group ratio, head_dim up to 256
  (the Triton tiles); KV-cached decoding; no padding.

Anything else (QK-norm after RoPE, learned sinks, split-qkv inputs, gates, clip_qkv, a key
multiplier, Llama 4 query scaling, GPT-2's reordered upcast) raises :class:`StatisticsModeError`
naming what is missing rather than computing something else.

Key masks from a KV-cache policy. ``statistics_mode(..., key_masks=)`` gives layers a per-query-head
:class:`HeadKeyMask` (S sinks + a window of W keys, the kernel's ``key_sink``/``key_window``, equal to
:func:`headscope.analysis.kv_compression.streaming_key_mask`), applied in the prefill and at every KV-cached
decode step. On a sliding-window layer it is intersected with the model's window: a query at
position ``p`` sees key ``j ≤ p`` iff ``j > p − W_model`` and (``j < S`` or ``j > p − W``)
(:func:`masked_segments`); rows where only some sinks are still inside the model's window run one
at a time on the keys that window keeps. The policy's O(n) memory is the kernel's. When no statistics
are asked, a layer's full KV groups run apart as the model runs them (SDPA's fused kernel where it
applies) and the streaming groups score only their S + W keys, so a policy costs less than the
uncompressed pass (``bench/compress.py backends``).

Pair terms. Besides the kernel's statistics a layer request can ask for ``pairs``: offsets ``o``
whose weights ``A[i, p_i − o]`` (``o = 0`` the query's own position, ``o = 1`` the previous token)
are recovered exactly from the row's log-sum-exp, ``A[i, j] = exp(s_ij − lse_i)`` with ``s_ij`` the
layer's (soft-capped) score, 0 where the layer's mask hides the key, at O(n · d) cost.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from headscope.kernels.attention import (
    ARGMAX,
    COL_SUM,
    LSE,
    POOLED,
    ROWS,
    SINK_MASS,
    SPAN_MASS,
    TOPK_INDEX,
    AttentionResult,
    attention,
)


class StatisticsModeError(ValueError):
    """The model, or a hook on it, cannot run in statistics mode; the message says why."""


@dataclass(frozen=True)
class LayerRequest:
    """What one attention layer returns besides its output.

    ``kernel`` holds keyword arguments of :func:`headscope.kernels.attention.attention` (``stats``,
    ``sink_size``, ``window``, ``spans``, ``block_size``, ``rows``, ``topk``); ``pairs`` the
    offsets of the pair terms (module docstring); ``pair_index`` any set of cells (query row,
    key position) whose weights are wanted, by the same exact formula.
    """

    kernel: dict[str, Any] = field(default_factory=dict)
    pairs: tuple[int, ...] = ()
    pair_index: tuple[Tensor, Tensor] | None = None  # (query rows [P], key positions [P]): A at those cells


@dataclass
class LayerStats:
    """One attention call's statistics: ``stats`` by the kernel's names (``[batch, head, ...]``,
    float32 / int64) and ``pairs`` offset → ``[batch, head, n_q]`` (0 where the key would be before
    position 0)."""

    layer: int
    n_q: int
    n_k: int
    stats: dict[str, Tensor]
    pairs: dict[int, Tensor]
    cells: Tensor | None = None  # [batch, head, P] weights of ``pair_index``


Request = Callable[[int, int, int], LayerRequest | None]
"""``request(layer, n_q, n_k)``: what to compute in that layer for this call (None: output only)."""
OnLayer = Callable[[LayerStats], None]


_state = threading.local()  # reentrancy guard per thread


def check_supported(bridge: Any) -> None:
    """Raise :class:`StatisticsModeError` when ``bridge``'s attention cannot run through the kernel."""
    from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import (
        JointQKVAttentionBridge,
    )
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    cfg = getattr(bridge, "cfg", None)
    blocks = getattr(bridge, "blocks", None)
    if not blocks:
        raise StatisticsModeError("Statistics mode needs a TransformerBridge with attention blocks.")
    reasons = []
    for flag in ("use_split_qkv_input", "use_attn_in", "gated_q_proj", "use_attn_result",
                 "rotary_interleaved_cos_sin", "rotary_adjacent_pairs", "qk_norm_after_rope"):
        if getattr(cfg, flag, False):
            reasons.append(flag)
    for i, block in enumerate(blocks):
        attn = getattr(block, "attn", None)
        if type(attn) not in (PositionEmbeddingsAttentionBridge, JointQKVAttentionBridge):
            reasons.append(f"layer {i} attention is {type(attn).__name__}, not rotary or GPT-2 self-attention")
            break
        hf = attn.original_component
        hf_cfg = getattr(hf, "config", None)
        if "gate" in attn.submodules or attn._modules.get("gate") is not None:
            reasons.append(f"gate in layer {i}")
        if type(attn) is JointQKVAttentionBridge:
            if getattr(hf, "reorder_and_upcast_attn", False):
                reasons.append("GPT-2's reorder_and_upcast_attn")
            if getattr(attn, "_layer_idx", None) is None:
                reasons.append(f"no layer index on layer {i} (KV cache)")
        elif "q_norm" in attn.submodules and attn._qk_norm_phase not in (None, "pre_reshape", "post_reshape"):
            reasons.append(f"a QK-norm of unknown placement in layer {i}")
        for attr, what in (("sinks", "learned sinks"), ("key_multiplier", "a key multiplier")):
            if getattr(hf, attr, None) is not None:
                reasons.append(f"{what} in layer {i}")
        if not isinstance(getattr(hf, "scaling", None), (int, float)):
            reasons.append(f"no attention scale (scaling) on layer {i}'s module")
        if getattr(hf_cfg, "clip_qkv", None) is not None:
            reasons.append("clip_qkv")
        rope = getattr(hf_cfg, "rope_parameters", None)
        if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
            reasons.append("llama-4 query scaling")
        if (type(attn) is PositionEmbeddingsAttentionBridge
                and type(attn)._pre_output_projection is not PositionEmbeddingsAttentionBridge._pre_output_projection):
            reasons.append("a transform before the output projection")
        if attn.is_cross_attention or not attn.is_causal:
            reasons.append(f"non-causal attention in layer {i}")
        if reasons:
            break
    if reasons:
        raise StatisticsModeError(
            "This model's attention cannot run through the statistics kernels ("
            + "; ".join(dict.fromkeys(reasons)) + "): use full patterns instead."
        )


def pattern_hooks_attached(bridge: Any) -> bool:
    """Whether any layer has a hook on ``hook_attn_scores`` or ``hook_pattern`` (an edit of the
    pattern, such as a masking ablation, that only the eager path can apply)."""
    for block in getattr(bridge, "blocks", ()):
        for hp in (block.attn.hook_attn_scores, block.attn.hook_pattern):
            if hp._forward_hooks or hp._forward_pre_hooks:
                return True
    return False


def statistics_supported(model: Any) -> bool:
    """Whether ``model`` can run in statistics mode now: its architecture is supported and no hook
    edits its patterns (a masking ablation needs the eager path). Callers fall back to eager."""
    bridge = getattr(model, "bridge", model)
    try:
        check_supported(bridge)
    except StatisticsModeError:
        return False
    return not pattern_hooks_attached(bridge)


@dataclass(frozen=True)
class HeadKeyMask:
    """Per query head of one layer: keys ``j < sink[h]`` and the last ``window[h]`` keys up to the
    query (``0``: no limit, the head sees every earlier key), as ``headscope.kernels.attention``'s ``key_sink``
    and ``key_window``."""

    sink: tuple[int, ...]
    window: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sink) != len(self.window) or min(self.sink + self.window, default=0) < 0:
            raise StatisticsModeError(f"A head key mask needs one sink >= 0 and one window >= 0 per query head; "
                                      f"got sinks {self.sink} and windows {self.window}.")


@dataclass(frozen=True)
class Segment:
    """Query rows ``[row_start, row_end)`` attending to cached keys ``key_start ..`` (up to the last row's
    position) with per-head
    ``key_sink``/``key_window`` (in the sliced keys' positions; window 0: none)."""

    row_start: int
    row_end: int
    key_start: int
    sink: tuple[int, ...]
    window: tuple[int, ...]


def masked_segments(mask: HeadKeyMask, model_window: int, n_q: int, n_k: int, dropped: int = 0) -> list[Segment]:
    """The kernel calls that apply ``mask`` intersected with a layer's sliding window.

    Query row ``r`` is model position ``p = dropped + n_k − n_q + r`` (the cache holds positions
    ``dropped ..``); head ``h`` sees key ``j ≤ p`` iff ``(W_m = 0 or j > p − W_m)`` and
    ``(W_h = 0 or j < S_h or j > p − W_h)``. Without a model window that is one call with the
    head mask. With one, a head with ``W_h = 0`` or ``W_h ≥ W_m`` has the model's window; the others
    have ``min(W_h, W_m)`` and sinks ``j < S_h`` visible while ``j > p − W_m``: all of them for rows
    with ``p < W_m``, none for ``p ≥ S_max + W_m − 1``, and in between one call per row on the keys
    ``j > p − W_m`` with the sinks that remain.
    """
    heads = range(len(mask.sink))
    if not model_window:
        return [Segment(0, n_q, 0, mask.sink, mask.window)]
    wm = model_window
    narrow = [0 < mask.window[h] < wm and mask.sink[h] > 0 for h in heads]
    windows = tuple(min(mask.window[h], wm) if mask.window[h] else wm for h in heads)

    def sinks(n_sink_gone: int) -> tuple[int, ...]:  # sinks left once positions < n_sink_gone are gone
        return tuple(max(0, mask.sink[h] - n_sink_gone) if narrow[h] else 0 for h in heads)

    first = dropped + n_k - n_q  # position of row 0
    s_max = max((mask.sink[h] for h in heads if narrow[h]), default=0)
    all_in = max(0, min(n_q, wm - first))  # rows with p < W_m: every sink inside the model window
    none_from = max(all_in, min(n_q, s_max + wm - 1 - first))  # rows from here: no sink inside
    out = []
    if all_in:
        out.append(Segment(0, all_in, 0, sinks(0), windows))
    for r in range(all_in, none_from):
        gone = first + r - wm + 1  # positions < gone are outside the model window of this row
        out.append(Segment(r, r + 1, max(0, gone - dropped), sinks(gone), windows))
    if none_from < n_q:
        out.append(Segment(none_from, n_q, 0, sinks(10**18), windows))
    merged = out[:1]
    for seg in out[1:]:  # neighbours with the same mask on the same keys (no sinks at all): one call
        last = merged[-1]
        if last.key_start == seg.key_start == 0 and (last.sink, last.window) == (seg.sink, seg.window):
            merged[-1] = Segment(last.row_start, seg.row_end, 0, seg.sink, seg.window)
        else:
            merged.append(seg)
    return merged


@contextlib.contextmanager
def statistics_mode(
    model: Any, request: Request | None = None, on_layer: OnLayer | None = None,
    key_masks: dict[int, HeadKeyMask] | None = None,
) -> Iterator[None]:
    """Within the block, ``model``'s forward passes compute attention with :func:`headscope.kernels.attention`.

    Parameters
    ----------
    model : a :class:`headscope.analysis.models.LoadedModel` (its ``lock`` is held for the whole block) or a
        bare ``TransformerBridge``.
    request : ``request(layer, n_q, n_k) -> LayerRequest | None`` for each attention call.
    on_layer : receives each call's :class:`LayerStats` (when its request asked for anything).
    key_masks : layer → :class:`HeadKeyMask`, a KV-cache policy's sinks and windows per query head
        (module docstring); layers not listed attend as the model does.

    Every forward pass inside the block (``bridge(...)``, ``run_with_hooks``, cached decoding) goes
    through the kernel; the original method is restored on exit, also after an exception.
    """
    bridge = getattr(model, "bridge", model)
    lock = getattr(model, "lock", None) or contextlib.nullcontext()
    with lock:
        if getattr(_state, "active", None) is bridge:
            raise StatisticsModeError("statistics_mode is already active on this model in this thread.")
        check_supported(bridge)
        patched = []
        try:
            for layer, block in enumerate(bridge.blocks):
                attn = block.attn
                # object.__setattr__: the bridge's own __setattr__ would forward the name to the
                # wrapped Hugging Face module, which has a ``forward`` too. GPT-2's joint-qkv bridge
                # keeps its forward (hooks, qkv split) and loses only _reconstruct_attention
                name = "_reconstruct_attention" if _is_joint(attn) else "forward"
                factory = _joint_factory if _is_joint(attn) else _forward_factory
                head_mask = (key_masks or {}).get(layer)
                if head_mask is not None and len(head_mask.sink) != bridge.cfg.n_heads:
                    raise StatisticsModeError(f"Layer {layer}'s key mask has {len(head_mask.sink)} heads; the model "
                                              f"has {bridge.cfg.n_heads} query heads.")
                object.__setattr__(attn, name, types.MethodType(factory(layer, request, on_layer, head_mask), attn))
                patched.append((attn, name))
            _state.active = bridge
            yield
        finally:
            _state.active = None
            for attn, name in patched:
                attn.__dict__.pop(name, None)


def restore_eager(bridge: Any) -> None:
    """Drop any statistics-mode patch left on ``bridge`` (a forked child of a process that was
    inside :func:`statistics_mode` when it forked)."""
    for block in getattr(bridge, "blocks", ()):
        with contextlib.suppress(Exception):
            block.attn.__dict__.pop("forward", None)
            block.attn.__dict__.pop("_reconstruct_attention", None)


def _is_joint(attn: Any) -> bool:
    from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import (
        JointQKVAttentionBridge,
    )

    return type(attn) is JointQKVAttentionBridge


def _forward_factory(layer: int, request: Request | None, on_layer: OnLayer | None, head_mask: HeadKeyMask | None):
    def forward(self: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return _kernel_forward(self, layer, request, on_layer, *args, head_mask=head_mask, **kwargs)

    return forward


def _joint_factory(layer: int, request: Request | None, on_layer: OnLayer | None, head_mask: HeadKeyMask | None):
    def reconstruct(self: Any, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, None]:
        return _joint_reconstruct(self, layer, request, on_layer, q, k, v, head_mask=head_mask, **kwargs)

    return reconstruct


def _refuse_pattern_hooks(self: Any) -> None:
    for hp in (self.hook_attn_scores, self.hook_pattern):
        if hp._forward_hooks or hp._forward_pre_hooks:
            raise StatisticsModeError(
                f"A hook is attached to {hp.name or 'hook_pattern'}: attention patterns are not built in "
                "statistics mode. Capture full patterns instead (shorter input), or hook q/k/v/z."
            )


@dataclass(frozen=True)
class LayerMask:
    """What one layer's attention adds to ``scale · q · k`` and the causal mask, read off its
    Hugging Face module: the scale (Gemma: ``query_pre_attn_scalar ** -0.5``), soft-capping
    (Gemma 2) and a sliding window (keys ``j > p − window``; 0: none)."""

    scale: float
    softcap: float | None = None
    window: int = 0

    @property
    def kernel(self) -> dict[str, Any]:
        return dict(scale=self.scale, softcap=self.softcap, key_window=self.window or None)


def layer_mask(hf_attn: Any) -> LayerMask:
    """The :class:`LayerMask` of a Hugging Face attention module. The window is
    :func:`headscope.analysis.model_facts.attention_window` (the one place windows are read);
    :func:`_check_causal_mask` then holds it against the mask the model actually built."""
    from headscope.analysis.model_facts import attention_window

    window = attention_window(hf_attn)
    softcap = getattr(hf_attn, "attn_logit_softcapping", None)
    return LayerMask(scale=float(hf_attn.scaling), softcap=None if softcap is None else float(softcap),
                     window=int(window or 0))


def _kernel_forward(self: Any, layer: int, request: Request | None, on_layer: OnLayer | None,
                    *args: Any, head_mask: HeadKeyMask | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """The bridge's rotary attention forward with the kernel in place of scores → softmax → @V.

    The steps up to the scores are those of ``PositionEmbeddingsAttentionBridge.forward`` for the
    configurations :func:`check_supported` lets through, with the same hooks in the same order."""
    _refuse_pattern_hooks(self)
    hf_attn = self.original_component
    if "hidden_states" in kwargs:
        hidden_states = kwargs.pop("hidden_states")
    elif args and isinstance(args[0], Tensor):
        hidden_states, args = args[0], args[1:]
    else:
        raise StatisticsModeError("Could not find hidden_states in the attention call.")
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    hidden_states = self.hook_in(hidden_states)
    input_shape = hidden_states.shape[:-1]
    head_dim = hf_attn.head_dim
    hidden_shape = (*input_shape, -1, head_dim)
    # the LinearBridges fire hook_q / hook_k / hook_v on the live path (biases included), as in eager
    q = self.q(hidden_states)
    k = self.k(hidden_states)
    v = self.v(hidden_states)
    has_q_norm, has_k_norm = "q_norm" in self.submodules, "k_norm" in self.submodules
    if has_q_norm and self._qk_norm_phase == "pre_reshape":  # OLMo 2: RMS over all heads at once
        q = self._apply_pre_reshape_qk_norm(q, self.q_norm, self.hook_q_normed, head_dim)
        if has_k_norm:
            k = self._apply_pre_reshape_qk_norm(k, self.k_norm, self.hook_k_normed, head_dim)
    q = q.view(hidden_shape).transpose(1, 2)
    k = k.view(hidden_shape).transpose(1, 2)
    v = v.view(hidden_shape).transpose(1, 2)
    if has_q_norm and self._qk_norm_phase == "post_reshape":  # Qwen 3, Gemma 3: per head, before RoPE
        if self._qk_norm_per_head:
            q = self.hook_q_normed(self.q_norm(q.transpose(1, 2)).transpose(1, 2))
            if has_k_norm:
                k = self.hook_k_normed(self.k_norm(k.transpose(1, 2)).transpose(1, 2))
        else:
            q = self.hook_q_normed(self.q_norm(q))
            if has_k_norm:
                k = self.hook_k_normed(self.k_norm(k))
    if position_embeddings is None:
        raise StatisticsModeError("No rotary position embeddings reached the attention layer.")
    q, k = _rotate(self, q, k, position_embeddings, head_dim)
    q = self.hook_rot_q(q)
    k = self.hook_rot_k(k)
    k, v = self._update_kv_cache(k, v, **kwargs)
    attn_output = _attend(self, layer, request, on_layer, q, k, v, attention_mask, layer_mask(hf_attn),
                          kwargs.get("position_ids"), head_mask)
    attn_output = attn_output.reshape(*input_shape, -1)
    o_weight = getattr(getattr(self.o, "original_component", None), "weight", None)
    if isinstance(o_weight, Tensor) and o_weight.dtype.is_floating_point and attn_output.dtype != o_weight.dtype:
        attn_output = attn_output.to(dtype=o_weight.dtype)
    attn_output = self.o(attn_output)  # fires hook_z (o.hook_in)
    attn_output = self.hook_out(attn_output)
    return attn_output, None


def _rotate(self: Any, q: Tensor, k: Tensor, position_embeddings: tuple[Tensor, Tensor],
            head_dim: int) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE as the bridge applies it: full width, GPT-OSS's half-width ``cos``/``sin``
    (duplicated), or partial (the first ``rotary_dim`` dimensions rotated, the rest passed)."""
    from transformer_lens.utilities.hf_utils import get_rotary_pct_from_config
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = self._apply_position_embedding_hooks(position_embeddings)
    rotary_dim = cos.shape[-1]
    if rotary_dim * 2 == head_dim and get_rotary_pct_from_config(self.config) == 1.0:
        return apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    if rotary_dim < head_dim:
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        return torch.cat([q_rot, q[..., rotary_dim:]], -1), torch.cat([k_rot, k[..., rotary_dim:]], -1)
    return apply_rotary_pos_emb(q, k, cos, sin)


def _joint_reconstruct(self: Any, layer: int, request: Request | None, on_layer: OnLayer | None,
                       q: Tensor, k: Tensor, v: Tensor, head_mask: HeadKeyMask | None = None,
                       **kwargs: Any) -> tuple[Tensor, None]:
    """GPT-2's attention after its fused qkv projection (``JointQKVAttentionBridge._reconstruct_attention``)
    with the kernel in place of scores → softmax → @V; positions were added to the residual stream."""
    _refuse_pattern_hooks(self)
    n_heads = self.config.n_heads
    n_kv = getattr(self.config, "n_key_value_heads", None) or n_heads
    q, k, v, batch, seq_len, head_dim = self._reshape_qkv_to_heads(q, k, v, n_heads, n_kv)
    k, v = self._update_kv_cache(k, v, **kwargs)
    out = _attend(self, layer, request, on_layer, q, k, v, kwargs.get("attention_mask"),
                  layer_mask(self.original_component), kwargs.get("position_ids"), head_mask)
    out = out.reshape(batch, seq_len, n_heads * head_dim)
    return self._apply_output_projection(out), None


def _attend(self: Any, layer: int, request: Request | None, on_layer: OnLayer | None, q: Tensor, k: Tensor,
            v: Tensor, attention_mask: Tensor | None, mask: LayerMask, position_ids: Tensor | None,
            head_mask: HeadKeyMask | None = None) -> Tensor:
    """The kernel on ``q`` ``[b, h, n_q, d]``, ``k``/``v`` ``[b, h_kv, n_k, d]`` with the layer's mask,
    scale and soft-cap; reports the requested statistics; returns ``[b, n_q, h, d_v]``.

    A sliding-window layer's KV cache (transformers' ``DynamicSlidingWindowLayer``) keeps only the
    last keys: the first ``dropped`` positions are gone, and were outside every later query's
    window. Statistics are reported in the model's positions all the same: key indices shifted by
    ``dropped``, rows and column sums zero on the dropped keys; statistics over absolute key spans
    (span and sink masses, pooled maps, listed cells) are refused there."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    _check_causal_mask(attention_mask, n_q, n_k, mask.window)
    dropped = 0
    if head_mask is not None and mask.window and (position_ids is None or not position_ids.numel()):
        # without positions a shortened cache's first key would be taken for position 0: sinks misplaced
        raise StatisticsModeError(f"Layer {layer} has a sliding window and a per-head key mask but no position ids: "
                                  "the sinks' positions in its KV cache are unknown.")
    if mask.window and position_ids is not None and position_ids.numel():
        dropped = max(0, int(position_ids.reshape(-1)[-1]) - (n_k - 1))
    req = request(layer, n_q, n_k + dropped) if request is not None else None
    kernel_kwargs = dict(req.kernel) if req is not None else {}
    stats = kernel_kwargs.pop("stats", ())
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    if dropped and (set(stats) & {SPAN_MASS, SINK_MASS, POOLED} or (req is not None and req.pair_index is not None)):
        raise StatisticsModeError(
            f"Layer {layer}'s sliding-window KV cache has dropped the first {dropped} keys: span and sink "
            "masses, pooled maps and listed cells need them. Run the text without the cache (one forward pass).")
    if req is not None and (req.pairs or req.pair_index is not None) and LSE not in stats:
        stats = (*stats, LSE)
    if head_mask is not None:
        return _attend_masked(layer, q, k, v, mask, head_mask, dropped, stats, kernel_kwargs, req, on_layer)
    result = attention(q, k, v, causal=True, stats=stats, **mask.kernel, **kernel_kwargs)
    if req is not None and on_layer is not None and (stats or req.pairs):
        lse = result.stats[LSE] if LSE in result.stats else None
        pairs = {o: _pair_weights(q, k, lse, mask, o) for o in req.pairs}
        cells = None
        if req.pair_index is not None:
            cells = cell_weights(q, k, lse, mask.scale, *req.pair_index, softcap=mask.softcap, window=mask.window)
        found = dict(result.stats)
        if dropped:
            found = _in_model_positions(found, dropped)
        on_layer(LayerStats(layer=layer, n_q=n_q, n_k=n_k + dropped, stats=found, pairs=pairs, cells=cells))
    return result.out.transpose(1, 2)


def _attend_masked(layer: int, q: Tensor, k: Tensor, v: Tensor, mask: LayerMask, head_mask: HeadKeyMask,
                   dropped: int, stats: tuple[str, ...], kernel_kwargs: dict[str, Any], req: LayerRequest | None,
                   on_layer: OnLayer | None) -> Tensor:
    """:func:`_attend` under a policy's key mask: one kernel call per :func:`masked_segments` segment.
    Statistics are reported when one call covers every row (pair terms and cells are refused: their
    formulas know only the model's window).

    With no statistics asked, the KV groups whose query heads all have window 0 (a policy's full
    groups) run apart, with the layer's own mask alone: the kernel then takes SDPA's fused path where
    it applies (no model window, square or single-row inputs), and the streaming groups' call has every
    head windowed, so it computes only their sink and window keys."""
    if req is not None and (req.pairs or req.pair_index is not None):
        raise StatisticsModeError("Pair terms and listed cells are not computed under a KV-cache policy's key mask.")
    n_q, n_k = q.shape[-2], k.shape[-2]
    segments = masked_segments(head_mask, mask.window, n_q, n_k, dropped)
    if stats and len(segments) == 1 and segments[0].key_start:
        raise StatisticsModeError(
            f"Layer {layer}: under the policy these rows read only keys from {segments[0].key_start} on, so the "
            "kernel's key indices are not the model's positions: statistics are not reported there.")
    if stats and len(segments) > 1:
        raise StatisticsModeError(
            f"Layer {layer}: the policy's sinks leave the model's sliding window of {mask.window} keys part-way "
            "through these rows, so they run in several kernel calls: statistics are not reported there.")
    group = q.shape[1] // k.shape[1]
    full = [g for g in range(k.shape[1]) if not any(head_mask.window[g * group : (g + 1) * group])]
    if not stats and 0 < len(full) < k.shape[1]:
        return _attend_split(q, k, v, mask, head_mask, dropped, kernel_kwargs, full).transpose(1, 2)
    out, result = _attend_segments(q, k, v, mask, segments, stats, kernel_kwargs)
    if stats and on_layer is not None:
        found = _in_model_positions(dict(result.stats), dropped) if dropped else dict(result.stats)
        on_layer(LayerStats(layer=layer, n_q=n_q, n_k=n_k + dropped, stats=found, pairs={}))
    return out.transpose(1, 2)


def _attend_segments(q: Tensor, k: Tensor, v: Tensor, mask: LayerMask, segments: list[Segment],
                     stats: tuple[str, ...], kernel_kwargs: dict[str, Any]) -> tuple[Tensor, AttentionResult]:
    """The kernel on each segment's rows and keys with its per-head mask: the output ``[b, h, n_q, d_v]``
    and the last call's result (the only one when statistics are asked)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    as_tensor = dict(dtype=torch.int64, device=q.device)
    outs = []
    for seg in segments:
        # the kernel puts its queries at the last key positions: end the keys at the segment's last row
        keys = slice(seg.key_start, n_k - (n_q - seg.row_end))
        result = attention(q[:, :, seg.row_start:seg.row_end], k[:, :, keys], v[:, :, keys],
                           causal=True, stats=stats, scale=mask.scale, softcap=mask.softcap,
                           key_sink=torch.tensor(seg.sink, **as_tensor),
                           key_window=torch.tensor(seg.window, **as_tensor), **kernel_kwargs)
        outs.append(result.out)
    return (torch.cat(outs, 2) if len(outs) > 1 else outs[0]), result


def _attend_split(q: Tensor, k: Tensor, v: Tensor, mask: LayerMask, head_mask: HeadKeyMask, dropped: int,
                  kernel_kwargs: dict[str, Any], full: list[int]) -> Tensor:
    """The output ``[b, h, n_q, d_v]`` with the KV groups ``full`` (every query head window 0) in one
    kernel call under the layer's mask alone, as :func:`_attend` without a policy runs them, and the
    other groups under their head mask (:func:`masked_segments` of their heads alone)."""
    n_kv, n_q, n_k = k.shape[1], q.shape[-2], k.shape[-2]
    group = q.shape[1] // n_kv
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    masked = [g for g in range(n_kv) if g not in full]
    for kv_heads in (full, masked):
        heads = [g * group + i for g in kv_heads for i in range(group)]
        hi = torch.tensor(heads, device=q.device)
        ki = torch.tensor(kv_heads, device=q.device)
        qs, ks, vs = q[:, hi], k[:, ki], v[:, ki]
        if kv_heads is full:
            out[:, hi] = attention(qs, ks, vs, causal=True, **mask.kernel, **kernel_kwargs).out
        else:
            part = HeadKeyMask(tuple(head_mask.sink[h] for h in heads), tuple(head_mask.window[h] for h in heads))
            segments = masked_segments(part, mask.window, n_q, n_k, dropped)
            out[:, hi] = _attend_segments(qs, ks, vs, mask, segments, (), kernel_kwargs)[0]
    return out


def _in_model_positions(stats: dict[str, Tensor], dropped: int) -> dict[str, Tensor]:
    """Statistics over a cache missing its first ``dropped`` keys, in the model's key positions."""
    out = dict(stats)
    for name in (ARGMAX, TOPK_INDEX):
        if name in out:
            out[name] = torch.where(out[name] >= 0, out[name] + dropped, out[name])
    for name in (ROWS, COL_SUM):
        if name in out:
            out[name] = torch.nn.functional.pad(out[name], (dropped, 0))
    return out


def _check_causal_mask(mask: Tensor | None, n_q: int, n_k: int, window: int = 0) -> None:
    """The kernel applies a causal mask, narrowed to the last ``window`` keys when ``window > 0``;
    refuse a mask that says anything else (padding, another window, bidirectional spans).

    O(n) check: the first, middle and last query rows see exactly the keys the kernel shows them
    (row ``i`` at position ``p = n_k − n_q + i``: keys ``j ≤ p``, and ``j > p − window``)."""
    if mask is None:
        return
    visible = mask if mask.dtype == torch.bool else mask == 0
    if visible.ndim == 2:  # [batch, n_k] padding mask
        if not bool(visible[..., :n_k].all()):
            raise StatisticsModeError("Padded batches are not supported in statistics mode.")
        return
    visible = visible[..., -n_q:, :n_k]
    keys = torch.arange(n_k, device=visible.device)
    for i in sorted({0, n_q // 2, n_q - 1}):
        p = n_k - n_q + i
        want = (keys <= p) & ((keys > p - window) if window > 0 else True)
        if not bool((visible[..., i, :] == want).all()):
            if window > 0:
                raise StatisticsModeError(
                    f"The attention mask does not match the layer's sliding window of {window} keys "
                    "(padding, or a mask the model builds differently): statistics mode cannot run it.")
            raise StatisticsModeError("The attention mask is not plain causal (padding or a window): "
                                      "statistics mode supports unpadded causal inputs only.")


def _scores(q: Tensor, keys: Tensor, scale: float, softcap: float | None) -> Tensor:
    """``scale · q · k`` row by row (float32), soft-capped as the layer does."""
    s = (q.float() * keys.float()).sum(-1) * scale
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _pair_weights(q: Tensor, k: Tensor, lse: Tensor, mask: LayerMask, offset: int) -> Tensor:
    """``A[i, p_i − offset] = exp(s − lse_i)``, 0 before position 0 or outside the layer's window."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    group = h // k.shape[1]
    pos = torch.arange(n_q, device=q.device) + (n_k - n_q) - offset
    valid = pos >= 0
    if mask.window and offset >= mask.window:
        valid = torch.zeros_like(valid)
    keys = k[:, :, pos.clamp(min=0)].repeat_interleave(group, dim=1)  # [b, h, n_q, d]: O(n · d)
    s = _scores(q, keys, mask.scale, mask.softcap)
    return torch.where(valid, torch.exp(s - lse), torch.zeros((), device=q.device))


def cell_weights(q: Tensor, k: Tensor, lse: Tensor, scale: float, rows: Tensor, keys: Tensor,
                 chunk: int = 1 << 14, softcap: float | None = None, window: int = 0) -> Tensor:
    """``A[r, c] = exp(s_rc − lse_r)`` for listed cells (query row ``r``, key position ``c``),
    ``[b, h, P]``, with ``s_rc = scale · q_r · k_c`` soft-capped by ``softcap``; 0 where a sliding
    ``window`` hides the key (``c ≤ p_r − window``). Cells a causal query cannot see must not be listed.

    The scores come from :func:`_cell_scores` (torch's sampled dense product at the cells); then
    ``chunk`` cells at a time: beside the ``[b, h, P]`` result, memory is O(P) whatever n is, and no
    ``n × n`` array is built."""
    b, h, n_q, _ = q.shape
    offset = k.shape[-2] - n_q
    rows, keys = rows.to(q.device, torch.int64), keys.to(q.device, torch.int64)
    out = _cell_scores(q, k, rows, keys)
    for a in range(0, rows.numel(), chunk):  # in place, a chunk at a time: no [b, h, P] temporaries
        r, c, s = rows[a : a + chunk], keys[a : a + chunk], out[:, :, a : a + chunk] * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        w = torch.exp(s - lse[:, :, r])
        if window:
            w = torch.where(c > r + offset - window, w, torch.zeros((), device=q.device))
        out[:, :, a : a + chunk] = w
    return out


def _cell_scores(q: Tensor, k: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
    """Unscaled ``q_r · k_c`` (float32) of the listed cells, ``[b, h, P]``: torch's sampled dense
    product (``torch.sparse.sampled_addmm``, SDDMM) of each head's queries and its KV group's keys at
    the cells, as one CSR mask; memory O(P) per head, no gathered copies of q or k."""
    import warnings

    b, h, n_q, _ = q.shape
    h_kv, n_k = k.shape[1], k.shape[-2]
    P = rows.numel()
    out = torch.empty(b, h, P, dtype=torch.float32, device=q.device)
    if P == 0:
        return out
    order = torch.argsort(rows * n_k + keys)  # CSR: by row, then key
    crow = torch.zeros(n_q + 1, dtype=torch.int64, device=q.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=n_q), 0)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        mask = torch.sparse_csr_tensor(crow, keys[order], torch.zeros(P, device=q.device), size=(n_q, n_k))
        for i in range(b):
            for j in range(h):
                kt = k[i, j // (h // h_kv)].float().T.contiguous()
                out[i, j, order] = torch.sparse.sampled_addmm(mask, q[i, j].float(), kt, beta=0.0).values()
    return out

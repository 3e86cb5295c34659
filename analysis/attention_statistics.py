"""Statistics mode: the model's own forward pass runs its attention through :func:`kernels.attention`.

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

Supported: rotary causal self-attention with full-width rotate-half RoPE (the Llama family, which
includes the embedded SmolLM2), grouped-query attention natively (K/V never repeated), KV-cached
decoding, no padding. Anything else (query/key norms, soft-capping, sliding windows, learned
sinks, split-qkv inputs, gates) raises :class:`StatisticsModeError` naming what is missing rather
than computing something else.

Pair terms. Besides the kernel's statistics a layer request can ask for ``pairs``: offsets ``o``
whose weights ``A[i, p_i − o]`` (``o = 0`` the query's own position, ``o = 1`` the previous token)
are recovered exactly from the row's log-sum-exp, ``A[i, j] = exp(scale · q_i · k_j − lse_i)``, at
O(n · d) cost.
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

from kernels.attention import LSE, attention


class StatisticsModeError(ValueError):
    """The model, or a hook on it, cannot run in statistics mode; the message says why."""


@dataclass(frozen=True)
class LayerRequest:
    """What one attention layer returns besides its output.

    ``kernel`` holds keyword arguments of :func:`kernels.attention.attention` (``stats``,
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
        if type(attn) is not PositionEmbeddingsAttentionBridge:
            reasons.append(f"layer {i} attention is {type(attn).__name__}, not rotary self-attention")
            break
        hf = attn.original_component
        hf_cfg = getattr(hf, "config", None)
        for sub in ("q_norm", "k_norm", "gate"):
            if sub in attn.submodules or attn._modules.get(sub) is not None:
                reasons.append(f"{sub} in layer {i}")
        for attr, what in (("attn_logit_softcapping", "soft-capping"), ("sinks", "learned sinks"),
                           ("key_multiplier", "a key multiplier"), ("sliding_window", "a sliding window")):
            if getattr(hf, attr, None) is not None:
                reasons.append(f"{what} in layer {i}")
        if getattr(hf_cfg, "clip_qkv", None) is not None:
            reasons.append("clip_qkv")
        rope = getattr(hf_cfg, "rope_parameters", None)
        if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
            reasons.append("llama-4 query scaling")
        if type(attn)._pre_output_projection is not PositionEmbeddingsAttentionBridge._pre_output_projection:
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


@contextlib.contextmanager
def statistics_mode(
    model: Any, request: Request | None = None, on_layer: OnLayer | None = None
) -> Iterator[None]:
    """Within the block, ``model``'s forward passes compute attention with :func:`kernels.attention`.

    Parameters
    ----------
    model : a :class:`analysis.models.LoadedModel` (its ``lock`` is held for the whole block) or a
        bare ``TransformerBridge``.
    request : ``request(layer, n_q, n_k) -> LayerRequest | None`` for each attention call.
    on_layer : receives each call's :class:`LayerStats` (when its request asked for anything).

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
                # wrapped Hugging Face module, which has a ``forward`` too
                object.__setattr__(attn, "forward", types.MethodType(_forward_factory(layer, request, on_layer), attn))
                patched.append(attn)
            _state.active = bridge
            yield
        finally:
            _state.active = None
            for attn in patched:
                attn.__dict__.pop("forward", None)


def restore_eager(bridge: Any) -> None:
    """Drop any statistics-mode patch left on ``bridge`` (a forked child of a process that was
    inside :func:`statistics_mode` when it forked)."""
    for block in getattr(bridge, "blocks", ()):
        with contextlib.suppress(Exception):
            block.attn.__dict__.pop("forward", None)


def _forward_factory(layer: int, request: Request | None, on_layer: OnLayer | None):
    def forward(self: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return _kernel_forward(self, layer, request, on_layer, *args, **kwargs)

    return forward


def _kernel_forward(self: Any, layer: int, request: Request | None, on_layer: OnLayer | None,
                    *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
    """The bridge's rotary attention forward with the kernel in place of scores → softmax → @V."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for hp in (self.hook_attn_scores, self.hook_pattern):
        if hp._forward_hooks or hp._forward_pre_hooks:
            raise StatisticsModeError(
                f"A hook is attached to {hp.name or 'hook_pattern'}: attention patterns are not built in "
                "statistics mode. Capture full patterns instead (shorter input), or hook q/k/v/z."
            )
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
    # the LinearBridges fire hook_q / hook_k / hook_v on the live path, as in the eager forward
    q = self.q(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v(hidden_states).view(hidden_shape).transpose(1, 2)
    if position_embeddings is None:
        raise StatisticsModeError("No rotary position embeddings reached the attention layer.")
    cos, sin = self._apply_position_embedding_hooks(position_embeddings)
    if cos.shape[-1] != head_dim:
        raise StatisticsModeError("Partial or half-width rotary embeddings are not supported in statistics mode.")
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    q = self.hook_rot_q(q)
    k = self.hook_rot_k(k)
    k, v = self._update_kv_cache(k, v, **kwargs)
    n_q, n_k = q.shape[-2], k.shape[-2]
    _check_causal_mask(attention_mask, n_q, n_k)

    scale = float(getattr(hf_attn, "scaling", head_dim**-0.5))
    req = request(layer, n_q, n_k) if request is not None else None
    kernel_kwargs = dict(req.kernel) if req is not None else {}
    stats = kernel_kwargs.pop("stats", ())
    stats = (stats,) if isinstance(stats, str) else tuple(stats)
    if req is not None and (req.pairs or req.pair_index is not None) and LSE not in stats:
        stats = (*stats, LSE)
    result = attention(q, k, v, causal=True, scale=scale, stats=stats, **kernel_kwargs)
    if req is not None and on_layer is not None and (stats or req.pairs):
        pairs = {o: _pair_weights(q, k, result.stats[LSE], scale, o) for o in req.pairs}
        cells = None
        if req.pair_index is not None:
            cells = cell_weights(q, k, result.stats[LSE], scale, *req.pair_index)
        on_layer(LayerStats(layer=layer, n_q=n_q, n_k=n_k, stats=dict(result.stats), pairs=pairs, cells=cells))

    attn_output = result.out.transpose(1, 2).reshape(*input_shape, -1)
    o_weight = getattr(getattr(self.o, "original_component", None), "weight", None)
    if isinstance(o_weight, Tensor) and o_weight.dtype.is_floating_point and attn_output.dtype != o_weight.dtype:
        attn_output = attn_output.to(dtype=o_weight.dtype)
    attn_output = self.o(attn_output)  # fires hook_z (o.hook_in)
    attn_output = self.hook_out(attn_output)
    return attn_output, None


def _check_causal_mask(mask: Tensor | None, n_q: int, n_k: int) -> None:
    """The kernel applies a plain causal mask; refuse a mask that says more (padding, windows).

    O(n) check: every key of the last query row is visible (no padding, no window) and the first
    query row sees exactly keys ``0..n_k − n_q``."""
    if mask is None:
        return
    visible = mask if mask.dtype == torch.bool else mask == 0
    if visible.ndim == 2:  # [batch, n_k] padding mask
        if not bool(visible[..., :n_k].all()):
            raise StatisticsModeError("Padded batches are not supported in statistics mode.")
        return
    visible = visible[..., -n_q:, :n_k]
    first = visible[..., 0, :]
    offset = n_k - n_q
    ok = bool(visible[..., -1, :].all()) and bool(first[..., : offset + 1].all()) and not bool(first[..., offset + 1:].any())
    if not ok:
        raise StatisticsModeError("The attention mask is not plain causal (padding or a window): "
                                  "statistics mode supports unpadded causal inputs only.")


def _pair_weights(q: Tensor, k: Tensor, lse: Tensor, scale: float, offset: int) -> Tensor:
    """``A[i, p_i − offset] = exp(scale · q_i · k_{p_i − offset} − lse_i)``, 0 before position 0."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    group = h // k.shape[1]
    pos = torch.arange(n_q, device=q.device) + (n_k - n_q) - offset
    valid = pos >= 0
    keys = k[:, :, pos.clamp(min=0)].repeat_interleave(group, dim=1)  # [b, h, n_q, d]: O(n · d)
    s = (q.float() * keys.float()).sum(-1) * scale
    return torch.where(valid, torch.exp(s - lse), torch.zeros((), device=q.device))


def cell_weights(q: Tensor, k: Tensor, lse: Tensor, scale: float, rows: Tensor, keys: Tensor,
                 chunk: int = 1 << 14) -> Tensor:
    """``A[r, c] = exp(scale · q_r · k_c − lse_r)`` for listed cells (query row ``r``, key position
    ``c``), ``[b, h, P]``; ``chunk`` cells at a time, so memory is O(chunk · h · d) whatever P is.
    Cells a causal query cannot see must not be listed."""
    b, h, _, _ = q.shape
    group = h // k.shape[1]
    out = torch.empty(b, h, rows.numel(), dtype=torch.float32, device=q.device)
    rows, keys = rows.to(q.device), keys.to(q.device)
    for a in range(0, rows.numel(), chunk):
        r, c = rows[a : a + chunk], keys[a : a + chunk]
        qr = q[:, :, r].float()  # [b, h, p, d]
        kc = k[:, :, c].float().repeat_interleave(group, dim=1)
        out[:, :, a : a + chunk] = torch.exp((qr * kc).sum(-1) * scale - lse[:, :, r])
    return out


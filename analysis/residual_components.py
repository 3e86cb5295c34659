"""The residual stream at chosen positions as a sum of components, with every normalisation frozen.

Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits" (transformer-circuits.pub/2021/
framework, §"Residual stream"): the residual stream is a sum of what each layer writes into it. At the
input of layer ``l`` and position ``p``

    x_l(p) = e(p) + Σ_{l' < l} Σ_h r_{l',h}(p) + Σ_{l' < l} m_{l'}(p) + b_{<l}(p)

with ``e`` the embedding the first block reads (token and absolute position embeddings, times Gemma's
``√d_model``), ``r_{l',h} = z_h W_O^h`` the output of head h (``z_h`` its value mixture at ``p``, the
input of the output projection), ``m_{l'}`` the MLP's output and ``b`` the output projections' biases.
Where a model normalises a sublayer's output before adding it (Gemma 2/3's and OLMo 2's post-attention
norm), that norm is frozen at its scale in the run: ``y = γ ⊙ x / σ(p)`` is linear in ``x`` once ``σ(p)``
is a number, so each head keeps its own share ``γ ⊙ r_h / σ(p)``. This is the standard linearisation of
direct logit attribution (Wang et al. 2022, "Interpretability in the Wild", arXiv:2211.00593, §3.1):
exact for the run explained, not for another input.

:func:`capture_components` runs the model once with hooks (the bridge's own, so every family's block
runs its usual code) and keeps, at the chosen positions only, each of these components, the residual
stream the model itself computed at every layer's input and before the final norm, and the scale
``σ`` of each normalisation there. :meth:`ComponentCapture.components` then checks that the parts add
up to the model's own residual stream (1e-4 of its size), and refuses a model whose blocks they do not
describe (a parallel attention/MLP block, a LayerNorm after a sublayer) with an :class:`InputError`,
never a wrong decomposition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from headscope.analysis.errors import InputError
from headscope.analysis.limits import hint, limit
from headscope.analysis.models import LoadedModel

LIMIT = "HEADSCOPE_MAX_TOKENS"
"""The limit on an explained text's tokens: the hooked forward pass builds each layer's full attention."""

TOLERANCE = 1e-4
"""Largest relative mismatch between a sum of components and the model's own value before refusing."""

EMBED, BIAS, INPUT_BIAS = "embed", "bias", "input_bias"


def head_name(layer: int, head: int) -> str:
    """A head's component name, ``L.H``."""
    return f"{layer}.{head}"


def mlp_name(layer: int) -> str:
    """An MLP's component name, ``mlp.L``."""
    return f"mlp.{layer}"


def affine_map(module: Any) -> tuple[Tensor, Tensor]:
    """``(W [d_in, d_out], b [d_out])`` float64 of a linear module as the model applies it
    (``y = x W + b``): ``torch.nn.Linear`` (``weight`` is ``[d_out, d_in]``) or GPT-2's ``Conv1D``
    (``weight`` is ``[d_in, d_out]``); the bias is zeros where there is none."""
    inner = getattr(module, "original_component", module)
    weight = getattr(inner, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise InputError(f"A projection of this model ({type(inner).__name__}) is not a plain linear layer: "
                         "its components cannot be written exactly.")
    if isinstance(inner, torch.nn.Linear):
        w = weight.detach().double().T
    elif type(inner).__name__ == "Conv1D":
        w = weight.detach().double()
    else:
        raise InputError(f"A projection of this model ({type(inner).__name__}) is not a plain linear layer: "
                         "its components cannot be written exactly.")
    bias = getattr(inner, "bias", None)
    b = bias.detach().double() if isinstance(bias, Tensor) else torch.zeros(w.shape[1], dtype=torch.float64)
    return w.to("cpu"), b.to("cpu")


@dataclass(frozen=True)
class FrozenNorm:
    """A normalisation read as ``x ↦ γ ⊙ P(x) / σ + β`` with ``σ`` frozen at the run: ``gain`` is γ
    (``1 + weight`` where the model stores an offset, as Gemma does), ``centred`` whether P subtracts the
    mean (LayerNorm; RMSNorm does not), ``bias`` β (zeros for RMSNorm)."""

    gain: Tensor
    bias: Tensor
    centred: bool

    def apply(self, x: Tensor, sigma: Tensor) -> Tensor:
        """The linear part ``γ ⊙ P(x) / σ`` of ``x [..., d]`` with ``σ`` broadcast against ``x[..., :1]``."""
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return x * self.gain / sigma


def frozen_norm(norm: Any) -> FrozenNorm:
    """The :class:`FrozenNorm` of a bridge normalisation component (its weight, offset and kind)."""
    inner = getattr(norm, "original_component", norm)
    weight = getattr(inner, "weight", None)
    if not isinstance(weight, Tensor):
        raise InputError(f"A normalisation of this model ({type(inner).__name__}) has no weight to freeze.")
    gain = weight.detach().double().cpu()
    if getattr(norm, "uses_weight_offset", False):
        gain = 1.0 + gain
    rms = bool(getattr(norm, "uses_rms_norm", False))
    bias = getattr(inner, "bias", None)
    beta = bias.detach().double().cpu() if isinstance(bias, Tensor) and not rms else torch.zeros_like(gain)
    return FrozenNorm(gain=gain, bias=beta, centred=not rms)


@dataclass
class AttentionCapture:
    """What one attention layer computed at the captured positions (``[P, ...]``, as the model computed
    them): its q and k after their projections (biases included, before any QK-norm) ``q_proj [P, H, d_head]``,
    ``k_proj [P, H_kv, d_head]``; the rotary ``cos``/``sin [P, rot]`` (None without RoPE); the q and
    k the scores are made of, after QK-norm and RoPE, ``q [P, H, d_head]``, ``k [P, H_kv, d_head]``;
    the input norm's scale ``sigma [P]`` (None where the layer reads the residual stream as it is)."""

    q_proj: Tensor
    k_proj: Tensor
    q: Tensor
    k: Tensor
    cos: Tensor | None
    sin: Tensor | None
    sigma: Tensor | None


@dataclass
class OutputMap:
    """How one layer's heads write into the residual stream: ``W_O [H, d_head, d_model]``, its bias
    ``b_O [d_model]`` and, where the model normalises the attention output before adding it, the post-norm's
    gain ``[d_model]`` and its scale at the captured positions ``[P]`` (else None)."""

    w_o: Tensor
    b_o: Tensor
    post_gain: Tensor | None = None
    post_sigma: Tensor | None = None

    def heads(self, z: Tensor, rows: Tensor) -> Tensor:
        """``[H, R, d_model]`` float64: each head's write at captured rows ``rows`` from ``z [P, H, d_head]``."""
        out = torch.einsum("rhd,hdm->hrm", z[rows].double(), self.w_o.double())
        return out if self.post_gain is None else out * self.post_gain / self.post_sigma[rows, None].double()

    def bias(self, rows: Tensor) -> Tensor:
        """``[R, d_model]`` float64: the output bias as written at captured rows ``rows``."""
        out = self.b_o.double().expand(len(rows), -1)
        return out if self.post_gain is None else out * self.post_gain / self.post_sigma[rows, None].double()


@dataclass
class ComponentCapture:
    """One forward pass, kept at ``positions`` (on the CPU, in the model's precision; the decompositions
    compute in float64). Head writes are formed when asked, for the rows asked: a capture of every position
    of a 512-token run of SmolLM2-135M holds about 40 MB per kind of tensor, not a ``[L, H, n, d_model]`` array.

    Attributes
    ----------
    token_ids, positions : what was run and where it was kept (``P`` positions).
    embed : ``[P, d_model]`` the residual stream the first block reads.
    z : ``[L, P, H, d_head]`` each head's value mixture, the input of the output projection.
    out_maps : per layer, the :class:`OutputMap` that turns ``z`` into the heads' writes.
    mlps : ``[L, P, d_model]`` each MLP's write (after its post-norm where the model has one).
    resid : ``[L + 1, P, d_model]`` the model's own residual stream at each layer's input; index ``L``
        is the final norm's input.
    final_sigma : ``[P]`` the final norm's scale.
    final_out : ``[P, d_model]`` the final norm's output (what the unembedding reads).
    attention : layer → :class:`AttentionCapture` for the layers asked for.
    """

    token_ids: list[int]
    positions: list[int]
    embed: Tensor
    z: Tensor
    out_maps: list[OutputMap]
    mlps: Tensor
    resid: Tensor
    final_sigma: Tensor
    final_out: Tensor
    attention: dict[int, AttentionCapture] = field(default_factory=dict)

    def index(self, position: int) -> int:
        """Where ``position`` sits among the captured positions."""
        return self.positions.index(position)

    def components(self, layer: int, positions: Sequence[int]) -> tuple[list[str], Tensor]:
        """Names and float64 vectors ``[len(positions), C, d_model]`` of the components of the residual stream at
        the input of ``layer`` (``n_layers``: before the final norm) at captured ``positions``: ``embed``, each
        head ``L.H`` and MLP ``mlp.L`` of the earlier layers, and ``bias`` (their output biases together).

        Raises :class:`InputError` when they do not add up to the model's own residual stream there."""
        rows = torch.tensor([self.index(p) for p in positions], dtype=torch.long)
        n_heads = self.z.shape[2]
        names = [EMBED] + [head_name(a, h) for a in range(layer) for h in range(n_heads)]
        names += [mlp_name(a) for a in range(layer)] + [BIAS]
        heads = [self.out_maps[a].heads(self.z[a], rows) for a in range(layer)]  # each [H, R, d]
        bias = sum((self.out_maps[a].bias(rows) for a in range(layer)), torch.zeros(len(rows), self.embed.shape[1],
                                                                                      dtype=torch.float64))
        parts = [self.embed[rows, None].double()]
        if heads:
            parts.append(torch.cat(heads, 0).transpose(0, 1))
        parts += [self.mlps[:layer, rows].transpose(0, 1).double(), bias[:, None]]
        vectors = torch.cat(parts, 1)
        check_sum(vectors.sum(1), self.resid[layer, rows].double(), f"the residual stream at the input of layer {layer}")
        return names, vectors


def check_sum(total: Tensor, own: Tensor, what: str) -> None:
    """Refuse (InputError) when ``total`` differs from the model's ``own`` value by more than
    :data:`TOLERANCE` of its size: the components do not describe this model's computation."""
    size = float(own.abs().max()) if own.numel() else 0.0
    error = float((total - own).abs().max()) if own.numel() else 0.0
    if error > TOLERANCE * max(size, 1e-12):
        raise InputError(
            f"This model's computation cannot be written exactly as a sum of components: {what} differs from "
            f"the model's own by {error:.3g} (of {size:.3g}). Its blocks are built differently from those "
            "headscope decomposes (pre-norm or post-norm sublayers added in sequence); use another model.")


def check_tokens(model: LoadedModel, token_ids: Sequence[int]) -> list[int]:
    """The ids as ints, refused (InputError) when empty, outside the vocabulary or over the limit."""
    ids = list(token_ids)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise InputError(f"Token ids must be whole numbers; got {bad[:3]!r}.")
    ids = [int(t) for t in ids]
    if not ids:
        raise InputError("The text is empty: there are no tokens to explain.")
    outside = [t for t in ids if not 0 <= t < model.vocab_size]
    if outside:
        raise InputError(f"Token ids {outside[:5]} are not in the model's vocabulary (0..{model.vocab_size - 1}).")
    most = limit(LIMIT)
    if len(ids) > most:
        raise InputError(f"Attributions run the model with full attention, on texts of at most {most:,} tokens "
                         f"{hint(LIMIT)}; this one has {len(ids):,}. Use a shorter text.")
    return ids


def check_structure(model: LoadedModel) -> None:
    """Refuse (InputError) a model whose attention the decomposition does not know: the families
    statistics mode supports (:func:`headscope.analysis.attention_statistics.check_supported`), with
    RMS post-norms only."""
    from headscope.analysis.attention_statistics import StatisticsModeError, check_supported

    try:
        check_supported(model.bridge)
    except StatisticsModeError as e:
        raise InputError(f"Attributions support the attention of the families statistics mode runs; {e}") from None
    for i, block in enumerate(model.bridge.blocks):
        for name in ("ln1_post", "ln2_post"):
            norm = getattr(block, name, None)
            if norm is not None and not getattr(norm, "uses_rms_norm", False):
                raise InputError(f"Layer {i} normalises a sublayer's output with a LayerNorm; attributions "
                                 "freeze RMS post-norms only.")


def capture_components(model: LoadedModel, token_ids: Sequence[int], positions: Sequence[int],
                       attention_layers: Sequence[int] = ()) -> ComponentCapture:
    """Run ``model`` once on ``token_ids`` and keep the residual components at ``positions``.

    Parameters
    ----------
    model : the model (its eager attention).
    token_ids : the ids the model sees, as given (at most ``HEADSCOPE_MAX_TOKENS``).
    positions : token positions, ``0 ≤ p < n``, at which components are kept.
    attention_layers : layers whose q, k, rotary tables and input-norm scale are kept too (for
        :func:`headscope.analysis.qk_attribution.qk_attribution`).

    Returns
    -------
    ComponentCapture
        The components, the model's own residual stream and the frozen scales (module docstring).
    """
    ids = check_tokens(model, token_ids)
    check_structure(model)
    pos = sorted({int(p) for p in positions})
    if not pos or pos[0] < 0 or pos[-1] >= len(ids):
        raise InputError(f"Positions must lie in 0..{len(ids) - 1} (the text has {len(ids)} tokens); got {list(positions)}.")
    bridge = model.bridge
    at = torch.tensor(pos)
    kept: dict[str, Tensor] = {}

    def keep(name: str, dim: int = 1):
        def hook(tensor: Tensor, hook: Any = None) -> None:
            kept[name] = tensor[0].detach().index_select(dim - 1, at.to(tensor.device)).float().cpu()

        return hook

    hooks = [("blocks.0.hook_in", keep("embed")), ("ln_final.hook_in", keep("final")),
             ("ln_final.hook_scale", keep("final_sigma")), ("ln_final.hook_out", keep("final_out"))]
    for layer, block in enumerate(bridge.blocks):
        hooks += [(f"blocks.{layer}.hook_in", keep(f"resid{layer}")), (f"blocks.{layer}.attn.o.hook_in", keep(f"z{layer}"))]
        hooks.append((f"blocks.{layer}.{'ln2_post' if hasattr(block, 'ln2_post') else 'mlp'}.hook_out", keep(f"mlp{layer}")))
        if hasattr(block, "ln1_post"):
            hooks.append((f"blocks.{layer}.ln1_post.hook_scale", keep(f"post{layer}")))
    for layer in sorted(set(attention_layers)):
        hooks += attention_hooks(model, layer, keep)
    with model.lock, torch.inference_mode():
        bridge.run_with_hooks(torch.tensor([ids], device=model.device), fwd_hooks=hooks, return_type=None,
                              **_last_logits_only(model))
    out_maps = []
    for layer, block in enumerate(bridge.blocks):
        w_o, b_o = affine_map(block.attn.o)  # [H · d_head, d_model]
        out = OutputMap(w_o=w_o.reshape(model.n_heads, -1, w_o.shape[1]).float(), b_o=b_o)
        if hasattr(block, "ln1_post"):
            out.post_gain, out.post_sigma = frozen_norm(block.ln1_post).gain, kept[f"post{layer}"][:, 0]
        out_maps.append(out)
    layers = range(model.n_layers)
    resid = torch.stack([kept[f"resid{layer}"] for layer in layers] + [kept["final"]])
    attention = {layer: attention_capture(kept, layer) for layer in sorted(set(attention_layers))}
    return ComponentCapture(token_ids=ids, positions=pos, embed=kept["embed"],
                            z=torch.stack([kept[f"z{layer}"] for layer in layers]), out_maps=out_maps,
                            mlps=torch.stack([kept[f"mlp{layer}"] for layer in layers]), resid=resid,
                            final_sigma=kept["final_sigma"][:, 0], final_out=kept["final_out"], attention=attention)


def _last_logits_only(model: LoadedModel) -> dict[str, int]:
    """``logits_to_keep=1`` where the Hugging Face model takes it: a capture keeps the final norm's output
    (computed at every position before the unembedding), never the logits, so unembedding only the last
    position spares what is about a fifth of a small model's forward pass (49k × 576 per position for
    SmolLM2-135M) and changes nothing kept."""
    import inspect

    forward = getattr(getattr(model, "hf_model", None), "forward", None)
    try:
        takes = forward is not None and "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"logits_to_keep": 1} if takes else {}


def attention_hooks(model: LoadedModel, layer: int, keep: Any) -> list[tuple[str, Any]]:
    """Hooks that keep what :class:`AttentionCapture` holds for ``layer``."""
    block = model.bridge.blocks[layer]
    prefix = f"blocks.{layer}.attn"
    hooks = [(f"{prefix}.q.hook_out", keep(f"q_proj{layer}")), (f"{prefix}.k.hook_out", keep(f"k_proj{layer}"))]
    if hasattr(block, "ln1"):
        hooks.append((f"blocks.{layer}.ln1.hook_scale", keep(f"sigma{layer}")))
    if hasattr(block.attn, "hook_rot_q"):
        hooks += [(f"{prefix}.hook_rot_q", keep(f"q{layer}")), (f"{prefix}.hook_rot_k", keep(f"k{layer}")),
                  (f"{prefix}.hook_cos", keep(f"cos{layer}")), (f"{prefix}.hook_sin", keep(f"sin{layer}"))]
    return hooks


def attention_capture(kept: dict[str, Tensor], layer: int) -> AttentionCapture:
    """The :class:`AttentionCapture` of ``layer`` from what its hooks kept (no RoPE: q and k as projected)."""
    q_proj, k_proj = kept[f"q_proj{layer}"], kept[f"k_proj{layer}"]
    sigma = kept.get(f"sigma{layer}")
    return AttentionCapture(q_proj=q_proj, k_proj=k_proj, q=kept.get(f"q{layer}", q_proj), k=kept.get(f"k{layer}", k_proj),
                            cos=kept.get(f"cos{layer}"), sin=kept.get(f"sin{layer}"),
                            sigma=None if sigma is None else sigma[:, 0])

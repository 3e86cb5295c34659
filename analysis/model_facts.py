"""Per-model facts the pages and analyses code against, read once from the loaded model.

One place answers, for any model the bridge boots:

- **windows**: per layer, the sliding attention window in keys (query at position p sees keys
  ``p − W < j ≤ p``), None on full-attention layers (Mistral: every layer; Gemma 2/3: some layers).
  Entropy normalises by the visible keys (:mod:`headscope.analysis.entropy`), statistics mode masks with it
  (:func:`headscope.analysis.attention_statistics.layer_mask`), the Attention page marks windowed layers.
- **BOS policy**: whether the tokenizer puts a BOS token before a text when asked for its special
  tokens (Llama, Mistral, Gemma do; Qwen, GPT-2 and SmolLM2 do not). When it does, headscope
  prepends it deliberately and shows it as token 0, so positions stay those the model saw
  (DESIGN.md, "Conventions").
- **chat template**: whether the tokenizer has one. Without it (a base model) NIAH prompts are the
  plain user message (:meth:`headscope.analysis.models.LoadedModel.chat_ids`) ending with an answer cue
  (:data:`headscope.analysis.niah.ANSWER_CUE`).
- **which q and k the QK page shows**: ``hook_rot_q``/``hook_rot_k``, i.e. after QK-norm (Qwen 3,
  Gemma 3, OLMo 2) and after RoPE where the model has them: the vectors the attention logits are
  made of. :attr:`ModelFacts.qk_label` says so in words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def attention_window(hf_attn: Any) -> int | None:
    """The sliding window of one Hugging Face attention module in keys, None for full attention.

    The module's own ``sliding_window`` (Gemma 2/3 and Qwen 2 set it per layer, None on
    full-attention layers), else its config's (Mistral uses one window on every layer)."""
    if hasattr(hf_attn, "sliding_window"):
        window = hf_attn.sliding_window
    else:
        window = getattr(getattr(hf_attn, "config", None), "sliding_window", None)
    return int(window) if window else None


@dataclass(frozen=True)
class ModelFacts:
    """What pages and analyses need to know about a model beyond its sizes.

    Attributes
    ----------
    windows : per layer the sliding window in keys, None = full attention.
    bos_id : the BOS token id the tokenizer prepends, None when it prepends none (then nothing is added).
    has_chat_template : whether prompts can be wrapped in the model's chat template.
    qk_norm : ``"per head"`` (Qwen 3, Gemma 3), ``"across heads"`` (OLMo 2) or None.
    positions : ``"RoPE"``, ``"partial RoPE"`` (a part of each head rotates) or ``"absolute"`` (GPT-2:
        positions are added to the residual stream, q and k are not rotated).
    """

    windows: tuple[int | None, ...]
    bos_id: int | None
    has_chat_template: bool
    qk_norm: str | None
    positions: str

    @property
    def adds_bos(self) -> bool:
        return self.bos_id is not None

    @property
    def windowed(self) -> bool:
        return any(self.windows)

    def window_label(self, layer: int) -> str:
        """``"window 4,096"`` or ``"full attention"`` for one layer (hover text on the grid)."""
        w = self.windows[layer]
        return f"sliding window {w:,} keys" if w else "full attention"

    @property
    def prompt_policy(self) -> str:
        """How a text becomes the tokens the model sees, in one line for the pages: whether a BOS is
        prepended (and then shown as token 0) and whether prompts go through a chat template, e.g.
        ``"BOS prepended (shown as token 0) · chat template: no (plain prompt)"``."""
        bos = "BOS prepended (shown as token 0)" if self.adds_bos else "no BOS (text read as written)"
        chat = "chat template: yes" if self.has_chat_template else "chat template: no (plain prompt)"
        return f"{bos} · {chat}"

    def run_policy(self, from_text: bool) -> str:
        """How a run's input became its tokens, in one line for the run's chip: a text is read as
        written, after the BOS the model expects, and never wrapped in the chat template (only
        needle-in-a-haystack prompts are, :attr:`prompt_policy`); token ids are used as given."""
        if not from_text:
            return "token ids as given (no BOS added, no chat template applied)"
        bos = "BOS prepended (shown as token 0)" if self.adds_bos else "no BOS"
        return f"{bos} · text as written, no chat template applied"

    @property
    def qk_label(self) -> str:
        """Which query and key vectors the QK page shows, in words."""
        steps = []
        if self.qk_norm:
            steps.append(f"QK-norm ({self.qk_norm})")
        if self.positions != "absolute":
            steps.append(self.positions)
        if not steps:
            return "q and k as projected (absolute positions: no rotation), what the logits are made of"
        return f"q and k after {' and '.join(steps)}, what the logits are made of"

    def run_windows(self) -> list[int | None] | None:
        """The windows as a run's settings record them: None when every layer is full attention
        (so runs of models without windows keep their keys)."""
        return list(self.windows) if self.windowed else None


def windowed_by_model(windows: Sequence[int | None] | None) -> str:
    """``"windowed by the model (W=512)"``: what marks a layer with a sliding window, in words (sizes
    joined by "/" when layers differ); "" when no layer has one."""
    sizes = sorted({int(w) for w in windows or () if w})
    return f"windowed by the model (W={'/'.join(f'{w:,}' for w in sizes)})" if sizes else ""


def window_note(windows: Sequence[int | None] | None, treatment: str) -> str:
    """``"w: windowed by the model (W=512): <treatment>"``, the line under a figure of a windowed
    model's layers (marked ``w``) saying how its number reads them; "" when no layer is windowed or
    the number reads such a layer like any other (``treatment`` "")."""
    marked = windowed_by_model(windows)
    return f"w: {marked}: {treatment}" if marked and treatment else ""


def bos_policy(tokenizer: Any) -> int | None:
    """The BOS id ``tokenizer`` prepends to a text when asked for its special tokens, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer that cannot encode plain text has no policy to read
        return None
    return int(bos) if with_special[: len(with_special) - len(plain)] == [bos] else None


def model_facts(model: Any) -> ModelFacts:
    """The :class:`ModelFacts` of a :class:`headscope.analysis.models.LoadedModel` (use ``model.facts``,
    which memoises this)."""
    from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import (
        JointQKVAttentionBridge,
    )

    blocks = list(model.bridge.blocks)
    windows = tuple(attention_window(b.attn.original_component) for b in blocks)
    attn = blocks[0].attn
    qk_norm = None
    if "q_norm" in getattr(attn, "submodules", {}):
        qk_norm = "across heads" if getattr(attn, "_qk_norm_phase", None) == "pre_reshape" else "per head"
    cfg = model.hf_model.config
    if type(attn) is JointQKVAttentionBridge or getattr(cfg, "model_type", "") == "gpt2":
        positions = "absolute"
    else:
        rope = getattr(cfg, "rope_parameters", None) or {}
        pct = getattr(cfg, "partial_rotary_factor", None) or (rope.get("partial_rotary_factor")
                                                              if isinstance(rope, dict) else None)
        positions = "partial RoPE" if pct and float(pct) < 1.0 else "RoPE"
    return ModelFacts(windows=windows, bos_id=bos_policy(model.tokenizer),
                      has_chat_template=bool(getattr(model.tokenizer, "chat_template", None)),
                      qk_norm=qk_norm, positions=positions)

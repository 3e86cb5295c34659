"""Tiny random-weight models of the architecture families statistics mode supports (no downloads).

Each builder returns a fresh Hugging Face causal LM (2 layers, hidden 64-128, GQA where the family
has it) with eager attention, sized for the embedded tokenizer's vocabulary. Tests wrap them with
:func:`headscope.analysis.models.wrap_model` as ``tests/conftest.py``'s ``tiny_model`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _llama(vocab: int, n_pos: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos))


def _mistral(vocab: int, n_pos: int) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos, sliding_window=7))


def _qwen2(vocab: int, n_pos: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos))


def _qwen3(vocab: int, n_pos: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=n_pos))


def _gemma2(vocab: int, n_pos: int) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=n_pos,
        sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0))


def _gemma3(vocab: int, n_pos: int) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=n_pos,
        sliding_window=6, query_pre_attn_scalar=256, layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"]))


def _gpt2(vocab: int, n_pos: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=n_pos))


def _stablelm(vocab: int, n_pos: int) -> Any:  # partial RoPE: a quarter of each head rotates
    from transformers import StableLmConfig, StableLmForCausalLM

    return StableLmForCausalLM(StableLmConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos, partial_rotary_factor=0.25))


def _olmo2(vocab: int, n_pos: int) -> Any:  # QK-norm over all heads at once, before the head split
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos))


def _phi3(vocab: int, n_pos: int) -> Any:  # fused qkv with RoPE: still refused by statistics mode
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_pos, pad_token_id=0))


#: The families statistics mode supports (the README's table).
FAMILIES: dict[str, Callable[[int, int], Any]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
    "gemma2": _gemma2, "gemma3": _gemma3, "gpt2": _gpt2, "stablelm": _stablelm, "olmo2": _olmo2,
}
#: Families the bridge boots but statistics mode refuses (full patterns only).
REFUSED: dict[str, Callable[[int, int], Any]] = {"phi3": _phi3}


def tiny_family_model(family: str, vocab_size: int, seed: int = 0, max_positions: int = 256) -> Any:
    """A fresh tiny random model of ``family`` (eager attention, eval mode). Biases (Qwen 2's q/k/v,
    GPT-2's) and norm weights get random values so that a path that drops them shows; query and
    key weights are scaled up so that heads attend sharply (near-uniform rows would make argmax
    comparisons a matter of rounding)."""
    torch.manual_seed(seed)
    model = {**FAMILIES, **REFUSED}[family](vocab_size, max_positions)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # biases and norm weights
                p.add_(torch.randn_like(p) * 0.2)
            elif any(part in name for part in ("q_proj", "k_proj", "c_attn", "qkv_proj")):
                p.mul_(8.0)
    model.config.architectures = [type(model).__name__]
    model.config._attn_implementation = "eager"
    return model.eval()

"""Hooks that force a model's decode: which key a head attends to at each step and which token it emits,
so a retrieval trial's copy-paste score and ROUGE gate can be checked against hand-computed values."""

from __future__ import annotations

import torch


def forcing_hooks(model, prompt, output):
    """Hooks that make head (0, 0) attend to the needle token it copies at each decode step, head
    (0, 1) attend to position 0, and the model emit ``output`` (then EOS)."""
    start, end = prompt.needle_span
    n_prompt = len(prompt.token_ids)
    eos = model.tokenizer.eos_token_id
    state = {"step": 0}

    def pattern(p, hook=None):
        if p.shape[-2] != 1:
            return None  # the prefill: untouched
        step = p.shape[-1] - n_prompt  # the first decode query sees exactly the prompt
        state["step"] = step
        p = p.clone()
        p[0, 0, -1, :] = 0
        p[0, 0, -1, start + min(step, end - start - 1)] = 1
        p[0, 1, -1, :] = 0
        p[0, 1, -1, 0] = 1
        return p

    def logits(x, hook=None):
        step = state["step"]
        target = output[step] if step < len(output) else eos
        x = torch.full_like(x, -1e4)
        x[..., target] = 1e4
        return x

    return [("blocks.0.attn.hook_pattern", pattern), ("unembed.hook_out", logits)]

"""An independent reference for the circuit attributions: plain PyTorch hooks on a Hugging Face Llama-style
model (``model.layers[l].self_attn``, ``input_layernorm``, ``model.norm``, ``lm_head``), computed here from the
model's own modules and weights with none of headscope's helpers."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def _hooked_run(hf, ids, modules):
    """Run ``hf`` on ``ids`` keeping the input of each module in ``modules`` (name → module)."""
    seen, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, kwargs, name=name: seen.__setitem__(
                name, (args[0] if args else kwargs["hidden_states"])[0].detach().double()),
            with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def reference_head_dla(hf, ids, answer, wrong):
    """``[layer, head]`` direct logit attribution of every head at the last position, and the model's own
    logit difference there: ``(z_h W_O^h) · (γ ⊙ (W_U[A] − W_U[B])) / σ`` with σ the final RMSNorm's scale."""
    layers = hf.model.layers
    cfg = hf.config
    n_heads = cfg.num_attention_heads
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    modules = {f"z{i}": layer.self_attn.o_proj for i, layer in enumerate(layers)}
    modules["final"] = hf.model.norm
    seen, logits = _hooked_run(hf, ids, modules)
    x = seen["final"][-1]
    sigma = torch.sqrt(x.pow(2).mean() + hf.model.norm.variance_epsilon)
    w_u = hf.lm_head.weight.detach().double()
    direction = hf.model.norm.weight.detach().double() * (w_u[answer] - w_u[wrong])
    out = torch.zeros(len(layers), n_heads, dtype=torch.float64)
    for i, layer in enumerate(layers):
        z = seen[f"z{i}"][-1]
        w_o = layer.self_attn.o_proj.weight.detach().double()
        for h in range(n_heads):
            part = slice(h * d_head, (h + 1) * d_head)
            out[i, h] = (w_o[:, part] @ z[part]) @ direction / sigma
    return out, float(logits[-1, answer] - logits[-1, wrong])


def reference_score(hf, ids, layer, head, query, key):
    """The pre-softmax score of head ``(layer, head)`` at ``(query, key)``: the model's q and k projections
    (hooked input of the layer's attention, through its input norm as the module applies it), RoPE from the
    model's rotary module at the two positions, ``q · k / √d_head``; and the embedding × embedding term
    of its decomposition with the input norm frozen at the run."""
    block = hf.model.layers[layer]
    attn = block.self_attn
    cfg = hf.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    seen, _ = _hooked_run(hf, ids, {"x": block.input_layernorm})
    x = seen["x"]  # [n, d_model], the residual stream at the layer's input
    norm = block.input_layernorm
    gamma = norm.weight.detach().double()
    sigma = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    positions = torch.arange(len(ids))[None]
    cos, sin = hf.model.rotary_emb(x[None].float(), positions)
    cos, sin = cos[0].double(), sin[0].double()
    g = head // (n_heads // n_kv)
    w_q = attn.q_proj.weight.detach().double()[head * d_head:(head + 1) * d_head]
    w_k = attn.k_proj.weight.detach().double()[g * d_head:(g + 1) * d_head]

    def score(vec_i, vec_j):
        q = (gamma * vec_i / sigma[query]) @ w_q.T
        k = (gamma * vec_j / sigma[key]) @ w_k.T
        q, _ = apply_rotary_pos_emb(q[None, None, None], q[None, None, None], cos[query][None], sin[query][None])
        _, k = apply_rotary_pos_emb(k[None, None, None], k[None, None, None], cos[key][None], sin[key][None])
        return float((q.reshape(-1) @ k.reshape(-1)) / d_head ** 0.5)

    emb = hf.model.embed_tokens.weight.detach().double()
    return score(x[query], x[key]), score(emb[ids[query]], emb[ids[key]])

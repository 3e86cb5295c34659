"""Edge attribution patching (Syed, Rager & Conmy 2023): with norms frozen, a sender → logits edge is the change
of that sender's direct logit attribution; every edge's score is the first-order effect of patching that edge
alone, checked by central differences with plain Hugging Face hooks on a float64 copy of the model; hostile
pairs are refused with a message."""

import numpy as np
import pytest
import torch

from headscope.analysis.edge_attribution import SITES, edge_attribution
from headscope.analysis.errors import InputError
from headscope.analysis.logit_attribution import direct_logit_attribution
from headscope.analysis.models import ModelError, wrap_model
from headscope.analysis.residual_components import capture_components
from tests.tiny_families import FAMILIES, tiny_family_model

CLEAN = [1, 5, 9, 200, 7, 8, 9, 10, 300, 301, 7, 8]
CORRUPTED = [1, 5, 9, 300, 7, 8, 9, 10, 200, 301, 7, 8]
ANSWER, WRONG = 9, 300


def _wrapped(family, tokenizer, seed=0, double=False):
    hf = tiny_family_model(family, len(tokenizer), seed=seed)
    if double:
        hf = hf.double()
    return wrap_model(hf, tokenizer, name=f"tiny-{family}", digest=f"tiny-{family}-seed{seed}-{double}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "olmo2", "gemma3"])
def test_sender_to_logits_edges_are_the_change_in_direct_logit_attribution_with_norms_frozen(family, embedded_tokenizer):
    model = _wrapped(family, embedded_tokenizer)
    result = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG], freeze_norms=True)
    last = len(CLEAN) - 1
    caps = [capture_components(model, ids, [last]) for ids in (CLEAN, CORRUPTED)]
    clean, corrupted = (direct_logit_attribution(model, ids, ANSWER, WRONG, capture=cap)
                        for ids, cap in zip((CLEAN, CORRUPTED), caps, strict=True))
    ratio = float(caps[1].final_sigma[0] / caps[0].final_sigma[0])  # the corrupted write through the clean scale
    size = np.abs(clean.values).sum()
    compared = 0
    for name in clean.names:
        if name == "bias":
            continue
        expected = corrupted.value(name) * ratio - clean.value(name)
        assert result.score(name, "logits", "logits") == pytest.approx(expected, abs=1e-5 * size), name
        compared += 1
    assert compared == 1 + model.n_layers * (model.n_heads + 1)
    assert result.clean == pytest.approx(clean.logit_diff, rel=1e-4)
    assert result.corrupted == pytest.approx(corrupted.logit_diff, rel=1e-4)


def _anatomy(hf):
    """Where a Hugging Face Llama or GPT-2 keeps what the reference needs: its blocks, each block's input norm,
    a head's write ``(z, layer, head) → [n, d]``, the projection of a site with that head's output columns,
    and the final norm. Linear weights are ``[out, in]``; GPT-2's Conv1D ``[in, out]`` and one fused c_attn."""
    n_heads = hf.config.num_attention_heads
    d_head = hf.config.hidden_size // n_heads
    if hasattr(hf, "transformer"):  # GPT-2
        blocks, d = hf.transformer.h, hf.config.hidden_size
        return {"blocks": blocks, "norm": lambda la: blocks[la].ln_1, "final": hf.transformer.ln_f,
                "o": lambda la: blocks[la].attn.c_proj,
                "write": lambda z, w, cols: z[:, cols] @ w.weight[cols, :],
                "proj": lambda la, site, head: (blocks[la].attn.c_attn, slice("qkv".index(site) * d + head * d_head,
                                                                              "qkv".index(site) * d + (head + 1) * d_head)),
                "apply": lambda m, x: x @ m.weight + m.bias, "d_head": d_head}
    blocks = hf.model.layers
    return {"blocks": blocks, "norm": lambda la: blocks[la].input_layernorm, "final": hf.model.norm,
            "o": lambda la: blocks[la].self_attn.o_proj,
            "write": lambda z, w, cols: z[:, cols] @ w.weight[:, cols].T,
            "proj": lambda la, site, head: (getattr(blocks[la].self_attn, f"{site}_proj"),
                                            slice(head * d_head, (head + 1) * d_head)),
            "apply": lambda m, x: torch.nn.functional.linear(x, m.weight, m.bias), "d_head": d_head}


def _hf_reference(hf, ids, *, sender=None, receiver=None, eps=0.0, delta=None):
    """Plain-hook run of a Hugging Face Llama or GPT-2: returns (logit difference, the sender's write [n, d]);
    with ``delta`` adds ``eps · delta`` to the copy of the residual stream read by ``receiver`` = (layer, head,
    site) only (site 'logits': the final norm's input)."""
    body = _anatomy(hf)
    seen, handles = {}, []
    if sender == "embed":  # what the first block reads
        handles.append(body["blocks"][0].register_forward_pre_hook(
            lambda m, a, k: seen.__setitem__("w", (a[0] if a else k["hidden_states"])[0]), with_kwargs=True))
    elif sender is not None and sender.startswith("mlp."):
        mlp = body["blocks"][int(sender[4:])].mlp
        handles.append(mlp.register_forward_hook(lambda m, a, out: seen.__setitem__("w", out[0])))
    elif sender is not None:
        la, h = map(int, sender.split("."))
        cols = slice(h * body["d_head"], (h + 1) * body["d_head"])
        handles.append(body["o"](la).register_forward_pre_hook(
            lambda m, a: seen.__setitem__("w", body["write"](a[0][0], m, cols))))
    if delta is not None:
        la, head, site = receiver
        if site == "logits":
            handles.append(body["final"].register_forward_pre_hook(lambda m, a: (a[0] + eps * delta,)))
        else:
            norm = body["norm"](la)
            handles.append(norm.register_forward_pre_hook(lambda m, a: None if "x" in seen else seen.update(x=a[0])))
            proj, cols = body["proj"](la, site, head)

            def swap(m, a, out):
                moved = body["apply"](m, norm(seen["x"] + eps * delta))
                out = out.clone()
                out[..., cols] = moved[..., cols]
                return out

            handles.append(proj.register_forward_hook(swap))
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
    finally:
        for handle in handles:
            handle.remove()
    return float(logits[ANSWER] - logits[WRONG]), seen.get("w")


def _float64_throughout(hf):
    """``hf`` in float64 with its RMSNorms and softmax computed in float64 too (Hugging Face's eager path upcasts
    them to float32, whose rounding, divided by a small ε, would swamp a central difference)."""
    hf = hf.double()
    hf.config._attn_implementation = "sdpa"
    for module in hf.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = (lambda x, m=module: m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                              + m.variance_epsilon))
    return hf


EDGES = [("llama", "0.1", (1, 2, "q"), "1.2"), ("llama", "0.3", (1, 0, "k"), "1.0"),
         ("llama", "0.0", (1, 1, "v"), "1.1"), ("llama", "embed", (0, 3, "q"), "0.3"),
         ("llama", "embed", (1, 1, "k"), "1.1"), ("llama", "mlp.0", (1, 0, "v"), "1.0"),
         ("llama", "1.2", (2, 0, "logits"), "logits"), ("llama", "mlp.1", (2, 0, "logits"), "logits"),
         ("gpt2", "0.2", (1, 2, "v"), "1.2"), ("gpt2", "0.0", (1, 1, "k"), "1.1"), ("gpt2", "embed", (0, 1, "q"), "0.1"),
         ("gpt2", "embed", (0, 0, "k"), "0.0"), ("gpt2", "1.0", (2, 0, "logits"), "logits"),
         ("gpt2", "mlp.1", (2, 0, "logits"), "logits")]


@pytest.mark.parametrize("family,sender,receiver,name", EDGES)
def test_each_score_is_the_first_order_effect_of_patching_that_edge_alone(family, sender, receiver, name,
                                                                           embedded_tokenizer):
    """Central differences on a float64 copy: d/dε m(clean, with ε (a_s^corrupt − a_s^clean) added to the one
    input of the receiver) at ε = 0 equals the score; Llama's RMSNorm and GQA (k/v receivers are key-value heads),
    GPT-2's LayerNorm (centred) and fused c_attn."""
    model = _wrapped(family, embedded_tokenizer, seed=2, double=True)
    result = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG])
    hf = _float64_throughout(tiny_family_model(family, len(embedded_tokenizer), seed=2))
    _, clean_write = _hf_reference(hf, CLEAN, sender=sender)
    _, corrupted_write = _hf_reference(hf, CORRUPTED, sender=sender)
    delta = corrupted_write - clean_write
    eps = 1e-4
    up, _ = _hf_reference(hf, CLEAN, receiver=receiver, eps=eps, delta=delta)
    down, _ = _hf_reference(hf, CLEAN, receiver=receiver, eps=-eps, delta=delta)
    slope = (up - down) / (2 * eps)
    score = result.score(sender, name, receiver[2])
    assert abs(score) > 1e-4, "an edge with no effect checks nothing"
    assert score == pytest.approx(slope, rel=1e-5, abs=1e-9)


def test_the_table_has_every_edge_once_sorted_and_swapping_the_answers_negates_it(embedded_tokenizer):
    model = _wrapped("llama", embedded_tokenizer)
    result = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG])
    keys = list(zip(result.senders, result.receivers, result.sites, strict=True))
    assert len(set(keys)) == len(keys)
    senders = 1 + model.n_layers * (model.n_heads + 1)  # embed, heads, MLPs
    into_heads = sum((1 + layer * (model.n_heads + 1)) * (model.n_heads + 2 * model.n_kv_heads)
                     for layer in range(model.n_layers))
    assert len(keys) == into_heads + senders
    assert set(result.sites) == set(SITES)
    assert {r for r, s in zip(result.receivers, result.sites, strict=True) if s == "k"} == {"0.0", "0.1", "1.0", "1.1"}
    assert np.all(np.diff(np.abs(result.scores)) <= 0)
    for s, r, site in keys:  # a sender writes before its receiver reads
        if site != "logits":
            assert s == "embed" or int(s.split(".")[-1 if s.startswith("mlp.") else 0]) < int(r.split(".")[0])
    swapped = edge_attribution(model, CLEAN, CORRUPTED, [WRONG, ANSWER])
    for s, r, site, v in result.rows(10):
        assert swapped.score(s, r, site) == pytest.approx(-v, rel=1e-5, abs=1e-7)


HOSTILE = [
    ("texts of different token lengths", "When Mary and John went", "When Mary went", [" Mary", " John"]),
    ("token ids of different lengths", CLEAN, CORRUPTED[:-1], [ANSWER, WRONG]),
    ("an empty clean text", "", "When Mary and John went", [" Mary", " John"]),
    ("an empty corrupted text", "When Mary and John went", "", [" Mary", " John"]),
    ("a text of spaces", "   ", "   ", [" Mary", " John"]),
    ("an answer of several tokens", "When Mary and John went", "When John and Mary went",
     [" Mary Elizabeth Montgomery", " John"]),
    ("an empty answer", "When Mary and John went", "When John and Mary went", ["", " John"]),
    ("one answer only", CLEAN, CORRUPTED, [ANSWER]),
    ("three answers", CLEAN, CORRUPTED, [ANSWER, WRONG, 7]),
    ("the same answer twice", CLEAN, CORRUPTED, [ANSWER, ANSWER]),
    ("identical prompts", CLEAN, CLEAN, [ANSWER, WRONG]),
    ("an answer outside the vocabulary", CLEAN, CORRUPTED, [ANSWER, 10**9]),
    ("a negative token id", [-1, *CLEAN[1:]], CORRUPTED, [ANSWER, WRONG]),
    ("a token id past the vocabulary", [10**9, *CLEAN[1:]], CORRUPTED, [ANSWER, WRONG]),
    ("a token id that is not whole", [1.5, *CLEAN[1:]], CORRUPTED, [ANSWER, WRONG]),
    ("a token id that is a bool", [True, *CLEAN[1:]], CORRUPTED, [ANSWER, WRONG]),
    ("token ids nested in lists", [[1, 2]] * len(CLEAN), CORRUPTED, [ANSWER, WRONG]),
    ("an answer that is a bool", CLEAN, CORRUPTED, [True, WRONG]),
    ("an answer that is None", CLEAN, CORRUPTED, [None, WRONG]),
    ("an answer that is not whole", CLEAN, CORRUPTED, [9.5, WRONG]),
    ("the answers as one string", CLEAN, CORRUPTED, " Mary"),
    ("a lone surrogate in the text", "When \ud800 Mary", "When \ud800 John", [" Mary", " John"]),
]


@pytest.mark.parametrize("what,clean,corrupted,answers", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_pairs_are_refused_with_a_message(what, clean, corrupted, answers, tiny_model):
    with pytest.raises((InputError, ModelError)) as e:
        edge_attribution(tiny_model, clean, corrupted, answers)
    assert "Traceback" not in str(e.value) and len(str(e.value)) > 20


def test_the_model_is_left_as_it_was(embedded_tokenizer):
    """No gradient is stored on the weights, no hook stays, and the frozen scales do not leak into the next run."""
    model = _wrapped("gpt2", embedded_tokenizer, seed=4)
    with torch.inference_mode():
        before = model.bridge(torch.tensor([CLEAN]), return_type="logits")
    edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG], freeze_norms=True)
    with torch.inference_mode():
        after = model.bridge(torch.tensor([CLEAN]), return_type="logits")
    assert torch.equal(before, after)
    assert all(p.grad is None for p in model.bridge.parameters())
    assert not any(h.fwd_hooks for h in model.bridge.hook_dict.values())


@pytest.mark.integration
def test_the_largest_edges_of_an_ioi_pair_agree_with_exact_path_patching(real_model):
    """The five largest head → head edges on the embedded model's IOI pair: each has the sign of its exact path
    patch (noising, MLPs frozen: that edge alone) and is within a factor of three of it (the full table:
    bench/edge_attribution_vs_path_patching.py)."""
    from headscope.analysis.patching_pairs import pair_by_id
    from headscope.analysis.path_patching import path_patching

    pair = pair_by_id("ioi-mary-john")
    result = edge_attribution(real_model, pair.clean, pair.corrupted, list(pair.answers))
    assert result.clean > 0 > result.corrupted
    heads = [row for row in result.rows() if row[2] != "logits" and row[0] != "embed" and not row[0].startswith("mlp.")]
    for sender, receiver, site, score in heads[:5]:
        exact = path_patching(real_model, pair.clean, pair.corrupted, list(pair.answers),
                              [tuple(map(int, sender.split(".")))], [tuple(map(int, receiver.split(".")))], site=site,
                              direction="noise", freeze_mlps=True)
        effect = exact.raw - exact.clean
        assert np.sign(effect) == np.sign(score) and 1 / 3 < score / effect < 3, (sender, receiver, site, score, effect)


def _bridge_slope(model, sender, layer, head, site, eps=3e-2):
    """Central difference through the bridge itself: the sender's write difference (from
    :func:`capture_components`, corrupted − clean) moved by ±ε into the input of one head's ``site`` projection
    only (recomputed from the block's own input norm module and the projection's weights)."""
    from headscope.analysis.residual_components import affine_map

    n = len(CLEAN)
    writes = []
    for ids in (CLEAN, CORRUPTED):
        names, vectors = capture_components(model, ids, range(n)).components(model.n_layers, range(n))
        writes.append(vectors[:, names.index(sender)])
    delta = writes[1] - writes[0]
    block = model.bridge.blocks[layer]
    norm = getattr(block, "ln1", None)
    w, b = affine_map(getattr(block.attn, site))

    def run(e):
        seen = {}

        def grab(t, hook=None):
            seen["x"] = t[0].detach().double()

        def swap(t, hook=None):
            x = seen["x"] + e * delta
            y = norm.original_component(x).double() if norm is not None else x
            t = t.clone()
            t[0, :, head] = (y @ w + b).reshape(n, -1, model.d_head)[:, head].to(t.dtype)
            return t

        where = f"blocks.{layer}.ln1.hook_in" if norm is not None else f"blocks.{layer}.attn.hook_in"
        with torch.no_grad():
            logits = model.bridge.run_with_hooks(torch.tensor([CLEAN]), return_type="logits",
                                                 fwd_hooks=[(where, grab), (f"blocks.{layer}.attn.{site}.hook_out", swap)])
        return float(logits[0, -1, ANSWER] - logits[0, -1, WRONG])

    return (run(eps) - run(-eps)) / (2 * eps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_largest_edges_are_first_order_patching_effects(family, embedded_tokenizer):
    """The three largest q/k/v edges of each family (Gemma's offset norms and post-norms, QK-norm, partial RoPE,
    OLMo 2 without an input norm) against a central difference through the bridge, on a float64 copy (the
    bridge's norms and softmax round in float32, hence 1 %)."""
    model = _wrapped(family, embedded_tokenizer, seed=2, double=True)
    result = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG])
    for sender, receiver, site, score in [row for row in result.rows() if row[2] != "logits"][:3]:
        layer, head = map(int, receiver.split("."))
        assert score == pytest.approx(_bridge_slope(model, sender, layer, head, site), rel=1e-2), (sender, receiver, site)


def test_scores_summed_over_chunks_of_positions_equal_one_chunk(embedded_tokenizer, monkeypatch):
    """Memory stays bounded on long texts: positions go in chunks; a chunk of one position gives the same table."""
    from headscope.analysis import edge_attribution as module

    model = _wrapped("gemma2", embedded_tokenizer)
    whole = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG])
    monkeypatch.setattr(module, "CHUNK_BYTES", 1)
    chunked = edge_attribution(model, CLEAN, CORRUPTED, [ANSWER, WRONG])
    one = {(s, r, site): v for s, r, site, v in whole.rows()}
    many = {(s, r, site): v for s, r, site, v in chunked.rows()}
    assert one.keys() == many.keys()
    np.testing.assert_allclose([many[k] for k in one], list(one.values()), rtol=1e-9, atol=1e-12)

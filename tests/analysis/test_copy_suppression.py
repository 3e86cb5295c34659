"""Copy suppression (McDougall et al. 2023) against a tiny model whose weights make the answer a number
worked by hand, a brute-force loop over heads, queries and sources on random weights, the model's own
logits (the frozen final norm), and the embedded model."""

import numpy as np
import pytest
import torch

from headscope.analysis.copy_suppression import copy_suppression, logit_directions
from headscope.analysis.errors import InputError
from headscope.analysis.models import wrap_model
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES, score_run

EPS = 1e-6
IDS = [11, 12, 13, 11, 12, 14]  # four distinct tokens, two of them repeated


def _one_layer_llama(vocab: int, hidden: int, head_dim: int):
    """One layer, 4 query heads on 2 key-value groups, no MLP output (down_proj = 0), queries 0 (so every
    head attends uniformly to the keys it may see: A[i, j] = 1 / (i + 1))."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=EPS,
                         max_position_embeddings=64, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.model.layers[0].self_attn.q_proj.weight.zero_()
        hf.model.layers[0].mlp.down_proj.weight.zero_()
    return hf


@pytest.fixture(scope="module")
def hand_model(embedded_tokenizer):
    """Embeddings 2·e_k (one axis per token used, every other row 0), the unembedding equal to them;
    group 0's value is the normalised input (W_V = I), group 1's is 0; head 0 writes −v (W_O = −I),
    head 1 writes +v, heads 2 and 3 (group 1) write whatever, of nothing. Norm weights 1."""
    vocab, d = len(embedded_tokenizer), 8
    hf = _one_layer_llama(vocab, d, head_dim=d)
    attn = hf.model.layers[0].self_attn
    with torch.no_grad():
        hf.model.embed_tokens.weight.zero_()
        for k, t in enumerate(sorted(set(IDS))):
            hf.model.embed_tokens.weight[t, k] = 2.0
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
        attn.v_proj.weight.zero_()
        attn.v_proj.weight[:d] = torch.eye(d)  # group 0: v = the normalised input; group 1: 0
        attn.o_proj.weight[:, :d] = -torch.eye(d)  # head 0 writes −v
        attn.o_proj.weight[:, d : 2 * d] = torch.eye(d)  # head 1 writes +v
        for norm in (hf.model.layers[0].input_layernorm, hf.model.norm):
            norm.weight.fill_(1.0)
    return wrap_model(hf, embedded_tokenizer, name="tiny-copy-suppression", digest="tiny-copy-suppression-hand")


def test_a_head_writing_minus_the_attended_token_scores_as_worked_by_hand(hand_model, embedded_tokenizer):
    """Worked by hand. Every used row of E is 2·e_k, so mean(E[t]²) = 4/8 and the normalised input is
    E[t] / √(0.5 + ε); heads 0 and 1 cancel in the residual stream, heads 2 and 3 read zeros and the MLP
    writes nothing, so the final norm's scale is σ_i = √(0.5 + ε) at every position. Head 0 sends
    −A[i, j] E[t_j] / √(0.5 + ε) from each source, whose effect on the logit of t_j against the mean
    logit is −A[i, j] · E[t_j] · (E[t_j] − Ē) / (0.5 + ε), with E[t_j] · E[t_j] = 4 and E[t_j] · Ē = 4/V
    (Ē: the mean row; each axis has one token). Row i's weights sum to 1, so for every query
    CS(head 0) = (4 − 4/V) / (0.5 + ε) ≈ 8: the head suppresses what it attends to, by 8 logits.
    Head 1 copies: the same, negative. Heads 2 and 3 read group 1, whose values are 0: exactly 0
    (reading the groups as h mod G instead of ⌊h / (H/G)⌋ would give head 1 zero and head 2 eight)."""
    vocab = len(embedded_tokenizer)
    by_hand = (4 - 4 / vocab) / (0.5 + EPS)
    got = copy_suppression(hand_model, IDS)
    assert got.shape == (1, 4)
    np.testing.assert_allclose(got[0], [by_hand, -by_hand, 0.0, 0.0], rtol=1e-5, atol=1e-9)


def _random_one_layer(embedded_tokenizer, seed: int):
    torch.manual_seed(seed)
    hf = _one_layer_llama(len(embedded_tokenizer), hidden=16, head_dim=8)
    with torch.no_grad():
        attn = hf.model.layers[0].self_attn
        attn.q_proj.weight.normal_(0, 0.5)  # non-uniform attention
        for norm in (hf.model.layers[0].input_layernorm, hf.model.norm):
            norm.weight.uniform_(0.5, 1.5)
    return hf, wrap_model(hf, embedded_tokenizer, name="tiny-copy-random", digest=f"tiny-copy-random-{seed}")


def _rms_normed(x, weight):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS) * weight


def test_random_weights_equal_a_brute_force_loop_over_heads_queries_and_sources(embedded_tokenizer):
    """Random weights and non-uniform attention: the values, the residual stream and the final norm's
    scale are recomputed from the weights in numpy (the model's logits confirm them), and the score is
    summed term by term, e(i, j) for every head, query and source, as the module docstring defines it."""
    from headscope.analysis.capture import capture

    hf, model = _random_one_layer(embedded_tokenizer, seed=3)
    ids = [5, 900, 31, 5, 77, 900, 5, 31]
    n, H, G = len(ids), 4, 2
    weight = lambda p: p.detach().double().numpy()  # noqa: E731
    layer = hf.model.layers[0]
    E, W_lm = weight(hf.model.embed_tokens.weight), weight(hf.lm_head.weight)
    W_v, W_o = weight(layer.self_attn.v_proj.weight), weight(layer.self_attn.o_proj.weight)
    gamma = weight(hf.model.norm.weight)
    A = capture(model, ids, pattern_dtype="float32").patterns[0].astype(np.float64)  # [head, i, j]
    x0 = E[ids]
    v = (_rms_normed(x0, weight(layer.input_layernorm.weight)) @ W_v.T).reshape(n, G, 8)
    head_out = [[v[j, h // (H // G)] @ W_o[:, 8 * h : 8 * h + 8].T for j in range(n)] for h in range(H)]
    x = x0 + np.einsum("hij,hjm->im", A, np.asarray(head_out))
    sigma = np.sqrt((x**2).mean(-1) + EPS)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(logits, (x / sigma[:, None] * gamma) @ W_lm.T, atol=1e-4)
    mean_row = W_lm.mean(0)
    want = np.zeros(H)
    for h in range(H):
        total = 0.0
        for i in range(n):
            for j in range(i + 1):
                total += A[h, i, j] * (head_out[h][j] * gamma / sigma[i]) @ (W_lm[ids[j]] - mean_row)
        want[h] = -total / n
    np.testing.assert_allclose(copy_suppression(model, ids)[0], want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gemma3", "qwen2"])
def test_the_frozen_final_norm_reproduces_the_models_logits(embedded_tokenizer, family):
    """``c · ũ_j / σ_i`` is the final norm frozen at the run and the unembedding, against the mean logit:
    the whole residual stream through it gives the model's own logits (before any soft-capping) up to
    a shift per position, on RMSNorm (γ and 1 + γ) and LayerNorm (centred) families alike."""
    from headscope.analysis.token_predictions import final_hidden_state
    from tests.tiny_families import tiny_family_model

    model = wrap_model(tiny_family_model(family, len(embedded_tokenizer)), embedded_tokenizer,
                       name=f"tiny-{family}", digest=f"tiny-{family}-copy-suppression")
    ids = model.encode("The cat sat on the mat, and the cat sat again.")
    kept = {}

    def keep(name):
        def hook(tensor, hook=None):
            kept[name] = tensor[0].detach().double()

        return hook

    with torch.inference_mode(), final_hidden_state(model) as final:
        model.bridge.run_with_hooks(torch.tensor([ids]), return_type=None,
                                    fwd_hooks=[("ln_final.hook_in", keep("x")), ("ln_final.hook_scale", keep("s"))])
        logits = model.hf_model.get_output_embeddings()(final.hidden).double()  # before any soft-capping
    vocab_ids = list(range(0, len(embedded_tokenizer), 97))  # every 97th token: a spread of directions
    u = logit_directions(model, vocab_ids).double()
    linear = kept["x"] @ u.T / kept["s"]  # [n, tokens]
    own = logits[:, vocab_ids] - logits.mean(-1, keepdim=True)
    bias = own - linear  # the norm's bias and the unembedding's: one shift per token, the same at every position
    np.testing.assert_allclose(bias.numpy(), np.broadcast_to(bias[:1].numpy(), bias.shape), atol=1e-4)


def test_every_head_of_the_embedded_model_gets_a_finite_score_through_the_registry(real_model):
    """SmolLM2-135M (30 layers × 9 query heads on 3 groups): finite, and the same number whether the
    run kept patterns or statistics; the Attention page, Compare and Ablation offer it on either."""
    from headscope.analysis.capture import capture
    from headscope.analysis.statistics_run import capture_statistics

    text = "When Mary and John went to the store, John gave a drink to Mary. Mary thanked John."
    run, stats = capture(real_model, text), capture_statistics(real_model, text)
    got = score_run(run, "copy_suppression", real_model)
    assert got.shape == (30, 9) and np.isfinite(got).all()
    np.testing.assert_allclose(score_run(stats, "copy_suppression", real_model), got, atol=1e-5)
    assert "copy_suppression" in RUN_SCORES and "copy_suppression" in run.metrics and "copy_suppression" in stats.metrics
    assert HEAD_SCORES["copy_suppression"].signed and (got > 0).any() and (got < 0).any()


def test_what_cannot_be_scored_says_why(hand_model, monkeypatch):
    """Hostile inputs: nothing, ids outside the vocabulary, a text past the limit, and a run of other
    weights each get a message naming what to do; none reaches torch as an index error."""
    with pytest.raises(InputError, match="empty"):
        copy_suppression(hand_model, [])
    for bad in ([-1, 5], [5, hand_model.vocab_size], [5, 2**40]):
        with pytest.raises(InputError, match="not in the model's vocabulary"):
            copy_suppression(hand_model, bad)
    monkeypatch.setenv("HEADSCOPE_MAX_TOKENS", "4")
    with pytest.raises(InputError, match="HEADSCOPE_MAX_TOKENS"):
        copy_suppression(hand_model, IDS)
    with pytest.raises(InputError, match="needs the model"):
        HEAD_SCORES["copy_suppression"].compute(None, IDS)


def test_it_is_offered_wherever_a_score_of_a_text_is(tiny_model):
    """Through the registry alone: the Attention and Compare metric, the Ablation and Compress rankings,
    links, the command line and the score tables over a sweep's prompts (the Heads page) all have it."""
    from headscope.analysis.head_scores import ScoredPrompt, score_prompts
    from headscope.analysis.kv_compression import build_policy
    from headscope.analysis.kv_compression_choices import RANKINGS
    from headscope.app.cli import build_parser
    from headscope.app.url_state import parse
    from headscope.app.views.ablation import RANK_LABELS

    state = parse("?metric=copy_suppression&by=copy_suppression&score=copy_suppression")
    assert (state.metric, state.by, state.score, state.problems) == ("copy_suppression",) * 3 + ([],)
    assert RANK_LABELS["copy_suppression"] == "Copy suppression" and "copy_suppression" in RANKINGS
    assert build_parser().parse_args(["compress", "--rankings", "copy_suppression,random"]).rankings[0] == "copy_suppression"
    scores = score_prompts(tiny_model, [ScoredPrompt(tiny_model.encode("The cat sat on the mat. The cat sat."))])
    table = scores.mean["copy_suppression"]
    np.testing.assert_allclose(table, copy_suppression(tiny_model, tiny_model.encode("The cat sat on the mat. The cat sat.")))
    policy = build_policy(tiny_model, "copy_suppression", 0.5, {"copy_suppression": table})
    group_max = table.reshape(2, 2, 2).max(-1)  # 4 query heads on 2 groups per layer
    assert policy.n_full == 2 and group_max[policy.full].min() >= group_max[~policy.full].max()


def test_its_grid_exports_with_its_numbers_and_a_scale_centred_at_zero(real_model, tmp_path):
    """The Attention page's grid of it, exported as ``headscope run`` and the page's export bar write it."""
    import json

    from headscope.analysis.capture import capture
    from headscope.app.export import write_files
    from headscope.app.views import VIEWS, names

    run = capture(real_model, "The keys to the cabinet are on the table. The keys are")
    write_files(run, names.HEAD_GRID, {"metric": "copy_suppression"}, tmp_path, ("svg",))
    rows = json.loads((tmp_path / f"{names.HEAD_GRID}.json").read_text())
    svg = (tmp_path / f"{names.HEAD_GRID}.svg").read_text()
    assert "Copy suppression" in svg
    got = np.array([[r["value"] for r in rows if r["layer"] == la] for la in range(30)])
    np.testing.assert_allclose(got, copy_suppression(real_model, run.token_ids), atol=1e-6)
    assert {r["metric"] for r in rows} == {"copy_suppression"}
    figure, _ = VIEWS[names.HEAD_GRID].build(run, {"metric": "copy_suppression"})
    assert figure.data[0].zmid == 0  # signed: a diverging scale centred at 0


@pytest.mark.parametrize("query", ["?metric=copy_suppression%00", "?metric=COPY_SUPPRESSION", "?by=copy%5Fsuppression%20",
                                   "?score=copy_suppression%3Cb%3E", "?metric=copy_suppression" + "x" * 5000])
def test_a_mangled_link_to_it_is_reported_not_followed(query):
    from headscope.app.url_state import parse

    state = parse(query)
    assert (state.metric, state.by, state.score) == ("entropy", "retrieval", "streaming")
    assert len(state.problems) == 1 and len(state.problems[0]) < 300

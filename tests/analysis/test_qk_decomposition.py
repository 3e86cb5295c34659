"""Tests for analysis/qk_decomposition.py: contrastive covariances, rank and subspaces, attribution,
intervention, label files, W_QK spectra and effective rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.linalg import subspace_angles

from headscope.analysis.errors import InputError
from headscope.analysis.paths import DATA_DIR
from headscope.analysis.qk_collect import ProbeTask, collect_head, load_probe_tasks
from headscope.analysis.qk_decomposition import (
    FeaturePairs,
    LabelFeature,
    LabelFileError,
    ablate_query_subspace,
    attribute_logits,
    attribute_sentence,
    contrastive_covariance,
    decompose,
    decompose_head,
    effective_rank,
    feature_pairs,
    intervention_effect,
    parse_label_csv,
    token_labels,
    wqk_spectra,
)
from tests.analysis.synthetic_heads import synthetic_head

D = 32


def _orthonormal(rng, d, r):
    return np.linalg.qr(rng.normal(size=(d, r)))[0]


def planted(rank: int, *, seed: int = 0, shared: bool = False, n_sentences: int = 300, length: int = 12,
            n_categories: int = 6, noise: float = 0.3):
    """Queries and keys with a known rank-``rank`` interaction for a categorical feature.

    Each token carries a category z (the same/different relation between a query's z and a key's z is
    the binary feature). q = A_q c(z) + B_q w + noise, k = A_k c(z) + B_k w' + noise, with c(z) ∈ R^rank
    (centred category codes), w, w' a nuisance latent. ΔC ∝ A_q M A_kᵀ with M of rank ``rank``:
    query subspace col(A_q), key subspace col(A_k). ``shared`` makes A_k = A_q (the feature then
    raises the logits of positive pairs).
    """
    rng = np.random.default_rng(seed)
    # centred, orthogonal category codes: E[c cᵀ] = 4 I, so every planted direction is equally strong
    codes = rng.normal(size=(n_categories, rank))
    codes = np.linalg.qr(codes - codes.mean(0))[0] * 2.0 * np.sqrt(n_categories)
    a_q = _orthonormal(rng, D, rank)
    a_k = a_q if shared else _orthonormal(rng, D, rank)
    b_q, b_k = _orthonormal(rng, D, 4), _orthonormal(rng, D, 4)
    lengths = [length] * n_sentences
    n = sum(lengths)
    z = rng.integers(n_categories, size=n)
    w = rng.normal(size=(n, 4))
    q = codes[z] @ a_q.T + w @ b_q.T + noise * rng.normal(size=(n, D))
    k = codes[z] @ a_k.T + rng.normal(size=(n, 4)) @ b_k.T + noise * rng.normal(size=(n, D))
    return q.astype(np.float32), k.astype(np.float32), lengths, z, a_q, a_k


def brute_pairs(lengths, z) -> FeaturePairs:
    """All causal pairs (key strictly before query) of queries with a positive and a negative key."""
    qi, kj, pos = [], [], []
    start = 0
    for m in lengths:
        for i in range(start + 1, start + m):
            keys = list(range(start, i))
            same = [z[j] == z[i] for j in keys]
            if any(same) and not all(same):
                qi += [i] * len(keys)
                kj += keys
                pos += same
        start += m
    return FeaturePairs("planted", np.array(qi), np.array(kj), np.array(pos, dtype=bool))


@pytest.mark.parametrize("rank", [1, 3])
def test_planted_rank_and_subspaces_are_recovered(rank):
    q, k, lengths, z, a_q, a_k = planted(rank)
    pairs = brute_pairs(lengths, z)
    dc = decompose(q, k, pairs, seed=0)
    assert dc.rank == rank
    assert np.degrees(subspace_angles(dc.query_basis, a_q)).max() < 5
    assert np.degrees(subspace_angles(dc.key_basis, a_k)).max() < 5
    assert dc.singular_values[rank] < dc.null_threshold < dc.singular_values[rank - 1]
    energy = decompose(q, k, pairs, criterion="energy", energy=0.8)
    assert energy.rank == rank


def test_no_feature_no_rank():
    rng = np.random.default_rng(1)
    lengths = [12] * 100
    n = sum(lengths)
    q, k = rng.normal(size=(n, D)), rng.normal(size=(n, D))
    z = rng.integers(4, size=n)  # labels unrelated to the vectors
    assert decompose(q, k, brute_pairs(lengths, z), seed=0).rank == 0


def test_contrastive_covariance_is_the_difference_of_pair_means():
    q, k, lengths, z, *_ = planted(2, n_sentences=5)
    q, k = q.astype(np.float64), k.astype(np.float64)
    pairs = brute_pairs(lengths, z)
    delta, c_pos, c_neg = contrastive_covariance(q, k, pairs)
    pos = [np.outer(q[i], k[j]) for i, j, p in zip(pairs.query_index, pairs.key_index, pairs.positive, strict=True) if p]
    neg = [np.outer(q[i], k[j]) for i, j, p in zip(pairs.query_index, pairs.key_index, pairs.positive, strict=True) if not p]
    np.testing.assert_allclose(c_pos, np.mean(pos, axis=0), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(delta, np.mean(pos, axis=0) - np.mean(neg, axis=0), rtol=1e-6, atol=1e-9)


def test_feature_pairs_match_brute_force():
    q, k, lengths, z, *_ = planted(1, n_sentences=20)
    head = synthetic_head(q, k, lengths, tokens=[f"c{c}" for c in z])
    feature = parse_label_csv(
        "feature,side,label,match\n" + "".join(f"cat,both,L{c},token:c{c}\n" for c in range(6))
    )["cat"]
    assert isinstance(feature, LabelFeature) and len(feature.rules) == 6
    got = feature_pairs(head, feature)
    ref = brute_pairs(lengths, z)
    as_set = lambda p: set(zip(p.query_index.tolist(), p.key_index.tolist(), p.positive.tolist(), strict=True))  # noqa: E731
    assert as_set(got) == as_set(ref)
    # decompose_head reads the same pairs
    np.testing.assert_allclose(decompose_head(head, feature).delta_c, decompose(q, k, ref).delta_c)


def test_same_and_previous_token_pairs():
    ids = np.array([5, 6, 5, 7, 6, 5])
    head = synthetic_head(np.zeros((6, 4)), np.zeros((6, 4)), [6], token_ids=ids)
    same = feature_pairs(head, "same_token")
    pos = set(zip(same.query_index[same.positive].tolist(), same.key_index[same.positive].tolist(), strict=True))
    assert pos == {(2, 0), (4, 1), (5, 0), (5, 2)}
    prev = feature_pairs(head, "previous_token")
    pos = set(zip(prev.query_index[prev.positive].tolist(), prev.key_index[prev.positive].tolist(), strict=True))
    assert pos == {(i, i - 1) for i in range(2, 6)}  # position 1 has no negative key
    assert prev.n_negative == sum(i - 1 for i in range(2, 6))


def test_attribution_terms_sum_to_the_logit_exactly():
    q, k, lengths, z, a_q, a_k = planted(2, shared=True)
    pairs = brute_pairs(lengths, z)
    dc = decompose(q, k, pairs)
    rng = np.random.default_rng(9)
    other = decompose(q, k, FeaturePairs("other", pairs.query_index, pairs.key_index, rng.permutation(pairs.positive)),
                      rank=3)  # overlaps nothing in particular: exercises the cross terms
    qp, kp = q[pairs.query_index].astype(np.float64), k[pairs.key_index].astype(np.float64)
    att = attribute_logits(qp, kp, [dc, other], scale=1 / np.sqrt(D))
    np.testing.assert_allclose(att.total(), att.logits, atol=1e-9)
    np.testing.assert_allclose(att.logits, np.einsum("pd,pd->p", qp, kp) / np.sqrt(D), rtol=1e-6)
    # the shared planted feature raises positive logits: its term separates the two conditions
    term = att.terms["planted"]
    assert term[pairs.positive].mean() > term[~pairs.positive].mean() + 1.0
    grid = attribute_sentence(synthetic_head(q, k, lengths), 0, [dc])
    total = grid["planted"] + grid["cross"] + grid["residual"]
    np.testing.assert_allclose(total[np.tril_indices(12)], grid["logits"][np.tril_indices(12)], atol=1e-9)


def test_projecting_the_feature_out_of_the_queries_removes_its_attention():
    q, k, lengths, z, *_ = planted(2, shared=True, noise=0.1)
    q = q * 6  # sharper attention
    head = synthetic_head(q, k, lengths)
    pairs = brute_pairs(lengths, z)
    dc = decompose(q, k, pairs)
    effect = intervention_effect(head, dc, pairs)
    # (the rest of each row goes to the query's own key, which also shares its category)
    assert effect.positive_before > effect.negative_before + 0.1
    assert effect.positive_after < effect.positive_before - 0.15
    assert effect.negative_after > effect.positive_after
    nothing = ablate_query_subspace(head, np.zeros((D, 0)), 0)
    np.testing.assert_allclose(nothing.after, nothing.before, atol=1e-12)


def test_decompositions_are_deterministic_with_a_seed():
    q, k, lengths, z, *_ = planted(2, noise=1.5)
    pairs = brute_pairs(lengths, z)
    a, b = decompose(q, k, pairs, seed=3), decompose(q, k, pairs, seed=3)
    np.testing.assert_array_equal(a.null_top, b.null_top)
    assert a.rank == b.rank


# ---------------------------------------------------------------------------------------------
# Labels


def test_example_label_file_parses_and_labels_words(tiny_model):
    features = parse_label_csv(DATA_DIR / "probes" / "labels_example.csv")
    assert {"colour", "animal", "sound_to_animal", "article"} <= set(features)
    sentences = ["The red fox and the blue whale met.", "The lion roared at the horse."]
    head = collect_head(tiny_model, sentences, layer=0, head=0)
    q_lab, k_lab = token_labels(head, features["colour"])
    labelled = [head.tokens[i] for i, lab in enumerate(k_lab) if lab == "colour"]
    assert labelled == ["·red", "·blue"]
    q_lab, k_lab = token_labels(head, features["sound_to_animal"])
    # a word's label goes to its last token (" roared" may be split: the last piece carries it)
    roared = [head.tokens[i] for i, lab in enumerate(q_lab) if lab]
    assert len(roared) == 1 and "·roared".endswith(roared[0])
    assert [head.tokens[i] for i, lab in enumerate(k_lab) if lab] == ["·lion", "·horse"]
    pairs = feature_pairs(head, features["sound_to_animal"])  # single label: negatives are other keys
    assert pairs.n_positive == 1 and pairs.n_negative == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("feature,label,match\nx,y,z\n", "line 1: the header"),
        ("feature,side,label,match\ncolour,left,c,word:red\n", "line 2: side 'left'"),
        ("feature,side,label,match\ncolour,both,,word:red\n", "line 2: the label is empty"),
        ("feature,side,label,match\n# c\ncolour,both,c,red\n", "line 3: match 'red'"),
        ("feature,side,label,match\ncolour,both,c,regex:(red\n", "does not compile"),
        ("feature,side,label,match\ncolour,both,c\n", "expected 4 fields"),
        ("# nothing\n\n", "no rows"),
        ("feature,side,label,match\n", "no rules"),
    ],
)
def test_bad_label_files_are_explained(text, message):
    with pytest.raises(LabelFileError, match=message):
        parse_label_csv(text)


def test_a_feature_without_positive_pairs_is_explained():
    head = synthetic_head(np.zeros((4, 4)), np.zeros((4, 4)), [4], tokens=["a", "b", "c", "d"])
    feature = parse_label_csv("feature,side,label,match\nf,both,x,token:a\nf,both,y,token:b\n")["f"]
    with pytest.raises(InputError, match="no positive pairs"):
        feature_pairs(head, feature)
    with pytest.raises(InputError, match="Unknown feature"):
        feature_pairs(head, "colourfulness")
    with pytest.raises(LabelFileError, match="Cannot read"):
        parse_label_csv("/no/such/file.csv")


def test_probe_task_category_feature(tiny_model):
    task = load_probe_tasks()["category"]
    small = ProbeTask(task.name, task.kind, task.description, task.sentences[:6], task.lexicon)
    head = collect_head(tiny_model, small.sentences, layer=0, head=0)
    pairs = feature_pairs(head, small)
    assert pairs.n_positive > 0 and pairs.n_negative > 0
    # every pair joins two lexicon words of one sentence, key first
    assert np.all(pairs.key_index < pairs.query_index)
    assert np.all(head.sentence_index[pairs.key_index] == head.sentence_index[pairs.query_index])


# ---------------------------------------------------------------------------------------------
# Weight space


def test_effective_rank_values():
    np.testing.assert_allclose(effective_rank(np.array([1.0, 1.0, 1.0, 1.0])), 4.0)
    np.testing.assert_allclose(effective_rank(np.array([3.0, 0.0, 0.0])), 1.0)
    assert effective_rank(np.zeros(3)) == 0.0
    p = np.array([0.5, 0.25, 0.25])
    np.testing.assert_allclose(effective_rank(np.array([2.0, 1.0, 1.0])), np.exp(-(p * np.log(p)).sum()))
    assert effective_rank(np.ones((2, 3, 5))).shape == (2, 3)


def test_wqk_spectra_match_factored_matrix_and_brute_force(tiny_model):
    from transformer_lens import FactoredMatrix

    b = tiny_model.bridge
    spectra = wqk_spectra(tiny_model, fold_ln=False)
    assert spectra.shape == (2, 4, 16)
    kv = [tiny_model.kv_head(h) for h in range(4)]
    with torch.no_grad():
        ref = FactoredMatrix(b.W_Q, b.W_K[:, kv].transpose(-1, -2)).S.numpy()
    np.testing.assert_allclose(spectra, ref, rtol=1e-4, atol=1e-6)
    folded = wqk_spectra(tiny_model, layers=[1])
    with torch.no_grad():
        g = b.blocks[1].ln1.w.double()
        full = (g[:, None] * b.W_Q[1, 3].double()) @ (g[:, None] * b.W_K[1, kv[3]].double()).T
    np.testing.assert_allclose(folded[0, 3], torch.linalg.svdvals(full)[:16].numpy(), rtol=1e-6, atol=1e-9)
    with pytest.raises(InputError, match="Layer 5 is out of range"):
        wqk_spectra(tiny_model, layers=[5])


def test_wqk_spectra_are_stored(tiny_model, store, monkeypatch):
    """The first call keeps its spectra in the store; the second reads them back, computing nothing."""
    a = wqk_spectra(tiny_model, store=store)
    (record,) = store.list(kind="wqk_spectra")
    np.testing.assert_array_equal(store.get(record.key).array("spectra"), a)
    monkeypatch.setattr(torch.linalg, "svdvals", lambda *args, **kwargs: pytest.fail("recomputed stored spectra"))
    b = wqk_spectra(tiny_model, store=store)
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# The embedded model


@pytest.mark.integration
def test_previous_token_subspace_of_a_real_previous_token_head(real_model):
    """Layer 1 head 2 of SmolLM2-135M attends from i to i-1 (mean 0.69 on the probe sentences)."""
    from headscope.analysis.qk_collect import load_sentences

    head = collect_head(real_model, load_sentences(limit=30), layer=1, head=2)
    pairs = feature_pairs(head, "previous_token")
    dc = decompose(head.q, head.k, pairs, seed=0)
    assert dc.rank >= 1
    effect = intervention_effect(head, dc, pairs)
    assert effect.positive_before > 0.5
    assert effect.positive_after < effect.positive_before - 0.2


def test_uploaded_labels_and_sentences_round_trip_through_the_store(store):
    from headscope.analysis.errors import InputError
    from headscope.analysis.qk_collect import store_sentences, stored_sentences
    from headscope.analysis.qk_decomposition import store_labels, stored_labels

    key, features = store_labels(store, "feature,side,label,match\ncat,both,L0,token:c0\ncat,both,L1,token:c1",
                                 "mine.csv")
    assert list(features) == ["cat"] and list(stored_labels(store, key[:16])) == ["cat"]
    texts = store_sentences(store, ["One sentence.", "Another one."], "mine.txt")
    assert stored_sentences(store, texts[:16]) == ["One sentence.", "Another one."]
    with pytest.raises(InputError, match="upload it again"):
        stored_labels(store, texts)  # a key of another kind is not a label file
    with pytest.raises(InputError, match="upload it again"):
        stored_sentences(store, "0" * 16)

"""Tests for analysis/joint_embedding.py: AttentionViz normalisation, projections, query → key helpers."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.head_summary import previous_token_mass
from headscope.analysis.joint_embedding import (
    attention_agreement,
    joint_embedding,
    nearest_keys,
    normalise_qk,
    project,
    query_attention,
)
from headscope.analysis.qk_collect import causal_softmax, collect_head, load_sentences
from tests.analysis.synthetic_heads import synthetic_head


def _attention_from(q: np.ndarray, k: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    out, start = [], 0
    for m in lengths:
        s = q[start: start + m].astype(np.float64) @ k[start: start + m].astype(np.float64).T / np.sqrt(q.shape[1])
        s[np.triu_indices(m, 1)] = -np.inf
        out.append(causal_softmax(s))
        start += m
    return out


def _random_qk(seed: int = 0, lengths=(7, 9, 5, 11)):
    rng = np.random.default_rng(seed)
    n, d = sum(lengths), 16
    # offset centroids and unequal norms, as in real heads
    q = (rng.normal(size=(n, d)) * 2.0 + 3.0).astype(np.float32)
    k = (rng.normal(size=(n, d)) * 0.5 - 1.0).astype(np.float32)
    return q, k, list(lengths)


def test_normalisation_equalises_centroids_and_mean_norms():
    q, k, _ = _random_qk()
    j = normalise_qk(q, k)
    np.testing.assert_allclose(j.queries.mean(0), j.keys.mean(0), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(j.queries, axis=1).mean(), np.linalg.norm(j.keys, axis=1).mean(), rtol=1e-6)
    np.testing.assert_allclose(j.queries, j.scale * q, rtol=1e-6)


def test_key_translation_and_scaling_leave_every_softmax_row_unchanged():
    q, k, lengths = _random_qk(1)
    j = normalise_qk(q, k)
    before = _attention_from(q, k, lengths)
    after = _attention_from(j.queries, j.keys, lengths)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # ...but the raw logits did change (the translation is not a no-op)
    assert abs(float(j.queries[0] @ j.keys[0]) - float(q[0] @ k[0])) > 1e-2


def test_balance_without_translation_uses_the_ratio_of_mean_norms():
    q, k, _ = _random_qk(2)
    j = normalise_qk(q, k, translate=False)
    expected = np.sqrt(np.linalg.norm(k, axis=1).mean() / np.linalg.norm(q, axis=1).mean())
    assert j.scale == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(j.keys, k / expected, rtol=1e-5)


def test_pca_is_the_top_two_principal_axes_and_deterministic():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 10)) * np.array([5, 3, 1, 1, 1, 1, 1, 1, 1, 1])
    a, ev = project(x, "pca")
    b, _ = project(x, "pca")
    np.testing.assert_array_equal(a, b)
    xc = x - x.mean(0)
    _, s, vt = np.linalg.svd(xc, full_matrices=False)
    ref = xc @ vt[:2].T
    np.testing.assert_allclose(np.abs(a), np.abs(ref), rtol=1e-4, atol=1e-4)  # same axes up to sign
    np.testing.assert_allclose(ev, (s[:2] ** 2) / (s**2).sum(), rtol=1e-6)


@pytest.mark.slow  # UMAP's numba compile and t-SNE: about 30 s
def test_umap_and_tsne_are_deterministic_given_a_seed():
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.normal(size=(60, 8)), rng.normal(size=(60, 8)) + 6]).astype(np.float32)
    u1, _ = project(x, "umap", seed=0, n_epochs=50)
    u2, _ = project(x, "umap", seed=0, n_epochs=50)
    np.testing.assert_array_equal(u1, u2)
    t1, _ = project(x, "tsne", seed=0, tsne_iter=300)
    t2, _ = project(x, "tsne", seed=0, tsne_iter=300)
    np.testing.assert_array_equal(t1, t2)
    # the two blobs stay apart in both pictures: each point is nearer its own blob's centre
    truth = np.repeat([0, 1], 60)
    for y in (u1, t1):
        centres = np.stack([y[:60].mean(0), y[60:].mean(0)])
        nearest = np.argmin(np.linalg.norm(y[:, None] - centres[None], axis=2), axis=1)
        assert (nearest == truth).mean() > 0.95


def test_bad_projection_requests_are_explained():
    with pytest.raises(InputError, match="Unknown projection"):
        project(np.zeros((10, 2)), "mds")
    with pytest.raises(InputError, match="at least 3 points"):
        project(np.zeros((2, 2)), "pca")
    with pytest.raises(InputError, match="same width"):
        normalise_qk(np.zeros((3, 4)), np.zeros((3, 5)))
    with pytest.raises(InputError, match="NaN"):
        normalise_qk(np.full((3, 4), np.nan), np.zeros((3, 4)))


def test_query_attention_and_nearest_keys_helpers():
    q, k, lengths = _random_qk(5)
    head = synthetic_head(q, k, lengths)
    emb = joint_embedding(head, "pca")
    i = 10  # sentence 1, position 3
    hits = query_attention(head, i, top_k=3, embedding=emb)
    row = head.attention(1)[3]
    assert [h.weight for h in hits] == pytest.approx(sorted(row[:4], reverse=True)[:3])
    assert all(h.sentence == 1 and h.position <= 3 for h in hits)
    assert hits[0].distance == pytest.approx(float(np.linalg.norm(emb.query_xy(i) - emb.key_xy(hits[0].token_index))))
    near = nearest_keys(head, emb, i, top_k=5)
    assert [h.distance for h in near] == sorted(h.distance for h in near)
    same = nearest_keys(head, emb, i, top_k=10, same_sentence=True)
    assert len(same) == 4 and all(not np.isnan(h.weight) for h in same)
    with pytest.raises(InputError, match="out of range"):
        query_attention(head, 10_000)


def test_agreement_is_high_when_queries_sit_on_their_keys_and_chance_otherwise():
    rng = np.random.default_rng(6)
    lengths = [10] * 30
    n = sum(lengths)
    k = rng.normal(size=(n, 8)).astype(np.float32)
    q = (np.roll(k, 1, axis=0) * 4).astype(np.float32)  # query i points at key i-1: a previous-token head
    head = synthetic_head(q, k, lengths)
    joint = normalise_qk(q, k)
    good = attention_agreement(head, joint.points)
    assert good.fraction > 0.9
    noise = attention_agreement(head, rng.normal(size=(2 * n, 2)))
    assert abs(noise.fraction - 0.5) < 0.05


def test_embedding_is_stored_and_reused(store):
    q, k, lengths = _random_qk(7)
    head = synthetic_head(q, k, lengths)
    a = joint_embedding(head, "pca", store=store)
    b = joint_embedding(head, "pca", store=store)
    np.testing.assert_array_equal(a.coords, b.coords)
    assert b.seconds == a.seconds  # loaded, not recomputed


# ---------------------------------------------------------------------------------------------
# The embedded model


@pytest.fixture(scope="module")
def previous_token_head(real_model):
    """The head with the highest mean attention from token i to i-1 on a probe text."""
    text = " ".join(load_sentences(limit=5))
    run = capture(real_model, real_model.encode(text))
    mass = previous_token_mass(run.patterns)
    layer, head = np.unravel_index(np.nanargmax(mass), mass.shape)
    assert mass[layer, head] > 0.5
    return int(layer), int(head)


@pytest.mark.integration
def test_translation_leaves_the_real_heads_attention_unchanged(real_model):
    head = collect_head(real_model, load_sentences(limit=12), layer=3, head=4)
    j = normalise_qk(head.q, head.k)
    lengths = np.diff(head.offsets).tolist()
    after = _attention_from(j.queries, j.keys, lengths)
    for s in range(len(lengths)):
        np.testing.assert_allclose(after[s], head.attention(s), atol=2e-5)


@pytest.mark.integration
def test_joint_embedding_puts_queries_near_the_key_they_attend_to(real_model, previous_token_head):
    layer, h = previous_token_head
    sentences = load_sentences()[5:30]  # not the sentences the head was found on
    head = collect_head(real_model, sentences, layer=layer, head=h)
    assert head.n_points <= 1000
    emb = joint_embedding(head, "pca")
    agree = attention_agreement(head, emb.coords, n_draws=1, seed=0)
    wins = round(agree.fraction * agree.n_queries)
    assert agree.fraction > 0.7
    assert binomtest(wins, agree.n_queries, 0.5, alternative="greater").pvalue < 1e-6


UMAP_STARTS_DURING_A_FORK = """
import os, sys, threading, time
from headscope.analysis import joint_embedding as je

def slow_warm_up(progress=None):  # stands in for numba's compile (10-20 s, holding its compiler lock)
    time.sleep(1.0)
    je._warm_seconds = 1.0
    return 1.0

je.warm_up_umap = slow_warm_up
started = []

def another_hook():  # registered later, so run earlier: a fork already under way when the warm-up starts
    if not started:
        t = threading.Thread(target=lambda: started.append(je.start_umap_warmup()))
        t.start()
        t.join()

os.register_at_fork(before=another_hook)
pid = os.fork()
if pid == 0:
    os._exit(0 if je.umap_is_warm() else 3)
_, status = os.waitpid(pid, 0)
print(started, os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow  # a process that imports and warms up UMAP
def test_a_fork_under_way_when_the_umap_warm_up_starts_waits_for_it():
    """The server starts UMAP's warm-up when its QK page first asks for UMAP, while other users' jobs
    may be forking. Python runs the at-fork hooks registered when a fork began: a hook registered by
    the warm-up's own start missed a fork already waiting in another hook (the fork gate), and the
    child was forked mid-compile, with numba's compiler lock held for ever (review of 2ad4ee9)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", UMAP_STARTS_DURING_A_FORK], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[True]", "0"], out.stdout  # started during the fork; the child was warm

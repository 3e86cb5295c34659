"""The pattern folder: DuoAttention's files and kvpress' ``head_scores.npy``, written and read back; kvpress'
own thresholding (re-implemented here from its source) recovers every policy from the scores; a hostile
``head_scores.npy`` is refused without unpickling anything."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import (
    RANKINGS,
    Policy,
    build_policy,
    evaluate_policies,
    group_priority,
)
from headscope.analysis.pattern_folder import (
    HEAD_SCORES_NPY,
    PATTERN_CONFIG,
    PATTERN_TSV,
    curve_priority,
    export_policy,
    load_policy,
)

IDS = [int(t) for t in np.random.default_rng(0).integers(100, 5000, size=14)]


@pytest.fixture(scope="module")
def model(make_tiny_model):
    return make_tiny_model(seed=3, name="tiny-kv")


def test_exported_pattern_folder_round_trips_with_layers_by_kv_heads(tmp_path):
    full = np.random.default_rng(1).random((30, 3)) > 0.6
    policy = Policy(full, 128, 256, "retrieval", 0.4)
    export_policy(policy, tmp_path / "pattern", model_name="smollm2-135m")
    table = np.loadtxt(tmp_path / "pattern" / PATTERN_TSV, delimiter="\t")
    assert table.shape == (30, 3)
    assert ((table >= 0) & (table <= 1)).all()
    assert np.array_equal(table > 0.5, full)
    config = json.loads((tmp_path / "pattern" / PATTERN_CONFIG).read_text())
    assert (config["sink_size"], config["recent_size"]) == (128, 256)
    assert config["head_compression_ratio"] == pytest.approx(1 - full.mean())
    back = load_policy(tmp_path / "pattern")
    assert np.array_equal(back.full, full) and (back.sink_size, back.recent_size) == (128, 256)
    # kvpress' DuoAttentionPress rule: the lowest head_compression_ratio share of scores stream
    n_pruned = round(table.size * config["head_compression_ratio"])
    streaming = np.zeros(table.size, bool)
    streaming[np.argsort(table, axis=None, kind="stable")[:n_pruned]] = True
    assert np.array_equal(~streaming.reshape(table.shape), full)




def kvpress_streaming_mask(head_scores: np.ndarray, head_compression_ratio: float) -> np.ndarray:
    """kvpress' own rule, re-implemented as the reference: ``DuoAttentionPress.post_init_from_model`` in
    NVIDIA/kvpress ``kvpress/presses/duo_attention_press.py`` at 8bb29b9c3078452a86d692f29123fa6c793e2b05:
    ``n_pruned = round(size · ratio)`` (Python's round) and the ``n_pruned`` lowest scores of
    ``np.argsort(head_scores, axis=None)`` (numpy's default, unstable sort) are streaming heads."""
    n_pruned = round(head_scores.size * head_compression_ratio)
    streaming = np.zeros(head_scores.shape, dtype=bool)
    if n_pruned > 0:
        indices = np.argsort(head_scores, axis=None)[:n_pruned]
        streaming[np.unravel_index(indices, head_scores.shape)] = True
    return streaming


def _tied_scores(rng: np.random.Generator, n_layers: int, n_heads: int) -> dict[str, np.ndarray]:
    """Per-head tables with many exact ties (zeros, and a few repeated values), so rank cuts fall inside
    runs of equal group priorities, plus nan where a score is undefined."""
    from headscope.analysis.score_registry import KV_SCORES

    def table() -> np.ndarray:
        t = np.round(rng.random((n_layers, n_heads)), 1)
        t[rng.random(t.shape) < 0.4] = 0.0
        t[0, 0] = np.nan
        return t

    return {"retrieval": table(), **{name: table() for name in KV_SCORES}}


def _check_kvpress_recovers(model, tmp_path, scores, rankings, fractions) -> int:
    checked = 0
    for ranking in rankings:
        for fraction in fractions:
            for seed in ((0, 1, 2) if RANKINGS[ranking].seeded else (0,)):
                policy = build_policy(model, ranking, fraction, scores, seed=seed, sink_size=4, recent_size=8)
                priority = group_priority(model, ranking, scores, seed)
                folder = tmp_path / f"{ranking}-{fraction}-{seed}"
                paths = export_policy(policy, folder, model_name=model.name, priority=priority)
                assert folder / HEAD_SCORES_NPY in paths
                head_scores = np.load(folder / HEAD_SCORES_NPY, allow_pickle=False)
                assert head_scores.shape == (model.n_layers, model.n_kv_heads) and head_scores.dtype == np.float64
                config = json.loads((folder / PATTERN_CONFIG).read_text())
                assert config["head_scores"] == HEAD_SCORES_NPY
                streaming = kvpress_streaming_mask(head_scores, config["head_compression_ratio"])
                assert np.array_equal(~streaming, policy.full), (ranking, fraction, seed)
                # the ranking's own priority, not a 0/1 table: only streaming groups tied with the lowest
                # full group's priority sit one float64 step below it
                moved = head_scores != priority
                assert (head_scores[moved] < priority[moved]).all() and not moved[policy.full].any()
                assert np.allclose(head_scores, priority, rtol=0, atol=1e-12)
                checked += 1
    return checked


def test_head_scores_npy_thresholded_as_kvpress_recovers_every_policy_on_a_tiny_model(model, tmp_path):
    scores = _tied_scores(np.random.default_rng(7), model.n_layers, model.n_heads)
    fractions = (0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9, 1.0)
    rankings = [r for r in ("retrieval", "streaming", "evidence", "random", "all_full", "all_streaming")
                if r in scores or r in ("random", "all_full", "all_streaming")]
    assert _check_kvpress_recovers(model, tmp_path, scores, rankings, fractions) > 30
    # continuous: the retrieval ranking's file keeps its distinct group priorities
    policy = build_policy(model, "retrieval", 0.5, scores)
    export_policy(policy, tmp_path / "r", priority=group_priority(model, "retrieval", scores))
    assert len(np.unique(np.load(tmp_path / "r" / "head_scores.npy", allow_pickle=False))) > 2


def test_head_scores_npy_recovers_the_policies_on_the_embedded_models_layout(real_model, tmp_path):
    scores = _tied_scores(np.random.default_rng(11), real_model.n_layers, real_model.n_heads)
    assert (real_model.n_layers, real_model.n_kv_heads) == (30, 3)
    n = _check_kvpress_recovers(real_model, tmp_path, scores, ["retrieval", "streaming", "random"],
                                (0.1, 0.25, 0.5, 0.75))
    assert n == 4 * 5


def test_head_scores_npy_gives_the_rankings_other_fractions_too(model, tmp_path):
    """One file, every fraction: kvpress at another ``head_compression_ratio`` keeps the groups
    :func:`build_policy` keeps at that fraction (where the two roundings agree: no exact half)."""
    scores = {"retrieval": np.random.default_rng(5).random((model.n_layers, model.n_heads))}
    priority = group_priority(model, "retrieval", scores)
    export_policy(build_policy(model, "retrieval", 0.5, scores), tmp_path, priority=priority)
    head_scores = np.load(tmp_path / "head_scores.npy", allow_pickle=False)
    n = head_scores.size
    for k in range(n + 1):
        want = build_policy(model, "retrieval", k / n, scores).full
        assert np.array_equal(~kvpress_streaming_mask(head_scores, 1 - k / n), want)


def test_export_without_a_priority_writes_the_policy_as_zero_one_scores(tmp_path):
    full = np.random.default_rng(2).random((6, 2)) > 0.5
    export_policy(Policy(full, 4, 8), tmp_path)
    head_scores = np.load(tmp_path / "head_scores.npy", allow_pickle=False)
    assert np.array_equal(head_scores, full.astype(np.float64))
    config = json.loads((tmp_path / PATTERN_CONFIG).read_text())
    assert np.array_equal(~kvpress_streaming_mask(head_scores, config["head_compression_ratio"]), full)


def test_export_refuses_a_priority_that_does_not_give_the_policy(tmp_path):
    full = np.array([[True, False], [False, False]])
    policy = Policy(full, 4, 8)
    bad = {"ranks a streaming group above a full one": np.array([[0.2, 0.9], [0.1, 0.0]]),
           "shape": np.zeros((3, 2)), "nan": np.array([[np.nan, 0.0], [0.0, 0.0]]),
           "inf": np.array([[np.inf, 0.0], [0.0, 0.0]]), "object": np.array([[1, "a"], [0, 0]], dtype=object)}
    for what, priority in bad.items():
        with pytest.raises(InputError, match="priority"):
            export_policy(policy, tmp_path / what.replace(" ", "_"), priority=priority)


def test_load_policy_refuses_a_hostile_head_scores_npy(tmp_path):
    """The folder's ``head_scores.npy`` is data from wherever the folder came from: only a plain float
    array of the TSV's shape that ranks its full groups first is read, without unpickling anything."""
    import pickle

    full = np.array([[True, False, False], [False, True, False]])
    good = tmp_path / "good"
    export_policy(Policy(full, 4, 8, "retrieval", 1 / 3), good,
                  priority=np.array([[0.9, 0.1, 0.2], [0.3, 0.8, 0.0]]))
    assert np.array_equal(load_policy(good).full, full)

    class Boom:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    def obj(path):
        np.save(path, np.array([[Boom(), 0, 0], [0, 0, 0]], dtype=object), allow_pickle=True)

    def huge_header(path):  # a header declaring 10^12 floats over 8 bytes of data
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False,
                                                     "shape": (10**6, 10**6)})
            f.write(b"\0" * 8)

    hostile = {
        "object array (pickle)": obj,
        "raw pickle": lambda p: p.write_bytes(pickle.dumps(Boom())),
        "wrong shape": lambda p: np.save(p, np.zeros((3, 2))),
        "1-d": lambda p: np.save(p, np.zeros(6)),
        "nan": lambda p: np.save(p, np.array([[np.nan, 0, 0], [0, 1, 0]])),
        "inf": lambda p: np.save(p, np.array([[np.inf, 0, 0], [0, 1, 0]])),
        "strings": lambda p: np.save(p, np.array([["1", "0", "0"], ["0", "1", "0"]])),
        "complex": lambda p: np.save(p, np.ones((2, 3), dtype=complex)),
        "structured": lambda p: np.save(p, np.zeros((2, 3), dtype=[("a", "<f8")])),
        "empty file": lambda p: p.write_bytes(b""),
        "text": lambda p: p.write_text("1\t0\t0\n0\t1\t0\n"),
        "truncated": lambda p: p.write_bytes((good / "head_scores.npy").read_bytes()[:-9]),
        "huge header": huge_header,
        "npz": lambda p: np.savez(open(p, "wb"), a=np.zeros((2, 3))),
        "disagrees with the tsv": lambda p: np.save(p, np.array([[0.1, 0.9, 0.0], [0.0, 0.8, 0.0]])),
        "a directory": lambda p: p.mkdir(),
        "a link to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
    }
    held = 0
    for what, write in hostile.items():
        folder = tmp_path / what.replace(" ", "_").replace("(", "").replace(")", "")
        export_policy(Policy(full, 4, 8), folder)
        target = folder / "head_scores.npy"
        target.unlink()
        write(target)
        with pytest.raises(InputError, match="head_scores.npy") as e:
            load_policy(folder)
        assert str(tmp_path) not in str(e.value) and "Traceback" not in str(e.value), what
        held += 1
    assert held == len(hostile) and not (tmp_path / "pwned").exists()


def test_an_evaluated_curve_exports_its_rankings_continuous_priorities(model, tmp_path):
    """The curve keeps each ranking's group priority (per seed for random), so an export from the curve
    alone (the Compress page's download, ``headscope compress``) writes it, not a 0/1 table."""
    scores = {"retrieval": np.random.default_rng(9).random((model.n_layers, model.n_heads))}
    curve = evaluate_policies(model, scores, ["retrieval", "random", "all_streaming"], [0.25, 0.5], texts=[IDS],
                              seeds=[0, 1], sink_size=2, recent_size=3)
    assert len(curve.evaluations) == 2 + 4 + 1
    for e in curve.evaluations:
        priority = curve_priority(curve, e.policy)
        want = group_priority(model, e.policy.ranking, scores, e.policy.seed or 0)
        assert np.array_equal(priority, want)
        folder = tmp_path / f"{e.policy.ranking}-{e.policy.fraction}-{e.policy.seed}"
        export_policy(e.policy, folder, priority=priority)
        head_scores = np.load(folder / "head_scores.npy", allow_pickle=False)
        config = json.loads((folder / PATTERN_CONFIG).read_text())
        assert np.array_equal(~kvpress_streaming_mask(head_scores, config["head_compression_ratio"]), e.policy.full)
        if e.policy.ranking != "all_streaming":
            assert len(np.unique(head_scores)) > 2
    assert curve_priority(type(curve)(curve.evaluations, curve.baseline, 2, 3, 1, 0, True, {}),
                          curve.evaluations[0].policy) is None  # a curve stored without priorities

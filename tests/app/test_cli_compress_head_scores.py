"""``headscope compress`` writes kvpress' ``head_scores.npy`` beside DuoAttention's pattern folder: the
exported ranking's continuous group priority, which kvpress' own thresholding turns back into the policy."""

from __future__ import annotations

import json
import os

import numpy as np


def test_compress_writes_and_names_head_scores_for_kvpress(tmp_path, real_model, capsys, monkeypatch):
    from headscope.app.cli import main

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    out = tmp_path / "out"
    code = main(["--home", str(tmp_path / "home"), "compress", "--lengths", "256", "--depths", "50", "--needles",
                 "locker-code", "--sink", "16", "--recent", "64", "--fractions", "0.5", "--rankings", "retrieval",
                 "--export", "retrieval:0.5", "--out", str(out), "--formats", "html"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    pattern = out / "pattern"
    full = np.loadtxt(pattern / "full_attention_heads.tsv", delimiter="\t") > 0.5
    scores = np.load(pattern / "head_scores.npy", allow_pickle=False)
    config = json.loads((pattern / "config.json").read_text())
    assert scores.shape == (30, 3) and scores.dtype == np.float64 and len(np.unique(scores)) > 2
    # kvpress' DuoAttentionPress.post_init_from_model (NVIDIA/kvpress 8bb29b9): the round(size · ratio)
    # lowest scores of np.argsort(head_scores, axis=None) stream
    n_pruned = round(scores.size * config["head_compression_ratio"])
    streaming = np.zeros(scores.size, bool)
    streaming[np.argsort(scores, axis=None)[:n_pruned]] = True
    assert n_pruned == 45 and np.array_equal(~streaming.reshape(scores.shape), full)
    assert "head_scores.npy" in printed and "head_compression_ratio 0.5" in printed

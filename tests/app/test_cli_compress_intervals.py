"""``headscope compress`` with error bars (#42 item 4): every NIAH accuracy in ``compress.csv``,
``summary.json``, the Pareto view's data and the printed table carries its n and its 95 % Wilson interval;
the random ranking's seed band is in the summary; the decision says the n it rests on."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest

from headscope.analysis.intervals import wilson
from headscope.app.cli.compress import compression_table


def _row(ranking, seed, fraction, accuracy, n, kv=0.5):
    p = wilson(round(accuracy * n), n)
    return {"ranking": ranking, "seed": seed, "fraction_full": fraction, "n_full_groups": 1, "kv_tokens": 100,
            "kv_bytes": 2**20, "kv_full_bytes": 2**21, "kv_fraction": kv, "loss": 2.0, "agreement": 0.9,
            "niah_accuracy": accuracy, "niah_accuracy_n": n, "niah_accuracy_low": p.low, "niah_accuracy_high": p.high}


def test_the_printed_table_shows_each_accuracy_with_its_interval_and_n():
    best = _row("retrieval", None, 0.25, 0.5, 4, kv=0.3)
    summary = {"model": "m", "sink_size": 4, "recent_size": 8, "n_texts": 1, "n_prompts": 4, "tolerance": 0.05,
               "complete": True, "baseline": _row("all_full", None, 1.0, 0.75, 4, kv=1.0),
               "rows": [best, _row("random", 0, 0.25, 0.0, 4)],
               "seed_bands": [{"ranking": "random", "fraction_full": 0.25, "n_seeds": 3, "niah_accuracy_seed_mean": 0.25,
                               "niah_accuracy_seed_low": 0.0, "niah_accuracy_seed_high": 0.5}],
               "smallest_within_tolerance": {"retrieval": best, "all_streaming": None}}
    lines = compression_table(summary)
    assert lines[1].split()[-4:] == ["NIAH", "[95%", "CI]", "n"]
    retrieval = next(line for line in lines if line.startswith("retrieval "))
    assert retrieval.endswith("0.50 [0.15, 0.85]  4")
    assert "0.00 [0.00, 0.49]" in next(line for line in lines if line.startswith("random "))
    assert "random at fraction full 0.25: NIAH over 3 seeds mean 0.25, lowest 0.00, highest 0.50" in lines
    assert ("Smallest KV within 5 NIAH points of full, retrieval: KV 0.300 (groups full 0.25), NIAH 0.50 [0.15, 0.85] "
            "on n = 4 prompts") in lines
    assert "Smallest KV within 5 NIAH points of full, all_streaming: none on n = 4 prompts" in lines


@pytest.mark.integration
@pytest.mark.timeout(900)  # a one-trial sweep and 5 policies on the embedded model, on a shared 2-core machine
def test_compress_csv_summary_and_pareto_data_hold_the_interval_columns(tmp_path, real_model, capsys, monkeypatch):
    from headscope.app.cli import main

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    out = tmp_path / "out"
    code = main(["--home", str(tmp_path / "home"), "compress", "--lengths", "256", "--depths", "50", "--needles",
                 "locker-code", "--sink", "16", "--recent", "64", "--fractions", "0.5", "--rankings", "retrieval,random",
                 "--seeds", "2", "--backend", "eager", "--out", str(out), "--formats", ""])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_prompts"] == 1
    for row in [summary["baseline"], *summary["rows"]]:
        want = wilson(round(row["niah_accuracy"]), 1)
        assert row["niah_accuracy_n"] == 1
        assert (row["niah_accuracy_low"], row["niah_accuracy_high"]) == pytest.approx((want.low, want.high))
    with open(out / "compress.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"niah_accuracy_n", "niah_accuracy_low", "niah_accuracy_high"} <= set(rows[0])
    assert [int(r["niah_accuracy_n"]) for r in rows] == [1, 1, 1]
    assert math.isclose(float(rows[0]["niah_accuracy_high"]), summary["rows"][0]["niah_accuracy_high"])
    # the random ranking's seed band at the one fraction, and its pooled interval over both seeds' prompts
    (band,) = summary["seed_bands"]
    accuracies = [r["niah_accuracy"] for r in summary["rows"] if r["ranking"] == "random"]
    assert band["n_seeds"] == 2 and band["niah_accuracy_seed_low"] == min(accuracies)
    assert band["niah_accuracy_pooled_n"] == 2
    assert "95 % Wilson" in summary["tolerance_rule"]
    # the Pareto view's data (what its CSV export writes) carries the same columns
    pareto = json.loads((out / "compression_pareto.json").read_text())
    assert pareto[0]["ranking"] == "uncompressed" and pareto[0]["niah_accuracy_n"] == 1
    assert any(r.get("seed") == "seed band" and r["niah_accuracy_pooled_n"] == 2 for r in pareto)
    # the printed table and the decision's n
    assert "NIAH [95% CI]" in printed and any(line.startswith("retrieval ") and " [" in line
                                             for line in printed.splitlines())
    assert "on n = 1 prompt" in printed

"""``headscope circuits --corrupted T2`` on the embedded model: ``edges.csv`` holds every edge's attribution
score (:func:`headscope.analysis.edge_attribution.edge_attribution`), the same numbers the Python function gives,
and a pair that cannot be compared is one line and exit 2."""

from __future__ import annotations

import contextlib
import csv
import io
import json

import pytest

from tests.app.command_line import assert_one_line

pytestmark = pytest.mark.integration

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def _circuits(*args, home, monkeypatch):
    """``headscope circuits ARGS`` through ``headscope.app.cli.main`` in this process (the model loads once)."""
    from headscope.app.cli import main

    monkeypatch.setenv("HEADSCOPE_HOME", str(home))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["circuits", *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def test_corrupted_writes_every_edges_score_as_the_python_function_gives_it(tmp_path, monkeypatch, real_model):
    from headscope.analysis.edge_attribution import edge_attribution

    out = tmp_path / "out"
    code, stdout, err = _circuits("--text", CLEAN, "--answers", " Mary, John", "--corrupted", CORRUPTED,
                                  "--out", str(out), "--formats", "", home=tmp_path / "home", monkeypatch=monkeypatch)
    assert code == 0, err
    with open(out / "edges.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["sender", "receiver", "site", "score"]
    expected = edge_attribution(real_model, CLEAN, CORRUPTED, [" Mary", " John"])
    assert len(rows) == len(expected.scores)
    for row, (s, r, site, v) in zip(rows[:20], expected.rows(20), strict=True):
        assert (row["sender"], row["receiver"], row["site"]) == (s, r, site)
        assert float(row["score"]) == pytest.approx(v, rel=1e-6, abs=1e-9)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["edges"]["corrupted_logit_diff"] == pytest.approx(expected.corrupted, rel=1e-4)
    assert summary["edges"]["top"][0]["sender"] == rows[0]["sender"]
    assert "edges.csv" in stdout or str(out) in stdout


@pytest.mark.parametrize("corrupted,expected", [
    ("When Mary and John went to the store, Mary Elizabeth gave a drink to", "same number of tokens"),
    (CLEAN, "same tokens"),
    ("", ""),  # refused by the argument parser, before the model loads
    ("   ", ""),
])
def test_a_pair_that_cannot_be_compared_is_one_line(corrupted, expected, tmp_path, monkeypatch, real_model):
    code, _, err = _circuits("--text", CLEAN, "--answers", " Mary, John", "--corrupted", corrupted,
                             "--out", str(tmp_path / "out"), "--formats", "", home=tmp_path / "home",
                             monkeypatch=monkeypatch)
    assert_one_line(code, err, "--corrupted", expected)
    assert not (tmp_path / "out" / "edges.csv").exists()

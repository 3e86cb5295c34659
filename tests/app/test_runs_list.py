"""``headscope runs list`` lists every readable run and reports each row it cannot list in one line.

A row's metadata can rot inside the index (SQLite's quick check passes it): ``{}``, text that is not
JSON, fields of the wrong type. Each such row is one line on stderr, naming its id; the others are
listed as always, and nothing prints a traceback.
"""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from headscope.analysis.runs import stored_runs
from headscope.analysis.store import Store
from headscope.app.cli import main

GOOD, BAD, STATS = "aa" * 32, "bb" * 32, "cc" * 32


def _meta(text: str, n: int = 3) -> dict:
    return {"model_name": "smollm2-135m", "model_digest": "d" * 64, "token_ids": list(range(n)),
            "tokens": ["x"] * n, "text": text, "settings": {}, "n_tokens": n}


@pytest.fixture
def home(tmp_path):
    store = Store(tmp_path / "home")
    store.put(GOOD, "run", _meta("a good run"), {"a": np.zeros(3)})
    store.put(BAD, "run", _meta("a rotten run"), {"a": np.zeros(3)})
    store.put(STATS, "stats_run", _meta("a long run", 5000), {"a": np.zeros(3)})
    store.close()
    return tmp_path / "home"


def _rot(home, meta) -> None:
    db = sqlite3.connect(home / "index.sqlite", isolation_level=None)
    db.execute("UPDATE records SET meta=? WHERE key=?", (meta, BAD))
    db.close()


ROTTEN = ["{}", "not json", "[1, 2]", "null", '{"model_name": 5, "n_tokens": 3}',
          '{"model_name": "m", "n_tokens": "3"}', '{"model_name": "m", "n_tokens": true}',
          '{"model_name": "m", "n_tokens": -1}', '{"model_name": "m", "n_tokens": 3, "text": ["a"]}',
          '{"model_name": "", "n_tokens": 3}', "[" * 50_000, b"\xff\xfe\x00"]


@pytest.mark.parametrize("meta", ROTTEN, ids=range(len(ROTTEN)))
def test_a_rotten_row_is_reported_in_one_line_and_the_others_are_listed(home, meta, capsys):
    _rot(home, meta)
    assert main(["--home", str(home), "runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert GOOD[:16] in out and "a good run" in out and STATS[:16] in out and "a long run" in out
    assert BAD[:16] not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headscope runs list: skipped ") and BAD[:16] in lines[0], err
    assert "Traceback" not in err


def test_a_good_store_lists_both_kinds_newest_first(home, capsys):
    assert main(["--home", str(home), "runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()] == [STATS[:16], BAD[:16], GOOD[:16]]
    assert "statistics" in out.splitlines()[0] and "statistics" not in out.splitlines()[1]
    assert err == ""


def test_stored_runs_reports_what_each_skipped_row_lacks(home):
    _rot(home, json.dumps({"model_name": "m", "n_tokens": 3, "text": 7}))
    runs, skipped = stored_runs(Store(home))
    assert [r.key for r in runs] == [STATS, GOOD]
    assert skipped == [f"{BAD[:16]}: its metadata's text is int, not text"]


def test_a_rotten_row_can_still_be_removed(home, capsys):
    _rot(home, "not json")
    assert main(["--home", str(home), "runs", "rm", BAD[:12]]) == 0
    assert main(["--home", str(home), "runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert "removed" in out and err == ""


@pytest.mark.parametrize("created", [1e300, -5.0, float("inf")])
def test_a_creation_time_no_clock_shows_is_reported(home, created, capsys):
    db = sqlite3.connect(home / "index.sqlite", isolation_level=None)
    db.execute("UPDATE records SET created=? WHERE key=?", (created, BAD))
    db.close()
    assert main(["--home", str(home), "runs", "list"]) == 0
    out, err = capsys.readouterr()
    assert BAD[:16] not in out and GOOD[:16] in out and len(err.strip().splitlines()) == 1, err


def test_control_characters_in_a_stored_text_never_reach_the_terminal(tmp_path, capsys):
    store = Store(tmp_path / "home")
    store.put(GOOD, "run", {**_meta("line one\nline two\x1b[2J\x1b]0;pwned\x07\r"), "model_name": "m\x1b[31m"},
              {"a": np.zeros(3)})
    assert main(["--home", str(tmp_path / "home"), "runs", "list"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "line one line two" in out

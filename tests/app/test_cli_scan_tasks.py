"""``headscope scan --tasks``: the Heads page's task-suite sweep from the command line (#42 item 3): bad
options are one line naming the argument, and a run writes the [length, task] accuracy grid with each
cell's n and 95 % Wilson interval to summary.json and niah_grid.csv."""

from __future__ import annotations

import csv
import json

import pytest

from tests.app.command_line import assert_one_line, headscope


@pytest.mark.parametrize("argv, names", [
    (("--tasks", "bogus"), "--tasks"), (("--tasks", ","), "--tasks"), (("--tasks", "passkey,../x"), "--tasks"),
    (("--tasks", "passkey", "--per-task", "0"), "--per-task"),
    (("--tasks", "passkey", "--per-task", "1000000000"), "--per-task"),
    (("--tasks", "passkey", "--per-task", "2.5"), "--per-task"), (("--tasks", "passkey", "--task-seed", "-1"), "--task-seed"),
    (("--tasks", "passkey", "--lengths", "512"), "--lengths"), (("--tasks", "passkey", "--lengths", "16384"), "--lengths"),
    (("--tasks", "passkey,multi_key,common_words", "--per-task", "100"), "--tasks"),  # 300 trials: over the limit
])
def test_bad_task_options_are_one_line_naming_the_argument(tmp_path, argv, names):
    code, err, torch_loaded, _ = headscope(["scan", *argv], tmp_path / "home")
    assert_one_line(code, err, names)
    assert names in err


@pytest.mark.integration
@pytest.mark.timeout(900)  # one passkey prompt of 1,024 tokens decoded, then the other per-head scores on it
def test_scan_on_the_task_suite_writes_each_tasks_interval(tmp_path):
    out = tmp_path / "out"
    code, err, _, _ = headscope(["scan", "--tasks", "passkey", "--per-task", "1", "--formats", "svg", "--out", str(out)],
                                tmp_path / "home")
    assert code == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"] == ["passkey"] and summary["lengths"] == [1024] and "depths" not in summary
    assert summary["accuracy_n"] == [[1]] and summary["n_trials"] == 1
    rows = list(csv.DictReader((out / "niah_grid.csv").open()))
    assert [(r["length"], r["task"], r["accuracy_n"]) for r in rows] == [("1024", "passkey", "1")]
    assert float(rows[0]["accuracy_low"]) <= float(rows[0]["accuracy"]) <= float(rows[0]["accuracy_high"])

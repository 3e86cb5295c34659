"""``headscope compress --tasks``: NIAH accuracy on the long-context task suite, with each task's uncompressed
answer rate printed and written, and the tasks the model cannot do dropped (#42 item 3)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from types import SimpleNamespace

import pytest


def headscope(*args, home):
    """``headscope ARGS`` through ``headscope.app.cli.main`` in this process (the model loads once per session)."""
    from headscope.app.cli import main

    saved = {k: os.environ.get(k) for k in ("HEADSCOPE_HOME", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")}
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ["HEADSCOPE_HOME"] = str(home)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.parametrize("argv, names, says", [
    (("--tasks", "bogus"), "--tasks", "unknown task(s) bogus"),
    (("--tasks", ","), "--tasks", "give one or more tasks"),
    (("--tasks", "passkey,../x"), "--tasks", "unknown task(s) ../x"),
    (("--tasks", "passkey", "--per-task", "0"), "--per-task", "between 1 and 500"),
    (("--tasks", "passkey", "--per-task", "1000000000"), "--per-task", "between 1 and 500"),
    (("--tasks", "passkey", "--per-task", "2.5"), "--per-task", "whole number"),
    (("--tasks", "passkey", "--task-seed", "-1"), "--task-seed", "at least 0"),
    (("--tasks", "passkey", "--min-rate", "2"), "--min-rate", "between 0 and 1"),
    (("--tasks", "passkey", "--min-rate", "nan"), "--min-rate", "between 0 and 1"),
    (("--tasks", "passkey", "--lengths", "512"), "--lengths", "1,024 to 8,192"),
    (("--tasks", "passkey", "--lengths", "16384"), "--lengths", "1,024 to 8,192"),
])
def test_bad_task_options_are_one_line_naming_the_argument(tmp_path, argv, names, says):
    r = headscope("compress", *argv, home=tmp_path / "home")
    assert r.returncode == 2, r.stderr
    assert names in r.stderr and says in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1, r.stderr


@pytest.mark.timeout(1200)  # a 1k-token sweep, 4 task prompts answered, then 2 policies on the kept ones
def test_compress_on_the_task_suite_prints_and_writes_each_tasks_rate(tmp_path, real_model, one_thread):
    """On the embedded model at 1,024 tokens: passkey and single-needle prompts (2 each), common words beside
    them; the rates are printed and written to summary.json, the accuracy is measured on the kept tasks'
    prompts, and a task below --min-rate is dropped."""
    out = tmp_path / "out"
    r = headscope("compress", "--lengths", "1024", "--depths", "50", "--needles", "locker-code", "--sink", "16",
                  "--recent", "64", "--fractions", "0.5", "--rankings", "retrieval", "--tasks",
                  "passkey,single_needle,common_words", "--per-task", "2", "--min-rate", "0.5", "--out", str(out),
                  "--formats", "", home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    tasks = summary["tasks"]
    assert list(tasks) == ["passkey", "single_needle", "common_words"]
    for name, t in tasks.items():
        assert t["n"] == 2 and 0 <= t["low"] <= t["rate"] <= t["high"] <= 1
        assert t["dropped"] == (t["rate"] < 0.5)
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(name + " "))
        assert f"{t['rate']:.2f} [{t['low']:.2f}, {t['high']:.2f}] n=2" in line
        assert line.rstrip().endswith("dropped") == t["dropped"]
    assert tasks["passkey"]["rate"] > 0 and tasks["single_needle"]["rate"] > 0
    kept = sum(t["n"] for t in tasks.values() if not t["dropped"])
    assert summary["n_prompts"] == kept
    # the same command again reads the stored rates and curve: the same numbers
    again = headscope("compress", "--lengths", "1024", "--depths", "50", "--needles", "locker-code", "--sink", "16",
                      "--recent", "64", "--fractions", "0.5", "--rankings", "retrieval", "--tasks",
                      "passkey,single_needle,common_words", "--per-task", "2", "--out", str(tmp_path / "again"),
                      "--formats", "", home=tmp_path / "home")
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["tasks"] == tasks

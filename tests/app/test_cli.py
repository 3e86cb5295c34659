"""The ``headscope`` command as a user runs it: real processes, the embedded model, a fresh store."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def headscope(*args, home, timeout=240):
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_run_list_figure_rm(tmp_path):
    home = tmp_path / "home"
    out = tmp_path / "out"
    r = headscope("run", "The capital of France is Paris.", "--out", str(out), "--formats", "svg", home=home)
    assert r.returncode == 0, r.stderr
    assert f"results in {out}" in r.stdout
    run_id = r.stdout.split("run ", 1)[1].split()[0]
    assert (out / "head_grid.svg").read_text().lstrip().startswith(("<svg", "<?xml"))
    manifest = json.loads((out / "head_grid.manifest.json").read_text())
    assert manifest["run_key"] == run_id and manifest["model"]["name"] == "smollm2-135m"

    listed = headscope("runs", "list", home=home)
    assert run_id[:16] in listed.stdout and "The capital of France" in listed.stdout

    again = headscope("figure", str(out / "head_grid.manifest.json"), "--out", str(tmp_path / "re"),
                      "--formats", "svg", home=home)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "re" / "head_grid.json").read_text()) == json.loads(
        (out / "head_grid.json").read_text())

    removed = headscope("runs", "rm", run_id[:12], home=home)
    assert removed.returncode == 0 and "removed" in removed.stdout
    assert run_id[:16] not in headscope("runs", "list", home=home).stdout


def test_run_in_statistics_mode_writes_statistics_and_regenerates(tmp_path):
    """A text above HEADSCOPE_MAX_TOKENS runs in statistics mode: scores, no patterns, and the
    manifest rebuilds the same figure data from the stored statistics."""
    home, out = tmp_path / "home", tmp_path / "out"
    text = (Path(__file__).resolve().parents[2] / "data" / "niah" / "haystack_prose.txt").read_text()[:1500]
    env_limit = {"HEADSCOPE_MAX_TOKENS": "64"}
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", text, "--out", str(out)],
                       env={**os.environ, "HEADSCOPE_HOME": str(home), **env_limit}, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    assert "statistics mode, no patterns kept" in r.stdout
    assert not (out / "patterns.npy").exists()
    rows = (out / "scores.csv").read_text().splitlines()
    assert rows[0] == ("layer,head,entropy,first_token,mid_sink,previous_token,duplicate_token,induction,"
                       "max_attention,streaming")
    assert len(rows) == 1 + 270
    pooled = np.load(out / "pooled.npy", allow_pickle=False)
    assert pooled.shape[:2] == (30, 9)
    again = headscope("figure", str(out / "head_grid.manifest.json"), "--out", str(tmp_path / "re"), home=home)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "re" / "head_grid.json").read_text()) == json.loads(
        (out / "head_grid.json").read_text())


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "   "), "empty"),
        (("run", "hello", "--model", "no-such-model"), "Cannot load model"),
        (("run", "--file", "/nonexistent/file.txt"), "cannot read"),
        (("figure", "/nonexistent/manifest.json"), "Cannot read manifest"),
        (("serve", "--host", "0.0.0.0", "--token", "short"), "at least 16 characters"),
    ],
)
def test_user_errors_are_messages_not_tracebacks(tmp_path, args, message):
    r = headscope(*args, home=tmp_path / "home")
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_models_lists_the_embedded_model(tmp_path):
    r = headscope("models", home=tmp_path / "home")
    assert r.returncode == 0 and "smollm2-135m" in r.stdout and "ready" in r.stdout


def test_scan_writes_tables_and_figures_and_reuses_trials(tmp_path):
    home = tmp_path / "home"
    args = ("scan", "--lengths", "256", "--depths", "50", "--needles", "locker-code", "--formats", "svg")
    first = headscope(*args, "--out", str(tmp_path / "a"), home=home)
    assert first.returncode == 0, first.stderr
    assert "1 trials answered (0 reused)" in first.stdout or "0/1 trials answered (0 reused)" in first.stdout
    scores = (tmp_path / "a" / "retrieval_scores.csv").read_text().splitlines()
    assert len(scores) == 30 and all(len(line.split(",")) == 9 for line in scores)
    assert (tmp_path / "a" / "retrieval_grid.svg").exists() and (tmp_path / "a" / "niah_grid.svg").exists()
    # the other per-head scores, over the sweep's prompts, as tables and maps
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert {"streaming", "induction", "duplicate_token", "mid_sink", "evidence"} <= set(summary["head_scores"]["scores"])
    evidence = np.loadtxt(tmp_path / "a" / "evidence_mean.csv", delimiter=",")
    assert evidence.shape == (30, 9) and 0 <= evidence.min() and evidence.max() <= 1
    assert (tmp_path / "a" / "induction" / "head_score_grid.svg").exists()
    assert (tmp_path / "a" / "mass_evidence" / "score_mass.csv").exists()
    again = headscope(*args, "--out", str(tmp_path / "b"), home=home)
    assert "(1 reused)" in again.stdout
    assert (tmp_path / "b" / "retrieval_scores.csv").read_text() == (tmp_path / "a" / "retrieval_scores.csv").read_text()
    bad = headscope("scan", "--depths", "150", "--needles", "locker-code", home=home)
    assert bad.returncode == 2 and "depth" in bad.stderr.lower() and "Traceback" not in bad.stderr


def test_ablate_writes_effects_and_a_curve_and_refuses_bad_heads(tmp_path):
    home = tmp_path / "home"
    text = "When Mary and John went to the store, John gave a drink to Mary."
    first = headscope("ablate", "--text", text, "--heads", "3.1,kv:5.0", "--method", "uniform", "--formats", "svg",
                      "--out", str(tmp_path / "a"), home=home)
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["heads"] == "3.1,5.0,5.1,5.2" and summary["method"] == "uniform"
    assert summary["text"]["mean_loss_ablated"] != summary["text"]["mean_loss_clean"]
    assert (tmp_path / "a" / "ablation_effects.svg").exists()
    curve = headscope("ablate", "--text", text, "--top-k", "3", "--by", "first_token", "--curve", "0,1,3",
                      "--seeds", "2", "--formats", "svg", "--out", str(tmp_path / "b"), home=home)
    assert curve.returncode == 0, curve.stderr
    rows = (tmp_path / "b" / "ablation_curve.csv").read_text().splitlines()
    assert rows[0].startswith("k,set,seed,value") and len(rows) == 1 + 3 + 2 * 3
    assert "top [" in curve.stdout and "random [" in curve.stdout
    for args, why in [(("--heads", "99.1"), "out of range"), (("--heads", "1.1", "--top-k", "2"), "exactly one"),
                      (("--top-k", "2", "--by", "retrieval"), "needs --sweep")]:
        bad = headscope("ablate", "--text", text, *args, home=home)
        assert bad.returncode == 2 and why in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_a_sweep_killed_mid_run_is_resumed_from_its_stored_trials(tmp_path):
    """SIGKILL ``headscope scan`` after its first trial is stored; running it again reuses that
    trial, finishes, and the store serves every record it lists."""
    import signal
    import time

    from analysis.store import Store

    home = tmp_path / "home"
    args = ["scan", "--lengths", "256", "--depths", "25,50,75", "--needles", "locker-code", "--formats", "svg",
            "--out", str(tmp_path / "out")]
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline:
        if home.exists() and Store(home).list(kind="retrieval_trial"):
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    store = Store(home)
    stored = len(store.list(kind="retrieval_trial"))
    assert 1 <= stored < 3
    assert all(store.get(r.key) is not None for r in store.list())
    again = headscope(*args, home=home)
    assert again.returncode == 0, again.stderr
    assert f"({stored} reused)" in again.stdout

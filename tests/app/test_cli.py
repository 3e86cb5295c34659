"""The ``headscope`` command as a user runs it: ``headscope.app.cli.main`` on the embedded model and a fresh store, and
real processes where the process itself is what is tested."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def headscope_process(*args, home, timeout=240, env=None):
    """``headscope ARGS`` in its own process, output captured (a pipe, not a terminal)."""
    env = {**os.environ, "HEADSCOPE_HOME": str(home), **(env or {})}
    return subprocess.run([sys.executable, "-m", "headscope.app.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def headscope(*args, home, timeout=None, env=None):
    """``headscope ARGS`` through the same ``headscope.app.cli.main`` a process runs, in this process: the
    embedded model is loaded once per test session instead of once per command (about 12 s each).
    What only a separate process shows (exit status of the interpreter, progress bars on a pipe,
    import cost, SIGKILL) is tested with :func:`headscope_process`. An exception that is not a user
    error propagates and fails the test, as its traceback would fail a process."""
    import contextlib
    import io

    from headscope.app.cli import main

    saved = {k: os.environ.get(k) for k in ("HEADSCOPE_HOME", *(env or {}))}
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update({"HEADSCOPE_HOME": str(home), **(env or {})})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's own errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["headscope", *args], code, out.getvalue(), err.getvalue())


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
    r = headscope("run", text, "--out", str(out), home=home, env=env_limit)
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
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_models_lists_the_embedded_model(tmp_path):
    r = headscope("models", home=tmp_path / "home")
    assert r.returncode == 0 and "smollm2-135m" in r.stdout and "ready" in r.stdout


def test_models_names_the_opt_in_model_and_its_terms_only_as_an_install_hint_when_missing(tmp_path, monkeypatch):
    from dataclasses import replace

    from headscope.analysis.models import EMBEDDED

    monkeypatch.setitem(EMBEDDED, "gemma3-270m", replace(EMBEDDED["gemma3-270m"], package="headscope_absent_optin_pkg"))
    r = headscope("models", home=tmp_path / "home")
    listed = [line.split()[0] for line in r.stdout.splitlines() if line and not line.startswith((" ", "Also", "Opt-in"))]
    assert r.returncode == 0 and "smollm2-135m" in listed and "gemma3-270m" not in listed
    hint = next(line for line in r.stdout.splitlines() if line.startswith("Opt-in, not installed: gemma3-270m"))
    assert "Gemma Terms of Use" in hint and "make gemma3" in hint


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
    again = headscope(*args[:-1], "svg,html", "--out", str(tmp_path / "b"), home=home)
    assert "(1 reused)" in again.stdout
    # every HTML figure of the scan, subfolders included, shares one copy of the plotting library
    pages = list((tmp_path / "b").rglob("*.html"))
    assert len(pages) > 10 and [p.name for p in (tmp_path / "b").rglob("*.js")] == ["plotly.min.js"]
    assert all(p.stat().st_size < 200_000 for p in pages)
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
    # the numbers of summary.json, as a table on stdout
    table = first.stdout.splitlines()
    assert table[0].startswith("ablated 4 heads (3.1,5.0,5.1,5.2) by uniform: attention spread uniformly")
    assert table[1].split() == ["clean", "ablated", "change"]
    t = summary["text"]
    assert table[2].split()[-3:] == [f"{t['mean_loss_clean']:.4f}", f"{t['mean_loss_ablated']:.4f}",
                                     f"{t['mean_loss_ablated'] - t['mean_loss_clean']:+.4f}"]
    assert table[2].startswith("mean loss on the text (nats)")
    assert table[3].startswith(f"p(next token {t['target_token']!r})")
    assert table[3].split()[-3:] == [f"{t['target_prob_clean']:.4f}", f"{t['target_prob_ablated']:.4f}",
                                     f"{t['target_prob_ablated'] - t['target_prob_clean']:+.4f}"]
    assert table[4].startswith("continuation") and table[-1] == f"results in {tmp_path / 'a'}"
    assert "\r" not in first.stdout + first.stderr and "\x1b" not in first.stdout + first.stderr
    curve = headscope("ablate", "--text", text, "--top-k", "3", "--by", "first_token", "--curve", "0,1,3",
                      "--seeds", "2", "--formats", "svg", "--out", str(tmp_path / "b"), home=home)
    assert curve.returncode == 0, curve.stderr
    rows = (tmp_path / "b" / "ablation_curve.csv").read_text().splitlines()
    assert rows[0].startswith("k,set,seed,value") and len(rows) == 1 + 3 + 2 * 3
    # the curve as table rows: k, top-k, random mean ± std, equal to summary.json's numbers
    c = json.loads((tmp_path / "b" / "summary.json").read_text())["curve"]
    lines = curve.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("top-k vs random curve: mean loss (nats)"))
    assert "First-token" in lines[start] or "first" in lines[start].lower()
    # the random control's top N (default 20), in the table, the summary and the exported rows
    assert "k random heads from outside the top 20 (2 sets)" in lines[start] and c["random_outside_top"] == 20
    exported = json.loads((tmp_path / "b" / "ablation_curve.json").read_text())
    assert {r.get("outside_top") for r in exported if r["set"] == "random"} == {20}
    assert "random heads outside the top 20 (mean)" in (tmp_path / "b" / "ablation_curve.svg").read_text()
    assert lines[start + 1].split() == ["k", "top-k", "random", "mean", "±", "std"]
    rows = [line.split() for line in lines[start + 2: start + 5]]
    assert rows == [[str(k), f"{top:.4f}", f"{m:.4f}", f"{sd:.4f}"]
                    for k, top, m, sd in zip(c["k"], c["top"], c["random_mean"], c["random_std"], strict=True)]
    assert [r[0] for r in rows] == ["0", "1", "3"] and rows[0][1] == rows[0][2]  # k = 0: nothing ablated
    for args, why in [(("--heads", "99.1"), "out of range"), (("--heads", "1.1", "--top-k", "2"), "exactly one"),
                      (("--top-k", "2", "--by", "retrieval"), "needs --sweep")]:
        bad = headscope("ablate", "--text", text, *args, home=home)
        assert bad.returncode == 2 and why in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.timeout(600)  # one command patches 434 units (257 s measured at load 10 when each command was a process)
def test_patch_maps_the_residual_stream_and_compares_attribution(tmp_path):
    """``headscope patch`` on an IOI-style name swap: the residual stream map (denoising) is 1 after the
    last layer at the last position and at the swapped name in layer 0 (those patches are the clean
    run), the table prints the largest effects with their attribution estimate, the figures come with
    manifests that rebuild them, and asking again reads the stored result."""
    home, out = tmp_path / "home", tmp_path / "out"
    args = ("patch", *P, "--corrupted", PATCH_CORRUPTED, "--answers", " Mary, John", "--site", "resid",
            "--attribution", "--formats", "svg")
    r = headscope(*args, "--out", str(out), home=home)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clean"] > 0 > summary["corrupted"]  # the model prefers the right name in both prompts
    assert summary["differ"] == [9] and summary["answers"] == ["·Mary", "·John"]
    rows = {row["unit"]: row for row in json.loads((out / "patching_map.json").read_text())}
    n = len(summary["clean_tokens"])
    assert len(rows) == 31 * n
    assert rows[f"out @ {n - 1} ·to"]["exact"] == pytest.approx(1.0, abs=1e-3)
    assert rows["L0 @ 9 ·John / ·Mary"]["exact"] == pytest.approx(1.0, abs=1e-3)
    assert rows["L0 @ 3 ·John"]["exact"] == pytest.approx(0.0, abs=1e-3)  # the same token in both prompts
    lines = r.stdout.splitlines()
    assert lines[0].startswith("denoise resid: residual stream")
    assert lines[2] == "largest effects (exact patching):" and lines[3].split() == ["unit", "exact", "attribution"]
    top = summary["top_exact"][0]
    assert lines[4].split()[-2:] == [f"{top['exact']:.4f}", f"{top['attribution']:.4f}"]
    a = summary["agreement"]
    assert f"Pearson {a['pearson']:.3f}, Spearman {a['spearman']:.3f}, top-10 overlap" in r.stdout
    for view in ("patching_map", "patching_agreement"):
        assert (out / f"{view}.svg").read_text().lstrip().startswith(("<svg", "<?xml"))
        assert json.loads((out / f"{view}.manifest.json").read_text())["params"]["patching"] == summary["patching"][:16]
    again = headscope("figure", str(out / "patching_agreement.manifest.json"), "--out", str(tmp_path / "re"),
                      "--formats", "", home=home)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "re" / "patching_agreement.json").read_text()) == json.loads(
        (out / "patching_agreement.json").read_text())
    stored = headscope(*args, "--out", str(tmp_path / "out2"), home=home)
    assert stored.returncode == 0, stored.stderr
    assert "(stored result)" in stored.stdout
    assert json.loads((tmp_path / "out2" / "patching_map.json").read_text()) == json.loads(
        (out / "patching_map.json").read_text())


def test_patch_with_a_built_in_pair(tmp_path):
    """``headscope patch --pair ID`` patches the shipped pair's prompts with its answers (here the
    attribution estimate alone: one forward and one backward pass)."""
    from headscope.analysis.patching_pairs import pair_by_id

    spec = pair_by_id("fact-capital-france-italy")
    out = tmp_path / "out"
    r = headscope("patch", "--pair", spec.id, "--attribution-only", "--formats", "", "--out", str(out),
                  home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pair"] == spec.id and summary["answers"] == ["·Paris", "·Rome"]
    assert "".join(summary["clean_tokens"]).replace("·", " ") == spec.clean
    assert "".join(summary["corrupted_tokens"]).replace("·", " ") == spec.corrupted
    assert summary["clean"] > 0 > summary["corrupted"]
    assert "largest effects (attribution patching):" in r.stdout


def test_patch_along_a_path(tmp_path, real_model):
    """``headscope patch --path-from … --path-to …`` prints and stores the value of
    :func:`headscope.analysis.path_patching.path_patching` on the same pair (computed here in-process)."""
    from headscope.analysis.patching_pairs import pair_by_id
    from headscope.analysis.path_patching import path_patching

    spec = pair_by_id("ioi-mary-john")
    out = tmp_path / "out"
    r = headscope("patch", "--pair", spec.id, "--path-from", "0.1,3.4", "--path-to", "9.1,12.2", "--path-site", "v",
                  "--direction", "noise", "--out", str(out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    expected = path_patching(real_model, spec.clean, spec.corrupted, list(spec.answers), [(0, 1), (3, 4)],
                             [(9, 1), (12, 2)], site="v", direction="noise")
    assert summary["value"] == pytest.approx(expected.value, abs=1e-4)
    assert summary["path_patching"] == {"senders": [[0, 1], [3, 4]], "receivers": [[9, 1], [12, 2]], "site": "v",
                                        "freeze_mlps": False}
    assert r.stdout.splitlines()[0] == "path patching, noise: 0.1,3.4 -> v of 9.1,12.2 (key-value heads)"
    assert f"value {expected.value:.4f} (0 = corrupted, 1 = clean)" in r.stdout


def test_ablate_sweep_takes_scan_needle_and_haystack_options_and_prints_niah_accuracy(tmp_path):
    """``ablate --sweep`` with a needles file and a haystack file (as ``scan`` takes them): the NIAH
    accuracy row in the table, from the needles and haystack given."""
    haystack = tmp_path / "hay.txt"
    prose = (Path(__file__).resolve().parents[2] / "data" / "niah" / "haystack_prose.txt").read_text()
    haystack.write_text("\n".join(line for line in prose.splitlines() if not line.startswith("#"))[:3000])
    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps([{"id": "violet-door", "needle": "The door of the old mill is painted violet.",
                                    "question": "What colour is the door of the old mill?", "answer": "violet"}]))
    r = headscope("ablate", "--sweep", "--lengths", "160", "--depths", "50", "--needles-file", str(needles),
                  "--haystack", str(haystack), "--heads", "3.1", "--formats", "", "--out", str(tmp_path / "out"),
                  home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    niah = json.loads((tmp_path / "out" / "summary.json").read_text())["niah"]
    assert niah["needles"] == ["violet-door"] and niah["n_prompts"] == 1 and niah["lengths"] == [160]
    row = next(line for line in r.stdout.splitlines() if line.startswith("NIAH accuracy (1 prompts)"))
    assert row.split()[-3:] == [f"{niah['accuracy_clean']:.3f}", f"{niah['accuracy_ablated']:.3f}",
                                f"{niah['accuracy_ablated'] - niah['accuracy_clean']:+.3f}"]


def test_a_sweep_killed_mid_run_is_resumed_from_its_stored_trials(tmp_path):
    """SIGKILL ``headscope scan`` after its first trial is stored; running it again reuses that
    trial, finishes, and the store serves every record it lists."""
    import signal
    import time

    from headscope.analysis.store import Store

    home = tmp_path / "home"
    args = ["scan", "--lengths", "256", "--depths", "25,50,75", "--needles", "locker-code", "--formats", "svg",
            "--out", str(tmp_path / "out")]
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "headscope.app.cli", *args], env=env, stdout=subprocess.PIPE,
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


# ---------------------------------------------------------------------------------------------
# The boundary: every bad input is one line on stderr naming the argument, exit status 2.


@pytest.fixture
def bad_files(tmp_path):
    """Files a user might pass by mistake, by name (for ``{name}`` in the argument tables)."""
    d = tmp_path / "inputs"
    d.mkdir()
    files = {
        "binary": b"\x00\x01\x02GGUF\xff" * 50,
        "latin1": "caf\xe9 cr\xe8me".encode("latin-1"),
        "empty": b"",
        "blank": b"  \n\t\n",
        "text": b"The cat sat on the mat.",
        "random.gguf": bytes(range(256)) * 16,
        "truncated.gguf": b"GGUF\x03\x00\x00\x00" + b"\xff" * 40,
        "empty.gguf": b"",
        "needles_types.json": json.dumps([{"needle": 3, "question": ["q"], "answer": None}]).encode(),
        "needles_obj.json": json.dumps({"needle": "n"}).encode(),
        "deep.json": b"[" * 100_000 + b"]" * 100_000,  # nested past the JSON parser's recursion
        "deep_obj.json": b'{"needles":' * 50_000 + b"1" + b"}" * 50_000,
        "long_number.json": b"[" + b"7" * 5000 + b"]",  # past int()'s 4,300 digits
    }
    paths = {"dir": str(d), "missing": str(d / "no-such-file.txt"), "home": str(tmp_path / "home"),
             "fifo": str(d / "fifo.txt"), "zero": "/dev/zero"}  # reading a pipe waits for a writer; /dev/zero never ends
    os.mkfifo(d / "fifo.txt")
    for name, data in files.items():
        (d / name).write_bytes(data)
        paths[name.replace(".", "_")] = str(d / name)
    weights = d / "corrupt-safetensors"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (weights / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    paths["corrupt_safetensors"] = str(weights)
    piped = d / "piped-safetensors"  # weights that are a pipe: reading them waited for a writer forever
    piped.mkdir()
    (piped / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    os.mkfifo(piped / "model.safetensors")
    paths["piped_safetensors"] = str(piped)
    deep = d / "deep-config"  # a config.json nested past the JSON parser's recursion (transformers' traceback)
    deep.mkdir()
    (deep / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (deep / "model.safetensors").write_bytes(b"")
    paths["deep_config"] = str(deep)
    good = {"manifest_version": 1, "view": "head_grid", "params": {"metric": "entropy"},
            "model": {"name": "smollm2-135m", "digest": "0" * 64}, "token_ids": [504, 3575], "settings": {}}
    broken = {
        "view_list": {"view": ["head_grid"]}, "view_unknown": {"view": "no_such_view"},
        "settings_str": {"settings": "float16"}, "params_list": {"params": [1, 2]},
        "ids_str": {"token_ids": ["a", "b"]}, "ids_float": {"token_ids": [1.5]}, "ids_negative": {"token_ids": [-4]},
        "ids_bool": {"token_ids": [True]}, "model_str": {"model": "smollm2-135m"},
        "model_name_int": {"model": {"name": 7, "digest": "x"}}, "version_str": {"manifest_version": "1"},
        "tokens_len": {"tokens": ["a"]}, "qk_str": {"settings": {"qk_layers": "all"}},
        "block_no_sink": {"settings": {"block_size": 64}}, "spans_bad": {"settings": {"spans": [[1]]}},
    }
    for name, change in broken.items():
        p = d / f"manifest_{name}.json"
        p.write_text(json.dumps({**good, **change}))
        paths[f"manifest_{name}"] = str(p)
    (d / "manifest_wrong_digest.json").write_text(json.dumps(good))  # well formed; the weights differ
    paths["manifest_wrong_digest"] = str(d / "manifest_wrong_digest.json")
    missing_field = dict(good)
    del missing_field["token_ids"]
    (d / "manifest_missing.json").write_text(json.dumps(missing_field))
    paths["manifest_missing"] = str(d / "manifest_missing.json")
    (d / "manifest_list.json").write_text("[1, 2]")
    paths["manifest_list"] = str(d / "manifest_list.json")
    (d / "manifest_bad_json.json").write_text("{\"view\": ")
    paths["manifest_bad_json"] = str(d / "manifest_bad_json.json")
    return paths


T = ("--text", "The cat sat on the mat.")
PATCH_CLEAN = "When Mary and John went to the store, John gave a drink to"
PATCH_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
P = ("--clean", PATCH_CLEAN)
PAIR = ("--pair", "ioi-mary-john")
# (argv, what the message must name); ``{name}`` is a path from ``bad_files``
BAD_INPUTS = [
    # the command itself
    ((), "COMMAND"), (("nosuch",), "COMMAND"), (("--home", "{text}", "runs", "list"), "--home"),
    # run: texts and files
    (("run",), "TEXT"), (("run", "   "), "TEXT"), (("run", "\udcff\udcfe"), "TEXT"),
    (("run", "hi", "--file", "{text}"), "--file"),
    (("run", "--file", "{missing}"), "--file"), (("run", "--file", "{binary}"), "--file"),
    (("run", "--file", "{latin1}"), "--file"), (("run", "--file", "{empty}"), "--file"),
    (("run", "--file", "{blank}"), "--file"), (("run", "--file", "{dir}"), "--file"),
    (("run", "--file", "{text}/below-a-file"), "--file"), (("run", "--file", "{fifo}"), "--file"),
    (("run", "--file", "{zero}"), "--file"), (("run", "hi", "--out", ""), "--out"), (("--home", "", "runs", "list"), "--home"),
    (("run", "hi", "--out", "{text}"), "--out"), (("run", "hi", "--formats", "svg,bmp"), "--formats"),
    # run: model files
    (("run", "hi", "--model", "{random_gguf}"), "--model"), (("run", "hi", "--model", "{truncated_gguf}"), "--model"),
    (("run", "hi", "--model", "{empty_gguf}"), "--model"), (("run", "hi", "--model", "{corrupt_safetensors}"), "--model"),
    (("run", "hi", "--model", "{piped_safetensors}"), "--model"), (("run", "hi", "--model", "{deep_config}"), "--model"),
    (("run", "hi", "--model", "{dir}"), "--model"), (("run", "hi", "--model", "{missing}.gguf"), "--model"),
    (("run", "hi", "--model", "no-such-model"), "--model"), (("run", "hi", "--model", ""), "--model"),
    # models, runs
    (("models", "extra"), "extra"), (("runs", "purge"), "action"), (("runs", "rm"), "ids"),
    (("runs", "list", "abc"), "ids"), (("runs", "rm", "zz-not-hex"), "ids"), (("runs", "rm", "abc123"), "ids"),
    # figure: files and the manifest's fields
    *[(("figure", "{" + name + "}"), "manifest") for name in (
        "missing", "binary", "latin1", "empty", "dir", "text", "manifest_view_list", "manifest_view_unknown",
        "manifest_settings_str", "manifest_params_list", "manifest_ids_str", "manifest_ids_float",
        "manifest_ids_negative", "manifest_ids_bool", "manifest_model_str", "manifest_model_name_int",
        "manifest_version_str", "manifest_tokens_len", "manifest_qk_str", "manifest_block_no_sink",
        "manifest_spans_bad", "manifest_missing", "manifest_list", "manifest_bad_json", "manifest_wrong_digest",
        "deep_json", "deep_obj_json", "long_number_json")],
    (("figure", "{manifest_ids_str}", "--formats", "gif"), "manifest"),
    # scan: lists, counts, needles, haystacks
    (("scan", "--lengths", "abc"), "--lengths"), (("scan", "--lengths", "0"), "--lengths"),
    (("scan", "--lengths", "-512"), "--lengths"), (("scan", "--lengths", ",,"), "--lengths"),
    (("scan", "--lengths", "1.5"), "--lengths"), (("scan", "--depths", "150"), "--depths"),
    (("scan", "--depths", "-1"), "--depths"), (("scan", "--depths", "50,x"), "--depths"),
    (("scan", "--depths", "nan"), "--depths"), (("scan", "--sink", "-1"), "--sink"), (("scan", "--window", "0"), "--window"),
    # S + W must leave query rows in every prompt, or every streaming score is NaN
    (("scan", "--sink", "99999999999999"), "--sink"), (("scan", "--lengths", "64", "--window", "64"), "--window"),
    (("scan", "--haystack", "{binary}"), "--haystack"), (("scan", "--haystack", "{missing}"), "--haystack"),
    (("scan", "--haystack", "{empty}"), "--haystack"), (("scan", "--haystack", "nosuch"), "--haystack"),
    (("scan", "--haystack", "{fifo}"), "--haystack"), (("scan", "--needles-file", "{zero}"), "--needles-file"),
    (("figure", "{fifo}"), "manifest"), (("figure", "{zero}"), "manifest"),
    (("scan", "--needles-file", "{latin1}"), "--needles-file"), (("scan", "--needles-file", "{missing}"), "--needles-file"),
    (("scan", "--needles-file", "{needles_types_json}"), "--needles-file"),
    (("scan", "--needles-file", "{needles_obj_json}"), "--needles-file"),
    (("scan", "--needles-file", "{text}"), "--needles-file"),
    (("scan", "--needles-file", "{deep_json}"), "--needles-file"), (("scan", "--needles-file", "{deep_obj_json}"), "--needles-file"),
    (("scan", "--needles-file", "{long_number_json}"), "--needles-file"),
    (("ablate", "--sweep", "--heads", "1.1", "--needles-file", "{deep_json}"), "--needles-file"),
    (("scan", "--needles", "no-such-needle"), "--needles"),
    (("scan", "--lengths", "100000", "--needles", "locker-code", "--depths", "50"), "--lengths"),
    (("scan", "--lengths", "6", "--needles", "locker-code", "--depths", "50"), "--lengths"),
    (("ablate", "--sweep", "--heads", "1.1", "--lengths", "100000", "--depths", "50"), "--lengths"), (("scan", "--formats", "svg,jpeg"), "--formats"),
    # ablate: counts, lists, heads, files, options that need others
    (("ablate", *T, "--top-k", "-3", "--by", "first_token"), "--top-k"),
    (("ablate", *T, "--top-k", "0", "--by", "first_token"), "--top-k"),
    (("ablate", *T, "--top-k", "abc"), "--top-k"), (("ablate", *T, "--top-k", "300", "--by", "first_token"), "--top-k"),
    (("ablate", *T, "--heads", "1.1", "--seeds", "-1"), "--seeds"), (("ablate", *T, "--heads", "1.1", "--seeds", "0"), "--seeds"),
    (("ablate", *T, "--heads", "1.1", "--curve", "0,1", "--seeds", "100000000"), "--seeds"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", "a,b"), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", "-1,2"), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", ""), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", "0,300"), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", "0,251"), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "first_token", "--curve", "0,5", "--control-top", "-1"), "--control-top"),
    (("ablate", *T, "--heads", "1.1", "--stop-at-newline"), "--stop-at-newline"),
    (("ablate", *T, "--heads", "1.1", "--depth-rule", "previous"), "--depth-rule"),
    (("scan", "--depth-rule", "after"), "--depth-rule"),
    (("ablate", *T, "--heads", "1.1", "--curve", "0,1"), "--curve"),
    (("ablate", *T, "--top-k", "2", "--by", "no_such_score"), "--by"), (("ablate", *T, "--top-k", "2"), "--by"),
    (("ablate", "--sweep", "--top-k", "2", "--by", "first_token"), "--by"),
    (("ablate", *T, "--heads", "99.1"), "--heads"), (("ablate", *T, "--heads", "1.99"), "--heads"),
    (("ablate", *T, "--heads", "kv:1.7"), "--heads"), (("ablate", *T, "--heads", "3-1"), "--heads"),
    (("ablate", *T, "--heads", "1.1", "--top-k", "2"), "--heads"), (("ablate", *T), "--heads"),
    (("ablate", "--heads", "1.1"), "--text"), (("ablate", "--text", " ", "--heads", "1.1"), "--text"),
    (("ablate", *T, "--file", "{text}", "--heads", "1.1"), "--file"),
    (("ablate", "--file", "{binary}", "--heads", "1.1"), "--file"),
    (("ablate", *T, "--heads", "1.1", "--method", "mean", "--reference-file", "{binary}"), "--reference-file"),
    (("ablate", *T, "--heads", "1.1", "--method", "mean", "--reference-file", "{empty}"), "--reference-file"),
    (("ablate", *T, "--heads", "1.1", "--reference-file", "{text}"), "--reference-file"),
    (("ablate", *T, "--heads", "1.1", "--method", "resample"), "--source"),
    (("ablate", *T, "--heads", "1.1", "--source", "Another text."), "--source"),
    (("ablate", *T, "--heads", "1.1", "--method", "bogus"), "--method"),
    (("ablate", *T, "--heads", "1.1", "--lengths", "256"), "--lengths"),
    (("ablate", *T, "--heads", "1.1", "--haystack", "passkey"), "--haystack"),
    (("ablate", "--sweep", "--heads", "1.1", "--lengths", "abc"), "--lengths"),
    (("ablate", "--sweep", "--heads", "1.1", "--depths", "101"), "--depths"),
    (("ablate", "--sweep", "--heads", "1.1", "--haystack", "{binary}"), "--haystack"),
    (("ablate", "--sweep", "--heads", "1.1", "--needles-file", "{needles_types_json}"), "--needles-file"),
    (("ablate", "--sweep", "--heads", "1.1", "--needles", "no-such-needle"), "--needles"),
    (("ablate", *T, "--heads", "1.1", "--model", "{random_gguf}"), "--model"),
    (("ablate", *T, "--heads", "1.1", "--formats", "svg,tiff"), "--formats"),
    # patch: prompt pairs, answers, sites, heads
    (("patch", *P, "--answers", " Mary, John", "--corrupted", "When Mary and John went to the big store, Mary gave "
      "a drink to"), "--corrupted"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CLEAN), "--corrupted"),
    (("patch", *P, "--answers", " Marylebone, John", "--corrupted", PATCH_CORRUPTED), "--answers"),
    (("patch", *P, "--answers", " Mary, John, Bob", "--corrupted", PATCH_CORRUPTED), "--answers"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--site", "o"), "--site"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--site", "resid", "--head", "1.1"),
     "--head"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--head", "1-1"), "--head"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--head", "99.1"), "--head"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--site", "k", "--head", "1.3"),
     "--head"),
    (("patch", *P, "--answers", " Mary", "--corrupted", PATCH_CORRUPTED), "--metric"),
    (("patch", *P, "--answers", " Mary, John", "--corrupted", PATCH_CORRUPTED, "--formats", "svg,tiff"), "--formats"),
    (("patch", *P, "--answers", " Mary, John"), "--corrupted"),
    (("patch", "--pair", "no-such-pair"), "--pair"), (("patch", "--pair", "ioi-mary-john", *P), "--pair"),
    (("patch", "--pair", " "), "--pair"), (("patch",), "--clean"),
    (("patch", *PAIR, "--path-from", "0.1"), "--path-to"), (("patch", *PAIR, "--path-to", "9.1"), "--path-from"),
    (("patch", *PAIR, "--path-from", "5.1", "--path-to", "5.2"), "--path-to"),
    (("patch", *PAIR, "--path-from", "99.1", "--path-to", "3.1"), "--path-from"),
    (("patch", *PAIR, "--path-from", "1.1", "--path-to", "3.7", "--path-site", "k"), "--path-to"),
    (("patch", *PAIR, "--path-from", "1-1", "--path-to", "3.1"), "--path-from"),
    (("patch", *PAIR, "--path-from", "1.1", "--path-to", "3.1", "--attribution"), "--attribution"),
    (("patch", *PAIR, "--path-from", "1.1", "--path-to", "3.1", "--path-site", "z"), "--path-site"),
    (("patch", *PAIR, "--path-site", "k"), "--path-site"),
    # compress: rankings, fractions, S and W, the exported policy, the sweep's inputs
    (("compress", "--fractions", "1.5"), "--fractions"), (("compress", "--fractions", "x"), "--fractions"),
    (("compress", "--rankings", "bogus"), "--rankings"), (("compress", "--rankings", ","), "--rankings"),
    (("compress", "--sink", "-1"), "--sink"), (("compress", "--recent", "0"), "--recent"),
    (("compress", "--seeds", "0"), "--seeds"), (("compress", "--tolerance", "2"), "--tolerance"),
    (("compress", "--tolerance", "nan"), "--tolerance"),
    (("compress", "--lengths", "256"), "--recent"),  # S + W = 128 + 256 keeps every key of 256 tokens
    (("compress", "--export", "bogus:0.5"), "--export"), (("compress", "--export", "retrieval:x"), "--export"),
    (("compress", "--export", "evidence:0.5"), "--export"), (("compress", "--export", "retrieval:0.3"), "--export"),
    (("compress", "--export", "retrieval:0.5:1"), "--export"),
    (("compress", *T, "--file", "{text}"), "--file"), (("compress", "--file", "{binary}"), "--file"),
    (("compress", "--needles", "no-such-needle"), "--needles"), (("compress", "--haystack", "nosuch"), "--haystack"),
    (("compress", "--lengths", "100000", "--needles", "locker-code", "--depths", "50"), "--lengths"),
    (("compress", "--model", "{random_gguf}"), "--model"),
    # serve, worker
    (("serve", "--port", "0"), "--port"), (("serve", "--port", "70000"), "--port"), (("serve", "--port", "http"), "--port"),
    (("serve", "--port", "{busy_port}"), "--port"), (("serve", "--host", ""), "--host"),
    (("serve", "--host", "0.0.0.0", "--token", "short"), "--token"),
    (("serve", "--host", "0.0.0.0", "--token", " " * 16), "--token"), (("serve", "--token", "a b c d e f g h i j"), "--token"),
    (("worker", "--concurrency", "0"), "--concurrency"), (("worker", "--page-concurrency", "-1"), "--page-concurrency"),
    (("worker", "--device", "gpu"), "--device"), (("worker", "--name", ""), "--name"), (("worker",), "HEADSCOPE_REDIS_URL"),
]


def _case_id(case):
    argv, _ = case
    return " ".join(a or "''" for a in argv)[:60] or "no-args"


@pytest.mark.parametrize("argv, names", BAD_INPUTS, ids=[_case_id(c) for c in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_argument_and_exit_2(real_model, bad_files, monkeypatch, capsys, argv, names):
    """In-process (the model is loaded once for the session): the status, the message, no traceback.
    An uncaught exception fails the test by itself."""
    import socket

    from headscope.app.cli import main

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):  # main sets them; restore after
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    monkeypatch.delenv("HEADSCOPE_REDIS_URL", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        files = {**bad_files, "busy_port": str(busy.getsockname()[1])}
        args = ["--home", files["home"], *(a.format(**files) for a in argv)] if argv and argv[0] != "--home" else \
            [a.format(**files) for a in argv]
        try:
            code = main(args)
        except SystemExit as e:  # argparse
            code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("headscope"), err
    assert names in lines[0], err


def test_bad_inputs_in_a_real_process_exit_2_without_traceback(bad_files, tmp_path):
    """The same boundary as a user meets it: separate processes, output captured."""
    for argv, names in [(("ablate", *T, "--top-k", "-3"), "--top-k"), (("figure", bad_files["manifest_view_list"]), "view"),
                        (("run", "hi", "--model", bad_files["random_gguf"]), "--model"),
                        (("run", "--file", bad_files["missing"]), "--file")]:
        r = headscope_process(*argv, home=tmp_path / "home")
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and names in r.stderr, r.stderr


HEAVY = ("torch", "transformers", "dash", "plotly", "transformer_lens", "numpy", "headscope.analysis.models")


def test_help_and_argument_errors_import_nothing_heavy_and_answer_fast(tmp_path):
    """Parsing every subcommand's arguments (good and bad) imports none of torch, transformers, dash:
    checked in a fresh process, which cannot flake; and the real command answers well within 5 s."""
    import time

    probe = (
        "import sys\n"
        "from headscope.app.cli import build_parser\n"
        "argvs = [['serve', '--port', '9000'], ['worker', '--concurrency', '2'], ['run', 'hi', '--formats', 'svg'],\n"
        "         ['scan', '--lengths', '256,512', '--depths', '0,50'], ['models'], ['runs', 'list'],\n"
        "         ['figure', 'm.json'], ['ablate', '--text', 'x', '--top-k', '3', '--curve', '0,1,3'],\n"
        "         ['ablate', '--top-k', '-3'], ['scan', '--lengths', 'abc'], ['--help'], ['ablate', '--help'],\n"
        "         ['patch', '--clean', 'a', '--corrupted', 'b', '--answers', ' x, y', '--site', 'resid'],\n"
        "         ['patch', '--help'], ['compress', '--rankings', 'retrieval,random', '--fractions', '0.1,0.5'],\n"
        "         ['compress', '--export', 'retrieval:0.3'], ['compress', '--help']]\n"
        "for argv in argvs:\n"
        "    try:\n"
        "        build_parser().parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
    for argv, code in [(("--help",), 0), (("ablate", "--help"), 0), (("scan", "--help"), 0),
                       (("ablate", "--top-k", "-3"), 2), (("run", "--file", str(tmp_path / "missing.txt")), 2)]:
        t = time.perf_counter()
        r = headscope_process(*argv, home=tmp_path / "home", timeout=60)
        took = time.perf_counter() - t
        assert r.returncode == code, r.stderr
        assert took < 5, f"headscope {' '.join(argv)} took {took:.1f} s"


def test_captured_output_has_no_progress_bars_and_clean_result_lines(tmp_path):
    """Output to a pipe: no carriage returns or escape codes (headscope's bars and transformers'
    'Loading weights' bar are off), and each result is one clean line."""
    out = tmp_path / "out"
    r = headscope_process("run", "The capital of France is Paris.", "--out", str(out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    for stream in (r.stdout, r.stderr):
        assert "\r" not in stream and "\x1b" not in stream, repr(stream[:300])
    assert "Loading weights" not in r.stderr and "%|" not in r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("run ") and len(lines[0].split()) == 2
    assert lines[1].startswith("7 tokens, mean loss ") and lines[1].endswith("(full patterns)")
    assert lines[2] == f"results in {out}"


def test_worker_with_an_unreachable_redis_is_one_line_exit_2(monkeypatch, capsys):
    """A Redis URL nothing listens on, or one that is not a URL: the variable is named, no traceback."""
    import socket

    from headscope.app.cli import main

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url in (f"redis://127.0.0.1:{port}/0", "not a url"):
        monkeypatch.setenv("HEADSCOPE_REDIS_URL", url)
        assert main(["worker"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "HEADSCOPE_REDIS_URL" in lines[0] and "cannot reach Redis" in lines[0], lines


def test_scan_defaults_for_s_and_w_are_the_kernels_defaults():
    """The CLI spells S and W out (so --help stays light); they must be the kernels' own defaults."""
    from headscope.app.cli import build_parser
    from headscope.kernels.statistics import DEFAULT_SINK_SIZE, DEFAULT_WINDOW

    args = build_parser().parse_args(["scan", "--model", "smollm2-135m"])
    assert (args.sink, args.window) == (DEFAULT_SINK_SIZE, DEFAULT_WINDOW)


def test_compare_two_runs_prints_the_largest_changes_and_writes_rebuildable_figures(tmp_path):
    """Two texts of equal length on the embedded model: the printed changes are the previous-token scores
    of the runs' exported patterns, worked by hand and subtracted (second − first), the figures rebuild from their manifests, a bad id exits 2."""
    home = tmp_path / "home"
    ids, scores = [], []
    for i, text in enumerate(["The capital of France is Paris.", "The capital of Italy is Rome."]):
        r = headscope("run", text, "--out", str(tmp_path / f"run{i}"), "--formats", "svg", home=home)
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.split("run ", 1)[1].split()[0])
        patterns = np.load(tmp_path / f"run{i}" / "patterns.npy", allow_pickle=False).astype(np.float64)
        n = patterns.shape[-1]  # previous-token score by hand: (1/(n−1)) Σ_{i≥1} A[i, i−1]
        by_hand = np.mean([patterns[:, :, q, q - 1] for q in range(1, n)], axis=0)
        scores.append({(la, h): float(by_hand[la, h]) for la in range(30) for h in range(9)})
    out = tmp_path / "cmp"
    r = headscope("compare", ids[0][:12], ids[1][:12], "--metric", "previous_token", "--head", "3.1", "--out", str(out),
                  "--formats", "svg", home=home)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "two prompts on one model" and summary["differ"] == [3, 5]  # France/Italy, Paris/Rome
    biggest = max(scores[0], key=lambda h: abs(scores[1][h] - scores[0][h]))
    top = summary["largest_changes"][0]
    assert (top["layer"], top["head"]) == biggest
    assert top["change"] == pytest.approx(scores[1][biggest] - scores[0][biggest], abs=1e-6)
    assert f"{biggest[0]:>3}.{biggest[1]:<2}" in r.stdout and "second − first" in r.stdout
    for view in ("run_comparison", "attention_difference"):
        assert (out / f"{view}.svg").exists()
        again = headscope("figure", str(out / f"{view}.manifest.json"), "--out", str(tmp_path / view), "--formats",
                          "svg", home=home)
        assert again.returncode == 0, again.stderr
        assert json.loads((tmp_path / view / f"{view}.json").read_text()) == json.loads((out / f"{view}.json").read_text())
    bad = headscope("compare", ids[0][:12], "feedfacefeedface", home=home)
    assert bad.returncode == 2 and "argument second" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(900)  # a sweep and two policy sets (eager, statistics): 57 s beside one process, over 300 s at load 5
def test_compress_prints_the_policy_table_and_writes_a_pattern_folder(tmp_path, real_model, capsys, monkeypatch):
    """In-process on the embedded model, one needle at 256 tokens: the uncompressed row, the retrieval-ranked
    policy keeping half the KV groups full, all-streaming; KV numbers by hand for 30 layers × 3 KV heads ×
    d_head 64 in float32; the exported TSV reads back as 30 × 3."""
    from headscope.app.cli import main

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    out = tmp_path / "out"
    code = main(["--home", str(tmp_path / "home"), "compress", "--lengths", "256", "--depths", "50", "--needles",
                 "locker-code", "--sink", "16", "--recent", "64", "--fractions", "0.5", "--rankings",
                 "retrieval,all_streaming", "--out", str(out), "--formats", "html"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    base, rows = summary["baseline"], {r["ranking"]: r for r in summary["rows"]}
    n = base["kv_tokens"]
    assert 200 < n <= 256 and base["kv_full_bytes"] == 30 * 3 * n * 2 * 64 * 4
    assert base["agreement"] == 1.0 and base["niah_accuracy"] == 1.0  # the sweep's one trial was answered
    assert rows["all_streaming"]["kv_fraction"] == pytest.approx(80 / n)
    assert rows["retrieval"]["kv_fraction"] == pytest.approx((45 * n + 45 * 80) / (90 * n))
    assert rows["all_streaming"]["loss"] > base["loss"] and rows["all_streaming"]["agreement"] < 1.0
    lines = printed.splitlines()
    assert lines[1].split() == ["ranking", "seed", "full", "KV", "frac", "KV", "MiB", "loss", "agree", "NIAH", "[95%", "CI]", "n"]
    assert lines[2].split()[0] == "uncompressed" and f"{base['loss']:.4f}" in lines[2]
    assert any(line.startswith("retrieval ") and f"{rows['retrieval']['kv_fraction']:.3f}" in line for line in lines)
    assert lines[-1] == f"results in {out}"
    with open(out / "compress.csv") as f:
        assert len(f.read().strip().splitlines()) == 1 + 2
    table = np.loadtxt(out / "pattern" / "full_attention_heads.tsv", delimiter="\t")
    assert table.shape == (30, 3) and set(np.unique(table)) <= {0.0, 1.0}
    config = json.loads((out / "pattern" / "config.json").read_text())
    assert (config["sink_size"], config["recent_size"]) == (16, 64)
    exported = summary["exported"]
    assert int(table.sum()) == round(0.5 * 90) if exported["ranking"] == "retrieval" else table.sum() == 0
    # the page's figures, with data and manifests: the Pareto view's table is summary.json's rows
    pareto = json.loads((out / "compression_pareto.json").read_text())
    assert pareto[0]["ranking"] == "uncompressed" and pareto[0]["loss"] == pytest.approx(base["loss"])
    assert [(r["ranking"], r["kv_fraction"], r["loss"]) for r in pareto[1:3]] == [
        (r["ranking"], pytest.approx(r["kv_fraction"]), pytest.approx(r["loss"])) for r in summary["rows"]]
    assert (out / "compression_pareto.html").stat().st_size > 0
    policy = json.loads((out / "compression_policy.json").read_text())
    assert np.array([r["full"] for r in policy]).reshape(30, 3).tolist() == table.astype(int).tolist()
    # `headscope figure` rebuilds both from their manifests and the stored curve
    for view in ("compression_pareto", "compression_policy"):
        again = main(["--home", str(tmp_path / "home"), "figure", str(out / f"{view}.manifest.json"), "--out",
                      str(tmp_path / view), "--formats", "html"])
        assert again == 0
        assert json.loads((tmp_path / view / f"{view}.json").read_text()) == json.loads((out / f"{view}.json").read_text())
    assert summary["backend"] == "eager"  # auto: 256 tokens is under HEADSCOPE_MAX_TOKENS on CPU
    # the same policies through the kernels' key mask (statistics mode, O(N) memory): the same numbers
    code = main(["--home", str(tmp_path / "home"), "compress", "--lengths", "256", "--depths", "50", "--needles",
                 "locker-code", "--sink", "16", "--recent", "64", "--fractions", "0.5", "--rankings",
                 "retrieval,all_streaming", "--backend", "statistics", "--out", str(tmp_path / "stats")])
    capsys.readouterr()
    assert code == 0
    stats = json.loads((tmp_path / "stats" / "summary.json").read_text())
    assert stats["backend"] == "statistics"
    for a, b in zip([base, *summary["rows"]], [stats["baseline"], *stats["rows"]], strict=True):
        assert (a["ranking"], a["kv_bytes"], a["agreement"], a["niah_accuracy"]) == \
            (b["ranking"], b["kv_bytes"], b["agreement"], b["niah_accuracy"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)


def test_a_run_the_store_cannot_write_is_one_line_exit_2(tmp_path):
    """A store that refuses the run (a file where its folder goes; a full disk reads the same) ends
    `headscope run` with one line that says nothing was stored and what to check, exit status 2; it
    was a NotADirectoryError traceback."""
    home = tmp_path / "home"
    assert headscope("runs", "list", home=home).returncode == 0  # the store exists
    records = home / "records"
    records.mkdir(exist_ok=True)
    for i in range(256):
        if not (records / f"{i:02x}").exists():
            (records / f"{i:02x}").write_text("not a folder")
    r = headscope("run", "The capital of France is Paris.", "--out", str(tmp_path / "out"), home=home)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "could not be stored (Not a directory): nothing was stored" in lines[0], r.stderr
    assert "argument" not in lines[0] and str(home) not in lines[0], r.stderr  # no argument was wrong


def test_ablate_on_a_sweep_writes_n_and_wilson_intervals_in_summary_json_and_the_curve_csv(tmp_path):
    """#42 item 4: ``ablate --sweep`` with a NIAH curve: summary.json's accuracies and curve points carry n
    and their 95 % Wilson interval (the random control's pooled over all seeds' prompts, and its seed
    band), the curve's CSV has the interval columns, and the table prints them."""
    import csv

    from headscope.analysis.intervals import seed_band, wilson

    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps([
        {"id": "passkey", "needle": "The secret passkey is 7731.", "question": "What is the secret passkey?",
         "answer": "7731"},
        {"id": "never", "needle": "The secret passkey is 7731.", "question": "What is the secret passkey?",
         "answer": "walrus"}]))
    out = tmp_path / "out"
    r = headscope("ablate", "--sweep", "--lengths", "160", "--depths", "25,75", "--needles-file", str(needles),
                  "--haystack", "passkey", "--top-k", "1", "--by", "retrieval", "--curve", "0,1", "--seeds", "2",
                  "--control-top", "1", "--formats", "", "--out", str(out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    niah = summary["niah"]
    assert niah["n_prompts"] == 4
    for which in ("clean", "ablated"):
        k = round(niah[f"accuracy_{which}"] * 4)
        p = wilson(k, 4)
        assert niah[f"accuracy_{which}_n"] == 4
        assert (niah[f"accuracy_{which}_low"], niah[f"accuracy_{which}_high"]) == pytest.approx((p.low, p.high))
    assert niah["accuracy_clean"] == 0.5  # the passkey needle is answered at both depths, the other never
    c = summary["curve"]
    assert c["n_prompts"] == 4 and c["top_n"] == [4, 4]
    for j, top in enumerate(c["top"]):
        p = wilson(round(top * 4), 4)
        assert (c["top_low"][j], c["top_high"][j]) == pytest.approx((p.low, p.high))
        pooled = wilson(round(sum(seed[j] for seed in c["random"]) * 4), 8)
        assert c["random_pooled_n"][j] == 8
        assert (c["random_pooled_low"][j], c["random_pooled_high"][j]) == pytest.approx((pooled.low, pooled.high))
        band = seed_band([seed[j] for seed in c["random"]])
        assert (c["random_seed_low"][j], c["random_seed_high"][j]) == (band.low, band.high)
    with (out / "ablation_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    top_rows = [row for row in rows if row["set"] == "top"]
    assert [int(row["value_n"]) for row in top_rows] == [4, 4]
    assert float(top_rows[0]["value_low"]) == pytest.approx(c["top_low"][0])
    assert [row["k"] for row in rows if row["set"] == "random, all seeds"] == ["0", "1"]
    lines = r.stdout.splitlines()
    assert any(line.split()[:1] == ["95"] or "95 % Wilson interval" in line for line in lines)
    interval_line = next(line for line in lines if line.strip().startswith("95 % Wilson interval"))
    assert f"[{niah['accuracy_clean_low']:.3f}, {niah['accuracy_clean_high']:.3f}]" in interval_line
    start = next(i for i, line in enumerate(lines) if line.startswith("top-k vs random curve: NIAH accuracy on 4"))
    assert f"[{c['top_low'][1]:.3f}, {c['top_high'][1]:.3f}]" in lines[start + 3]


def test_scan_writes_n_and_the_wilson_interval_of_every_niah_accuracy(tmp_path):
    """#42 item 4: ``scan``'s summary.json gives each cell's n and 95 % Wilson interval and the sweep's
    overall accuracy, niah_grid.csv has the interval columns, and the printed line says the interval."""
    import csv

    from headscope.analysis.intervals import wilson

    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps([
        {"id": "passkey", "needle": "The secret passkey is 7731.", "question": "What is the secret passkey?",
         "answer": "7731"},
        {"id": "never", "needle": "The secret passkey is 7731.", "question": "What is the secret passkey?",
         "answer": "walrus"}]))
    out = tmp_path / "out"
    r = headscope("scan", "--lengths", "160", "--depths", "50", "--needles-file", str(needles), "--haystack", "passkey",
                  "--formats", "", "--out", str(out), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    p = wilson(1, 2)
    assert summary["accuracy"] == [[0.5]] and summary["accuracy_n"] == [[2]]
    assert summary["accuracy_low"] == [[pytest.approx(p.low)]] and summary["accuracy_high"] == [[pytest.approx(p.high)]]
    assert summary["overall_accuracy"] == {"accuracy": 0.5, "accuracy_n": 2, "accuracy_low": pytest.approx(p.low),
                                           "accuracy_high": pytest.approx(p.high)}
    with (out / "niah_grid.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert (row["accuracy_n"], float(row["accuracy_low"])) == ("2", pytest.approx(p.low))
    assert "1/2 trials answered (0 reused), accuracy 0.50 [0.09, 0.91] n=2 (95 % Wilson)" in r.stdout

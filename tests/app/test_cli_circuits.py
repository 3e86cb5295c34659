"""``headscope circuits`` and ``headscope explain`` on the embedded model: what they write adds up to the
model's own numbers (checked against the model's logits and its hooked attention scores, not headscope's
helpers), the figures rebuild from their manifests alone, and a user's mistake is one line and exit 2."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess

import pytest

from tests.app.command_line import assert_one_line
from tests.app.command_line import headscope as headscope_process

pytestmark = pytest.mark.integration

TEXT = "When Mary and John went to the store, John gave a drink to"


def headscope(*args, home):
    """``headscope ARGS`` through ``headscope.app.cli.main`` in this process (the model loads once per session)."""
    from headscope.app.cli import main

    saved = os.environ.get("HEADSCOPE_HOME")
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ["HEADSCOPE_HOME"] = str(home)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
    finally:
        if saved is None:
            os.environ.pop("HEADSCOPE_HOME", None)
        else:
            os.environ["HEADSCOPE_HOME"] = saved
    return subprocess.CompletedProcess(["headscope", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def circuits_out(tmp_path_factory):
    """One ``headscope circuits`` run (composition scores are computed once per store and model)."""
    home, out = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("out")
    r = headscope("circuits", "--text", TEXT, "--answers", " Mary, John", "--out", str(out), "--formats", "svg",
                  home=home)
    assert r.returncode == 0, r.stderr
    return home, out, r


def _model():
    from headscope.analysis.models import load_model

    return load_model("smollm2-135m")


def test_circuits_attributions_add_up_to_the_models_logit_difference(circuits_out):
    import torch

    home, out, r = circuits_out
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "direct_logit_attribution.csv") as f:
        rows = list(csv.DictReader(f))
    names = [row["component"] for row in rows]
    assert names[0] == "embed" and names[-1] == "bias" and "23.3" in names and "mlp.29" in names
    assert len(names) == 1 + 30 * 9 + 30 + 1
    total = sum(float(row["value"]) for row in rows)
    assert total == pytest.approx(summary["logit_diff"], rel=1e-4)
    model = _model()  # the model's own logits, through no headscope helper
    ids = model.input_ids(TEXT)
    with torch.inference_mode():
        logits = model.bridge(torch.tensor([ids]))[0, -1].double()
    mary, john = model.encode(" Mary")[0], model.encode(" John")[0]
    assert summary["logit_diff"] == pytest.approx(float(logits[mary] - logits[john]), rel=1e-3)
    assert summary["logit_diff"] > 0  # the model prefers the indirect object
    assert summary["answers"] == ["·Mary", "·John"] and summary["tokens"][-1] == "·to"
    assert summary["top_heads"][0]["head"] in r.stdout and "results in" in r.stdout


def test_circuits_writes_composition_of_every_earlier_head(circuits_out):
    from headscope.analysis.composition import composition_scores

    home, out, _ = circuits_out
    with open(out / "composition.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["sender", "receiver", "kind", "score"]
    assert len(rows) == 3 * sum(9 * 9 * b for b in range(30))  # every earlier head into every later one
    assert {row["kind"] for row in rows} == {"q", "k", "v"}
    assert all(int(row["sender"].split(".")[0]) < int(row["receiver"].split(".")[0]) for row in rows[::997])
    k = {(row["sender"], row["receiver"]): float(row["score"]) for row in rows if row["kind"] == "k"}
    direct = composition_scores(_model()).k
    for sender, receiver in (("16.0", "18.6"), ("0.0", "1.0"), ("28.8", "29.8")):
        (sl, sh), (rl, rh) = (map(int, x.split(".")) for x in (sender, receiver))
        assert k[sender, receiver] == pytest.approx(direct[sl, sh, rl, rh], rel=1e-5)


def test_circuits_figures_rebuild_from_their_manifests_in_an_empty_store(circuits_out, tmp_path):
    home, out, _ = circuits_out
    for view in ("circuit_dla", "circuit_dla_others", "circuit_composition"):
        assert (out / f"{view}.svg").read_text().lstrip().startswith(("<svg", "<?xml"))
        again = tmp_path / view
        r = headscope("figure", str(out / f"{view}.manifest.json"), "--out", str(again), "--formats", "",
                      home=tmp_path / "empty")
        assert r.returncode == 0, r.stderr
        assert json.loads((again / f"{view}.json").read_text()) == json.loads((out / f"{view}.json").read_text())


def test_circuits_again_reads_the_stored_result(circuits_out, tmp_path):
    import time

    home, out, _ = circuits_out
    t = time.perf_counter()
    r = headscope("circuits", "--text", TEXT, "--answers", " Mary, John", "--out", str(tmp_path), "--formats", "",
                  home=home)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t < 15  # composition (20-40 s here) is not computed again
    assert json.loads((tmp_path / "summary.json").read_text())["logit_diff"] == \
        json.loads((out / "summary.json").read_text())["logit_diff"]


def test_explain_terms_add_up_to_the_models_own_score(circuits_out, tmp_path):
    import torch

    home, _, _ = circuits_out
    out = tmp_path / "out"
    r = headscope("explain", "--text", TEXT, "--head", "23.3", "--query", "13", "--key", "1", "--out", str(out),
                  "--formats", "svg", home=home)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "qk_attribution.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["query_component", "key_component", "contribution"]
    n = len(summary["query_sums"])
    assert len(rows) == n * n and n == 1 + 23 * 9 + 23 + 2  # embed, earlier heads and MLPs, bias, input_bias
    total = sum(float(row["contribution"]) for row in rows)
    assert total == pytest.approx(summary["score"], rel=1e-4)
    assert summary["check"]["terms_sum_to_score"] and summary["query_token"] == "·to"
    model = _model()  # the model's own score, from its hooked attention scores
    kept = {}

    def keep(scores, hook=None):
        kept["s"] = scores[0, 3, 13, 1].item()

    with torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([model.input_ids(TEXT)]), return_type=None,
                                    fwd_hooks=[("blocks.23.attn.hook_attn_scores", keep)])
    assert summary["score"] == pytest.approx(kept["s"], rel=1e-3, abs=1e-4)
    by_component = {}
    for row in rows:
        by_component[row["query_component"]] = by_component.get(row["query_component"], 0) + float(row["contribution"])
    assert by_component["22.4"] == pytest.approx(summary["query_sums"]["22.4"], abs=1e-9)
    assert "terms sum to" in r.stdout
    again = tmp_path / "again"
    r = headscope("figure", str(out / "qk_cell.manifest.json"), "--out", str(again), "--formats", "",
                  home=tmp_path / "empty")
    assert r.returncode == 0, r.stderr
    assert len(json.loads((again / "qk_cell.json").read_text())) == n * n


# Each: argv after the command, and what the one line must name. Checked before the model loads.
BOUNDARY = [
    (["circuits", "--text", TEXT, "--answers", " Mary"], "--answers"),
    (["circuits", "--text", TEXT, "--answers", " Mary, John, Bob"], "--answers"),
    (["circuits", "--text", TEXT, "--answers", " , "], "--answers"),
    (["circuits", "--text", "   ", "--answers", " Mary, John"], "--text"),
    (["circuits", "--text", TEXT, "--answers", " Mary, John", "--formats", "exe"], "--formats"),
    (["explain", "--text", TEXT, "--head", "23", "--query", "1", "--key", "0"], "--head"),
    (["explain", "--text", TEXT, "--head", "2.3.4", "--query", "1", "--key", "0"], "--head"),
    (["explain", "--text", TEXT, "--head", "٢.3", "--query", "1", "--key", "0"], "--head"),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "-1", "--key", "0"], "--query"),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "1e3", "--key", "0"], "--query"),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "1"], "--key"),
]

# Checked once the model is loaded: the message says what was wrong.
LOADED = [
    (["circuits", "--text", TEXT, "--answers", " Maryland Johnson, John"], ("--answers", "tokens")),
    (["circuits", "--text", TEXT, "--answers", " Mary, Mary"], ("--answers", "same token")),
    (["circuits", "--text", "word " * 3000, "--answers", " Mary, John"], ("--text", "HEADSCOPE_MAX_TOKENS")),
    (["explain", "--text", TEXT, "--head", "30.0", "--query", "1", "--key", "0"], ("--head", "layer")),
    (["explain", "--text", TEXT, "--head", "0.9", "--query", "1", "--key", "0"], ("--head", "head")),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "14", "--key", "0"], ("--query", "0..13")),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "99999999999", "--key", "0"], ("--query", "outside")),
    (["explain", "--text", TEXT, "--head", "2.3", "--query", "1", "--key", "5"], ("--key", "after query")),
]


@pytest.mark.parametrize("argv, flag", BOUNDARY, ids=[" ".join(a[0:1] + a[-2:]) for a, _ in BOUNDARY])
def test_a_mistyped_argument_is_one_line_before_the_model_loads(argv, flag, tmp_path):
    code, err, torch_loaded, _ = headscope_process(argv, tmp_path)
    assert_one_line(code, err, flag)
    assert not torch_loaded


@pytest.mark.parametrize("argv, expected", LOADED, ids=[" ".join(a[-4:]) for a, _ in LOADED])
def test_a_wrong_answer_head_or_position_is_one_line(argv, expected, tmp_path):
    r = headscope(*argv, "--formats", "", home=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert str(tmp_path) not in lines[0]  # no server path


def test_help_says_composition_is_computed_once():
    from headscope.app.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["circuits", "--help"])
    assert "once per model" in " ".join(out.getvalue().split())

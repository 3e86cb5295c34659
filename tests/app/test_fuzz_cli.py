"""Property-based tests of the command line: odd texts and head lists end in exit status 0 (it
worked) or 2 (a message on stderr) — never a traceback or a hang."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.analysis.test_fuzz_inputs import TEXT

pytestmark = pytest.mark.integration

CLI = settings(max_examples=10, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HEADS = st.one_of(st.text(max_size=30), st.sampled_from(["12.3", "kv:14.1", "7.*", "L3H2", "29.8,0.0", "30.0", "-1.2",
                                                         "kv:99.0", "1.9", "", ",,,", "1.1 2.2;3.3"]))


def run_cli(argv, capsys):
    from app.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse: a usage message and status 2
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out


@CLI
@given(heads=HEADS)
def test_ablate_head_lists(real_model, tmp_path, capsys, heads):
    code, out = run_cli(["--home", str(tmp_path / "home"), "ablate", "--text", "The cat sat on the mat.",
                         "--heads", heads, "--formats", "", "--out", str(tmp_path / "out")], capsys)
    assert code in (0, 2)
    if code == 2:
        assert out.err.strip()


@CLI
@given(text=TEXT)
def test_run_odd_texts(real_model, tmp_path, capsys, text):
    code, out = run_cli(["--home", str(tmp_path / "home"), "run", text, "--out", str(tmp_path / "out")], capsys)
    assert code in (0, 2)
    if code == 0:
        assert "tokens, mean loss" in out.out
    else:
        assert out.err.strip()


NUMBERS = st.one_of(st.text(max_size=12), st.integers(-10**6, 10**6).map(str),
                    st.lists(st.integers(-50, 400), max_size=4).map(lambda xs: ",".join(map(str, xs))),
                    st.sampled_from(["", ",", "1,,2", "1.5", "nan", "inf", "-0", " 3 ", "1e3", "0x10", "٣"]))


@settings(max_examples=60, deadline=None)
@given(top_k=NUMBERS, seeds=NUMBERS, curve=NUMBERS, lengths=NUMBERS, depths=NUMBERS)
def test_ablate_numbers_are_parsed_in_range_or_refused_in_one_line(top_k, seeds, curve, lengths, depths):
    """Whatever is typed for the counts and lists, parsing either gives values in range or exits 2
    with one line naming an argument (parsing alone: nothing heavy runs)."""
    import contextlib
    import io

    from app.cli import build_parser

    err = io.StringIO()
    argv = ["ablate", "--sweep", "--top-k", top_k, "--seeds", seeds, "--curve", curve, "--lengths", lengths,
            "--depths", depths]
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        assert e.code == 2 and len(lines) == 1, err.getvalue()
        assert any(f"argument {flag}:" in lines[0] for flag in ("--top-k", "--seeds", "--curve", "--lengths",
                                                                "--depths")), lines[0]
        return
    assert args.top_k >= 1 and args.seeds >= 1
    assert args.curve and all(k >= 0 for k in args.curve)
    assert args.lengths and all(n >= 1 for n in args.lengths)
    assert args.depths and all(0 <= d <= 100 for d in args.depths)

"""Property-based tests of the command line: odd texts and head lists end in exit status 0 (it
worked) or 2 (a message on stderr) — never a traceback or a hang."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.hostile_text import TEXT

pytestmark = pytest.mark.integration

CLI = settings(max_examples=10, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HEADS = st.one_of(st.text(max_size=30), st.sampled_from(["12.3", "kv:14.1", "7.*", "L3H2", "29.8,0.0", "30.0", "-1.2",
                                                         "kv:99.0", "1.9", "", ",,,", "1.1 2.2;3.3"]))


def run_cli(argv, capsys):
    from headscope.app.cli import main

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

    from headscope.app.cli import build_parser

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


# ---------------------------------------------------------------------------------------------
# Every subcommand, any of its options, hostile values: one line and exit 2, or the arguments were
# accepted. The options are read from the parser itself, so a new option is fuzzed without a list.

# what a command line can carry: text without NUL, and bytes that are not UTF-8 (Python gives them to
# argv as lone surrogates, U+DC80..U+DCFF)
HOSTILE = st.one_of(
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=16),
    st.binary(max_size=12).filter(lambda b: b"\x00" not in b).map(os.fsdecode),
    st.integers(-10**30, 10**30).map(str),
    st.sampled_from(["", " ", "-1", "0", "1", "1.5", "nan", "inf", "-inf", "1e309", "0x10", "٣", "３", "²", "1_000",
                     "7" * 5000, "1" * 40, ",", ",,", "1,,2", "a,b", "3.1,kv:5.0", "99.99", "1.1", "-1.-1", "1.1.1",
                     "kv:", "*", "*.*", "..", ".", "/", "~", "/dev/zero", "/dev/stdin", "/etc/passwd", "/proc/self",
                     "/nonexistent/x", "no-such-model", "smollm2-135m", "http://x/y", "\udcff\udcfe", "\x1b[31m",
                     "a" * 3000, "prose", "passkey", "retrieval", "random:0.5:9", "all_streaming", "0.1,0.5",
                     "locker-code", "ioi-mary-john", "z", "resid", "denoise", "svg", "svg,bmp", "nearest",
                     "localhost", "0.0.0.0", "::1", "evil.example", "cuda:99", "mps", "{}", "[]", "%s%s%n"]),
)


def _subcommands():
    import argparse

    from headscope.app.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, parser in sub.choices.items():
        positionals = [a for a in parser._actions if not a.option_strings and a.dest != "help"]
        options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        out[name] = (positionals, options)
    return out


@st.composite
def command_lines(draw):
    commands = _subcommands()
    name = draw(st.sampled_from(sorted(commands)))
    positionals, options = commands[name]
    argv = [name]
    for action in positionals:
        if action.choices:
            argv.append(draw(st.one_of(st.sampled_from(sorted(action.choices)), HOSTILE)))
        elif action.nargs in ("*", "?"):
            argv += draw(st.lists(HOSTILE, max_size=2))
        else:
            argv.append(draw(HOSTILE))
    for action in draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda a: a.dest)) if options else []:
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true
            argv.append(flag)
        elif action.choices:
            argv += [flag, draw(st.one_of(st.sampled_from(sorted(map(str, action.choices))), HOSTILE))]
        else:
            argv += [flag, draw(HOSTILE)]
    return argv


class ReachedHeavyWork(Exception):
    """Raised where a command would load a model or start a server: its arguments were all accepted."""


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=command_lines())
def test_every_subcommand_answers_bad_arguments_in_one_line(tmp_path_factory, monkeypatch, capsys, argv):
    """Any subcommand with any of its options given hostile values (other scripts' digits, 5,000 digits,
    surrogates, device files, URLs, escapes): exit 2 with one line naming what to fix, or the arguments
    were accepted. The run stops where a model would load or a server start (the fuzz covers the argument
    boundary; test_ablate_head_lists and test_cli.py run the real model past it)."""
    from headscope.analysis import models
    from headscope.app import export, jobs
    from headscope.app.cli import main

    def stop(*_args, **_kwargs):
        raise ReachedHeavyWork

    for module in (models, export):
        monkeypatch.setattr(module, "load_model", stop)
    monkeypatch.setattr(jobs, "prepare_server_threads", stop)
    for var in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_ALLOWED_HOSTS"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):  # main sets them; restore after
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    work = tmp_path_factory.mktemp("fuzz")
    monkeypatch.chdir(work)  # a relative --out lands here
    argv = [str(work / "out") if i and argv[i - 1] == "--out" and a.startswith(("/", "~")) else a
            for i, a in enumerate(argv)]
    try:
        code = main(["--home", str(work / "home"), *argv])
    except SystemExit as e:
        code = e.code
    except ReachedHeavyWork:
        capsys.readouterr()
        event(f"{argv[0]}: accepted")
        return
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    event(f"{argv[0]}: exit {code}")
    if argv[0] in ("models", "runs") and code == 0:
        return
    if argv[:2] == ["runs", "rm"] and code == 2 and len(lines) > 1:  # one line for each id it could not remove
        assert all(line.startswith("headscope runs rm: argument ids:") for line in lines), err
        return
    assert code == 2 and len(lines) == 1 and lines[0].startswith("headscope"), (argv, code, err[-2000:])

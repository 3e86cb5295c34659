"""Every mistake a user can make on the command line ends in one line on stderr and exit status 2, never a
traceback, whatever the command imported before it noticed; and a mistake in the arguments answers
before torch loads (well under 2 s), as the README promises (app/cli/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.command_line import assert_one_line, headscope

ROOT = Path(__file__).resolve().parents[2]


TEXT = ["--text", "The cat sat on the mat."]
FAST = [
    # (argv, what the line must say)
    (["run", "A text.", "--formats", "svg,bogus"], "argument --formats"),
    (["scan", "--formats", "gif"], "argument --formats"),
    (["scan", "--sink", "500", "--window", "64", "--lengths", "512"], "argument --sink/--window"),
    (["scan", "--needles", "locker-code,nope"], "argument --needles"),
    (["scan", "--haystack", "nosuch"], "--haystack"),
    (["scan", "--depth-rule", "sideways"], "argument --depth-rule"),
    (["ablate", "--heads", "1.1", *TEXT, "--formats", "jpg"], "argument --formats"),
    (["ablate", "--heads", "1.1", "--sweep", "--needles", "nope"], "argument --needles"),
    (["ablate", "--heads", "1.1", "--sweep", "--haystack", "nosuch"], "--haystack"),
    (["ablate", "--heads", "1.1", "--sweep", "--depth-rule", "sideways"], "argument --depth-rule"),
    (["compress", "--formats", "bmp"], "argument --formats"),
    (["compress", "--needles", "nope"], "argument --needles"),
    (["compress", "--haystack", "nosuch"], "--haystack"),
    (["compress", "--depth-rule", "sideways"], "argument --depth-rule"),
    (["compress", "--sink", "2000", "--recent", "64"], "argument --sink/--recent"),
    (["patch", "--pair", "nope"], "argument --pair"),
    (["patch", "--pair", "ioi-mary-john", "--formats", "tiff"], "argument --formats"),
    (["compare", "aaaa", "bbbb", "--formats", "gif"], "argument --formats"),
]


@pytest.mark.parametrize("argv, expected", FAST, ids=[" ".join(a)[:60] for a, _ in FAST])
def test_argument_errors_answer_in_one_line_before_torch_loads(tmp_path, argv, expected):
    code, err, torch_loaded, seconds = headscope(argv, tmp_path / "home")
    assert_one_line(code, err, expected)
    assert not torch_loaded, f"torch was imported before the argument was refused: {err}"
    assert seconds < 2, f"{seconds:.1f} s to refuse {argv}"


def test_patch_with_an_unknown_pair_names_the_pairs(tmp_path):
    code, err, _, _ = headscope(["patch", "--pair", "nope"], tmp_path / "home")
    assert_one_line(code, err, "argument --pair", "nope", "ioi-mary-john")


def test_an_input_error_is_one_line_whatever_was_imported():
    """The command line recognises analysis' InputError (and its subclasses) without the module that
    happened to raise it being one it knows about."""
    code = ("import sys; from headscope.app.cli.errors import is_user_error; from headscope.analysis.errors import InputError;"
            "assert 'headscope.analysis.capture' not in sys.modules; assert is_user_error(InputError('x'));"
            "from headscope.analysis.qk_decomposition import LabelFileError; assert is_user_error(LabelFileError('x'))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.integration
def test_errors_found_after_the_model_loads_are_one_line_too(tmp_path):
    """Checks that need the model (a head outside it, a text too long) still end in one line and exit 2."""
    home = tmp_path / "home"
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"view": "head_grid"}))
    for argv, expected in (
        (["ablate", "--heads", "99.0", *TEXT, "--formats", ""], "argument --heads"),
        (["patch", "--clean", "a b", "--corrupted", "a b c d e", "--answers", " b, c", "--formats", ""],
         "argument --corrupted"),
        (["compare", "0123456789abcdef", "fedcba9876543210"], "argument first"),
    ):
        code, err, _, _ = headscope(argv, home)
        assert_one_line(code, err, expected)


ODD = [
    # (argv, what the line must say): what the fuzzer (test_fuzz_cli.py) found printing a traceback or two lines
    (["run", "--file", "a\rb"], "argument --file"),  # a carriage return split the message in two
    (["run", "--file", "7" * 5000], "argument --file"),  # a name too long for the file system
    (["run", "--file", "~no-such-user-here/x.txt"], "argument --file"),  # ~user for no such user
    (["run", "x", "--out", "7" * 5000], "argument --out"),
    (["serve", "--host", "\x80"], "argument --host"),  # IDNA could not encode it
    (["serve", "--host", "a" * 64 + ".example"], "argument --host"),  # a label over 63 characters
    (["figure", "7" * 5000], "argument manifest"),
    (["scan", "--haystack", "\x1b[31mred"], "argument --haystack"),  # an escape sequence is shown, not sent
]


@pytest.mark.parametrize("argv, expected", ODD, ids=[repr(a)[:50] for a, _ in ODD])
def test_odd_arguments_are_one_printable_line(tmp_path, argv, expected):
    code, err, torch_loaded, _ = headscope(argv, tmp_path / "home")
    assert_one_line(code, err, expected)
    assert "\x1b" not in err and "\r" not in err
    assert not torch_loaded


def test_bytes_that_are_not_utf8_in_an_argument_are_shown_escaped(tmp_path):
    """A file name in Latin-1 (bytes that are not UTF-8) reaches Python as lone surrogates; the message
    shows them escaped instead of failing to print."""
    env = {**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home")}
    p = subprocess.run([sys.executable, "-m", "headscope.app.cli", "run", "--file", b"caf\xe9.txt"], cwd=ROOT, env=env,
                       capture_output=True, timeout=60)
    err = p.stderr.decode("utf-8")  # strict: the message is valid UTF-8
    assert_one_line(p.returncode, err, "argument --file", "caf\\udce9.txt")


def test_figure_refuses_a_format_before_torch_loads(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"manifest_version": 1, "view": "head_grid", "params": {"metric": "entropy"},
                                    "model": {"name": "smollm2-135m", "digest": "0" * 64}, "token_ids": [504, 3575],
                                    "settings": {}}))
    code, err, torch_loaded, seconds = headscope(["figure", str(manifest), "--formats", "gif"], tmp_path / "home")
    assert_one_line(code, err, "argument --formats")
    assert not torch_loaded and seconds < 2, (torch_loaded, seconds)

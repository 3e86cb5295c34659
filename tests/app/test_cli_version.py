"""``headscope --version``: the installed distribution's version, answered before anything heavy loads."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest


def headscope_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headscope.app.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_version_prints_the_installed_version_and_exits_0():
    done = headscope_process("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"headscope {version('headscope')}\n"
    assert done.stderr == ""


def test_version_in_the_help_and_after_another_option(tmp_path):
    assert "--version" in headscope_process("--help").stdout
    done = headscope_process("--home", str(tmp_path), "--version")
    assert (done.returncode, done.stdout) == (0, f"headscope {version('headscope')}\n"), done.stderr


def test_version_loads_nothing_heavy():
    code = ("import sys\nfrom headscope.app.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in ('torch', 'transformers', 'dash') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("args", [["run", "--version"], ["--version=1"], ["run", "text", "--version"]])
def test_version_misplaced_or_with_a_value_is_one_line_and_status_2(args):
    done = headscope_process(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr

"""``make test``, the README's test command (and CI's, .ci/run), as a newcomer runs it: it prints the
slowest tests, so a test that grows slow is seen before it reaches its timeout (#38 item 24)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_prints_the_slowest_tests_by_default():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ARGS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    planned = subprocess.run(["make", "-n", "test"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    pytest_line = next(line for line in planned.stdout.splitlines() if " -m pytest " in line)
    assert "--durations=" in pytest_line, pytest_line
    assert "-ra" in pytest_line.split(), pytest_line  # and why each skipped or failed test did
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_fast_runs_the_unit_tests_alone_and_installs_no_system_package():
    """``make test-fast``: the unit tests without the embedded model, Chromium, Redis or anything marked
    slow, and without installing Debian's chromium or redis-server (``make test`` installs them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ARGS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    planned = subprocess.run(["make", "-n", "test-fast"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    pytest_line = next(line for line in planned.stdout.splitlines() if " -m pytest " in line)
    words = shlex.split(pytest_line)
    markers = words[words.index("-m", words.index("pytest")) + 1]
    assert markers == "not integration and not browser and not redis and not slow", pytest_line
    assert "--durations=" in pytest_line and "-ra" in words, pytest_line
    assert "apt-get" not in planned.stdout, planned.stdout  # neither chromium nor redis-server is installed

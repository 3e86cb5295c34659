"""Commands that load torch leave nothing in ``$TMPDIR``: torch creates its compile cache folder
(``torchinductor_<user>``) when it is imported, even though headscope compiles nothing with it; the
command line points it at headscope's own cache folder, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def run_cli(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", **extra}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.update(extra)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "headscope.app.cli", "run", "The cat sat on the mat.", "--out",
                           str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_command_that_loads_torch_leaves_tmpdir_as_it_was(tmp_path):
    p = run_cli(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_compile_cache_the_user_chose_is_kept(tmp_path):
    mine = tmp_path / "my-inductor-cache"
    p = run_cli(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(mine))
    assert p.returncode == 0, p.stderr[-2000:]
    assert mine.is_dir() and os.listdir(tmp_path / "tmp") == []

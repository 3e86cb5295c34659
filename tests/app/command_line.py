"""``headscope`` run as a user runs it, in a process of its own, for the tests of what it prints on a
mistake (tests/app/test_cli_errors.py, tests/app/test_numerals.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs the command line as `headscope` does, then says on stdout whether torch was loaded.
RUNNER = """
import sys
from headscope.app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("torch loaded" if "torch" in sys.modules else "no torch")
sys.exit(code)
"""


def headscope(argv: list[str], home: Path, timeout: float = 600) -> tuple[int, str, bool, float]:
    """(exit status, stderr, whether torch was loaded, seconds) of ``headscope --home HOME *argv``."""
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_ALLOWED_HOSTS"):
        env.pop(name, None)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stderr, "torch loaded" in p.stdout, time.perf_counter() - t


def assert_one_line(code: int, err: str, *expected: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    for text in expected:
        assert text in lines[0], (text, lines[0])

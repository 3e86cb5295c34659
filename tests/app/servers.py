"""Start ``headscope serve`` for a test on a free loopback port, and know that the server answering is ours.

The browser tests' shared server (tests/app/conftest.py), the modules that need a server of their own
settings, and tests/test_install.py (an installed wheel's server) start theirs with :func:`start_server`.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    """A loopback port free right now. Another process may take it before ours binds it: start
    servers with :func:`start_server`, which checks that the server answering is ours."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], env: dict[str, str], log_path: Path, timeout: float = 180,
                 attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """Start ``headscope serve`` (``args`` without ``--port``) on a free loopback port; return (process, url).

    Ready when werkzeug logged that it runs on the port (after binding it) and it answers there: an answer alone could
    come from another engineer's or test's server that took the port between :func:`free_port` and our
    bind. If ours could not bind (the port was taken), it is started again on another port."""
    for _ in range(attempts):
        port = free_port()
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "a") as log:
            proc = subprocess.Popen([*args, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + timeout
        while proc.poll() is None and time.time() < deadline:
            text = log_path.read_text(errors="replace")[offset:]
            # werkzeug logs "Running on" after it bound the port; headscope's own "serving on" line
            # comes before the bind, so it cannot tell whether the port is ours
            if f"Running on http://127.0.0.1:{port}" in text:
                try:
                    urllib.request.urlopen(url, timeout=5)
                    return proc, url
                except urllib.error.HTTPError:  # an answer (403 from a server that wants its token)
                    return proc, url
                except OSError:
                    pass
            time.sleep(0.5)
        text = log_path.read_text(errors="replace")[offset:]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
            pytest.fail(f"server did not start within {timeout:.0f} s:\n{text}")
        if "in use" not in text:
            pytest.fail(f"server exited with code {proc.returncode}:\n{text}")
    pytest.fail(f"no free port after {attempts} attempts:\n{text}")

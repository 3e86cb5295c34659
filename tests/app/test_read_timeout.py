"""A client that stops sending (a body shorter than its Content-Length, headers never finished) holds a
server thread only for HEADSCOPE_READ_TIMEOUT seconds: then the connection is closed, the thread is
free, the log has one line and no traceback, and the server answered everyone else meanwhile."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.app.servers import start_server

pytestmark = pytest.mark.integration

TIMEOUT = 3  # seconds the server waits for the next bytes of a request (HEADSCOPE_READ_TIMEOUT)


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("timeout-home")
    log = home / "server.log"
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1", "HEADSCOPE_READ_TIMEOUT": str(TIMEOUT)}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_ALLOWED_HOSTS"):
        env.pop(name, None)
    proc, base = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, log)
    yield base, proc, log
    proc.terminate()
    proc.wait(timeout=30)


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def wait_closed(s: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed ``s`` (reading what it sent first), at most ``limit``."""
    t, data = time.monotonic(), b""
    s.settimeout(limit)
    try:
        while chunk := s.recv(65_536):
            data += chunk
    except TimeoutError:
        return float("inf"), data
    except ConnectionResetError:
        pass
    return time.monotonic() - t, data


def test_a_stalled_body_is_dropped_after_the_read_timeout(timed_server):
    base, proc, log = timed_server
    port = int(base.rstrip("/").rsplit(":", 1)[1])
    start = Path(log).stat().st_size
    urllib.request.urlopen(base, timeout=120).read()
    before = threads(proc.pid)
    stalled = []
    for request in (
        # a body shorter than its Content-Length, to a callback and to a page
        b"POST /_dash-update-component HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"output\":",
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n0123456789",
        # headers never finished
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
        # a chunked body that stops in a chunk
        b"POST /_dash-update-component HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n100\r\n{\"output\"",
    ):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(request)
        stalled.append(s)
    t = time.monotonic()
    for _ in range(3):  # everyone else is answered meanwhile
        assert urllib.request.urlopen(base, timeout=120).status == 200
    # each stalled connection is closed after about TIMEOUT s (generous bound: the machine may be loaded)
    replies = []
    for s in stalled:
        seconds, data = wait_closed(s, 60)
        s.close()
        assert seconds < 60, "the server kept a stalled connection open"
        replies.append(data)
    # the callback whose body stopped: 408 saying so; a page takes no POST (405 without reading the body);
    # unfinished headers or chunk: closed (werkzeug logs "Request timed out", or answers 400)
    assert replies[0].startswith(b"HTTP/1.1 408") and b"stopped arriving" in replies[0], replies[0][:300]
    assert replies[1].startswith(b"HTTP/1.1 405"), replies[1][:300]
    assert all(r == b"" or r.startswith((b"HTTP/1.1 408", b"HTTP/1.1 400")) for r in replies[2:]), replies[2:]
    assert time.monotonic() - t >= TIMEOUT - 0.5  # it waited for the bytes first
    deadline = time.time() + 30
    while threads(proc.pid) > before and time.time() < deadline:
        time.sleep(0.2)
    assert threads(proc.pid) <= before, "the stalled requests' threads did not end"
    assert urllib.request.urlopen(base, timeout=120).status == 200
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    assert "Traceback" not in text and "Exception on" not in text, text[-3000:]

"""Dash serves its component scripts from ``/_dash-component-suites/<package>/<path>``; a package or path
it did not register, or one that climbs out of a package (``..%2f``), is answered 404 with one line of
text, and the server logs no traceback for it (app/server.py)."""

from __future__ import annotations

import http.client
import re
import time

import pytest

pytestmark = pytest.mark.integration


def get(base: str, path: str) -> tuple[int, str]:
    port = int(base.rstrip("/").rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    finally:
        conn.close()


def test_unknown_component_paths_are_404_without_a_traceback(server):
    base, _, home = server
    log = home / "server.log"
    status, index = get(base, "/")
    assert status == 200
    scripts = re.findall(r'src="(/_dash-component-suites/[^"]+)"', index)
    assert scripts, index[:500]
    assert all(get(base, s)[0] == 200 for s in scripts[:3])  # what the page loads is still served
    package = scripts[0].split("/")[2]
    start = log.stat().st_size
    hostile = [
        "/_dash-component-suites/nope/x.js", f"/_dash-component-suites/{package}/nope.js",
        f"/_dash-component-suites/{package}/..%2f..%2fapp%2fcli%2f__init__.py",
        f"/_dash-component-suites/{package}/..%2F__init__.py",
        f"/_dash-component-suites/{package}/%2e%2e/%2e%2e/etc/passwd", "/_dash-component-suites/os/..%2fos.py",
        "/_dash-component-suites/app/cli/__init__.py", "/_dash-component-suites/analysis/store.py",
        f"/_dash-component-suites/{package}/" + "a" * 3000 + ".js", f"/_dash-component-suites/{package}/x.v9_9_9m1.js",
        f"/_dash-component-suites/{package}/%00.js", f"/_dash-component-suites/{package}/%C3%BC.js",
        "/_dash-component-suites/..%2f..%2fetc/passwd", "/_dash-component-suites/sys/x",
        f"/_dash-component-suites/{package}/deps",
    ]
    for path in hostile:
        status, text = get(base, path)
        assert status == 404, (path, status, text[:300])
        assert len(text.strip().splitlines()) == 1 and "registered" not in text and "/work" not in text, text[:300]
    assert get(base, f"/_dash-component-suites/{package}/")[0] == 404  # no path: the app's own 404 page
    time.sleep(0.3)
    with open(log, "rb") as f:
        f.seek(start)
        logged = f.read().decode(errors="replace")
    assert "Traceback" not in logged and "Exception on" not in logged, logged[-2000:]
    assert get(base, "/")[0] == 200

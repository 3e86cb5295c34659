"""A server bound beyond the loopback lets in only requests carrying its printed access token."""

from __future__ import annotations

import http.cookiejar
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.app.test_browser import free_port

pytestmark = pytest.mark.integration


def status(url: str, opener=None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with (opener or urllib.request.build_opener()).open(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_non_loopback_server_requires_its_token(tmp_path):
    port = free_port()
    env = {**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home")}
    env.pop("HEADSCOPE_TOKEN", None)
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "0.0.0.0", "--port", str(port)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        token = None
        deadline = time.time() + 180
        while time.time() < deadline and token is None:
            assert proc.poll() is None, log.read_text()
            m = re.search(r"\?token=([\w-]+)", log.read_text())
            token = m and m[1]
            time.sleep(0.5)
        assert token and len(token) >= 16, log.read_text()
        base = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 60
        while status(base) not in (403, 200) and time.time() < deadline:
            time.sleep(0.5)
        assert status(base) == 403  # no token: refused
        assert status(base + "_dash-layout") == 403
        assert status(base + "?token=" + "x" * len(token)) == 403  # a wrong token
        assert status(base + "_dash-layout", headers={"Authorization": f"Bearer {token}"}) == 200
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        assert status(base + "?token=" + token, browser) == 200
        cookie = next(c for c in jar if c.name == "headscope_token")
        assert cookie.has_nonstandard_attr("HttpOnly")
        assert status(base + "_dash-layout", browser) == 200  # the cookie carries the token from now on
    finally:
        proc.terminate()
        proc.wait(timeout=20)

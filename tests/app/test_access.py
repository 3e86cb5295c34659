"""A server bound beyond the loopback lets in only requests carrying its printed access token."""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.app.servers import start_server

pytestmark = pytest.mark.integration


def status(url: str, opener=None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with (opener or urllib.request.build_opener()).open(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_non_loopback_server_requires_its_token(tmp_path):
    env = {**os.environ, "HEADSCOPE_HOME": str(tmp_path / "home")}
    env.pop("HEADSCOPE_TOKEN", None)
    log = tmp_path / "server.log"
    proc, base = start_server([sys.executable, "-m", "headscope.app.cli", "serve", "--host", "0.0.0.0"], env, log)
    try:
        token = None
        deadline = time.time() + 180
        while time.time() < deadline and token is None:
            assert proc.poll() is None, log.read_text()
            m = re.search(r"\?token=([\w-]+)", log.read_text())
            token = m and m[1]
            time.sleep(0.5)
        assert token and len(token) >= 16, log.read_text()
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


TOKEN = "a-token-for-the-tests-" + "7" * 10
UPLOAD_LIMIT = 1000


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """A loopback server given a token (so it asks for one), with a small upload limit."""
    home = tmp_path_factory.mktemp("access-home")
    log = home.parent / f"{home.name}-server.log"
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "HEADSCOPE_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "HEADSCOPE_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT)}
    env.pop("HEADSCOPE_MAX_REQUEST_BYTES", None)
    proc, base = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, log)
    port = int(base.rstrip("/").rsplit(":", 1)[1])
    yield base, port, log, proc
    proc.terminate()
    proc.wait(timeout=30)


def test_the_token_never_reaches_the_log(guarded_server):
    base, _, log, _ = guarded_server
    assert status(base + "?token=" + TOKEN) == 200
    assert status(base + "_dash-layout?x=1&token=" + TOKEN + "&y=2") == 200
    assert status(base + "_dash-dependencies?TOKEN=" + TOKEN) in (200, 403)
    # the same token spelled with percent escapes (in the key, in the value): the server decodes them and
    # lets the request in, so the log must not keep the token in any spelling either
    encoded = "".join(f"%{ord(c):02X}" if i % 3 == 0 else c for i, c in enumerate(TOKEN))
    for query in ("%74oken=" + TOKEN, "tok%65n=" + TOKEN, "token=" + encoded, "a=1&%74oken=" + encoded):
        assert status(base + "_dash-layout?" + query) == 200, query
    time.sleep(0.5)
    lines = log.read_text().splitlines()
    # a token given to serve is never printed, not even in the start-up line that says what to open
    assert any("?token=<your token>" in line for line in lines), lines[:5]
    assert any("token=***" in line and "_dash-layout" in line for line in lines), lines[-5:]
    assert not [line for line in lines if TOKEN in urllib.parse.unquote(line)]


def test_a_60_mb_request_is_refused_before_it_is_read(guarded_server):
    """413 answers the headers of a 60 MB POST: the reply comes after 64 KB of body were sent, so the
    app never waited for (or read) the rest (no wall-clock bound: the machine may be loaded)."""
    import socket

    _, port, _, proc = guarded_server
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"POST /_dash-update-component HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {60_000_000}\r\n\r\n".encode()
                  + b"{" + b" " * 65_536)
        reply = read_reply(s)
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert "HEADSCOPE_MAX_REQUEST_BYTES" in reply
    # a chunked body (no length) is cut off once reading passes the cap
    sent, chunk = 0, b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /_dash-update-component HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        reply = ""
        try:
            while sent < 60_000_000:
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
                s.settimeout(0.01)
                try:
                    reply = s.recv(65_536).decode(errors="replace")
                    s.settimeout(10)
                    reply += read_reply(s)
                    break
                except TimeoutError:
                    s.settimeout(10)
        except OSError:  # the server closed the connection: what it answered is waiting to be read
            s.settimeout(10)
            reply = read_reply(s)
    assert sent < 20_000_000, f"the server read {sent:,} bytes of a chunked body"
    if reply:  # a reset can swallow the answer; the cut-off above is what matters
        assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert proc.poll() is None
    assert status(base_of(port) + "?token=" + TOKEN) == 200


def read_reply(s) -> str:
    """One HTTP response: its headers and its Content-Length's worth of body."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"Content-Length: (\d+)", data)[1] if re.search(rb"Content-Length: (\d+)", data) else 0):
            chunk = s.recv(65_536)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace")


def base_of(port: int) -> str:
    return f"http://127.0.0.1:{port}/"


@pytest.mark.browser
def test_an_oversized_upload_says_so_in_the_page(guarded_server, tmp_path):
    """A file over HEADSCOPE_MAX_UPLOAD_BYTES: a message naming the limit (dcc.Upload alone drops it
    silently); a file within it becomes the own haystack."""
    from playwright.sync_api import sync_playwright

    from tests.app.browsing import CHROMIUM_ARGS, settle

    base, _, _, _ = guarded_server
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text("word " * 1000)  # 5,000 bytes
    small.write_text("A short own haystack. It has two sentences.")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(base + "?token=" + TOKEN)
            page.goto(base + "heads")
            # the page drawn first, as a user sees it: the page's first draw clears the banner when it
            # answers, and under load it answered after the size check had written it (a loaded run)
            page.wait_for_selector("#hs-heads-run")
            settle(page)
            page.set_input_files("#hs-heads-haystack-upload input[type=file]", str(big))
            page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('big.txt')")
            text = page.locator("#hs-error").inner_text()
            assert "big.txt has 5,000 bytes (the limit is 1,000; set HEADSCOPE_MAX_UPLOAD_BYTES" in text
            assert page.locator("#hs-heads-custom-haystack").input_value() == ""
            page.set_input_files("#hs-heads-haystack-upload input[type=file]", str(small))
            page.wait_for_function("(document.querySelector('#hs-heads-custom-haystack')?.value || '')"
                                   ".includes('two sentences')")
            assert "Loaded small.txt" in page.locator("#hs-heads-status").inner_text()
        finally:
            browser.close()

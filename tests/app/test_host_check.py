"""A server answers only to the host names it was started for, and refuses POSTs from other origins: a web
page the user visits cannot drive it through a rebinding domain or a cross-origin form (app/access.py)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time

import pytest

from tests.app.servers import start_server

pytestmark = pytest.mark.integration

REFUSED_HOST = "this server answers only to"
REFUSED_ORIGIN = "comes from another site"


def ask(base: str, path: str = "/", *, host: str | None = None, method: str = "GET",
        headers: dict | None = None, body: bytes | None = None) -> tuple[int, str]:
    """One raw HTTP request to ``base``'s port with exactly the Host (and other headers) given."""
    port = int(base.rstrip("/").rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        reply = conn.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    finally:
        conn.close()


def raw(base: str, request: bytes) -> str:
    """Send ``request`` as bytes over a socket; the reply's text."""
    port = int(base.rstrip("/").rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65_536):
            data += chunk
    return data.decode(errors="replace")


def log_lines(log, marker: str, start: int = 0) -> list[str]:
    """The lines of the server's log after byte ``start`` that contain ``marker``."""
    time.sleep(0.3)  # the server writes its log line after it answered
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [line for line in text.splitlines() if marker in line]


def port_of(base: str) -> int:
    return int(base.rstrip("/").rsplit(":", 1)[1])


def router_request(base: str) -> bytes:
    """The callback request a page sends to draw the Attention page (Dash Pages' router), as bytes: its
    answer is the page's layout."""
    status, text = ask(base, "/_dash-dependencies", host=f"127.0.0.1:{port_of(base)}")
    assert status == 200, text[:200]
    router = next(d for d in json.loads(text) if "_pages_content.children" in d["output"])
    values = {"_pages_location.pathname": "/", "_pages_location.search": ""}

    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = [dict(zip(("id", "property"), part.rsplit(".", 1), strict=True))
               for part in router["output"].strip(".").split("...")]
    body = {"output": router["output"], "outputs": outputs if router["output"].startswith("..") else outputs[0],
            "inputs": [item(s) for s in router["inputs"]], "state": [item(s) for s in router["state"]],
            "changedPropIds": ["_pages_location.pathname"]}
    return json.dumps(body).encode()


def test_a_rebinding_host_is_refused_and_logged(server):
    """A page at evil.example whose name now points at 127.0.0.1 reaches the port with its own name in Host:
    403, one log line, no app; the names the loopback server was bound to get the app."""
    base, _, home = server
    port = port_of(base)
    log = home / "server.log"
    start = log.stat().st_size
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                 f"localhost.evil.example:{port}", f"0.0.0.0:{port}", f"10.0.0.7:{port}", f"[::2]:{port}",
                 f"127.0.0.1:{port}@evil.example", f"evil.example#127.0.0.1:{port}", "", f"[::ffff:10.0.0.1]:{port}"):
        status, text = ask(base, "/", host=host)
        assert status == 403, (host, status, text[:200])
        assert REFUSED_HOST in text and "<html" not in text.lower(), (host, text[:200])
    status, text = ask(base, "/_dash-layout", host=f"evil.example:{port}")
    assert status == 403 and "hs-nav" not in text  # nor the layout, which a rebinding page would read
    status, text = ask(base, "/_dash-update-component", host=f"evil.example:{port}", method="POST",
                       body=router_request(base), headers={"Origin": f"http://evil.example:{port}"})
    assert status == 403 and "attn-hs-text" not in text
    lines = log_lines(log, "evil.example", start)
    assert len(lines) == 8, lines  # one line per refused request that named evil.example (7 GETs above, one POST)
    assert all("--allowed-hosts" in line and "Traceback" not in line for line in lines), lines
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}",
                 f"127.0.0.2:{port}", f"[::ffff:127.0.0.1]:{port}", f"localhost.:{port}", "127.0.0.1"):
        status, text = ask(base, "/", host=host)
        assert status == 200 and "<html" in text.lower(), (host, status, text[:200])


def test_a_request_without_host_reaches_the_server_only_over_http_1_0(server):
    """HTTP/1.0 needs no Host (no browser sends such a request, so no web page can); HTTP/1.1 without one
    is malformed and refused."""
    base, _, _ = server
    assert raw(base, b"GET / HTTP/1.0\r\n\r\n").startswith("HTTP/1.1 200")
    reply = raw(base, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert reply.startswith(("HTTP/1.1 400", "HTTP/1.1 403")), reply[:200]


def test_a_cross_origin_post_is_refused(server):
    """Host is ours but the page that sent the POST is elsewhere (a form or fetch from another site, or a
    sandboxed frame, Origin: null): 403 before any callback runs; our own origin goes through."""
    base, _, home = server
    port = port_of(base)
    start = (home / "server.log").stat().st_size
    ours = f"127.0.0.1:{port}"
    callback = router_request(base)
    for origin in ("http://evil.example", f"http://evil.example:{port}", "null", f"http://localhost:{port}",
                   f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}.evil.example", "file://",
                   f"http://127.0.0.1:{port}@evil.example", "garbage"):
        status, text = ask(base, "/_dash-update-component", host=ours, method="POST", body=callback,
                           headers={"Origin": origin})
        assert status == 403 and REFUSED_ORIGIN in text, (origin, status, text[:200])
    # no Origin, but the browser says the request comes from another site (Fetch Metadata)
    status, text = ask(base, "/_dash-update-component", host=ours, method="POST", body=callback,
                       headers={"Sec-Fetch-Site": "cross-site"})
    assert status == 403 and REFUSED_ORIGIN in text
    assert len(log_lines(home / "server.log", "is not this server's own", start)) == 9
    assert len(log_lines(home / "server.log", "Sec-Fetch-Site 'cross-site'", start)) == 1
    for headers in ({"Origin": f"http://{ours}"}, {"Origin": f"http://{ours}", "Sec-Fetch-Site": "same-origin"},
                    {}):  # a page of ours, and a client that is no browser (curl, a script)
        status, text = ask(base, "/_dash-update-component", host=ours, method="POST", body=callback,
                           headers=headers)
        assert status == 200 and "attn-hs-text" in text, (headers, status, text[:200])
    # a GET from another origin's page reads nothing (the browser keeps the answer from it) and changes nothing
    status, _ = ask(base, "/", host=ours, headers={"Origin": "http://evil.example"})
    assert status == 200


@pytest.fixture(scope="module")
def named_server(tmp_path_factory):
    """A loopback server that also answers to two names (a reverse proxy's, say)."""
    home = tmp_path_factory.mktemp("named-home")
    log = home / "server.log"
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_ALLOWED_HOSTS"):
        env.pop(name, None)
    proc, base = start_server([sys.executable, "-m", "headscope.app.cli", "serve", "--allowed-hosts",
                               "lab.example, Notebook.Example."], env, log)
    yield base, log
    proc.terminate()
    proc.wait(timeout=30)


def test_allowed_hosts_adds_names(named_server):
    base, log = named_server
    port = port_of(base)
    for host in ("lab.example", f"LAB.example:{port}", f"notebook.example:{port}", f"localhost:{port}",
                 f"127.0.0.1:{port}"):
        status, text = ask(base, "/", host=host)
        assert status == 200, (host, status, text[:200])
    # the page's own origin under that name posts (behind a TLS proxy: https pages, plain http here)
    status, text = ask(base, "/_dash-update-component", host="lab.example", method="POST",
                       body=router_request(base), headers={"Origin": "https://lab.example"})
    assert status == 200 and "attn-hs-text" in text
    for host in ("evil.example", f"x.lab.example:{port}", f"lab.example.evil:{port}", "lab-example"):
        status, _ = ask(base, "/", host=host)
        assert status == 403, host


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """Bound to every address, with a token, and names given by HEADSCOPE_ALLOWED_HOSTS."""
    home = tmp_path_factory.mktemp("open-home")
    log = home / "server.log"
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1", "HEADSCOPE_TOKEN": TOKEN,
           "HEADSCOPE_ALLOWED_HOSTS": "gpu-box.lab.example"}
    env.pop("HEADSCOPE_REDIS_URL", None)
    proc, base = start_server([sys.executable, "-m", "headscope.app.cli", "serve", "--host", "0.0.0.0"], env, log)
    yield base, log
    proc.terminate()
    proc.wait(timeout=30)


TOKEN = "host-check-token-" + "5" * 16


def test_names_given_to_an_open_server_are_checked_too(open_server):
    """Bound beyond the loopback the token is the guard; names given with HEADSCOPE_ALLOWED_HOSTS (or
    --allowed-hosts) are checked as well, so a token that leaked into a page still cannot be used from it."""
    base, log = open_server
    port = port_of(base)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for host in (f"gpu-box.lab.example:{port}", f"127.0.0.1:{port}", f"localhost:{port}"):
        assert ask(base, "/_dash-layout", host=host, headers=bearer)[0] == 200, host
        assert ask(base, "/_dash-layout", host=host)[0] == 403, host  # no token
    status, text = ask(base, "/_dash-layout", host=f"evil.example:{port}", headers=bearer)
    assert status == 403 and REFUSED_HOST in text
    status, text = ask(base, "/_dash-update-component", host=f"gpu-box.lab.example:{port}", method="POST",
                       body=b"{}", headers={**bearer, "Origin": "http://evil.example"})
    assert status == 403 and REFUSED_ORIGIN in text
    assert TOKEN not in log.read_text()


@pytest.mark.parametrize("given, names", [
    ("lab.example", ("lab.example",)), (" LAB.Example. , lab.example", ("lab.example",)),
    ("10.0.0.5,[::1],::FFFF:10.0.0.5", ("10.0.0.5", "::1", "::ffff:a00:5")), ("gpu_box", ("gpu_box",)),
])
def test_allowed_host_names_are_read_in_one_spelling(given, names):
    from headscope.app.access import host_names

    assert host_names(given) == names


@pytest.mark.parametrize("given", ["*", "*.example", "http://lab.example", "lab.example:8050", "lab.example/x", "",
                                   ",,", "a..b", "-a.example", "a" * 64 + ".example", "lab example", "évil.example",
                                   "127.1", "2130706433", "[::1", "lab.example\t.x", "user@lab.example", ".example"])
def test_what_is_no_host_name_is_refused_before_the_server_starts(given):
    """--allowed-hosts (and HEADSCOPE_ALLOWED_HOSTS) refuse anything but names and addresses, in one line,
    exit 2, before anything heavy loads."""
    import subprocess

    env = {**os.environ, "HEADSCOPE_ALLOWED_HOSTS": given}
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # a server that got past the names would stop at its port, never start
    for argv, where in ((["--allowed-hosts", given], "argument --allowed-hosts"), ([], "HEADSCOPE_ALLOWED_HOSTS")):
        if not argv and not given.strip():
            continue  # an empty variable is no variable
        p = subprocess.run([sys.executable, "-c", "import sys; from headscope.app.cli import main; code = main(sys.argv[1:]); "
                            "assert 'torch' not in sys.modules and 'flask' not in sys.modules; sys.exit(code)",
                            "serve", "--port", str(taken.getsockname()[1]), *argv], env=env, capture_output=True,
                           text=True, timeout=60)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and where in lines[0], (given, argv, p.stderr)
    taken.close()


def test_the_rule_for_each_way_of_binding():
    """Bound to the loopback: loopback addresses and localhost, plus names given. Bound to every address:
    any name unless names are given. Bound to one address: that address too."""
    from headscope.app.access import HostRule, same_origin

    loop = HostRule.for_server("127.0.0.1")
    assert [loop.accepts(h) for h in ("127.0.0.1:1", "localhost", "[::1]:8", "127.9.9.9", "lab.example", "0.0.0.0",
                                      "[0:0:0:0:0:0:0:1]", "localhost:99999", "localhost:", " localhost",
                                      "[127.0.0.1]", "127.0.0.1:8050:1")] == [
        True, True, True, True, False, False, True, False, False, True, False, False]
    assert not HostRule.for_server("::1").any_host and not HostRule.for_server("localhost").any_host
    assert HostRule.for_server("0.0.0.0").accepts("anything.example") and HostRule.for_server("::").any_host
    lan = HostRule.for_server("192.168.1.5", ["gpu.example"])
    assert [lan.accepts(h) for h in ("192.168.1.5:8050", "gpu.example", "localhost", "192.168.1.6", "x.example")] == [
        True, True, True, False, False]
    assert same_origin("http://127.0.0.1:8050", "127.0.0.1:8050") and same_origin("https://lab.example", "lab.example")
    assert same_origin("http://lab.example:80", "lab.example") and same_origin("http://[::1]:8", "[::1]:8")
    for origin in ("http://127.0.0.1:8051", "http://lab.example.evil", "http://lab.example/x", "ftp://lab.example",
                   "http://[::1", "http://a@lab.example", "http://lab.example?x", "http://lab.example#x", "//lab.example"):
        assert not same_origin(origin, "lab.example" if "lab" in origin else "127.0.0.1:8050"), origin

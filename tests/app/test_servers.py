"""tests/app/servers.py: a server started for a test is ours, even when another process takes its port."""

from __future__ import annotations

import os
import sys
import urllib.request

from tests.app import servers
from tests.app.servers import free_port, start_server

# a stand-in for ``headscope serve`` in the test below: answers "ours" on --port, logs like werkzeug
STAND_IN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print(f"headscope: serving on http://127.0.0.1:{port}", flush=True)  # like headscope: before the bind
class Ours(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ours")
server = http.server.HTTPServer(("127.0.0.1", port), Ours)
print(f" * Running on http://127.0.0.1:{port}", flush=True)
server.serve_forever()
"""


def test_a_server_whose_port_was_taken_meanwhile_starts_on_another_and_the_url_reaches_it(tmp_path, monkeypatch):
    """Another process takes the chosen port between free_port() and our bind (six engineers start
    servers on this machine): start_server starts ours again on another port, and the url it returns
    reaches our server, never the intruder that answers on the first port."""
    import http.server
    import threading

    class Intruder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"intruder")

        def log_message(self, *args):
            pass

    intruder = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Intruder)
    taken = intruder.server_address[1]
    threading.Thread(target=intruder.serve_forever, daemon=True).start()
    chosen, real_free_port = iter([taken]), free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(chosen, None) or real_free_port())
    proc = None
    try:
        proc, url = start_server([sys.executable, "-c", STAND_IN], dict(os.environ), tmp_path / "server.log", timeout=60)
        assert not url.endswith(f":{taken}/")
        assert urllib.request.urlopen(url, timeout=10).read() == b"ours"
        assert "in use" in (tmp_path / "server.log").read_text()  # the first start found the port taken
    finally:
        intruder.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)

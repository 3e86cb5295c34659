"""Fixtures the browser test modules share.

``server``: one ``headscope serve`` with the default settings and its own home, started once per
session (or once per pytest-xdist worker) for every module that needs nothing else of a server. A
start costs 15-20 s on a quiet 2-core machine (the app's imports, the model, the first page), and ten
modules started one each. Its store holds every sharing test's runs and sweeps: a test keeps to the
ones it made (the page's URL names them) and never counts what the store holds. A module that needs
its own settings (a token, a smaller limit, workers, stored runs before the start) defines its own
``server`` fixture, which overrides this one in that module.

``browser``: one headless Chromium (Playwright) per module; ``page``: a 1400 × 1100 px page in a
context of its own for each test. What a test does in a page (Run a text, click a cell, wait for a
title) is in tests/app/browsing.py, and starting a server of one's own in tests/app/servers.py: plain
functions, imported by the modules that use them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """(url, process, home) of the shared plain server."""
    from tests.app.servers import start_server

    home = tmp_path_factory.mktemp("shared-server-home")
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_MAX_TOKENS"):
        env.pop(name, None)  # a developer's own settings never reach the tests' server
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, home / "server.log")
    yield url, proc, home
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    from tests.app.browsing import CHROMIUM_ARGS

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    from tests.app.browsing import open_page

    yield from open_page(browser, 1400, 1100)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A throw-away redis-server on a free loopback port, no persistence. Ready when our server logged
    that it accepts connections (a ping alone could reach another process's server on a port taken
    between choosing and binding it); started again on another port if ours could not bind."""
    import redis

    from tests.app.servers import free_port
    from tests.app.worker_processes import REDIS

    if not os.path.exists(REDIS):
        pytest.fail("redis-server is missing: `make setup` installs Debian's redis-server")
    folder = tmp_path_factory.mktemp("redis")
    for attempt in range(3):
        port = free_port()
        log_path = folder / f"redis-{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(folder)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while proc.poll() is None and "Ready to accept connections" not in log_path.read_text(errors="replace"):
            assert time.time() < deadline, log_path.read_text()
            time.sleep(0.1)
        if proc.poll() is None:
            break
        assert "in use" in log_path.read_text(errors="replace"), log_path.read_text()
    else:
        pytest.fail(f"redis-server found no free port in 3 attempts:\n{log_path.read_text()}")
    redis.Redis(port=port).ping()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)

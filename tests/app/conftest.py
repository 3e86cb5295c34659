"""Fixtures the browser test modules share.

``server``: one ``headscope serve`` with the default settings and its own home, started once per
session (or once per pytest-xdist worker) for every module that needs nothing else of a server. A
start costs 15-20 s on a quiet 2-core machine (the app's imports, the model, the first page), and ten
modules started one each. Its store holds every sharing test's runs and sweeps: a test keeps to the
ones it made (the page's URL names them) and never counts what the store holds. A module that needs
its own settings (a token, a smaller limit, workers, stored runs before the start) defines its own
``server`` fixture, which overrides this one in that module.
"""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """(url, process, home) of the shared plain server."""
    from tests.app.test_browser import start_server

    home = tmp_path_factory.mktemp("shared-server-home")
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    for name in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_MAX_TOKENS"):
        env.pop(name, None)  # a developer's own settings never reach the tests' server
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, home / "server.log")
    yield url, proc, home
    proc.terminate()
    proc.wait(timeout=30)

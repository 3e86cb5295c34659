"""The patching limit as a user meets it (#38 item 7): ``HEADSCOPE_MAX_PATCH_TOKENS`` bounds each prompt
of a patching, on the Patching page (a server started with it) and in ``headscope patch``, and the
refusal names it. The analysis's own tests (``tests/analysis/test_patching.py``) check that a raised
limit admits a 2,101-token pair; here the message is what is tested, where the user reads it."""

from __future__ import annotations

import os
import sys

import pytest

from tests.app.servers import start_server

pytestmark = pytest.mark.integration

LIMIT = "HEADSCOPE_MAX_PATCH_TOKENS"
PAD = " and" * 47  # the IOI pair (14 tokens each on the embedded model) padded to 61 tokens each
CLEAN = f"When Mary and John went to the store{PAD}, John gave a drink to"
CORRUPTED = f"When Mary and John went to the store{PAD}, Mary gave a drink to"
REFUSED = f"The clean prompt has 61 tokens, more than patching takes (the limit is 16; set {LIMIT} to change it)."


def run_cli(argv, capsys):
    from headscope.app.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out


@pytest.mark.parametrize("kind", [("--attribution-only",), ("--path-from", "0.1", "--path-to", "9.1")],
                         ids=["activation", "path"])
def test_headscope_patch_over_the_limit_names_the_limit_in_one_line(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setenv(LIMIT, "16")
    code, out = run_cli(["patch", "--clean", CLEAN, "--corrupted", CORRUPTED, "--answers", " Mary, John",
                         "--formats", "", "--out", str(tmp_path / "out"), *kind], capsys)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0], out.err
    assert "Traceback" not in out.err and "HEADSCOPE_MAX_TOKENS " not in out.err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server whose patching limit is 16 tokens."""
    home = tmp_path_factory.mktemp("patch-limit-home")
    env = {**os.environ, "HEADSCOPE_HOME": str(home), LIMIT: "16"}
    env.pop("HEADSCOPE_REDIS_URL", None)
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, home / "server.log")
    yield url, proc, home
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.browser
def test_the_patching_page_names_the_limit_beside_the_prompts_and_on_run(server, page):
    url, proc, _home = server
    page.goto(url + "patching")
    page.wait_for_function("() => (document.querySelector('#hs-pat-differ')?.innerText || '').includes('differ')",
                           timeout=240_000)  # the default pair (14 tokens) is under the limit
    page.fill("#hs-pat-clean", CLEAN)
    page.fill("#hs-pat-corrupted", CORRUPTED)
    page.wait_for_function("t => (document.querySelector('#hs-pat-differ')?.innerText || '').includes(t)",
                           arg=REFUSED, timeout=60_000)
    page.click("#hs-pat-run")
    page.wait_for_function("t => (document.querySelector('#hs-error')?.innerText || '').includes(t)",
                           arg=REFUSED, timeout=120_000)
    page.wait_for_function("() => (document.querySelector('#hs-pat-status')?.innerText || '').startsWith('Not run')")
    assert "patching" not in page.evaluate("location.search")  # nothing ran, nothing stored
    assert proc.poll() is None

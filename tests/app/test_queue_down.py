"""With Celery workers, a job queue (Redis) that goes away ends the page's wait with a message.

Debian's redis-server on a free loopback port, one ``headscope worker`` and a ``headscope serve`` front
end, driven from headless Chromium. Redis is killed (SIGKILL) while a job runs on the worker, and a Run is
clicked while it is down: every poll of the page then failed inside Dash, which answered 204 with no body,
and the page stopped waiting without a word. Each now says the queue is not reachable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.app.browsing import select_option, settled
from tests.app.servers import free_port, start_server
from tests.app.worker_processes import REDIS, Worker

# the module's first test also pays for starting redis, a worker (which loads the model) and the web
# server, each allowed 180 s on a loaded machine; then a sweep runs on the worker
pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(600)]

UNREACHABLE = "job queue (Redis) is not reachable"


class Redis:
    """A throw-away redis-server on loopback, no persistence, that a test can kill."""

    def __init__(self, folder: Path):
        self.folder, self.proc, self.port = folder, None, None

    def start(self) -> str:
        for _ in range(3):
            self.port = free_port()
            log_path = self.folder / f"redis-{self.port}.log"
            with open(log_path, "w") as log:
                self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                              "--appendonly", "no", "--dir", str(self.folder)],
                                             stdout=log, stderr=subprocess.STDOUT)
            deadline = time.time() + 60
            while self.proc.poll() is None and "Ready to accept connections" not in log_path.read_text(errors="replace"):
                assert time.time() < deadline, log_path.read_text()
                time.sleep(0.1)
            if self.proc.poll() is None:
                return f"redis://127.0.0.1:{self.port}/0"
        pytest.fail(f"redis-server found no free port in 3 attempts:\n{log_path.read_text()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def queue(tmp_path_factory):
    folder = tmp_path_factory.mktemp("queue-down")
    redis = Redis(folder)
    url = redis.start()
    worker, web = Worker("w1", folder, url), None
    try:  # a start that fails leaves nothing running
        worker.start()
        env = {**os.environ, "HEADSCOPE_HOME": str(folder / "web-home"), "HEADSCOPE_REDIS_URL": url}
        env.pop("HEADSCOPE_TOKEN", None)
        web, web_url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, folder / "web.log")
        worker.wait_ready()
        yield {"url": web_url, "web": web, "web_log": folder / "web.log", "redis": redis, "worker": worker}
    finally:
        if web is not None:
            web.terminate()
            web.wait(timeout=30)
        worker.stop()
        redis.kill()


class RunAnswers:
    """The answers the server gave the heads page's Run callback (its start and its polls), recorded
    from the page's network traffic: (status, body) each, read once the test asks."""

    def __init__(self, page):
        self.responses = []
        page.on("response", self._seen)

    def _seen(self, response) -> None:
        if "_dash-update-component" not in response.url or response.request.method != "POST":
            return
        try:
            outputs = json.loads(response.request.post_data or "{}").get("outputs")
        except ValueError:
            return
        if isinstance(outputs, list) and {"id": "hs-heads-status", "property": "children"} in outputs:
            self.responses.append(response)

    def all(self) -> list[tuple[int, str]]:
        return [(r.status, r.text() if r.status == 200 else "") for r in self.responses]


def open_heads_page(browser, url: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(120_000)
    answers = RunAnswers(page)
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey? | 7731")
    page.fill("#hs-heads-lengths", "640")
    page.fill("#hs-heads-depths", "20,40,60,80")
    select_option(page, "hs-heads-haystack", "passkey")
    return page, answers


def wait_banner(page, text: str, timeout: float = 60_000) -> None:
    page.wait_for_function("(t) => (document.querySelector('#hs-error')?.innerText || '').includes(t)", arg=text,
                           timeout=timeout)


def test_redis_killed_while_a_job_runs_ends_the_wait_with_a_message(queue, browser):
    page, answers = open_heads_page(browser, queue["url"])
    settled(page, timeout=240_000)  # the page's own render ran on the worker
    page.click("#hs-heads-run")
    page.wait_for_function(  # the job runs on the worker: "trial i of n (p%)" with some of it done
        "/trial \\d+ of \\d+ \\([1-9]/.test(document.querySelector('#hs-heads-status')?.innerText || '')",
        timeout=300_000)
    queue["redis"].kill()
    wait_banner(page, UNREACHABLE)
    page.wait_for_function("!document.querySelector('#hs-heads-run').disabled", timeout=10_000)
    said = answers.all()
    assert all(status == 200 for status, _ in said), said  # no poll went unanswered (204)
    assert any(UNREACHABLE in body for _, body in said), said  # the Run's own poll said it
    text = page.locator("#hs-error").inner_text()
    assert "redis://" not in text and "127.0.0.1" not in text  # the queue's address stays in the log
    assert queue["web"].poll() is None


def test_run_while_redis_is_down_says_the_queue_is_not_reachable(queue, browser):
    """After the test above Redis is down: the page's own render says so as it loads, and Run, clicked
    then, answers with the same message from its own callback."""
    assert queue["redis"].proc.poll() is not None
    page, answers = open_heads_page(browser, queue["url"])
    wait_banner(page, UNREACHABLE)  # the page's render, a job on the workers, could not be queued
    page.click("#hs-heads-run")
    deadline = time.time() + 60
    while not any(UNREACHABLE in body for _, body in answers.all()):
        assert time.time() < deadline, answers.all()
        page.wait_for_timeout(200)  # Playwright delivers the response events only while it is called
    page.wait_for_function("!document.querySelector('#hs-heads-run').disabled", timeout=10_000)
    assert all(status == 200 for status, _ in answers.all()), answers.all()
    assert UNREACHABLE in page.locator("#hs-error").inner_text()
    assert queue["web"].poll() is None

"""The multi-worker set-up for real: Debian's redis-server on loopback, two ``headscope worker``
processes (Celery, prefork) and a ``headscope serve`` front end, each with its own ``HEADSCOPE_HOME``
(so results must cross disks through Redis), driven from headless Chromium on the embedded model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.app.browsing import click_cell, select_option, wait_title
from tests.app.servers import start_server
from tests.app.worker_processes import STARTED, Worker

# 600 s, not the suite's 300: the module's first test also pays for starting redis, two workers and
# the web server (each allowed 180 s to load the model), and every test waits on sweeps run by workers
pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    """Two workers and the web front end, each with its own HEADSCOPE_HOME."""
    folder = tmp_path_factory.mktemp("cluster")
    workers = [Worker(f"w{i}", folder, redis_url) for i in (1, 2)]
    for w in workers:
        w.start()
    web_home = folder / "web-home"
    web, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"],
                            {**os.environ, "HEADSCOPE_HOME": str(web_home), "HEADSCOPE_REDIS_URL": redis_url},
                            folder / "web.log")
    for w in workers:
        w.wait_ready()
    yield {"url": url, "web": web, "web_log": folder / "web.log", "web_home": web_home, "workers": workers}
    web.terminate()
    web.wait(timeout=20)
    for w in workers:
        w.stop()


def new_page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(120_000)
    return page


def start_sweep(page, url: str, needle: str, lengths: str, depths: str) -> None:
    prepare_sweep(page, url, needle, lengths, depths)
    click_run(page)


def click_run(page) -> None:
    page.click("#hs-heads-run")
    page.wait_for_function("document.querySelector('#hs-heads-run').disabled")


def prepare_sweep(page, url: str, needle: str, lengths: str, depths: str) -> None:
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", needle)
    page.fill("#hs-heads-lengths", lengths)
    page.fill("#hs-heads-depths", depths)
    select_option(page, "hs-heads-haystack", "passkey")


def wait_sweep_shown(page, timeout: float = 300_000) -> None:
    page.bring_to_front()  # plotly draws on animation frames, which a background tab does not get
    page.wait_for_function("location.search.includes('sweep=')", timeout=timeout)
    page.wait_for_selector("#hs-heads-grid .heatmaplayer .hm", timeout=timeout)
    page.wait_for_function("(document.querySelector('#hs-heads-info')?.innerText || '').includes('trials counted')",
                           timeout=timeout)


def wait_progress(page, timeout: float = 240_000) -> None:
    """Until the sweep's progress caption ("trial i of n (p%)") says some of the sweep is done."""
    page.wait_for_function(
        "/trial \\d+ of \\d+ \\([1-9]/.test(document.querySelector('#hs-heads-status')?.innerText || '')",
        timeout=timeout)


def serves(url: str) -> bool:
    return urllib.request.urlopen(url + "heads", timeout=30).status == 200


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed child the pool has not reaped yet is a zombie: not working any more
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_two_users_sweeps_run_on_two_workers_and_reach_the_page_across_disks(cluster, browser):
    url, (w1, w2) = cluster["url"], cluster["workers"]
    pages = [new_page(browser), new_page(browser)]
    # two users submit a sweep each at the same time: each worker (one pool process, one job at a
    # time) takes one
    prepare_sweep(pages[0], url, "The secret passkey is 7731. | What is the secret passkey? | 7731", "256", "25,75")
    prepare_sweep(pages[1], url, "The secret passkey is 7731. | What is the secret passkey? | 7731", "256", "30,70")
    click_run(pages[0])
    click_run(pages[1])
    for page in pages:
        wait_sweep_shown(page)
        assert "2/2 trials counted" in page.locator("#hs-heads-info").inner_text()
        assert page.locator("#hs-error").inner_text().strip() == ""
    assert len(w1.jobs("run_sweep")) == 1 and len(w2.jobs("run_sweep")) == 1, (w1.log(), w2.log())
    # the web process never tried to load a model
    assert "refused to load model" not in cluster["web_log"].read_text()
    # results cross disks: with w1 stopped, w2 draws both sweeps after a reload, and one of them was
    # computed by w1 into a HEADSCOPE_HOME w2 never sees: it comes through the records in Redis
    searches = [p.evaluate("location.search") for p in pages]
    w1.stop()
    try:
        for search in searches:
            page = new_page(browser)
            page.goto(url + "heads" + search)
            wait_sweep_shown(page)
            assert "2/2 trials counted" in page.locator("#hs-heads-info").inner_text()
            assert page.locator("#hs-error").inner_text().strip() == ""
    finally:
        offset = len(w1.log())
        w1.start()
        w1.wait_ready(since=offset)


def test_attention_run_happens_on_a_worker_and_the_web_process_loads_no_model(cluster, browser):
    """The web front end refuses to load a model in this set-up: the run, the grid and the token strip
    come from workers, and no banner says a model was refused."""
    page = new_page(browser)
    page.goto(cluster["url"])
    page.fill("#attn-hs-text", "The keys to the cabinet are on the table.")
    page.click("#attn-hs-run")
    page.wait_for_function("(document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')")
    page.wait_for_selector("#hs-grid .heatmaplayer .hm")
    click_cell(page, "hs-grid", col=5, row=3, n_cols=9, n_rows=30)  # a head click: its render patches the figures
    wait_title(page, "hs-heatmap", "Attention of layer 3, head 5")
    assert page.locator("#hs-error").inner_text().strip() == ""
    assert "refused to load model" not in cluster["web_log"].read_text()
    jobs = [job for w in cluster["workers"] for job, what, _ in STARTED.findall(w.log()) if what == "started"]
    assert "run_text" in jobs and "render" in jobs  # the Attention page's Run job and its render


def test_cancel_stops_the_running_job_on_its_worker(cluster, browser):
    url, workers = cluster["url"], cluster["workers"]
    offsets = [len(w.log()) for w in workers]
    page = new_page(browser)
    start_sweep(page, url, "The secret passkey is 7731. | What is the secret passkey? | 7731", "512", "10,30,50,70,90")
    wait_progress(page)
    pids = [pid for w, o in zip(workers, offsets, strict=True) for pid in w.jobs("run_sweep", o)]
    assert len(pids) == 1, [w.log()[o:] for w, o in zip(workers, offsets, strict=True)]
    page.click("#hs-heads-cancel")
    page.wait_for_function("!document.querySelector('#hs-heads-run').disabled")
    # the pool process that ran it is terminated (the pool forks a fresh one), the sweep never lands
    deadline = time.time() + 120  # a revoke crosses Redis and the worker's main loop: slow under load
    while pid_alive(pids[0]):
        assert time.time() < deadline, "the job's process still runs after cancel"
        time.sleep(0.2)
    time.sleep(3)
    assert "sweep=" not in page.evaluate("location.search")
    assert not any("job run_sweep finished" in w.log()[o:] for w, o in zip(workers, offsets, strict=True))
    assert serves(url)


def test_a_job_whose_worker_process_is_killed_is_retried_and_the_app_keeps_serving(cluster, browser):
    url, workers = cluster["url"], cluster["workers"]
    for w in workers:  # a pool process terminated by the cancel above has been replaced
        assert w.proc.poll() is None
    offsets = [len(w.log()) for w in workers]
    page = new_page(browser)
    start_sweep(page, url, "The secret passkey is 7731. | What is the secret passkey? | 7731", "320", "25,50,75")
    wait_progress(page)
    started = [(w, pid) for w, o in zip(workers, offsets, strict=True) for pid in w.jobs("run_sweep", o)]
    assert len(started) == 1
    os.kill(started[0][1], signal.SIGKILL)  # the pool process dies mid-job, as under the OOM killer
    assert serves(url)
    wait_sweep_shown(page)  # retried (on either worker), finished trials reused
    assert "/3 trials counted" in page.locator("#hs-heads-info").inner_text()
    # the retry may land on either worker, so the pids are collected per worker, not in start order:
    # the job started exactly twice, once in the killed process and once in another one
    killed = started[0][1]
    runs = [pid for w, o in zip(workers, offsets, strict=True) for pid in w.jobs("run_sweep", o)]
    assert sorted(runs.count(pid) for pid in set(runs)) == [1, 1] and killed in runs, (killed, runs)
    assert any("WorkerLostError" in w.log()[o:] for w, o in zip(workers, offsets, strict=True))
    assert page.locator("#hs-error").inner_text().strip() == ""
    assert serves(url)


def test_records_cross_disks_through_redis_within_limits(redis_url, tmp_path, monkeypatch):
    """Two stores on different folders share records through Redis; an oversized record stays local."""
    from headscope.analysis.store import Store

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    monkeypatch.setenv("HEADSCOPE_SHARED_RECORD_MB", "1")
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    scores = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.put("ab12" + "0" * 60, "sweep", {"n": 3}, {"scores": scores})
    assert b.find("ab12") == ["ab12" + "0" * 60]
    record = b.get("ab12" + "0" * 60)
    assert record.meta == {"n": 3} and np.array_equal(record.array("scores"), scores)
    big = np.zeros(2**20, dtype=np.float32)  # 4 MB > 1 MB: kept on a's disk
    a.put("cd34" + "0" * 60, "run", {}, {"patterns": big})
    assert b.get("cd34" + "0" * 60) is None and a.get("cd34" + "0" * 60) is not None
    # a shared copy whose bytes do not match its checksum is refused, not served
    import redis

    client = redis.Redis.from_url(redis_url)
    key = "ef56" + "0" * 60
    a.put(key, "sweep", {}, {"scores": scores})
    client.hset(f"headscope:record:{key}", "array:scores", b"\x93NUMPY garbage")
    assert b.get(key) is None
    a.remove("ab12" + "0" * 60)
    assert Store(tmp_path / "c").get("ab12" + "0" * 60) is None


def test_a_job_that_failed_outside_its_callback_ends_with_a_message(redis_url, monkeypatch):
    """A task Celery marked failed (its pool process lost more often than it is retried) gives the page
    an error to show, not an endless spinner; a job that delivered its result is not terminated."""
    from billiard.exceptions import WorkerLostError

    import headscope.app.workers as workers

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    monkeypatch.setattr(workers, "_celery", None)
    manager = workers.job_manager()
    manager.handle.backend.mark_as_failure("lost-job", WorkerLostError("Worker exited prematurely: signal 9"))
    out = manager.get_result("no-result-key", "lost-job")
    assert "Worker exited prematurely" in out["background_callback_error"]["msg"]
    manager.handle.backend.set("done-key", b'["figure", ""]')
    assert manager.get_result("done-key", "done-job") == ["figure", ""]
    assert manager.terminate_job("done-job") is None  # delivered: no revoke sent to the workers
    monkeypatch.setattr(workers, "_celery", None)


@pytest.mark.parametrize("url, expected", [
    ("", "set HEADSCOPE_REDIS_URL"),
    ("redis://127.0.0.1:1/0", "cannot reach Redis at redis://127.0.0.1:1/0"),
])
def test_worker_without_a_reachable_redis_says_what_to_do(url, expected):
    env = {**os.environ, "HEADSCOPE_REDIS_URL": url}
    out = subprocess.run([sys.executable, "-m", "headscope.app.cli", "worker"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and expected in out.stderr and "Traceback" not in out.stderr


def test_a_worker_offers_every_model_it_was_given(tmp_path):
    """Page callbacks check models on the worker: `worker --model A --model B` must accept B too."""
    from headscope.analysis.store import Store
    from headscope.app.workers import worker_context

    context = worker_context(Store(tmp_path / "store"), ["smollm2-135m", "/models/second"])
    assert context.default_model == "smollm2-135m"
    assert "/models/second" in context.allowed_models()


def test_a_progress_report_written_while_a_poll_reads_the_last_one_is_not_lost_on_redis(redis_url, monkeypatch):
    """As tests/app/test_jobs.py checks for the disk cache: on Redis a poll reads and removes the job's
    progress in one step (MULTI/EXEC), so a report the job writes right after is the next poll's."""
    import json

    import headscope.app.workers as workers
    from tests.app.racing_cache import WritesAfterFirstRead

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    monkeypatch.setattr(workers, "_celery", None)
    manager = workers.job_manager()
    backend = manager.handle.backend
    key = manager._make_progress_key("redis-job")
    backend.set(key, json.dumps([50, 100, "half"]))
    client = backend.client

    class Pipeline:  # the client's pipeline, whose execute() is the poll's read
        def __init__(self, outer):
            self.outer, self.real = outer, client.pipeline()

        def __enter__(self):
            self.real.__enter__()
            return self

        def __exit__(self, *exc):
            return self.real.__exit__(*exc)

        def get(self, *args):
            self.real.get(*args)
            return self

        def delete(self, *args):
            self.real.delete(*args)
            return self

        def execute(self):
            return self.outer._after(self.real.execute())

    watched = WritesAfterFirstRead(client, lambda: client.set(key, json.dumps([100, 100, "preview"])))
    watched.pipeline = lambda: Pipeline(watched)
    monkeypatch.setattr(backend, "client", watched)  # Dash's own get, then delete, also goes through it
    try:
        assert manager.get_progress("redis-job") == [50, 100, "half"]
        assert manager.get_progress("redis-job") == [100, 100, "preview"]
        assert manager.get_progress("redis-job") is None
    finally:
        monkeypatch.setattr(workers, "_celery", None)


def test_a_job_result_that_is_not_json_ends_the_job_with_a_message(redis_url, monkeypatch):
    """A result or progress key holding what is not JSON (bit rot, a tampered Redis) failed the poll inside
    Dash, which answered 204: the page stopped waiting and said nothing. The job now ends with a message."""
    import headscope.app.workers as workers

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    monkeypatch.setattr(workers, "_celery", None)
    manager = workers.job_manager()
    backend = manager.handle.backend
    try:
        for value in (b"\x80not json{", b'{"truncated": '):
            backend.set("rotten-result", value)
            out = manager.get_result("rotten-result", "rotten-job")
            assert "could not be read" in out["background_callback_error"]["msg"], out
        backend.set(manager._make_progress_key("rotten-result"), b"\xffgarbage")
        assert manager.get_progress("rotten-result") is None
    finally:
        monkeypatch.setattr(workers, "_celery", None)

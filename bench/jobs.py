"""Throughput of the app's background jobs on Celery workers: 20 small analysis jobs, 1 vs 2 workers.

Starts its own redis-server on a free loopback port, then for 1 and for 2 ``headscope worker``
processes (``--concurrency 1`` each, a fresh ``HEADSCOPE_HOME`` each, so nothing is reused) submits
the same kind of job the Attention page's *Run* button submits — the Dash background callback
``run_text_attn`` (capture a text's patterns, loss and top-5 into the store), through the Celery task
Dash registered for it — for 20 distinct texts of about ``--tokens`` tokens, and times submit → all
results stored. Prints one table; the ratio is against the 1-worker run measured in the same run.

    .venv/bin/python bench/jobs.py [--jobs 20] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the a of river stone light garden silver quiet morning letter window north harbour clock "
         "paper winter music bridge forest candle market question answer number seven engine").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    import redis

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_workers(n: int, folder: Path, url: str) -> list[subprocess.Popen]:
    procs, logs = [], []
    for i in range(n):
        log = folder / f"worker{n}-{i}.log"
        env = {**os.environ, "HEADSCOPE_REDIS_URL": url, "HEADSCOPE_HOME": str(folder / f"home{n}-{i}"),
               "TOKENIZERS_PARALLELISM": "false"}
        procs.append(subprocess.Popen([sys.executable, "-m", "headscope.app.cli", "worker", "--name", f"bench{n}-{i}",
                                       "--concurrency", "1"], cwd=ROOT, env=env, stdout=open(log, "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    deadline = time.time() + 300
    while not all(log.read_text(errors="replace").count(" ready.") >= 2 for log in logs):  # jobs + pages
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("a worker did not start:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
        time.sleep(0.5)
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    import signal

    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.wait(timeout=60)


def texts(n: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(tokens - 2)) + "." for _ in range(n)]


def run_text_task(folder: Path):
    """The Celery task Dash registered for the Attention page's Run callback (same app as the server)."""
    from dash.background_callback.managers import BaseBackgroundCallbackManager

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.jobs import background_manager
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(folder / "bench-home")))
    for key, fn, _progress in BaseBackgroundCallbackManager.functions:
        if fn.__name__ == "run_text_attn":
            return background_manager().func_registry[key], background_manager()
    raise SystemExit("the Attention page's Run callback is not a background callback: is HEADSCOPE_REDIS_URL set?")


def submit_all(task, manager, batch: list[str]) -> float:
    """Submit one job per text; wait until every result is stored; seconds from first submit."""
    backend = manager.handle.backend
    keys = []
    t = time.perf_counter()
    for text in batch:
        key = f"bench-{uuid.uuid4().hex}"
        task.delay(key, key + "-progress", [1, text, "smollm2-135m", ""], {})
        keys.append(key)
    pending = set(keys)
    deadline = time.time() + 1800
    while pending:
        for key in list(pending):
            value = backend.get(key)
            if value is not None:
                out = json.loads(value)
                if isinstance(out, dict) and "background_callback_error" in out:
                    raise SystemExit(f"a job failed: {out['background_callback_error']['msg']}")
                if out[1]:
                    raise SystemExit(f"a job reported: {out[1]}")
                pending.discard(key)
        if time.time() > deadline:
            raise SystemExit("jobs did not finish in 30 minutes")
        time.sleep(0.02)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="headscope-bench-jobs-"))
    redis_proc, url = start_redis(folder)
    os.environ["HEADSCOPE_REDIS_URL"] = url
    rows = []
    try:
        task, manager = run_text_task(folder)
        for n_workers in (1, 2):
            workers = start_workers(n_workers, folder, url)
            try:
                submit_all(task, manager, texts(2, args.tokens, seed=1000 + n_workers))  # warm the pools
                wall = submit_all(task, manager, texts(args.jobs, args.tokens, seed=n_workers))
            finally:
                stop(workers)
            rows.append((n_workers, wall))
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
    base = rows[0][1]
    print(f"{args.jobs} jobs: the Attention page's Run (capture of a {args.tokens}-token text), "
          f"one pool process per worker, {os.cpu_count()} CPU cores")
    print("jobs | workers |  wall s | jobs/s | speed-up vs 1 worker")
    for n_workers, wall in rows:
        print(f"{args.jobs:>4} | {n_workers:>7} | {wall:>7.2f} | {args.jobs / wall:>6.2f} | {base / wall:>5.2f}×")


if __name__ == "__main__":
    main()

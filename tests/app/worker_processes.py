"""The processes of the multi-worker set-up, for the tests that start it: Debian's redis-server (the
``redis_url`` fixture in tests/app/conftest.py starts one) and ``headscope worker`` (Celery) processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"
STARTED = re.compile(r"job (\w+) (started|skipped) in \S+ pid (\d+)")


class Worker:
    """One ``headscope worker`` subprocess with its own store folder and log."""

    def __init__(self, name: str, folder: Path, redis_url: str):
        self.name, self.folder, self.redis_url = name, folder, redis_url
        self.log_path = folder / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "HEADSCOPE_HOME": str(self.folder / "home"), "HEADSCOPE_REDIS_URL": self.redis_url}
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "headscope.app.cli", "worker", "--name", self.name,
                                      "--concurrency", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, since: int = 0, timeout: float = 180) -> None:
        """Until both of its Celery workers (long jobs, page callbacks) are ready."""
        deadline = time.time() + timeout
        while self.log()[since:].count(" ready.") < 2:
            assert self.proc.poll() is None, self.log()
            assert time.time() < deadline, f"worker {self.name} did not start:\n{self.log()}"
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def jobs(self, name: str, since: int = 0) -> list[int]:
        """Pids of the pool processes that started job ``name`` (in the log after offset ``since``),
        leaving out calls that had nothing to do (logged as skipped: a button's callback fired as its
        page's layout arrived, which Dash still sends to a worker)."""
        pids: list[int] = []
        for job, what, pid in STARTED.findall(self.log()[since:]):
            if job == name and what == "started":
                pids.append(int(pid))
            elif job == name and int(pid) in pids:
                pids.reverse()
                pids.remove(int(pid))  # the most recent start of that process
                pids.reverse()
        return pids

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # warm shutdown of the worker and its pool
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

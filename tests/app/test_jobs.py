"""Background job processes do not outlive the server that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

# A stand-in for `headscope serve`: the same job-process launch Dash's DiskcacheManager uses
# (`multiprocess.Process`, not a daemon), a job that would compute for ten minutes, and the
# server's SIGTERM handling from app.jobs. It prints the job's pid and then serves "forever".
SERVER = textwrap.dedent("""
    import sys, time
    from multiprocess import Process
    from app.jobs import end_jobs_with_server

    end_jobs_with_server()

    def job():
        time.sleep(600)

    p = Process(target=job)
    p.start()
    print(p.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_terminated_server_ends_its_running_jobs_and_reports_sigterm():
    """systemd, `docker stop` or a test's teardown send SIGTERM to the server only: its forked job
    processes used to keep computing, orphaned, holding the model's memory (seen after a journey test)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        job = int(server.stdout.readline())
        assert _alive(job)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == -signal.SIGTERM  # still reads as "ended by SIGTERM"
        deadline = time.time() + 30
        while _alive(job) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(job), "the job process outlived its server"
    finally:
        server.kill()
        try:
            os.kill(job, signal.SIGKILL)
        except (OSError, UnboundLocalError):
            pass


def test_a_process_that_imports_the_app_first_runs_sqlite_without_its_global_memory_mutex():
    """`headscope serve` imports :mod:`app` before sqlite3, so SQLite's memory statistics (one global
    mutex taken by every allocation, which a forked job could inherit locked) are off: SQLite then
    counts no memory in use, where by default it counts every allocation."""
    probe = textwrap.dedent("""
        import ctypes, {first}
        import sqlite3
        con = sqlite3.connect(":memory:")
        con.execute("create table t (x)"); con.executemany("insert into t values (?)", [(i,) for i in range(1000)])
        lib = ctypes.CDLL("libsqlite3.so.0")
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        print(lib.sqlite3_memory_used())
    """)
    used = {}
    for first in ("app", "json"):  # json: a process that never imported the app (SQLite's default)
        out = subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True,
                             timeout=120, check=True)
        used[first] = int(out.stdout.strip())
    assert used["app"] == 0 and used["json"] > 0, used

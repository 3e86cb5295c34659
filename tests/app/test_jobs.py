"""Background job processes do not outlive the server that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.app.racing_cache import WritesAfterFirstRead

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `headscope serve`: the same job-process launch Dash's DiskcacheManager uses
# (`multiprocess.Process`, not a daemon), a job that would compute for ten minutes, and the
# server's SIGTERM handling from app.jobs. It prints the job's pid and then serves "forever".
SERVER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    from multiprocess import Process
    from headscope.app.jobs import end_jobs_with_server

    faulthandler.register(signal.SIGUSR1)  # for the test's report if it does not end
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


def _where(pid: int) -> str:
    """What the kernel says process ``pid`` is doing: its state, wait channel and system call."""
    said = []
    for name in ("wchan", "syscall"):
        try:
            said.append(f"{name}={Path(f'/proc/{pid}/{name}').read_text().strip()}")
        except OSError as e:
            said.append(f"{name}: {e.strerror}")
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        said += [line for line in status if line.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt"))]
    except OSError:
        pass
    return "; ".join(said)


def _ended_or_report(server: subprocess.Popen, job: int, timeout: float) -> int:
    """``server``'s exit status once it ended within ``timeout`` s; else fail with where it was stuck:
    the kernel's view of it and of its job, and every thread's Python stack (faulthandler). Under a
    loaded run (two suites at once) it once did not end within 60 s, where alone it takes ~2 s."""
    try:
        return server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        report = f"server: {_where(server.pid)}\njob: {_where(job)}\n"
        server.send_signal(signal.SIGUSR1)
        time.sleep(2)
        for pid in (server.pid, job):  # the job holds the server's stderr open too
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _, stderr = server.communicate(timeout=30)
        pressure = {kind: Path(f"/proc/pressure/{kind}").read_text() for kind in ("cpu", "memory", "io")
                    if Path(f"/proc/pressure/{kind}").exists()}
        raise AssertionError(f"the server did not end within {timeout:.0f} s of SIGTERM\n{report}"
                             f"pressure: {pressure}\nload: {os.getloadavg()}\nstacks:\n{stderr}") from None


def test_a_terminated_server_ends_its_running_jobs_and_reports_sigterm():
    """systemd, `docker stop` or a test's teardown send SIGTERM to the server only: its forked job
    processes used to keep computing, orphaned, holding the model's memory (seen after a journey test)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        job = int(server.stdout.readline())
        assert _alive(job)
        server.send_signal(signal.SIGTERM)
        assert _ended_or_report(server, job, 60) == -signal.SIGTERM  # still reads as "ended by SIGTERM"
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


@pytest.mark.browser  # kaleido's Chromium
def test_a_terminated_server_with_its_export_browser_running_ends_within_seconds():
    """The server keeps a headless Chromium for image exports (kaleido, started at warm-up). On SIGTERM
    its wrapper process (choreographer's) spent 5 s in its own SIGTERM handler, waiting on a lock its
    interrupted main thread held, and the server then waited out its whole grace period for it: every
    `docker stop`, systemd stop and test teardown took over 5 s (7 s measured on a quiet machine).
    The browser itself must still be gone afterwards."""
    import psutil

    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from headscope.app.export import figure_bytes
        from headscope.app.jobs import end_jobs_with_server
        import plotly.graph_objects as go

        end_jobs_with_server()
        figure_bytes(go.Figure(), "svg")  # starts the export browser, as the server's warm-up does
        print("ready", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert server.stdout.readline().strip() == "ready"
        def named_chrom(process) -> bool:
            try:
                return "chrom" in process.name()
            except psutil.Error:  # a short-lived helper process already gone
                return False

        browser = [p for p in psutil.Process(server.pid).children(recursive=True) if named_chrom(p)]
        assert browser, "no export browser was started"
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == -signal.SIGTERM
        took = time.monotonic() - started
        assert took < 5.0, f"the server took {took:.1f} s to end"
        deadline = time.time() + 10
        while any(_alive(p.pid) for p in browser) and time.time() < deadline:
            time.sleep(0.1)
        assert not [p.pid for p in browser if _alive(p.pid)], "the export browser outlived its server"
    finally:
        for p in [server, *locals().get("browser", [])]:
            try:
                p.kill()
            except Exception:
                pass


def test_a_process_that_imports_the_app_first_runs_sqlite_without_its_global_memory_mutex():
    """`headscope serve` imports :mod:`headscope.app` before sqlite3, so SQLite's memory statistics (one global
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
    for first in ("headscope.app", "json"):  # json: a process that never imported the app (SQLite's default)
        out = subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True,
                             timeout=120, check=True)
        used[first] = int(out.stdout.strip())
    assert used["headscope.app"] == 0 and used["json"] > 0, used


# A stand-in for the server at the moment it forks a job: another server thread is inside a write to
# the job cache (a poll delivering a result, Dash ending a finished job) when the job is forked; the job
# then writes its progress. SQLite's per-process lock bookkeeping, copied into the child with that
# lock's owner gone, made every write the child tried "busy" until the cache's timeout: the job could
# report neither progress nor result (diskcache.Timeout, exit code 1; seen with ten sessions at once).
FORK_DURING_WRITE = textwrap.dedent("""
    import sys, threading, time
    import headscope.app
    from multiprocess import Process
    from headscope.app.jobs import GatedCache, JSONJobDisk
    import diskcache

    kind = GatedCache if sys.argv[2] == "gated" else diskcache.Cache
    cache = kind(sys.argv[1], disk=JSONJobDisk, timeout=5)
    cache.set("before", "1")
    inside = threading.Event()

    def server_thread():
        with cache.transact():
            cache.set("other", "2")
            inside.set()
            time.sleep(1.0)

    threading.Thread(target=server_thread).start()
    inside.wait()

    def job():
        cache.set("progress", "50%")
        cache.set("result", "done")

    p = Process(target=job)
    p.start()
    p.join(60)
    print(p.exitcode, cache.get("result"), flush=True)
""")


def test_a_job_forked_while_another_thread_writes_the_job_cache_still_delivers_its_result(tmp_path):
    """The job cache is gated: the fork waits for the write in flight (about a second here), and the
    job writes its progress and result. Ungated (diskcache's own ``Cache``), the same job fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outcome = {}
    for kind in ("gated", "plain"):
        out = subprocess.run([sys.executable, "-c", FORK_DURING_WRITE, str(tmp_path / kind), kind], capture_output=True,
                             text=True, timeout=180, env=env)
        outcome[kind] = out.stdout.split()
    assert outcome["gated"] == ["0", "done"], outcome
    assert outcome["plain"] == ["1", "None"], outcome  # the failure the gate prevents, still reproduced


def test_two_jobs_with_the_same_arguments_each_deliver_their_own_result(tmp_path):
    """Ten pages that run the same text at once start ten jobs with equal arguments. Dash keyed their
    results by the arguments alone: the first page to poll took the shared result and the others waited
    for ever or read "the job stopped". Each job now has its own key, and each poll gets its own result."""
    from dash import DiskcacheManager
    from dash._utils import AttributeDict

    from headscope.app.jobs import _watched_manager, job_cache

    manager = _watched_manager(DiskcacheManager)(job_cache(tmp_path), expire=3600)

    def double(x):
        return {"value": 2 * x}

    job_fn = manager.make_job_fn(double, False)
    context = AttributeDict(args={}, ignore_register_page=True)
    started = []
    for _ in range(2):
        key = manager.build_cache_key(double, [21], [], None)
        started.append((key, manager.call_job_fn(key, job_fn, [21], context)))
    assert started[0][0] != started[1][0]
    deadline, results = time.time() + 120, {}
    while len(results) < 2 and time.time() < deadline:
        for key, job in started:
            if key not in results:
                result = manager.get_result(key, job)
                if result is not manager.UNDEFINED:
                    results[key] = result
        time.sleep(0.1)
    assert sorted(map(str, results.values())) == [str({"value": 42})] * 2, results


# What `headscope serve` does before it loads a model (app/cli/serve.py cmd_serve), then a job forked from it
FORKED_JOB_THREADS = textwrap.dedent("""
    import os, signal, sys, threading
    from headscope.app.jobs import in_job, prepare_server_threads

    prepare_server_threads()
    import torch

    x = torch.randn(4_000_000)
    expected = torch.exp(x)  # the server's own work, in its main thread and in a request thread: one thread
    seen = [torch.get_num_threads()]
    t = threading.Thread(target=lambda: seen.append((torch.exp(x).sum(), torch.get_num_threads())[1]))
    t.start(); t.join()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child that inherited a dead OpenMP pool hangs: end it, the pipe says nothing
        in_job()
        got = torch.exp(x)
        os.write(w, f"{torch.get_num_threads()} {torch.equal(got, expected)}".encode())
        os._exit(0)
    os.close(w)
    print(seen, os.read(r, 100).decode() or "no-answer -", os.environ["OMP_WAIT_POLICY"],
          len(os.sched_getaffinity(0)), flush=True)
    os.waitpid(pid, 0)
""")


@pytest.mark.parametrize("policy, given, want", [(None, None, "cores"), ("ACTIVE", None, 1), (None, "3", 3)])
def test_a_job_forked_from_the_server_uses_its_cores_only_where_openmp_sleeps_while_waiting(policy, given, want):
    """Every thread of the server runs torch on one thread, so its forked jobs can use every core (or
    the OMP_NUM_THREADS the environment gave) without inheriting a dead OpenMP pool: a child of a
    multi-threaded parent hangs. With OpenMP set to spin-wait (``ACTIVE``), several such jobs on the
    same cores slow each other several times over, so a job keeps to one thread there."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    if given:
        env["OMP_NUM_THREADS"] = given
    out = subprocess.run([sys.executable, "-c", FORKED_JOB_THREADS], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    server, job = out.stdout.split("] ", 1)
    threads, same, seen_policy, cores = job.split()
    assert server == "[1, 1" and same == "True" and seen_policy == (policy or "PASSIVE")
    assert int(threads) == (int(cores) if want == "cores" else want)


# Start fn as a job through the server's own job manager (forked, as `headscope serve` does) and wait
# for its result; prepended to the scripts below.
RUN_IN_A_JOB = textwrap.dedent("""
    import time
    from dash import DiskcacheManager
    from dash._utils import AttributeDict
    from headscope.app.jobs import _watched_manager, job_cache

    def run_in_a_job(fn, cache, timeout_s):
        manager = _watched_manager(DiskcacheManager)(job_cache(cache), expire=3600)
        key = manager.build_cache_key(fn, [1], [], None)
        job = manager.call_job_fn(key, manager.make_job_fn(fn, False), [1],
                                  AttributeDict(args={}, ignore_register_page=True))
        result, deadline = manager.UNDEFINED, time.time() + timeout_s
        while result is manager.UNDEFINED and time.time() < deadline:
            result = manager.get_result(key, job)
            time.sleep(0.1)
        return result
""")


# A server thread loads a model (a page's render, for a model named in its link) while a Run click
# forks the job through the server's job manager; the job loads the model and runs it.
JOB_FORKED_DURING_A_LOAD = RUN_IN_A_JOB + textwrap.dedent("""
    import faulthandler, sys, threading
    from headscope.analysis import models
    from headscope.analysis.fork_gate import MODEL_LOADS

    folder, delay_s, cache = sys.argv[1], float(sys.argv[2]), sys.argv[3]

    def run(n):
        faulthandler.dump_traceback_later(90, exit=True)  # a hung job says where, and ends
        import torch
        shared = (folder, "cpu") in models._models
        model = models.load_model(folder)
        with model.lock, torch.inference_mode():
            logits = model.bridge(torch.tensor([[1, 2, 3]]))
        return {"shared": shared, "logits": list(logits.shape)}

    render = threading.Thread(target=models.load_model, args=(folder,))
    render.start()
    while not MODEL_LOADS.inside():
        time.sleep(0.001)
    time.sleep(delay_s)  # inside the load: Hugging Face imports the family's modelling code
    result = run_in_a_job(run, cache, 150)
    render.join()
    print(result, flush=True)
""")


@pytest.mark.slow  # a server process that imports the app and loads a model, twice
@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_a_job_forked_while_the_server_loads_a_model_runs_it(embedded_tokenizer, tmp_path, delay_s):
    """CI: the Qwen 3 browser test waited 240 s for a Run whose job never started. The page's render
    was loading the model in a server thread when the click forked the job, and the child waited for
    ever on the lock of a module the load was importing. The fork now waits for loads in flight: the
    job finds the model loaded (it never loads it again) and runs it."""
    from tests.tiny_families import tiny_family_model

    folder = tmp_path / "tiny-qwen3"
    tiny_family_model("qwen3", len(embedded_tokenizer)).save_pretrained(folder, safe_serialization=True)
    embedded_tokenizer.save_pretrained(folder)
    # a fresh interpreter: none of Qwen 3's modelling code imported yet, as in a server that just started
    done = subprocess.run([sys.executable, "-c", JOB_FORKED_DURING_A_LOAD, str(folder), str(delay_s),
                           str(tmp_path / "jobs")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    want = {"shared": True, "logits": [1, 3, len(embedded_tokenizer)]}
    assert done.stdout.strip().splitlines()[-1] == str(want), done.stdout[-2000:] + done.stderr[-3000:]


# A server thread imports a module on first use (a library a page needs) while a Run click forks a
# job that imports the same module.
JOB_FORKED_DURING_AN_IMPORT = RUN_IN_A_JOB + textwrap.dedent("""
    import faulthandler, sys, threading

    sys.path.insert(0, sys.argv[1])

    def run(n):
        faulthandler.dump_traceback_later(60, exit=True)  # a hung job says where, and ends
        import slow_to_import
        return {"value": slow_to_import.VALUE}

    threading.Thread(target=lambda: __import__("slow_to_import")).start()
    while "slow_to_import" not in sys.modules:  # its code is running now (it sleeps 2 s)
        time.sleep(0.001)
    print(run_in_a_job(run, sys.argv[2], 120), flush=True)
""")


def test_a_job_forked_while_the_server_imports_a_module_runs(tmp_path):
    """A fork while another server thread runs a module's import left the job waiting for ever on
    that module's lock when it imported the module too. The fork now waits for the import to end."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(2)\nVALUE = 7\n")
    done = subprocess.run([sys.executable, "-c", JOB_FORKED_DURING_AN_IMPORT, str(tmp_path), str(tmp_path / "jobs")],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str({"value": 7}), done.stdout[-2000:] + done.stderr[-3000:]


def test_a_progress_report_written_while_a_poll_reads_the_last_one_is_not_lost(tmp_path):
    """A poll reads the job's progress and removes it in one step. Dash's own manager read it, then
    deleted it: a report the job wrote in between was deleted unseen. Run's grid preview is its job's
    last report, so the page never drew it (#16). A report over diskcache's 32 KB inline limit (kept in
    a file, as a preview grid can be) is read and removed the same way."""
    from dash import DiskcacheManager

    from headscope.app.jobs import _watched_manager, job_cache

    manager = _watched_manager(DiskcacheManager)(job_cache(tmp_path), expire=3600)
    key = manager._make_progress_key("job")
    real = manager.handle
    real.set(key, [50, 100, "half"])
    manager.handle = WritesAfterFirstRead(real, lambda: real.set(key, [100, 100, "preview", "x" * 40_000]))
    assert manager.get_progress("job") == [50, 100, "half"]
    assert manager.get_progress("job") == [100, 100, "preview", "x" * 40_000]  # not deleted unseen
    assert manager.get_progress("job") is None
    assert real.get(key) is None and not any(tmp_path.rglob("*.val"))  # the file went with it

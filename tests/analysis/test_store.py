import contextlib
import hashlib
import io
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from headscope.analysis.store import Store, content_key


def test_round_trip_keeps_values_shapes_and_metadata(store):
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    store.put("k1", "run", {"text": "héllo", "n": 3}, {"a": a, "b": np.array([1.5, np.nan], dtype=np.float32)})
    r = store.get("k1")
    assert r.meta == {"text": "héllo", "n": 3} and r.kind == "run"
    np.testing.assert_array_equal(r.array("a"), a)
    assert r.array("a").dtype == np.float16
    assert np.isnan(r.array("b")[1])


def test_content_key_depends_on_every_part():
    base = content_key("run", "digest", [1, 2, 3], {"dtype": "float16"})
    assert base == content_key("run", "digest", [1, 2, 3], {"dtype": "float16"})
    assert base != content_key("run", "digest", [1, 2, 4], {"dtype": "float16"})
    assert base != content_key("run", "other", [1, 2, 3], {"dtype": "float16"})
    assert base != content_key("run", "digest", [1, 2, 3], {"dtype": "float32"})


def test_truncated_file_is_detected_and_record_dropped(store):
    store.put("k", "run", {}, {"a": np.ones(1000)})
    path = store.get("k").folder / "a.npy"
    path.write_bytes(path.read_bytes()[:-100])
    assert store.get("k") is None
    assert store.list() == []


def test_object_arrays_are_refused_no_pickles(store):
    with pytest.raises(TypeError, match="object"):
        store.put("k", "run", {}, {"a": np.array([{"x": 1}], dtype=object)})
    assert store.get("k") is None


def test_replacing_a_record_removes_the_old_files(store):
    store.put("k", "run", {"v": 1}, {"a": np.zeros(3)})
    old = store.get("k").folder
    store.put("k", "run", {"v": 2}, {"a": np.ones(3)})
    assert not old.exists()
    assert store.get("k").meta == {"v": 2}


def test_crash_leftovers_are_ignored_then_collected(store):
    orphan = store.root / "records" / "ab" / "abcdef-12345678"
    orphan.mkdir(parents=True)
    (orphan / "a.npy").write_bytes(b"half a file")
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    assert store.get("abcdef") is None
    assert store.collect_garbage() == 1 and not orphan.exists()


def test_remove_and_prefix_find(store):
    store.put("abcd1234ef", "run", {}, {"a": np.zeros(1)})
    assert store.find("abcd12") == ["abcd1234ef"]
    assert store.find("'; DROP TABLE records; --") == []
    assert store.remove("abcd1234ef") and store.get("abcd1234ef") is None


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from headscope.analysis.store import Store
    s = Store(sys.argv[1]); who = int(sys.argv[2])
    for i in range(40):
        key = f"shared{i % 10}"            # both processes write the same ten keys
        arr = np.full(5000, i % 10, dtype=np.float32)
        s.put(key, "run", {"writer": who, "i": i}, {"a": arr})
        r = s.get(key)
        assert r is not None and float(r.array("a")[0]) == i % 10, (key, r)
    """
)


def test_two_processes_sharing_a_store_do_not_corrupt_it(tmp_path):
    root = tmp_path / "shared"
    Store(root)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(w)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    s = Store(root)
    records = s.list()
    assert len(records) == 10
    for r in records:
        full = s.get(r.key)
        assert full is not None
        assert float(full.array("a")[0]) == int(r.key.removeprefix("shared"))
    folders = list((root / "records").glob("*/*"))
    assert len(folders) == 10  # replaced versions were cleaned up, no temporaries left


KILLED_WRITER = r"""
import sys, numpy as np
from headscope.analysis.store import Store
s = Store(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
i = 0
while True:  # until killed: replace and add records with a few MB each
    key = f"crash{i % 7}"
    s.put(key, "test", {"i": i}, {"a": np.full(300_000, i, dtype=np.float64), "b": rng.random(1000)})
    if i == 0:
        print("stored", flush=True)  # the test kills only after a first whole write, however slow the start
    i += 1
"""


def test_sigkill_during_writes_leaves_a_consistent_store(tmp_path):
    """Kill a writer with SIGKILL mid-write, several times: every record the index lists either
    verifies and holds one whole write, or is dropped; temporaries are collected; writing goes on."""
    import signal

    root = tmp_path / "killed"
    Store(root)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for attempt, delay in enumerate((0.05, 0.3, 0.7)):
        p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root), str(attempt)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # wait for the first whole write (interpreter start is seconds on a loaded machine), then let
        # it write on for a while: the kill lands at a different point of a later write each time
        assert p.stdout.readline() == b"stored\n", p.stderr.read().decode()
        time.sleep(delay)
        assert p.poll() is None, p.stderr.read().decode()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    s = Store(root)
    listed = s.list()
    assert listed, "the writer stored nothing before it was killed"
    served = 0
    for r in listed:
        full = s.get(r.key)
        if full is None:  # detected as incomplete and dropped: never served
            continue
        a = full.array("a")
        assert a.shape == (300_000,) and (a == full.meta["i"]).all()  # one whole write, not a mix
        served += 1
    assert served >= 1, "every record was dropped: the first whole write of each writer should survive"
    # the killed writers' temporaries were collected by opening the store, without being asked
    assert not [p for p in (root / "records").glob("*/.tmp-*")]
    s.put("after", "test", {}, {"a": np.zeros(3)})
    assert s.get("after") is not None


# -- served bytes are verified bytes ----------------------------------------------------------------


def _within(seconds: float, call):
    """``call()``'s result, failing the test if it has not returned after ``seconds`` (a blocked read)."""
    import threading

    out: list = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still blocked after {seconds} s"
    return out[0]


@pytest.mark.parametrize("tamper", ["flip", "truncate", "delete", "fifo", "symlink-to-fifo", "folder"])
def test_a_file_changed_after_reading_never_changes_what_was_served(store, tamper, caplog, tmp_path):
    """Arrays are read into memory and verified once: flipping bytes in place (same size and mtime),
    truncating or deleting the file afterwards changes nothing already served (with a memory map,
    flipped bytes showed through and a truncation killed the process with SIGBUS); the next read
    from disk logs the problem, drops the record, and a recompute stores the right numbers again."""
    a = np.arange(200_000, dtype=np.float32)
    store.put("k", "run", {"n": 1}, {"a": a})
    held = store.get("k")
    served = held.array("a")
    path = held.folder / "a.npy"
    st = path.stat()
    if tamper == "flip":
        raw = bytearray(path.read_bytes())
        raw[-4000:] = bytes(b ^ 0xFF for b in raw[-4000:])
        path.write_bytes(bytes(raw))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a stat check alone would miss it
    elif tamper == "truncate":
        with open(path, "r+b") as f:
            f.truncate(st.st_size // 2)
    elif tamper == "delete":
        path.unlink()
    else:  # replaced by something that is not a file: a pipe, or a symlink to one (opening a pipe for
        # reading waits for a writer: the server's thread hung), a folder
        outside = tmp_path / "outside"
        outside.mkdir(exist_ok=True)
        target = outside / "a.npy"
        if tamper == "symlink-to-fifo":
            os.mkfifo(target)
        path.unlink()
        if tamper == "fifo":
            os.mkfifo(path)
        elif tamper == "folder":
            path.mkdir()
        else:
            path.symlink_to(target)
    np.testing.assert_array_equal(served, a)
    np.testing.assert_array_equal(held.array("a"), a)
    with pytest.raises(ValueError):
        served[0] = 1  # read-only, as the memory map was
    with caplog.at_level("WARNING", logger="headscope.analysis.store"):
        assert _within(20, lambda: store.get("k")) is None
    assert "dropped, it will be computed again" in caplog.text and "k" in caplog.text
    store.put("k", "run", {"n": 1}, {"a": a})
    np.testing.assert_array_equal(store.get("k").array("a"), a)


def test_a_planted_object_array_is_never_unpickled(store, tmp_path):
    """An .npy holding a pickled object array, even with a matching checksum in the index, is refused."""
    import pickle

    canary = tmp_path / "canary"

    class Bomb:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    record = store.put("k", "run", {}, {"a": np.zeros(3)})
    path = record.folder / "a.npy"
    arr = np.empty(1, dtype=object)
    arr[0] = Bomb()
    with open(path, "wb") as f:
        np.lib.format.write_array(f, arr, allow_pickle=True)
    with store._db() as db:
        db.execute("UPDATE arrays SET sha256=? WHERE key='k'", (hashlib.sha256(path.read_bytes()).hexdigest(),))
    assert pickle.PROTO in path.read_bytes() or b"canary" in path.read_bytes()
    assert store.get("k") is None
    assert not canary.exists()


# -- a corrupt index is rebuilt from the record folders ---------------------------------------------


def _fill(root) -> dict[str, np.ndarray]:
    s = Store(root)
    want = {}
    for i in range(5):
        want[f"{i:02d}" + "ab" * 31] = np.full(10, i, dtype=np.float32)
    for key, arr in want.items():
        s.put(key, "run", {"i": int(arr[0])}, {"a": arr})
    s.put(next(iter(want)), "run", {"i": 0}, {"a": want[next(iter(want))]})  # a replaced version too
    s.close()
    return want


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zero-length", "deleted"])
def test_a_corrupt_index_is_reported_once_and_rebuilt_losing_nothing(tmp_path, damage, caplog):
    root = tmp_path / "home"
    want = _fill(root)
    index = root / "index.sqlite"
    with contextlib.suppress(FileNotFoundError):
        (root / "index.sqlite-wal").unlink()
    if damage == "garbage":
        index.write_bytes(os.urandom(8192))
    elif damage == "truncated":
        index.write_bytes(index.read_bytes()[: index.stat().st_size // 3])
    elif damage == "zero-length":
        index.write_bytes(b"")
    else:
        index.unlink()
    with caplog.at_level("WARNING", logger="headscope.analysis.store"):
        s = Store(root)
    lines = [r.getMessage() for r in caplog.records if r.name == "headscope.analysis.store"]
    assert len(lines) == 1 and "rebuilt 5 records from the record folders" in lines[0], lines
    assert {r.key for r in s.list()} == set(want)
    for key, arr in want.items():
        r = s.get(key)
        assert r.meta == {"i": int(arr[0])} and r.kind == "run"
        np.testing.assert_array_equal(r.array("a"), arr)
    caplog.clear()
    with caplog.at_level("WARNING", logger="headscope.analysis.store"):
        Store(root)  # rebuilt once: the next open says nothing
    assert not caplog.records


# -- crash leftovers ---------------------------------------------------------------------------------


def test_a_live_writers_temporary_folder_is_left_alone_a_dead_ones_is_collected(tmp_path):
    root = tmp_path / "home"
    s = Store(root)
    from headscope.analysis.store import _HOST

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_tmp = root / "records" / "ab" / f".tmp-{sleeper.pid}-{_HOST}-ab12-00000000"
        dead_tmp = root / "records" / "ab" / f".tmp-{dead.pid}-{_HOST}-ab34-00000000"
        foreign_tmp = root / "records" / "ab" / ".tmp-123-ffffffff-ab56-00000000"  # another host
        for folder in (live_tmp, dead_tmp, foreign_tmp):
            folder.mkdir(parents=True)
            (folder / "a.npy").write_bytes(b"half")
        Store(root)
        assert live_tmp.exists() and foreign_tmp.exists() and not dead_tmp.exists()
        old = time.time() - 3 * 3600
        for path in (foreign_tmp / "a.npy", foreign_tmp, live_tmp / "a.npy", live_tmp):
            os.utime(path, (old, old))
        assert s.collect_garbage() == 1
        assert live_tmp.exists() and not foreign_tmp.exists()  # the live writer's, however old, stays
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_writable_array_is_the_callers_own(store):
    """``mmap=False`` hands over a writable array; changing it never changes what is served next."""
    store.put("k", "run", {}, {"a": np.arange(5.0)})
    record = store.get("k")
    mine = record.array("a", mmap=False)
    mine[0] = 9
    np.testing.assert_array_equal(record.array("a"), np.arange(5.0))
    np.testing.assert_array_equal(store.get("k").array("a"), np.arange(5.0))


def test_records_stored_before_manifests_survive_a_later_index_rebuild(tmp_path):
    """A store written by the previous version (no ``record.json`` in its folders) gets its manifests
    written from the index at the next open, so garbling the index afterwards loses nothing."""
    root = tmp_path / "old"
    s = Store(root)
    s.put("ab" * 32, "run", {"v": 1}, {"a": np.arange(4.0)})
    (s.get("ab" * 32).folder / "record.json").unlink()
    with s._db() as db:
        db.execute("PRAGMA user_version=0")  # as the previous version left it
    s.close()
    Store(root).close()
    (root / "index.sqlite-wal").unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"garbage" * 100)
    r = Store(root).get("ab" * 32)
    assert r.meta == {"v": 1}
    np.testing.assert_array_equal(r.array("a"), np.arange(4.0))


def test_a_locked_index_is_reported_and_never_moved_aside(tmp_path, monkeypatch):
    """Only a damaged index is rebuilt: one that another process holds locked is reported (a clear
    error) and left as it is, with every record still there once the lock is gone."""
    import sqlite3

    from headscope.analysis.store import StoreUnavailable

    root = tmp_path / "locked"
    s = Store(root)
    s.put("k", "test", {"n": 1}, {"a": np.arange(3.0)})
    s.close()
    holder = sqlite3.connect(root / "index.sqlite", isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr(Store, "BUSY_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(StoreUnavailable, match="locked"):
            Store(root)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not list(root.glob("index.sqlite.corrupt-*"))
    assert (Store(root).get("k").array("a") == np.arange(3.0)).all()


# Leftovers of odd shapes under records/: each once stopped every store from opening (an OverflowError
# traceback for a pid past C's long; "Not a directory" for a stray file) or stayed forever.
# (name under records/ab/, what it is: "dir", "file" or "link"; its mtime is an hour and more ago)
ODD_LEFTOVERS = [
    (f".tmp-{10**20}-HOST-x", "dir"), (".tmp-0-HOST-x", "dir"), (".tmp-123-zzzzzzzz-x", "file"),
    (".tmp-4194304999-HOST-x", "file"), (".tmp-1-zzzzzzzz-x", "link"), ("not-a-record", "file"),
]


@pytest.mark.parametrize("name, kind", ODD_LEFTOVERS, ids=[f"{k}:{n[:24]}" for n, k in ODD_LEFTOVERS])
def test_odd_leftovers_never_stop_a_store_opening_and_are_collected(tmp_path, name, kind):
    from headscope.analysis.store import _HOST

    Store(tmp_path / "home").put("kept", "run", {"n": 1}, {"a": np.arange(4.0)})
    where = tmp_path / "home" / "records" / "ab"
    where.mkdir(parents=True, exist_ok=True)
    path = where / name.replace("HOST", _HOST)
    if kind == "dir":
        path.mkdir()
        (path / "a.npy").write_bytes(b"x")
    elif kind == "file":
        path.write_bytes(b"x")
    else:
        path.symlink_to(tmp_path / "nowhere")
    old = time.time() - 2 * 3600
    os.utime(path, (old, old), follow_symlinks=False)
    if kind == "dir":
        os.utime(path / "a.npy", (old, old))
    store = Store(tmp_path / "home")  # opening collects
    assert not os.path.lexists(path), f"{name} was not collected"
    np.testing.assert_array_equal(store.get("kept").array("a"), np.arange(4.0))


# A background job is forked from the server while another server thread writes to the store's index.
FORK_DURING_INDEX_WRITE = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from headscope.analysis.store import Store

    store = Store(sys.argv[1], shared=False)
    store.BUSY_TIMEOUT_S = 5
    inside = threading.Event()

    def server_thread():
        with store._db() as db:  # a write transaction in flight, as Store.put's
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM records WHERE key='none'")
            inside.set()
            time.sleep(1.0)
            db.execute("COMMIT")

    threading.Thread(target=server_thread).start()
    inside.wait()
    pid = os.fork()
    if pid == 0:
        try:
            Store(sys.argv[1], shared=False).put("job", "run", {}, {"x": np.arange(3)})
            os._exit(0)
        except BaseException as e:
            print(type(e).__name__, e, flush=True)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), store.get("job") is not None, flush=True)
""")


def test_a_job_forked_while_the_server_writes_the_index_can_store_its_result(tmp_path):
    """The fork waits for the write in flight (analysis.fork_gate); the child's own write then succeeds.
    Without the gate the child inherits SQLite's lock bookkeeping with its owner gone, and its write is
    refused as busy until the store's timeout."""
    out = subprocess.run([sys.executable, "-c", FORK_DURING_INDEX_WRITE, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split()[-2:] == ["0", "True"], (out.stdout, out.stderr[-2000:])


def test_the_fork_gate_lets_threads_in_together_and_a_fork_waits_for_them():
    """Threads inside the gate do not wait for each other; a fork waits until the last has left, then
    the threads that arrive meanwhile wait for the fork; a thread that forks from inside waits for the
    others only."""
    import threading

    from headscope.analysis.fork_gate import ForkGate

    gate, order = ForkGate(), []
    release = threading.Event()

    def reader(name):
        with gate.using():
            order.append(f"{name} in")
            release.wait(10)
            order.append(f"{name} out")

    readers = [threading.Thread(target=reader, args=(n,)) for n in ("a", "b")]
    for t in readers:
        t.start()
    while gate.inside() < 2:
        time.sleep(0.01)
    forker = threading.Thread(target=lambda: (gate.close_for_fork(), order.append("fork"), gate.open_after_fork()))
    forker.start()
    time.sleep(0.2)
    assert "fork" not in order  # both readers are still inside
    release.set()
    forker.join(10)
    for t in readers:
        t.join(10)
    assert order.index("fork") > max(order.index("a out"), order.index("b out"))
    with gate.using(), gate.using():  # re-entrant, and a fork from inside waits for nobody
        gate.close_for_fork()
        gate.open_after_fork()


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.float16).reshape(3, 4),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),  # stored C-ordered
    np.arange(40, dtype=np.int64)[::3],  # a strided view
    np.float32(2.5) * np.ones(()),  # 0-d
    np.empty((0, 5), dtype=np.float32),
    np.random.default_rng(0).random((3, 1 << 20), dtype=np.float64),  # 24 MiB: written in several blocks
    np.array([True, False, True]),
    np.zeros(3, dtype=[("a", "<i4"), ("b", "<f2")]),
], ids=["float16", "fortran", "strided", "0-d", "empty", "24MiB", "bool", "structured"])
def test_each_recorded_checksum_is_the_sha256_of_the_file_on_disk(store, arr):
    """put writes the file itself and hashes the bytes as it writes them (one pass, no reading back):
    the file must be what ``numpy.save`` writes, its recorded checksum that of the file a later read
    checks, and the array read must equal the one put."""
    record = store.put("k", "run", {}, {"a": arr})
    path = record.folder / "a.npy"
    expected = io.BytesIO()
    np.save(expected, np.ascontiguousarray(arr), allow_pickle=False)
    assert path.read_bytes() == expected.getvalue()
    assert record.array_info["a"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    np.testing.assert_array_equal(store.get("k").array("a"), arr)


def test_an_array_whose_header_is_over_64_kib_is_refused_and_leaves_nothing(store):
    """A reader takes at most 64 KiB of .npy header (``_read_verified``), so such an array (thousands of
    named fields) is refused when it is put, with a clear error, not stored and then dropped as corrupt."""
    arr = np.zeros(2, dtype=[(f"field_{i:04d}_{'x' * 20}", "u1") for i in range(2500)])
    with pytest.raises(ValueError, match="header needs a format other than 1.0"):
        store.put("k", "run", {}, {"a": arr})
    assert store.get("k") is None and store.list() == []
    assert not any((store.root / "records").rglob("*.npy"))


def test_a_record_that_cannot_be_written_says_so_without_the_stores_path(tmp_path, monkeypatch):
    """A write the disk refuses (here a file where a record's folder would go; a full disk, a locked
    index) raises one error that says nothing was stored and what to check, without the store's path
    (it reaches web pages); nothing half-written stays. It was the bare NotADirectoryError or SQLite's
    OperationalError, which a page could only show as "Something went wrong"."""
    import sqlite3

    from headscope.analysis.store import StoreWriteError

    root = tmp_path / "store"
    s = Store(root)
    s.put("aa-kept", "test", {}, {"a": np.arange(3.0)})
    for i in range(256):
        with contextlib.suppress(FileExistsError, IsADirectoryError):
            (root / "records" / f"{i:02x}").write_text("not a folder")
    with pytest.raises(StoreWriteError) as refused:
        s.put("bb-new", "test", {}, {"a": np.arange(3.0)})
    text = str(refused.value)
    assert "Not a directory" in text and "nothing was stored" in text and str(tmp_path) not in text, text
    assert isinstance(refused.value, OSError)
    assert s.get("bb-new") is None and (s.get("aa-kept").array("a") == np.arange(3.0)).all()

    other = tmp_path / "locked"
    monkeypatch.setattr(Store, "BUSY_TIMEOUT_S", 0.2)
    s2 = Store(other)
    holder = sqlite3.connect(other / "index.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreWriteError, match="locked") as locked:
            s2.put("cc-new", "test", {}, {"a": np.arange(3.0)})
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert str(tmp_path) not in str(locked.value)
    assert not [p for p in (other / "records").rglob("*") if p.is_file()]  # the folder written went again


def test_an_index_error_that_is_a_bug_is_not_reported_as_a_refused_write(tmp_path, monkeypatch):
    """Only what the disk or a lock refuses is a StoreWriteError ("check free space"); an SQL error of
    our own (a missing table, bad SQL) stays itself, so it is logged as the bug it is, and the record's
    folder still goes."""
    import sqlite3

    from headscope.analysis.store import StoreWriteError

    s = Store(tmp_path / "store")

    def broken(self, db, *args):
        db.execute("INSERT INTO no_such_table VALUES (1)")

    monkeypatch.setattr(Store, "_insert", broken)
    with pytest.raises(sqlite3.OperationalError, match="no such table") as raised:
        s.put("dd-new", "test", {}, {"a": np.arange(3.0)})
    assert not isinstance(raised.value, StoreWriteError)
    assert not [p for p in (tmp_path / "store" / "records").rglob("*") if p.is_file()]

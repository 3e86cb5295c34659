"""A read that fails for a passing reason (too many open files, an I/O error, a busy resource) is
reported and keeps the record; only proven damage (a checksum that fails, a file that is missing,
truncated or not a regular file, a header that is not ``.npy``) drops one. Errors are injected at
``os.open`` and at the read itself, and produced for real by a low ``RLIMIT_NOFILE`` in a child
process."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from headscope.analysis.store import Store, StoreReadError

A = np.arange(5000, dtype=np.float32)


def _stored(store: Store, key: str = "ab" * 32) -> str:
    store.put(key, "run", {"text": "kept", "model_name": "m", "n_tokens": 3}, {"a": A, "b": A[:10] * 2})
    return key


def _fail_opening_npy(monkeypatch, code: int) -> None:
    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if str(path).endswith(".npy"):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def _still_there(store: Store, key: str) -> None:
    assert [r.key for r in store.list()] == [key]
    again = store.get(key)
    assert again is not None
    np.testing.assert_array_equal(again.array("a"), A)
    np.testing.assert_array_equal(again.array("b"), A[:10] * 2)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EIO, errno.EAGAIN, errno.EACCES, errno.EINTR,
                                  errno.ENOMEM])
def test_a_failed_open_is_reported_and_the_record_stays(store, monkeypatch, code, caplog):
    key = _stored(store)
    with monkeypatch.context() as m:
        _fail_opening_npy(m, code)
        with pytest.raises(StoreReadError) as raised:
            store.get(key)
    text = str(raised.value)
    assert text.startswith("Could not read the stored run right now: ") and os.strerror(code) in text, text
    assert str(store.root) not in text and "\n" not in text  # it reaches pages and the CLI's one line
    assert "dropped" not in caplog.text
    _still_there(store, key)


class _FailingRead(io.RawIOBase):
    """A file whose reads fail with ``code`` after ``good`` bytes (an I/O error mid-file)."""

    def __init__(self, fd: int, code: int, good: int):
        self.f, self.code, self.good = open(fd, "rb"), code, good

    def fileno(self) -> int:
        return self.f.fileno()

    def readinto(self, b) -> int:
        if self.good <= 0:
            raise OSError(self.code, os.strerror(self.code))
        n = self.f.readinto(memoryview(b)[:self.good])
        self.good -= n
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


@pytest.mark.parametrize("code", [errno.EIO, errno.EAGAIN, errno.EMFILE])
def test_a_read_failing_mid_file_is_reported_and_the_record_stays(store, monkeypatch, code):
    key = _stored(store)
    import headscope.analysis.store as store_module

    with monkeypatch.context() as m:
        m.setattr(store_module, "open", lambda fd, mode="r", *a, **k: _FailingRead(fd, code, 1000), raising=False)
        with pytest.raises(StoreReadError, match=os.strerror(code)):
            store.get(key)
    _still_there(store, key)


def test_a_record_read_later_reports_a_failed_read_and_stays(store, monkeypatch):
    """A record handed over writable (``mmap=False``) is read again when asked again: that read failing
    says so too, and removes nothing."""
    key = _stored(store)
    record = store.get(key)
    record.array("a", mmap=False)
    with monkeypatch.context() as m:
        _fail_opening_npy(m, errno.EMFILE)
        with pytest.raises(StoreReadError):
            record.array("a")
    _still_there(store, key)


def test_proven_damage_still_drops_the_record(store):
    """The other side of the rule: a checksum that fails drops the record (it is recomputed)."""
    key = _stored(store)
    path = store.get(key).folder / "a.npy"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.get(key) is None and store.list() == []


def test_a_transient_error_reaches_the_cli_as_one_line_and_the_run_stays(tmp_path, monkeypatch, capsys):
    from headscope.app.cli import main

    home = tmp_path / "home"
    store = Store(home)
    key = _stored(store)
    store.close()
    with monkeypatch.context() as m:
        _fail_opening_npy(m, errno.EMFILE)
        status = main(["--home", str(home), "compare", key[:12], key[:12]])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "Could not read the stored run right now" in err and "Too many open files" in err
    assert "Traceback" not in err
    _still_there(Store(home), key)


def test_the_app_shows_a_transient_error_as_a_message():
    from headscope.app.errors import USER_ERRORS, guarded

    assert issubclass(StoreReadError, USER_ERRORS)

    @guarded(outputs=1)
    def callback():
        raise StoreReadError("run", OSError(errno.EMFILE, os.strerror(errno.EMFILE)))

    shown = str(callback())
    assert "Could not read the stored run right now" in shown and "Too many open files" in shown


CHILD = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    from headscope.analysis.store import Store, StoreReadError

    store = Store(sys.argv[1])
    key = "cd" * 32
    store.put(key, "run", {"text": "kept"}, {"a": np.arange(5000, dtype=np.float32)})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        store.get(key)
        print("READ")
    except StoreReadError as e:
        print("REPORTED", e)
    seen = []

    def fresh_thread():  # a server thread with no index connection yet: it cannot even open one
        try:
            seen.append(repr(store.get(key)))
        except StoreReadError as e:
            seen.append(str(e))

    import threading
    os.close(held.pop())  # a thread needs no descriptor to start, SQLite needs more than one
    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    print("THREAD", seen[0])
    for fd in held:
        os.close(fd)
    print("LISTED", [r.key == key for r in store.list()])
    print("READ AGAIN", float(store.get(key).array("a").sum()))
""")


def test_too_many_open_files_for_real_keeps_the_run(tmp_path):
    """A process out of file descriptors (as a server under ~170 idle connections was): the read is
    reported, the run stays listed and reads once descriptors are free again."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "home")], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("REPORTED Could not read the stored run right now") and "Too many open files" in lines[0]
    assert lines[1].startswith("THREAD Could not read the stored result right now: the store's index"), lines[1]
    assert lines[2] == "LISTED [True]"
    assert lines[3] == f"READ AGAIN {float(A.sum())}"


# -- the shared copy (Redis) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A throw-away redis-server on a free loopback port (Debian's, which `make setup` installs)."""
    import shutil
    import socket
    import time

    import redis

    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(server):
        pytest.fail("redis-server is missing: `make setup` installs Debian's redis-server")
    folder = tmp_path_factory.mktemp("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.time() < deadline, "redis-server did not start"
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=30)


def test_damage_on_this_disk_keeps_the_good_shared_copy(redis_url, tmp_path, monkeypatch):
    """A record damaged on one disk is dropped there and read again from Redis, not removed from it
    (another process's disk, and Redis, still hold it whole)."""
    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    one, two = Store(tmp_path / "one"), Store(tmp_path / "two")
    key = _stored(one, "ef" * 32)
    path = one.get(key).folder / "a.npy"
    path.write_bytes(path.read_bytes()[:-8])
    again = one.get(key)
    assert again is not None and again.folder != path.parent
    np.testing.assert_array_equal(again.array("a"), A)
    np.testing.assert_array_equal(two.get(key).array("a"), A)


def test_a_transient_failure_with_a_shared_store_removes_nothing(redis_url, tmp_path, monkeypatch):
    import redis

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    store = Store(tmp_path / "one")
    key = _stored(store, "fe" * 32)
    with monkeypatch.context() as m:
        _fail_opening_npy(m, errno.EIO)
        with pytest.raises(StoreReadError, match="Input/output error"):
            store.get(key)
    assert redis.Redis.from_url(redis_url).exists(f"headscope:record:{key}")
    _still_there(store, key)


def test_a_shared_copy_with_an_empty_array_is_not_used(redis_url, tmp_path, monkeypatch):
    """Empty ``.npy`` bytes whose checksum matches (numpy raises EOFError on them): logged, not used."""
    import hashlib
    import json

    import redis

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    key = "0e" * 32
    header = {"kind": "run", "meta": {}, "created": 0.0,
              "arrays": {"a": {"sha256": hashlib.sha256(b"").hexdigest(), "shape": [1], "dtype": "float32"}}}
    client = redis.Redis.from_url(redis_url)
    client.hset(f"headscope:record:{key}", mapping={"header": json.dumps(header), "array:a": b""})
    client.zadd("headscope:records", {key: 0})
    assert Store(tmp_path / "one").get(key) is None

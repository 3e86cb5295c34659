import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from analysis.store import Store, content_key


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
    from analysis.store import Store
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
from analysis.store import Store
s = Store(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
i = 0
while True:  # until killed: replace and add records with a few MB each
    key = f"crash{i % 7}"
    s.put(key, "test", {"i": i}, {"a": np.full(300_000, i, dtype=np.float64), "b": rng.random(1000)})
    i += 1
"""


def test_sigkill_during_writes_leaves_a_consistent_store(tmp_path):
    """Kill a writer with SIGKILL mid-write, several times: every record the index lists either
    verifies and holds one whole write, or is dropped; temporaries are collected; writing goes on."""
    import signal

    root = tmp_path / "killed"
    Store(root)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for attempt, delay in enumerate((0.8, 1.3, 2.1)):
        p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root), str(attempt)], env=env,
                             stderr=subprocess.PIPE)
        time.sleep(delay + 1.0)  # interpreter start, then some writes
        assert p.poll() is None, p.stderr.read().decode()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    s = Store(root)
    listed = s.list()
    assert listed, "the writer stored nothing before it was killed"
    for r in listed:
        full = s.get(r.key)
        if full is None:  # detected as incomplete and dropped: never served
            continue
        a = full.array("a")
        assert a.shape == (300_000,) and (a == full.meta["i"]).all()  # one whole write, not a mix
    s.collect_garbage(older_than_s=0)
    assert not [p for p in (root / "records").glob("*/.tmp-*")]
    s.put("after", "test", {}, {"a": np.zeros(3)})
    assert s.get("after") is not None

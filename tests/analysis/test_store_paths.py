"""The store reads and removes only inside its ``records/`` folder, whatever its index says.

An index row is bytes on a disk: bit rot or a hand edit can make its folder absolute, give it ``..``,
or lead out through a symbolic link. Dropping such a "corrupt" record used to ``rmtree`` the folder
it named. Each test tampers with a real index and checks that a canary folder outside the store
survives every path that reads or removes (get, list, remove, replacing a record, collecting
leftovers, rebuilding the index, writing old records' manifests).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time

import numpy as np
import pytest

from headscope.analysis.store import Store, UnreadableRow

A = np.arange(100, dtype=np.float32)
KEY = "ab" * 32


@pytest.fixture
def outside(tmp_path):
    """A folder outside the store holding a canary and an ``a.npy`` that would pass the checksum."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "canary.txt").write_text("still here")
    return folder


def _index(store: Store, sql: str, *args) -> None:
    store.close()
    db = sqlite3.connect(store.root / "index.sqlite", isolation_level=None)
    db.execute(sql, args)
    db.close()


def _point(store: Store, folder: str, key: str = KEY) -> None:
    _index(store, "UPDATE records SET folder=? WHERE key=?", folder, key)


def _intact(outside) -> None:
    assert (outside / "canary.txt").read_text() == "still here"


def _tampered_rows(store: Store, outside) -> list[str]:
    rel_up = os.path.relpath(outside, store.root)  # ../outside
    return [str(outside), str(outside) + "/", rel_up, f"records/ab/../../{rel_up}", f"records/../{rel_up}",
            f"records/ab/{KEY}-x/../../../{rel_up}", "records/ab/./../../" + rel_up, "/etc", "records", "records/ab",
            "", "records/ab/a/b"]


def test_every_tampered_folder_is_dropped_without_touching_it(tmp_path, outside):
    """Damaged or not, a row naming a folder outside ``records/`` is never read nor removed: get
    drops the row (it is damage), answers None, and the canary stays."""
    tried = 0
    for bad in _tampered_rows(Store(tmp_path / "probe"), outside):
        store = Store(tmp_path / f"home{tried}")
        store.put(KEY, "run", {"n": 1}, {"a": A})
        store.put("cd" * 32, "run", {"n": 2}, {"a": A})
        _point(store, bad)
        assert store.get(KEY) is None, bad
        _intact(outside)
        assert [r.key for r in store.list()] == ["cd" * 32], bad
        np.testing.assert_array_equal(store.get("cd" * 32).array("a"), A)
        tried += 1
    assert tried == 12


def test_a_matching_file_outside_is_never_served(tmp_path, outside):
    store = Store(tmp_path / "home")
    record = store.put(KEY, "run", {"n": 1}, {"a": A})
    shutil.copy(record.folder / "a.npy", outside / "a.npy")  # would pass its checksum
    _point(store, str(outside))
    assert store.get(KEY) is None
    assert (outside / "a.npy").exists()
    _intact(outside)


def test_remove_and_replace_never_remove_a_folder_outside(tmp_path, outside):
    store = Store(tmp_path / "home")
    store.put(KEY, "run", {"n": 1}, {"a": A})
    _point(store, str(outside))
    assert store.remove(KEY)  # `headscope runs rm`: the row goes, the folder it named stays
    _intact(outside)
    store.put(KEY, "run", {"n": 1}, {"a": A})
    _point(store, "records/../../outside")
    store.put(KEY, "run", {"n": 2}, {"a": A})  # replacing a record removes its old folder: not this one
    _intact(outside)
    assert store.get(KEY).meta == {"n": 2}


@pytest.mark.parametrize("link", ["folder", "shard"])
def test_a_symbolic_link_leading_out_is_never_followed(tmp_path, outside, link):
    """A record folder (``records/ab/<key>-x``) or a whole shard (``records/zz``) replaced by a link to
    a folder outside: reading drops the row, removing leaves the target, and collecting leftovers
    removes at most the link itself."""
    store = Store(tmp_path / "home")
    record = store.put(KEY, "run", {"n": 1}, {"a": A})
    shutil.copy(record.folder / "a.npy", outside / "a.npy")
    (outside / "victim").mkdir()
    (outside / "victim" / "data.txt").write_text("keep")
    if link == "folder":
        shutil.rmtree(record.folder)
        record.folder.symlink_to(outside, target_is_directory=True)
        rel = str(record.folder.relative_to(store.root))
    else:
        (store.root / "records" / "zz").symlink_to(outside, target_is_directory=True)
        rel = "records/zz/victim"
        _point(store, rel)
    assert store.get(KEY) is None
    _intact(outside)
    assert (outside / "a.npy").exists() and (outside / "victim" / "data.txt").read_text() == "keep"
    old = time.time() - 3 * 3600
    for path in (outside, outside / "victim", outside / "canary.txt"):
        os.utime(path, (old, old))
    reopened = Store(tmp_path / "home")  # collects leftovers
    reopened.collect_garbage(older_than_s=0)
    _intact(outside)
    assert (outside / "victim" / "data.txt").read_text() == "keep"


def test_a_rebuilt_index_never_takes_in_a_folder_outside(tmp_path, outside):
    """A shard linked to a folder outside holding a record folder with a valid manifest: a rebuild
    of the index (here: a garbled index) leaves it out and removes nothing there."""
    store = Store(tmp_path / "home")
    record = store.put(KEY, "run", {"n": 1}, {"a": A})
    store.put("cd" * 32, "run", {"n": 2}, {"a": A})
    shutil.copytree(record.folder, outside / record.folder.name)
    store.remove(KEY)
    (store.root / "records" / "ab").rmdir()
    (store.root / "records" / "ab").symlink_to(outside, target_is_directory=True)
    store.close()
    (store.root / "index.sqlite").write_bytes(b"garbage" * 100)
    for suffix in ("-wal", "-shm"):
        (store.root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    rebuilt = Store(tmp_path / "home")
    assert [r.key for r in rebuilt.list()] == ["cd" * 32]
    assert rebuilt.get(KEY) is None
    _intact(outside)
    assert (outside / record.folder.name / "a.npy").exists()


def test_manifests_of_old_records_are_never_written_outside(tmp_path, outside):
    """Opening a store written before manifests existed writes each record's manifest into its
    folder: never into a folder outside that a row names."""
    store = Store(tmp_path / "home")
    store.put(KEY, "run", {"n": 1}, {"a": A})
    _point(store, str(outside))
    _index(store, "PRAGMA user_version=0")
    Store(tmp_path / "home")
    assert sorted(p.name for p in outside.iterdir()) == ["canary.txt"]


def test_an_array_name_that_is_a_path_is_refused(tmp_path, outside):
    store = Store(tmp_path / "home")
    record = store.put(KEY, "run", {"n": 1}, {"a": A})
    shutil.copy(record.folder / "a.npy", outside / "a.npy")
    up = os.path.relpath(outside / "a", record.folder)
    _index(store, "UPDATE arrays SET name=? WHERE key=?", up, KEY)
    assert store.get(KEY) is None
    assert (outside / "a.npy").exists()
    _intact(outside)


def test_a_pipe_for_a_manifest_never_hangs_a_rebuild(tmp_path):
    """A rebuild reads every manifest: a pipe in a manifest's place is damage, not a wait for a writer."""
    import subprocess
    import sys
    import textwrap

    store = Store(tmp_path / "home")
    record = store.put(KEY, "run", {"n": 1}, {"a": A})
    store.put("cd" * 32, "run", {"n": 2}, {"a": A})
    (record.folder / "record.json").unlink()
    os.mkfifo(record.folder / "record.json")
    store.close()
    (store.root / "index.sqlite").write_bytes(b"garbage" * 100)
    child = textwrap.dedent("""
        import sys
        from headscope.analysis.store import Store
        print([r.key[:4] for r in Store(sys.argv[1]).list()])
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "home")], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['cdcd']"


# -- item 9: a row whose metadata rotted is reported and skipped; the others are listed ---------------


BAD_META = ["{}", "not json", "[1, 2]", "null", '"text"', "42", "[" * 100_000, "\x00\xff", b"\xff\xfe", "NaN"]


@pytest.mark.parametrize("meta", BAD_META, ids=range(len(BAD_META)))
def test_a_row_with_bad_metadata_is_skipped_and_reported_by_list(tmp_path, meta):
    store = Store(tmp_path / "home")
    store.put(KEY, "run", {"n": 1}, {"a": A})
    store.put("cd" * 32, "run", {"n": 2}, {"a": A})
    _index(store, "UPDATE records SET meta=? WHERE key=?", meta, KEY)
    skipped: list[UnreadableRow] = []
    listed = store.list(skipped=skipped)
    if meta == "{}":  # a JSON object: the store lists it; what a run needs is checked by analysis.runs
        assert sorted(r.key for r in listed) == sorted([KEY, "cd" * 32]) and not skipped
        return
    assert [r.key for r in listed] == ["cd" * 32]
    assert [s.key for s in skipped] == [KEY] and "\n" not in skipped[0].reason
    assert store.get(KEY) is None  # read by key, the damaged row is dropped (recomputed on demand)
    assert [r.key for r in store.list()] == ["cd" * 32]


@pytest.mark.parametrize("column, value", [("created", "yesterday"), ("created", b"\x00"), ("kind", b"\xff"),
                                           ("folder", 12)])
def test_a_row_with_fields_of_the_wrong_type_is_skipped(tmp_path, column, value):
    store = Store(tmp_path / "home")
    store.put(KEY, "run", {"n": 1}, {"a": A})
    store.put("cd" * 32, "run", {"n": 2}, {"a": A})
    _index(store, f"UPDATE records SET {column}=? WHERE key=?", value, KEY)
    skipped: list[UnreadableRow] = []
    assert [r.key for r in store.list(skipped=skipped)] == ["cd" * 32]
    assert [s.key for s in skipped] == [KEY]
    json.dumps([s.reason for s in skipped])


@pytest.mark.parametrize("key", ["../../outside/x", "/tmp/x", "..", "a/b", "", "x" * 129, "k\n", "ké"])
def test_a_key_that_is_a_path_is_refused_before_anything_is_written(tmp_path, outside, key):
    store = Store(tmp_path / "home")
    with pytest.raises(ValueError, match="record key"):
        store.put(key, "run", {}, {"a": A})
    assert not [p for p in (tmp_path / "home" / "records").rglob("*")]
    assert sorted(p.name for p in outside.iterdir()) == ["canary.txt"]

"""analysis/stored_results.py: a record read back only as the kind asked for, a stored result found before
any work (with its progress done), and a link's short id that names one stored result or none."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import loaded_by_prefix, stored_record, stored_result


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "home")
    s.put(content_key("a"), "head_means", {"n": 1}, {"mean": np.arange(3, dtype=np.float32)})
    s.put(content_key("b"), "patching", {"n": 2}, {})
    return s


def test_a_record_is_read_back_only_as_its_own_kind(store):
    record = stored_record(store, content_key("a"), "head_means")
    assert record is not None and record.meta == {"n": 1}
    assert record.array("mean").tolist() == [0, 1, 2]
    assert stored_record(store, content_key("a"), "patching") is None  # another kind under that key
    assert stored_record(store, content_key("nothing"), "head_means") is None


@pytest.mark.parametrize("key", ["", "0" * 64, "not a key", None, 12, content_key("a")[:16], content_key("a").upper(),
                                 "../" + content_key("a"), content_key("a") + "\x00"])
def test_a_hostile_key_finds_no_record(store, key):
    assert stored_record(store, key, "head_means") is None


def _load_n(store, key):
    record = stored_record(store, key, "head_means")
    return None if record is None else record.meta["n"]


def test_a_stored_result_is_found_before_any_work_and_its_progress_is_done(store):
    heard = []
    assert stored_result(store, content_key("a"), _load_n, heard.append) == 1
    assert heard == [1.0]


def test_nothing_stored_means_compute_and_no_progress_yet(store):
    heard = []
    assert stored_result(store, content_key("b"), _load_n, heard.append) is None  # a patching, not head means
    assert stored_result(store, content_key("c"), _load_n, heard.append) is None
    assert stored_result(store, content_key("a"), _load_n) == 1  # no progress to tell
    assert heard == []


def test_without_a_store_nothing_is_looked_up():
    def load(_store, _key):
        raise AssertionError("looked up without a store")

    heard = []
    assert stored_result(None, content_key("a"), load, heard.append) is None
    assert heard == []


def test_a_short_id_names_one_stored_result_or_none(store):
    key = content_key("a")
    assert loaded_by_prefix(store, key[:8], _load_n) == (key, 1)
    assert loaded_by_prefix(store, key, _load_n) == (key, 1)
    assert loaded_by_prefix(store, content_key("b")[:8], _load_n) is None  # stored, but not that kind
    store.put(key[:10] + "f" * 54, "head_means", {"n": 3}, {})  # a second key with the same first 10 digits
    assert loaded_by_prefix(store, key[:10], _load_n) is None  # ambiguous
    assert loaded_by_prefix(store, key[:11], _load_n) == (key, 1)


@pytest.mark.parametrize("prefix", [None, "", " ", "%", "_", "*", "zz", "0x" + "a" * 8, "a" * 65, "\udcff", 7.5, 0,
                                    False, "' OR 1=1 --"])
def test_a_hostile_short_id_names_nothing(store, prefix):
    assert loaded_by_prefix(store, prefix, _load_n) is None

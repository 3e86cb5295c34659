"""Reading results back from the store: a record of the kind asked for, a result stored before any work
starts, and the one result a link's short id names.

Every analysis that stores its result begins the same way: it computes its content key, returns what
the store holds under it (telling ``progress`` the work is done), and only then computes. It ends by
storing, under conditions of its own (only a complete result, after a hook, ...), so the ending stays
with each analysis. A record is read back only as the kind its reader expects: a key made by
:func:`headscope.analysis.store.content_key` names one request, and a record of another kind under it is
not that request's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from headscope.analysis.store import Record, Store

T = TypeVar("T")


def stored_record(store: Store, key: Any, kind: str) -> Record | None:
    """The record under ``key`` when it is a ``kind`` record; None when there is none, or one of another kind.

    Parameters
    ----------
    store : the store to read.
    key : a full content key (anything else finds nothing).
    kind : the record kind its writer stored it as, e.g. ``"head_means"``.
    """
    record = store.get(key)
    return record if record is not None and record.kind == kind else None


def stored_result(store: Store | None, key: str, load: Callable[[Store, str], T | None],
                  progress: Callable[[float], None] | None = None) -> T | None:
    """What ``load(store, key)`` reads, where a store is given and holds it; None when it must be computed.

    A result found is all the work there is: ``progress`` then hears 1.0. Without a store nothing is read.
    Used as ``if (stored := stored_result(store, key, load_run, progress)) is not None: return stored``.
    """
    if store is None:
        return None
    found = load(store, key)
    if found is not None and progress:
        progress(1.0)
    return found


def loaded_by_prefix(store: Store, prefix: Any, load: Callable[[Store, str], T | None]) -> tuple[str, T] | None:
    """``(key, load(store, key))`` for the one stored key starting with ``prefix`` (a link's short id);
    None when ``prefix`` is empty, no key or several start with it (:meth:`headscope.analysis.store.Store.find`),
    or ``load`` reads nothing there."""
    keys = store.find(str(prefix)) if prefix else []
    found = load(store, keys[0]) if len(keys) == 1 else None
    return None if found is None else (keys[0], found)

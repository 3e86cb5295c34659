"""Store records shared through Redis, so processes on different disks see one store.

With ``HEADSCOPE_REDIS_URL`` set, headscope's web front end and its Celery workers may each have
their own ``HEADSCOPE_HOME``. Every record a :class:`headscope.analysis.store.Store` writes is also written
here (write-through), and a key the local store lacks is looked up here and copied into the local
store (read-through), so a sweep computed by one worker is found by another worker and after a
reload, whichever disk each process has.

One Redis hash per record: ``header`` (kind, metadata, creation time, each array's sha256, shape
and dtype, as JSON) and ``array:<name>`` (the array's ``.npy`` bytes, read back with
``allow_pickle=False`` after its sha256 is checked). A sorted set of keys answers prefix look-ups
(the short ids in links).

Limits: a record whose arrays exceed ``HEADSCOPE_SHARED_RECORD_MB`` (default 128) stays on the disk
that made it (a 512-token run's float16 patterns are 140 MB); processes that need such records must
share ``HEADSCOPE_HOME`` (or compute them again). Shared copies expire after
``HEADSCOPE_SHARED_RECORD_TTL_S`` (default 7 days); local copies stay. If Redis cannot be reached,
the local store keeps working and a warning is logged.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

RECORD = "headscope:record:"
KEYS = "headscope:records"


def _number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


class SharedRecords:
    """Records in one Redis database: :meth:`publish`, :meth:`fetch`, :meth:`find`, :meth:`remove`."""

    def __init__(self, url: str, max_bytes: int, ttl_s: int):
        import redis

        self.url = url
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)

    @classmethod
    def from_env(cls) -> SharedRecords | None:
        """Shared records on ``HEADSCOPE_REDIS_URL``, or None when it is not set (embedded mode)."""
        url = os.environ.get("HEADSCOPE_REDIS_URL", "").strip()
        if not url:
            return None
        return cls(url, int(_number("HEADSCOPE_SHARED_RECORD_MB", 128) * 2**20),
                   int(_number("HEADSCOPE_SHARED_RECORD_TTL_S", 7 * 24 * 3600)))

    def publish(self, key: str, kind: str, meta_json: str, created: float, folder: Path,
                info: dict[str, dict[str, Any]]) -> bool:
        """Copy one committed record (its ``.npy`` files in ``folder``) to Redis; False if too large."""
        total = sum(int(i["nbytes"]) for i in info.values())
        if total > self.max_bytes:
            log.info("record %s (%d MB) is over HEADSCOPE_SHARED_RECORD_MB: kept on this disk only",
                     key[:12], total >> 20)
            return False
        header = {"kind": kind, "meta": json.loads(meta_json), "created": created,
                  "arrays": {n: {"sha256": i["sha256"], "shape": i["shape"], "dtype": i["dtype"]}
                             for n, i in info.items()}}
        fields: dict[str, bytes] = {"header": json.dumps(header).encode()}
        try:  # read inside: another writer of the same key may have replaced (removed) this folder
            for name in info:
                fields[f"array:{name}"] = (folder / f"{name}.npy").read_bytes()
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(RECORD + key)
            pipe.hset(RECORD + key, mapping=fields)
            pipe.expire(RECORD + key, self.ttl_s)
            pipe.zadd(KEYS, {key: 0})
            pipe.execute()
        except Exception as e:  # the local store still has it
            log.warning("could not share record %s through Redis: %s", key[:12], e)
            return False
        return True

    def fetch(self, key: str) -> tuple[str, dict[str, Any], dict[str, np.ndarray]] | None:
        """(kind, meta, arrays) of a shared record, or None if absent, expired or failing a checksum."""
        try:
            fields = self.client.hgetall(RECORD + key)
        except Exception as e:
            log.warning("could not read record %s from Redis: %s", key[:12], e)
            return None
        if not fields or b"header" not in fields:
            return None
        try:
            header = json.loads(fields[b"header"])
            arrays = {}
            for name, info in header["arrays"].items():
                data = fields.get(f"array:{name}".encode())  # immutable bytes: hashed, then parsed
                if data is None or hashlib.sha256(data).hexdigest() != info["sha256"]:
                    log.warning("shared record %s: array %s is missing or fails its checksum", key[:12], name)
                    return None
                arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
            return str(header["kind"]), dict(header["meta"]), arrays
        except (ValueError, KeyError, TypeError, AttributeError, EOFError, RecursionError) as e:
            # a malformed header or .npy (an empty one: EOFError), or a pickle
            log.warning("shared record %s is malformed (%s): not used", key[:12], e)
            return None

    def find(self, prefix: str) -> list[str]:
        """Shared keys starting with ``prefix`` (expired ones left out)."""
        try:
            keys = [k.decode() for k in self.client.zrangebylex(KEYS, f"[{prefix}", f"[{prefix}\xff")]
            if not keys:
                return []
            alive = self.client.pipeline(transaction=False)
            for k in keys:
                alive.exists(RECORD + k)
            live = alive.execute()
        except Exception as e:
            log.warning("could not look up records in Redis: %s", e)
            return []
        stale = [k for k, ok in zip(keys, live, strict=True) if not ok]
        if stale:
            self.client.zrem(KEYS, *stale)
        return [k for k, ok in zip(keys, live, strict=True) if ok]

    def remove(self, key: str) -> None:
        try:
            self.client.delete(RECORD + key)
            self.client.zrem(KEYS, key)
        except Exception as e:
            log.warning("could not remove record %s from Redis: %s", key[:12], e)

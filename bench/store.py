"""What verified reads cost: a 512-token run's patterns record, old memory-map path vs read-and-verify.

The record has the shape a 512-token run of the embedded model stores (30 layers × 9 heads × 512 × 512
float16 = 142 MB, random values; the bytes, not their meaning, set the cost). Both paths read the same
file from a warm page cache, in this process:

- old (baseline): sha256 of the file once (then a (path, size, mtime) stamp skips it), then
  ``np.load(mmap_mode="r")`` — what ``analysis/store.py`` did before: fast, but a file changed later
  is served changed, and a truncated one kills the process with SIGBUS;
- new: ``Store.get`` — read the file into memory, sha256 of exactly those bytes, parse: every read.

"+ use" rows touch every value once (a sum), as a view over all heads does. Peak memory is what
tracemalloc saw allocated (a memory map's pages are not allocations; they are page cache).

    .venv/bin/python bench/store.py [--tokens 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headscope.analysis.store import Store  # noqa: E402

_stamps: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def old_get(path: Path, sha256: str) -> np.ndarray:
    """The pre-change read path: verify once per (path, size, mtime), then memory-map."""
    st = path.stat()
    stamp = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        known = _stamps.get(stamp) == sha256
    if not known:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        assert h.hexdigest() == sha256
        with _lock:
            _stamps[stamp] = sha256
    return np.load(path, mmap_mode="r", allow_pickle=False)


def measure(fn, repeat: int) -> tuple[float, float]:
    """(median seconds, peak MB allocated) over ``repeat`` calls."""
    times, peaks = [], []
    for _ in range(repeat):
        tracemalloc.start()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
        tracemalloc.stop()
    return statistics.median(times), max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.tokens
    rng = np.random.default_rng(0)
    patterns = rng.random((30, 9, n, n), dtype=np.float32).astype(np.float16)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store", shared=False)
        record = store.put("ab" * 32, "run", {"n_tokens": n}, {"patterns": patterns})
        path = record.folder / "patterns.npy"
        sha = record.array_info["patterns"]["sha256"]
        mb = path.stat().st_size / 2**20
        path.read_bytes()  # warm the page cache for both paths

        def old_first():
            _stamps.clear()
            old_get(path, sha)

        rows = [
            ("old: first read (sha256 + mmap)", old_first),
            ("old: later reads (stat + mmap)", lambda: old_get(path, sha)),
            ("old: later read + use", lambda: float(old_get(path, sha).sum(dtype=np.float32))),
            ("new: every read (read + sha256)", lambda: store.get("ab" * 32).array("patterns")),
            ("new: every read + use", lambda: float(store.get("ab" * 32).array("patterns").sum(dtype=np.float32))),
        ]
        results = [(what, *measure(fn, args.repeat)) for what, fn in rows]
        assert np.array_equal(store.get("ab" * 32).array("patterns"), old_get(path, sha))
    base = results[0][1]
    print(f"patterns record of a {n}-token run: {mb:.1f} MB on disk, median of {args.repeat}")
    print(f"{'what':<36} {'size MB':>8} {'time ms':>9} {'peak MB':>8} {'ratio':>7}")
    for what, seconds, peak in results:
        print(f"{what:<36} {mb:>8.1f} {seconds * 1e3:>9.1f} {peak:>8.1f} {seconds / base:>7.2f}")


if __name__ == "__main__":
    main()

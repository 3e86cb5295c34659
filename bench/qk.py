"""Time and memory to collect one head's queries and keys and embed them (PCA, UMAP, t-SNE).

One run, one table: for about 2,000 / 4,000 / 8,000 points (queries + keys of one head over whole
probe sentences of ``data/probes/sentences.txt``), the time and peak memory of

- collecting the layer (forward passes, cold store) and loading it again from the store,
- PCA, the baseline of every ratio,
- UMAP cold: a fresh Python process (import + numba compilation + the fit), reported as a whole
  and as its first fit alone,
- UMAP warm: in this process, after :func:`headscope.analysis.joint_embedding.warm_up_umap`,
- t-SNE (scikit-learn Barnes-Hut, one thread, 500 iterations).

Peak memory: tracemalloc's peak of traced allocations (numpy, Python) in this process, or the child
process's maximum RSS for cold UMAP. Targets: PCA ≤ 0.5 s, warm UMAP over ~4,000 points ≤ 10 s.

    .venv/bin/python bench/qk.py [--layer 1 --head 2 --sizes 2000,4000,8000 --no-tsne]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COLD_UMAP = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import numpy as np
from headscope.analysis.joint_embedding import project
x = np.load(sys.argv[1])
t1 = time.perf_counter()
project(x, "umap", seed=0)
t2 = time.perf_counter()
print(json.dumps({"total": t2 - t0, "fit": t2 - t1, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def timed(fn):
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, seconds, peak / 2**20


def cold_umap(points: np.ndarray) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "points.npy"
        np.save(path, points)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        out = subprocess.run([sys.executable, "-c", COLD_UMAP, str(path)], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--head", type=int, default=2)
    parser.add_argument("--sizes", default="2000,4000,8000", help="approximate point counts")
    parser.add_argument("--no-tsne", action="store_true")
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-process UMAP runs")
    args = parser.parse_args()

    from headscope.analysis.joint_embedding import normalise_qk, project, warm_up_umap
    from headscope.analysis.models import load_model
    from headscope.analysis.qk_collect import collect_layer, load_sentences
    from headscope.analysis.store import Store

    model = load_model(args.model)
    sentences = load_sentences()
    rows: list[tuple[str, int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        qk, t_collect, m_collect = timed(lambda: collect_layer(model, sentences, args.layer, store=store))
        _, t_load, m_load = timed(lambda: collect_layer(model, sentences, args.layer, store=store))
    head = qk.head(args.head)
    rows.append((f"collect layer {args.layer} (forward, {len(sentences)} sentences)", head.n_points, t_collect, m_collect))
    rows.append(("collect again (from the store)", head.n_points, t_load, m_load))

    _, t_warm, m_warm = timed(lambda: warm_up_umap())
    rows.append(("UMAP warm-up (compile, 300 points)", 300, t_warm, m_warm))

    lengths = np.diff(head.offsets)
    results = []
    for target in [int(s) for s in args.sizes.split(",")]:
        n_sent = int(np.searchsorted(np.cumsum(2 * lengths), target) + 1)
        sub = head.subset(range(min(n_sent, len(lengths))))
        joint = normalise_qk(sub.q, sub.k)
        x = joint.points
        n = len(x)
        _, t_pca, m_pca = timed(lambda x=x: project(x, "pca"))
        case = [("PCA", t_pca, m_pca)]
        if not args.no_cold:
            c = cold_umap(x)
            case.append(("UMAP cold (fresh process: import + compile + fit)", c["total"], c["rss_mb"]))
            case.append(("UMAP cold, first fit alone", c["fit"], float("nan")))
        _, t_umap, m_umap = timed(lambda x=x: project(x, "umap", seed=0))
        case.append(("UMAP warm", t_umap, m_umap))
        if not args.no_tsne:
            _, t_tsne, m_tsne = timed(lambda x=x: project(x, "tsne", seed=0))
            case.append(("t-SNE (500 iterations)", t_tsne, m_tsne))
        results.append((n, t_pca, case))
        for what, t, _ in case:
            print(f"  {n:>6} points  {what:<52} {t:8.2f} s", flush=True)

    print(f"\nQK bench: {args.model}, layer {args.layer} head {args.head}, d_head {head.d_head}, "
          f"{os.cpu_count()} CPUs\n")
    print(f"{'what':<56} {'points':>7} {'time (s)':>9} {'peak MB':>8} {'× PCA':>8}")
    print("-" * 92)
    for what, n, t, m in rows:
        print(f"{what:<56} {n:>7} {t:>9.3f} {m:>8.1f} {'':>8}")
    for n, t_pca, case in results:
        print("-" * 92)
        for what, t, m in case:
            ratio = t / t_pca if t_pca > 0 else float("nan")
            mem = f"{m:>8.1f}" if m == m else f"{'':>8}"
            print(f"{what:<56} {n:>7} {t:>9.3f} {mem} {ratio:>8.1f}")


if __name__ == "__main__":
    main()

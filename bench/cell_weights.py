"""Listed attention cells (statistics mode's duplicate-token and induction scores): tiles against dots.

Statistics mode never builds a pattern; the duplicate-token and induction scores read the weights
of their detection cells (``t_j = t_i``, ``j < i``, and those cells one key right) from the lse
(:func:`analysis.attention_statistics.cell_weights`). A repetitive text has many: the passkey
haystack of the needle-in-a-haystack page (the paper's "The grass is green..." filler) lists about
121,000 cells at 1,200 tokens and 1.4 million at 4,096. Until 2026-12-03 every cell gathered its
query and key vectors and took a dot product (memory-bound, a repeated copy of the keys per query
head); now the 64 × 64 tiles of the (query, key) plane that hold at least 128 listed cells are one
matrix product per row of tiles, and only lone cells take the old path.

Part 1: the two paths on random q/k of SmolLM2's shape (9 query heads, 3 KV heads, d = 64) over the
passkey prompt's real cells, one torch thread as the page's job runs; the old path is the same
function with no tile dense (``dense_at`` above any count). Part 2: the whole statistics-mode run of
the 1,200-token passkey text on the embedded model, old path and new, and the largest difference of
the two runs' duplicate-token and induction scores.

    .venv/bin/python bench/cell_weights.py [--sizes 1200,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1200,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from analysis import attention_statistics as mod
    from analysis.models import load_model
    from analysis.niah import named_haystack
    from analysis.statistics_run import capture_statistics, detection_cells, statistics_score

    torch.set_num_threads(1)
    model = load_model("smollm2-135m")
    text = named_haystack("passkey")
    ids_all = model.encode(text * 4)
    never = 1 << 62
    print(f"{'tokens':>6} | {'cells':>9} | {'in dense tiles':>14} | {'dots s':>7} | {'tiles s':>7} | {'ratio':>5} | max |diff|")
    for n in (int(s) for s in args.sizes.split(",")):
        ids = ids_all[:n]
        dup_rows, dup_keys = detection_cells(ids)  # and the induction cells, one key right, as a run lists them
        rows = torch.from_numpy(np.concatenate([dup_rows, dup_rows]))
        keys = torch.from_numpy(np.concatenate([dup_keys, dup_keys + 1]))
        g = torch.Generator().manual_seed(n)
        q, k = torch.randn(1, 9, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
        lse = torch.full((1, 9, n), 8.0)
        tile = mod.CELL_TILE
        tile_of = (rows // tile) * (-(-n // tile)) + keys // tile
        _, which, counts = torch.unique(tile_of, return_inverse=True, return_counts=True)
        dense_share = float((counts[which] >= tile * tile // 32).float().mean())
        old, new = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            a = mod.cell_weights(q, k, lse, 0.125, rows, keys, dense_at=never)
            old.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = mod.cell_weights(q, k, lse, 0.125, rows, keys)
            new.append(time.perf_counter() - t)
        diff = float(((a - b).abs() / a.abs().clamp(min=1e-30)).max())
        x, y = statistics.median(old), statistics.median(new)
        print(f"{n:>6} | {rows.numel():>9,} | {dense_share:>13.1%} | {x:>7.2f} | {y:>7.3f} | {x / y:>4.0f}× | {diff:.1e} (relative)")

    ids = ids_all[:1200]
    original = mod.cell_weights
    runs, times = {}, {}
    for name, fn in (("dots", partial(original, dense_at=never)), ("tiles", original)):
        mod.cell_weights = fn
        t = time.perf_counter()
        runs[name] = capture_statistics(model, ids)
        times[name] = time.perf_counter() - t
    mod.cell_weights = original
    worst = max(float(abs(statistics_score(runs["dots"], s) - statistics_score(runs["tiles"], s)).max())
                for s in ("duplicate_token", "induction"))
    print(f"statistics-mode run of 1,200 passkey tokens, embedded model, one thread: dots {times['dots']:.1f} s, "
          f"tiles {times['tiles']:.1f} s ({times['dots'] / times['tiles']:.1f}×); "
          f"largest score difference {worst:.1e}")


if __name__ == "__main__":
    main()

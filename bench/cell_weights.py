"""Listed attention cells (statistics mode's duplicate-token and induction scores): SDDMM against dots.

Statistics mode never builds a pattern; the duplicate-token and induction scores read the weights
of their detection cells (``t_j = t_i``, ``j < i``, and those cells one key right) from the lse
(:func:`headscope.analysis.attention_statistics.cell_weights`). A repetitive text has many: the passkey
haystack of the needle-in-a-haystack page (the paper's "The grass is green..." filler) lists about
121,000 cells at 1,200 tokens and 1.4 million at 4,096. Until 2026-12-03 every cell gathered its
query and key vectors (the keys repeated for each query head of their group) and took a dot
product; now torch's sampled dense product (``torch.sparse.sampled_addmm``) computes each head's
scores at the cells.

Part 1: the code before (``cell_weights_before`` below, as it was in analysis/attention_statistics.py
at 7c77195) and now, on random q/k of SmolLM2's shape (9 query heads, 3 KV heads, d = 64) over the
passkey prompt's real cells, one torch thread. Part 2: the whole statistics-mode run of the
1,200-token passkey text on the embedded model with the code before and now, and the largest
difference of the two runs' duplicate-token and induction scores.

    .venv/bin/python bench/cell_weights.py [--sizes 1200,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cell_weights_before(q, k, lse, scale, rows, keys, chunk=1 << 14, softcap=None, window=0):
    """headscope.analysis.attention_statistics.cell_weights at 7c77195 (the baseline): every cell gathers its
    query and its key, repeated for each query head of the key's group, and takes a dot product."""
    import torch

    b, h, n_q, _ = q.shape
    group = h // k.shape[1]
    offset = k.shape[-2] - n_q
    out = torch.empty(b, h, rows.numel(), dtype=torch.float32, device=q.device)
    rows, keys = rows.to(q.device), keys.to(q.device)
    for a in range(0, rows.numel(), chunk):
        r, c = rows[a : a + chunk], keys[a : a + chunk]
        qr = q[:, :, r].float()
        kc = k[:, :, c].float().repeat_interleave(group, dim=1)
        s = (qr * kc).sum(-1) * scale
        s = s if softcap is None else softcap * torch.tanh(s / softcap)
        w = torch.exp(s - lse[:, :, r])
        if window:
            w = torch.where(c > r + offset - window, w, torch.zeros((), device=q.device))
        out[:, :, a : a + chunk] = w
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1200,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from headscope.analysis import attention_statistics as mod
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import named_haystack
    from headscope.analysis.statistics_run import capture_statistics, detection_cells, statistics_score

    torch.set_num_threads(1)
    model = load_model("smollm2-135m")
    text = named_haystack("passkey")
    ids_all = model.encode(text * 4)
    print(f"{'tokens':>6} | {'cells':>9} | {'before s':>8} | {'now s':>6} | {'ratio':>5} | max |diff| (relative)")
    for n in (int(s) for s in args.sizes.split(",")):
        ids = ids_all[:n]
        dup_rows, dup_keys = detection_cells(ids)  # and the induction cells, one key right, as a run lists them
        rows = torch.from_numpy(np.concatenate([dup_rows, dup_rows]))
        keys = torch.from_numpy(np.concatenate([dup_keys, dup_keys + 1]))
        g = torch.Generator().manual_seed(n)
        q, k = torch.randn(1, 9, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
        lse = torch.full((1, 9, n), 8.0)
        times = {"before": [], "now": []}
        for _ in range(args.repeats):
            for name, fn in (("before", cell_weights_before), ("now", mod.cell_weights)):
                t = time.perf_counter()
                got = fn(q, k, lse, 0.125, rows, keys)
                times[name].append(time.perf_counter() - t)
                if name == "before":
                    a = got
            b = got
        diff = float(((a - b).abs() / a.abs().clamp(min=1e-30)).max())
        x, y = (statistics.median(times[name]) for name in ("before", "now"))
        print(f"{n:>6} | {rows.numel():>9,} | {x:>8.2f} | {y:>6.3f} | {x / y:>4.0f}× | {diff:.1e}")

    ids = ids_all[:1200]
    original = mod.cell_weights
    runs, times = {}, {}
    for name, fn in (("before", cell_weights_before), ("now", original)):
        mod.cell_weights = fn
        t = time.perf_counter()
        runs[name] = capture_statistics(model, ids)
        times[name] = time.perf_counter() - t
    mod.cell_weights = original
    worst = max(float(abs(statistics_score(runs["before"], s) - statistics_score(runs["now"], s)).max())
                for s in ("duplicate_token", "induction"))
    print(f"statistics-mode run of 1,200 passkey tokens, embedded model, one thread: before {times['before']:.1f} s, "
          f"now {times['now']:.1f} s ({times['before'] / times['now']:.1f}×); largest score difference {worst:.1e}")


if __name__ == "__main__":
    main()

"""Rounding a layer's attention pattern to the stored float16: numpy's cast against torch's.

A run keeps every layer's pattern ``[head, N, N]`` as float16 (analysis/capture.py). Until
2026-12-03 each layer was handed to numpy as float32 and cast by the assignment into the float16
array, a scalar loop in numpy; now torch rounds it (vectorised) and numpy copies it. Both round to
nearest even: the table says whether the two results are identical, bit for bit, on softmax rows of
a SmolLM2-sized layer (9 heads), and how long each takes per layer, on one torch thread as the page's
job runs. Then the whole capture of a text of about 515 tokens on the embedded model (the new path),
for scale: 30 layers × the old per-layer cost is what the old path added.

    .venv/bin/python bench/pattern_cast.py [--sizes 128,512,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"{'tokens':>6} | {'numpy cast ms':>13} | {'torch cast ms':>13} | {'ratio':>6} | identical")
    for n in (int(s) for s in args.sizes.split(",")):
        g = torch.Generator().manual_seed(n)
        scores = torch.randn(9, n, n, generator=g) * 4
        layer = torch.softmax(scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1)
        out = np.empty((9, n, n), dtype=np.float16)
        old, new = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out[...] = layer.numpy()  # the old path: numpy casts float32 → float16
            old.append(time.perf_counter() - t)
            by_numpy = out.copy()
            t = time.perf_counter()
            out[...] = layer.to(torch.float16).numpy()  # the new path: torch rounds, numpy copies
            new.append(time.perf_counter() - t)
        same = np.array_equal(by_numpy.view(np.uint16), out.view(np.uint16))
        a, b = statistics.median(old) * 1000, statistics.median(new) * 1000
        print(f"{n:>6} | {a:>13.1f} | {b:>13.1f} | {a / b:>5.0f}× | {same}")

    sys.path.insert(0, str(ROOT))
    from headscope.analysis.capture import capture
    from headscope.analysis.models import load_model

    model = load_model("smollm2-135m")
    prose = (ROOT / "data" / "niah" / "haystack_prose.txt").read_text(encoding="utf-8").split()
    text = " ".join(prose[:420])
    capture(model, "warm up")
    times = []
    for i in range(3):
        t = time.perf_counter()
        run = capture(model, text + " " * (i + 1))
        times.append(time.perf_counter() - t)
    print(f"capture of {run.n_tokens} tokens on one thread (new path): median {statistics.median(times):.2f} s "
          f"of {len(times)}")


if __name__ == "__main__":
    main()

"""What capture() costs over a bare forward pass of the embedded model.

For 128 / 512 / 1024 tokens, each case runs in a fresh process (so peak memory is its own): load the
model, warm up, then time the operation (median of repeats) and record the growth of peak RSS over
the loaded-model baseline. Prints one table with the ratio capture / bare, measured in the same run.

    .venv/bin/python bench/capture.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r"""
import json, os, resource, statistics, sys, time
import torch
from headscope.analysis.models import load_model
from headscope.analysis.capture import capture
mode, n, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
m = load_model("smollm2-135m")
ids = torch.randint(100, 40000, (n,)).tolist()
with torch.inference_mode():
    m.bridge(torch.tensor([ids[:16]]))
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = rss_mb()
times = []
for _ in range(repeats):
    t = time.perf_counter()
    if mode == "bare":
        with torch.inference_mode():
            m.bridge(torch.tensor([ids]))
    else:
        run = capture(m, ids)
        del run
    times.append(time.perf_counter() - t)
print(json.dumps({"time": statistics.median(times), "peak_mb": rss_mb() - base}))
"""


def measure(mode: str, n: int, repeats: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", CASE, mode, str(n), str(repeats), str(threads)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="128,512,1024")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 gives steadier ratios on a busy machine")
    args = parser.parse_args()
    print(f"{'tokens':>6} | {'bare s':>7} | {'capture s':>9} | {'time ×':>6} | {'bare peak MB':>12} | "
          f"{'capture peak MB':>15}")
    print("-" * 72)
    for n in map(int, args.sizes.split(",")):
        bare = measure("bare", n, args.repeats, args.threads)
        cap = measure("capture", n, args.repeats, args.threads)
        print(f"{n:>6} | {bare['time']:>7.3f} | {cap['time']:>9.3f} | {cap['time'] / bare['time']:>6.2f} | "
              f"{bare['peak_mb']:>12.0f} | {cap['peak_mb']:>15.0f}", flush=True)
    print("\npeak MB = growth of peak RSS over the loaded model; capture keeps patterns as float16 "
          "[30, 9, N, N] plus loss and top-5.")


if __name__ == "__main__":
    main()

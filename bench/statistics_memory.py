"""Peak memory of one statistics-mode pass, against a bare forward pass that returns [n, vocab] logits.

A statistics run keeps O(layers · heads · n) statistics, so at long contexts its peak is set by the
per-token loss and top-5 predictions: built from a full ``[n, vocab]`` logits array they cost
``n · vocab · 4`` bytes (8 GiB for Gemma 3's 262k vocabulary at 8,192 tokens); built in chunks of
positions from the final hidden state (:mod:`headscope.analysis.token_predictions`) they cost
``chunk · vocab · 4``. Each case runs in its own process (fresh peak), on the embedded model by
default; peak = the process's VmHWM (reset through /proc/self/clear_refs) minus its resident set
before the case.

    .venv/bin/python bench/statistics_memory.py [--length 2048] [--model smollm2-135m] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r"""
import gc, json, sys, time
import torch
from headscope.analysis.models import load_model
from headscope.analysis.niah import load_haystack
from headscope.analysis.statistics_run import capture_statistics

mode, spec, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if threads:
    torch.set_num_threads(threads)

def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

m = load_model(spec)
ids = m.input_ids(load_haystack("prose"))
while len(ids) < n:
    ids += m.encode("\n\n" + load_haystack("prose"))
ids = ids[:n]
with torch.inference_mode():
    m.bridge(torch.tensor([ids[:16]]))
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = kb("VmRSS")
t = time.perf_counter()
if mode == "bare":
    with torch.inference_mode():
        logits = m.bridge(torch.tensor([ids]), return_type="logits")
    loss = float("nan")
    del logits
else:
    run = capture_statistics(m, ids, max_tokens=n)
    loss = float(run.token_loss[1:].mean())
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_mib": (kb("VmHWM") - before) / 1024, "vocab": m.vocab_size,
                  "mean_loss": loss}))
"""


def measure(mode: str, spec: str, n: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", CASE, mode, spec, str(n), str(threads)], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rows = {mode: measure(mode, args.model, args.length, args.threads) for mode in ("bare", "statistics")}
    logits_mib = args.length * rows["bare"]["vocab"] * 4 / 2**20
    print(f"== {args.model}, {args.length:,} tokens, torch threads {args.threads}, "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')}, load average {os.getloadavg()[0]:.1f} ==")
    print(f"{'case':<44}{'seconds':>9}{'peak MiB':>10}{'ratio':>7}")
    base = rows["bare"]["peak_mib"]
    for mode, what in (("bare", "bare forward pass, [n, vocab] logits returned"),
                       ("statistics", "capture_statistics (loss + top-5 + statistics)")):
        r = rows[mode]
        print(f"{what:<44}{r['seconds']:>9.1f}{r['peak_mib']:>10.0f}{r['peak_mib'] / base:>7.2f}")
    print(f"[n, vocab] float32 logits: {logits_mib:.0f} MiB; mean loss {rows['statistics']['mean_loss']:.4f}")


if __name__ == "__main__":
    main()

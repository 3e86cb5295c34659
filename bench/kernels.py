"""Statistics mode on the embedded model vs the eager path with patterns and an SDPA forward (CPU).

For 1,024 / 2,048 / 4,096 tokens, each case runs in a fresh process (so its peak memory is its
own): load the model, warm up on 16 tokens, then time the operation (best of ``--repeats``) and read
the process's peak RSS. Cases:

- ``sdpa``: the Hugging Face model (same weights) with ``attn_implementation="sdpa"``, logits
  only — the baseline of the ratios;
- ``eager``: the bridge's own forward pass (eager attention, the N×N scores built per layer and freed);
- ``eager+patterns``: :func:`headscope.analysis.capture.capture`, every head's float16 pattern kept
  (what the Attention page does for short texts);
- ``stats``: the bridge's forward pass in statistics mode, output only;
- ``stats run``: :func:`headscope.analysis.statistics_run.capture_statistics`, every statistic the long-run
  page and the per-head scores use (entropy, argmax, sink/recent/first-token mass, pair terms,
  column sums, 128×128 pooled maps), plus loss and top-5.

Prints one table: seconds, ratio to ``sdpa`` at the same length, peak RSS (GB) and its growth over
the loaded model. ``--skip-patterns-above N`` skips ``eager+patterns`` above N tokens (its
patterns alone are 30·9·N²·2 bytes: 9 GB at 4,096).

    .venv/bin/python bench/kernels.py [--sizes 1024 2048 4096] [--repeats 2]
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
import json, resource, sys, time
import torch
from headscope.analysis.models import load_model, converted_gguf, embedded_gguf
mode, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
ids = torch.randint(100, 40000, (1, n))
if mode == "sdpa":
    from transformers import AutoModelForCausalLM
    folder, _ = converted_gguf(embedded_gguf())
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa").eval()
    def run(x):
        return hf(x).logits
else:
    m = load_model("smollm2-135m")
    from headscope.analysis.attention_statistics import statistics_mode
    from headscope.analysis.capture import capture
    from headscope.analysis.statistics_run import capture_statistics
    def run(x):
        if mode == "eager":
            return m.bridge(x, return_type="logits")
        if mode == "eager+patterns":
            return capture(m, x[0].tolist(), max_tokens=x.shape[1])
        if mode == "stats":
            with statistics_mode(m):
                return m.bridge(x, return_type="logits")
        return capture_statistics(m, x[0].tolist())
def rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
with torch.inference_mode():
    run(ids[:, :16])
base = rss_gb()
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter()
    with torch.inference_mode():
        out = run(ids)
    best = min(best, time.perf_counter() - t)
    del out
print(json.dumps({"time": best, "peak_gb": rss_gb(), "base_gb": base}))
"""

MODES = ("sdpa", "eager", "eager+patterns", "stats", "stats run")


def measure(mode: str, n: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", CASE, mode, str(n), str(repeats)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:80]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-patterns-above", type=int, default=4096)
    args = parser.parse_args()
    import torch

    print(f"embedded SmolLM2-135M, float32, CPU, {torch.get_num_threads()} threads; best of {args.repeats}")
    print(f"{'tokens':>6} {'case':16} {'seconds':>8} {'× sdpa':>7} {'peak GB':>8} {'+ over model':>12}")
    for n in args.sizes:
        base = None
        for mode in MODES:
            if mode == "eager+patterns" and n > args.skip_patterns_above:
                print(f"{n:6d} {mode:16} {'skipped':>8}")
                continue
            r = measure(mode, n, args.repeats)
            if "error" in r:
                print(f"{n:6d} {mode:16} ERROR {r['error']}")
                continue
            if mode == "sdpa":
                base = r["time"]
            ratio = f"{r['time'] / base:7.2f}" if base else f"{'-':>7}"
            print(f"{n:6d} {mode:16} {r['time']:8.2f} {ratio} {r['peak_gb']:8.2f} {r['peak_gb'] - r['base_gb']:12.2f}",
                  flush=True)


if __name__ == "__main__":
    main()

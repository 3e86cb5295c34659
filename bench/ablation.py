"""Single-head ablation sweep of the embedded model: time per head against one clean forward pass.

Sweeps every head (30 layers × 9 heads = 270) of SmolLM2-135M on one random 256-token input with
zero ablation and the loss metric, for several ways of batching (see
:func:`headscope.analysis.head_sweep.single_head_sweep`):

- ``batch 1``: one forward pass per head, the baseline;
- ``batch B``: B copies of the input per pass, batch element b ablating its own head;
- ``+ shared prefix``: the layers below a batch's first ablated layer run once on one copy, and a
  hook on ``hook_resid_pre`` broadcasts the residual to the batch.

Each case runs in a fresh process (so peak memory is its own): load the model, warm up, then run
the sweep. The baseline, a clean batch-1 forward pass, is timed about twenty times *during* the
sweep (from the progress callback, its time subtracted from the sweep's), so on a shared machine
both see the same load; the table gives its mean, in wall-clock and process CPU seconds.
Peak MB is the growth of peak RSS over the loaded model. Prints one table.

    .venv/bin/python bench/ablation.py [--tokens 256] [--cases 1,9,9s,27s] [--sample 0]

``--sample N`` sweeps N heads spread over all layers instead of all 270 (a quick look).
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
import json, resource, statistics, sys, time
import numpy as np, torch
from headscope.analysis.models import load_model
from headscope.analysis.head_sweep import single_head_sweep
n, batch, share, sample = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.manual_seed(0)
m = load_model("smollm2-135m")
ids = torch.randint(100, 40000, (n,)).tolist()
heads = [(l, h) for l in range(m.n_layers) for h in range(m.n_heads)]
if sample:
    heads = [heads[i] for i in np.linspace(0, len(heads) - 1, sample).round().astype(int)]
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out
def clean():
    with torch.inference_mode():
        return m.bridge(torch.tensor([ids]), return_type="logits")
clean()
base = rss_mb()
n_calls = -(-len(heads) // batch)
every = max(1, n_calls // 20)
baseline = [timed(clean)[:2]]
calls = [0]
def interleave(fraction):
    # a clean forward every few batches, so the baseline shares the sweep's conditions
    calls[0] += 1
    if calls[0] % every == 0:
        baseline.append(timed(clean)[:2])
wall, cpu, sweep = timed(lambda: single_head_sweep(m, ids, "zero", "loss", heads=heads, batch_size=batch,
                                                   share_prefix=share, progress=interleave))
inside = baseline[1:]
wall -= sum(t[0] for t in inside)
cpu -= sum(t[1] for t in inside)
# the mean, like the sweep's own per-head time: a median would drop the load bursts the sweep pays
print(json.dumps({"clean_wall": statistics.mean(t[0] for t in inside or baseline),
                  "clean_cpu": statistics.mean(t[1] for t in inside or baseline), "n_clean": len(inside),
                  "wall": wall, "cpu": cpu, "heads": len(heads), "peak_mb": rss_mb() - base,
                  "effect": np.nan_to_num(sweep.effect).tolist()}))
"""


def measure(n: int, batch: int, share: bool, sample: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-c", CASE, str(n), str(batch), "1" if share else "0", str(sample)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--cases", default="1,9,9s,27s", help="batch sizes; a trailing s shares the prefix")
    parser.add_argument("--sample", type=int, default=0, help="sweep this many heads (0: all)")
    args = parser.parse_args()
    import numpy as np

    print(f"single-head zero-ablation sweep, {args.tokens} tokens, loss metric")
    print(
        f"{'case':<24} | {'heads':>5} | {'wall s':>7} | {'cpu s':>7} | {'wall/head':>9} | {'clean wall':>10} | "
        f"{'head/fwd wall':>13} | {'head/fwd cpu':>12} | {'peak MB':>7} | {'max |Δ| vs 1st':>14}"
    )
    print("-" * 133)
    reference = None
    for case in args.cases.split(","):
        share = case.endswith("s")
        batch = int(case.rstrip("s"))
        r = measure(args.tokens, batch, share, args.sample)
        effect = np.array(r["effect"])
        if reference is None:
            reference = effect
        diff = float(np.abs(effect - reference).max())
        name = f"batch {batch}" + (" + shared prefix" if share else "")
        per_wall, per_cpu = r["wall"] / r["heads"], r["cpu"] / r["heads"]
        print(
            f"{name:<24} | {r['heads']:>5} | {r['wall']:>7.1f} | {r['cpu']:>7.1f} | {per_wall:>9.3f} | "
            f"{r['clean_wall']:>10.3f} | {per_wall / r['clean_wall']:>13.2f} | {per_cpu / r['clean_cpu']:>12.2f} | "
            f"{r['peak_mb']:>7.0f} | {diff:>14.2e}",
            flush=True,
        )
    print(
        "\nhead/fwd = seconds per swept head over one clean batch-1 forward pass (mean of ~20 timed during "
        "the sweep), "
        "in wall-clock and in process CPU time;\npeak MB = growth of peak RSS over the loaded model "
        "(the batch's logits dominate); max |Δ| = largest difference of the effect map from the first case."
    )


if __name__ == "__main__":
    main()

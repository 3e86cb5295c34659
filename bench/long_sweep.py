"""Benchmark: the Heads page's sweep job at long contexts, without the browser.

What a click on the Heads page's Run does for one own needle in the passkey haystack at each length
(one depth): the retrieval sweep (``headscope.analysis.retrieval.sweep``: statistics-mode prefill and KV-cached
decode, one attention row per head per step) and then every other per-head score over the sweep's
prompt (``headscope.analysis.head_scores.score_prompts``: streaming, sink, entropy, evidence, ...). The browser
test runs this at 1,200 tokens (just above the page's patterns limit); this script carries the long
sizes the suite no longer runs.

Prints, per length: tokens, sweep time, scoring time, peak resident memory (VmHWM, reset per length
through /proc/self/clear_refs), whether the model answered, and the time ratio to the first length.

    .venv/bin/python bench/long_sweep.py [--lengths 2048 4096] [--threads 1] [--depth 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NEEDLE = "The secret passkey is 7731. | What is the secret passkey? | 7731"


def _peak_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--depth", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a page job's fork runs with 1)")
    args = parser.parse_args()

    import torch

    from headscope.analysis.head_scores import score_prompts, trial_prompts
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, parse_needles
    from headscope.analysis.retrieval import sweep

    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m")
    needles = parse_needles(NEEDLE)
    haystack = load_haystack("passkey")
    print(f"{'tokens':>7} {'sweep s':>8} {'scores s':>9} {'total s':>8} {'ratio':>6} {'peak MB':>8}  answered", flush=True)
    base = None
    for length in args.lengths:
        _reset_peak()
        t0 = time.perf_counter()
        result = sweep(model, needles, [length], [args.depth], haystack)
        t1 = time.perf_counter()
        score_prompts(model, trial_prompts(result.trials))
        t2 = time.perf_counter()
        total = t2 - t0
        base = base or total
        print(f"{length:>7} {t1 - t0:>8.1f} {t2 - t1:>9.1f} {total:>8.1f} {total / base:>6.2f} {_peak_mb():>8.0f}  "
              f"{result.n_counted}/{result.n_trials}", flush=True)


if __name__ == "__main__":
    main()

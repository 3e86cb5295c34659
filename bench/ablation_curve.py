"""The retrieval-head paper's causal test on the embedded model: needle-in-a-haystack accuracy
with the top-k retrieval heads ablated, against k random heads (Wu et al. 2024, §4).

Runs (or reuses, from the store) a sweep of every shipped needle at the given length and depths,
ranks heads by their retrieval score, and for each k ablates the top k, and k random heads outside
the top N = max(--control-top, max k) for several seeds, measuring accuracy (ROUGE-1 recall > 0.5)
on the sweep's prompts, through :func:`headscope.analysis.ablation_curve.ablation_curve` (what the page and
``headscope ablate --curve`` call). The ranking and the accuracy use the same prompts, as in the
paper. Prints one table per method.

    .venv/bin/python bench/ablation_curve.py [--length 256] [--depths 25,75] [--k 0,5,10,20]
                                             [--seeds 3] [--control-top 20] [--methods uniform,zero]
                                             [--home DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--depths", default="25,75")
    parser.add_argument("--k", default="0,5,10,20")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--control-top", type=int, default=20)
    parser.add_argument("--methods", default="uniform,zero")
    parser.add_argument("--home", help="store folder (default: HEADSCOPE_HOME or the user data dir)")
    args = parser.parse_args()

    import numpy as np
    import torch

    from headscope.analysis.ablation import AblationSpec
    from headscope.analysis.ablation_curve import ablation_curve
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    torch.set_num_threads(1)  # decoding is many tiny matmuls; one thread is fastest on a shared box
    store = Store(args.home) if args.home else Store()
    model = load_model("smollm2-135m")
    depths = [float(d) for d in args.depths.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    t = time.perf_counter()
    result = sweep(model, load_needles(), [args.length], depths, load_haystack("prose"), store=store)
    print(f"sweep: {len(result.trials)} prompts at {args.length} tokens, {result.n_counted} answered, "
          f"{result.share_above(0.1):.1%} of heads score > 0.1 ({time.perf_counter() - t:.0f} s)")
    scores = np.nan_to_num(result.scores)
    for method in args.methods.split(","):
        t = time.perf_counter()
        _, curve, _ = ablation_curve(model, scores, ks, AblationSpec((), method), store, on=result,
                                     by_label="Retrieval score", seeds=range(args.seeds),
                                     outside_top=args.control_top)
        print(f"\n{method} ablation ({time.perf_counter() - t:.0f} s), random heads outside the top "
              f"{curve.outside_top}; top heads: "
              + ", ".join(f"{la}.{h}" for la, h in curve.order[: max(ks)]))
        print(f"{'k':>4} {'top-k':>7} {'random mean':>12} {'± std':>7}   per seed")
        for j, k in enumerate(ks):
            per_seed = " ".join(f"{v:.2f}" for v in curve.random[:, j])
            print(f"{k:>4} {curve.top[j]:>7.3f} {curve.random_mean[j]:>12.3f} {curve.random_std[j]:>7.3f}   {per_seed}")


if __name__ == "__main__":
    main()

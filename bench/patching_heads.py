"""Which heads carry the built-in IOI pairs, and are they heads headscope already scores?

For every IOI-style pair of ``data/patching/pairs.json`` (name swaps, Wang et al. 2022), denoises
each head's output ``z`` of the embedded SmolLM2-135M exactly and by attribution patching
(:func:`headscope.analysis.patching.activation_patching`, normalised logit difference: 0 = corrupted,
1 = clean), then:

- per pair: the clean and corrupted logit differences, the attribution/exact agreement (Pearson,
  Spearman over the 270 heads, top-10 overlap) and the five heads with the largest |effect|;
- over the pairs: the mean effect per head, its top ten, and how many of them are among the ten
  highest-scoring heads of each detector headscope has: previous-token and induction
  (TransformerLens' detectors, :func:`headscope.analysis.detectors.head_detector_scores`, on one run of
  ``--random-tokens`` random token ids repeated twice, the detectors' usual input) and retrieval
  (:func:`headscope.analysis.retrieval.sweep` at ``--length`` tokens, read from the store if present).
  Chance overlap of two random top-10 sets of 270 heads is 10·10/270 = 0.37 heads.

    .venv/bin/python bench/patching_heads.py [--home DIR] [--length 2048] [--random-tokens 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, before bench/ (bench/kernels.py)

TOP = 10


def top_heads(table: np.ndarray, k: int = TOP, absolute: bool = True) -> list[tuple[int, int]]:
    """The k heads ``(layer, head)`` with the largest (absolute) value of a ``[layer, head]`` table."""
    flat = np.abs(table).ravel() if absolute else table.ravel()
    order = np.argsort(-np.nan_to_num(flat, nan=-np.inf), kind="stable")[:k]
    return [tuple(int(x) for x in np.unravel_index(i, table.shape)) for i in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", help="store folder (default: HEADSCOPE_HOME or the user data dir)")
    parser.add_argument("--length", type=int, default=2048, help="NIAH sweep length for retrieval scores")
    parser.add_argument("--needles", default="locker-code,chess-club,tram-depot,plum-jam")
    parser.add_argument("--depths", default="50")
    parser.add_argument("--random-tokens", type=int, default=50)
    args = parser.parse_args()

    from headscope.analysis.capture import capture
    from headscope.analysis.detectors import head_detector_scores
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.patching import activation_patching
    from headscope.analysis.patching_pairs import load_pairs
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    store = Store(args.home) if args.home else Store()
    model = load_model("smollm2-135m")
    pairs = [p for p in load_pairs() if p.kind == "ioi"]
    print(f"# bench/patching_heads.py on {model.name}: {len(pairs)} IOI pairs, z denoised, normalised logit diff")
    print(f"{'pair':<18} {'LD clean':>8} {'LD corr':>8} {'exact s':>7} {'attr s':>6} {'Pearson':>7} {'Spearman':>8} "
          f"{'top10':>5}  top five heads (effect)")
    effects = []
    for spec in pairs:
        r = activation_patching(model, spec.clean, spec.corrupted, list(spec.answers), site="z",
                                attribution=True, store=store)
        effects.append(r.values)
        top = ", ".join(f"{ly}.{h} ({v:+.2f})" for (ly, h), v in r.top_units(5))
        a = r.agreement
        print(f"{spec.id:<18} {r.clean:>8.2f} {r.corrupted:>8.2f} {r.seconds:>7.1f} {r.attribution_seconds:>6.1f} "
              f"{a.pearson:>7.3f} {a.spearman:>8.3f} {a.overlap:>5.0%}  {top}", flush=True)
    mean = np.mean(effects, axis=0)
    patched = top_heads(mean)
    print(f"\nmean effect over the {len(pairs)} pairs, top {TOP}: "
          + ", ".join(f"{ly}.{h} ({mean[ly, h]:+.2f})" for ly, h in patched))

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, model.bridge.cfg.d_vocab - 1000, size=args.random_tokens).tolist()
    run = capture(model, ids + ids, store=store)
    scores = {kind: head_detector_scores(run.patterns, run.token_ids, kind) for kind in ("previous_token", "induction")}
    by_id = {n.id: n for n in load_needles()}
    result = sweep(model, [by_id[k] for k in args.needles.split(",")], [args.length],
                   [float(d) for d in args.depths.split(",")], load_haystack("prose"), store=store)
    scores[f"retrieval ({args.length} tokens, {result.n_counted} of {len(result.trials)} answered)"] = \
        np.asarray(result.scores)
    print(f"\noverlap of the patching top {TOP} with each score's top {TOP} (chance: {TOP * TOP / mean.size:.2f})")
    chosen = set(patched)
    for name, table in scores.items():
        best = top_heads(table, absolute=False)
        both = [f"{ly}.{h}" for ly, h in best if (ly, h) in chosen]
        print(f"  {name:<45} {len(both):>2}  {' '.join(both)}   (its top {TOP}: "
              + " ".join(f"{ly}.{h}" for ly, h in best) + ")")


if __name__ == "__main__":
    main()

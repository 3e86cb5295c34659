"""Faithfulness of token attribution on the embedded model (Abnar & Zuidema 2020, section 5).

Run: ``.venv/bin/python bench/faithfulness.py`` (a few minutes on 2 cores; ``--help`` for options).

For every prompt of ``data/attribution/eval_set.json`` (``--set copy``: ``copy_set.json``; or
``--limit`` of them), at its last
position and for its target token, ``headscope.analysis.attribution.attribute`` scores every input token by
raw attention (last layer, head mean), attention rollout, exact attention flow, rollout and flow
divided by their values on uniform causal attention (position-corrected), value-weighted attention
and rollout (Kobayashi et al. 2020) and input×gradient (norm and signed sum), and by leave-one-out ablation with the zero vector; the same inputs are
ablated again with the mean embedding. The first table gives, per method, the mean ± standard
deviation of Spearman's ρ with the ablation importance over the inputs, and how many inputs had a
defined ρ; columns: all positions; without position 0 (the attention sink, which every attention
method favours and whose removal disrupts the model); without position 0 and the target position
t itself (zeroing the query token's own embedding is by far the largest effect, and attention
methods rank t low); against |importance|. Then the mean ρ per kind of prompt. Two extra rows show
rollout and flow with the sink column dropped before renormalising (``drop_sinks=(0,)``), which
only makes sense without position 0.

The second table is the time per input, by stage, with the ratio to one plain forward pass
(``capture``) measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from headscope.analysis.attribution import (  # noqa: E402
    COPY_SET,
    EVAL_SET,
    LABELS,
    METHODS,
    ablation_importance,
    attribute,
    load_eval_set,
)
from headscope.analysis.capture import capture  # noqa: E402
from headscope.analysis.flow import attention_flow  # noqa: E402
from headscope.analysis.rollout import rollout  # noqa: E402

SINK_VARIANTS = {"rollout_nosink": "rollout, sink dropped", "flow_nosink": "flow, sink dropped"}
STAGES = (("capture (forward + patterns)", 0.2),
          ("rollout, flow (plain, corrected), value pass", 0.6),
          ("input×gradient", 0.7),
          ("ablation (N+1 copies, 1 batch)", 1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--set", dest="prompt_set", default="eval", choices=("eval", "copy"),
                        help="eval: data/attribution/eval_set.json (agreement, facts, context); "
                             "copy: data/attribution/copy_set.json (names and words copied from earlier)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()

    import torch

    from headscope.analysis.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    items = load_eval_set(COPY_SET if args.prompt_set == "copy" else EVAL_SET)[: args.limit]
    print(f"{model.name}: {len(items)} prompts, torch threads {torch.get_num_threads()}")

    by_ablation: dict[str, list] = {"zero": [], "mean": []}
    stage_times: list[list[float]] = []
    totals, lengths = [], []
    for k, item in enumerate(items):
        marks: list[float] = []
        start = time.perf_counter()
        a = attribute(model, item.text, target=item.target, progress=lambda _, marks=marks: marks.append(time.perf_counter()))
        totals.append(time.perf_counter() - start)
        stage_times.append(list(np.diff([start, *marks])))
        lengths.append(a.position + 1)

        # Rollout and flow with the sink column dropped: same patterns, one more forward.
        patterns = capture(model, a.token_ids[: a.position + 1], pattern_dtype="float32").patterns
        extra = {
            "rollout_nosink": rollout(patterns, drop_sinks=(0,))[a.position],
            "flow_nosink": attention_flow(patterns, target=a.position, drop_sinks=(0,)),
        }
        zero = dataclasses.replace(a, scores={**a.scores, **extra})
        mean_importance, _ = ablation_importance(model, a.token_ids, a.position, a.target_id, ablation="mean")
        mean = dataclasses.replace(zero, ablation="mean", scores={**zero.scores, "ablation": mean_importance})
        by_ablation["zero"].append(zero)
        by_ablation["mean"].append(mean)
        rho = zero.correlations()
        print(
            f"  [{k + 1:2d}/{len(items)}] {item.id:22s} {a.position + 1:3d} tok  {a.target_token:>12s} "
            f"p={np.exp(a.target_logprob):.2f}  {totals[-1]:5.2f} s  ρ(zero): "
            + " ".join(f"{m}={rho[m]:+.2f}" for m in METHODS),
            flush=True,
        )

    methods = (*METHODS, *SINK_VARIANTS)
    labels = {**LABELS, **SINK_VARIANTS}
    columns = (
        ("all positions", lambda a: {}),
        ("without position 0", lambda a: {"exclude": (0,)}),
        ("without 0 and t", lambda a: {"exclude": (0, a.position)}),
        ("vs |importance|", lambda a: {"magnitude": True}),
    )
    kinds = sorted({item.kind for item in items})
    for ablation, attributions in by_ablation.items():
        print(f"\nSpearman ρ with leave-one-out ablation importance ({ablation} embedding), mean ± std (n)")
        header = f"  {'method':40s}" + "".join(f"{title:>24s}" for title, _ in columns)
        print(header)
        print("  " + "-" * (len(header) - 2))
        for m in methods:
            cells = []
            for _, options in columns:
                rho = np.array([a.correlations([m], **options(a))[m] for a in attributions])
                rho = rho[np.isfinite(rho)]
                std = rho.std(ddof=1) if rho.size > 1 else float("nan")
                cells.append(f"{rho.mean():+.2f} ± {std:.2f} ({rho.size:2d})" if rho.size else "—")
            print(f"  {labels[m]:40s}" + "".join(f"{c:>24s}" for c in cells))
        counts = [f"{kind} ({sum(i.kind == kind for i in items)})" for kind in kinds]
        print(f"  {'mean ρ by kind, all positions':40s}" + "".join(f"{c:>16s}" for c in counts))
        for m in methods:
            cells = []
            for kind in kinds:
                rho = np.array([a.correlations([m])[m] for a, i in zip(attributions, items, strict=True) if i.kind == kind])
                cells.append(f"{np.nanmean(rho):+.2f}")
            print(f"  {labels[m]:40s}" + "".join(f"{c:>16s}" for c in cells))

    times = np.array(stage_times)
    forward = times[:, 0].mean()
    print(f"\nTime per input ({len(items)} inputs, {min(lengths)}–{max(lengths)} tokens, mean {np.mean(lengths):.1f})")
    print(f"  {'stage':46s}{'mean s':>10s}{'max s':>10s}{'× forward':>12s}")
    for (name, _), column in zip(STAGES, times.T, strict=True):
        print(f"  {name:46s}{column.mean():10.3f}{column.max():10.3f}{column.mean() / forward:12.1f}")
    total = np.array(totals)
    print(f"  {'attribute() total':46s}{total.mean():10.3f}{total.max():10.3f}{total.mean() / forward:12.1f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak resident memory {peak:,.0f} MiB")


if __name__ == "__main__":
    main()

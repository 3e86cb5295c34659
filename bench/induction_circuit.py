"""The known induction circuit on the embedded model: on repeated random tokens, what builds the key side of
the top induction heads (QK attribution), against earlier previous-token heads (K-composition).

Olsson et al. 2022, "In-context Learning and Induction Heads" (arXiv:2209.11895): an induction head at
query ``i`` (second copy) attends to the token after the earlier occurrence, key ``i − L + 1``, because a
previous-token head in an earlier layer wrote "the token before me" into that key's residual stream
(K-composition, Elhage et al. 2021). One run of ``[BOS?] r r`` (``r`` of ``L`` random tokens):

1. induction and previous-token scores of every head from its pattern (mean attention on ``i − L + 1`` over
   the second copy; on ``i − 1`` over every query);
2. for the top induction heads, :func:`headscope.analysis.qk_attribution.qk_attribution` at several second-copy
   queries and their induction keys, from one capture; the key-side column sums averaged over the queries,
   the top components listed with their previous-token scores;
3. the K-composition (:func:`headscope.analysis.composition.composition_scores`) of the top previous-token
   heads into each induction head, and its rank among all earlier heads.

    OMP_NUM_THREADS=1 .venv/bin/python bench/induction_circuit.py [--length 50 --heads 3 --queries 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    from headscope.analysis.composition import composition_scores
    from headscope.analysis.models import load_model
    from headscope.analysis.qk_attribution import qk_attribution
    from headscope.analysis.residual_components import capture_components

    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=50)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = load_model("smollm2-135m")
    g = torch.Generator().manual_seed(args.seed)
    r = torch.randint(1000, 20000, (args.length,), generator=g).tolist()
    bos = model.facts.bos_id
    ids = ([bos] if bos is not None else []) + r + r
    start = len(ids) - args.length  # first position of the second copy
    patterns = {}

    def keep(layer):
        def hook(t, hook=None):
            patterns[layer] = t[0].detach().float()
        return hook

    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(torch.tensor([ids]), return_type=None,
                                    fwd_hooks=[(f"blocks.{i}.attn.hook_pattern", keep(i)) for i in range(model.n_layers)])
    rows = torch.arange(start, len(ids))
    induction = np.array([[float(patterns[a][h, rows, rows - args.length + 1].mean()) for h in range(model.n_heads)]
                          for a in range(model.n_layers)])
    every = torch.arange(1, len(ids))
    previous = np.array([[float(patterns[a][h, every, every - 1].mean()) for h in range(model.n_heads)]
                         for a in range(model.n_layers)])
    top = sorted(np.ndindex(induction.shape), key=lambda lh: -induction[lh])[: args.heads]
    queries = [int(q) for q in np.linspace(start + 1, len(ids) - 1, args.queries).round()]
    keys = [q - args.length + 1 for q in queries]
    t0 = time.perf_counter()
    capture = capture_components(model, ids, sorted(set(queries + keys)), attention_layers=sorted({a for a, _ in top}))
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    comp = composition_scores(model).k
    t_comp = time.perf_counter() - t0
    prev_top = sorted(np.ndindex(previous.shape), key=lambda lh: -previous[lh])[:5]
    print(f"repeated random tokens: {len(ids)} tokens (L = {args.length}), queries {queries}")
    print("top previous-token heads:", ", ".join(f"{a}.{h} ({previous[a, h]:.2f})" for a, h in prev_top))
    for a, h in top:
        t0 = time.perf_counter()
        results = [qk_attribution(model, ids, a, h, q, k, capture=capture) for q, k in zip(queries, keys, strict=True)]
        per_cell = (time.perf_counter() - t0) / len(results)
        names = results[0].key_names
        col = np.mean([res.key_sums for res in results], 0)
        score = np.mean([res.score for res in results])
        print(f"\ninduction head {a}.{h}: induction {induction[a, h]:.2f}, previous-token {previous[a, h]:.2f}; "
              f"mean score s_ij {score:.2f}; {per_cell * 1e3:.1f} ms per cell from the capture")
        print(f"  {'key-side component':>20} {'mean column sum':>16} {'prev-token score':>17} {'K-comp':>7} {'K-comp rank':>11}")
        ranks = np.argsort(np.argsort(-comp[:a, :, a, h], axis=None)).reshape(a, model.n_heads) + 1
        for i in np.argsort(-col)[:8]:
            name = names[i]
            if name.count(".") == 1 and name.split(".")[0].isdigit():
                sa, sh = (int(x) for x in name.split("."))
                extra = f"{previous[sa, sh]:17.2f} {comp[sa, sh, a, h]:7.3f} {ranks[sa, sh]:11d}"
            else:
                extra = f"{'':>17} {'':>7} {'':>11}"
            print(f"  {name:>20} {col[i]:16.3f} {extra}")
    print(f"\ncapture (one hooked pass, {len(ids)} tokens): {t_capture:.2f} s; composition scores: {t_comp:.1f} s")


if __name__ == "__main__":
    main()

"""Edge attribution patching against exact path patching on the embedded model's IOI pairs.

Edge attribution (:func:`headscope.analysis.edge_attribution.edge_attribution`, Syed, Rager & Conmy 2023,
arXiv:2310.10348) estimates ``m(clean with edge s → (r, site) corrupted) − m(clean)`` to first order from one
forward+backward pass. Path patching (:func:`headscope.analysis.path_patching.path_patching`, Wang et al. 2022)
measures the same thing exactly for a head → head edge: noising (the clean prompt receives, the corrupted one is
the source), with the MLPs frozen so that only the direct path from the sender into the receiver's q, k or v
changes; its ``raw − clean`` is the exact effect. Path patching has no embedding or MLP senders and no logits
receiver, so the comparison covers the head → head edges.

For each pair: the 50 edges with the largest ``|score|`` (``--edges``), each path-patched; the table gives the
Spearman rank correlation of score and exact effect over them (signed, and of the absolute values), the overlap
of the ten largest by each, the fraction with the same sign, and the times (one edge-attribution call; one
plain forward pass for scale; one exact path patch).

    OMP_NUM_THREADS=1 .venv/bin/python bench/edge_attribution_vs_path_patching.py [--edges 50 --pairs 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.stats import spearmanr


def _head(name: str) -> tuple[int, int]:
    layer, head = name.split(".")
    return int(layer), int(head)


def compare(model, spec, n_edges: int, freeze_norms: bool) -> dict:
    from headscope.analysis.edge_attribution import edge_attribution
    from headscope.analysis.path_patching import path_patching

    t = time.perf_counter()
    result = edge_attribution(model, spec.clean, spec.corrupted, list(spec.answers), freeze_norms=freeze_norms)
    t_edges = time.perf_counter() - t
    ids = torch.tensor([list(result.pair.clean_ids)])
    t = time.perf_counter()
    with model.lock, torch.inference_mode():
        model.bridge(ids, return_type="logits")
    t_forward = time.perf_counter() - t
    heads = [(s, r, site, v) for s, r, site, v in result.rows()
             if site in ("q", "k", "v") and s not in ("embed",) and not s.startswith("mlp.")][:n_edges]
    exact = []
    t = time.perf_counter()
    for s, r, site, _ in heads:
        p = path_patching(model, spec.clean, spec.corrupted, list(spec.answers), [_head(s)], [_head(r)], site=site,
                          direction="noise", freeze_mlps=True)
        exact.append(p.raw - p.clean)
    t_path = (time.perf_counter() - t) / max(len(heads), 1)
    scores = np.array([h[3] for h in heads])
    exact = np.array(exact)
    top_a = set(np.argsort(-np.abs(scores))[:10])
    top_e = set(np.argsort(-np.abs(exact))[:10])
    return {"pair": spec.id, "freeze": freeze_norms, "n": len(heads), "clean": result.clean,
            "corrupted": result.corrupted, "spearman": spearmanr(scores, exact)[0],
            "spearman_abs": spearmanr(np.abs(scores), np.abs(exact))[0], "top10": len(top_a & top_e),
            "sign": float(np.mean(np.sign(scores) == np.sign(exact))), "t_edges": t_edges, "t_forward": t_forward,
            "t_path": t_path, "n_all": len(result.scores), "rows": list(zip(heads, exact, strict=True))}


def main() -> None:
    from headscope.analysis.models import load_model
    from headscope.analysis.patching_pairs import load_pairs

    parser = argparse.ArgumentParser()
    parser.add_argument("--edges", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=2, help="how many of the shipped IOI pairs")
    parser.add_argument("--show", type=int, default=12, help="edges listed per pair")
    args = parser.parse_args()
    model = load_model("smollm2-135m")
    pairs = [p for p in load_pairs() if p.kind == "ioi"][: args.pairs]
    print(f"model smollm2-135m: {model.n_layers} layers x {model.n_heads} heads ({model.n_kv_heads} key-value), "
          f"torch threads {torch.get_num_threads()}")
    results = []
    for spec in pairs:
        for freeze in (False, True):
            r = compare(model, spec, args.edges, freeze)
            results.append(r)
            print(f"\n{spec.id} (freeze_norms={freeze}): logit diff clean {r['clean']:.3f}, corrupted "
                  f"{r['corrupted']:.3f}; {r['n_all']} edges scored; the top {r['n']} head -> head edges path-patched")
            print(f"  {'sender':>7} {'receiver':>8} {'site':>4} {'attribution':>12} {'exact':>10}")
            for (s, rec, site, v), e in r["rows"][: args.show]:
                print(f"  {s:>7} {rec:>8} {site:>4} {v:12.4f} {e:10.4f}")
    print(f"\n{'pair':<16} {'freeze':>6} {'edges':>5} {'spearman':>8} {'|s| sp.':>7} {'top-10':>6} {'sign':>5} "
          f"{'EAP s':>6} {'fwd s':>6} {'ratio':>5} {'path s/edge':>11}")
    for r in results:
        print(f"{r['pair']:<16} {str(r['freeze']):>6} {r['n']:>5} {r['spearman']:8.3f} {r['spearman_abs']:7.3f} "
              f"{r['top10']:>4}/10 {r['sign']:5.2f} {r['t_edges']:6.2f} {r['t_forward']:6.2f} "
              f"{r['t_edges'] / r['t_forward']:5.1f} {r['t_path']:11.2f}")
    print("\nEAP s: one edge_attribution call (clean forward+backward, corrupted forward, all edges); fwd s: one "
          "plain forward of the clean prompt; path s/edge: one exact path patch (six forward passes).")


if __name__ == "__main__":
    main()

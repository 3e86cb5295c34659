"""Exactness of direct logit attribution and QK attribution in every family statistics mode supports and on
the embedded model: the largest error of the sum of the terms against the model's own value, over every
position and two answer pairs (DLA) and over every head and a grid of (query, key) cells (QK), all from one
capture per model.

Two measures: relative to the value itself, over the cells where it is not a cancellation (|LD| above 1 % of
the terms' total absolute size; |s| above 1 % of ``scale · |q| |k|``), and relative to that size over every
cell (the scale of the model's own float32 rounding).

    OMP_NUM_THREADS=1 .venv/bin/python bench/attribution_exactness.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def exactness(name, model, ids, stride=1) -> None:
    """Print the largest errors of one model on ``ids`` (every ``stride``-th layer for QK)."""
    from headscope.analysis.logit_attribution import direct_logit_attribution
    from headscope.analysis.model_facts import attention_window
    from headscope.analysis.qk_attribution import qk_attribution
    from headscope.analysis.residual_components import capture_components

    n = len(ids)
    cap = capture_components(model, ids, range(n), attention_layers=range(model.n_layers))
    dla = dla_all = 0.0
    n_dla = 0
    for p in range(n):
        for a, b in [(ids[(p + 1) % n], ids[(p + 3) % n]), (5, 1000)]:
            r = direct_logit_attribution(model, ids, a, b, position=p, capture=cap)
            err, size = abs(r.values.sum() - r.logit_diff), abs(r.values).sum()
            dla_all, n_dla = max(dla_all, err / size), n_dla + 1
            if abs(r.logit_diff) > 1e-2 * size:
                dla = max(dla, err / abs(r.logit_diff))
    qk = qk_all = 0.0
    n_qk = 0
    for layer in range(0, model.n_layers, stride):
        window = attention_window(model.bridge.blocks[layer].attn.original_component) or 10**9
        att = cap.attention[layer]
        for h in range(model.n_heads):
            for i in range(0, n, 3):
                for j in range(max(0, i - window + 1), i + 1, 2):
                    r = qk_attribution(model, ids, layer, h, i, j, capture=cap)
                    bound = r.scale * float(att.q[i, h].double().norm() * att.k[j, model.kv_head(h)].double().norm())
                    err = abs(r.terms.sum() - r.score)
                    qk_all, n_qk = max(qk_all, err / bound), n_qk + 1
                    if abs(r.score) > 1e-2 * bound:
                        qk = max(qk, err / abs(r.score))
    print(f"{name:10s} DLA: max |err|/|LD| {dla:.1e}, max |err|/sum|terms| {dla_all:.1e} ({n_dla} cells) | "
          f"QK: max |err|/|s| {qk:.1e}, max |err|/(scale|q||k|) {qk_all:.1e} ({n_qk} cells)", flush=True)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_families, tests.conftest
    from headscope.analysis.models import load_model, wrap_model
    from tests.conftest import load_embedded_tokenizer
    from tests.tiny_families import FAMILIES, tiny_family_model

    tokenizer = load_embedded_tokenizer()
    ids = torch.randint(0, 40000, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    for family in FAMILIES:
        exactness(family, wrap_model(tiny_family_model(family, len(tokenizer)), tokenizer, name=family, digest=family), ids)
    ids = torch.randint(0, 40000, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    exactness("smollm2", load_model("smollm2-135m"), ids, stride=3)


if __name__ == "__main__":
    main()

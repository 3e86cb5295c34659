"""``headscope explain``: why a head gives a query its score on a key (QK attribution)."""

from __future__ import annotations

from pathlib import Path

from headscope.app.cli.arguments import (
    MODEL_HELP,
    check_formats,
    count,
    folder,
    layer_head,
    non_empty,
    text_arg,
)
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import open_store_and_model


def cmd_explain(args) -> int:
    """The pre-softmax score of ``--head`` at (``--query``, ``--key``) split over pairs of residual-stream
    components (:func:`headscope.analysis.circuits.explain`); writes ``qk_attribution.csv``, ``summary.json``
    and the figure with its manifest, and prints the largest query-side and key-side components."""
    formats = check_formats(args.formats)

    import csv
    import json

    import numpy as np

    from headscope.analysis.circuits import explain, text_ids
    from headscope.analysis.errors import check_head_index
    from headscope.app.export import write_files
    from headscope.app.views import names

    store, spec, model = open_store_and_model(args)
    with argument("--head"):
        layer, head = check_head_index(model.n_layers, model.n_heads, *args.head)
    with argument("--text"):
        ids = text_ids(model, args.text)
    for flag, value in (("--query", args.query), ("--key", args.key)):
        if value >= len(ids):
            raise UsageError(f"argument {flag}: position {value} is outside the text's {len(ids)} tokens "
                             f"(0..{len(ids) - 1}; `headscope run` lists them)")
    with argument("--key"):
        cell = explain(model, ids, layer, head, args.query, args.key, store=store)
    a = cell.attribution
    out = Path(args.out) if args.out else store.root / "exports" / f"explain-{cell.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "qk_attribution.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["query_component", "key_component", "contribution"])
        for i, qn in enumerate(a.query_names):
            for j, kn in enumerate(a.key_names):
                writer.writerow([qn, kn, repr(float(a.terms[i, j]))])
    total = float(a.terms.sum())
    size = max(float(np.abs(a.terms).sum(1).max()), abs(a.score), 1e-12)
    summary = {
        "model": model.name, "model_digest": model.digest, "head": f"{layer}.{head}", "layer": layer, "head_index": head,
        "query": a.query, "key": a.key, "query_token": cell.tokens[a.query], "key_token": cell.tokens[a.key],
        "score": a.score, "capped_score": a.capped_score, "softcap": a.softcap, "scale": a.scale,
        "sum_of_terms": total, "check": {"relative_error": abs(total - a.score) / size, "tolerance": 1e-4,
                                         "terms_sum_to_score": abs(total - a.score) <= 1e-4 * size},
        "query_sums": dict(zip(a.query_names, map(float, a.query_sums), strict=True)),
        "key_sums": dict(zip(a.key_names, map(float, a.key_sums), strict=True)),
        "tokens": cell.tokens, "result": cell.key,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_files(None, names.QK_CELL, {"model": spec, "cell": cell.key[:16]}, out, formats)
    print(f"head {layer}.{head}, query {a.query} {cell.tokens[a.query]!r} on key {a.key} {cell.tokens[a.key]!r}: "
          f"score {a.score:.4f} before softmax; the {len(a.query_names)} x {len(a.key_names)} terms sum to {total:.4f}")
    for side, sums, nm in (("query", a.query_sums, a.query_names), ("key", a.key_sums, a.key_names)):
        top = np.argsort(-np.abs(sums))[:5]
        print(f"  largest {side}-side components: " + ", ".join(f"{nm[i]} {sums[i]:+.3f}" for i in top))
    print(f"results in {out}")
    return 0


def add_parser(sub) -> None:
    """``headscope explain``: the QK attribution of one head at one (query, key) cell."""
    p = sub.add_parser("explain", help="why a head attends where it does: its pre-softmax score at (query, key) as a "
                                       "sum over pairs of residual-stream components (QK attribution)")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--text", type=text_arg, required=True, help="the text (the BOS the model expects is token 0)")
    p.add_argument("--head", type=layer_head, required=True, help="the head, layer.head, e.g. 18.6")
    p.add_argument("--query", type=count(0), required=True, help="the query position (a token index)")
    p.add_argument("--key", type=count(0), required=True, help="the key position, at most the query")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html", help="figure formats of qk_cell (default svg,html; none: '')")
    p.set_defaults(func=cmd_explain)

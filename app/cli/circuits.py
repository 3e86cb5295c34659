"""``headscope circuits``: what each head writes towards an answer (direct logit attribution) and which
earlier heads feed which (composition scores)."""

from __future__ import annotations

from pathlib import Path

from headscope.app.cli.arguments import MODEL_HELP, check_formats, folder, non_empty, text_arg
from headscope.app.cli.errors import argument
from headscope.app.cli.loading import open_store_and_model
from headscope.app.cli.patch import answer_list
from headscope.app.cli.terminal import progress_bar


def _two_answers(text: str) -> list[str]:
    """``--answers``: exactly two answers (:func:`headscope.app.cli.patch.answer_list` reads them)."""
    import argparse

    items = answer_list(text)
    if len(items) != 2:
        raise argparse.ArgumentTypeError("give two answer tokens separated by a comma, the one the text should "
                                         "lead to first, e.g. \" Mary, John\"")
    return items


def cmd_circuits(args) -> int:
    """Direct logit attribution of every head, MLP, the embedding and the biases to the logit difference of
    the two answers at the last token, and the composition scores of every earlier head into every later
    one (:func:`headscope.analysis.circuits.circuits`); writes ``direct_logit_attribution.csv``,
    ``composition.csv``, ``summary.json`` and the figures with their manifests; with ``--corrupted`` also
    ``edges.csv`` (:func:`headscope.analysis.edge_attribution.edge_attribution`, stored with the result) and
    the ``circuit_edges`` graph."""
    formats = check_formats(args.formats)

    import csv
    import json

    import numpy as np

    from headscope.analysis.circuits import circuits, corrupted_ids, load_composition, load_edges, text_ids
    from headscope.analysis.composition import KINDS
    from headscope.app.export import write_files
    from headscope.app.views import names

    store, spec, model = open_store_and_model(args)
    with argument("--text"):
        ids = text_ids(model, args.text)
    with argument("--corrupted"):
        corrupted_ids(model, ids, args.corrupted)
    with argument("--answers"), progress_bar("attribution and composition scores") as bar:
        result = circuits(model, args.text, args.answers, store=store, progress=bar, corrupted=args.corrupted)
    edges = load_edges(store, result.edges_key) if result.edges_key else None
    a = result.attribution
    composition = load_composition(store, result.composition_key)
    out = Path(args.out) if args.out else store.root / "exports" / f"circuits-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "direct_logit_attribution.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["component", "value"])
        writer.writerows([n, repr(float(v))] for n, v in zip(a.names, a.values, strict=True))
    with open(out / "composition.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sender", "receiver", "kind", "score"])
        for kind in KINDS:
            s = composition.of(kind)
            for rl in range(1, model.n_layers):
                for rh in range(model.n_heads):
                    for sl in range(rl):
                        for sh in range(model.n_heads):
                            writer.writerow([f"{sl}.{sh}", f"{rl}.{rh}", kind, f"{float(s[sl, sh, rl, rh]):.6g}"])
    heads = a.heads()
    top = [tuple(int(x) for x in np.unravel_index(int(i), heads.shape)) for i in np.argsort(-np.abs(heads), axis=None)[:10]]
    total = float(a.values.sum())
    summary = {
        "model": model.name, "model_digest": model.digest, "tokens": result.tokens, "answers": list(result.answer_tokens),
        "answer_ids": [a.answer, a.wrong], "position": a.position, "logit_diff": a.logit_diff, "sum_of_values": total,
        "check": {"relative_error": abs(total - a.logit_diff) / max(float(np.abs(a.values).max()), abs(a.logit_diff),
                                                                    1e-12), "tolerance": 1e-4},
        "top_heads": [{"head": f"{la}.{h}", "value": float(heads[la, h])} for la, h in top],
        "result": result.key, "composition": result.composition_key,
    }
    if edges is not None:
        with open(out / "edges.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sender", "receiver", "site", "score"])
            writer.writerows([s, r, site, repr(v)] for s, r, site, v in edges.rows())
        summary["edges"] = {"corrupted": args.corrupted, "corrupted_logit_diff": edges.corrupted, "count": len(edges.scores),
                            "result": result.edges_key,
                            "top": [{"sender": s, "receiver": r, "site": site, "score": v} for s, r, site, v in edges.rows(10)]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    params = {"model": spec, "circuits": result.key[:16], "layer": top[0][0], "head": top[0][1]}
    write_files(None, names.CIRCUIT_DLA, params, out, formats)
    write_files(None, names.CIRCUIT_DLA_OTHERS, params, out, formats)
    write_files(None, names.CIRCUIT_COMPOSITION, params, out, formats)
    if edges is not None:
        write_files(None, names.CIRCUIT_EDGES, params, out, formats)
    first, second = result.answer_tokens
    print(f"logit[{first!r}] - logit[{second!r}] at the last token: {a.logit_diff:.4f}; the "
          f"{len(a.names)} components sum to {total:.4f}")
    print("largest direct effects: " + ", ".join(f"{la}.{h} {heads[la, h]:+.3f}" for la, h in top[:5]))
    print(f"results in {out}")
    return 0


def add_parser(sub) -> None:
    """``headscope circuits``: direct logit attribution and composition scores."""
    about = ("what each head writes towards an answer (direct logit attribution) and which earlier heads feed which "
             "(composition scores: computed once per model, about 20-40 s on the embedded model on two CPU cores, "
             "then read from the store)")
    p = sub.add_parser("circuits", help=about, description=about)
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--text", type=text_arg, required=True, help="the text; the last token's logits are explained")
    p.add_argument("--answers", type=_two_answers, required=True,
                   help="two answer tokens, the expected one first, comma-separated and with their leading space, "
                        "e.g. \" Mary, John\"")
    p.add_argument("--corrupted", type=text_arg,
                   help="a corrupted text of the same token length (e.g. another name): also writes edges.csv, the "
                        "edge attribution score of every sender -> receiver q/k/v/logits edge (Syed et al. 2023)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html",
                   help="figure formats of circuit_dla, circuit_dla_others, circuit_composition and (with "
                        "--corrupted) circuit_edges (default svg,html; none: '')")
    p.set_defaults(func=cmd_circuits)

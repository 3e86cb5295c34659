"""``headscope patch``: activation, attribution and path patching between two prompts."""

from __future__ import annotations

import argparse
from pathlib import Path

from headscope.analysis.patching_choices import DIRECTIONS as PATCH_DIRECTIONS
from headscope.analysis.patching_choices import METRICS as PATCH_METRICS
from headscope.analysis.patching_choices import PATH_SITES
from headscope.analysis.patching_choices import SITES as PATCH_SITES
from headscope.app.cli.arguments import MODEL_HELP, check_formats, folder, layer_head, non_empty, text_arg
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import open_store_and_model
from headscope.app.cli.terminal import progress_bar


def answer_list(text: str) -> list[str]:
    """``--answers``: one or two answers separated by a comma, each kept exactly as typed (an answer
    that follows a space in the text is written with it: ``" Mary, John"``)."""
    items = text.split(",")
    if not 1 <= len(items) <= 2 or not all(item.strip() for item in items):
        raise argparse.ArgumentTypeError("give one or two answer tokens separated by a comma, the clean answer "
                                         "first, e.g. \" Mary, John\"")
    return items


def head_list(text: str) -> list[tuple[int, int]]:
    """``--path-from``, ``--path-to``: heads as layer.head, comma-separated (``0.1,3.2``), read by
    :func:`headscope.analysis.patching_choices.parse_head_pairs` as the Patching page reads them."""
    from headscope.analysis.errors import InputError
    from headscope.analysis.patching_choices import parse_head_pairs

    try:
        return parse_head_pairs(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


def patching_table(summary: dict) -> list[str]:
    """The numbers of a patching's ``summary.json``: the setting, the largest effects and the agreement."""
    lines = [f"{summary['direction']} {summary['site']}: {summary['unit']}",
             f"{summary['metric_label']} {' vs '.join(repr(a) for a in summary['answers'])}: "
             f"clean {summary['clean']:.4f}, corrupted {summary['corrupted']:.4f} (normalised: 1 and 0)"]
    top = summary.get("top_exact") or summary.get("top_attribution") or []
    has_exact, has_attr = "top_exact" in summary, "top_attribution" in summary
    if top:
        lines.append(f"largest effects ({'exact' if has_exact else 'attribution'} patching):")
        width = max(len(r["unit"]) for r in top)
        head = f"{'unit':<{width}}  {'exact':>9}" if has_exact else f"{'unit':<{width}}"
        lines.append(head + (f"  {'attribution':>11}" if has_attr else ""))
        for r in top:
            row = f"{r['unit']:<{width}}"
            if has_exact:
                row += f"  {r['exact']:>9.4f}"
            if has_attr:
                row += f"  {r['attribution']:>11.4f}"
            lines.append(row)
    a = summary.get("agreement")
    if a:
        lines.append(f"attribution vs exact over {a['n_units']} units: Pearson {a['pearson']:.3f}, "
                     f"Spearman {a['spearman']:.3f}, top-{a['k']} overlap {a['overlap']:.0%}")
    times = [f"exact {summary['seconds_exact']:.1f} s"] if has_exact else []
    if has_attr:
        times.append(f"attribution {summary['seconds_attribution']:.2f} s")
    lines.append("time: " + ", ".join(times) + (" (stored result)" if summary.get("reused") else ""))
    return lines


def _patch_prompts(args) -> None:
    """``--pair ID`` (a built-in pair, :mod:`headscope.analysis.patching_pairs`) or ``--clean``, ``--corrupted`` and
    ``--answers``, not both: fills the three from the pair."""
    given = [f"--{name}" for name in ("clean", "corrupted", "answers") if getattr(args, name) is not None]
    if args.pair is not None:
        if given:
            raise UsageError(f"argument --pair: a built-in pair brings its own prompts and answers; drop "
                             f"{', '.join(given)} or --pair")
        from headscope.analysis.patching_pairs import pair_by_id

        with argument("--pair"):
            spec = pair_by_id(args.pair)
        args.clean, args.corrupted, args.answers = spec.clean, spec.corrupted, list(spec.answers)
        return
    for name in ("clean", "corrupted", "answers"):
        if getattr(args, name) is None:
            raise UsageError(f"argument --{name}: required (or --pair ID, one of the built-in prompt pairs)")


def cmd_patch(args) -> int:
    """Activation patching (and attribution patching) between a clean and a corrupted prompt; writes
    the map, the exact-vs-attribution scatter, their tables and ``summary.json``, and prints the top units."""
    _patch_prompts(args)
    if (args.path_from is None) != (args.path_to is None):
        missing = "--path-to" if args.path_to is None else "--path-from"
        raise UsageError(f"argument {missing}: path patching needs both --path-from (senders) and --path-to "
                         f"(receivers)")
    if args.path_from is not None:
        return _cmd_path_patch(args)
    if args.path_site is not None or args.freeze_mlps:
        raise UsageError(f"argument {'--path-site' if args.path_site is not None else '--freeze-mlps'}: only with "
                         f"--path-from and --path-to")
    if args.head is not None and args.site == "resid":
        raise UsageError("argument --head: the residual stream map is already per position; use --site z, q, k or v")
    if args.attribution_only and args.attribution:
        raise UsageError("argument --attribution-only: already includes --attribution")
    formats = check_formats(args.formats)

    import json

    import numpy as np

    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.patching import unit_names

    store, spec, model = open_store_and_model(args)
    from headscope.analysis.patching import activation_patching, load_patching, patching_key, prompt_pair
    from headscope.analysis.patching_choices import METRIC_LABELS

    # Checked in two steps so that the message names the argument to fix: the prompts (lengths,
    # differences) with a placeholder answer, then the answers.
    with argument("--corrupted"):
        prompt_pair(model, args.clean, args.corrupted, [0])
    with argument("--answers"):
        pair = prompt_pair(model, args.clean, args.corrupted, args.answers)
    attribution = args.attribution or args.attribution_only
    exact = not args.attribution_only
    reused = load_patching(store, patching_key(model, pair, args.site, args.direction, args.metric, args.head,
                                               attribution, exact)) is not None
    with progress_bar(f"{args.direction} {args.site}") as bar, argument("--head" if args.head else "--metric"):
        result = activation_patching(model, list(pair.clean_ids), list(pair.corrupted_ids), list(pair.answers),
                                     site=args.site, direction=args.direction, metric=args.metric, head=args.head,
                                     attribution=attribution, exact=exact, store=store, progress=bar)
    out = Path(args.out) if args.out else store.root / "exports" / f"patch-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    params = {"model": spec, "patching": result.key[:16]}
    names_ = unit_names(result)
    summary: dict = {
        "patching": result.key, "pair": args.pair, "model": model.name, "model_digest": model.digest,
        "site": result.site,
        "direction": result.direction, "metric": result.metric, "metric_label": METRIC_LABELS[result.metric],
        "head": list(result.head) if result.head else None, "unit": result.unit,
        "clean_tokens": list(result.pair.clean_tokens), "corrupted_tokens": list(result.pair.corrupted_tokens),
        "differ": list(result.pair.differ), "answers": list(result.pair.answer_tokens),
        "clean": result.clean, "corrupted": result.corrupted, "reused": reused,
    }
    for which, arr in (("exact", result.values), ("attribution", result.attribution)):
        if arr is None:
            continue
        top = result.top_units(10, attribution=which == "attribution")
        flat_index = [int(np.ravel_multi_index(ix, arr.shape)) for ix, _ in top]
        summary[f"top_{which}"] = [
            {"unit": names_[i], "exact": None if result.values is None else float(result.values.ravel()[i]),
             "attribution": None if result.attribution is None else float(result.attribution.ravel()[i])}
            for i in flat_index]
    if result.values is not None:
        summary["seconds_exact"] = result.seconds - result.attribution_seconds
    if result.attribution is not None:
        summary["seconds_attribution"] = result.attribution_seconds
    if result.agreement is not None:
        a = result.agreement
        summary["agreement"] = {"pearson": a.pearson, "spearman": a.spearman, "k": a.k, "overlap": a.overlap,
                                "n_units": a.n_units}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_files(None, names.PATCHING_MAP, {**params, "show": None}, out, formats)
    if result.agreement is not None:
        write_files(None, names.PATCHING_AGREEMENT, params, out, formats)
    for line in patching_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


def _cmd_path_patch(args) -> int:
    """``headscope patch --path-from … --path-to …``: path patching (:func:`headscope.analysis.path_patching.path_patching`);
    prints the value and writes ``summary.json``."""
    for flag, given in (("--head", args.head is not None), ("--attribution", args.attribution),
                        ("--attribution-only", args.attribution_only), ("--site", args.site != "z")):
        if given:
            raise UsageError(f"argument {flag}: not with path patching (--path-from, --path-to; the receivers' "
                             f"input is --path-site)")
    import json

    from headscope.analysis.errors import check_head_index
    from headscope.analysis.patching_choices import KV_SITES, METRIC_LABELS

    site = args.path_site or "q"
    store, spec, model = open_store_and_model(args)
    from headscope.analysis.patching import patching_metric, prompt_pair
    from headscope.analysis.path_patching import path_patching
    from headscope.analysis.store import content_key

    with argument("--path-from"):
        for layer, head in args.path_from:
            check_head_index(model.n_layers, model.n_heads, layer, head)
    with argument("--path-to"):
        n = model.n_kv_heads if site in KV_SITES else model.n_heads
        for layer, head in args.path_to:
            check_head_index(model.n_layers, n, layer, head)
    with argument("--corrupted"):
        prompt_pair(model, args.clean, args.corrupted, [0])
    with argument("--answers"):
        pair = prompt_pair(model, args.clean, args.corrupted, args.answers)
    with argument("--metric"):
        patching_metric(args.metric, pair.answers)
    with argument("--path-to"):
        result = path_patching(model, args.clean, args.corrupted, args.answers, args.path_from, args.path_to,
                               site=site, direction=args.direction, metric=args.metric, freeze_mlps=args.freeze_mlps)
    key = content_key("path-patching", model.digest, list(result.pair.clean_ids), list(result.pair.corrupted_ids),
                      list(result.pair.answers), result.senders, result.receivers, site, result.direction,
                      result.metric, result.freeze_mlps)
    out = Path(args.out) if args.out else store.root / "exports" / f"path-{key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    senders = ",".join(f"{la}.{h}" for la, h in result.senders)
    receivers = ",".join(f"{la}.{h}" for la, h in result.receivers)
    summary = {
        "path_patching": {"senders": [list(h) for h in result.senders], "receivers": [list(h) for h in result.receivers],
                          "site": site, "freeze_mlps": result.freeze_mlps},
        "pair": args.pair, "model": model.name, "model_digest": model.digest, "direction": result.direction,
        "metric": result.metric, "metric_label": METRIC_LABELS[result.metric],
        "clean_tokens": list(result.pair.clean_tokens), "corrupted_tokens": list(result.pair.corrupted_tokens),
        "differ": list(result.pair.differ), "answers": list(result.pair.answer_tokens),
        "clean": result.clean, "corrupted": result.corrupted, "patched": result.raw, "value": result.value,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    kv = " (key-value heads)" if site in KV_SITES else ""
    print(f"path patching, {result.direction}: {senders} -> {site} of {receivers}{kv}"
          f"{', MLPs frozen' if result.freeze_mlps else ''}")
    print(f"{METRIC_LABELS[result.metric]} {' vs '.join(repr(a) for a in result.pair.answer_tokens)}: "
          f"clean {result.clean:.4f}, corrupted {result.corrupted:.4f}, patched {result.raw:.4f}")
    print(f"value {result.value:.4f} (0 = corrupted, 1 = clean)")
    print(f"results in {out}")
    return 0


def add_parser(sub) -> None:
    """``headscope patch``: activation and attribution patching (:func:`headscope.analysis.patching.activation_patching`)."""
    p = sub.add_parser("patch", help="activation patching between a clean and a corrupted prompt: which heads "
                                     "(or residual positions) carry the answer")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--pair", type=non_empty("the pair id"),
                   help="a built-in prompt pair (data/patching/pairs.json: IOI name swaps, factual recall, "
                        "induction), instead of --clean, --corrupted and --answers")
    p.add_argument("--clean", type=text_arg, help="the clean prompt")
    p.add_argument("--corrupted", type=text_arg,
                   help="the corrupted prompt: the same number of tokens (e.g. a name swapped)")
    p.add_argument("--answers", type=answer_list,
                   help="the clean answer token, then the corrupted one, comma-separated and with their leading "
                        "space, e.g. \" Mary, John\"")
    p.add_argument("--site", choices=PATCH_SITES, default="z",
                   help="z: head outputs; q: queries; k, v: keys, values (per key-value head); resid: the "
                        "residual stream, layer × position (default z)")
    p.add_argument("--direction", choices=PATCH_DIRECTIONS, default="denoise",
                   help="denoise: clean activations into the corrupted run; noise: the reverse (default denoise)")
    p.add_argument("--metric", choices=PATCH_METRICS, default="logit_diff",
                   help="logit difference of the two answers, or the loss on the clean answer")
    p.add_argument("--head", type=layer_head, help="patch this head (layer.head) one position at a time")
    p.add_argument("--attribution", action="store_true",
                   help="also attribution patching (one forward and one backward pass) and its agreement")
    p.add_argument("--attribution-only", action="store_true", help="attribution patching alone (fast)")
    p.add_argument("--path-from", type=head_list,
                   help="path patching (Wang et al. 2022): sender heads layer.head, comma-separated; with --path-to")
    p.add_argument("--path-to", type=head_list,
                   help="path patching: receiver heads layer.head (key-value heads for --path-site k or v)")
    p.add_argument("--path-site", choices=PATH_SITES,
                   help="path patching: the receivers' input the path ends in: q, k or v (default q)")
    p.add_argument("--freeze-mlps", action="store_true",
                   help="path patching: freeze the MLPs too (only direct sender -> receiver paths; default: "
                        "MLPs recomputed, as in Wang et al.)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_patch)

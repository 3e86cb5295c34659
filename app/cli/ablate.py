"""``headscope ablate``: ablate heads; effects on a text, NIAH accuracy and the top-k vs random curve."""

from __future__ import annotations

import argparse
from pathlib import Path

from headscope.analysis.ablation_choices import (
    CONTROL_TOP_N,
    DEFAULT_METHOD,
    DEFAULT_SEEDS,
    MAX_SEEDS,
    METHODS,
)
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.cli.arguments import (
    MODEL_HELP,
    check_formats,
    count,
    folder,
    haystack,
    non_empty,
    number_list,
    read_text_file,
    text_arg,
    text_file,
)
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import model_spec, open_store_and_model
from headscope.app.cli.niah import (
    add_niah_options,
    checked_depth_rule,
    chosen_needles,
    depth_percents,
    haystack_text,
    niah_sweep,
    token_counts,
)
from headscope.app.cli.terminal import progress_bar


def _check_ablate_args(args) -> None:
    """What ``ablate`` can check before anything is imported: which options go together."""
    if bool(args.heads) == bool(args.top_k):
        raise UsageError("choose the heads with exactly one of --heads (e.g. 12.3,14.1) and --top-k N --by SCORE")
    if args.text is not None and args.file:
        raise UsageError("give the text either with --text or with --file, not both")
    if args.text is None and not args.file and not args.sweep:
        raise UsageError("say what to measure on: --text, --file, or --sweep (needle-in-a-haystack prompts)")
    if not args.sweep:
        given = [flag for flag, value in (("--lengths", args.lengths), ("--depths", args.depths),
                                          ("--needles", args.needles), ("--needles-file", args.needles_file),
                                          ("--haystack", args.haystack), ("--depth-rule", args.depth_rule),
                                          ("--stop-at-newline", args.stop_at_newline)) if value]
        if given:
            raise UsageError(f"argument {given[0]}: only used with --sweep")
    if args.top_k:
        if args.by == "retrieval" and not args.sweep:
            raise UsageError("argument --by: --by retrieval needs --sweep (the retrieval scores come from its trials)")
        if args.by != "retrieval" and args.text is None and not args.file:
            raise UsageError(f"argument --by: --by {args.by} is computed on a text: give --text or --file")
    if args.curve and not args.top_k:
        raise UsageError("argument --curve: needs --top-k and --by (the score whose top heads are ablated)")
    if args.method == "resample" and not args.source:
        raise UsageError("argument --source: --method resample needs --source TEXT "
                         "(the input whose head outputs are patched in)")
    if args.source and args.method != "resample":
        raise UsageError("argument --source: only used with --method resample")
    if args.reference_file and args.method != "mean":
        raise UsageError("argument --reference-file: only used with --method mean")


def ablation_table(summary: dict) -> list[str]:
    """The numbers of an ablation's ``summary.json`` as a readable table, one line per row."""
    lines = [f"ablated {len(summary['heads'].split(','))} heads ({summary['heads']}) by {summary['method']}: "
             f"{summary.get('method_does', '')}".rstrip(": ")]
    rows: list[tuple[str, str, str, str]] = []
    if "text" in summary and summary["text"]:
        t = summary["text"]
        rows.append(("mean loss on the text (nats)", f"{t['mean_loss_clean']:.4f}", f"{t['mean_loss_ablated']:.4f}",
                     f"{t['d_loss']:+.4f}"))
        rows.append((f"p(next token {t['target_token']!r})", f"{t['target_prob_clean']:.4f}",
                     f"{t['target_prob_ablated']:.4f}", f"{t['d_p_next']:+.4f}"))
    if "niah" in summary:
        n = summary["niah"]
        rows.append((f"NIAH accuracy ({n['n_prompts']} prompts)", f"{n['accuracy_clean']:.3f}",
                     f"{n['accuracy_ablated']:.3f}", f"{n['accuracy_ablated'] - n['accuracy_clean']:+.3f}"))
        if "accuracy_clean_low" in n:
            rows.append(("  95 % Wilson interval", _interval(n, "accuracy_clean"), _interval(n, "accuracy_ablated"),
                         ""))
    if rows:
        width = max(len(r[0]) for r in rows)
        cols = [max(len(r[i]) for r in rows + [("", "clean", "ablated", "change")]) for i in (1, 2, 3)]
        lines.append(f"{'':<{width}}  {'clean':>{cols[0]}}  {'ablated':>{cols[1]}}  {'change':>{cols[2]}}")
        lines += [f"{r[0]:<{width}}  {r[1]:>{cols[0]}}  {r[2]:>{cols[1]}}  {r[3]:>{cols[2]}}".rstrip() for r in rows]
    t = summary.get("text") or {}
    for which in ("clean", "ablated"):
        if f"continuation_{which}" in t:
            shown = repr(t[f"continuation_{which}"])
            lines.append(f"continuation, {which + ':':<8} {shown if len(shown) <= 80 else shown[:77] + '...'}")
    if "curve" in summary:
        lines += _curve_table(summary["curve"])
    return lines


def _interval(numbers: dict, name: str) -> str:
    """``[low, high]`` of ``name``'s interval columns."""
    return f"[{numbers[f'{name}_low']:.3f}, {numbers[f'{name}_high']:.3f}]"


def _curve_table(c: dict) -> list[str]:
    """The curve of ``summary.json`` as table lines: a loss curve's random control as mean ± std over
    seeds; an accuracy curve's points with their 95 % Wilson intervals (the random control's pooled over
    all seeds' prompts) and the lowest and highest seed."""
    outside = f" from outside the top {c['random_outside_top']}" if c.get("random_outside_top") else ""
    n = f" on {c['n_prompts']} prompts" if c.get("n_prompts") else ""
    lines = [f"top-k vs random curve: {c['metric']}{n} with the top k heads by {c['by_label']} ablated, "
             f"and k random heads{outside} ({c['n_seeds']} sets)"]
    if not c.get("n_prompts"):
        lines.append(f"{'k':>5}  {'top-k':>10}  {'random mean':>12}  {'± std':>8}")
        for k, top, mean, std in zip(c["k"], c["top"], c["random_mean"], c["random_std"], strict=True):
            lines.append(f"{k:>5}  {top:>10.4f}  {mean:>12.4f}  {std:>8.4f}")
        return lines
    lines.append(f"{'k':>5}  {'top-k':>6}  {'95 % Wilson':>14}  {'random':>6}  {'95 % Wilson (all seeds)':>23}  "
                 f"{'seeds low-high':>14}")
    for j, k in enumerate(c["k"]):
        lines.append(f"{k:>5}  {c['top'][j]:>6.3f}  {_pair(c['top_low'][j], c['top_high'][j]):>14}  "
                     f"{c['random_pooled'][j]:>6.3f}  {_pair(c['random_pooled_low'][j], c['random_pooled_high'][j]):>23}"
                     f"  {_pair(c['random_seed_low'][j], c['random_seed_high'][j]):>14}")
    return lines


def _pair(low, high) -> str:
    return "-" if low is None or high is None or low != low or high != high else f"[{low:.3f}, {high:.3f}]"


def _prepared(model, args, heads, store, reference):
    """The ablation of ``--method`` on ``heads`` with the reference means or source run it needs, stored
    (:func:`headscope.analysis.ablation_effects.prepare`), and the page parameters naming it."""
    from headscope.analysis.ablation import format_heads
    from headscope.analysis.ablation_effects import prepare

    where = {"resample": "--source", "mean": "--reference-file"}.get(args.method, "--method")
    with progress_bar("reference means", enabled=None if args.method == "mean" else False) as bar, argument(where):
        prepared = prepare(model, heads, args.method, source=args.source, reference=reference or None, store=store,
                           progress=bar)
    params = {"model": model_spec(args), "heads": format_heads(heads), "ablate": args.method}
    if prepared.means_key:
        params["ref"] = prepared.means_key[:16]
    if prepared.source_key:
        params["source"] = prepared.source_key[:16]
    return prepared, params


def _niah_accuracy(model, spec, result, needles, lengths, depths) -> dict:
    """NIAH accuracy on the sweep's prompts, clean and with ``spec`` ablated, for ``summary.json``."""
    from headscope.analysis.ablation import ablation_hooks
    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.retrieval import trial_prompt

    prompts = [trial_prompt(t) for t in result.trials]
    with progress_bar("retrieval accuracy, clean and ablated") as bar:
        clean = retrieval_accuracy(model, prompts)
        bar(0.5)
        ablated = retrieval_accuracy(model, prompts, ablation_hooks(model, spec))
    return {"sweep": result.key, "needles": [n.id for n in needles], "lengths": lengths, "depths": depths,
            "n_prompts": len(prompts), **clean.proportion().columns("accuracy_clean"),
            **ablated.proportion().columns("accuracy_ablated"), "responses_ablated": ablated.responses}


def _curve_intervals(curve) -> dict:
    """An accuracy curve's n and 95 % intervals for ``summary.json`` (a loss curve has none): per k, the
    top-k Wilson interval; the random control's prompts of all seeds pooled, with its Wilson interval;
    and its seed band (lowest and highest seed)."""
    if curve.n_prompts is None:
        return {}
    top, pooled, band = curve.top_accuracy(), curve.random_pooled(), curve.random_band()
    return {"n_prompts": curve.n_prompts, "top_n": [p.n for p in top], "top_low": [p.low for p in top],
            "top_high": [p.high for p in top], "random_pooled": [p.value for p in pooled],
            "random_pooled_n": [p.n for p in pooled], "random_pooled_low": [p.low for p in pooled],
            "random_pooled_high": [p.high for p in pooled], "random_seed_low": [b.low for b in band],
            "random_seed_high": [b.high for b in band], "interval": "95 % Wilson score; seed band: lowest-highest seed"}


def cmd_ablate(args) -> int:
    """Ablate heads: effects on a text, retrieval accuracy on a needle-in-a-haystack sweep, and the
    top-k vs random curve; writes tables (CSV, JSON) and figures, and prints the numbers as a table."""
    _check_ablate_args(args)
    text = read_text_file(args.file) if args.file else args.text
    reference = None
    if args.reference_file:
        reference = [t for t in read_text_file(args.reference_file).splitlines() if t.strip()]
    formats = check_formats(args.formats)
    needles = hay = None
    if args.sweep:
        needles, hay = chosen_needles(args), haystack_text(args)
        checked_depth_rule(args)

    import json

    import numpy as np

    from headscope.analysis.ablation import LIMIT as ABLATION_LIMIT
    from headscope.analysis.ablation import METHOD_DESCRIPTIONS, format_heads, parse_heads
    from headscope.analysis.ablation_curve import ablation_curve, check_curve, rank_heads
    from headscope.analysis.ablation_effects import effects_on
    from headscope.analysis.capture import capture
    from headscope.analysis.errors import InputError
    from headscope.analysis.limits import limit
    from headscope.analysis.store import content_key
    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.ablation import remember_effects
    from headscope.app.views.registry import metric_scores

    lengths, depths = args.lengths or [512], args.depths or [25.0, 75.0]
    store, spec_name, model = open_store_and_model(args)
    n_heads = model.n_layers * model.n_heads
    if args.top_k and args.top_k > n_heads:
        raise UsageError(f"argument --top-k: must be at most {n_heads} (the heads of {spec_name}), got {args.top_k}")
    if args.curve:
        with argument("--curve"):  # checked before any long work
            check_curve(model, args.curve, args.seeds, args.control_top)
    with argument("--heads"):
        heads = parse_heads(model, args.heads) if args.heads else None
    with argument("--file" if args.file else "--text"):
        run = capture(model, text, store=store, max_tokens=limit(ABLATION_LIMIT),
                      max_tokens_variable=ABLATION_LIMIT) if text else None
    result = niah_sweep(model, args, store, needles, hay, lengths, depths) if args.sweep else None
    scores, by_label = None, ""  # the scores heads are ranked by
    if args.top_k:
        if args.by == "retrieval":
            scores, by_label = np.nan_to_num(result.scores, nan=0.0), "Retrieval score"
        else:
            scores, by_label = metric_scores(run, args.by), HEAD_SCORES[args.by].label
        heads = rank_heads(scores)[: args.top_k]
        if len(heads) < args.top_k:
            raise InputError(f"Only {len(heads)} heads have a {by_label} here; --top-k must be at most that.")
    prepared, params = _prepared(model, args, heads, store, reference)
    spec = prepared.spec
    out = Path(args.out) if args.out else store.root / "exports" / f"ablate-{content_key(params)[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": model.name, "model_digest": model.digest, "heads": format_heads(heads),
                     "method": args.method, "method_does": METHOD_DESCRIPTIONS[args.method],
                     "by": args.by if args.top_k else None}
    if run is not None:
        with progress_bar("effects on the text") as bar:
            applied = effects_on(model, run, prepared, progress=bar)
        remember_effects(run, params, applied)  # the export draws it, not computing it again
        fig_rows = write_files(run, names.ABLATION_EFFECTS, params, out, formats)
        rows = json.loads(fig_rows[-2].read_text()) if fig_rows else []
        summary["text"] = {**rows[-1], "d_loss": applied.d_loss, "d_p_next": applied.d_p_next} if rows else {}
    if result is not None:
        summary["niah"] = _niah_accuracy(model, spec, result, needles, lengths, depths)
    if args.curve:
        seeds = list(range(args.seeds))
        with progress_bar(f"top-k vs random curve ({len(set(args.curve))} k × {1 + len(seeds)} sets)") as bar:
            key, curve, meta = ablation_curve(model, scores, args.curve, spec, store, on=result or run,
                                              by_label=by_label, seeds=seeds, outside_top=args.control_top,
                                              source_id=params.get("source"), progress=bar)
        write_files(None, names.ABLATION_CURVE, {**params, "curve": key[:16]}, out, formats)
        summary["curve"] = {"k": curve.k_values, "top": curve.top.tolist(), "random": curve.random.tolist(),
                            "random_mean": curve.random_mean.tolist(), "random_std": curve.random_std.tolist(),
                            "metric": meta["metric_label"], "by_label": by_label, "n_seeds": len(seeds),
                            "random_outside_top": curve.outside_top,
                            "top_heads": format_heads(curve.order[: max(curve.k_values)]), **_curve_intervals(curve)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for line in ablation_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


BY_HELP = f"retrieval (needs --sweep) or a per-head score on the text: {', '.join(RUN_SCORES)}"


def rank_score(text: str) -> str:
    """``--by``: ``retrieval`` (a sweep's) or a per-head score of the text."""
    if text != "retrieval" and text not in RUN_SCORES:
        raise argparse.ArgumentTypeError(f"unknown score {text[:40]!r}; use retrieval or one of {', '.join(RUN_SCORES)}")
    return text


def add_parser(sub) -> None:
    """``headscope ablate``: which heads, how, and on what."""
    p = sub.add_parser("ablate", help="ablate heads: effects on a text or on needle-in-a-haystack retrieval, "
                                      "and the top-k vs random curve")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--heads", help="e.g. 12.3,14.1 or kv:20.1 (a key-value group) or 7.* (a layer)")
    p.add_argument("--top-k", type=count(1), help="ablate the k heads with the highest --by score")
    p.add_argument("--by", default="retrieval", type=rank_score, help=BY_HELP)
    p.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS)
    p.add_argument("--text", type=text_arg)
    p.add_argument("--file", type=text_file, help="read the text from a UTF-8 file")
    p.add_argument("--source", type=text_arg, help="resample: the text whose head outputs are patched in")
    p.add_argument("--reference-file", type=text_file,
                   help="mean: reference texts, one per line (default: built-in sentences)")
    p.add_argument("--sweep", action="store_true", help="measure needle-in-a-haystack retrieval accuracy")
    p.add_argument("--lengths", type=token_counts, help="--sweep: context lengths in tokens (default 512)")
    p.add_argument("--depths", type=depth_percents, help="--sweep: needle depths in percent (default 25,75)")
    p.add_argument("--needles", default="", help="--sweep: needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file,
                   help="--sweep: a JSON file of needles (fields: needle, question, answer)")
    p.add_argument("--haystack", type=haystack, help="--sweep: prose (default), passkey, or a UTF-8 text file")
    add_niah_options(p, "--sweep: ")
    p.add_argument("--curve", type=number_list(int, 0, what="head counts"),
                   help="k values for the top-k vs random curve, e.g. 0,5,10,20")
    p.add_argument("--seeds", type=count(1, MAX_SEEDS), default=DEFAULT_SEEDS,
                   help=f"random head sets per k (1 to {MAX_SEEDS})")
    p.add_argument("--control-top", type=count(0), default=CONTROL_TOP_N,
                   help="--curve: the random heads are drawn from outside the top N heads by the score "
                        f"(default {CONTROL_TOP_N}; at least the largest k)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_ablate)

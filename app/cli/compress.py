"""``headscope compress``: KV-cache compression policies from head classes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headscope.analysis.ablation_choices import DEFAULT_SEEDS, MAX_SEEDS
from headscope.analysis.kv_compression_choices import BACKENDS as COMPRESS_BACKENDS
from headscope.analysis.kv_compression_choices import DEFAULT_FRACTIONS as COMPRESS_FRACTIONS
from headscope.analysis.kv_compression_choices import DEFAULT_RANKINGS as COMPRESS_RANKINGS
from headscope.analysis.kv_compression_choices import (
    DEFAULT_RECENT_SIZE,
    DEFAULT_SINK_SIZE,
    DEFAULT_TOLERANCE,
)
from headscope.analysis.kv_compression_choices import RANKINGS as COMPRESS_RANKING_NAMES
from headscope.analysis.long_context_tasks import DEFAULT_MIN_RATE, MAX_PER_TASK, TASKS, TaskSuite
from headscope.analysis.long_context_tasks import MAX_LENGTH as TASK_MAX_LENGTH
from headscope.analysis.long_context_tasks import MIN_LENGTH as TASK_MIN_LENGTH
from headscope.app.cli.arguments import (
    MODEL_HELP,
    ascii_number,
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
from headscope.app.cli.loading import open_store_and_model
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


def ranking_list(text: str) -> list[str]:
    """``--rankings``: names of :data:`headscope.analysis.kv_compression_choices.RANKINGS`, comma-separated."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not items:
        raise argparse.ArgumentTypeError(f"give one or more rankings separated by commas, from "
                                         f"{', '.join(COMPRESS_RANKING_NAMES)}")
    unknown = [x for x in items if x not in COMPRESS_RANKING_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ranking(s) {', '.join(unknown)}; choose from "
                                         f"{', '.join(COMPRESS_RANKING_NAMES)}")
    return items


def task_list(text: str) -> list[str]:
    """``--tasks``: names of :data:`headscope.analysis.long_context_tasks.TASKS`, comma-separated."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in items if x not in TASKS]
    if not items or unknown:
        said = f"unknown task(s) {', '.join(unknown)}; " if unknown else ""
        raise argparse.ArgumentTypeError(f"{said}give one or more tasks separated by commas, from {', '.join(TASKS)}")
    return items


def share(text: str) -> float:
    """A number in [0, 1] (a tolerance on an accuracy)."""
    try:
        v = ascii_number(text, float)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not 0 <= v <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def export_choice(text: str) -> tuple[str, float | None, int | None]:
    """``--export RANKING[:FRACTION[:SEED]]``."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or parts[0] not in COMPRESS_RANKING_NAMES:
        raise argparse.ArgumentTypeError(f"write RANKING:FRACTION (e.g. retrieval:0.25, random:0.5:1 for a seed, "
                                         f"or all_streaming), with RANKING one of {', '.join(COMPRESS_RANKING_NAMES)}")
    try:
        fraction = ascii_number(parts[1], float) if len(parts) > 1 else None
        seed = ascii_number(parts[2]) if len(parts) > 2 else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; the fraction must be a number and the seed a whole number") from None
    if fraction is not None and not 0 <= fraction <= 1:
        raise argparse.ArgumentTypeError(f"the fraction must be between 0 and 1, got {parts[1]}")
    return parts[0], fraction, seed


def _check_compress_args(args) -> None:
    """What ``compress`` can check before anything is imported."""
    if args.text is not None and args.file:
        raise UsageError("give the text either with --text or with --file, not both")
    lengths = args.lengths or [2048]
    if args.tasks and not all(TASK_MIN_LENGTH <= n <= TASK_MAX_LENGTH for n in lengths):
        raise UsageError(f"argument --lengths: the task suite (--tasks) is built at {TASK_MIN_LENGTH:,} to "
                         f"{TASK_MAX_LENGTH:,} tokens, got {','.join(map(str, lengths))}")
    if args.sink + args.recent >= min(lengths):
        raise UsageError(f"argument --sink/--recent: S + W = {args.sink + args.recent} keeps every key of a "
                         f"{min(lengths)}-token prompt (nothing to compress, and no rows for the streaming score); "
                         "keep it below the shortest of --lengths")
    if args.export:
        ranking, fraction, seed = args.export
        if ranking not in args.rankings:
            raise UsageError(f"argument --export: {ranking} is not among --rankings ({', '.join(args.rankings)})")
        if fraction is not None and ranking not in ("all_full", "all_streaming") and fraction not in args.fractions:
            raise UsageError(f"argument --export: fraction {fraction:g} is not among --fractions "
                             f"({','.join(f'{f:g}' for f in args.fractions)})")
        if seed is not None and (ranking != "random" or not 0 <= seed < args.seeds):
            raise UsageError(f"argument --export: a seed is only for random, from 0 to {args.seeds - 1}")


def compression_table(summary: dict) -> list[str]:
    """The rows of a compression evaluation's ``summary.json`` as a readable table: each NIAH accuracy with
    its 95 % Wilson interval and n, the random ranking's seed band per fraction, and per ranking the
    smallest KV fraction within the tolerance (decided on the intervals) with the n it rests on."""
    from headscope.app.views.compress import decision_text

    def num(x, fmt):
        return "—" if x is None or x != x else format(x, fmt)

    def niah(r):
        if not r.get("niah_accuracy_n"):
            return num(r["niah_accuracy"], ".2f")
        return f"{r['niah_accuracy']:.2f} [{r['niah_accuracy_low']:.2f}, {r['niah_accuracy_high']:.2f}]"

    b = summary["baseline"]
    lines = [f"KV cache policies on {summary['model']}: streaming groups keep S={summary['sink_size']} sinks + "
             f"W={summary['recent_size']} recent tokens; KV memory for {b['kv_tokens']:,} tokens "
             f"(full: {b['kv_full_bytes'] / 2**20:.1f} MiB); loss and agreement on {summary['n_texts']} text(s), "
             f"NIAH accuracy on {summary['n_prompts']} prompt(s)"]
    head = ("ranking", "seed", "full", "KV frac", "KV MiB", "loss", "agree", "NIAH [95% CI]", "n")
    rows = [("uncompressed", "", "1.00", "1.000", f"{b['kv_bytes'] / 2**20:.1f}", num(b["loss"], ".4f"),
             num(b["agreement"], ".3f"), niah(b), str(b.get("niah_accuracy_n") or 0))]
    for r in summary["rows"]:
        rows.append((r["ranking"], "" if r["seed"] is None else str(r["seed"]), f"{r['fraction_full']:.2f}",
                     f"{r['kv_fraction']:.3f}", f"{r['kv_bytes'] / 2**20:.1f}", num(r["loss"], ".4f"),
                     num(r["agreement"], ".3f"), niah(r), str(r.get("niah_accuracy_n") or 0)))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                    strict=True))))
    for band in summary.get("seed_bands", []):
        lines.append(f"{band['ranking']} at fraction full {band['fraction_full']:.2f}: NIAH over {band['n_seeds']} "
                     f"seeds mean {num(band['niah_accuracy_seed_mean'], '.2f')}, lowest "
                     f"{num(band['niah_accuracy_seed_low'], '.2f')}, highest {num(band['niah_accuracy_seed_high'], '.2f')}")
    tol = summary["tolerance"]
    for ranking, best in summary["smallest_within_tolerance"].items():
        lines.append(decision_text(ranking, tol, best, summary["n_prompts"]))
    lines.append("within tolerance: a policy's 95 % interval reaches the uncompressed one's lower bound less the "
                 "tolerance (random: every seed's)")
    if not summary["complete"]:
        lines.append("cancelled: the table holds the policies that finished")
    return lines


def cmd_compress(args) -> int:
    """KV-cache compression from head classes: evaluate policies (ranking × fraction kept full) against
    the uncompressed model; writes compress.csv, summary.json, policies.json and a DuoAttention pattern
    folder, and prints the table."""
    _check_compress_args(args)
    text = read_text_file(args.file) if args.file else args.text
    formats = check_formats(args.formats)
    needles, hay = chosen_needles(args), haystack_text(args)
    checked_depth_rule(args)

    import csv
    import json

    import numpy as np

    from headscope.analysis.capture import tokenize_input
    from headscope.analysis.kv_compression_sweep import compress_sweep
    from headscope.analysis.pattern_folder import curve_priority, export_policy
    from headscope.analysis.store import content_key
    from headscope.app.export import write_files
    from headscope.app.views import names
    from headscope.app.views.compress import pick_text

    lengths, depths = args.lengths or [2048], args.depths or [25.0, 75.0]
    store, spec, model = open_store_and_model(args)
    with argument("--file" if args.file else "--text"):
        text_ids = tokenize_input(model, text, model.n_ctx) if text else None
    result = niah_sweep(model, args, store, needles, hay, lengths, depths)
    if not result.trials:
        print("headscope compress: no trial finished", file=sys.stderr)
        return 1
    texts = [text_ids] if text_ids else None
    suite, n_prompts = task_suite(args, model, store, lengths)
    seeds = list(range(args.seeds))
    n_policies = sum(1 if r.startswith("all_") else len(args.fractions) * (len(seeds) if r == "random" else 1)
                     for r in args.rankings)
    with progress_bar(f"{n_policies} policies on {n_prompts or len(result.trials)} prompts") as bar, \
            argument("--rankings/--fractions"):
        stored = compress_sweep(model, result, args.rankings, args.fractions, seeds=seeds, sink_size=args.sink,
                                recent_size=args.recent, texts=texts, backend=args.backend, suite=suite,
                                store=store, progress=bar)
    curve = stored.curve
    key = content_key("compress", result.key, args.rankings, curve.meta["fractions"], seeds, args.sink,
                      args.recent, texts, *([args.backend] if args.backend != "auto" else []),
                      *([suite.key()] if suite else []))
    out = Path(args.out) if args.out else store.root / "exports" / f"compress-{key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    rows = curve.rows()
    with open(out / "compress.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(curve.baseline.row()))
        writer.writeheader()
        writer.writerows(rows)
    best = {r: curve.smallest_within(r, args.tolerance) for r in args.rankings if r not in ("all_full",)}
    if args.export:
        chosen = curve.find(*args.export)
    else:  # the first score ranking's smallest policy within the tolerance, else its largest
        named = [r for r in args.rankings if r not in ("random", "all_full", "all_streaming")] or list(args.rankings)
        chosen = best.get(named[0]) or max((e for e in curve.evaluations if e.policy.ranking == named[0]),
                                           key=lambda e: e.memory.fraction, default=None)
    pattern = None
    if chosen is not None:
        pattern = out / "pattern"
        exported = export_policy(chosen.policy, pattern, model_name=model.name,
                                 priority=curve_priority(curve, chosen.policy))

    def finite(x):
        return None if x is None or x != x else x

    summary = {
        "model": model.name, "model_digest": model.digest, "sweep": result.key, "lengths": lengths, "depths": depths,
        "needles": [n.id for n in needles], "sink_size": args.sink, "recent_size": args.recent,
        "rankings": args.rankings, "fractions": curve.meta["fractions"], "seeds": seeds,
        "n_texts": curve.n_texts, "n_prompts": curve.n_prompts, "text": "given" if text_ids else "sweep prompts",
        "layout": curve.meta["layout"], "dtype_bytes": curve.meta["dtype_bytes"], "complete": curve.complete,
        "tolerance": args.tolerance, "backend": curve.meta["backend"],
        "baseline": {k: finite(v) for k, v in curve.baseline.row().items()},
        "rows": [{k: finite(v) for k, v in r.items()} for r in rows],
        "smallest_within_tolerance": {r: (None if e is None else {k: finite(v) for k, v in e.row().items()})
                                      for r, e in best.items()},
        "tolerance_rule": "niah_accuracy_high >= uncompressed niah_accuracy_low - tolerance (95 % Wilson "
                          "intervals; random: every seed)",
        "seed_bands": [{k: finite(v) for k, v in band.items()} for band in curve.seed_bands()],
        "exported": None if chosen is None else {"folder": str(pattern), **chosen.row()},
    }
    if suite is not None:  # each task's uncompressed answer rate, and whether it was dropped
        summary["tasks"] = {t: {k: finite(v) for k, v in r.items()} for t, r in curve.meta["tasks"].items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "policies.json").write_text(json.dumps([e.policy.to_json() for e in curve.evaluations]))
    np.savetxt(out / "retrieval_group_max.csv", result.group_max, delimiter=",", fmt="%.6f")
    if stored.key:  # the figures read the stored curve (a cancelled one is not stored)
        params = {"model": spec, "compress": stored.key[:16], "tolerance": args.tolerance,
                  "pick": None if chosen is None else pick_text(chosen)}
        write_files(None, names.COMPRESSION_PARETO, params, out, formats)
        if chosen is not None:
            write_files(None, names.COMPRESSION_POLICY, params, out, formats)
    for line in compression_table(summary):
        print(line)
    if chosen is not None:
        p = chosen.policy
        print(f"pattern folder ({p.ranking}{'' if p.seed is None else f' seed {p.seed}'}, fraction full "
              f"{p.fraction:g}, KV fraction {chosen.memory.fraction:.3f}): {pattern}")
        print(f"  {', '.join(path.name for path in exported)} (head_scores.npy: kvpress DuoAttentionPress' scores, "
              f"head_compression_ratio {1 - p.full_share:.6g})")
    print(f"results in {out}")
    return 0


def task_suite(args, model, store, lengths: list[int]) -> tuple[TaskSuite | None, int]:
    """``--tasks``: the suite asked for and the number of its prompts kept; prints every task's uncompressed
    answer rate (stored, so the evaluation that follows reads it back) and the tasks dropped."""
    if not args.tasks:
        return None, 0
    from headscope.analysis.long_context_tasks import measured_suite

    suite = TaskSuite(tuple(args.tasks), tuple(lengths), args.per_task, args.task_seed, args.min_rate)
    with argument("--tasks"):
        n = len(suite.tasks) * len(set(lengths)) * suite.n_per_task
        with progress_bar(f"uncompressed answers on {n} task prompts") as bar:
            measured = measured_suite(model, suite, store, progress=bar)
    print(f"task suite at {','.join(map(str, lengths))} tokens, {args.per_task} prompt(s) per task and length "
          f"(seed {args.task_seed}): uncompressed answer rate [95% Wilson], tasks below {args.min_rate:g} dropped")
    for task, rate in measured.rates.items():
        print(f"  {task:<18} {rate.text()}{'  dropped' if task in measured.dropped else ''}")
    return suite, len(measured.kept)


def add_parser(sub) -> None:
    """``headscope compress``: rankings, fractions, the sweep and the export."""
    p = sub.add_parser("compress", help="KV-cache compression from head classes: evaluate full/streaming policies "
                                        "per KV group (DuoAttention) by ranking and fraction kept full")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--rankings", type=ranking_list, default=list(COMPRESS_RANKINGS),
                   help=f"how KV groups are ranked, from {', '.join(COMPRESS_RANKING_NAMES)} "
                        f"(default {','.join(COMPRESS_RANKINGS)})")
    p.add_argument("--fractions", type=number_list(float, 0, 1, what="fractions"), default=list(COMPRESS_FRACTIONS),
                   help="shares of KV groups kept full, e.g. 0.1,0.25,0.5")
    p.add_argument("--seeds", type=count(1, MAX_SEEDS), default=DEFAULT_SEEDS, help="random policies per fraction")
    p.add_argument("--sink", type=count(0), default=DEFAULT_SINK_SIZE,
                   help=f"S: first tokens a streaming group keeps (default {DEFAULT_SINK_SIZE}, DuoAttention's)")
    p.add_argument("--recent", type=count(1), default=DEFAULT_RECENT_SIZE,
                   help=f"W: recent tokens a streaming group keeps (default {DEFAULT_RECENT_SIZE}, DuoAttention's)")
    p.add_argument("--text", type=text_arg, help="measure loss and agreement on this text (default: the sweep's prompts)")
    p.add_argument("--file", type=text_file, help="read that text from a UTF-8 file")
    p.add_argument("--lengths", type=token_counts, help="sweep: context lengths in tokens (default 2048)")
    p.add_argument("--depths", type=depth_percents, help="sweep: needle depths in percent (default 25,75)")
    p.add_argument("--needles", default="", help="sweep: needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file, help="sweep: a JSON file of needles")
    p.add_argument("--haystack", type=haystack, help="sweep: prose (default), passkey, or a UTF-8 text file")
    add_niah_options(p, "sweep: ")
    p.add_argument("--backend", choices=COMPRESS_BACKENDS, default="auto",
                   help="eager: mask the attention scores (N × N per layer); statistics: the kernels' per-head key "
                        "mask (O(N) memory); cache: each KV group keeps only what the policy keeps (the memory is "
                        "really freed; same tokens as the masks); auto (default): statistics mode above "
                        "HEADSCOPE_MAX_TOKENS tokens or on CUDA, where the model supports it")
    p.add_argument("--tolerance", type=share, default=DEFAULT_TOLERANCE,
                   help="report the smallest KV fraction whose NIAH accuracy is within this of full (default 0.05)")
    p.add_argument("--export", type=export_choice,
                   help="the policy written as the pattern folder, RANKING:FRACTION[:SEED] (default: the first score "
                        "ranking's smallest policy within --tolerance)")
    p.add_argument("--tasks", type=task_list,
                   help=f"score NIAH accuracy on the long-context task suite instead of the sweep's prompts, tasks "
                        f"from {', '.join(TASKS)} (at --lengths, {TASK_MIN_LENGTH}-{TASK_MAX_LENGTH} tokens); the "
                        "sweep still ranks the heads. Tasks the uncompressed model answers less often than "
                        "--min-rate are dropped")
    p.add_argument("--per-task", type=count(1, MAX_PER_TASK), default=5,
                   help="--tasks: prompts per task and length (default 5)")
    p.add_argument("--task-seed", type=count(0), default=0, help="--tasks: the seed the prompts are drawn with")
    p.add_argument("--min-rate", type=share, default=DEFAULT_MIN_RATE,
                   help=f"--tasks: the uncompressed answer rate a task needs to be scored (default {DEFAULT_MIN_RATE})")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html",
                   help="figure formats of compression_pareto and compression_policy (default svg,html; none: '')")
    p.set_defaults(func=cmd_compress)

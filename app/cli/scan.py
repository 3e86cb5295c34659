"""``headscope scan``: a needle-in-a-haystack sweep (of needles, or of the long-context task suite's prompts),
its retrieval scores and every other per-head score."""

from __future__ import annotations

import sys
from pathlib import Path

from headscope.analysis.long_context_tasks import MAX_LENGTH as TASK_MAX_LENGTH
from headscope.analysis.long_context_tasks import MAX_PER_TASK, TaskSuite
from headscope.analysis.long_context_tasks import MIN_LENGTH as TASK_MIN_LENGTH
from headscope.analysis.score_registry import HEAD_SCORES
from headscope.app.cli.arguments import (
    MODEL_HELP,
    check_formats,
    count,
    folder,
    haystack,
    non_empty,
    text_file,
)
from headscope.app.cli.compress import task_list
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import open_store_and_model
from headscope.app.cli.niah import (
    add_niah_options,
    checked_depth_rule,
    chosen_needles,
    depth_percents,
    haystack_text,
    token_counts,
)
from headscope.app.cli.terminal import progress_bar


def cmd_scan(args) -> int:
    """Needle-in-a-haystack sweep → retrieval score tables and figures (re-running reuses trials)."""
    formats = check_formats(args.formats)
    lengths, depths = args.lengths or ([TASK_MIN_LENGTH] if args.tasks else [512]), args.depths
    from headscope.analysis.niah import check_streaming_window  # the Heads page's rule too; imports no torch

    if args.tasks and not all(TASK_MIN_LENGTH <= n <= TASK_MAX_LENGTH for n in lengths):
        raise UsageError(f"argument --lengths: the task suite (--tasks) is built at {TASK_MIN_LENGTH:,} to "
                         f"{TASK_MAX_LENGTH:,} tokens, got {','.join(map(str, lengths))}")
    with argument("--sink/--window/--lengths"):  # S + W against the shortest length
        check_streaming_window(args.sink, args.window, lengths)
    if args.tasks:
        return _scan_tasks(args, formats, TaskSuite(tuple(args.tasks), tuple(lengths), args.per_task, args.task_seed))
    needles, hay = chosen_needles(args), haystack_text(args)
    checked_depth_rule(args)

    from headscope.analysis.head_scan import scan

    store, spec, model = open_store_and_model(args)
    trials = f"needle-in-a-haystack sweep ({len(needles)} needles × {len(lengths)} lengths × {len(depths)} depths)"
    with (progress_bar(trials) as bar, progress_bar("per-head scores on the sweep's prompts") as scoring,
          argument("--lengths/--depths/--needles")):
        found = scan(model, needles, lengths, depths, hay, sink=args.sink, window=args.window,
                     depth_rule=checked_depth_rule(args), stop_at_newline=args.stop_at_newline, store=store,
                     progress=bar, scores_progress=scoring)
    return _write(args, formats, store, spec, model, found,
                  {"lengths": lengths, "depths": depths, "needles": [n.id for n in needles]})


def _scan_tasks(args, formats, suite) -> int:
    """``scan --tasks``: the sweep over the task suite's prompts (a [length, task] accuracy grid)."""
    from headscope.analysis.head_scan import task_scan
    from headscope.analysis.task_retrieval import check_task_sweep

    with argument("--tasks/--lengths/--per-task"):
        suite = check_task_sweep(suite)
    store, spec, model = open_store_and_model(args)
    trials = (f"task-suite sweep ({len(suite.tasks)} tasks × {len(suite.lengths)} lengths × {suite.n_per_task} "
              "prompts)")
    with (progress_bar(trials) as bar, progress_bar("per-head scores on the sweep's prompts") as scoring,
          argument("--tasks/--lengths")):
        found = task_scan(model, suite, sink=args.sink, window=args.window, stop_at_newline=args.stop_at_newline,
                          store=store, progress=bar, scores_progress=scoring)
    return _write(args, formats, store, spec, model, found,
                  {"lengths": list(suite.lengths), "tasks": list(suite.tasks), "per_task": suite.n_per_task,
                   "task_seed": suite.seed})


def _write(args, formats, store, spec, model, found, asked: dict) -> int:
    """The scan's tables, ``summary.json`` (what was ``asked``, then the results) and figures, and its lines."""
    import json

    import numpy as np

    from headscope.app.export import write_files
    from headscope.app.views import names

    result, scores = found.sweep, found.scores
    if not result.trials:
        print("headscope scan: no trial finished", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else store.root / "exports" / f"scan-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    tables = {"scores": result.scores, "group_max": result.group_max, "group_mean": result.group_mean}
    for name, table in tables.items():
        np.savetxt(out / f"retrieval_{name}.csv", table, delimiter=",", fmt="%.6f")
    summary = {
        "sweep": result.key, "model": model.name, "model_digest": model.digest, **asked,
        "n_trials": result.n_trials, "n_counted": result.n_counted,
        "share_above_0.1": result.share_above(0.1),
        "accuracy": np.where(np.isfinite(result.accuracy), result.accuracy, None).tolist(),
        **_accuracy_intervals(result),
        "reused_trials": sum(t.reused for t in result.trials),
        "depth_rule": result.depth_rule, "stop_at_newline": result.stop_at_newline,
    }
    params = {"model": spec, "sweep": result.key[:16], "agg": "query", "score": "streaming", "stat": "mean",
              "sink_size": args.sink, "window": args.window, "trial": 0}
    for name in scores.names:
        np.savetxt(out / f"{name}_mean.csv", scores.mean[name], delimiter=",", fmt="%.6f")
        np.savetxt(out / f"{name}_std.csv", scores.std[name], delimiter=",", fmt="%.6f")
    summary["head_scores"] = {"n_prompts": scores.n_prompts, "sink_size": scores.sink, "window": scores.window,
                              "scores": scores.names}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for view in (names.RETRIEVAL_GRID, names.RETRIEVAL_HISTOGRAM, names.RETRIEVAL_SCATTER, names.NIAH_GRID):
        write_files(None, view, params, out, formats)
    for score in scores.names:
        write_files(None, names.HEAD_SCORE_GRID, {**params, "score": score}, out / score, formats,
                    plotlyjs_path=out / "plotly.min.js")
    for score in ("retrieval", *[name for name in scores.names if HEAD_SCORES[name].mass_curve]):
        write_files(None, names.SCORE_MASS, {**params, "score": score}, out / f"mass_{score}", formats,
                    plotlyjs_path=out / "plotly.min.js")
    print(f"sweep {result.key} ({result.settings_text()})")
    print(f"{result.n_counted}/{result.n_trials} trials answered ({summary['reused_trials']} reused), accuracy "
          f"{result.overall_accuracy().text()} (95 % Wilson); {result.share_above(0.1):.1%} of heads score above 0.1")
    print(f"results in {out}")
    return 0


def add_parser(sub) -> None:
    """``headscope scan``: needle-in-a-haystack sweep options."""
    p = sub.add_parser("scan", help="needle-in-a-haystack sweep: retrieval scores per head")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--lengths", type=token_counts,
                   help="context lengths in tokens, e.g. 512,1024 (default 512; with --tasks 1024)")
    p.add_argument("--depths", type=depth_percents, default=[10.0, 50.0, 90.0],
                   help="needle depths in percent, e.g. 0,50,100")
    p.add_argument("--needles", default="", help="needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", type=text_file, help="a JSON file of needles (fields: needle, question, answer)")
    p.add_argument("--haystack", type=haystack, default="prose", help="prose, passkey, or a UTF-8 text file")
    # S and W are kernels.statistics' DEFAULT_SINK_SIZE and DEFAULT_WINDOW, written out so --help does
    # not import torch (tests/app/test_cli.py checks they agree)
    p.add_argument("--sink", type=count(0), default=4, help="streaming score: S, the first tokens kept as sinks")
    p.add_argument("--window", type=count(1), default=64, help="streaming score: W, the recent window")
    add_niah_options(p, "")
    p.add_argument("--tasks", type=task_list,
                   help="sweep the long-context task suite's prompts instead of needles (tasks separated by commas; "
                        f"lengths {TASK_MIN_LENGTH:,} to {TASK_MAX_LENGTH:,}); the NIAH grid is length × task")
    p.add_argument("--per-task", type=count(1, MAX_PER_TASK), default=5,
                   help="--tasks: prompts per task and length (default 5)")
    p.add_argument("--task-seed", type=count(0), default=0, help="--tasks: the seed the prompts are drawn with")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_scan)


def _accuracy_intervals(result) -> dict:
    """Each [length, depth] cell's n and 95 % Wilson interval, and the whole sweep's accuracy with its own
    (:meth:`headscope.analysis.retrieval.RetrievalSweep.accuracy_intervals`), for ``summary.json``."""
    cells = result.accuracy_intervals()

    def grid(field):
        return [[None if not p.n else getattr(p, field) for p in row] for row in cells]

    return {"accuracy_n": [[p.n for p in row] for row in cells], "accuracy_low": grid("low"),
            "accuracy_high": grid("high"), "overall_accuracy": result.overall_accuracy().columns("accuracy")}

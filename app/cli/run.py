"""``headscope run``: run a text and write its head grid, arrays and scores."""

from __future__ import annotations

from pathlib import Path

from headscope.app.cli.arguments import (
    MODEL_HELP,
    check_formats,
    folder,
    non_empty,
    read_text_file,
    text_arg,
    text_file,
)
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import model_spec, open_store
from headscope.app.cli.terminal import progress_bar


def cmd_run(args) -> int:
    if args.text is not None and args.file:
        raise UsageError("give the text either as TEXT or with --file, not both")
    if args.text is None and not args.file:
        raise UsageError("give a TEXT or --file F")
    text = read_text_file(args.file) if args.file else args.text
    formats = check_formats(args.formats)

    import numpy as np

    from headscope.analysis.limits import limit
    from headscope.analysis.models import load_model
    from headscope.analysis.statistics_run import STATS_METRICS, capture_for_page, capture_statistics
    from headscope.app.export import write_files
    from headscope.app.views import names

    store = open_store(args)
    with progress_bar("loading model") as bar, argument("--model"):
        model = load_model(model_spec(args))
        bar(1.0)
    with progress_bar("capturing") as bar, argument("--file" if args.file else "TEXT"):
        if args.stats:
            run = capture_statistics(model, text, store=store, max_tokens=limit("HEADSCOPE_MAX_STATS_TOKENS"),
                                     progress=bar)
        else:
            run = capture_for_page(model, text, store, limit("HEADSCOPE_MAX_TOKENS"))
            bar(1.0)
    out = Path(args.out) if args.out else store.root / "exports" / run.short_id
    paths = write_files(run, names.HEAD_GRID, {"metric": "entropy"}, out, formats)
    for name, arr in run.kept_arrays().items():  # patterns, or per-row statistics, column sums and pooled maps
        np.save(out / f"{name}.npy", arr, allow_pickle=False)
        paths.append(out / f"{name}.npy")
    if not run.has_patterns:  # statistics mode: the scores a short run's grid would recompute from patterns
        with open(out / "scores.csv", "w", encoding="utf-8") as f:
            f.write("layer,head," + ",".join(STATS_METRICS) + "\n")
            tables = [run.head_scores(name) for name in STATS_METRICS]
            for la in range(run.n_layers):
                for h in range(run.n_heads):
                    f.write(f"{la},{h}," + ",".join(f"{t[la, h]:.6g}" for t in tables) + "\n")
        paths.append(out / "scores.csv")
    mode = run.mode
    print(f"run {run.key}")
    loss = float(np.nanmean(run.token_loss)) if run.n_tokens > 1 else float("nan")  # one token: no loss
    print(f"{run.n_tokens} tokens, mean loss {loss:.4f} ({mode})")
    print(f"results in {out}")
    for p in dict.fromkeys(paths):
        print(f"  {p.name}")
    return 0


def add_parser(sub) -> None:
    """``headscope run``: run a text and write its results."""
    p = sub.add_parser("run", help="run a text and write its results")
    p.add_argument("text", nargs="?", type=text_arg, metavar="TEXT")
    p.add_argument("--file", type=text_file, help="read the text from a UTF-8 file")
    p.add_argument("--model", type=non_empty("the model spec"), help=MODEL_HELP)
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="", help="figure formats to write, e.g. svg,png,html")
    p.add_argument("--stats", action="store_true",
                   help="statistics mode at any length (attention through the kernels, no patterns kept); "
                        "texts above HEADSCOPE_MAX_TOKENS use it anyway")
    p.set_defaults(func=cmd_run)

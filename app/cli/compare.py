"""``headscope compare``: two stored runs compared head by head."""

from __future__ import annotations

import argparse
from pathlib import Path

from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app.cli.arguments import check_formats, count, folder, layer_head, non_empty
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.loading import open_store

METRIC_HELP = f"the per-head score (default entropy; the Attention page's metrics: {', '.join(RUN_SCORES)})"


def text_score(text: str) -> str:
    """``--metric``: a per-head score of one text (:data:`headscope.analysis.score_registry.RUN_SCORES`)."""
    if text not in RUN_SCORES:
        raise argparse.ArgumentTypeError(f"unknown score {text[:40]!r}; choose one of {', '.join(RUN_SCORES)}")
    return text


def cmd_compare(args) -> int:
    """Two stored runs compared head by head (:func:`headscope.analysis.run_comparison.compare_runs`): prints the
    heads whose score changed most (second − first); writes both grids with the change, one head's
    change in attention (``--head``), their tables and ``summary.json``."""
    formats = check_formats(args.formats)

    import json

    import numpy as np

    from headscope.analysis.errors import InputError
    from headscope.analysis.run_comparison import compare_runs
    from headscope.app.context import AppContext, set_context
    from headscope.app.export import write_files
    from headscope.app.views import names

    metric = args.metric or "entropy"
    store = open_store(args)
    from headscope.analysis.models import DEFAULT_MODEL

    context = AppContext(store=store, default_model=DEFAULT_MODEL)
    set_context(context)
    runs = []
    for which, run_id in (("first", args.first), ("second", args.second)):
        keys = [k for k in store.find(run_id) if (r := store.get(k)) is not None and r.kind in ("run", "stats_run")]
        run = context.run(keys[0]) if len(keys) == 1 else None
        if run is None:
            why = "matches several runs: give more of it" if len(keys) > 1 else "is no stored run"
            raise UsageError(f"argument {which}: {run_id!r} {why} (`headscope runs list` shows them)")
        runs.append(run)
    first, second = runs
    with argument("--metric"):
        for run in runs:
            if metric not in run.metrics:
                compare_runs(first, second, metric)  # raises, naming the run that cannot compute it
    with argument("second"):
        result = compare_runs(first, second, metric)
    # the manifest names the first run's model (checked when rebuilt); both runs are read from the store
    params = {"model": first.model_name, "first": first.key[:16], "second": second.key[:16], "metric": metric}
    if args.head is not None:
        with argument("--head"):
            from headscope.analysis.run_comparison import attention_difference

            attention_difference(first, second, *args.head)
        params.update(layer=args.head[0], head=args.head[1])
    out = Path(args.out) if args.out else store.root / "exports" / f"compare-{first.short_id[:8]}-{second.short_id[:8]}"
    out.mkdir(parents=True, exist_ok=True)
    top = result.largest_changes(args.top)
    summary = {
        "first": first.key, "second": second.key, "first_model": first.model_name, "second_model": second.model_name,
        "kind": result.kind, "metric": metric, "metric_label": HEAD_SCORES[metric].label,
        "n_tokens": first.n_tokens, "differ": list(result.differ),
        "differ_tokens": [[first.tokens[i], second.tokens[i]] for i in result.differ],
        "largest_changes": [{"layer": c.layer, "head": c.head, "first": _finite(c.first), "second": _finite(c.second),
                             "change": _finite(c.change)} for c in top],
        "mean_abs_change": _finite(np.nanmean(np.abs(result.difference))) if np.isfinite(result.difference).any()
        else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        write_files(None, names.RUN_COMPARISON, params, out, formats)
        if args.head is not None:
            write_files(None, names.ATTENTION_DIFFERENCE, params, out, formats)
    except InputError as e:  # checked above; a run removed meanwhile
        raise UsageError(f"argument second: {e}") from None
    for line in comparison_table(summary):
        print(line)
    print(f"results in {out}")
    return 0


def _finite(x) -> float | None:
    """A number for JSON: nan (a score the run's length cannot give) is null, not ``NaN``."""
    return float(x) if x == x else None


def _shown(x: float | None, sign: str = "") -> str:
    return "n/a" if x is None else f"{x:{sign}.4f}"


def comparison_table(summary: dict) -> list[str]:
    """``headscope compare``'s printed summary: what was compared, and the heads that changed most."""
    differ = summary["differ"]
    where = ", ".join(f"{i} {a!r} / {b!r}" for i, (a, b) in zip(differ[:6], summary["differ_tokens"][:6], strict=True))
    lines = [f"{summary['metric_label']}: {summary['kind']}, {summary['n_tokens']} tokens"
             + (f"; tokens differ at {len(differ)} position(s): {where}{' …' if len(differ) > 6 else ''}" if differ else ""),
             f"first  {summary['first'][:12]} ({summary['first_model']})",
             f"second {summary['second'][:12]} ({summary['second_model']})",
             f"mean |change| over heads {_shown(summary['mean_abs_change'])}; largest changes (second − first):",
             f"  {'head':>6} {'first':>9} {'second':>9} {'change':>9}"]
    lines += [f"  {c['layer']:>3}.{c['head']:<2} {_shown(c['first']):>9} {_shown(c['second']):>9} "
              f"{_shown(c['change'], '+'):>9}" for c in summary["largest_changes"]]
    return lines


def add_parser(sub) -> None:
    """``headscope compare FIRST SECOND``."""
    p = sub.add_parser("compare", help="compare two stored runs head by head: the change of a per-head score "
                                       "(second - first) and of one head's attention")
    p.add_argument("first", type=non_empty("the first run id"), help="a stored run's id (`headscope runs list`)")
    p.add_argument("second", type=non_empty("the second run id"),
                   help="a run of the same length: another text on the same model, or the same text on a model "
                        "with the same tokenizer")
    p.add_argument("--metric", type=text_score, help=METRIC_HELP)
    p.add_argument("--head", type=layer_head, help="also this head's change in attention (layer.head)")
    p.add_argument("--top", type=count(1, 10_000), default=10, help="how many heads to print (default 10)")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_compare)

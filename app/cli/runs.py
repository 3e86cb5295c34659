"""``headscope runs``: list or remove stored runs."""

from __future__ import annotations

import sys
import time

from headscope.app.cli.errors import EXIT_USER_ERROR, UsageError
from headscope.app.cli.loading import open_store


def cmd_runs(args) -> int:
    if args.action == "list" and args.ids:
        raise UsageError("argument ids: `runs list` takes no run ids (did you mean `runs rm`?)")
    if args.action == "rm" and not args.ids:
        raise UsageError("argument ids: give the ids of the runs to remove (`headscope runs list` shows them)")
    store = open_store(args)
    if args.action == "list":
        from headscope.analysis.runs import stored_runs

        runs, skipped = stored_runs(store)
        for line in skipped:  # a row that rotted inside the index: reported, never hiding the others
            print(f"headscope runs list: skipped {_printable(line)} (`headscope runs rm` removes it)", file=sys.stderr)
        if not runs and not skipped:
            print("no runs stored in", store.root)
        for r in runs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
            mode = "statistics  " if r.statistics else ""
            print(f"{r.key[:16]}  {when}  {_printable(r.model_name)[:40]:<16} {r.n_tokens:>6} tok  "
                  f"{mode}{_printable(r.text or '')[:50]}")
        return 0
    missing = 0
    for run_id in args.ids:
        keys = store.find(run_id)
        if len(keys) != 1:
            print(f"headscope runs rm: argument ids: {run_id!r} matches {len(keys)} runs", file=sys.stderr)
            missing += 1
            continue
        store.remove(keys[0])
        print(f"removed {keys[0][:16]}")
    return EXIT_USER_ERROR if missing else 0


def _printable(text: str) -> str:
    """``text`` on one line, with control characters (a stored text's newlines, a terminal's escape
    sequences) shown as spaces."""
    return "".join(c if c.isprintable() else " " for c in text)


def add_parser(sub) -> None:
    """``headscope runs list|rm``."""
    p = sub.add_parser("runs", help="list or remove stored runs")
    p.add_argument("action", choices=["list", "rm"])
    p.add_argument("ids", nargs="*")
    p.set_defaults(func=cmd_runs)

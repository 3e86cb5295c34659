"""The needle-in-a-haystack sweep's options and inputs, shared by ``scan``, ``ablate --sweep`` and ``compress``."""

from __future__ import annotations

import argparse

from headscope.app.cli.arguments import number_list, read_text_file
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.terminal import progress_bar

token_counts = number_list(int, 1, what="token counts")
depth_percents = number_list(float, 0, 100, what="depths in percent")


def add_niah_options(p: argparse.ArgumentParser, prefix: str) -> None:
    """The needle placement and decode stop of a sweep (``scan`` and ``ablate --sweep``)."""
    p.add_argument("--depth-rule",
                   help=prefix + "where the needle goes: the sentence boundary nearest to the depth (default) "
                        "or the previous one (at or before it)")
    p.add_argument("--stop-at-newline", action="store_true",
                   help=prefix + "stop each decode at the first newline after some text (the retrieval-head "
                                 "paper's rule; default: at EOS or after 32 tokens)")


def _check_needle_types(path: str) -> None:
    """Refuse a needles file whose fields are not strings (``headscope.analysis.niah`` reads the shape and
    would turn a number or a list into text)."""
    from headscope.analysis.errors import parse_json

    try:
        raw = parse_json(read_text_file(path))
    except ValueError:
        return  # not JSON at all: load_needles says so
    items = raw.get("needles") if isinstance(raw, dict) else raw
    for i, item in enumerate(items if isinstance(items, list) else []):
        for key in ("needle", "question", "answer", "id", "kind"):
            if isinstance(item, dict) and key in item and not isinstance(item[key], str):
                kind = "a number" if isinstance(item[key], (int, float)) else type(item[key]).__name__
                raise UsageError(f"argument --needles-file: needle {i}: field {key!r} must be a string, got {kind}")


def chosen_needles(args) -> list:
    """The needles chosen by ``--needles-file`` and ``--needles`` (ids), checked."""
    from headscope.analysis.niah import load_needles

    if args.needles_file:
        _check_needle_types(args.needles_file)
    with argument("--needles-file"):
        needles = load_needles(args.needles_file) if args.needles_file else load_needles()
    if args.needles:
        wanted = [n.strip() for n in args.needles.split(",") if n.strip()]
        known = {n.id: n for n in needles}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise UsageError(f"argument --needles: unknown needle id(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        needles = [known[w] for w in wanted]
    return needles


def haystack_text(args) -> str:
    """The text of ``--haystack`` (default prose)."""
    from headscope.analysis.niah import load_haystack

    with argument("--haystack"):
        return load_haystack(args.haystack or "prose")


def checked_depth_rule(args) -> str:
    """``--depth-rule`` (default: :data:`headscope.analysis.niah.DEFAULT_DEPTH_RULE`), checked."""
    from headscope.analysis.niah import DEFAULT_DEPTH_RULE, DEPTH_RULES

    rule = args.depth_rule or DEFAULT_DEPTH_RULE
    if rule not in DEPTH_RULES:
        raise UsageError(f"argument --depth-rule: choose one of {', '.join(DEPTH_RULES)}, got {rule!r}")
    return rule


def niah_sweep(model, args, store, needles, hay, lengths, depths):
    """The needle-in-a-haystack sweep of ``scan`` and ``ablate --sweep`` (stored trials are reused)."""
    from headscope.analysis.retrieval import sweep

    depth_rule = checked_depth_rule(args)
    with progress_bar(f"needle-in-a-haystack sweep ({len(needles)} needles × {len(lengths)} lengths × "
                      f"{len(depths)} depths)") as bar, argument("--lengths/--depths/--needles"):
        return sweep(model, needles, lengths, depths, hay, store=store, depth_rule=depth_rule,
                     stop_at_newline=args.stop_at_newline, progress=bar)

"""The compression curve with error bars: task-suite accuracy against the KV cache kept, per ranking.

At each ``--lengths`` (tokens), ``--per-task`` prompts of each ``--tasks`` task of the offline suite
(:mod:`headscope.analysis.long_context_tasks`; a task the uncompressed model answers less than
``--min-rate`` of the time is dropped and said so) are scored under every (ranking, fraction[, seed])
policy by :func:`headscope.analysis.kv_compression_sweep.compress_sweep` on the ``--backend``
(statistics: the kernels' per-head key mask), the heads ranked by a needle sweep at ``--sweep-length``
(retrieval scores; streaming and evidence scores over its prompts). Every accuracy is printed with
its n and 95 % Wilson interval, each random fraction with its seed band, and per ranking the smallest
fraction of groups kept full whose interval reaches the uncompressed one (overlaps it or lies above:
the Compress page's rule at tolerance 0), with any larger fraction that falls below it. ``--measure-memory`` runs
one prefill per distinct fraction through the cache backend (:mod:`headscope.analysis.kv_cache`) and
prints the bytes its tensors allocate beside the count. ``--figure`` writes the curve as a PNG.

Every policy's numbers are stored as they finish (``--home``), so a run stopped part-way resumes, and
a run with more rankings, fractions or seeds reuses what is stored.

    .venv/bin/python bench/compress_curve.py [--lengths 2048,4096] [--tasks a,b] [--per-task 20]
        [--rankings retrieval,streaming,evidence,random] [--fractions 0.1,0.25,0.5,0.75,0.9] [--seeds 3]
        [--parts 'retrieval:0.1,0.25,0.5;random:0.25:3'] [--parts-at 4096=retrieval:0.25] [--backend statistics]
        [--measure-memory] [--figure docs/compress_curve.png] [--home DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _print_curve(curve, length: int) -> None:
    from headscope.analysis.intervals import overlaps

    base = curve.baseline
    print(f"\n{length} tokens: uncompressed NIAH {base.niah.text()}, loss {base.loss:.4f}; "
          f"{curve.n_prompts} prompts, backend {curve.meta.get('backend')}")
    print(f"{'ranking':<14} {'seed':>4} {'full':>5} {'KV frac':>7} {'accuracy [95% Wilson]':>26} {'loss':>7}")
    for e in sorted(curve.evaluations, key=lambda e: (e.policy.ranking, e.policy.fraction, e.policy.seed or 0)):
        p = e.policy
        print(f"{p.ranking:<14} {'' if p.seed is None else p.seed:>4} {p.fraction:>5.2f} {e.memory.fraction:>7.3f} "
              f"{e.niah.text():>26} {e.loss:>7.4f}")
    for band in curve.seed_bands():
        print(f"random seeds at {band['fraction_full']:.2f}: mean {band['niah_accuracy_seed_mean']:.3f}, "
              f"lowest {band['niah_accuracy_seed_low']:.3f}, highest {band['niah_accuracy_seed_high']:.3f} "
              f"({band['n_seeds']} seeds)")
    for ranking in dict.fromkeys(e.policy.ranking for e in curve.evaluations):
        # the page's rule at tolerance 0 (CompressionCurve.within_tolerance): the policy's interval reaches
        # the uncompressed interval's lower bound (overlapping it, or above it); random: every seed
        best = curve.smallest_within(ranking, 0.0)
        said = "none" if best is None else f"{best.policy.fraction:.2f} of groups full (KV {best.memory.fraction:.3f})"
        print(f"smallest fraction whose interval reaches the uncompressed one, {ranking}: {said} "
              f"(n = {curve.n_prompts} prompts{', every seed' if ranking == 'random' else ''})")
        below = [e for e in curve.evaluations if e.policy.ranking == ranking and best is not None
                 and e.policy.fraction > best.policy.fraction and not overlaps(e.niah, base.niah)
                 and e.niah.high < base.low]
        if below:
            print(f"  but larger fractions fall below it: {', '.join(f'{e.policy.fraction:.2f}' for e in below)}")


def _measure_memory(model, curve, length: int) -> dict[float, tuple[int, int]]:
    """Per distinct fraction: (bytes the cache backend's tensors allocate after one prefill of
    ``length`` prose tokens, kv_memory's count)."""
    from headscope.analysis import kv_cache
    from headscope.analysis.kv_compression import dtype_bytes, kv_memory
    from headscope.analysis.niah import load_haystack

    ids = model.tokenizer(load_haystack("prose"), add_special_tokens=False)["input_ids"]
    ids = (ids * (length // len(ids) + 1))[:length]
    out = {}
    for e in [curve.baseline, *curve.evaluations]:
        p = e.policy
        if p.fraction in out:
            continue
        got = kv_cache.greedy_continuation(model, p.full, ids, 1, p.sink_size, p.recent_size)
        counted = kv_memory(p, length, model.d_head, dtype_bytes(model), model.facts.windows).bytes
        out[p.fraction] = (got.prefill_kept_bytes, counted)
        print(f"  cache backend at {length} tokens, {p.fraction:.2f} of groups full: {got.prefill_kept_bytes / 2**20:.1f} "
              f"MiB kept ({got.prefill_bytes / 2**20:.1f} allocated), {counted / 2**20:.1f} MiB counted"
              f"{'' if got.prefill_kept_bytes == counted else '  MISMATCH'}", flush=True)
    return out


DODGE = {"retrieval": -0.018, "streaming": -0.006, "evidence": 0.006, "random": 0.018}


def _figure(curves: dict[int, object], path: str, memory: dict[int, dict[float, tuple[int, int]]]) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    def title(n: int) -> str:
        full = memory.get(n, {}).get(1.0)
        return f"{n:,} tokens" + (f" (full cache {full[0] / 2**20:.1f} MiB, measured)" if full else "")

    fig = make_subplots(rows=1, cols=len(curves), subplot_titles=[title(n) for n in curves], shared_yaxes=True)
    colours = {"retrieval": "#1f77b4", "streaming": "#ff7f0e", "evidence": "#2ca02c", "random": "#7f7f7f"}
    for col, curve in enumerate(curves.values(), start=1):
        base = curve.baseline.niah
        fig.add_trace(go.Scatter(x=[1.0], y=[base.value], mode="markers", name="uncompressed", legendgroup="full",
                                 showlegend=col == 1, marker=dict(color="#d62728", symbol="diamond", size=9),
                                 error_y=dict(type="data", symmetric=False, array=[base.high - base.value],
                                              arrayminus=[base.value - base.low])), row=1, col=col)
        # drawn once the subplot has a trace: plotly leaves shapes off an empty subplot
        fig.add_hrect(y0=base.low, y1=base.high, row=1, col=col, fillcolor="#d62728", opacity=0.12, line_width=0)
        fig.add_hline(y=base.value, row=1, col=col, line=dict(color="#d62728", dash="dash"))
        # rankings at one fraction keep the same bytes: each is drawn a little apart so the bars stay
        # readable (the hover gives the exact KV fraction)
        for ranking, colour in colours.items():
            es = sorted((e for e in curve.evaluations if e.policy.ranking == ranking),
                        key=lambda e: (e.memory.fraction, e.policy.seed or 0))
            if not es:
                continue
            x = [e.memory.fraction + (DODGE[ranking] + 0.004 * ((e.policy.seed or 0) - 1) if ranking == "random"
                                      else DODGE[ranking]) for e in es]
            y = [e.niah.value for e in es]
            text = [f"{ranking}{'' if e.policy.seed is None else f' seed {e.policy.seed}'}, {e.policy.fraction:.2f} of "
                    f"groups full, KV {e.memory.fraction:.3f}: {e.niah.text()}" for e in es]
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="markers" if ranking == "random" else "lines+markers", name=ranking,
                legendgroup=ranking, showlegend=col == 1, marker=dict(color=colour), text=text, hoverinfo="text",
                error_y=dict(type="data", symmetric=False, array=[e.niah.high - e.niah.value for e in es],
                             arrayminus=[e.niah.value - e.niah.low for e in es])), row=1, col=col)
        fig.update_xaxes(title_text="KV cache kept, fraction of the full cache (the cache backend's bytes)", row=1, col=col,
                         range=[0, 1.05])
    fig.update_yaxes(title_text="task-suite accuracy (95 % Wilson)", row=1, col=1, range=[0, 1.05])
    fig.update_layout(width=120 + 600 * len(curves), height=520, margin=dict(l=60, r=20, t=80, b=60),
                      title=dict(text="Task-suite accuracy against the KV cache kept<br><sup>95 % Wilson intervals; "
                                      "uncompressed: red band; rankings at one fraction drawn slightly apart</sup>",
                                 font=dict(size=15)),
                      legend=dict(orientation="h", y=-0.18, x=0))
    fig.write_image(path)
    print(f"figure -> {path}")


def _part(text: str, seeds: int) -> tuple[str, list[float], int]:
    """``ranking:f,f[:seeds]`` -> (ranking, fractions, seeds; ``--seeds`` where the part names none)."""
    ranking, fractions, *n = text.split(":")
    return ranking, [float(f) for f in fractions.split(",")], int(n[0]) if n else seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--tasks", default="single_needle,multi_key,multi_value,variable_tracking,common_words,passkey")
    parser.add_argument("--per-task", type=int, default=20)
    parser.add_argument("--min-rate", type=float, default=0.5)
    parser.add_argument("--rankings", default="retrieval,streaming,evidence,random")
    parser.add_argument("--fractions", default="0.1,0.25,0.5,0.75,0.9")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--recent", type=int, default=256)
    parser.add_argument("--sweep-length", type=int, default=1024)
    parser.add_argument("--backend", default="statistics")
    parser.add_argument("--parts", help="instead of every ranking at every fraction: 'ranking:f,f[:seeds];ranking:f' "
                        "(e.g. retrieval:0.1,0.25,0.5;random:0.25:3;random:0.5:1), each part its own sweep, drawn "
                        "as one curve")
    parser.add_argument("--parts-at", action="append", default=[], metavar="LENGTH=PARTS",
                        help="--parts for one of --lengths (repeatable), e.g. 4096=retrieval:0.25;random:0.25:3, "
                        "where a CPU run measures fewer policies at the longer length")
    parser.add_argument("--measure-memory", action="store_true")
    parser.add_argument("--figure")
    parser.add_argument("--home", help="store folder (default: HEADSCOPE_HOME or the user data dir)")
    args = parser.parse_args()

    import torch

    from headscope.analysis.kv_compression_sweep import compress_sweep
    from headscope.analysis.long_context_tasks import TaskSuite
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    torch.set_num_threads(1)
    store = Store(args.home) if args.home else Store()
    model = load_model("smollm2-135m")
    t0 = time.perf_counter()

    def progress(share: float) -> None:
        print(f"  {share:.0%} after {time.perf_counter() - t0:.0f} s", flush=True)

    ranking_sweep = sweep(model, load_needles(), [args.sweep_length], [25, 75], load_haystack("prose"), store=store)
    print(f"# bench/compress_curve.py {' '.join(sys.argv[1:])}")
    print(f"ranking sweep: {len(ranking_sweep.trials)} trials at {args.sweep_length} tokens, "
          f"{ranking_sweep.n_counted} answered ({time.perf_counter() - t0:.0f} s)", flush=True)
    loss_text = [ranking_sweep.trials[0].prompt_ids] if ranking_sweep.trials else None
    curves, memory = {}, {}
    lengths = [int(x) for x in args.lengths.split(",")]
    parts_at = {}
    for given in args.parts_at:
        n, eq, spec = given.partition("=")
        if not (eq and n.strip().isdigit() and int(n) in lengths and spec.strip()):
            parser.error(f"--parts-at {given!r}: give LENGTH=PARTS for one of --lengths {lengths}")
        parts_at[int(n)] = spec
    for length in lengths:
        suite = TaskSuite(tuple(args.tasks.split(",")), (length,), args.per_task, 0, args.min_rate)
        spec = parts_at.get(length, args.parts)
        parts = ([_part(p, args.seeds) for p in spec.split(";")] if spec
                 else [(args.rankings, [float(f) for f in args.fractions.split(",")], args.seeds)])
        found = [compress_sweep(model, ranking_sweep, rankings.split(","), fractions, seeds=list(range(n_seeds)),
                                sink_size=args.sink, recent_size=args.recent, texts=loss_text, backend=args.backend,
                                suite=suite, store=store, progress=progress).curve
                 for rankings, fractions, n_seeds in parts]
        # every part shares the suite, the baseline and the texts: one curve of all their policies
        seen = {}
        for part in found:
            for e in part.evaluations:
                seen.setdefault((e.policy.ranking, e.policy.fraction, e.policy.seed), e)
        curve = curves[length] = dataclasses.replace(found[0], evaluations=list(seen.values()))
        for task, r in (curve.meta.get("tasks") or {}).items():
            print(f"task {task:<18} uncompressed {r['answered']}/{r['n']} = {r['rate']:.2f} "
                  f"[{r['low']:.2f}, {r['high']:.2f}]{'  dropped' if r['dropped'] else ''}")
        _print_curve(curve, length)
        if args.measure_memory:
            memory[length] = _measure_memory(model, curve, length)
    if args.figure:
        _figure(curves, args.figure, memory)


if __name__ == "__main__":
    main()

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
    .venv/bin/python bench/compress_curve.py --from-results a.txt,b.txt [--figure docs/compress_curve.png]

``--from-results`` measures nothing: it reads the tables earlier runs printed, merges them per length
(the runs must agree on the uncompressed baseline and on any policy both measured), prints the merged
curve with its smallest fractions and draws the figure, so policies measured in separate runs, or in a
store that is gone, make one curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from headscope.analysis.intervals import Proportion, reaches, seed_band, smallest_passing, wilson  # noqa: E402  (no torch)


@dataclasses.dataclass(frozen=True)
class Point:
    """One policy's place on the curve: what the figure draws and the table prints."""

    ranking: str
    seed: int | None
    fraction: float  # of KV groups asked to stay full
    kv_fraction: float  # of the full cache's bytes (kv_memory's count)
    niah: Proportion
    loss: float


@dataclasses.dataclass
class Panel:
    """One length's curve: the uncompressed baseline and every policy's point, from a live
    :class:`~headscope.analysis.kv_compression.CompressionCurve` (:func:`_panel`) or from an earlier run's
    printed table (:func:`parse_results`)."""

    length: int
    baseline: Proportion
    loss: float
    points: list[Point]
    backend: str = ""
    # fraction of groups full -> (MiB the cache backend's tensors keep after a prefill, MiB counted)
    memory: dict[float, tuple[float, float]] = dataclasses.field(default_factory=dict)


def _panel(curve, length: int) -> Panel:
    return Panel(length, curve.baseline.niah, curve.baseline.loss,
                 [Point(e.policy.ranking, e.policy.seed, e.policy.fraction, e.memory.fraction, e.niah, e.loss)
                  for e in curve.evaluations], str(curve.meta.get("backend", "")))


def smallest_reaching(panel: Panel, ranking: str) -> Point | None:
    """The Compress page's rule at tolerance 0 (``CompressionCurve.smallest_within(ranking, 0.0)``, through
    the same :func:`~headscope.analysis.intervals.reaches` and
    :func:`~headscope.analysis.intervals.smallest_passing`): among the fractions whose every point's
    interval reaches the uncompressed one (for random, every seed), the one with the smallest mean KV
    fraction, and of its seeds the one keeping the most KV. None when no fraction passes."""
    by_fraction: dict[float, list[Point]] = {}
    for p in panel.points:
        if p.ranking == ranking:
            by_fraction.setdefault(p.fraction, []).append(p)
    return smallest_passing(by_fraction.values(), lambda p: p.kv_fraction, lambda p: reaches(p.niah, panel.baseline))


NUMBER = r"(?:[\d.]+|nan)"
ROW = re.compile(rf"^(?P<ranking>[a-z_]+) +(?P<seed>\d+)? +(?P<fraction>[\d.]+) +(?P<kv>[\d.]+) +"
                 rf"(?P<value>[\d.]+) \[(?P<low>[\d.]+), (?P<high>[\d.]+)\] n=(?P<n>\d+)(?: +(?P<k>\d+)/(?P<of>\d+))? +"
                 rf"(?P<loss>{NUMBER})$")
ROW_LIKE = re.compile(r"^[a-z_]+ +(\d+ +)?[\d.]+ +[\d.]+ ")  # a table row, parsed or not
BASELINE = re.compile(rf"^(?P<length>\d+) tokens: uncompressed NIAH (?P<value>[\d.]+) \[(?P<low>[\d.]+), "
                      rf"(?P<high>[\d.]+)\] n=(?P<n>\d+)(?: \((?P<k>\d+)/(?P<of>\d+)\))?, loss (?P<loss>{NUMBER}); "
                      rf".*backend (?P<backend>\w+)$")
MEMORY = re.compile(r"^ +cache backend at (?P<length>\d+) tokens, (?P<fraction>[\d.]+) of groups full: "
                    r"(?P<kept>[\d.]+) MiB kept .*, (?P<counted>[\d.]+) MiB counted")
COMMAND = "# bench/compress_curve.py "
# the arguments two runs must share to make one curve (the prompts, the policies' S and W, the ranking sweep)
SAME_CURVE = ("tasks", "per_task", "min_rate", "sink", "recent", "sweep_length", "backend")


def _proportion(m: re.Match, where: str) -> Proportion:
    """The printed accuracy as answered of n: the printed count where the row has one, else the value
    times n (exact while n <= 100 at two decimals); the value and the interval must be the count's."""
    n = int(m["n"])
    if m["k"] is None and n > 100:
        raise ValueError(f"{where}: n = {n} with no printed count; two decimals do not give the answered prompts")
    if m["of"] is not None and int(m["of"]) != n:
        raise ValueError(f"{where}: {m['k']}/{m['of']} answered, but n={n}")
    k = int(m["k"]) if m["k"] else round(float(m["value"]) * n)
    got = wilson(k, n)
    if abs(got.value - float(m["value"])) > 0.005 + 1e-9:
        raise ValueError(f"{where}: {k}/{n} is {got.value:.4f}, not the printed {m['value']}")
    if abs(got.low - float(m["low"])) > 0.006 or abs(got.high - float(m["high"])) > 0.006:
        raise ValueError(f"{where}: {k}/{n} gives [{got.low:.2f}, {got.high:.2f}], not the printed "
                         f"[{m['low']}, {m['high']}]")
    return got


def run_settings(text: str, source: str = "results") -> dict[str, object]:
    """The :data:`SAME_CURVE` arguments of the run that printed ``text``, read from its command line
    (``# bench/compress_curve.py …``) by this script's own parser, defaults included."""
    import shlex

    for line in text.splitlines():
        if line.startswith(COMMAND):
            words = shlex.split(line[len(COMMAND):])
            if "--from-results" in words:
                raise ValueError(f"{source}: a merged table (--from-results); give the runs' own results")
            try:
                args, _ = _parser().parse_known_args(words)
            except SystemExit as exc:
                raise ValueError(f"{source}: its command line does not parse: {line}") from exc
            return {name: getattr(args, name) for name in SAME_CURVE}
    raise ValueError(f"{source}: no '{COMMAND.strip()} …' line says how it was run")


def parse_results(text: str, source: str = "results") -> dict[int, Panel]:
    """The panels an earlier run printed (:func:`_print_panel`'s table and the memory lines), per length.
    A table line that does not parse, a length printed twice, or memory for a length with no table is
    refused (ValueError), never skipped."""
    panels: dict[int, Panel] = {}
    panel = None
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{number}"
        if re.match(r"^\d+ tokens:", line):
            m = BASELINE.match(line)
            if m is None:
                raise ValueError(f"{where}: an uncompressed line this script cannot read: {line}")
            length = int(m["length"])
            if length in panels:
                raise ValueError(f"{where}: a second table at {length} tokens")
            panel = panels[length] = Panel(length, _proportion(m, where), float(m["loss"]), [], m["backend"])
        elif panel is not None and ROW_LIKE.match(line):
            m = ROW.match(line)
            if m is None:
                raise ValueError(f"{where}: a policy row this script cannot read: {line}")
            panel.points.append(Point(m["ranking"], None if m["seed"] is None else int(m["seed"]), float(m["fraction"]),
                                      float(m["kv"]), _proportion(m, where), float(m["loss"])))
        elif m := MEMORY.match(line):
            if int(m["length"]) not in panels:
                raise ValueError(f"{where}: cache-backend memory at {m['length']} tokens, which has no table above it")
            panels[int(m["length"])].memory[float(m["fraction"])] = (float(m["kept"]), float(m["counted"]))
    return panels


def read_results(path: str) -> tuple[dict[str, object], dict[int, Panel]]:
    """A results file's run settings and panels; a file without a table is refused."""
    text = Path(path).read_text()
    panels = parse_results(text, path)
    if not panels:
        raise ValueError(f"{path}: no curve table in it")
    return run_settings(text, path), panels


def merge(runs: list[tuple[dict[str, object], dict[int, Panel]]], sources: list[str]) -> dict[int, Panel]:
    """One panel per length from several runs: they must share the :data:`SAME_CURVE` settings, each
    length's uncompressed baseline (answered alike, the same loss) and, for a policy more than one of
    them measured, its answers and KV fraction."""
    out: dict[int, Panel] = {}
    first_settings, first_source = runs[0][0], sources[0]
    for (settings, found), source in zip(runs, sources, strict=True):
        differ = {k: (first_settings[k], settings[k]) for k in SAME_CURVE if settings[k] != first_settings[k]}
        if differ:
            raise ValueError(f"{source} was run with other settings than {first_source}: "
                             + ", ".join(f"{k} {b!r} against {a!r}" for k, (a, b) in differ.items()))
        for length, panel in found.items():
            if length not in out:
                out[length] = dataclasses.replace(panel, points=list(panel.points), memory=dict(panel.memory))
                continue
            have = out[length]
            if (have.baseline.successes, have.baseline.n, have.backend, f"{have.loss:.4f}") != (
                    panel.baseline.successes, panel.baseline.n, panel.backend, f"{panel.loss:.4f}"):
                raise ValueError(f"{source}: at {length} tokens the uncompressed baseline is {panel.baseline.text()}, "
                                 f"loss {panel.loss:.4f} on {panel.backend}, not {have.baseline.text()}, loss "
                                 f"{have.loss:.4f} on {have.backend}: not the same curve")
            seen = {(p.ranking, p.fraction, p.seed): p for p in have.points}
            for p in panel.points:
                other = seen.get((p.ranking, p.fraction, p.seed))
                if other is None:
                    have.points.append(p)
                elif (other.niah.successes, other.niah.n, other.kv_fraction) != (p.niah.successes, p.niah.n,
                                                                                  p.kv_fraction):
                    raise ValueError(f"{source}: {p.ranking} {p.fraction} seed {p.seed} at {length} tokens answered "
                                     f"{p.niah.successes}/{p.niah.n} at KV {p.kv_fraction}, another run "
                                     f"{other.niah.successes}/{other.niah.n} at KV {other.kv_fraction}")
            have.memory.update(panel.memory)
    return out


def _print_panel(panel: Panel, n_prompts: int | None = None) -> None:
    base = panel.baseline
    said = f"{n_prompts} prompts, " if n_prompts is not None else ""
    print(f"\n{panel.length} tokens: uncompressed NIAH {base.text()} ({base.successes}/{base.n}), loss {panel.loss:.4f}; "
          f"{said}backend {panel.backend}")
    print(f"{'ranking':<14} {'seed':>4} {'full':>5} {'KV frac':>7} {'accuracy [95% Wilson]':>26} {'answered':>8} {'loss':>7}")
    for p in sorted(panel.points, key=lambda p: (p.ranking, p.fraction, p.seed or 0)):
        print(f"{p.ranking:<14} {'' if p.seed is None else p.seed:>4} {p.fraction:>5.2f} {p.kv_fraction:>7.3f} "
              f"{p.niah.text():>26} {f'{p.niah.successes}/{p.niah.n}':>8} {p.loss:>7.4f}")
    seeded: dict[float, list[Point]] = {}
    for p in panel.points:
        if p.ranking == "random" and p.seed is not None:
            seeded.setdefault(p.fraction, []).append(p)
    for fraction, ps in sorted(seeded.items()):
        band = seed_band([p.niah.value for p in ps])
        print(f"random seeds at {fraction:.2f}: mean {band.mean:.3f}, lowest {band.low:.3f}, "
              f"highest {band.high:.3f} ({band.n_seeds} seeds)")
    for ranking in dict.fromkeys(p.ranking for p in panel.points):
        best = smallest_reaching(panel, ranking)
        said = "none" if best is None else f"{best.fraction:.2f} of groups full (KV {best.kv_fraction:.3f})"
        print(f"smallest fraction whose interval reaches the uncompressed one, {ranking}: {said} "
              f"(n = {base.n} prompts{', every seed' if ranking == 'random' else ''})")
        below = [p for p in panel.points if p.ranking == ranking and best is not None and p.fraction > best.fraction
                 and p.niah.high < base.low]
        if below:
            print(f"  but larger fractions fall below it: {', '.join(f'{p.fraction:.2f}' for p in below)}")


def _measure_memory(model, curve, panel: Panel) -> None:
    """Per distinct fraction, into ``panel.memory``: (MiB the cache backend's tensors keep after one
    prefill of ``panel.length`` prose tokens, MiB kv_memory counts)."""
    from headscope.analysis import kv_cache
    from headscope.analysis.kv_compression import dtype_bytes, kv_memory
    from headscope.analysis.niah import load_haystack

    length = panel.length
    ids = model.tokenizer(load_haystack("prose"), add_special_tokens=False)["input_ids"]
    ids = (ids * (length // len(ids) + 1))[:length]
    for e in [curve.baseline, *curve.evaluations]:
        p = e.policy
        if p.fraction in panel.memory:
            continue
        got = kv_cache.greedy_continuation(model, p.full, ids, 1, p.sink_size, p.recent_size)
        counted = kv_memory(p, length, model.d_head, dtype_bytes(model), model.facts.windows).bytes
        panel.memory[p.fraction] = (got.prefill_kept_bytes / 2**20, counted / 2**20)
        print(f"  cache backend at {length} tokens, {p.fraction:.2f} of groups full: {got.prefill_kept_bytes / 2**20:.1f} "
              f"MiB kept ({got.prefill_bytes / 2**20:.1f} allocated), {counted / 2**20:.1f} MiB counted"
              f"{'' if got.prefill_kept_bytes == counted else '  MISMATCH'}", flush=True)


DODGE = {"retrieval": -0.018, "streaming": -0.006, "evidence": 0.006, "random": 0.018, "all_streaming": 0.0}


def _figure(panels: dict[int, Panel], path: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    def title(panel: Panel) -> str:
        full = panel.memory.get(1.0)
        return f"{panel.length:,} tokens" + (f" (full cache {full[0]:.1f} MiB, measured)" if full else "")

    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[title(p) for p in panels.values()],
                        shared_yaxes=True)
    colours = {"retrieval": "#1f77b4", "streaming": "#ff7f0e", "evidence": "#2ca02c", "random": "#7f7f7f",
               "all_streaming": "#8c564b"}
    for col, panel in enumerate(panels.values(), start=1):
        base = panel.baseline
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
            es = sorted((p for p in panel.points if p.ranking == ranking), key=lambda p: (p.kv_fraction, p.seed or 0))
            if not es:
                continue
            x = [e.kv_fraction + (DODGE[ranking] + 0.004 * ((e.seed or 0) - 1) if ranking == "random"
                                  else DODGE[ranking]) for e in es]
            y = [e.niah.value for e in es]
            text = [f"{ranking}{'' if e.seed is None else f' seed {e.seed}'}, {e.fraction:.2f} of "
                    f"groups full, KV {e.kv_fraction:.3f}: {e.niah.text()}" for e in es]
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="markers" if ranking == "random" else "lines+markers", name=ranking,
                legendgroup=ranking, showlegend=col == 1, marker=dict(color=colour), text=text, hoverinfo="text",
                error_y=dict(type="data", symmetric=False, array=[e.niah.high - e.niah.value for e in es],
                             arrayminus=[e.niah.value - e.niah.low for e in es])), row=1, col=col)
        fig.update_xaxes(title_text="KV cache kept, fraction of the full cache (the cache backend's bytes)", row=1, col=col,
                         range=[0, 1.05])
    fig.update_yaxes(title_text="task-suite accuracy (95 % Wilson)", row=1, col=1, range=[0, 1.05])
    fig.update_layout(width=120 + 600 * len(panels), height=520, margin=dict(l=60, r=20, t=80, b=60),
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


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--from-results", metavar="FILE,FILE",
                        help="measure nothing: merge the tables earlier runs printed (bench/results/compress_curve_*.txt; "
                        "they must agree on each length's uncompressed baseline), print the merged curve and draw "
                        "--figure from it")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_results:
        sources = args.from_results.split(",")
        try:
            panels = merge([read_results(f) for f in sources], sources)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        print(f"# bench/compress_curve.py {' '.join(sys.argv[1:] if argv is None else argv)}")
        for panel in panels.values():
            _print_panel(panel)
        if args.figure:
            _figure(panels, args.figure)
        return

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
    panels = {}
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
        curve = dataclasses.replace(found[0], evaluations=list(seen.values()))
        panel = panels[length] = _panel(curve, length)
        for task, r in (curve.meta.get("tasks") or {}).items():
            print(f"task {task:<18} uncompressed {r['answered']}/{r['n']} = {r['rate']:.2f} "
                  f"[{r['low']:.2f}, {r['high']:.2f}]{'  dropped' if r['dropped'] else ''}")
        _print_panel(panel, curve.n_prompts)
        if args.measure_memory:
            _measure_memory(model, curve, panel)
    if args.figure:
        _figure(panels, args.figure)


if __name__ == "__main__":
    main()

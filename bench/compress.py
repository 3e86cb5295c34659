"""KV-cache compression policies on the embedded model (DuoAttention, Xiao et al. 2024, arXiv:2410.10819).

``ratio``: one policy evaluation (mean loss on a text + NIAH accuracy on one prompt, through
:mod:`headscope.analysis.kv_compression`'s masked eager path) against the same evaluation of the uncompressed
model, in the same run, alternating, best of ``--repeats``; prints time, peak RSS growth during the
call and the ratio. Both run the eager path (the N × N scores of a layer exist in both); the mask is
one ``masked_fill`` per layer with streaming groups.

``backends``: the same evaluation (uncompressed, and the random 50 % policy) on both backends of
:func:`headscope.analysis.kv_compression.policy_applied` at each of ``--lengths``: ``eager`` (masked
``hook_attn_scores``, the N × N scores of a layer exist) and ``statistics`` (the kernels' per-head
key mask, O(N)); prints time, peak RSS growth, the time ratio policy / uncompressed on the same
backend and the peak-memory ratio statistics / eager, all measured in the same run. ``--backends statistics``
runs one backend only (eager's N × N pass takes several times as long; its memory ratio is then nan).

``curve``: a needle-in-a-haystack sweep (stored: reused) at ``--length`` tokens, retrieval scores from
its trials and streaming scores over its prompts with the policy's S and W, then
:func:`headscope.analysis.kv_compression.evaluate_policies` for the retrieval, streaming and random rankings
over ``--fractions`` and the two ends; prints the table and, per ranking, the smallest KV fraction
whose NIAH interval reaches 5 points below the uncompressed interval (the page's rule,
:meth:`CompressionCurve.within_tolerance`; for random: every seed), with n.

    .venv/bin/python bench/compress.py ratio [--length 1024] [--repeats 3]
    .venv/bin/python bench/compress.py backends [--lengths 2048,4096] [--repeats 1] [--backends eager,statistics]
    .venv/bin/python bench/compress.py curve [--length 2048] [--backend auto] [--depths 25,75] [--needles a,b,c]
                                             [--fractions 0.1,0.25,0.5,0.75] [--seeds 3] [--loss-texts N]
                                             [--home DIR]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(fn):
    """(result, seconds, peak RSS growth in bytes while ``fn`` ran (sampled every 5 ms), CPU seconds of
    the process meanwhile). CPU time hardly moves with other work on the machine; wall time does."""
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t, cpu = time.perf_counter(), time.process_time()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - t
        cpu = time.process_time() - cpu
        done.set()
        th.join()
    return out, seconds, max(peak[0], _rss()) - base, cpu


def ratio(args) -> None:
    import torch

    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.kv_compression import build_policy, policy_hooks, text_metrics
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    model = load_model("smollm2-135m")
    hay = load_haystack("prose")
    prompt = build_prompt(model, load_needles()[0], hay, args.length, 50.0)
    text = prompt.token_ids
    policy = build_policy(model, "random", 0.5, seed=0, sink_size=args.sink, recent_size=args.recent)
    variants = {"uncompressed": [], f"random 50% full, S={args.sink} W={args.recent}": policy_hooks(model, policy)}
    best: dict[str, tuple[float, int, float, float]] = {}
    for _ in range(args.repeats):
        for name, hooks in variants.items():
            def run(hooks=hooks):
                loss = text_metrics(model, [text], hooks).loss
                return loss, retrieval_accuracy(model, [prompt], hooks).accuracy

            (loss, acc), s, mem, _ = measured(run)
            if name not in best or s < best[name][0]:
                best[name] = (s, mem, loss, acc)
    base = best["uncompressed"][0]
    print(f"one evaluation = mean loss on {len(text)} tokens + NIAH on one {prompt.n_tokens}-token prompt "
          f"(24 new tokens), eager path, {torch.get_num_threads()} thread(s), best of {args.repeats}")
    print(f"{'what':<34} {'tokens':>6} {'time s':>7} {'peak RSS MiB':>12} {'ratio':>6} {'loss':>7} {'NIAH':>5}")
    for name, (s, mem, loss, acc) in best.items():
        print(f"{name:<34} {len(text):>6} {s:>7.2f} {mem / 2**20:>12.1f} {s / base:>6.2f} {loss:>7.4f} {acc:>5.2f}")


def _one(args) -> None:
    """One measurement in a fresh process (so memory freed by an earlier run cannot hide a peak):
    prints a JSON line with seconds, peak RSS growth, loss and NIAH accuracy."""
    import json

    import torch

    from headscope.analysis.ablation_curve import retrieval_accuracy
    from headscope.analysis.kv_compression import build_policy, policy_applied, text_metrics
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import build_prompt, load_haystack, load_needles

    model = load_model("smollm2-135m")
    prompt = build_prompt(model, load_needles()[0], load_haystack("prose"), args.length, 50.0)
    policy = None
    if args.variant == "policy":
        policy = build_policy(model, "random", 0.5, seed=0, sink_size=args.sink, recent_size=args.recent)
    with policy_applied(model, policy, args.backend) as hooks:  # warm-up: one-time allocations
        text_metrics(model, [prompt.token_ids[:64]], hooks)

    def run():
        with policy_applied(model, policy, args.backend) as hooks:
            if args.forward_only:  # the layers alone: no [n, vocab] logits, so attention memory shows
                with torch.inference_mode():
                    model.bridge.run_with_hooks(torch.tensor([prompt.token_ids]), fwd_hooks=hooks, return_type=None,
                                                stop_at_layer=model.n_layers)
                return float("nan"), float("nan")
            loss = text_metrics(model, [prompt.token_ids], hooks).loss
            acc = float("nan")
            if args.new_tokens:  # 0: the loss pass alone (one prefill)
                acc = retrieval_accuracy(model, [prompt], hooks, max_new_tokens=args.new_tokens).accuracy
        return loss, acc

    (loss, acc), s, mem, cpu = measured(run)
    import resource

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's high-water mark
    print(json.dumps({"tokens": prompt.n_tokens, "seconds": s, "cpu": cpu, "rss": mem, "max_rss": max_rss, "loss": loss,
                      "niah": acc}))


def backends(args) -> None:
    import json
    import subprocess

    import torch

    label = f"random 50% full, S={args.sink} W={args.recent}"
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.repeats):
            for backend in args.backends.split(","):
                for variant in ("uncompressed", "policy"):
                    cmd = [sys.executable, __file__, "_one", "--length", str(length), "--backend", backend,
                           "--variant", variant, "--sink", str(args.sink), "--recent", str(args.recent),
                           "--new-tokens", str(args.new_tokens), *(["--forward-only"] if args.forward_only else [])]
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    m = json.loads(out.strip().splitlines()[-1])
                    print(f"  {length} {backend} {variant}: {m['seconds']:.1f} s, CPU {m['cpu']:.1f} s, "
                          f"{m['rss'] / 2**20:.0f} MiB", flush=True)
                    if (backend, variant) not in best or m["seconds"] < best[(backend, variant)]["seconds"]:
                        best[(backend, variant)] = m
        rows.append(best)
    what = (f"mean loss on a NIAH prompt + NIAH on it ({args.new_tokens} new tokens, KV cache)" if args.new_tokens
            else "mean loss on a NIAH prompt (one prefill; --new-tokens 0: no NIAH decode)")
    if args.forward_only:
        what = "one forward pass over a NIAH prompt without the unembedding (--forward-only: no logits)"
    print(f"\none evaluation = {what}, "
          f"{torch.get_num_threads()} thread(s), each in a fresh process, best of {args.repeats}; t ratio = policy / "
          "uncompressed on the same backend, cpu ratio the same on the process's CPU time (steadier on a loaded machine); RSS growth = peak RSS during the evaluation minus RSS before it (sampled "
          "every 5 ms); max RSS = the process's high-water mark (model included); mem ratio = RSS growth of this row / "
          "the eager row of the same variant")
    print(f"{'backend':<11} {'what':<30} {'tokens':>6} {'time s':>7} {'CPU s':>6} {'RSS growth MiB':>14} "
          f"{'max RSS MiB':>11} {'t ratio':>7} {'cpu ratio':>9} {'mem ratio':>9} {'loss':>7} {'NIAH':>5}")
    for best in rows:
        for (backend, variant), m in best.items():
            base = best[(backend, "uncompressed")]
            eager_mem = best[("eager", variant)]["rss"] if ("eager", variant) in best else float("nan")
            name = label if variant == "policy" else "uncompressed"
            print(f"{backend:<11} {name:<30} {m['tokens']:>6} {m['seconds']:>7.1f} {m['cpu']:>6.1f} "
                  f"{m['rss'] / 2**20:>14.1f} {m['max_rss'] / 2**20:>11.0f} {m['seconds'] / base['seconds']:>7.2f} "
                  f"{m['cpu'] / base['cpu']:>9.2f} {m['rss'] / eager_mem if eager_mem > 0 else float('nan'):>9.2f} "
                  f"{m['loss']:>7.4f} {m['niah']:>5.2f}")


def curve(args) -> None:
    from headscope.analysis.head_scores import score_prompts, trial_prompts
    from headscope.analysis.kv_compression import evaluate_policies
    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep, trial_prompt
    from headscope.analysis.store import Store

    store = Store(args.home) if args.home else Store()
    model = load_model("smollm2-135m")
    by_id = {n.id: n for n in load_needles()}
    needles = [by_id[k] for k in args.needles.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    t = time.perf_counter()
    result = sweep(model, needles, [args.length], depths, load_haystack("prose"), store=store)
    print(f"sweep: {len(result.trials)} prompts at {args.length} tokens, {result.n_counted} answered "
          f"({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    hs = score_prompts(model, trial_prompts(result.trials), sink=args.sink, window=args.recent, store=store)
    print(f"streaming scores (S={args.sink}, W={args.recent}) on {hs.n_prompts} prompts ({time.perf_counter() - t:.0f} s)")
    prompts = [trial_prompt(tr) for tr in result.trials]
    texts = [p.token_ids for p in trial_prompts(result.trials)][: args.loss_texts or None]
    t = time.perf_counter()
    last = [0.0]

    def progress(f: float) -> None:
        if f - last[0] >= 0.1 or f >= 1:
            last[0] = f
            print(f"  {f:.0%} after {time.perf_counter() - t:.0f} s", flush=True)

    c = evaluate_policies(model, {"retrieval": result.scores, "streaming": hs.mean["streaming"]},
                          ["retrieval", "streaming", "random", "all_full", "all_streaming"], fractions,
                          texts=texts, prompts=prompts, seeds=range(args.seeds), sink_size=args.sink,
                          recent_size=args.recent, backend=args.backend, store=store, progress=progress)
    b = c.baseline
    print(f"\npolicies ({time.perf_counter() - t:.0f} s): S={args.sink} W={args.recent}, KV for {b.memory.n_tokens} "
          f"tokens (full {b.memory.full_bytes / 2**20:.1f} MiB), loss/agreement on {c.n_texts} prompt(s), "
          f"NIAH on {c.n_prompts}, {c.meta['backend']} backend")
    print(f"{'ranking':<14} {'seed':>4} {'full':>5} {'KV frac':>7} {'loss':>7} {'agree':>6} {'NIAH':>5}")
    print(f"{'uncompressed':<14} {'':>4} {1:>5.2f} {1:>7.3f} {b.loss:>7.4f} {b.agreement:>6.3f} {b.niah_accuracy:>5.2f}")
    for e in c.evaluations:
        p = e.policy
        print(f"{p.ranking:<14} {'' if p.seed is None else p.seed:>4} {p.fraction:>5.2f} {e.memory.fraction:>7.3f} "
              f"{e.loss:>7.4f} {e.agreement:>6.3f} {e.niah_accuracy:>5.2f}")
    print()
    for ranking in ("retrieval", "streaming", "random", "all_streaming"):
        e = c.smallest_within(ranking, 0.05)
        where = "none" if e is None else f"KV fraction {e.memory.fraction:.3f} (fraction full {e.policy.fraction:.2f})"
        print(f"smallest KV whose NIAH interval reaches 5 points below full's ({b.niah.text()}; the page's rule), "
              f"{ranking}: {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("ratio")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=256)
    p = sub.add_parser("backends")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=24, help="NIAH decode steps (0: loss only, one prefill)")
    p.add_argument("--forward-only", action="store_true",
                   help="time one forward pass without the unembedding ([n, vocab] logits dominate memory otherwise)")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--backends", default="eager,statistics", choices=("eager,statistics", "eager", "statistics"),
                   help="which backends to time (default both)")
    p = sub.add_parser("_one")
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--variant", choices=("uncompressed", "policy"), required=True)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=256)
    p = sub.add_parser("curve")
    p.add_argument("--backend", default="auto", help="auto (default), eager or statistics")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depths", default="25,75")
    p.add_argument("--needles", default="locker-code,chess-club,tram-depot")
    p.add_argument("--fractions", default="0.1,0.25,0.5,0.75")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--loss-texts", type=int, default=0,
                   help="measure loss and agreement on the first N prompts only (default 0: all)")
    p.add_argument("--home", help="store folder (default: HEADSCOPE_HOME or the user data dir)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # decoding is many tiny matmuls; one thread is fastest on a shared box
    {"ratio": ratio, "backends": backends, "_one": _one, "curve": curve}[args.what](args)


if __name__ == "__main__":
    main()

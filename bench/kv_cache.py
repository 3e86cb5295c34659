"""The cache backend's memory and time: a KV cache as small as the policy says, against the full cache.

For each length and policy, one fresh process (so no earlier run's freed memory hides a peak) loads the
embedded model, pre-fills a prompt of prose tokens in chunks of ``--chunk`` through
:mod:`headscope.analysis.kv_cache` and decodes ``--new-tokens`` greedy tokens, and reports

- the cache's bytes as allocated (the key/value tensors' storage sizes) after the prefill and at the
  end, beside :func:`headscope.analysis.kv_compression.kv_memory`'s count for the same policy;
- the process's peak RSS growth during the prefill and decoding, over its RSS with the model loaded
  and warmed up (sampled every 5 ms: ``bench/compress.py``'s ``measured``);
- prefill seconds and the median seconds per decoded token, wall and CPU (one torch thread: CPU time
  hardly moves with other work on a shared machine, wall time does; the ratios use CPU time).

Policies: ``all_full`` (the full cache, the baseline of every ratio), the retrieval-ranked policies
keeping 50 % and 25 % of the KV groups full, and ``all_streaming``; plus ``hf``: Hugging Face's own
``DynamicCache`` on the same weights with SDPA attention (``bare_twin(model, "sdpa")``), the same chunks,
as the reference for time. The retrieval ranking needs retrieval scores: ``scores`` computes them from
a needle-in-a-haystack sweep and saves the ``[layer, head]`` table as ``.npy`` (no pickle).

DuoAttention (Xiao et al. 2024, arXiv:2410.10819, Fig. 1/§4.3) reports for GQA models (Llama-3-8B,
25 % of heads full on an A100) up to 1.67× less memory and 1.50× faster decoding; those are GPU
numbers at 8B scale, beside which these are a 135M model's on a CPU.

    .venv/bin/python bench/kv_cache.py scores [--length 1024] [--out bench/results/retrieval_scores_smollm2.npy]
    .venv/bin/python bench/kv_cache.py table [--lengths 2048,8192,32768] [--policies all_full,retrieval50,...]
                                              [--new-tokens 16] [--chunk 512] [--scores FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCORES = ROOT / "bench" / "results" / "retrieval_scores_smollm2.npy"
POLICIES = {"hf": None, "all_full": ("all_full", 1.0), "retrieval50": ("retrieval", 0.5),
            "retrieval25": ("retrieval", 0.25), "all_streaming": ("all_streaming", 0.0)}
MIB = 1 << 20


def _prose_ids(model, n: int) -> list[int]:
    from headscope.analysis.niah import load_haystack

    ids = model.tokenizer(load_haystack("prose"), add_special_tokens=False)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def scores(args) -> None:
    """Retrieval scores of the embedded model from a sweep (every shipped needle, 2 depths) at ``--length``."""
    import numpy as np

    from headscope.analysis.models import load_model
    from headscope.analysis.niah import load_haystack, load_needles
    from headscope.analysis.retrieval import sweep
    from headscope.analysis.store import Store

    model = load_model("smollm2-135m")
    t = time.perf_counter()
    # stored (HEADSCOPE_HOME): bench/compress_curve.py ranks its policies by the same sweep
    result = sweep(model, load_needles(), [args.length], [25, 75], load_haystack("prose"), store=Store(),
                   progress=lambda share: print(f"  {share:.0%} after {time.perf_counter() - t:.0f} s", flush=True))
    table = np.asarray(result.scores, dtype=np.float64)
    np.save(args.out, table, allow_pickle=False)
    print(f"retrieval scores {table.shape} from {len(result.trials)} trials at {args.length} tokens "
          f"({time.perf_counter() - t:.0f} s) -> {args.out}")


def _one(args) -> None:
    """One (length, policy) in this process; prints a JSON line."""
    import statistics

    import numpy as np
    import torch
    from transformers import DynamicCache

    from headscope.analysis import kv_cache
    from headscope.analysis.bare_model import bare_twin
    from headscope.analysis.kv_compression import build_policy, dtype_bytes, kv_memory
    from headscope.analysis.models import load_model

    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m")
    ids = _prose_ids(model, args.length)
    name = args.policy
    policy = None
    if name != "hf":
        ranking, fraction = POLICIES[name]
        table = {"retrieval": np.load(args.scores, allow_pickle=False)} if ranking == "retrieval" else None
        policy = build_policy(model, ranking, fraction, table, sink_size=args.sink, recent_size=args.recent)

    def run(n_ids: list[int], new_tokens: int) -> dict:
        steps: list[float] = []
        with torch.inference_mode():
            if policy is None:
                twin, cache = bare_twin(model, "sdpa"), DynamicCache(config=model.hf_model.config)
                ctx = model.lock
            else:
                ctx = kv_cache.policy_cache(model, policy.full, policy.sink_size, policy.recent_size)
            with ctx as opened:
                if policy is not None:
                    twin, cache = opened
                t, c = time.perf_counter(), time.process_time()
                logits = kv_cache.run_chunks(twin, cache, n_ids, model.device, args.chunk)
                prefill, prefill_cpu = time.perf_counter() - t, time.process_time() - c
                prefill_bytes = _bytes(cache)
                kept_bytes = cache.kept_bytes() if hasattr(cache, "kept_bytes") else prefill_bytes
                token = int(logits.argmax())
                cpu_steps = []
                for _ in range(new_tokens):
                    t, c = time.perf_counter(), time.process_time()
                    out = twin(input_ids=torch.tensor([[token]], device=model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
                    token = int(out.logits[0, -1].argmax())
                    steps.append(time.perf_counter() - t)
                    cpu_steps.append(time.process_time() - c)
                nan = float("nan")
                return {"prefill_s": prefill, "prefill_cpu": prefill_cpu,
                        "decode_s": statistics.median(steps) if steps else nan,
                        "decode_cpu": statistics.median(cpu_steps) if cpu_steps else nan,
                        "prefill_bytes": prefill_bytes, "kept_bytes": kept_bytes, "final_bytes": _bytes(cache)}

    from compress import measured

    run(ids[:64], 2)  # warm-up: one-time allocations, the twin built
    got, _, peak_growth, _ = measured(lambda: run(ids, args.new_tokens))
    counted = kv_memory(policy or build_policy(model, "all_full", 1.0), args.length, model.d_head, dtype_bytes(model))
    print(json.dumps({"length": args.length, "policy": name, "n_full": None if policy is None else policy.n_full,
                      "counted_bytes": counted.bytes, "peak_growth": peak_growth, **got}))


def _bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def table(args) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = args.policies.split(",")
    print(f"# bench/kv_cache.py table --lengths {args.lengths} --policies {args.policies} --new-tokens "
          f"{args.new_tokens} --chunk {args.chunk} --sink {args.sink} --recent {args.recent} --threads {args.threads} "
          f"--repeats {args.repeats}")
    print("# embedded SmolLM2-135M (30 layers x 3 KV heads, d_head 64, float32), CPU; one process per row "
          "(MALLOC_MMAP_THRESHOLD_=65536); CPU-time ratios against all_full of the same length; after the prefill, 'kept MiB' = the keys and "
          "values kept (equal to kv_memory's count, checked per row), 'alloc' = their tensors' storage (a full "
          "group's headroom of 256 tokens included), 'peak' = RSS growth during prefill + decode")
    header = (f"{'tokens':>6} {'policy':<14} {'full':>4} {'kept MiB':>9} {'alloc':>8} {'mem/full':>8} "
              f"{'peak MiB':>8} {'peak/full':>9} {'prefill s':>9} {'cpu s':>7} {'pre/full':>8} {'ms/token':>8} "
              f"{'cpu ms':>7} {'dec/full':>8}")
    print(header)
    print("-" * len(header))
    for n in lengths:
        rows: dict[str, dict] = {}
        for _ in range(args.repeats):  # round-robin, keeping each row's fastest (CPU time) of the repeats
            for name in policies:
                got = _run_one(args, n, name)
                if got is None:
                    continue
                old = rows.get(name)
                if old is None:
                    rows[name] = got
                else:
                    for key in ("prefill_s", "prefill_cpu", "decode_s", "decode_cpu", "peak_growth"):
                        old[key] = min(old[key], got[key])
        full = rows.get("all_full")
        for r in rows.values():
            if r["policy"] != "hf" and r["kept_bytes"] != r["counted_bytes"]:
                print(f"# {n} {r['policy']}: kept {r['kept_bytes']} bytes, kv_memory counts {r['counted_bytes']}")
        for name in policies:
            r = rows.get(name)
            if r is None or full is None:
                print(f"{n:>6} {name:<14} failed", flush=True)
                continue
            print(f"{n:>6} {name:<14} {r['n_full'] if r['n_full'] is not None else '':>4} "
                  f"{r['kept_bytes'] / MIB:>9.1f} {r['prefill_bytes'] / MIB:>8.1f} "
                  f"{r['kept_bytes'] / full['kept_bytes']:>8.3f} {r['peak_growth'] / MIB:>8.0f} "
                  f"{r['peak_growth'] / max(full['peak_growth'], 1):>9.3f} {r['prefill_s']:>9.2f} "
                  f"{r['prefill_cpu']:>7.2f} {r['prefill_cpu'] / full['prefill_cpu']:>8.3f} "
                  f"{r['decode_s'] * 1e3:>8.1f} {r['decode_cpu'] * 1e3:>7.1f} "
                  f"{r['decode_cpu'] / full['decode_cpu']:>8.3f}", flush=True)


def _run_one(args, n: int, name: str) -> dict | None:
    """One row in a fresh process: its JSON, or None (said on stdout) when it failed."""
    cmd = [sys.executable, __file__, "one", "--length", str(n), "--policy", name, "--new-tokens",
           str(args.new_tokens), "--chunk", str(args.chunk), "--sink", str(args.sink), "--recent",
           str(args.recent), "--scores", str(args.scores), "--threads", str(args.threads)]
    # big blocks always mmapped: freed memory goes back to the OS, so RSS is live memory, not
    # what glibc's raised mmap threshold keeps on its heap after the first freed score block
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(f"# {n} {name} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("scores")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--out", default=str(DEFAULT_SCORES))
    for name in ("table", "one"):
        p = sub.add_parser(name)
        p.add_argument("--new-tokens", type=int, default=16)
        p.add_argument("--chunk", type=int, default=512)
        p.add_argument("--sink", type=int, default=128)
        p.add_argument("--recent", type=int, default=256)
        p.add_argument("--scores", default=str(DEFAULT_SCORES))
        p.add_argument("--threads", type=int, default=1)
        if name == "table":
            p.add_argument("--lengths", default="2048,8192,32768")
            p.add_argument("--policies", default="all_full,hf,retrieval50,retrieval25,all_streaming")
            p.add_argument("--repeats", type=int, default=1, help="rounds over the policies; each row its fastest")
        else:
            p.add_argument("--length", type=int, required=True)
            p.add_argument("--policy", choices=list(POLICIES), required=True)
    args = parser.parse_args()
    {"scores": scores, "table": table, "one": _one}[args.cmd](args)


if __name__ == "__main__":
    main()

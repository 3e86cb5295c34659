"""CPU micro-benchmark: the chunked torch attention kernel against SDPA and eager attention.

Each case runs in a fresh subprocess so that its peak memory is its own: peak RSS growth over the
RSS after the inputs exist (``/proc/self/clear_refs`` resets the high-water mark). Time is the best
of several runs after one warm-up. Ratios are against SDPA at the same size, measured in this run.

    .venv/bin/python bench/kernels_micro.py                  # 1024/2048/4096 tokens + the model case
    .venv/bin/python bench/kernels_micro.py --sizes 4096 --no-model

The model case runs a 30-layer SmolLM2-135M-shaped Llama (random weights, 9 heads / 3 KV heads,
d_head 64) forward at 4096 tokens with transformers' SDPA attention, then with this kernel
registered as the attention function and asked for statistics; its ratio is the product target
(a whole forward with statistics within 1.3× of an SDPA forward, peak under 3 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STREAMING = ("lse", "sink_mass", "recent_mass", "entropy", "col_sum")
EVERYTHING = ("lse", "argmax", "span_mass", "sink_mass", "recent_mass", "entropy", "col_sum", "pooled")
METHODS = {
    "sdpa": None,
    "eager (full matrix)": None,
    "kernel: output only": (),
    "kernel: lse": ("lse",),
    "kernel: streaming set": STREAMING,
    "kernel: all but rows": EVERYTHING,
}


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(fn, reps: int) -> dict:
    base = _rss_mb("VmRSS")
    exact_peak = _reset_peak()
    fn()  # warm-up; sets the peak
    peak = _rss_mb("VmHWM") - base if exact_peak else float("nan")
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    return {"time_s": best, "cpu_s": best_cpu, "peak_mb": peak}


def run_micro_case(method: str, n: int, threads: int, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from headscope.kernels.attention import attention
    from headscope.kernels.reference import eager_attention

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, d = 1, 9, 3, 64
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, h_kv, n, d, generator=g)
    v = torch.randn(b, h_kv, n, d, generator=g)

    if method == "sdpa":
        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif method.startswith("eager"):
        def fn():  # what attn_implementation="eager" does: repeat K/V, materialise the matrix
            return eager_attention(q, k, v, causal=True)
    else:
        stats = METHODS[method]
        kw = dict(spans=[(0, 4), (n // 2, n // 2 + 32)], block_size=64) if "span_mass" in stats else {}

        def fn():
            return attention(q, k, v, stats=stats, backend="torch", **kw)

    return _measure(fn, reps)


def _build_model(n: int, threads: int):
    """A SmolLM2-135M-shaped Llama whose attention is SDPA or this kernel, switchable per call."""
    import torch
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from headscope.kernels.attention import attention

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    current = {"stats": (), "wall": 0.0, "cpu": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                current["wall"] += time.perf_counter() - t
                current["cpu"] += time.process_time() - c

        return wrapper

    @timed
    def headscope_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        stats = current["stats"]
        kw = dict(spans=[(0, 4), (n // 2, n // 2 + 32)], block_size=64) if "span_mass" in stats else {}
        res = attention(query, key, value, causal=True, scale=scaling, stats=stats, backend="torch", **kw)
        return res.out.transpose(1, 2).contiguous(), None

    # custom names get no mask from transformers, so the timed SDPA keeps its flash path (is_causal)
    AttentionInterface.register("headscope", headscope_attention)
    AttentionInterface.register("timed_sdpa", timed(sdpa_attention_forward))
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))

    def forward(method: str) -> tuple[float, float]:
        """Run one forward; return the wall and CPU seconds spent inside attention."""
        impl = "timed_sdpa" if method == "sdpa" else "headscope"
        current.update(stats=() if method == "sdpa" else METHODS[method], wall=0.0, cpu=0.0)
        model.config._attn_implementation = impl
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = impl
        with torch.inference_mode():  # skip the 49k-vocab head: the same cost for every method
            model.model(input_ids=ids)
        return current["wall"], current["cpu"]

    return forward


def run_model_memory(method: str, n: int, threads: int, reps: int) -> dict:
    forward = _build_model(n, threads)
    base = _rss_mb("VmRSS")
    exact = _reset_peak()
    forward(method)
    return {"peak_mb": _rss_mb("VmHWM") - base if exact else float("nan")}


def run_model_times(methods: list[str], n: int, threads: int, reps: int) -> dict:
    """Best wall and CPU time per method, the methods interleaved so that load drifts hit all."""
    forward = _build_model(n, threads)
    for method in methods:
        forward(method)  # warm-up
    keys = ("time_s", "cpu_s", "attn_time_s", "attn_cpu_s")
    best = {m: dict.fromkeys(keys, float("inf")) for m in methods}
    for _ in range(reps):
        for method in methods:
            t, c = time.perf_counter(), time.process_time()
            attn_wall, attn_cpu = forward(method)
            values = (time.perf_counter() - t, time.process_time() - c, attn_wall, attn_cpu)
            for key, value in zip(keys, values, strict=True):
                best[method][key] = min(best[method][key], value)
    return best


def _spawn(kind: str, method, n: int, threads: int, reps: int) -> dict:
    cmd = [sys.executable, __file__, "--_case", json.dumps([kind, method, n, threads, reps])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model-tokens", type=int, default=4096)
    parser.add_argument("--no-model", action="store_true", help="skip the 30-layer forward-pass case")
    parser.add_argument("--no-micro", action="store_true", help="only the forward-pass case")
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._case:
        kind, method, n, threads, reps = json.loads(args._case)
        runner = {"micro": run_micro_case, "model-memory": run_model_memory, "model-times": run_model_times}[kind]
        print(json.dumps(runner(method, n, threads, reps)))
        return

    print("time: best wall clock; cpu: process CPU time of that kind of run (steadier when the machine is shared)")
    if not args.no_micro:
        print(f"attention, 9 heads / 3 KV heads, d_head 64, float32, causal, {args.threads} threads")
        _table("micro", list(METHODS), args.sizes, args.threads, args.reps, scale=1e3, unit="ms")
    if args.no_model:
        return
    n = args.model_tokens
    print(f"\nforward pass, SmolLM2-135M shape (30 layers), random weights, {n} tokens, {args.threads} threads")
    print("(methods interleaved in one process for time; peak memory from a fresh process per method)")
    methods = ["sdpa", "kernel: output only", "kernel: streaming set", "kernel: all but rows"]
    times = _spawn("model-times", methods, n, args.threads, max(1, args.reps // 2))
    if "error" in times:
        print(f"failed: {times['error']}")
        return
    print("attention: seconds inside the attention function (SDPA or this kernel) during the forward")
    print(f"{'what':28s} {'tokens':>6s} {'time s':>7s} {'cpu s':>7s} {'attn s':>7s} {'attn cpu':>8s} "
          f"{'peak MB':>8s} {'× sdpa time':>11s} {'× sdpa cpu':>10s} {'attn × sdpa cpu':>15s}")
    base = times["sdpa"]
    for method in methods:
        r = times[method]
        mem = _spawn("model-memory", method, n, args.threads, 1)
        peak = mem.get("peak_mb", float("nan"))
        print(f"{method:28s} {n:6d} {r['time_s']:7.2f} {r['cpu_s']:7.2f} {r['attn_time_s']:7.2f} "
              f"{r['attn_cpu_s']:8.2f} {peak:8.1f} {r['time_s'] / base['time_s']:11.2f} "
              f"{r['cpu_s'] / base['cpu_s']:10.2f} {r['attn_cpu_s'] / base['attn_cpu_s']:15.2f}")


def _table(kind: str, methods: list[str], sizes: list[int], threads: int, reps: int, scale: float, unit: str):
    head = f"{'what':28s} {'tokens':>6s} {'time ' + unit:>9s} {'cpu ' + unit:>9s} {'peak MB':>8s}"
    print(f"{head} {'× sdpa time':>11s} {'× sdpa cpu':>10s}")
    for n in sizes:
        base = None
        for method in methods:
            r = _spawn(kind, method, n, threads, reps)
            if "error" in r:
                print(f"{method:28s} {n:6d}  failed: {r['error']}")
                continue
            base = r if method == "sdpa" else base
            ratios = (
                f"{r['time_s'] / base['time_s']:11.2f} {r['cpu_s'] / base['cpu_s']:10.2f}"
                if base else f"{'-':>11s} {'-':>10s}"
            )
            print(f"{method:28s} {n:6d} {r['time_s'] * scale:9.2f} {r['cpu_s'] * scale:9.2f} "
                  f"{r['peak_mb']:8.1f} {ratios}")


if __name__ == "__main__":
    main()

"""GPU check for the Triton attention kernels: parity with the torch kernel, then timings.

Run through ``bench/gpu_check.sh`` on a CUDA machine (written for an H100/H200, under 8 minutes):

1. parity: Triton vs the torch kernel (both on CUDA tensors) for every statistic, on shapes that
   cover GQA, causal and not, decode rows (n_q < n_k), odd lengths, fp32 / fp16 / bf16, pooled
   blocks that nest with the tiles and ones that do not; sliding windows (per head, with sinks)
   and soft-capping (Mistral, Gemma 2/3 shapes, head_dim 256);
   then the newer paths: the statistics pass's running top-k list (k = 8, 16) and the split-K decode
   kernel (1-16 rows of 8k-64k keys, GQA, a window with sinks and soft-capping, top-k), each
   against the torch kernel, with the path each case took;
2. timing: the Triton kernel against ``scaled_dot_product_attention`` (flash backend) at
   4k / 16k / 32k / 64k tokens, 32 heads, d_head 128, bf16, causal, for each statistic, every
   non-top-k statistic together and all of them with top-8, with the achieved TFLOP/s (the causal
   forward's 2·n²·d·heads matmul flops over the time) beside an assumed peak; a 4,096-key
   sliding window (and soft-capping) against SDPA with the same boolean mask, up to 16k tokens;
3. decode rows: one query row (argmax + the row) against 64k keys, 32 heads: split-K against the
   two-pass kernels, SDPA, and the time to read K and V once at the copy bandwidth measured here;
4. if time is left, a small sweep of tile shapes at 16k tokens.

Every case is guarded: a failure prints one line and the table goes on.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headscope.kernels import statistics as stat  # noqa: E402
from headscope.kernels import triton_attention as ta  # noqa: E402
from headscope.kernels.attention import attention  # noqa: E402
from headscope.kernels.reference import OUT, reference_attention  # noqa: E402
from headscope.kernels.statistics import validate  # noqa: E402
from headscope.kernels.triton_decode import DECODE_MIN_KEYS, DECODE_STATS, splits_keys  # noqa: E402

T0 = time.time()
#: Peak dense bf16 tensor-core rate assumed for "% of peak" (NVIDIA's H200 SXM sheet, without
#: sparsity); printed with every table that uses it.
PEAK_TFLOPS = 989.0
DEVICE = "cuda"  # "cpu" with --dry-run (TRITON_INTERPRET=1, tiny shapes): checks this script itself


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def elapsed() -> float:
    return time.time() - T0


def log(msg: str = "") -> None:
    print(msg, flush=True)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


# --- 1. parity --------------------------------------------------------------------------------------

# name: (batch, n_heads, n_kv_heads, n_q, n_k, d, dtype, causal, pooled block[, key mask / soft-cap])
PARITY = {
    "mistral window 512 of 3000 bf16": (1, 8, 2, 3000, 3000, 128, torch.bfloat16, True, 64, dict(key_window=512)),
    "gemma2 window+cap 2000 bf16": (1, 8, 4, 2000, 2000, 128, torch.bfloat16, True, 64,
                                    dict(key_window=512, softcap=50.0)),
    "gemma3 d256 4:1 window 1500 bf16": (1, 4, 1, 1500, 1500, 256, torch.bfloat16, True, 32, dict(key_window=512)),
    "per-head window+sink decode 3x5000": (1, 8, 2, 3, 5000, 128, torch.bfloat16, True, 16,
                                           dict(key_window=torch.tensor([0, 64, 512, 4096] * 2), key_sink=4)),
    "gqa 8/2 causal 1000 fp32": (2, 8, 2, 1000, 1000, 64, torch.float32, True, 64),
    "gqa 32/8 causal 4096 bf16": (1, 32, 8, 4096, 4096, 128, torch.bfloat16, True, 64),
    "mha causal 777 fp16 odd": (1, 4, 4, 777, 777, 128, torch.float16, True, 48),
    "bidirectional 513x1031 bf16": (2, 6, 3, 513, 1031, 64, torch.bfloat16, False, 32),
    "decode 1 row of 8192 bf16": (1, 32, 8, 1, 8192, 128, torch.bfloat16, True, 128),
    "decode 37 rows of 5000 bf16": (1, 12, 4, 37, 5000, 128, torch.bfloat16, True, 16),
    "one token fp32": (1, 4, 2, 1, 1, 64, torch.float32, True, 1),
    "d_head 80 causal 300 bf16": (1, 4, 1, 300, 300, 80, torch.bfloat16, True, 100),
}


def parity_case(b, h, h_kv, n_q, n_k, d, dtype, causal, block, mask=None) -> tuple[bool, str]:
    mask = mask or {}
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(b, h, n_q, d, device=DEVICE, dtype=dtype, generator=g)
    k = torch.randn(b, h_kv, n_k, d, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(b, h_kv, n_k, d, device=DEVICE, dtype=dtype, generator=g)
    kw = dict(causal=causal, stats=stat.STATISTICS, spans=[(0, min(4, n_k)), (n_k // 2, n_k)], sink_size=4,
              window=min(256, n_k), block_size=block, rows=[0, n_q - 1, n_q // 2], topk=min(4, n_k), **mask)
    ref = attention(q, k, v, backend="torch", **kw)
    got = attention(q, k, v, backend="triton", **kw)
    sync()

    out_tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    checks = {"out": ((got.out.float() - ref.out.float()).abs().max().item(), out_tol)}
    for name in (stat.LSE, stat.ENTROPY):
        checks[name] = ((got[name] - ref[name]).abs().max().item(), 2e-3)
    for name in (stat.SPAN_MASS, stat.SINK_MASS, stat.RECENT_MASS, stat.POOLED, stat.ROWS, stat.ARGMAX_PROB):
        checks[name] = ((got[name] - ref[name]).abs().max().item(), 1e-4)
    col_rel = ((got[stat.COL_SUM] - ref[stat.COL_SUM]).abs() / ref[stat.COL_SUM].abs().clamp(min=1)).max().item()
    checks["col_sum (rel)"] = (col_rel, 1e-4)
    col_alone = attention(q, k, v, backend="triton", causal=causal, stats=(stat.COL_SUM,), **mask)[stat.COL_SUM]
    col_alone_rel = ((col_alone - ref[stat.COL_SUM]).abs() / ref[stat.COL_SUM].abs().clamp(min=1)).max().item()
    checks["col_sum alone (rel)"] = (col_alone_rel, 1e-4)
    # argmax: an index may differ only where two keys are within rounding of each other, so
    # compare the reference probability of the key Triton chose with the reference maximum
    same = got[stat.ARGMAX] == ref[stat.ARGMAX]
    gap = 0.0
    if not same.all():
        k_chosen = k.repeat_interleave(h // h_kv, 1).float().gather(
            2, got[stat.ARGMAX].unsqueeze(-1).expand(-1, -1, -1, d)
        )
        s_chosen = (q.float() * k_chosen).sum(-1) * d**-0.5  # the kernels' default scale
        if mask.get("softcap"):
            s_chosen = mask["softcap"] * torch.tanh(s_chosen / mask["softcap"])
        gap = (ref[stat.ARGMAX_PROB] - torch.exp(s_chosen - ref[stat.LSE])).abs().max().item()
    checks["argmax (prob gap)"] = (gap, 1e-3)
    if stat.TOPK_PROB in ref.stats:
        checks["topk_prob"] = ((got[stat.TOPK_PROB] - ref[stat.TOPK_PROB]).abs().max().item(), 1e-3)
    if b * h * n_q * n_k <= 64 * 2**20:
        # the torch kernel itself against plain eager attention (kernels/reference.py: the full
        # matrix, here in float32), so that a failure says which side is wrong
        eager = reference_attention(q, k, v, causal=causal, dtype=torch.float32, **mask)
        checks["torch vs eager: lse"] = ((ref[stat.LSE] - eager[stat.LSE]).abs().max().item(), 1e-3)
        checks["torch vs eager: out"] = ((ref.out.float() - eager[OUT]).abs().max().item(), out_tol)
        del eager
    finite = all(torch.isfinite(t.float()).all().item() for t in got.stats.values() if t.is_floating_point())
    ok = finite and all(val <= tol for val, tol in checks.values())
    detail = ", ".join(f"{name} {val:.1e}" + ("" if val <= tol else " (!)") for name, (val, tol) in checks.items())
    if not finite:
        detail += ", NON-FINITE statistic"
    detail += f", argmax agree {same.float().mean().item():.4f}"
    if stat.TOPK_INDEX in ref.stats:
        detail += f", topk agree {(got[stat.TOPK_INDEX] == ref[stat.TOPK_INDEX]).float().mean().item():.4f}"
    return ok, detail


def run_parity() -> int:
    log("== parity: Triton vs torch kernel on CUDA tensors ==")
    failures = 0
    for name, case in PARITY.items():
        t = time.time()
        try:
            ok, detail = parity_case(*case)
        except Exception as exc:  # keep going: one failure must not lose the rest
            ok, detail = False, "ERROR " + short_error(exc)
            traceback.print_exc(limit=3)
        failures += not ok
        log(f"{'PASS' if ok else 'FAIL'}  {name:32s} {time.time() - t:5.1f}s  {detail}")
        empty_cache()
    log(f"parity: {len(PARITY) - failures}/{len(PARITY)} passed\n")
    return failures


# name: (n_heads, n_kv_heads, n_q, n_k, topk[, key mask / soft-cap]); d_head 128, bf16, causal, the
# statistics both paths have (DECODE_STATS): which kernel runs is kernels.attention's choice, printed
NEW_PARITY = {
    "top-16 list, gqa 32/8, 2048": (32, 8, 2048, 2048, 16),
    "top-8 list, gemma2 window+cap 2000": (8, 4, 2000, 2000, 8, dict(key_window=512, softcap=50.0)),
    "top-16 list, 3 rows x 300 (two-pass)": (8, 2, 3, 300, 16),
    "split-K 1 row x 65536, gqa 32/8, top-8": (32, 8, 1, 65536, 8),
    "split-K 1 row x 65536, mha 32, argmax": (32, 32, 1, 65536, 1),
    "split-K 5 rows x 20000, window+sink+cap": (8, 2, 5, 20000, 4,
                                                dict(key_window=torch.tensor([0, 64, 512, 4096] * 2), key_sink=4,
                                                     softcap=30.0)),
    "split-K 16 rows x 8192, gqa 8:1, top-16": (16, 2, 16, 8192, 16),
}


def chosen_prob(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, mask: dict) -> torch.Tensor:
    """Probability (by the reference lse) of keys ``idx`` ``[b, h, n_q, K]`` picked by a kernel
    (-1: none, probability 0), from their scores: a wrong index shows as a probability gap."""
    d = q.shape[-1]
    kr = k.repeat_interleave(q.shape[1] // k.shape[1], 1).float()
    keys = kr.gather(2, idx.clamp(min=0).flatten(2).unsqueeze(-1).expand(-1, -1, -1, d)).view(*idx.shape, d)
    s = (q.float().unsqueeze(-2) * keys).sum(-1) * d**-0.5
    if mask.get("softcap"):
        s = mask["softcap"] * torch.tanh(s / mask["softcap"])
    return torch.exp(s - lse.unsqueeze(-1)).masked_fill(idx < 0, 0.0)


def new_parity_case(h, h_kv, n_q, n_k, topk, mask=None, d=128) -> tuple[bool, str]:
    mask = mask or {}
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(1, n, m, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
               for n, m in ((h, n_q), (h_kv, n_k), (h_kv, n_k)))
    stats = tuple(sorted(DECODE_STATS))
    kw = dict(stats=stats, spans=[(0, 4), (n_k // 2, n_k)], sink_size=4, window=min(256, n_k),
              rows=[0, n_q - 1], topk=topk, **mask)
    plan = validate(q, k, v, True, None, stats, 4, kw["window"], kw["spans"], None, kw["rows"], topk, "triton",
                    key_sink=mask.get("key_sink"), key_window=mask.get("key_window"), softcap=mask.get("softcap"))
    path = "split-K" if splits_keys(plan, n_q, n_k) else "two-pass"
    ref = attention(q, k, v, backend="torch", **kw)
    got = attention(q, k, v, backend="triton", **kw)
    sync()
    checks = {"out": ((got.out.float() - ref.out.float()).abs().max().item(), 3e-2)}
    for name in (stat.LSE, stat.ENTROPY):
        checks[name] = ((got[name] - ref[name]).abs().max().item(), 2e-3)
    for name in (stat.SPAN_MASS, stat.SINK_MASS, stat.RECENT_MASS, stat.ROWS, stat.ARGMAX_PROB):
        checks[name] = ((got[name] - ref[name]).abs().max().item(), 1e-4)
    idx_names = [(stat.ARGMAX, stat.ARGMAX_PROB)] + ([(stat.TOPK_INDEX, stat.TOPK_PROB)] if topk > 1 else [])
    agree = []
    for idx_name, prob_name in idx_names:
        got_i, want_p = got[idx_name], ref[prob_name]
        if idx_name == stat.ARGMAX:
            got_i, want_p = got_i.unsqueeze(-1), want_p.unsqueeze(-1)
        else:
            checks[prob_name] = ((got[prob_name] - want_p).abs().max().item(), 1e-4)
        # an index may differ only between keys tied within rounding: compare probabilities
        gap = (chosen_prob(q, k, got_i, ref[stat.LSE], mask) - want_p).abs().max().item()
        checks[f"{idx_name} (prob gap)"] = (gap, 1e-3)
        agree.append(f"{idx_name} agree {(got[idx_name] == ref[idx_name]).float().mean().item():.4f}")
    finite = all(torch.isfinite(t.float()).all().item() for t in got.stats.values() if t.is_floating_point())
    ok = finite and all(val <= tol for val, tol in checks.values())
    detail = f"[{path}] " + ", ".join(f"{name} {val:.1e}" + ("" if val <= tol else " (!)")
                                      for name, (val, tol) in checks.items())
    return ok, detail + ("" if finite else ", NON-FINITE statistic") + ", " + ", ".join(agree)


def run_new_parity() -> int:
    log("== parity of the top-k list and the split-K decode kernel (bf16, d_head 128, causal) ==")
    failures = 0
    for name, case in NEW_PARITY.items():
        t = time.time()
        try:
            ok, detail = new_parity_case(*case)
        except Exception as exc:
            ok, detail = False, "ERROR " + short_error(exc)
            traceback.print_exc(limit=3)
        failures += not ok
        log(f"{'PASS' if ok else 'FAIL'}  {name:40s} {time.time() - t:5.1f}s  {detail}")
        empty_cache()
    log(f"new-path parity: {len(NEW_PARITY) - failures}/{len(NEW_PARITY)} passed\n")
    return failures


# --- 2. timing --------------------------------------------------------------------------------------


def bench_ms(fn) -> float:
    if DEVICE != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def memory_mark() -> int:
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def memory_peak_mb(before: int) -> float:
    if DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def stat_cases(n: int) -> dict:
    spans = [(0, 4), (n // 2, min(n, n // 2 + 64))]
    return {
        "output only": dict(stats=()),
        "lse": dict(stats=(stat.LSE,)),
        "argmax": dict(stats=(stat.ARGMAX,)),
        "argmax top-4": dict(stats=(stat.ARGMAX,), topk=4),
        "span_mass (2 spans)": dict(stats=(stat.SPAN_MASS,), spans=spans),
        "recent_mass (W=256)": dict(stats=(stat.RECENT_MASS,), window=256),
        "sink_mass (S=4)": dict(stats=(stat.SINK_MASS,), sink_size=4),
        "entropy": dict(stats=(stat.ENTROPY,)),
        "col_sum": dict(stats=(stat.COL_SUM,)),
        "pooled (B=64)": dict(stats=(stat.POOLED,), block_size=64),
        "rows (4)": dict(stats=(stat.ROWS,), rows=[0, n // 3, n // 2, n - 1]),
        "all statistics": dict(stats=stat.STATISTICS, spans=spans, window=256, block_size=64,
                               rows=[0, n // 3, n // 2, n - 1]),
        "every non-top-k statistic": dict(stats=tuple(x for x in stat.STATISTICS if x != stat.ARGMAX), spans=spans,
                                          window=256, block_size=64, rows=[0, n // 3, n // 2, n - 1]),
        "argmax top-8": dict(stats=(stat.ARGMAX,), topk=8),
        "all statistics + top-8": dict(stats=stat.STATISTICS, spans=spans, window=256, block_size=64,
                                       rows=[0, n // 3, n // 2, n - 1], topk=8),
    }


def tflops(n_q: int, n_k: int, d: int, heads: int, ms: float, causal: bool = True) -> float:
    """Forward attention's matmul rate: 2 matmuls × 2 flops × (visible scores) × d × heads / time;
    the statistics pass's recomputed QKᵀ is not counted (the same count for every row of a table)."""
    scores = n_q * n_k - (n_q * (n_q - 1) // 2 if causal else 0)
    return 4 * scores * d * heads / (ms * 1e-3) / 1e12


def run_timing(sizes: list[int], heads: int, d: int, budget_s: float) -> None:
    log(f"== timing: {heads} heads, d_head {d}, bf16, causal; ratio = time / SDPA flash (same size) ==")
    log(f"TFLOP/s: the causal forward's 4·(visible scores)·d·heads flops / time; % of an assumed peak of "
        f"{PEAK_TFLOPS:.0f} TFLOP/s (H200 bf16 dense)")
    log(f"{'case':34s} {'tokens':>7s} {'ms':>9s} {'× sdpa':>7s} {'extra MB':>9s} {'TFLOP/s':>8s} {'% peak':>7s}")
    for n in sizes:
        if elapsed() > budget_s:
            log(f"(stopping timings at {n} tokens: time budget)")
            break
        try:
            time_size(n, heads, d, budget_s)
        except Exception as exc:
            log(f"{'(size)':34s} {n:7d}  ERROR {short_error(exc)}")
        empty_cache()
    log("")


def time_size(n: int, heads: int, d: int, budget_s: float) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    base = None
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            base = bench_ms(lambda: sdpa(q, k, v, is_causal=True))
        rate = tflops(n, n, d, heads, base)
        log(f"{'sdpa flash':34s} {n:7d} {base:9.2f} {1.0:7.2f} {'':>9s} {rate:8.1f} {100 * rate / PEAK_TFLOPS:6.1f}%")
    except Exception as exc:
        log(f"{'sdpa flash':34s} {n:7d}  ERROR {short_error(exc)}")
    for label, kw in stat_cases(n).items():
        if elapsed() > budget_s:
            log(f"(skipping the rest at {n} tokens: time budget)")
            break
        try:
            def fn(kw=kw):
                return attention(q, k, v, causal=True, backend="triton", **kw)

            fn()
            before = memory_mark()
            fn()
            extra = memory_peak_mb(before)
            ms = bench_ms(fn)
            ratio = f"{ms / base:7.2f}" if base else f"{'-':>7s}"
            rate = tflops(n, n, d, heads, ms)
            log(f"{'triton: ' + label:34s} {n:7d} {ms:9.2f} {ratio} {extra:9.1f} {rate:8.1f} "
                f"{100 * rate / PEAK_TFLOPS:6.1f}%")
        except Exception as exc:
            log(f"{'triton: ' + label:34s} {n:7d}  ERROR {short_error(exc)}")
        empty_cache()
    # a sliding window of 4,096 keys (Mistral), then with Gemma 2's soft-capping, against SDPA with
    # the same boolean mask (SDPA cannot cap: that row's ratio is against the uncapped mask)
    if n <= 16384:
        try:
            pos = torch.arange(n, device=DEVICE)
            band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 4096)
            mbase = bench_ms(lambda: sdpa(q, k, v, attn_mask=band))
            log(f"{'sdpa + window mask':34s} {n:7d} {mbase:9.2f} {mbase / base if base else 0:7.2f}")
            del band
            empty_cache()
            for label, extra in (("window 4096", {}), ("window 4096 + cap", dict(softcap=50.0)),
                                 ("window 4096 + entropy", dict(stats=(stat.ENTROPY,)))):
                ms = bench_ms(lambda extra=extra: attention(q, k, v, backend="triton", key_window=4096, **extra))
                log(f"{'triton: ' + label:34s} {n:7d} {ms:9.2f} {ms / mbase:7.2f}  (× sdpa with the mask)")
        except Exception as exc:
            log(f"{'triton: window':34s} {n:7d}  ERROR {short_error(exc)}")
        empty_cache()
    # grouped-query attention (4 query heads per kv head) and one decode row
    label = "triton: gqa 4:1 lse+ent+col"
    try:
        n_kv = max(1, heads // 4)
        kg, vg = k[:, :n_kv].contiguous(), v[:, :n_kv].contiguous()
        ms = bench_ms(lambda: attention(q, kg, vg, backend="triton", stats=(stat.LSE, stat.ENTROPY, stat.COL_SUM)))
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                gbase = bench_ms(lambda: sdpa(q, kg, vg, is_causal=True, enable_gqa=True))
            gratio = f"{ms / gbase:7.2f}"
        except Exception:  # flash without GQA support: compare with the MHA time
            gratio = f"{ms / base:7.2f}" if base else f"{'-':>7s}"
        log(f"{label:34s} {n:7d} {ms:9.2f} {gratio}")
    except Exception as exc:
        log(f"{label:34s} {n:7d}  ERROR {short_error(exc)}")
    label = "triton: decode row argmax+row"  # split-K from 512 keys on (kernels/triton_decode.py)
    try:
        q1 = q[:, :, -1:].contiguous()
        ms = bench_ms(lambda: attention(q1, k, v, backend="triton", stats=(stat.ARGMAX, stat.ROWS), rows=[0]))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            dbase = bench_ms(lambda: sdpa(q1, k, v))
        log(f"{label:34s} {n:7d} {ms:9.2f} {ms / dbase:7.2f}")
    except Exception as exc:
        log(f"{label:34s} {n:7d}  ERROR {short_error(exc)}")


# --- 3. decode rows ---


def copy_bandwidth() -> tuple[float, int]:
    """Device memory bandwidth (bytes/s) of a large device-to-device copy, counting its read and its
    write, and the bytes copied: what reading K and V once can at best reach on this device."""
    n = 2**29 if DEVICE == "cuda" else 2**20  # 1 GiB of bf16 on the GPU
    src = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n * src.element_size() / (ms * 1e-3), n * src.element_size()


def run_decode_timing(n_k: int, heads: int, d: int) -> None:
    """One query row (argmax + its exact row) against ``n_k`` keys: split-K, the two-pass kernels,
    SDPA, and the K/V read time at the measured copy bandwidth (the floor for any decode kernel)."""
    bw, size = copy_bandwidth()
    empty_cache()
    log(f"== decode: 1 query row x {n_k} keys, {heads} query heads, d_head {d}, bf16; argmax + the row ==")
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write of {size / 2**20:.0f} MiB); "
        f"TFLOP/s = 4·n_k·d·heads / time, % of an assumed {PEAK_TFLOPS:.0f} TFLOP/s peak")
    log(f"{'case':34s} {'ms':>8s} {'× sdpa':>7s} {'× K/V read':>10s} {'GB/s':>7s} {'TFLOP/s':>8s} {'% peak':>7s}")
    for kv_heads in (heads, max(1, heads // 4)):
        try:
            time_decode(n_k, heads, kv_heads, d, bw)
        except Exception as exc:
            log(f"{f'kv heads {kv_heads}':34s} ERROR {short_error(exc)}")
        empty_cache()
    log("")


def time_decode(n_k: int, heads: int, kv_heads: int, d: int, bw: float) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device=DEVICE).manual_seed(0)
    q1 = torch.randn(1, heads, 1, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, kv_heads, n_k, d, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
    kv_bytes = 2 * k.numel() * k.element_size()
    read_ms = kv_bytes / bw * 1e3
    kw = dict(stats=(stat.ARGMAX, stat.ROWS), rows=[0])
    plan = validate(q1, k, v, True, None, kw["stats"], 4, 64, None, None, [0], 1, "triton")
    gqa = kv_heads < heads

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q1, k, v, enable_gqa=gqa)

    try:
        flash()
        base, base_label = bench_ms(flash), "sdpa flash"
    except Exception:  # no flash kernel for this case (GQA on some builds, or the CPU dry run)
        base, base_label = bench_ms(lambda: sdpa(q1, k, v, enable_gqa=gqa)), "sdpa (default backend)"
    cases = {"triton split-K": lambda: attention(q1, k, v, backend="triton", **kw),
             "triton two-pass": lambda: ta.triton_attention(q1, k, v, plan)}
    rows = [(base_label, base)] + [(label, bench_ms(fn)) for label, fn in cases.items()]
    for label, ms in rows:
        rate = 4 * n_k * d * heads / (ms * 1e-3) / 1e12
        log(f"{label + f', kv {kv_heads}':34s} {ms:8.3f} {ms / base:7.2f} {ms / read_ms:10.2f} "
            f"{kv_bytes / (ms * 1e-3) / 1e9:7.0f} {rate:8.2f} {100 * rate / PEAK_TFLOPS:6.2f}%")
    log(f"{f'K/V read at copy bandwidth, kv {kv_heads}':34s} {read_ms:8.3f}")


# --- 4. tile sweep ----------------------------------------------------------------------------------

FWD_CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]
STATS_CANDIDATES = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3), (128, 32, 8, 2)]
COLS_CANDIDATES = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 3)]


def run_tile_sweep(n: int, heads: int, d: int, budget_s: float) -> None:
    log(f"== tile sweep at {n} tokens (BLOCK_M, BLOCK_N, warps, stages); defaults: {ta.TILES} ==")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(3))
    for which, cands, stats in (("fwd", FWD_CANDIDATES, (stat.LSE,)),
                                ("stats", STATS_CANDIDATES, (stat.ENTROPY, stat.COL_SUM)),
                                ("cols", COLS_CANDIDATES, (stat.COL_SUM,))):
        for tiles in cands:
            if elapsed() > budget_s:
                log("(tile sweep stopped: time budget)")
                ta.TILE_OVERRIDE.clear()
                return
            ta.TILE_OVERRIDE.clear()
            ta.TILE_OVERRIDE[which] = tiles
            try:
                ms = bench_ms(lambda stats=stats: attention(q, k, v, backend="triton", stats=stats))
                log(f"{which:6s} {str(tiles):20s} {ms:9.2f} ms ({'+'.join(stats)})")
            except Exception as exc:
                log(f"{which:6s} {str(tiles):20s} ERROR {short_error(exc)}")
    ta.TILE_OVERRIDE.clear()
    log("")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--d-head", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting new cases after this")
    parser.add_argument("--decode-keys", type=int, default=65536, help="keys of the decode-row timing")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, TRITON_INTERPRET=1, tiny shapes: exercises this script without a GPU")
    args = parser.parse_args()

    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
        for name, (_b, h, h_kv, n_q, n_k, d, dtype, causal, block, *mask) in list(PARITY.items()):
            d_small = min(d, 32) if d & (d - 1) == 0 else 24  # keep a non-power-of-two head size
            mask = dict(mask[0]) if mask else {}
            if "key_window" in mask:  # a window that still masks at 47 keys, one per (fewer) head
                mask["key_window"] = 5 if isinstance(mask["key_window"], int) else torch.tensor([0, 3, 5, 9][: min(h, 4)])
            PARITY[name] = (1, min(h, 4), min(h_kv, 2), min(n_q, 33), min(n_k, 47), d_small, dtype, causal,
                            min(block, 8), mask)
        for name, (h, h_kv, n_q, n_k, topk, *mask) in list(NEW_PARITY.items()):
            mask = dict(mask[0]) if mask else {}
            if "key_window" in mask:
                mask["key_window"] = 5 if isinstance(mask["key_window"], int) else torch.tensor([0, 3, 5, 9])
            n_k = DECODE_MIN_KEYS if n_k > 4096 and n_q <= 16 else min(n_k, 47)  # keep each case's path
            NEW_PARITY[name] = (min(h, 4), min(h_kv, 2), min(n_q, 33), n_k, min(topk, n_k), mask, 16)
        args.sizes, args.heads, args.d_head, args.decode_keys = [64], 2, 16, DECODE_MIN_KEYS

    import triton

    if DEVICE == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: this script needs a GPU (or --dry-run with TRITON_INTERPRET=1)")
        return 2
    where = torch.cuda.get_device_name() + f", capability {torch.cuda.get_device_capability()}" \
        if DEVICE == "cuda" else "CPU dry run (interpreter)"
    log(f"torch {torch.__version__}, triton {triton.__version__}, {where}")
    failures = 0 if args.skip_parity else run_parity() + run_new_parity()
    run_timing(args.sizes, args.heads, args.d_head, args.budget_s - 90)
    if elapsed() < args.budget_s - 30:
        run_decode_timing(args.decode_keys, args.heads, args.d_head)
    if not args.skip_sweep:
        run_tile_sweep(args.sizes[0] if args.dry_run else 16384, args.heads, args.d_head, args.budget_s)
    log(f"done in {elapsed():.0f} s; parity failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: a Llama-3.1-8B-shaped model at 32k-128k tokens, statistics mode against SDPA (a GPU script).

The model has Llama 3.1 8B's shape (32 layers, hidden 4096, 32 query / 8 key-value heads of 128, MLP
14336, vocabulary 128256, RoPE θ 500000, 131072 positions) and random weights: ``LlamaConfig`` +
``LlamaForCausalLM`` built on the device in bf16, nothing downloaded, wrapped as headscope wraps models
(:func:`headscope.analysis.models.wrap_model`, TransformerLens' bridge). Per length N (default 32k, 64k, 128k):

  sdpa   Hugging Face's own model on the same weights with SDPA attention (the bridge's modules
         unwrapped: :func:`headscope.analysis.bare_model.bare_twin`), one forward pass, last position's logits: the baseline;
  stats  one statistics-mode pass through the bridge (:mod:`headscope.analysis.attention_statistics`, as
         :func:`headscope.analysis.statistics_run.capture_statistics` runs it): every layer's attention through
         :func:`headscope.kernels.attention` (Triton on CUDA) with the per-row statistics a statistics run keeps
         (entropy, argmax, sink and recent mass, the first key's mass, log-sum-exp), copied to the host
         layer by layer; no N × N matrix.

Both without a KV cache. Per case: seconds, peak memory above the weights, tokens/s, time ratio to sdpa
and the largest |difference| of the last position's logits. Then one layer's attention alone at each N
(random q/k/v of the model's shape): SDPA against the kernel with the same statistics, and the achieved
attention TFLOP/s (causal: 2 · N² · d_head · heads per layer, the QKᵀ and PV products) against the
device's dense bf16 peak (``--peak-tflops``; known for H100/H200/A100). Last, a retrieval trial at
``--retrieval-length``: prefill and ``--decode-steps`` KV-cached steps recording each step's argmax key
per head (:func:`headscope.analysis.greedy_decoding.greedy_decode`) against Hugging Face's greedy ``generate``.

Guards: ``--budget-s`` (a size whose time, extrapolated as N² from the last one, would not fit is
skipped) and a memory estimate per size against the device's free memory (skipped, with the estimate,
when it would not fit).

On one GPU with ≥ 80 GB (the project's environment), one command, about 6-9 minutes on an H200:

    PYTHONUNBUFFERED=1 python bench/scale.py --budget-s 480 | tee bench/results/scale_h200_$(date +%F).txt

The lent H200 image has torch, triton and transformers but not transformer-lens or platformdirs: carry
their wheels as /work/.library/device/README.md says (transformer-lens==4.3.0 and its missing
dependencies, transformers==5.23.0, platformdirs). On a CPU, tiny shapes (2 layers, hidden 256,
128-256 tokens, 3 decode steps; ``tests/bench/test_scale.py`` runs it):

    python bench/scale.py --dry-run
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from headscope.analysis.attention_statistics import LayerRequest, statistics_mode  # noqa: E402
from headscope.analysis.bare_model import bare_twin  # noqa: E402
from headscope.analysis.greedy_decoding import greedy_decode  # noqa: E402
from headscope.analysis.models import LoadedModel, wrap_model  # noqa: E402
from headscope.kernels.attention import ARGMAX, ENTROPY, LSE, RECENT_MASS, SINK_MASS, SPAN_MASS, attention  # noqa: E402

#: Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) by a word of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
STATS = dict(stats=(ENTROPY, ARGMAX, SINK_MASS, RECENT_MASS, SPAN_MASS, LSE), sink_size=4, window=64, spans=[(0, 1)])


@dataclass(frozen=True)
class Shape:
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    d_head: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    max_positions: int = 131072

    @property
    def params(self) -> int:
        attn = self.hidden * self.d_head * (2 * self.heads + 2 * self.kv_heads)
        return self.n_layers * (attn + 3 * self.hidden * self.intermediate) + 2 * self.vocab * self.hidden


LLAMA_8B = Shape(n_layers=32, hidden=4096, heads=32, kv_heads=8, d_head=128, intermediate=14336, vocab=128256)
TINY = Shape(n_layers=2, hidden=256, heads=4, kv_heads=2, d_head=64, intermediate=512, vocab=1024)


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer with ``vocab`` entries ``t0 ..``: the bridge needs one, nothing here reads text.
    No BOS token: TransformerLens would otherwise reload it by name with ``add_bos_token``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2")


def build_model(shape: Shape, device: str, dtype: torch.dtype) -> LoadedModel:
    """Random weights of ``shape`` made on ``device`` in ``dtype`` (never a float32 copy), wrapped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.d_head, rope_theta=shape.rope_theta, max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    config._attn_implementation = "eager"  # as analysis.models loads models; the bridge runs its own attention
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    tokenizer = synthetic_tokenizer(shape.vocab)
    return wrap_model(hf.eval(), tokenizer, name="llama-3.1-8b-shaped-random", digest="random", device=device)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(fn: Callable[[], object], device: str) -> tuple[object, float, float]:
    """``fn()``; (result, seconds, peak GiB above the memory in use before it)."""
    if device.startswith("cuda"):
        gc.collect()  # frees the last case's tensors for the next peak (1-2 s with transformers loaded: not on the CPU)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - before) / 2**30
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current resident set
    before = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, (_rss_kb("VmHWM") - before) / 2**20


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def forward_bytes(shape: Shape, n: int, bytes_per: int = 2) -> int:
    """A generous estimate of one forward pass's working memory at ``n`` tokens (no KV cache): the
    residual stream and norms (≈ 8 × hidden), the MLP's three intermediates, q/k/v and the attention
    output, per token; the statistics of one layer (float32, ≈ 8 per head and row)."""
    per_token = 8 * shape.hidden + 3 * shape.intermediate + 2 * (shape.heads + shape.kv_heads) * shape.d_head
    return n * per_token * bytes_per + 8 * shape.heads * n * 4


def sdpa_forward(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    twin = bare_twin(model, "sdpa")
    with torch.inference_mode():
        return twin(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()


def stats_forward(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    request = LayerRequest(dict(STATS))
    kept = []

    def keep(ls) -> None:  # to the host, layer by layer, as a statistics run does
        kept.append(sum(t.cpu().numel() for t in ls.stats.values()))

    with torch.inference_mode(), statistics_mode(model, lambda layer, n_q, n_k: request, keep):
        logits = model.bridge(ids, return_type="logits", use_cache=False, logits_to_keep=1)
    assert len(kept) == model.n_layers, "every layer must report its statistics"
    return logits[0, -1].float()


def attention_tflops(shape: Shape, n: int, seconds: float) -> float:
    return 2.0 * n * n * shape.d_head * shape.heads / seconds / 1e12


def time_attention(shape: Shape, n: int, device: str, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Seconds of one layer's causal attention at ``n`` tokens: SDPA, and the kernel with :data:`STATS`."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, shape.heads, n, shape.d_head, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, shape.kv_heads, n, shape.d_head, device=device, dtype=dtype, generator=g) for _ in "kv")
    cases = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             "stats": lambda: attention(q, k, v, causal=True, **STATS)}
    best = {}
    for name, fn in cases.items():
        fn()  # warm-up (Triton compiles on first use)
        best[name] = min(measure(fn, device)[1] for _ in range(repeats))
    return best["sdpa"], best["stats"]


def device_peak(device: str, given: float | None) -> tuple[str, float | None]:
    if not device.startswith("cuda"):
        return "cpu", given
    name = torch.cuda.get_device_name()
    return name, given or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def run_forward_sizes(model: LoadedModel, shape: Shape, lengths: list[int], device: str, deadline: float,
                      weights_gib: float) -> list[int]:
    """The sdpa and stats forward passes at each length; returns the lengths that ran."""
    header = (f"{'case':<6} {'tokens':>7} {'time s':>8} {'peak GiB':>9} {'tokens/s':>10} {'time/sdpa':>10} "
              f"{'max |Δlogit|':>13}")
    print(f"weights {weights_gib:.1f} GiB; peaks are above the weights")
    print(header)
    print("-" * len(header))
    ran, last = [], None
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        need = forward_bytes(shape, n)
        if need > 0.9 * free_bytes(device):
            print(f"{'skip':<6} {n:>7}  estimated {need / 2**30:.1f} GiB > 90% of the {free_bytes(device) / 2**30:.1f} "
                  "GiB free")
            continue
        if last is not None and time.perf_counter() + last[1] * (n / last[0]) ** 2 > deadline:
            print(f"{'skip':<6} {n:>7}  would need ≈{last[1] * (n / last[0]) ** 2:.0f} s, past --budget-s")
            continue
        ids = torch.randint(3, shape.vocab, (1, n), generator=gen).to(device)
        base, t_base, m_base = measure(lambda ids=ids: sdpa_forward(model, ids), device)
        got, t_stats, m_stats = measure(lambda ids=ids: stats_forward(model, ids), device)
        diff = float((got - base).abs().max())
        for name, t, m in (("sdpa", t_base, m_base), ("stats", t_stats, m_stats)):
            print(f"{name:<6} {n:>7} {t:>8.2f} {m:>9.2f} {n / t:>10.0f} {t / t_base:>10.2f} "
                  f"{diff if name == 'stats' else 0.0:>13.3g}")
        ran.append(n)
        last = (n, t_base + t_stats)
    return ran


def run_attention_sizes(shape: Shape, lengths: list[int], device: str, dtype: torch.dtype, peak: float | None,
                        repeats: int) -> None:
    print(f"\none layer's attention ({shape.heads} query / {shape.kv_heads} key-value heads of {shape.d_head}, "
          f"{str(dtype).removeprefix('torch.')}, causal); peak {f'{peak:.0f} TFLOP/s' if peak else 'unknown'}")
    header = (f"{'tokens':>7} {'sdpa ms':>9} {'stats ms':>9} {'stats/sdpa':>11} {'sdpa TFLOP/s':>13} "
              f"{'stats TFLOP/s':>14} {'% of peak':>10}")
    print(header)
    print("-" * len(header))
    for n in lengths:
        t_sdpa, t_stats = time_attention(shape, n, device, dtype, repeats)
        f_sdpa, f_stats = attention_tflops(shape, n, t_sdpa), attention_tflops(shape, n, t_stats)
        share = f"{100 * f_sdpa / peak:.0f} / {100 * f_stats / peak:.0f}" if peak else "n/a"
        print(f"{n:>7} {t_sdpa * 1e3:>9.2f} {t_stats * 1e3:>9.2f} {t_stats / t_sdpa:>11.2f} {f_sdpa:>13.1f} "
              f"{f_stats:>14.1f} {share:>10}")


def run_retrieval(model: LoadedModel, shape: Shape, n: int, steps: int, device: str) -> None:
    """Prefill + ``steps`` decode steps recording argmax rows, against Hugging Face's greedy generate."""
    ids = torch.randint(3, shape.vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    twin = bare_twin(model, "sdpa")

    def generate() -> list[int]:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = twin.generate(x, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        return out[0, n:].tolist()

    hf_tokens, t_hf, m_hf = measure(generate, device)
    decoded, t_score, m_score = measure(lambda: greedy_decode(model, ids, steps), device)
    same = decoded.generated == hf_tokens[: len(decoded.generated)]
    print(f"\nretrieval trial at {n} tokens: HF generate (SDPA) {len(hf_tokens)} tokens {t_hf:.2f} s, peak {m_hf:.2f} GiB; "
          f"scoring (argmax rows) {len(decoded.generated)} steps {t_score:.2f} s, peak {m_score:.2f} GiB; "
          f"time ratio {t_score / t_hf:.2f}; same tokens {same}; argmax rows {tuple(decoded.argmax_keys.shape)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (tests the script)")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --dry-run)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default 32768 65536 131072")
    parser.add_argument("--retrieval-length", type=int, default=None, help="default 32768; 0 skips the trial")
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting sizes after this many seconds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--repeats", type=int, default=3, help="attention timings: the fastest of this many")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    shape = TINY if args.dry_run else LLAMA_8B
    device = args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    lengths = args.lengths or ([128, 256] if args.dry_run else [32768, 65536, 131072])
    retrieval = args.retrieval_length if args.retrieval_length is not None else (128 if args.dry_run else 32768)
    steps = 3 if args.dry_run and args.decode_steps == 24 else args.decode_steps
    repeats = 1 if args.dry_run else args.repeats
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    name, peak = device_peak(device, args.peak_tflops)
    model, t_build, m_build = measure(lambda: build_model(shape, device, dtype), device)
    print(f"{'dry run: ' if args.dry_run else ''}Llama-3.1-8B-shaped random model {shape} on {name}, "
          f"{shape.params / 1e9:.3g}B parameters, built and wrapped in {t_build:.1f} s; torch {torch.__version__}")
    ran = run_forward_sizes(model, shape, lengths, device, t0 + args.budget_s, m_build)
    if ran:
        run_attention_sizes(shape, ran, device, dtype, peak, repeats)
    if retrieval and time.perf_counter() - t0 < args.budget_s:
        run_retrieval(model, shape, retrieval, steps, device)
    elif retrieval:
        print(f"\nretrieval trial skipped: --budget-s {args.budget_s:g} spent")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

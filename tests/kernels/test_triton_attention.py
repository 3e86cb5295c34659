"""The Triton kernels against the torch kernel, under Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, and it would change how
every later Triton import in the pytest process behaves. So the kernels run in one subprocess
(this file executed as a script), which prints a JSON report per case; the tests read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from headscope.kernels.statistics import STATISTICS

ROOT = Path(__file__).resolve().parents[2]

# 600 s, not the suite's 300: the first test waits for the interpreter subprocess, which runs every
# case 100-1000x slower than torch (measured: 259 s on a 2-core machine at load average 9-12)
pytestmark = pytest.mark.timeout(600)

# name: (batch, n_heads, n_kv_heads, n_q, n_k, d, d_v, causal, dtype, block_size, tiles (m, n) or None)
CASES = {
    "gqa-causal-odd": (1, 4, 2, 37, 37, 16, 16, True, "float32", 4, None),
    "decode-rows-any-block": (1, 6, 3, 5, 41, 16, 16, True, "float32", 5, None),
    "mqa-bidirectional-small-d": (2, 2, 1, 20, 29, 8, 8, False, "float32", 16, None),
    "one-token": (1, 2, 1, 1, 1, 16, 16, True, "float32", 2, None),
    "wide-tiles-dv": (1, 4, 2, 40, 40, 32, 8, True, "float32", 8, (32, 16)),
    "block-larger-than-tiles": (1, 2, 2, 33, 50, 16, 16, True, "float32", 32, None),
    "bfloat16": (1, 4, 2, 19, 19, 16, 16, True, "bfloat16", 4, None),
    "float16": (1, 4, 2, 19, 23, 16, 16, True, "float16", 3, None),
    "more-queries-than-keys": (1, 2, 1, 30, 12, 16, 16, False, "float32", 4, None),
}
ALL = STATISTICS


def _worker() -> None:
    """Run every case with both backends; print one JSON line of max differences per case."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    from headscope.kernels.attention import attention
    from headscope.kernels.statistics import validate
    from headscope.kernels.triton_attention import triton_attention

    report = {}
    for name, (b, h, h_kv, n_q, n_k, d, d_v, causal, dtype, block, tiles) in CASES.items():
        g = torch.Generator().manual_seed(len(name))
        dt = getattr(torch, dtype)
        q = torch.randn(b, h, n_q, d, generator=g).to(dt)
        k = torch.randn(b, h_kv, n_k, d, generator=g).to(dt)
        v = torch.randn(b, h_kv, n_k, d_v, generator=g).to(dt)
        if name == "gqa-causal-odd":  # hook tensors arrive as [batch, pos, head, d]: strided views
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        kw = dict(causal=causal, stats=ALL, spans=[(0, 1), (n_k // 2, n_k)], block_size=block,
                  rows=[0, n_q - 1, 0], topk=min(3, n_k), sink_size=3, window=7)
        ref = attention(q, k, v, backend="torch", **kw)
        if tiles:
            plan = validate(q, k, v, kw["causal"], None, ALL, 3, 7, kw["spans"], block, kw["rows"],
                            kw["topk"], "triton")
            out, stats = triton_attention(q, k, v, plan, block_m=tiles[0], block_n=tiles[1])
        else:
            res = attention(q, k, v, backend="triton", **kw)
            out, stats = res.out, res.stats
        only_out = attention(q, k, v, backend="triton", causal=causal)
        lse_only = attention(q, k, v, backend="triton", causal=causal, stats="lse")
        col_only = attention(q, k, v, backend="triton", causal=causal, stats="col_sum")  # its own kernel
        diffs = {
            "col_sum/alone": (col_only.col_sum - ref.col_sum).abs().max().item(),
            "out": (out.float() - ref.out.float()).abs().max().item(),
            "out/no-stats": (only_out.out.float() - ref.out.float()).abs().max().item(),
            "lse/alone": (lse_only.lse - ref.lse).abs().max().item(),
            "dtype": str(out.dtype).removeprefix("torch."),
        }
        for key, want in ref.stats.items():
            got = stats[key]
            if want.dtype == torch.int64:
                diffs[key] = int((got != want).sum().item())
            else:
                assert got.shape == want.shape, (key, got.shape, want.shape)
                diffs[key] = (got - want).abs().max().item()
        report[name] = diffs

    # exact ties (q = 0: uniform rows): lowest key index first, as torch.argmax and the torch kernel
    q = torch.zeros(1, 4, 9, 16)
    k = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(0))
    tied = attention(q, k, k, backend="triton", stats="argmax", topk=3)
    report["ties"] = {
        "argmax_is_first_key": bool((tied.argmax == 0).all()),
        "topk_in_index_order": bool((tied.topk_index == torch.tensor([0, 1, 2])).all()),
        "prob": (tied.topk_prob - 1 / (torch.arange(31, 40) + 1.0).view(1, 1, 9, 1)).abs().max().item(),
    }
    report["model"] = _model_through_triton()
    print(json.dumps(report))


def _model_through_triton() -> dict:
    """Statistics mode with the Triton backend (interpreted) inside a tiny Llama's own forward pass:
    the integration that runs by default on CUDA, checked against the eager path."""
    import torch

    from headscope.analysis.attention_statistics import LayerRequest, statistics_mode
    from headscope.analysis.models import wrap_model
    from tests.conftest import load_embedded_tokenizer, tiny_hf_model

    tokenizer = load_embedded_tokenizer()  # the tokenizer alone: no real weights for a tiny model
    model = wrap_model(tiny_hf_model(len(tokenizer)), tokenizer, name="tiny", digest="tiny-triton")
    ids = torch.tensor([tokenizer.encode("Triton inside the bridge: the same logits as eager, twice over.")])
    seen = []
    with torch.inference_mode():
        eager = model.bridge(ids, return_type="logits")
        req = LayerRequest({"stats": ("entropy", "argmax"), "backend": "triton"})
        with statistics_mode(model, lambda layer, n_q, n_k: req, seen.append):
            stats = model.bridge(ids, return_type="logits")
            _, past = model.bridge(ids[:, :-1], return_type="logits_and_cache", use_cache=True)
            step, _ = model.bridge(ids[:, -1:], return_type="logits_and_cache", past_key_values=past)
    return {"logits": (stats - eager).abs().max().item(), "decode": (step[0, -1] - eager[0, -1]).abs().max().item(),
            "layers": len(seen)}


def _compile_worker() -> None:
    """Compile each kernel for sm_90 without a GPU: GPU-only lowering errors show up here."""
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from headscope.kernels import triton_attention as ta
    from headscope.kernels import triton_decode as td

    def build(fn, dtype, num_warps, **constexprs):
        # naming convention in kernels/triton_attention.py: Capitalised = pointer, ALL_CAPS = constexpr
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in ("Q", "K", "V", "Out"):
                sig[name] = "*" + dtype
            elif name in ("ArgIdx", "RowSlot", "Spans", "PrevIdx", "NextIdx", "Win", "Sink", "TopIdx", "PartArgI"):
                sig[name] = "*i32"
            elif name == "PartTop":
                sig[name] = "*i64"
            elif name[0].isupper() and not name.isupper():
                sig[name] = "*fp32"
            else:
                sig[name] = "fp32" if name in ("qk_scale", "cap") else "i32"
        src = ASTSource(fn, sig, constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 3})

    every = dict(DO_ENT=True, DO_ARG=True, NUM_SPANS=3, SPAN_PAD=4, DO_RECENT=True, DO_COL=True, DO_ROWS=True,
                 UPCAST=False, DO_TOPK=True, TOPK=16, TOPK_P=16)  # the fused top-16 list on top of all
    plain, masked = dict(WINDOWED=False, SOFTCAP=False), dict(WINDOWED=True, SOFTCAP=True)  # Gemma 2
    build(ta._attn_fwd, "bf16", 8, HEAD_D=128, HEAD_DV=128, BLOCK_D=128, BLOCK_DV=128, CAUSAL=True,
          BLOCK_M=128, BLOCK_N=64, PRECISION="tf32", UPCAST=False, **plain)
    build(ta._attn_fwd, "bf16", 4, HEAD_D=256, HEAD_DV=256, BLOCK_D=256, BLOCK_DV=256, CAUSAL=True,
          BLOCK_M=64, BLOCK_N=32, PRECISION="tf32", UPCAST=False, **masked)
    build(ta._attn_stats, "bf16", 8, HEAD_D=128, BLOCK_D=128, CAUSAL=True, BLOCK_M=64, BLOCK_N=64,
          PRECISION="tf32", POOL_MODE=1, POOL_PM=1, POOL_PN=1, POOL_QBP=1, POOL_KBP=1, **every, **plain)
    build(ta._attn_stats, "bf16", 4, HEAD_D=256, BLOCK_D=256, CAUSAL=True, BLOCK_M=32, BLOCK_N=32,
          PRECISION="tf32", POOL_MODE=1, POOL_PM=1, POOL_PN=1, POOL_QBP=1, POOL_KBP=1, **every, **masked)
    build(ta._attn_stats, "fp32", 4, HEAD_D=80, BLOCK_D=128, CAUSAL=False, BLOCK_M=64, BLOCK_N=64,
          PRECISION="ieee", POOL_MODE=2, POOL_PM=1, POOL_PN=1, POOL_QBP=16, POOL_KBP=16, **every, **plain)
    build(ta._attn_topk_next, "fp16", 4, HEAD_D=64, BLOCK_D=64, CAUSAL=True, BLOCK_M=64, BLOCK_N=64,
          PRECISION="tf32", UPCAST=False, **masked)
    build(ta._attn_colsum, "bf16", 4, HEAD_D=128, BLOCK_D=128, CAUSAL=True, BLOCK_M=64, BLOCK_N=64,
          PRECISION="tf32", UPCAST=False, **masked)
    # split-K decode: 1 row x 4 heads per kv head (MQA/GQA packing), every statistic it has, top-16;
    # Gemma 2's mask with head_dim 256
    decode = dict(DO_ENT=True, DO_ARG=False, DO_TOPK=True, TOPK=16, TOPK_P=16, NUM_SPANS=3, SPAN_PAD=4,
                  DO_RECENT=True, DO_ROWS=True, UPCAST=False, CAUSAL=True, PRECISION="tf32")
    build(td._attn_decode_split, "bf16", 4, HEAD_D=128, HEAD_DV=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=16,
          BLOCK_N=64, **decode, **plain)
    build(td._attn_decode_split, "bf16", 4, HEAD_D=256, HEAD_DV=256, BLOCK_D=256, BLOCK_DV=256, BLOCK_M=16,
          BLOCK_N=32, **decode, **masked)
    print(json.dumps({"compiled": 9}))


@pytest.fixture(scope="module")
def workers():
    """Both subprocesses start together: the interpreter run and the sm_90 compile overlap."""
    interp_env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    plain_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {
        name: subprocess.Popen([sys.executable, __file__, flag], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=ROOT)
        for name, flag, env in (("interpret", "--worker", interp_env), ("compile", "--compile", plain_env))
    }
    results = {}

    def result(name: str) -> tuple[int, str, str]:
        if name not in results:
            out, err = procs[name].communicate(timeout=540)  # inside the module's 600 s test timeout
            results[name] = (procs[name].returncode, out, err)
        return results[name]

    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def report(workers) -> dict:
    code, out, err = workers("interpret")
    assert code == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_torch_kernel(report, case):
    diffs = report[case]
    low_precision = CASES[case][8] != "float32"
    out_tol = 2e-2 if low_precision else 1e-5  # the output is rounded to the input dtype
    assert diffs["dtype"] == CASES[case][8]
    assert diffs["out"] <= out_tol
    assert diffs["out/no-stats"] <= out_tol
    assert diffs["lse/alone"] <= 1e-5
    assert diffs["col_sum/alone"] <= 2e-6 * max(1, CASES[case][3])  # a sum over up to n_q rows
    expected = {*ALL, "argmax_prob"} | ({"topk_index", "topk_prob"} if CASES[case][4] > 1 else set())
    assert expected <= set(diffs)
    for key in expected:
        if key in ("argmax", "topk_index"):
            assert diffs[key] == 0, key  # index mismatches
        elif key in ("lse", "entropy"):
            assert diffs[key] <= 1e-5, key
        else:  # probabilities and masses
            assert diffs[key] <= 2e-6, key


@pytest.mark.slow
def test_statistics_mode_through_triton_matches_eager_logits(report):
    model = report["model"]
    assert model["layers"] == 2 + 2 * 2  # the prefill, then the cached prefill and one decode step
    assert model["logits"] <= 1e-5 and model["decode"] <= 1e-5


@pytest.mark.slow
def test_ties_go_to_the_lowest_key_index(report):
    ties = report["ties"]
    assert ties["argmax_is_first_key"]
    assert ties["topk_in_index_order"]
    assert ties["prob"] <= 1e-6


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu(workers):
    """The interpreter does not lower to GPU code; compiling for sm_90 catches what it cannot."""
    code, out, err = workers("compile")
    if code != 0 and "ptxas" in err and "No such file" in err:
        pytest.skip("triton's CUDA toolchain (ptxas) is not installed")
    assert code == 0, err[-4000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"compiled": 9}


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """Without TRITON_INTERPRET, asking for Triton on CPU is a clear error, not a driver traceback."""
    import torch

    from headscope.kernels.attention import attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attention(q, q, q, backend="triton")
    assert attention(q, q, q, backend="auto").out.shape == (1, 2, 4, 16)  # auto: torch on CPU


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and "--compile" in sys.argv:
    _compile_worker()

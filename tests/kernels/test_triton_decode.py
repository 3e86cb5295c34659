"""The split-K decode kernel (``kernels/triton_decode.py``) and the fused top-k list it shares with the
statistics pass (``kernels/triton_attention.py``), under Triton's CPU interpreter, against the torch
kernel and the eager reference.

What is guaranteed, and so asserted: probabilities, masses, entropy, lse and the output agree to
float32 rounding; the argmax index is the torch kernel's (the lowest index on exact ties, both
sides); a top-k index may differ from the torch kernel's only where the two keys' probabilities are
tied within rounding (``torch.topk`` leaves the order of ties unspecified), and on exact ties the
Triton kernels list keys by increasing index. As in ``test_triton_attention.py`` the kernels run in
one subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported) that prints a JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# name: (n_heads, n_kv_heads, n_q, n_k, topk, key_window, key_sink, softcap, dtype)
TOPK_CASES = {  # the statistics pass with a running top-k list (two-pass kernels: n_k < 512)
    "gqa-ragged-k4": (4, 2, 21, 21, 4, None, None, None, "float32"),
    "window-sinks-softcap-k8": (2, 1, 19, 27, 8, [3, 6], [2, 0], 3.0, "float32"),
    "decode-rows-k16": (2, 1, 3, 35, 16, None, None, None, "float32"),
    "k17-one-pass-per-rank": (1, 1, 5, 20, 17, None, None, None, "float32"),  # k > 16: the old passes
}
DECODE_CASES = {  # triton_decode with ranges of 32 keys (two 16-key tiles): every case crosses ranges
    "one-row-gqa-k1": (4, 2, 1, 41, 1, None, None, None, "float32"),
    "window-sinks-softcap-k4": (4, 2, 3, 70, 4, [0, 3, 7, 1], [0, 1, 2, 0], 3.0, "float32"),
    "bf16-window-k8": (4, 1, 5, 50, 8, 5, 2, None, "bfloat16"),
    "16-rows-two-row-blocks-k16": (2, 1, 16, 40, 16, None, None, None, "float32"),
    "bidirectional-k2": (2, 2, 2, 37, 2, None, None, None, "float32"),  # causal=False
}
DISPATCH = (2, 1, 1, 512)  # n_heads, n_kv_heads, n_q, n_k: attention() picks the split-K kernel


def _worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    from headscope.kernels.attention import attention
    from headscope.kernels.statistics import validate
    from headscope.kernels.triton_decode import DECODE_STATS, splits_keys, triton_decode

    def tensors(name, h, h_kv, n_q, n_k, dtype):
        g = torch.Generator().manual_seed(len(name))
        dt = getattr(torch, dtype)
        return ((torch.randn(1, h, n_q, 16, generator=g) * 2).to(dt), torch.randn(1, h_kv, n_k, 16, generator=g).to(dt),
                torch.randn(1, h_kv, n_k, 16, generator=g).to(dt))

    def compare(got: dict, out, want, q, k, v, mask, causal=True) -> dict:
        """Max differences; index slots that differ from the torch kernel's where the two keys'
        reference probabilities differ by more than 1e-6 (not a tie) are counted apart."""
        diffs = {"out": (out.float() - want.out.float()).abs().max().item()}
        probs = _matrix(q, k, mask, causal)  # [b, h, n_q, n_k]
        for key, w in want.stats.items():
            g = got[key]
            assert g.shape == w.shape, (key, g.shape, w.shape)
            if w.dtype == torch.int64:
                wi, gi = (w.unsqueeze(-1), g.unsqueeze(-1)) if key == "argmax" else (w, g)
                differ = gi != wi
                p_got = probs.gather(-1, gi.clamp(min=0)).masked_fill(gi < 0, 0.0)
                p_want = probs.gather(-1, wi.clamp(min=0)).masked_fill(wi < 0, 0.0)
                diffs[key] = int(differ.sum())
                diffs[key + "/not-tied"] = int((differ & ((p_got - p_want).abs() > 1e-6)).sum())
            else:
                diffs[key] = (g.double() - w.double()).abs().max().item()
        return diffs

    def mask_of(window, sink, cap):
        def arg(x):
            return torch.tensor(x) if isinstance(x, list) else x

        return dict(key_window=arg(window), key_sink=arg(sink), softcap=cap)

    report: dict = {"topk": {}, "decode": {}}
    for name, (h, h_kv, n_q, n_k, topk, window, sink, cap, dtype) in TOPK_CASES.items():
        q, k, v = tensors(name, h, h_kv, n_q, n_k, dtype)
        mask = mask_of(window, sink, cap)
        kw = dict(stats=("argmax", "entropy", "sink_mass"), topk=topk, **mask)
        got = attention(q, k, v, backend="triton", **kw)
        report["topk"][name] = compare(got.stats, got.out, attention(q, k, v, backend="torch", **kw), q, k, v, mask)
    for name, (h, h_kv, n_q, n_k, topk, window, sink, cap, dtype) in DECODE_CASES.items():
        q, k, v = tensors(name, h, h_kv, n_q, n_k, dtype)
        mask = mask_of(window, sink, cap)
        kw = dict(spans=[(0, 1), (n_k // 2, n_k)], rows=[0, n_q - 1], window=7, sink_size=3, topk=topk)
        causal = not name.startswith("bidirectional")
        plan = validate(q, k, v, causal, None, DECODE_STATS, 3, 7, kw["spans"], None, kw["rows"], topk, "triton",
                        **mask)
        out, stats = triton_decode(q, k, v, plan, split=32)
        want = attention(q, k, v, backend="torch", causal=causal, stats=DECODE_STATS, **kw, **mask)
        report["decode"][name] = compare(stats, out, want, q, k, v, mask, causal)

    # exact ties (q = 0: every visible key scores 0): keys listed by increasing index, both kernels
    q0, k0 = torch.zeros(1, 2, 2, 16), torch.randn(1, 1, 40, 16, generator=torch.Generator().manual_seed(1))
    plan = validate(q0, k0, k0, True, None, ("argmax",), 4, 64, None, None, None, 8, "triton")
    fused = attention(q0, k0, k0, backend="triton", stats="argmax", topk=8)
    _, split = triton_decode(q0, k0, k0, plan, split=16)
    first8 = torch.arange(8).expand(1, 2, 2, 8)
    report["ties"] = {"fused": bool((fused.topk_index == first8).all()), "decode": bool((split["topk_index"] == first8).all()),
                      "decode_argmax": bool((split["argmax"] == 0).all())}

    h, h_kv, n_q, n_k = DISPATCH
    q, k, v = tensors("dispatch", h, h_kv, n_q, n_k, "float32")
    kw = dict(stats=("argmax", "rows", "lse"), rows=[0])
    plan = validate(q, k, v, True, None, kw["stats"], 4, 64, None, None, [0], 1, "triton")
    col_plan = validate(q, k, v, True, None, ("col_sum",), 4, 64, None, None, None, 1, "triton")
    got = attention(q, k, v, backend="triton", **kw)
    report["dispatch"] = {"splits": splits_keys(plan, n_q, n_k), "col_sum_splits": splits_keys(col_plan, n_q, n_k),
                          **compare(got.stats, got.out, attention(q, k, v, backend="torch", **kw), q, k, v, {})}
    print(json.dumps(report))


def _matrix(q, k, mask, causal=True):
    """The reference attention matrix in float64 (for the probability of any chosen key)."""
    import torch

    from headscope.kernels.reference import attention_scores

    return torch.softmax(attention_scores(q, k, causal=causal, **mask), -1)


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(diffs: dict, low_precision: bool) -> None:
    tol = 2e-2 if low_precision else 2e-6
    for key, diff in diffs.items():
        if key.endswith("/not-tied"):
            assert diff == 0, (key, diff)  # an index differs only between keys tied within rounding
        elif key == "argmax" and not low_precision:
            assert diff == 0, (key, diff)
        elif key in ("argmax", "topk_index"):
            continue  # counted in /not-tied
        elif key in ("lse", "entropy", "out"):
            assert diff <= (tol if low_precision else 1e-5), (key, diff)
        else:
            assert diff <= tol, (key, diff)


@pytest.mark.parametrize("case", list(TOPK_CASES))
def test_fused_topk_matches_torch_kernel(report, case):
    diffs = report["topk"][case]
    assert {"topk_index", "topk_prob", "argmax", "argmax_prob", "entropy", "sink_mass"} <= set(diffs)
    _check(diffs, False)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_split_k_decode_matches_torch_kernel(report, case):
    diffs = report["decode"][case]
    want = {"out", "lse", "entropy", "argmax", "argmax_prob", "span_mass", "sink_mass", "recent_mass", "rows"}
    if DECODE_CASES[case][4] > 1:
        want |= {"topk_index", "topk_prob"}
    assert want <= set(diffs)
    _check(diffs, DECODE_CASES[case][8] == "bfloat16")


def test_exact_ties_list_keys_by_increasing_index(report):
    assert report["ties"] == {"fused": True, "decode": True, "decode_argmax": True}


def test_attention_sends_decode_rows_to_split_k(report):
    diffs = dict(report["dispatch"])
    assert diffs.pop("splits") is True and diffs.pop("col_sum_splits") is False
    _check(diffs, False)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()

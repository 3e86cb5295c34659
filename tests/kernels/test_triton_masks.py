"""Sliding windows with sinks (per query head) and soft-capping in the Triton kernels, under
Triton's CPU interpreter, against the eager reference from the definition.

As in ``test_triton_attention.py``, ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported, so the kernels run in a subprocess (this file as a script) that prints a JSON report.
Shapes are tiny: the interpreter is 100-1000x slower than torch.
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

# name: (n_heads, n_kv_heads, n_q, n_k, key_window, key_sink, softcap, dtype, tiles (m, n) or None)
CASES = {
    "window-gqa": (4, 2, 37, 37, 5, None, None, "float32", None),
    "per-head-window-sink-decode": (4, 2, 5, 41, [0, 3, 7, 1], [0, 1, 2, 0], 3.0, "float32", None),
    "softcap-only": (2, 1, 20, 23, None, None, 2.0, "float32", None),
    "window-softcap-bf16": (4, 1, 33, 33, 6, 2, 5.0, "bfloat16", (16, 32)),
    "sinks-over-a-tile-short-window": (2, 1, 50, 50, 3, 18, None, "float32", None),  # skipped tiles between
}


def _worker() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch

    from headscope.kernels.attention import STATISTICS, attention
    from headscope.kernels.reference import reference_attention

    def arg(x):
        return torch.tensor(x, dtype=torch.int64) if isinstance(x, list) else x

    report = {}
    for name, (h, h_kv, n_q, n_k, window, sink, cap, dtype, tiles) in CASES.items():
        g = torch.Generator().manual_seed(len(name))
        dt = getattr(torch, dtype)
        q = (torch.randn(1, h, n_q, 16, generator=g) * 2).to(dt)
        k = torch.randn(1, h_kv, n_k, 16, generator=g).to(dt)
        v = torch.randn(1, h_kv, n_k, 16, generator=g).to(dt)
        kw = dict(spans=[(0, 1), (n_k // 2, n_k)], block_size=4, rows=[0, n_q - 1], topk=3, sink_size=3,
                  window=7, key_window=arg(window), key_sink=arg(sink), softcap=cap)
        ref = reference_attention(q.double(), k.double(), v.double(), **kw)
        if tiles:
            from headscope.kernels.statistics import validate
            from headscope.kernels.triton_attention import triton_attention

            plan = validate(q, k, v, True, None, STATISTICS, 3, 7, kw["spans"], 4, kw["rows"], 3, "triton",
                            key_sink=kw["key_sink"], key_window=kw["key_window"], softcap=cap)
            out, stats = triton_attention(q, k, v, plan, block_m=tiles[0], block_n=tiles[1])
        else:
            res = attention(q, k, v, backend="triton", stats=STATISTICS, **kw)
            out, stats = res.out, res.stats
        mask = dict(key_window=kw["key_window"], key_sink=kw["key_sink"], softcap=cap)
        only_out = attention(q, k, v, backend="triton", **mask)
        col_only = attention(q, k, v, backend="triton", stats="col_sum", **mask)  # its own kernel
        diffs = {"out": (out.double() - ref["out"]).abs().max().item(),
                 "out/no-stats": (only_out.out.double() - ref["out"]).abs().max().item(),
                 "col_sum/alone": (col_only.col_sum.double() - ref["col_sum"]).abs().max().item()}
        for key, got in stats.items():
            want = ref[key]
            if want.dtype == torch.int64:
                diffs[key] = int((got != want).sum().item())
            else:
                diffs[key] = (got.double() - want).abs().max().item()
        report[name] = diffs
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_triton_masks_match_the_reference(report, case):
    diffs = report[case]
    tol = 2e-2 if CASES[case][7] == "bfloat16" else 2e-5
    for key, diff in diffs.items():
        if key in ("argmax", "topk_index"):
            assert diff == 0 if tol < 1e-3 else diff <= 2, (key, diff)  # bf16 may swap near-ties
        else:
            assert diff < tol, (key, diff)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()

"""The eager reference (kernels/reference.py) against answers that do not come from it.

Both kernels are judged by this reference, so it is checked on its own: every statistic on uniform
attention, where each one has a closed form, and the output against torch's SDPA with its own
bottom-right causal mask.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from headscope.kernels import statistics as stat
from headscope.kernels.reference import OUT, eager_attention, reference_attention


def test_uniform_attention_gives_the_hand_computed_statistics():
    """q = 0: every score is 0, so row i (position 2 + i of 6 keys) is uniform over its 3 + i keys."""
    n_q, n_k = 4, 6
    q = torch.zeros(1, 2, n_q, 8)
    k = torch.randn(1, 1, n_k, 8, generator=torch.Generator().manual_seed(0))
    v = torch.arange(n_k, dtype=torch.float32).view(1, 1, n_k, 1).expand(1, 1, n_k, 8)
    ref = reference_attention(q, k, v, sink_size=2, window=2, spans=[(1, 3)], block_size=4, rows=[-1, 0], topk=5)

    seen = [3, 4, 5, 6]  # visible keys per row
    per_row = (stat.LSE, stat.ENTROPY, stat.ARGMAX, stat.ARGMAX_PROB, stat.SINK_MASS, stat.RECENT_MASS)
    row = {name: ref[name][0, 1].tolist() for name in per_row}
    assert row[stat.LSE] == pytest.approx([math.log(n) for n in seen])
    assert row[stat.ENTROPY] == pytest.approx([math.log(n) for n in seen])
    assert row[stat.ARGMAX] == [0, 0, 0, 0]  # ties: the lowest key index
    assert row[stat.ARGMAX_PROB] == pytest.approx([1 / n for n in seen])
    assert row[stat.SINK_MASS] == pytest.approx([2 / n for n in seen])
    assert row[stat.RECENT_MASS] == pytest.approx([2 / n for n in seen])
    assert ref[stat.SPAN_MASS][0, 0, :, 0].tolist() == pytest.approx([2 / n for n in seen])
    assert ref[OUT][0, 0, :, 0].tolist() == pytest.approx([(n - 1) / 2 for n in seen])  # mean of 0..n-1

    # key j is seen by the rows with n > j, each giving it 1/n
    assert ref[stat.COL_SUM][0, 0].tolist() == pytest.approx([sum(1 / n for n in seen if n > j) for j in range(n_k)])
    # pooled, B = 4: blocks rows 0-3 × keys 0-3 (16 cells) and rows 0-3 × keys 4-5 (8 cells)
    left = sum(min(n, 4) / n for n in seen) / 16
    right = sum(max(n - 4, 0) / n for n in seen) / 8
    assert ref[stat.POOLED].shape == (1, 2, 1, 2)
    assert ref[stat.POOLED][0, 0, 0].tolist() == pytest.approx([left, right])
    assert ref[stat.ROWS][0, 0].flatten().tolist() == pytest.approx([1 / 6] * 6 + [1 / 3] * 3 + [0.0] * 3)
    # top-5 of row 0 (3 visible keys): two empty slots
    assert ref[stat.TOPK_INDEX][0, 0, 0].tolist()[3:] == [-1, -1]
    assert ref[stat.TOPK_PROB][0, 0, 0].tolist() == pytest.approx([1 / 3] * 3 + [0.0] * 2)
    assert ref[stat.TOPK_PROB][0, 0, 3].tolist() == pytest.approx([1 / 6] * 5)


@pytest.mark.parametrize("n_q,n_k,causal", [(9, 9, True), (3, 11, True), (7, 5, False)])
def test_output_matches_sdpa_with_its_own_masks(n_q, n_k, causal):
    """Grouped-query output against SDPA; decode rows (n_q < n_k) use its lower-right causal bias."""
    g = torch.Generator().manual_seed(n_q * n_k)
    q = torch.randn(2, 6, n_q, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, n_k, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, n_k, 8, generator=g, dtype=torch.float64)
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    mask = causal_lower_right(n_q, n_k) if causal else None
    want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=0.3)
    ref = reference_attention(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(ref[OUT], want, atol=1e-12, rtol=0)
    torch.testing.assert_close(eager_attention(q.float(), k.float(), v.float(), causal=causal, scale=0.3),
                               want.float(), atol=1e-5, rtol=0)

"""A :class:`~headscope.analysis.qk_collect.HeadQK` built from arrays, for the unit tests of the analyses
that read one (tests/analysis/test_joint_embedding.py, tests/analysis/test_qk_decomposition.py)."""

from __future__ import annotations

import numpy as np

from headscope.analysis.qk_collect import HeadQK


def synthetic_head(q: np.ndarray, k: np.ndarray, lengths: list[int], *, tokens: list[str] | None = None,
                   token_ids: np.ndarray | None = None, sentences: list[str] | None = None,
                   char_spans: np.ndarray | None = None) -> HeadQK:
    """A HeadQK built from arrays (for unit tests of the analyses that read one)."""
    n = int(sum(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return HeadQK(
        layer=0, head=0, kv_head=0, rotary=True, q=q, k=k, q_rot=q, k_rot=k,
        token_ids=np.arange(n) if token_ids is None else np.asarray(token_ids),
        tokens=tokens or [f"t{i}" for i in range(n)],
        positions=np.concatenate([np.arange(m) for m in lengths]).astype(np.int32),
        sentence_index=np.repeat(np.arange(len(lengths)), lengths).astype(np.int32), offsets=offsets,
        char_spans=np.zeros((n, 2), np.int32) if char_spans is None else char_spans,
        sentences=sentences or [f"s{i}" for i in range(len(lengths))], scale=1 / np.sqrt(q.shape[1]),
    )

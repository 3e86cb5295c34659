"""What a user can choose in a KV-cache compression policy, spelled once: the rankings of KV groups,
the streaming groups' S and W (DuoAttention's shipped defaults) and the default fractions and seeds.

This module imports nothing heavy, so the command line checks its arguments against these names
before torch is loaded; :mod:`headscope.analysis.kv_compression` and the Compress page read the same names.
The rankings by a head score are those the registry declares (:attr:`headscope.analysis.score_registry.HeadScore.kv_ranking`).
"""

from __future__ import annotations

from headscope.analysis.score_registry import HEAD_SCORES, KV_SCORES

RANKING_LABELS = {
    "retrieval": "Retrieval score (group max)",
    **{name: HEAD_SCORES[name].kv_ranking.label for name in KV_SCORES},
    "random": "Random groups",
    "all_full": "All full (uncompressed)",
    "all_streaming": "All streaming (StreamingLLM's sinks + window; positions kept, not renumbered)",
}
"""Rankings of KV groups (higher = kept full first): :data:`headscope.analysis.kv_compression.RANKINGS` says how each
orders the groups."""
RANKINGS = tuple(RANKING_LABELS)
DEFAULT_RANKINGS = ("retrieval", "streaming", "random", "all_full", "all_streaming")

BACKENDS = ("auto", "eager", "statistics", "cache")
"""How a policy is evaluated (:func:`headscope.analysis.kv_compression.evaluate_policies`): ``eager`` masks the
scores (O(n²) memory), ``statistics`` gives the mask to the kernels (O(n)), ``cache`` keeps each KV
group's cache as the policy says, physically smaller (:mod:`headscope.analysis.kv_cache`); ``auto`` picks
statistics mode above ``HEADSCOPE_MAX_TOKENS`` tokens or on CUDA where the model supports it."""

BACKEND_LABELS = {
    "auto": "auto: masks (statistics mode for long inputs, else eager)",
    "eager": "eager: masked scores (N × N per layer)",
    "statistics": "statistics: the kernels' key mask (O(N))",
    "cache": "cache: each KV group keeps only what the policy keeps (memory really freed)",
}

DEFAULT_SINK_SIZE = 128
"""S: ``sink_size`` of DuoAttention's shipped patterns (mit-han-lab/duo-attention,
``attn_patterns/Meta-Llama-3.1-8B-Instruct/.../config.json`` and the Llama-3-8B-Gradient ones), also
kvpress' ``DuoAttentionPress`` on-the-fly default."""
DEFAULT_RECENT_SIZE = 256
"""W: ``recent_size`` of the same configs."""
DEFAULT_FRACTIONS = (0.1, 0.25, 0.5, 0.75)
DEFAULT_SEEDS = 3
DEFAULT_TOLERANCE = 0.05
"""The smallest KV fraction "within 5 NIAH points of full" the issue asks for."""

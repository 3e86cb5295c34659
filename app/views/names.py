"""Every view's name, spelled once: pages, export buttons, manifests, the CLI and tests use these.

A name is what a manifest's ``"view"`` holds, so a name never changes once released. An export
button may add a variant after a colon (``relevance:rollout``): :func:`variant` and :func:`split`.
"""

from __future__ import annotations

# Attention page
HEAD_GRID = "head_grid"
ATTENTION = "attention"
TOKEN_STRIP = "token_strip"
SINK_MAP = "sink_map"
# Flow page
RELEVANCE = "relevance"
ROLLOUT_LAYERS = "rollout_layers"
GRADIENT = "gradient"
FAITHFULNESS_INPUT = "faithfulness_input"
FAITHFULNESS_SET = "faithfulness_set"
# Heads page
RETRIEVAL_GRID = "retrieval_grid"
RETRIEVAL_HISTOGRAM = "retrieval_histogram"
RETRIEVAL_SCATTER = "retrieval_scatter"
NIAH_GRID = "niah_grid"
HEAD_SCORE_GRID = "head_score_grid"
SCORE_MASS = "score_mass"
TRIAL_STEPS = "trial_steps"
# Ablation page
ABLATION_SELECTION = "ablation_selection"
ABLATION_EFFECTS = "ablation_effects"
ABLATION_CURVE = "ablation_curve"
ABLATION_HEAD_SWEEP = "ablation_head_sweep"
# Patching page (and headscope patch)
PATCHING_MAP = "patching_map"
PATCHING_AGREEMENT = "patching_agreement"
RUN_COMPARISON = "run_comparison"
ATTENTION_DIFFERENCE = "attention_difference"
# Compress page (and headscope compress)
COMPRESSION_PARETO = "compression_pareto"
COMPRESSION_POLICY = "compression_policy"
# QK page
QK_SCATTER = "qk_scatter"
QK_SPECTRUM = "qk_spectrum"
QK_ATTRIBUTION = "qk_attribution"
QK_LAYER = "qk_layer"
QK_RANK_MAP = "qk_rank_map"
# Circuits page (and headscope circuits, headscope explain)
CIRCUIT_DLA = "circuit_dla"
CIRCUIT_DLA_OTHERS = "circuit_dla_others"
CIRCUIT_COMPOSITION = "circuit_composition"
CIRCUIT_EDGES = "circuit_edges"
QK_CELL = "qk_cell"


def variant(name: str, which: str) -> str:
    """An export button's view id for one variant of a view (``relevance:rollout``)."""
    return f"{name}:{which}"


def split(view: str) -> tuple[str, str]:
    """``(name, variant)`` of an export button's view id (variant ``""`` when it has none)."""
    name, _, which = view.partition(":")
    return name, which

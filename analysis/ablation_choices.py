"""What a user can choose in an ablation, spelled once: the methods and what each removes, the
metrics of single-head sweeps and of top-k curves, and the default size of the top-N the random
control stays out of. (The per-head scores heads can be ranked by are declared in
:mod:`headscope.analysis.score_registry`.)

This module imports nothing heavy, so the command line checks its arguments against these names
before torch is loaded; the pages, the exports and :mod:`headscope.analysis.ablation` read the same names.
"""

from __future__ import annotations

METHODS = ("zero", "mean", "resample", "uniform", "first_token")
Z_METHODS = ("zero", "mean", "resample")
PATTERN_METHODS = ("uniform", "first_token")
DEFAULT_METHOD = "zero"
METHOD_DESCRIPTIONS = {
    "zero": "head output z (before W_O) set to 0",
    "mean": "head output z (before W_O) set to its mean over a reference set",
    "resample": "head output z (before W_O) taken from another input, position-aligned",
    "uniform": "attention spread uniformly over the visible keys (Wu et al. 2024 masking)",
    "first_token": "all attention on key 0 (the sink)",
}

SWEEP_METRICS = {"loss": "Δ mean loss", "kl": "KL from the clean next-token distribution"}
"""Metrics of a single-head sweep (:func:`headscope.analysis.head_sweep.single_head_sweep`)."""

CURVE_METRICS = {"loss": "mean loss (nats)", "niah": "NIAH accuracy"}
"""Metrics of a top-k curve (:func:`headscope.analysis.ablation_curve.ablation_curve`): mean next-token loss on
a run, or needle-in-a-haystack accuracy on a retrieval sweep's prompts."""

CONTROL_TOP_N = 20
"""The random control of a top-k curve draws its k heads from outside the top N by the score
(N = max(this, largest k)). Outside only the current top k, a random set may hold heads ranked just
below k — under uniform ablation early-layer heads of high score break the model on their own, and
the control then moves like the top-k curve. 20 follows the table of ``bench/ablation_curve.py``."""

DEFAULT_CURVE_KS = (0, 2, 5, 10, 20)
DEFAULT_SEEDS = 3
MAX_SEEDS = 100
"""Random head sets per k at most: each is a full pass over the curve's k values (a forged or mistyped
10**8 would otherwise run for ever)."""

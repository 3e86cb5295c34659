"""Views of a KV-cache compression curve (:mod:`headscope.analysis.kv_compression`), drawn from the curve stored
by :func:`headscope.analysis.kv_compression_sweep.compress_sweep` and named by its key (``params["compress"]``,
a prefix of it): the Pareto view (NIAH accuracy and mean loss against the KV fraction kept) and the
per-(layer, KV group) map of one policy of the curve (``params["pick"]``, ``RANKING:FRACTION[:SEED]``).

The Compress page (``/compress``) shows them; ``headscope compress --formats`` exports them and
``headscope figure`` rebuilds them from their manifests.
"""

from __future__ import annotations

import re
from typing import Any

import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import CompressionCurve, PolicyEvaluation
from headscope.analysis.kv_compression_choices import DEFAULT_TOLERANCE, RANKING_LABELS, RANKINGS
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, register

ENDS = ("all_full", "all_streaming")
_PICK = re.compile(r"^([a-z_]{1,20})(?::([0-9]*\.?[0-9]+))?(?::(\d{1,4}))?$")


def _context():
    from headscope.app.context import get_context

    return get_context()


def compress_params(state: Any, which: str = "") -> dict[str, Any]:
    """The views' params from a page state: the stored curve, the tolerance (``tol``, NIAH points) and
    the chosen policy (``pick``)."""
    tol = getattr(state, "tol", None)
    return {"model": getattr(state, "model", None) or _context().default_model,
            "compress": getattr(state, "compress", None),
            "tolerance": DEFAULT_TOLERANCE if tol is None else tol / 100, "pick": getattr(state, "pick", None)}


def stored_curve(key: Any) -> tuple[str, CompressionCurve]:
    """The stored curve whose key starts with ``key``; an ``InputError`` when none (or several) do."""
    from headscope.analysis.kv_compression_sweep import find_curve

    if not key:
        raise InputError("No compression curve yet: run the evaluation first.")
    return find_curve(_context().store, str(key))


def check_tolerance(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InputError(f"The tolerance must be a share between 0 and 1 (0.05 = 5 NIAH points), got {value!r}.")
    return float(value)


def pick_text(e: PolicyEvaluation) -> str:
    """``RANKING:FRACTION[:SEED]`` naming one evaluation of a curve (the ends: the ranking alone)."""
    p = e.policy
    if p.ranking in ENDS:
        return p.ranking
    fraction = f"{p.fraction:.6f}".rstrip("0").rstrip(".") or "0"  # fixed point: a link's pattern has no exponent
    return f"{p.ranking}:{fraction}" + ("" if p.seed is None else f":{p.seed}")


def parse_pick(text: Any) -> tuple[str, float | None, int | None]:
    """``(ranking, fraction, seed)`` of a ``RANKING[:FRACTION[:SEED]]`` text; an ``InputError`` otherwise."""
    m = _PICK.match(text) if isinstance(text, str) else None
    if m is None or m.group(1) not in RANKINGS:
        raise InputError(f"Name a policy as RANKING:FRACTION[:SEED] (e.g. retrieval:0.25), with RANKING one of "
                         f"{', '.join(RANKINGS)}; got {str(text)[:40]!r}.")
    return m.group(1), None if m.group(2) is None else float(m.group(2)), None if m.group(3) is None else int(m.group(3))


def default_pick(curve: CompressionCurve, tolerance: float) -> PolicyEvaluation | None:
    """The policy shown when none is chosen, as ``headscope compress`` exports it: the first score
    ranking's smallest policy within the tolerance (decided on the NIAH intervals:
    :meth:`headscope.analysis.kv_compression.CompressionCurve.within_tolerance`), else its largest."""
    rankings = curve.meta.get("rankings") or list(dict.fromkeys(e.policy.ranking for e in curve.evaluations))
    named = [r for r in rankings if r not in ("random", *ENDS)] or list(rankings)
    if not named:
        return None
    mine = [e for e in curve.evaluations if e.policy.ranking == named[0]]
    return curve.smallest_within(named[0], tolerance) or max(mine, key=lambda e: e.memory.fraction, default=None)


def chosen_evaluation(curve: CompressionCurve, pick: Any, tolerance: float) -> PolicyEvaluation:
    """The evaluation ``pick`` names (default: :func:`default_pick`); an ``InputError`` when the curve has none."""
    if not pick:
        found = default_pick(curve, tolerance)
    else:
        ranking, fraction, seed = parse_pick(pick)
        # the text an option offers names its policy even where it rounds the fraction (six places)
        found = next((e for e in curve.evaluations if pick_text(e) == pick), None) or curve.find(ranking, fraction, seed)
    if found is None:
        raise InputError(f"The curve has no policy {pick!r}: choose one of "
                         f"{', '.join(pick_text(e) for e in curve.evaluations)}.")
    return found


def smallest_within(curve: CompressionCurve, tolerance: float) -> dict[str, PolicyEvaluation | None]:
    """Per ranking of the curve (but all full), the smallest-KV policy within ``tolerance`` NIAH accuracy of
    full, decided on the 95 % intervals
    (:meth:`headscope.analysis.kv_compression.CompressionCurve.within_tolerance`)."""
    rankings = list(dict.fromkeys(e.policy.ranking for e in curve.evaluations))
    return {r: curve.smallest_within(r, tolerance) for r in rankings if r != "all_full"}


def decision_text(label: str, tolerance: float, best: dict[str, Any] | None, n_prompts: int) -> str:
    """The sentence that states one ranking's smallest KV fraction within ``tolerance`` and the n it rests
    on, from the policy's row (:meth:`headscope.analysis.kv_compression.PolicyEvaluation.row`; None: no
    policy passes). The page and ``headscope compress`` print it."""
    head = f"Smallest KV within {tolerance * 100:g} NIAH points of full, {label}: "
    tail = f" on n = {n_prompts} prompt{'' if n_prompts == 1 else 's'}"
    if best is None:
        return head + "none" + tail
    from headscope.analysis.intervals import Proportion

    n = best.get("niah_accuracy_n") or 0
    accuracy = "—" if not n else Proportion(round(best["niah_accuracy"] * n), n, best["niah_accuracy_low"],
                                            best["niah_accuracy_high"]).text().rsplit(" n=", 1)[0]
    seeds = "" if best.get("seed") is None else ", every seed"
    return (head + f"KV {best['kv_fraction']:.3f} (groups full {best['fraction_full']:g}), NIAH {accuracy}{seeds}"
            + tail)


def curve_rows(curve: CompressionCurve) -> Rows:
    """The table: the uncompressed model first, then every policy, as ``PolicyEvaluation.row`` writes it."""
    base = {**curve.baseline.row(), "ranking": "uncompressed"}
    return [base, *curve.rows()]


def _title(curve: CompressionCurve, what: str) -> str:
    n = curve.baseline.memory.n_tokens
    partial = "" if curve.complete else " — cancelled, partial"
    return (f"{what}, {curve.meta.get('model_name', '')}: streaming groups keep S={curve.sink_size} + "
            f"W={curve.recent_size} of {n:,} tokens; {curve.n_prompts} NIAH prompt(s){partial}")


@register(names.COMPRESSION_PARETO, "KV-cache compression: accuracy and loss against KV kept",
          ("compress", "tolerance"), lambda state, query, which: compress_params(state, which), needs_run=False)
def compression_pareto_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    _, curve = stored_curve(params.get("compress"))
    tolerance = check_tolerance(params.get("tolerance", DEFAULT_TOLERANCE))
    rows = curve.rows()
    best = smallest_within(curve, tolerance)
    bands = curve.seed_bands()
    fig = figures.compression_pareto(rows, curve.baseline.row(), RANKING_LABELS, tolerance,
                                     {r: None if e is None else e.memory.fraction for r, e in best.items()},
                                     _title(curve, "KV cache kept against accuracy"), bands)
    out = curve_rows(curve)
    out.extend({**b, "seed": "seed band"} for b in bands)
    for r, e in best.items():
        niah = {} if e is None else {k: v for k, v in e.row().items() if k.startswith("niah_accuracy")}
        out.append({"ranking": r, "seed": "smallest within tolerance", "tolerance": tolerance,
                    "kv_fraction": None if e is None else e.memory.fraction,
                    "fraction_full": None if e is None else e.policy.fraction, **niah,
                    "n_prompts": curve.n_prompts})
    return fig, out


@register(names.COMPRESSION_POLICY, "KV-cache policy per layer and KV group", ("compress", "pick", "tolerance"),
          lambda state, query, which: compress_params(state, which), needs_run=False)
def compression_policy_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    _, curve = stored_curve(params.get("compress"))
    tolerance = check_tolerance(params.get("tolerance", DEFAULT_TOLERANCE))
    e = chosen_evaluation(curve, params.get("pick"), tolerance)
    p = e.policy
    seed = "" if p.seed is None else f" seed {p.seed}"
    title = (f"{RANKING_LABELS[p.ranking]}{seed}: {p.n_full} of {p.full.size} KV groups full, KV kept "
             f"{e.memory.fraction:.3f}, NIAH {e.niah.text() if e.niah.n else 'none'}, loss {e.loss:.4f}")
    fig = figures.policy_map(p.full, title)
    rows: Rows = [{"layer": la, "kv_head": g, "full": int(p.full[la, g]), "ranking": p.ranking, "seed": p.seed,
                   "fraction_full": p.fraction, "sink_size": p.sink_size, "recent_size": p.recent_size}
                  for la in range(p.full.shape[0]) for g in range(p.full.shape[1])]
    return fig, rows

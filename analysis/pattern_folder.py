"""KV-cache policies as files: DuoAttention's pattern folder, with the per-group scores NVIDIA kvpress'
``DuoAttentionPress`` thresholds.

DuoAttention (Xiao et al. 2024, arXiv:2410.10819) ships a policy as a folder (``attn_patterns/*`` in
mit-han-lab/duo-attention): ``config.json`` with ``sink_size`` and ``recent_size``, and
``full_attention_heads.tsv``, one row per layer and one column per KV head, read with
``np.loadtxt(path, delimiter="\t")`` and thresholded at 0.5 by ``duo_attn.utils.load_attn_pattern``.
kvpress (NVIDIA/kvpress ``kvpress/presses/duo_attention_press.py``) fetches those files for the models
it knows; its ``DuoAttentionPress.post_init_from_model`` takes ``(sink_size, recent_size, head_scores)``
from ``load_attention_pattern(model)`` and makes the

    n_pruned = round(L · H_kv · head_compression_ratio)

lowest ``head_scores`` (``np.argsort(head_scores, axis=None)``) streaming heads. A policy here (a
:class:`headscope.analysis.kv_compression.Policy`) is written as both (:func:`export_policy`) and
read back, the scores checked before use (:func:`load_policy`, :func:`load_head_scores`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression import CompressionCurve, Policy, priority_name

PATTERN_CONFIG = "config.json"
PATTERN_TSV = "full_attention_heads.tsv"
POLICY_JSON = "policy.json"
HEAD_SCORES_NPY = "head_scores.npy"
MAX_HEAD_SCORES_BYTES = 1 << 20  # 128k groups of float64 and a header: far above any model's layers × KV heads


def policy_head_scores(policy: Policy, priority: np.ndarray | None = None) -> np.ndarray:
    """``[layer, kv_head]`` float64 scores, higher = kept full, whose ``round(L · H_kv · r)`` lowest are
    exactly the policy's streaming groups at ``r`` = its share of streaming groups (kvpress'
    ``DuoAttentionPress`` rule, :func:`export_policy`).

    ``priority`` is the ranking's group priority the policy was built from
    (:func:`headscope.analysis.kv_compression.group_priority`): the scores are that priority, except that
    a streaming group tied with the lowest full group's priority is set one float64 step below it, so the
    cut is the policy's whatever order a sort gives ties.
    Without a priority (a policy read from a folder), full groups score 1 and streaming ones 0.
    """
    full = policy.full
    if priority is None:
        return full.astype(np.float64)
    try:
        scores = np.array(priority, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError("The group priority must be a table of numbers.") from None
    if scores.shape != full.shape:
        raise InputError(f"The group priority must have the policy's shape [layer, kv_head] = {full.shape}, "
                         f"got {scores.shape}.")
    if not np.isfinite(scores).all():
        raise InputError("The group priority has nan or infinite values: it cannot order the KV groups.")
    if full.all() or not full.any():
        return scores
    lowest_full = scores[full].min()
    if scores[~full].max() > lowest_full:
        raise InputError("The group priority ranks a streaming group above a full one: it is not the priority "
                         "this policy was built from.")
    scores[~full & (scores == lowest_full)] = np.nextafter(lowest_full, -np.inf)
    return scores


def curve_priority(curve: CompressionCurve, policy: Policy) -> np.ndarray | None:
    """The group priority ``policy``'s ranking had in ``curve`` (:func:`headscope.analysis.kv_compression.group_priorities`), or None where
    the curve kept none (a curve stored before curves kept them, or one built by hand)."""
    found = (curve.meta.get("priorities") or {}).get(priority_name(policy.ranking, policy.seed))
    if found is None:
        return None
    try:
        return np.asarray(found, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError("The stored curve's group priority is not a table of numbers: run the evaluation "
                         "again.") from None


def export_policy(policy: Policy, folder: str | Path, *, model_name: str = "",
                  priority: np.ndarray | None = None) -> list[Path]:
    """Write ``policy`` as DuoAttention's pattern folder: what ``duo_attn.utils.load_attn_pattern(folder)``
    reads, and the files kvpress' ``DuoAttentionPress.load_attention_pattern`` parses (it fetches them
    from DuoAttention's repository for the models it knows, with the same ``np.loadtxt`` call).

    - ``config.json``: ``sink_size`` and ``recent_size`` (plus how the policy was built), and
      ``head_compression_ratio``, the share of streaming groups;
    - ``full_attention_heads.tsv``: one row per layer, one tab-separated column per KV head, 1.0 for a
      full group and 0.0 for a streaming one; ``np.loadtxt(path, delimiter="\\t")`` reads it back
      (DuoAttention's ``load_attn_pattern``; its threshold 0.5, or kvpress' ``head_compression_ratio``
      = share of streaming groups, recovers this policy exactly);
    - ``head_scores.npy``: :func:`policy_head_scores` as a float64 ``[layer, kv_head]`` .npy (no pickle),
      the ranking's continuous group priority when ``priority`` is given. kvpress' ``DuoAttentionPress``
      (NVIDIA/kvpress ``kvpress/presses/duo_attention_press.py``) takes per-group scores from its
      ``load_attention_pattern(model) -> (sink_size, recent_size, head_scores)`` and makes the
      ``round(size · head_compression_ratio)`` lowest scores streaming heads; a subclass whose
      ``load_attention_pattern`` returns this file (as kvpress' own tests do) uses the policy without
      fetching patterns from the network, and at this ``head_compression_ratio`` keeps exactly its
      full groups (another ratio gives the same ranking's policy at that fraction);
    - ``policy.json``: the policy as JSON.
    """
    head_scores = policy_head_scores(policy, priority)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = {"sink_size": policy.sink_size, "recent_size": policy.recent_size, "model_name": model_name,
              "ranking": policy.ranking, "fraction_full": policy.fraction, "seed": policy.seed,
              "head_compression_ratio": 1.0 - policy.full_share, "head_scores": HEAD_SCORES_NPY,
              "head_scores_use": "kvpress: subclass DuoAttentionPress with a static load_attention_pattern(model) "
                                 "returning (sink_size, recent_size, np.load('head_scores.npy', allow_pickle=False)), "
                                 "and give it this head_compression_ratio; higher scores stay full",
              "source": "headscope"}
    paths = [out / PATTERN_CONFIG, out / PATTERN_TSV, out / HEAD_SCORES_NPY, out / POLICY_JSON]
    paths[0].write_text(json.dumps(config, indent=2))
    np.savetxt(paths[1], policy.full.astype(np.float64), delimiter="\t", fmt="%.1f")
    np.save(paths[2], head_scores, allow_pickle=False)
    paths[3].write_text(json.dumps({**policy.to_json(), "model_name": model_name}, indent=2))
    return paths


def load_head_scores(path: str | Path, shape: tuple[int, ...]) -> np.ndarray:
    """``head_scores.npy`` of a pattern folder as float64, checked before it is read: at most
    :data:`MAX_HEAD_SCORES_BYTES`, a .npy of real numbers (never unpickled: ``allow_pickle=False``, and
    memory-mapped so a header declaring more data than the file holds is refused, not allocated), of
    ``shape``, finite. Anything else is an ``InputError`` saying so."""
    path = Path(path)
    where = f"The pattern folder's {HEAD_SCORES_NPY}"
    try:
        if not path.is_file() or path.stat().st_size > MAX_HEAD_SCORES_BYTES:
            raise InputError(f"{where} is not a file of at most {MAX_HEAD_SCORES_BYTES // 1024} KiB: export the "
                             "policy again.")
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)
        if not isinstance(loaded, np.ndarray):
            raise InputError(f"{where} is not a single .npy array: export the policy again.")
        if loaded.dtype.kind not in "biuf" or loaded.dtype.fields is not None:
            raise InputError(f"{where} holds {loaded.dtype} values, not real numbers: export the policy again.")
        scores = np.array(loaded, dtype=np.float64)
    except InputError:
        raise
    except (OSError, ValueError, EOFError, TypeError):
        raise InputError(f"{where} is not a plain numeric .npy array (pickled data is never read): export the "
                         "policy again.") from None
    if scores.shape != tuple(shape):
        raise InputError(f"{where} has shape {scores.shape}, not the pattern's [layer, kv_head] = {tuple(shape)}.")
    if not np.isfinite(scores).all():
        raise InputError(f"{where} has nan or infinite scores: export the policy again.")
    return scores


def load_policy(folder: str | Path) -> Policy:
    """Read a pattern folder back (``config.json`` + ``full_attention_heads.tsv``): groups scoring
    above 0.5 are full (DuoAttention's default threshold). A ``head_scores.npy`` beside them is read with
    :func:`load_head_scores` and must rank those full groups above the streaming ones."""
    folder = Path(folder)
    try:
        config = json.loads((folder / PATTERN_CONFIG).read_text())
        table = np.atleast_2d(np.loadtxt(folder / PATTERN_TSV, delimiter="\t", dtype=np.float64))
    except (OSError, ValueError) as e:
        raise InputError(f"Cannot read a pattern folder at {folder}: {e}") from None
    full = np.clip(table, 0, 1) > 0.5
    if (folder / HEAD_SCORES_NPY).exists() or (folder / HEAD_SCORES_NPY).is_symlink():
        scores = load_head_scores(folder / HEAD_SCORES_NPY, full.shape)
        if full.any() and not full.all() and scores[~full].max() >= scores[full].min():
            raise InputError(f"The pattern folder's {HEAD_SCORES_NPY} ranks a streaming group of {PATTERN_TSV} "
                             "at or above a full one: the two files describe different policies. Export it again.")
    return Policy(full, int(config["sink_size"]), int(config["recent_size"]),
                  str(config.get("ranking", "")), float(config.get("fraction_full", float((table > 0.5).mean()))))

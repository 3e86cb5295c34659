"""Single-head ablation sweeps: ablate every head on its own and map what changes.

``effect[l, h] = metric(model with head (l, h) ablated) − metric(clean model)`` on one run's tokens,
with the metric the mean next-token loss or the mean KL divergence from the clean next-token
distribution (:data:`headscope.analysis.ablation_choices.SWEEP_METRICS`). The ablation methods and exactly
what each removes are described in :mod:`headscope.analysis.ablation`. The retrieval-head paper ranks heads by
a score and masks them (Wu et al. 2024, arXiv:2404.15574, §4); a sweep measures each head's effect
directly, as in Olsson et al. 2022's per-head ablations.

:func:`ablation_head_sweep` is the user action (the page's "Sweep all heads"): it owns the store
key, resumes a cancelled sweep, and takes ``progress`` and ``cancel``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.ablation import (
    ABLATION_VERSION,
    AblationSpec,
    Cancel,
    Head,
    Hook,
    Progress,
    SweepMetric,
    _layer_hooks,
    _logits,
    _spec_template,
    _tensor,
    ablation_ids,
    kl_metric,
    loss_metric,
)
from headscope.analysis.ablation_choices import SWEEP_METRICS
from headscope.analysis.capture import Run
from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel
from headscope.analysis.retrieval import Cancelled, cancel_requested
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record


@dataclass
class HeadSweep:
    """Effect of ablating each head alone: ``effect[l, h] = metric(ablated (l, h)) − metric(clean)``.

    Heads not swept, or not reached before a cancel, are nan; ``complete`` says whether all were.
    """

    effect: np.ndarray
    clean: float
    method: str
    metric: str
    complete: bool
    seconds: float = 0.0


def single_head_sweep(
    model: LoadedModel,
    tokens: str | Sequence[int],
    method: str | AblationSpec = "zero",
    metric: str | SweepMetric = "loss",
    *,
    heads: Sequence[Head] | None = None,
    batch_size: int | None = None,
    share_prefix: bool = True,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> HeadSweep:
    """Ablate every head on its own and map the change of ``metric`` to ``[layer, head]``.

    Heads are taken in (layer, head) order in batches: the batch holds one copy of the input per
    head and a hook ablates head ``heads[b]`` in batch element b only (the hooks index the batch
    dimension). With ``share_prefix`` the layers below the batch's first ablated layer run once on
    a single copy, which a hook on that layer's ``hook_resid_pre`` then broadcasts to the batch
    (those layers are the same for every element), so a batch of B heads in layer l costs about
    ``l + B·(L − l)`` layer-passes instead of ``B·L``.

    Parameters
    ----------
    method : a method name, or an :class:`AblationSpec` whose method and options (means, source)
        are used for every head.
    metric : ``"loss"`` (mean next-token loss, :func:`loss_metric`), ``"kl"`` (mean KL from the
        clean next-token distribution, :func:`kl_metric`) or a callable
        ``logits [batch, pos, vocab] → [batch]``.
    heads : the heads to sweep (default: all); others are nan.
    batch_size : heads per forward pass (default: one layer's heads, fewer when the logits of the
        batch would pass 1 GiB).
    cancel : checked between batches; the sweep stops and returns what finished (``complete`` False).
    """
    t0 = time.perf_counter()
    ids = ablation_ids(model, tokens)
    template = _spec_template(method)
    all_heads = [(layer, h) for layer in range(model.n_layers) for h in range(model.n_heads)]
    todo = sorted({(int(layer), int(h)) for layer, h in heads}) if heads is not None else all_heads
    template.with_heads(todo).validate(model)
    if batch_size is None:
        batch_size = max(1, min(model.n_heads, (1 << 28) // max(1, len(ids) * model.vocab_size)))
    if batch_size < 1:
        raise InputError("batch_size must be at least 1.")
    clean_logits = _logits(model, ids, [])
    if isinstance(metric, str):
        if metric == "loss":
            if len(ids) < 2:
                raise InputError("The loss needs at least two tokens.")
            fn = loss_metric(ids)
        elif metric == "kl":
            fn = kl_metric(clean_logits)
        else:
            raise InputError(f"Unknown sweep metric {metric!r}: use 'loss', 'kl' or a function.")
        metric_name = metric
    else:
        fn, metric_name = metric, getattr(metric, "__name__", "custom")
    with torch.inference_mode():
        clean = float(fn(clean_logits[None])[0])
    effect = np.full((model.n_layers, model.n_heads), np.nan, dtype=np.float32)
    done = 0
    complete = True
    for start in range(0, len(todo), batch_size):
        if cancel_requested(cancel):
            complete = False
            break
        chunk = todo[start : start + batch_size]
        n = len(chunk)
        hooks: list[Hook] = []
        by_layer: dict[int, tuple[list[int], list[int]]] = {}
        for b, (layer, h) in enumerate(chunk):
            rows, hs = by_layer.setdefault(layer, ([], []))
            rows.append(b)
            hs.append(h)
        for layer, (rows, hs) in sorted(by_layer.items()):
            hooks += _layer_hooks(model, template, layer, hs, rows)
        first = min(by_layer)
        if share_prefix and first > 0:

            def broadcast(resid: torch.Tensor, hook: Any = None, n: int = n) -> torch.Tensor:
                return resid.expand(n, *resid.shape[1:]).contiguous()

            hooks.insert(0, (get_act_name("resid_pre", first), broadcast))
            inp = _tensor(model, [ids])
        else:
            inp = _tensor(model, [ids] * n)
        with model.lock, torch.inference_mode():
            logits = model.bridge.run_with_hooks(inp, fwd_hooks=hooks, return_type="logits")
            values = fn(logits).float().cpu().numpy()
        del logits
        for (layer, h), v in zip(chunk, values, strict=True):
            effect[layer, h] = v - clean
        done += n
        if progress:
            progress(done / len(todo))
    return HeadSweep(effect, clean, template.method, metric_name, complete, time.perf_counter() - t0)



def save_head_sweep(store: Store, key: str, sweep: HeadSweep, meta: dict[str, Any]) -> None:
    store.put(key, "ablation_head_sweep", {
        **meta, "clean": sweep.clean, "method": sweep.method, "metric": sweep.metric,
        "complete": sweep.complete, "seconds": sweep.seconds, "version": ABLATION_VERSION,
    }, {"effect": np.asarray(sweep.effect, dtype=np.float32)})


def load_head_sweep(store: Store, key: str) -> tuple[HeadSweep, dict[str, Any]] | None:
    record = stored_record(store, key, "ablation_head_sweep")
    if record is None:
        return None
    m = record.meta
    sweep = HeadSweep(record.array("effect", mmap=False), float(m["clean"]), m["method"], m["metric"],
                      bool(m["complete"]), float(m["seconds"]))
    return sweep, m


def resumable_head_sweep(
    model: LoadedModel,
    tokens: str | Sequence[int],
    method: str | AblationSpec,
    metric: str,
    store: Store,
    key: str,
    *,
    layers_per_save: int = 3,
    meta: dict[str, Any] | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> HeadSweep:
    """:func:`single_head_sweep` a few layers at a time, stored under ``key`` after each block.

    A sweep that is cancelled, or whose process is killed, keeps the layers it finished (stored with
    ``complete=False``, shown as partial) and resumes from them when called again with the same key;
    a complete stored sweep is returned at once.
    """
    found = load_head_sweep(store, key)
    if found is not None and found[0].complete:
        if progress:
            progress(1.0)
        return found[0]
    n_layers, n_heads = model.n_layers, model.n_heads
    effect = found[0].effect.copy() if found else np.full((n_layers, n_heads), np.nan, np.float32)
    seconds = found[0].seconds if found else 0.0
    todo = [la for la in range(n_layers) if np.isnan(effect[la]).any()]
    done = n_layers - len(todo)
    result = found[0] if found else None
    for i in range(0, len(todo), max(1, layers_per_save)):
        if cancel_requested(cancel):
            break
        block = todo[i : i + layers_per_save]
        part = single_head_sweep(
            model, tokens, method, metric, heads=[(la, h) for la in block for h in range(n_heads)],
            progress=(lambda f, d=done, n=len(block): progress((d + f * n) / n_layers)) if progress else None,
        )
        effect[block] = part.effect[block]
        seconds, done = seconds + part.seconds, done + len(block)
        result = HeadSweep(effect.copy(), part.clean, part.method, part.metric, done == n_layers, seconds)
        save_head_sweep(store, key, result, {**(meta or {}), "model_digest": model.digest})
    if result is None:
        raise Cancelled("cancelled before the first block finished")
    return result


def head_sweep_key(model: LoadedModel, run: Run, spec: AblationSpec, metric: str, source_id: str | None) -> str:
    """The store key of :func:`ablation_head_sweep`: the key every stored sweep has, so none is computed again."""
    ref = spec.means.key[:16] if spec.means is not None else None
    return content_key("ablation_head_sweep", model.digest, run.key, spec.method, metric, ref, source_id)


def ablation_head_sweep(
    model: LoadedModel,
    run: Run,
    spec: AblationSpec,
    metric: str,
    store: Store,
    *,
    source_id: str | None = None,
    progress: Progress | None = None,
    cancel: Cancel | None = None,
) -> tuple[str, HeadSweep]:
    """Ablate each head alone on ``run`` with ``spec``'s method and options; stored and resumable.

    Parameters
    ----------
    spec : the method and its options (mean reference, resample source); its heads are ignored.
    metric : a name of :data:`~headscope.analysis.ablation_choices.SWEEP_METRICS`.
    source_id : the store id of the resample source run (part of the key; None for other methods).

    Returns
    -------
    The store key and the sweep (partial, ``complete`` False, when cancelled).
    """
    if metric not in SWEEP_METRICS:
        raise InputError(f"Unknown sweep metric {metric!r}: choose one of {', '.join(SWEEP_METRICS)}.")
    key = head_sweep_key(model, run, spec, metric, source_id)
    result = resumable_head_sweep(model, run.token_ids, spec, metric, store, key, meta={"run": run.key},
                                  progress=progress, cancel=cancel)
    return key, result

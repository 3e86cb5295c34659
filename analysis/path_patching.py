"""Patching several units at once, and path patching (Wang et al. 2022).

:func:`patch_together` copies a *set* of units (head outputs, q/k/v inputs, attention or MLP outputs,
embeddings, residual positions) from one prompt's run into the other's in one forward pass; it is what
the exactness checks of activation patching are written with (an empty set gives the baseline
exactly; a layer's heads together equal that layer's attention output). :func:`path_patching`
(Wang et al. 2022, "Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2
small", arXiv:2211.00593) patches only the path from sender heads into receiver heads' query, key or
value input. The prompts, metric and normalisation are :mod:`headscope.analysis.patching`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.ablation import Hook, Progress, _tensor
from headscope.analysis.errors import InputError, check_head_index, check_layer
from headscope.analysis.models import LoadedModel
from headscope.analysis.patching import (
    LAST_POSITION,
    MIN_DENOMINATOR,
    MetricFn,
    PromptPair,
    _check_choices,
    _head_kind,
    _n_heads,
    _site_hook,
    patching_metric,
    prompt_pair,
)
from headscope.analysis.patching_choices import (
    HEAD_SITES,
    JOINT_SITES,
    METRIC_LABELS,
    PATH_SITES,
)

JointUnit = tuple[str, int | None, int | None, int | None]
"""``(site, layer, head, position)`` of :func:`patch_together`: ``site`` one of
:data:`~headscope.analysis.patching_choices.JOINT_SITES`; ``layer`` None for ``embed`` (row L of ``resid`` is the
stream after the last layer); ``head`` a query head for ``z``/``q``, a key-value head for ``k``/``v``
and None for the other sites; ``position`` one token position or None for all of them."""


@dataclass(frozen=True)
class PatchedMetric:
    """The fields every patched-metric result shares: ``value`` normalised (0 = corrupted, 1 = clean),
    ``raw`` un-normalised, the two endpoints ``clean`` and ``corrupted``, ``direction`` and ``metric``."""

    value: float
    raw: float
    clean: float
    corrupted: float
    direction: str
    metric: str


@dataclass(frozen=True)
class JointPatch(PatchedMetric):
    """The metric with a set of units patched together in one forward pass.

    ``value`` is normalised (0 = corrupted, 1 = clean), ``raw`` the un-normalised metric, ``clean`` and
    ``corrupted`` the two endpoints; ``units`` the checked units, in the order given.
    """

    units: tuple[JointUnit, ...]
    pair: PromptPair


def layer_units(model: LoadedModel, layer: int, site: str = "z") -> list[JointUnit]:
    """Every head of ``layer`` at ``site`` (``z``/``q``: query heads; ``k``/``v``: key-value heads), at
    every position: the units of "the whole layer's heads" for :func:`patch_together`."""
    if site not in HEAD_SITES:
        raise InputError(f"A layer's heads are patched at a head site: choose one of {', '.join(HEAD_SITES)}.")
    layer = check_layer(model.n_layers, layer)
    return [(site, layer, h, None) for h in range(_n_heads(model, site))]


def _joint_hook(model: LoadedModel, site: str, layer: int | None) -> str:
    if site == "embed":
        return get_act_name("embed")
    if site in ("attn_out", "mlp_out"):
        return get_act_name(site, layer)
    return _site_hook(model, site, layer)


def _check_joint_units(model: LoadedModel, units: Sequence[Sequence[Any]], n_tokens: int) -> tuple[JointUnit, ...]:
    checked: list[JointUnit] = []
    for unit in units:
        if len(unit) != 4:
            raise InputError(f"A unit is (site, layer, head, position), got {tuple(unit)!r}.")
        site, layer, head, position = unit
        if site not in JOINT_SITES:
            raise InputError(f"Unknown site {site!r} in {tuple(unit)!r}: choose one of {', '.join(JOINT_SITES)}.")
        if site == "embed":
            if layer is not None or head is not None:
                raise InputError(f"The embedding has no layer or head: write ('embed', None, None, position), "
                                 f"got {tuple(unit)!r}.")
        elif site == "resid":
            layer = check_layer(model.n_layers + 1, layer)
        else:
            layer = check_layer(model.n_layers, layer)
        if site in HEAD_SITES:
            n = _n_heads(model, site)
            if head is None:
                raise InputError(f"Site {site!r} is per head: give a head (0..{n - 1}) in {tuple(unit)!r}.")
            head = check_head_index(model.n_layers, n, layer, head, kind=_head_kind(site))[1]
        elif head is not None:
            raise InputError(f"Site {site!r} has no heads: write None for the head in {tuple(unit)!r}.")
        if position is not None:
            if _whole_position(position) is None or not 0 <= int(position) < n_tokens:
                raise InputError(f"Position {position!r} in {tuple(unit)!r} is out of range: the prompts have "
                                 f"positions 0..{n_tokens - 1} (None: every position).")
            position = int(position)
        checked.append((site, layer, head, position))
    return tuple(checked)


def _whole_position(value: Any) -> int | None:
    return int(value) if isinstance(value, int | np.integer) and not isinstance(value, bool) else None


def _run_with_cache(model: LoadedModel, ids: Sequence[int], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The activations ``names`` (``[pos, …]``, batch dropped) of one forward pass on ``ids``."""
    acts: dict[str, torch.Tensor] = {}

    def keep(name: str):  # by the name asked for: an alias's hook.name is the canonical one
        def hook(t: torch.Tensor, hook: Any = None) -> None:
            acts[name] = t[0].detach().clone()

        return hook

    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(_tensor(model, [ids]), fwd_hooks=[(n, keep(n)) for n in sorted(set(names))],
                                    return_type=None)
    return acts


def _overwrite_hooks(writes: dict[str, list[tuple[tuple, torch.Tensor]]]) -> list[Hook]:
    """Hooks that overwrite, at each hook name, the entries ``where`` (index without the batch) of
    batch element 0 with ``value``."""
    hooks: list[Hook] = []
    for name, items in writes.items():

        def write(t: torch.Tensor, hook: Any = None, items=items) -> torch.Tensor:
            t = t.clone()
            for where, value in items:
                t[(0, *where)] = value.to(t.dtype)
            return t

        hooks.append((name, write))
    return hooks


def _unit_index(head: int | None, position: int | None) -> tuple:
    return (slice(None) if position is None else position,) + (() if head is None else (head,))


def _endpoints(model: LoadedModel, pair: PromptPair, fn: MetricFn, metric: str) -> tuple[float, float]:
    """The metric on each prompt, each in a batch of one like the patched run, so that patching
    nothing reproduces its endpoint bit for bit (a batch of two rounds differently)."""
    m_clean, m_corrupted = (_metric_with_hooks(model, ids, [], fn) for ids in (pair.clean_ids, pair.corrupted_ids))
    if abs(m_clean - m_corrupted) < MIN_DENOMINATOR:
        raise InputError(
            f"The {METRIC_LABELS[metric]} is the same on the clean and the corrupted prompt ({m_clean:.4g}): "
            "there is no difference to restore. Corrupt the prompt so that the answer changes."
        )
    return m_clean, m_corrupted


def _metric_with_hooks(model: LoadedModel, ids: Sequence[int], hooks: list[Hook], fn: MetricFn) -> float:
    with model.lock, torch.inference_mode():
        logits = model.bridge.run_with_hooks(_tensor(model, [ids]), fwd_hooks=hooks + [LAST_POSITION],
                                             return_type="logits")
        return float(fn(logits)[0])


def patch_together(
    model: LoadedModel,
    clean: str | Sequence[int],
    corrupted: str | Sequence[int],
    answers: Sequence[str | int],
    units: Sequence[JointUnit],
    *,
    direction: str = "denoise",
    metric: str = "logit_diff",
) -> JointPatch:
    """Patch a set of units together, in one forward pass, and measure the normalised metric.

    Every unit takes its activation from the source run (the clean prompt when denoising, the
    corrupted one when noising: module docstring) while everything not named is recomputed in the
    receiving run. Activations are the source run's own, not recomputed with the other patches in
    place: patching ``z`` of layer 0 and layer 1 together copies the clean ``z`` of both.

    What is exact, and what is not (the residual stream is a sum of writers: the token embedding,
    then each layer's attention output ``W_O·z`` and MLP output, Elhage et al. 2021, "A Mathematical
    Framework for Transformer Circuits"):

    - an empty set is the receiving run itself: value 0 when denoising, 1 when noising, exactly;
    - every head of layer l at ``z`` (:func:`layer_units`) equals patching that layer's attention
      output ``attn_out`` (``hook_attn_out = W_O · z``, no bias in the Llama family);
    - the embedding, every head of every layer at ``z`` and every layer's ``mlp_out`` together rebuild
      the source run's residual stream, so the value is 1 when denoising (0 when noising);
    - the metric reads the last position only, and its residual stream is its own token embedding
      plus each layer's attention and MLP outputs *at that position*: MLPs and norms act position by
      position, so other positions reach it only through attention. Every head of every layer at
      ``z`` (at all positions, or at the last one alone) therefore gives the source run's logits
      exactly **when the two prompts end in the same token**, though the residual stream at every
      other position stays the receiving run's mixture (its embedding and MLPs still read the
      receiving prompt): the clean logits come back only where they must. When the last tokens
      differ, the heads alone are not enough; the last position's embedding with them is.

    Parameters
    ----------
    units : ``(site, layer, head, position)`` (:data:`JointUnit`); may be empty.
    direction, metric : as in :func:`headscope.analysis.patching.activation_patching`.

    Returns
    -------
    :class:`JointPatch`.

    Raises
    ------
    InputError
        See :func:`prompt_pair`; a unit with an unknown site, a layer, head or position out of range.
    """
    _check_choices("z", direction, metric)
    pair = prompt_pair(model, clean, corrupted, answers)
    fn = patching_metric(metric, pair.answers)
    checked = _check_joint_units(model, units, pair.n_tokens)
    m_clean, m_corrupted = _endpoints(model, pair, fn, metric)
    receive, source_ids = ((pair.corrupted_ids, pair.clean_ids) if direction == "denoise"
                           else (pair.clean_ids, pair.corrupted_ids))
    names = {u: _joint_hook(model, u[0], u[1]) for u in checked}
    source = _run_with_cache(model, source_ids, list(names.values())) if checked else {}
    writes: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
    for unit, name in names.items():
        where = _unit_index(unit[2], unit[3])
        writes.setdefault(name, []).append((where, source[name][where]))
    raw = _metric_with_hooks(model, receive, _overwrite_hooks(writes), fn)
    return JointPatch((raw - m_corrupted) / (m_clean - m_corrupted), raw, m_clean, m_corrupted, direction, metric,
                      checked, pair)


# ---------------------------------------------------------------------------------------------
# Path patching


@dataclass(frozen=True)
class PathPatch(PatchedMetric):
    """The normalised metric (0 = corrupted, 1 = clean) with only the paths from ``senders`` into the
    ``site`` input of ``receivers`` patched; ``raw``, ``clean``, ``corrupted`` as in :class:`JointPatch`."""

    site: str
    senders: tuple[tuple[int, int], ...]
    receivers: tuple[tuple[int, int], ...]
    freeze_mlps: bool
    pair: PromptPair


def _check_heads(model: LoadedModel, heads: Sequence[Sequence[Any]], n_heads: int, what: str,
                 kind: str = "query heads") -> tuple[tuple[int, int], ...]:
    if not heads:
        raise InputError(f"Give at least one {what} head (layer, head).")
    checked = []
    for item in heads:
        if len(item) != 2:
            raise InputError(f"A {what} head is (layer, head), got {tuple(item)!r}.")
        checked.append(check_head_index(model.n_layers, n_heads, *item, kind=kind))
    return tuple(dict.fromkeys(checked))


def path_patching(
    model: LoadedModel,
    clean: str | Sequence[int],
    corrupted: str | Sequence[int],
    answers: Sequence[str | int],
    senders: Sequence[tuple[int, int]],
    receivers: Sequence[tuple[int, int]],
    *,
    site: str = "q",
    direction: str = "denoise",
    metric: str = "logit_diff",
    freeze_mlps: bool = False,
    progress: Progress | None = None,
) -> PathPatch:
    """Path patching from a set of sender heads into the query, key or value input of receiver heads.

    Wang et al. 2022, "Interpretability in the Wild: a Circuit for Indirect Object Identification in
    GPT-2 small", arXiv:2211.00593, §3.1 and Appendix B. With x_r the receiving prompt and x_s the
    source prompt (denoising: x_r corrupted, x_s clean; noising the reverse), z_h(x) head h's output
    (``hook_z``) and S, R the sender and receiver sets:

    1. run x_r with every head's output frozen to its value on x_r except the senders', which take
       their value on x_s:  z_h = z_h(x_s) for h ∈ S,  z_h = z_h(x_r) otherwise
       (MLPs recomputed, as in Wang et al.; with ``freeze_mlps`` also frozen to x_r, so only the direct
       paths S → R through the residual stream remain), and keep each receiver's input
       ``site`` (``hook_q``; ``hook_k``/``hook_v`` per key-value head): s_R*;
    2. run x_r with the receivers' ``site`` set to s_R* and everything else recomputed; m* its metric.

    value = (m* − m(x_corrupted)) / (m(x_clean) − m(x_corrupted)), as :func:`headscope.analysis.patching.activation_patching`.

    Only the paths S → R → logits change: the receivers' other inputs, every head not in R
    downstream of S and the MLPs' direct paths to the logits see x_r. Receivers in layers at or
    before every sender receive nothing from them; at least one receiver must lie after a sender.

    Parameters
    ----------
    senders : query heads ``(layer, head)`` whose outputs are patched.
    receivers : ``(layer, head)``: query heads for ``q``, key-value heads for ``k`` and ``v`` (with
        grouped-query attention one key-value head is read by ``group_size`` query heads).
    site : ``q``, ``k`` or ``v``: which input of the receivers the path ends in.
    freeze_mlps : freeze the MLP outputs in step 1 as well (only direct sender → receiver paths).

    Returns
    -------
    :class:`PathPatch`.

    Raises
    ------
    InputError
        See :func:`prompt_pair`; an unknown site; no senders or receivers; a head out of range; no
        receiver after a sender.
    """
    if site not in PATH_SITES:
        raise InputError(f"Path patching ends in a receiver's query, key or value: choose the site from "
                         f"{', '.join(PATH_SITES)}, got {site!r}.")
    _check_choices("z", direction, metric)
    pair = prompt_pair(model, clean, corrupted, answers)
    fn = patching_metric(metric, pair.answers)
    sends = _check_heads(model, senders, model.n_heads, "sender")
    receives = _check_heads(model, receivers, _n_heads(model, site), "receiver", _head_kind(site))
    if max(r[0] for r in receives) <= min(s[0] for s in sends):
        raise InputError(f"No receiver lies in a layer after a sender (senders from layer {min(s[0] for s in sends)},"
                         f" receivers up to layer {max(r[0] for r in receives)}): a head reads only earlier layers' "
                         "outputs. Choose receivers in later layers.")
    m_clean, m_corrupted = _endpoints(model, pair, fn, metric)
    receive, source_ids = ((pair.corrupted_ids, pair.clean_ids) if direction == "denoise"
                           else (pair.clean_ids, pair.corrupted_ids))
    last = max(r[0] for r in receives)  # nothing after the last receiver's input matters in step 1
    z_names = {la: get_act_name("z", la) for la in range(last)}
    mlp_names = {la: get_act_name("mlp_out", la) for la in range(last)} if freeze_mlps else {}
    frozen = _run_with_cache(model, receive, [*z_names.values(), *mlp_names.values()])
    sent = _run_with_cache(model, source_ids, [z_names[la] for la in {s[0] for s in sends} if la < last])
    writes: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
    for la, name in z_names.items():
        writes[name] = [((slice(None),), frozen[name])]
        writes[name] += [((slice(None), h), sent[name][:, h]) for sl, h in sends if sl == la]
    for name in mlp_names.values():
        writes[name] = [((slice(None),), frozen[name])]
    site_names = {la: get_act_name(site, la) for la in sorted({r[0] for r in receives})}
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(t: torch.Tensor, hook: Any = None) -> None:
            captured[name] = t[0].detach().clone()

        return hook

    with model.lock, torch.inference_mode():
        model.bridge.run_with_hooks(_tensor(model, [receive]), return_type=None,
                                    fwd_hooks=_overwrite_hooks(writes) + [(n, keep(n)) for n in site_names.values()])
    patch = {name: [((slice(None), h), captured[name][:, h]) for la, h in receives if site_names[la] == name]
             for name in site_names.values()}
    raw = _metric_with_hooks(model, receive, _overwrite_hooks(patch), fn)
    if progress:
        progress(1.0)
    return PathPatch((raw - m_corrupted) / (m_clean - m_corrupted), raw, m_clean, m_corrupted, direction, metric,
                     site, sends, receives, freeze_mlps, pair)

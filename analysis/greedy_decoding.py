"""Greedy decoding through the KV cache that records, at every step, where each head looks.

The decoding half of the retrieval-head protocol (Wu et al. 2024, "Retrieval Head Mechanistically
Explains Long-Context Factuality", arXiv:2404.15574; :mod:`headscope.analysis.retrieval`): at decode step t
the query that produces token ``y_t`` attends over the prompt and what was generated; for every
layer and query head only ``argmax_j A[l, h][t, j]`` and its weight are kept (and, on request, one
head's whole row). The prompt is pre-filled in statistics mode (:mod:`headscope.analysis.attention_statistics`)
so no N x N matrix is built, and each decode row is reduced to its argmax by :func:`headscope.kernels.attention`
in the pass that computes the output; models without statistics mode use a ``hook_pattern`` hook
(same numbers). Also used by the ablation pipelines (continuations under ablation) and stopped by
the same ``cancel`` callables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.attention_statistics import statistics_mode, statistics_supported
from headscope.analysis.bare_model import bare_statistics, bare_supported
from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.models import LoadedModel
from headscope.kernels.attention import ARGMAX, ARGMAX_PROB, ROWS

DEFAULT_MAX_NEW_TOKENS = 32

Progress = Callable[[float], None]
Cancel = Callable[[], bool]


class Cancelled(RuntimeError):
    """Raised inside a trial when ``cancel`` asks to stop; the unfinished trial is dropped."""



@dataclass
class Decoded:
    """A greedy continuation and, per step, the argmax key and its weight for every query head."""

    generated: list[int]
    argmax_keys: np.ndarray  # [step, layer, head] int32
    argmax_weight: np.ndarray  # [step, layer, head] float32
    seconds: float
    rows: list[np.ndarray] | None = None  # with keep_row: the full attention row per step


def stop_ids(model: LoadedModel) -> set[int]:
    """Token ids that end a response: the tokenizer's EOS and the generation config's EOS ids."""
    ids: set[int] = set()
    tok = model.tokenizer
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    gen = getattr(model.hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(e) for e in eos)
    return ids


def cancel_requested(cancel: Any) -> bool:
    if cancel is None:
        return False
    if hasattr(cancel, "is_set"):
        return bool(cancel.is_set())
    return bool(cancel())


@torch.inference_mode()
def greedy_decode(
    model: LoadedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    record: bool = True,
    cancel: Cancel | None = None,
    progress: Progress | None = None,
    force: Sequence[int] | None = None,
    keep_row: tuple[int, int] | None = None,
    stop_at_newline: bool = False,
) -> Decoded:
    """Greedy decoding with the KV cache, keeping one attention row per head per step.

    The prompt minus its last token is pre-filled without keeping any attention; then each step
    feeds one token and, when ``record``, every layer's decode row ``[head, key]`` is reduced to its
    argmax key and maximum. The first step's query is the prompt's last token, so row t produces
    token t. Models that run in statistics mode (the families in the README's table) do all of it through
    :func:`headscope.kernels.attention` (the prefill builds no N × N matrix; the argmax comes from the
    kernel); others through a hook on ``hook_pattern``, which gives the same numbers. When no hook is
    attached to the bridge, the passes run on the Hugging Face modules it wraps, without its wrappers
    (:mod:`headscope.analysis.bare_model`: the same numbers, without the bridge's per-module cost).

    Parameters
    ----------
    prompt_ids : the exact ids to continue.
    max_new_tokens : the most tokens to generate; decoding also stops after an EOS token (which is
        kept in ``generated``).
    record : False gives plain generation (the baseline of ``bench/retrieval.py``).
    cancel : called between steps; True raises :class:`Cancelled`.
    progress : called with the fraction of ``max_new_tokens`` done.
    force : feed these tokens instead of the argmax (a replay of an earlier decode: same prefill, same
        KV-cache steps, so the same numbers); decoding runs ``len(force)`` steps.
    keep_row : ``(layer, head)`` whose whole attention row (over the prompt and the tokens generated
        so far) is kept at every step, in ``rows``.
    stop_at_newline : also stop after the first token that puts a newline after some non-blank text
        (the token is kept in ``generated``, like an EOS).

    Returns
    -------
    :class:`Decoded` with ``argmax_keys``/``argmax_weight`` of shape ``[steps, layer, head]``.
    """
    if not prompt_ids:
        raise InputError("The prompt is empty.")
    if force is not None:
        max_new_tokens = len(force)
    if max_new_tokens < 1:
        raise InputError("max_new_tokens must be at least 1.")
    t0 = time.perf_counter()
    bridge = model.bridge
    stops = stop_ids(model)
    n_layers, n_heads = model.n_layers, model.n_heads
    keys = torch.zeros((max_new_tokens, n_layers, n_heads), dtype=torch.int64)
    weights = torch.zeros((max_new_tokens, n_layers, n_heads), dtype=torch.float32)
    step_box = [0]
    rows: list[np.ndarray] = []

    if keep_row is not None:
        keep_row = check_head_index(n_layers, n_heads, *keep_row)
    record = record or keep_row is not None
    hooked, bare = nullcontext(), False
    if statistics_supported(model):
        request, on_layer = _kernel_recorders(keys, weights, step_box, rows, keep_row, record)
        bare = bare_supported(model)  # nothing hooked: the Hugging Face modules without the bridge's wrappers
        mode = bare_statistics(model, request, on_layer) if bare else statistics_mode(model, request, on_layer)
    else:
        hooks = _row_recorders(n_layers, keys, weights, step_box, rows, keep_row, len(prompt_ids))
        mode = nullcontext()
        hooked = bridge.hooks(fwd_hooks=hooks) if record else nullcontext()
    device = model.device
    generated: list[int] = []
    with model.lock, mode as twin:
        forward = _bare_forward(twin) if bare else _bridge_forward(bridge)
        past = None
        if len(prompt_ids) > 1:
            prefix = torch.tensor([list(prompt_ids[:-1])], dtype=torch.long, device=device)
            # only the cache is used: logits of the last position alone, never [n, vocab] (Gemma 3's
            # 262k-word vocabulary would make that 8.6 GB at 8k tokens, and most of the prefill's time)
            _, past = forward(prefix, None, prefill=True)
        token = int(prompt_ids[-1])
        with hooked:
            for step in range(max_new_tokens):
                if cancel_requested(cancel):
                    raise Cancelled("cancelled")
                step_box[0] = step
                inp = torch.tensor([[token]], dtype=torch.long, device=device)
                logits, past = forward(inp, past)
                token = int(force[step]) if force is not None else int(logits[0, -1].argmax())
                generated.append(token)
                if progress:
                    progress((step + 1) / max_new_tokens)
                if token in stops and force is None:
                    break
                if stop_at_newline and force is None and _ends_a_line(model, generated):
                    break
    n = len(generated)
    return Decoded(
        generated=generated,
        argmax_keys=keys[:n].numpy().astype(np.int32),
        argmax_weight=weights[:n].numpy(),
        seconds=time.perf_counter() - t0,
        rows=rows if keep_row is not None else None,
    )


Forward = Callable[..., tuple[torch.Tensor, Any]]
"""``forward(ids [1, n], past, prefill=False) -> (logits [1, n or 1, vocab], past)``: one KV-cached pass."""


def _bridge_forward(bridge: Any) -> Forward:
    """A pass through the bridge (its hooks fire)."""

    def forward(ids: torch.Tensor, past: Any, prefill: bool = False) -> tuple[torch.Tensor, Any]:
        if prefill:
            return bridge(ids, return_type="logits_and_cache", use_cache=True, logits_to_keep=1)
        if past is None:
            return bridge(ids, return_type="logits_and_cache", use_cache=True)
        return bridge(ids, return_type="logits_and_cache", past_key_values=past)

    return forward


def _bare_forward(twin: Any) -> Forward:
    """A pass through the bridge's Hugging Face modules without its wrappers (:mod:`headscope.analysis.bare_model`)."""

    def forward(ids: torch.Tensor, past: Any, prefill: bool = False) -> tuple[torch.Tensor, Any]:
        out = twin(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        return out.logits, out.past_key_values

    return forward


def _kernel_recorders(keys: torch.Tensor, weights: torch.Tensor, step_box: list[int], rows: list[np.ndarray],
                      keep_row: tuple[int, int] | None, record: bool) -> tuple[Any, Any]:
    """Statistics mode's ``request`` and ``on_layer`` for greedy decoding: each decode row (one query)
    reduced to its argmax key and weight by the kernel, into ``keys``/``weights`` at step ``step_box[0]``,
    and ``keep_row``'s whole row; the prefill asks for nothing (no N × N matrix)."""
    from headscope.analysis.attention_statistics import LayerRequest

    argmax_only = LayerRequest({"stats": (ARGMAX,)})
    with_row = LayerRequest({"stats": (ARGMAX, ROWS), "rows": [0]})

    def request(layer: int, n_q: int, n_k: int):
        if not record or n_q != 1:
            return None
        return with_row if keep_row is not None and keep_row[0] == layer else argmax_only

    def on_layer(ls) -> None:
        keys[step_box[0], ls.layer] = ls.stats[ARGMAX][0, :, 0]
        weights[step_box[0], ls.layer] = ls.stats[ARGMAX_PROB][0, :, 0]
        if ROWS in ls.stats:
            rows.append(ls.stats[ROWS][0, keep_row[1], 0].float().cpu().numpy().copy())

    return request, on_layer


def _row_recorders(n_layers: int, keys: torch.Tensor, weights: torch.Tensor, step_box: list[int],
                   rows: list[np.ndarray], keep_row: tuple[int, int] | None, n_prompt: int) -> list[tuple[str, Any]]:
    """The eager path's ``hook_pattern`` hooks: each decode row's argmax key and weight per head
    (into ``keys``/``weights`` at step ``step_box[0]``), and ``keep_row``'s whole row, in the
    model's key positions: a sliding-window layer's cache (Mistral, Gemma) holds only the last
    keys, so its pattern row starts at ``dropped`` = query position − (row length − 1)."""

    def record_row(layer: int):
        def hook(pattern: torch.Tensor, hook: Any = None) -> None:
            # pattern: [batch, head, query, key]; the decode step has a single query row.
            dropped = max(0, n_prompt - 1 + step_box[0] - (pattern.shape[-1] - 1))
            w, j = pattern[0, :, -1, :].max(dim=-1)
            keys[step_box[0], layer] = j + dropped
            weights[step_box[0], layer] = w.float()
            if keep_row is not None and keep_row[0] == layer:
                row = pattern[0, keep_row[1], -1, :].float().cpu().numpy()
                rows.append(np.concatenate([np.zeros(dropped, dtype=row.dtype), row]))

        return hook

    return [(get_act_name("pattern", layer), record_row(layer)) for layer in range(n_layers)]


def _ends_a_line(model: LoadedModel, generated: list[int]) -> bool:
    """Whether the text generated so far has a newline after some non-blank text."""
    text = model.tokenizer.decode(generated, skip_special_tokens=True).lstrip()
    return "\n" in text

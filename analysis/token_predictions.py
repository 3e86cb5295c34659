"""Per-token loss and top-k next-token predictions, in chunks of positions from the final hidden state.

A run shows, for every position i, the loss of the token that follows and the model's top-5 guesses
there. Read off the model's logits, that needs an ``[n, vocab]`` float32 array: with Gemma 3's
262,144-word vocabulary, 8 GiB at 8,192 tokens, most of a statistics-mode run's peak memory. Instead
the forward pass asks for the last position's logits only (``logits_to_keep=1``), the final hidden
state ``h`` ``[n, d_model]`` (the unembedding's input, after the final norm) is kept
(:func:`final_hidden_state`), and for each chunk of C positions ``a .. e−1``:

    z = unembed(h[a:e])                      the model's ``lm_head``, then its final soft-capping
                                             ``cap · tanh(z / cap)`` where it has one (Gemma 2)
    log p = log_softmax(z)
    loss[i + 1] = −log p[i, ids[i + 1]]       (nan at position 0)
    top-k of log p → ids and probabilities exp(log p)

and ``z`` is dropped before the next chunk: peak memory O(C · vocab), not O(n · vocab). The numbers
equal those of the full logits (``tests/analysis/test_token_predictions.py``, to 1e-5, chunk sizes
that do not divide n included). The model's own logits of the last position are held against the
recomputed ones, so a model whose logits are something else than ``unembed(h)`` is refused instead
of getting wrong losses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from headscope.analysis.errors import InputError

TOP_K = 5
PREDICTION_CHUNK = 256
"""Positions unembedded at a time: 256 × 262,144 × 4 B = 256 MiB for Gemma 3 (and the same again
for its log-softmax)."""


@dataclass
class TokenPredictions:
    """Attributes
    ----------
    token_loss : ``[n]`` float32, ``−log p(ids[i] | ids[:i])``; nan at position 0.
    top_ids, top_probs : ``[n, k]`` the ``k`` most likely next tokens after each position (int64, float32).
    """

    token_loss: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray


@dataclass
class _Kept:
    hidden: torch.Tensor | None = None


@contextmanager
def final_hidden_state(model: Any) -> Iterator[_Kept]:
    """Keep the final hidden state ``[n, d_model]`` (batch row 0) of the forward passes run inside.

    Hooks the Hugging Face base model (``model.hf_model.base_model``), whose output is the
    unembedding's input (its final norm applied) for every family the bridge boots.
    """
    kept = _Kept()

    def keep(module: Any, args: Any, output: Any) -> None:
        h = output[0] if isinstance(output, tuple) else output.last_hidden_state
        kept.hidden = h[0].detach()

    handle = model.hf_model.base_model.register_forward_hook(keep)
    try:
        yield kept
    finally:
        handle.remove()


def unembed(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``[..., vocab]`` logits of final hidden states, as the model's forward makes them: its output
    embedding (``lm_head``), then ``cap · tanh(z / cap)`` when its config has a
    ``final_logit_softcapping`` (Gemma 2)."""
    z = model.hf_model.get_output_embeddings()(hidden)
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    if cap:
        z = torch.tanh(z / cap) * cap
    return z


def token_predictions(
    model: Any,
    hidden: torch.Tensor,
    ids: Sequence[int],
    *,
    chunk: int = PREDICTION_CHUNK,
    k: int = TOP_K,
    last_logits: torch.Tensor | None = None,
) -> TokenPredictions:
    """Per-token loss and top-``k`` from ``hidden`` ``[n, d_model]``, ``chunk`` positions at a time
    (see the module docstring).

    Parameters
    ----------
    hidden : the final hidden state of the forward pass over ``ids`` (:func:`final_hidden_state`).
    ids : the ``n`` token ids of that pass.
    chunk : positions unembedded at a time (>= 1); peak memory about ``2 · chunk · vocab · 4`` bytes.
    last_logits : ``[vocab]`` the model's own logits of the last position, checked against the
        recomputed ones (to 1e-3 of their scale).

    Raises
    ------
    InputError
        When the recomputed last-position logits differ from ``last_logits``: the model's logits are
        not ``unembed(h)``, so its losses cannot be computed this way.
    """
    n = len(ids)
    if hidden.shape[0] != n:
        raise ValueError(f"hidden has {hidden.shape[0]} positions for {n} token ids")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    targets = torch.as_tensor(list(ids), dtype=torch.long, device=hidden.device)
    loss = np.full(n, np.nan, dtype=np.float32)
    top_ids: np.ndarray | None = None
    top_probs: np.ndarray | None = None
    with torch.inference_mode():
        for a in range(0, n, chunk):
            e = min(a + chunk, n)
            z = unembed(model, hidden[a:e]).float()
            if e == n and last_logits is not None:
                _check_last(z[-1], last_logits.float())
            lp = torch.log_softmax(z, dim=-1)
            del z
            if top_ids is None:
                kk = min(k, lp.shape[-1])
                top_ids = np.zeros((n, kk), dtype=np.int64)
                top_probs = np.zeros((n, kk), dtype=np.float32)
            top = torch.topk(lp, k=top_ids.shape[1], dim=-1)
            top_ids[a:e] = top.indices.cpu().numpy()
            top_probs[a:e] = top.values.exp().cpu().numpy()
            stop = min(e, n - 1)  # position i predicts ids[i + 1]; the last one predicts nothing here
            if stop > a:
                loss[a + 1 : stop + 1] = (-lp[: stop - a].gather(1, targets[a + 1 : stop + 1, None])[:, 0]).cpu().numpy()
            del lp
    assert top_ids is not None and top_probs is not None  # n >= 1: at least one chunk ran
    return TokenPredictions(loss, top_ids, top_probs)


def _check_last(recomputed: torch.Tensor, own: torch.Tensor) -> None:
    scale = float(own.abs().max().clamp_min(1.0))
    diff = float((recomputed - own.to(recomputed.device)).abs().max())
    if diff > 1e-3 * scale:
        raise InputError(
            f"This model's logits are not its unembedding of the final hidden state (last position off by "
            f"{diff:.3g}): per-token losses cannot be computed in chunks for it. Run a text within "
            "HEADSCOPE_MAX_TOKENS to capture full patterns instead."
        )

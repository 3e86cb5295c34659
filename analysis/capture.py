"""One forward pass of one model on one input, with exactly what was asked captured.

A :class:`Run` holds the token ids the model saw and their display strings, the post-softmax attention
pattern of every query head (``[layer, head, query, key]``), the per-token loss, the top-5 next-token
predictions and, on request, post-rotary queries and keys of chosen layers. Hooks capture only the
named activations (never the whole cache) and copy them straight into preallocated arrays.

Runs are content-keyed (model digest + token ids + settings) and stored: asking again loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from analysis.models import LoadedModel
from analysis.store import Store, content_key

CAPTURE_VERSION = 1
MAX_TOKENS_PATTERNS = 2048
"""Longest input whose full patterns are captured (30 layers × 9 heads × N² grows fast)."""

TOP_K = 5


class InputError(ValueError):
    """Input a user can fix: the message says what was wrong and what to do."""


@dataclass
class Run:
    """What one forward pass captured.

    Attributes
    ----------
    patterns : ``[layer, head, query, key]`` post-softmax attention per *query* head.
    token_loss : ``[pos]`` cross-entropy of token ``pos`` given the tokens before it (nan at 0).
    top_ids, top_probs : ``[pos, 5]`` the most likely next tokens after position ``pos``.
    q : layer → ``[head, pos, d_head]`` post-rotary queries; k : layer → ``[kv_head, pos, d_head]``.
    """

    key: str
    model_name: str
    model_digest: str
    token_ids: list[int]
    tokens: list[str]
    text: str | None
    settings: dict[str, Any]
    patterns: np.ndarray
    token_loss: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    q: dict[int, np.ndarray] = field(default_factory=dict)
    k: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def short_id(self) -> str:
        return self.key[:12]

    def meta(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "model_digest": self.model_digest,
            "token_ids": self.token_ids,
            "tokens": self.tokens,
            "text": self.text,
            "settings": self.settings,
            "n_tokens": self.n_tokens,
            "capture_version": CAPTURE_VERSION,
        }


def run_key(model: LoadedModel, token_ids: Sequence[int], settings: dict[str, Any]) -> str:
    return content_key("run", CAPTURE_VERSION, model.digest, list(map(int, token_ids)), settings)


def tokenize_input(model: LoadedModel, text_or_ids: str | Sequence[int], max_tokens: int, *,
                   limited: str = "full attention patterns are limited to",
                   variable: str = "HEADSCOPE_MAX_TOKENS") -> list[int]:
    """Token ids for a string (no BOS added behind the user's back) or validated ids.

    At most ``max_tokens`` (a limit set by ``variable``) and at most the model's context
    ``model.n_ctx``. Above the context the message says so and names no setting: none makes the model
    read more positions than it has; below it, a text over ``max_tokens`` is told ``variable``.
    """
    if isinstance(text_or_ids, str):
        if not text_or_ids.strip():
            raise InputError("The text is empty: type or paste some text to analyse.")
        # Cheap bound first, so 2,000,000 characters do not tokenise for nothing (a text of words
        # has far fewer than 32 characters a token, so this one is far beyond the context).
        if len(text_or_ids) > max(max_tokens, model.n_ctx) * 32:
            raise InputError(_beyond_context(model, f"The text has {len(text_or_ids):,} characters, far"))
        ids = model.encode(text_or_ids)
    else:
        ids = [int(i) for i in text_or_ids]
        bad = [i for i in ids if not 0 <= i < model.vocab_size]
        if bad:
            raise InputError(f"Token ids outside the vocabulary (0..{model.vocab_size - 1}): {bad[:5]}")
    if not ids:
        raise InputError("The input has no tokens.")
    if len(ids) > model.n_ctx:
        raise InputError(_beyond_context(model, f"The input has {len(ids):,} tokens,"))
    if len(ids) > max_tokens:
        raise InputError(
            f"The input has {len(ids):,} tokens; {limited} {max_tokens:,} "
            f"tokens (set {variable} to change it). Shorten the text."
        )
    return ids


def _beyond_context(model: LoadedModel, size: str) -> str:
    return (f"{size} more than the model's context of {model.n_ctx:,} tokens, the most "
            f"{model.name} can read at once (its context limit; no setting raises it). Shorten the text to "
            f"at most {model.n_ctx:,} tokens, or analyse it in parts.")


def capture(
    model: LoadedModel,
    text_or_ids: str | Sequence[int],
    *,
    qk_layers: Sequence[int] = (),
    store: Store | None = None,
    pattern_dtype: str = "float16",
    max_tokens: int = MAX_TOKENS_PATTERNS,
    progress: Callable[[float], None] | None = None,
) -> Run:
    """Run ``model`` on ``text_or_ids`` and capture patterns, loss, top-5 and optional q/k.

    Parameters
    ----------
    text_or_ids : text (tokenised without adding a BOS) or token ids, used exactly as given.
    qk_layers : layers whose post-rotary q and k vectors (``hook_rot_q``/``hook_rot_k``) are kept.
    store : when given, a stored run with the same key is loaded instead of recomputed, and a new
        run is stored.
    pattern_dtype : ``float16`` (half the memory and disk) or ``float32`` (bit-exact to eager).
    """
    if pattern_dtype not in ("float16", "float32"):
        raise InputError("pattern_dtype must be float16 or float32")
    layers = sorted({int(layer) for layer in qk_layers})
    bad = [layer for layer in layers if not 0 <= layer < model.n_layers]
    if bad:
        raise InputError(f"Layer {bad[0]} is out of range: the model has layers 0..{model.n_layers - 1}.")
    ids = tokenize_input(model, text_or_ids, max_tokens)
    text = text_or_ids if isinstance(text_or_ids, str) else None
    settings = {"pattern_dtype": pattern_dtype, "qk_layers": layers}
    key = run_key(model, ids, settings)
    if store is not None:
        stored = load_run(store, key)
        if stored is not None:
            if progress:
                progress(1.0)
            return stored

    n = len(ids)
    dtype = np.dtype(pattern_dtype)
    patterns = np.empty((model.n_layers, model.n_heads, n, n), dtype=dtype)
    q: dict[int, np.ndarray] = {}
    k: dict[int, np.ndarray] = {}

    def keep_pattern(layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            patterns[layer] = tensor[0].detach().to(torch.float32).numpy()
            if progress:
                progress((layer + 1) / (model.n_layers + 1))

        return hook

    def keep(target: dict[int, np.ndarray], layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            # [batch, pos, head, d_head] → [head, pos, d_head]
            target[layer] = tensor[0].detach().permute(1, 0, 2).contiguous().numpy().astype(np.float32)

        return hook

    hooks = [(get_act_name("pattern", layer), keep_pattern(layer)) for layer in range(model.n_layers)]
    for layer in layers:
        hooks.append((get_act_name("rot_q", layer), keep(q, layer)))
        hooks.append((get_act_name("rot_k", layer), keep(k, layer)))

    tokens_t = torch.tensor([ids], dtype=torch.long, device=model.device)
    with model.lock, torch.inference_mode():
        logits = model.bridge.run_with_hooks(tokens_t, fwd_hooks=hooks, return_type="logits")
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    token_loss = np.full(n, np.nan, dtype=np.float32)
    if n > 1:
        target = tokens_t[0, 1:]
        token_loss[1:] = (-logprobs[:-1].gather(1, target[:, None])[:, 0]).numpy()
    top = torch.topk(logprobs, k=min(TOP_K, logprobs.shape[-1]), dim=-1)
    run = Run(
        key=key,
        model_name=model.name,
        model_digest=model.digest,
        token_ids=ids,
        tokens=model.token_strings(ids),
        text=text,
        settings=settings,
        patterns=patterns,
        token_loss=token_loss,
        top_ids=top.indices.numpy().astype(np.int64),
        top_probs=top.values.exp().numpy().astype(np.float32),
        q=q,
        k=k,
    )
    if store is not None:
        save_run(store, run)
    if progress:
        progress(1.0)
    return run


def save_run(store: Store, run: Run) -> None:
    arrays: dict[str, np.ndarray] = {
        "patterns": run.patterns,
        "token_loss": run.token_loss,
        "top_ids": run.top_ids,
        "top_probs": run.top_probs,
    }
    for layer, arr in run.q.items():
        arrays[f"q{layer}"] = arr
    for layer, arr in run.k.items():
        arrays[f"k{layer}"] = arr
    store.put(run.key, "run", run.meta(), arrays)


def load_run(store: Store, key: str) -> Run | None:
    """A stored run, or ``None`` when absent or corrupt (a corrupt run is dropped, to be recomputed)."""
    record = store.get(key)
    if record is None or record.kind != "run":
        return None
    m = record.meta
    names = record.array_info
    return Run(
        key=key,
        model_name=m["model_name"],
        model_digest=m["model_digest"],
        token_ids=m["token_ids"],
        tokens=m["tokens"],
        text=m.get("text"),
        settings=m["settings"],
        patterns=record.array("patterns"),
        token_loss=record.array("token_loss", mmap=False),
        top_ids=record.array("top_ids", mmap=False),
        top_probs=record.array("top_probs", mmap=False),
        q={int(n[1:]): record.array(n) for n in names if n.startswith("q") and n[1:].isdigit()},
        k={int(n[1:]): record.array(n) for n in names if n.startswith("k") and n[1:].isdigit()},
    )

"""One forward pass of one model on one input, with exactly what was asked captured.

A :class:`Run` holds the token ids the model saw and their display strings, the post-softmax attention
pattern of every query head (``[layer, head, query, key]``), the per-token loss, the top-5 next-token
predictions and, on request, post-rotary queries and keys of chosen layers. Hooks capture only the
named activations (never the whole cache) and copy them straight into preallocated arrays.

Runs are content-keyed (model digest + token ids + settings) and stored: asking again loads.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.errors import (  # InputError also re-exported from here for older imports
    InputError,
    check_layer,
)
from headscope.analysis.models import LoadedModel
from headscope.analysis.runs import RunRecord
from headscope.analysis.score_registry import run_metrics, score_run
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result
from headscope.analysis.token_predictions import final_hidden_state, token_predictions

CAPTURE_VERSION = 1
MAX_TOKENS_PATTERNS = 2048
"""Longest input whose full patterns are captured (30 layers × 9 heads × N² grows fast)."""


@dataclass
class Run(RunRecord):
    """What one forward pass captured (an :class:`headscope.analysis.runs.AttentionRun` with full patterns).

    Attributes
    ----------
    patterns : ``[layer, head, query, key]`` post-softmax attention per *query* head.
    token_loss : ``[pos]`` cross-entropy of token ``pos`` given the tokens before it (nan at 0).
    top_ids, top_probs : ``[pos, 5]`` the most likely next tokens after position ``pos``.
    q : layer → ``[head, pos, d_head]`` post-rotary queries; k : layer → ``[kv_head, pos, d_head]``.
    """

    patterns: np.ndarray
    token_loss: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    q: dict[int, np.ndarray] = field(default_factory=dict)
    k: dict[int, np.ndarray] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    has_patterns = True
    seconds = float("nan")  # not timed
    block_size = 1  # the overview is the pattern itself

    @property
    def n_layers(self) -> int:
        return self.patterns.shape[0]

    @property
    def n_heads(self) -> int:
        return self.patterns.shape[1]

    @property
    def metrics(self) -> tuple[str, ...]:
        """The scores this run gives (:func:`headscope.analysis.score_registry.run_metrics`)."""
        return run_metrics(self)

    @property
    def mode(self) -> str:
        return "full patterns"

    def require_patterns(self, what: str) -> None:
        """Full patterns are kept: every view can be drawn."""

    def head_scores(self, metric: str, model: LoadedModel | None = None) -> np.ndarray:
        """``[layer, head]`` score ``metric`` of the patterns, or with ``model`` (default: the run's own)
        for a score that needs the model (:func:`headscope.analysis.score_registry.score_run`)."""
        return score_run(self, metric, model, word="metric")

    def received_attention(self) -> np.ndarray:
        """``[layer, head, n]`` :func:`headscope.analysis.streaming.sink_map`'s ``received``."""
        return self._sink_map().received

    def sink_counts(self) -> np.ndarray:
        """``[n]`` :func:`headscope.analysis.streaming.sink_map`'s ``head_counts``."""
        return self._sink_map().head_counts

    def _sink_map(self):
        from headscope.analysis.streaming import sink_map

        if "sink_map" not in self._memo:
            self._memo["sink_map"] = sink_map(self.patterns, layer_windows=self.layer_windows)
        return self._memo["sink_map"]

    def attention_overview(self, layer: int, head: int) -> np.ndarray:
        """``[n, n]`` the head's pattern ``A[l, h]`` (float32)."""
        return np.asarray(self.patterns[layer, head], dtype=np.float32)

    def attention_region(self, layer: int, head: int, queries: tuple[int, int], keys: tuple[int, int],
                         model: Any = None) -> np.ndarray:
        """``A[l, h][q0:q1, k0:k1]`` read from the stored patterns (float32)."""
        (q0, q1), (k0, k1) = queries, keys
        return np.asarray(self.patterns[layer, head, q0:q1, k0:k1], dtype=np.float32)

    def kept_arrays(self) -> dict[str, np.ndarray]:
        return {"patterns": np.asarray(self.patterns)}

    def meta(self) -> dict[str, Any]:
        return {**self.common_meta(), "capture_version": CAPTURE_VERSION}


def run_key(model: LoadedModel, token_ids: Sequence[int], settings: dict[str, Any]) -> str:
    return content_key("run", CAPTURE_VERSION, model.digest, list(map(int, token_ids)), settings)


def tokenize_input(model: LoadedModel, text_or_ids: str | Sequence[int], max_tokens: int, *,
                   limited: str = "full attention patterns are limited to",
                   variable: str = "HEADSCOPE_MAX_TOKENS") -> list[int]:
    """Token ids for a string (:meth:`LoadedModel.input_ids`: the BOS the model expects, shown as
    token 0, and nothing else) or validated ids, used as given.

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
        ids = model.input_ids(text_or_ids)  # a BOS only where the model expects one (model.facts)
    else:
        ids = _whole_ids(text_or_ids)
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


def _whole_ids(values: Sequence[object]) -> list[int]:
    """Ids as ints, each an integer type (``operator.index``: int, numpy and 0-d torch integers); a float,
    bool, string or None is refused rather than converted, since ``int(6.7)`` would analyse token 6."""
    ids, bad = [], []
    for v in values:
        try:
            if isinstance(v, bool | np.bool_):
                raise TypeError
            ids.append(operator.index(v))
        except TypeError:
            bad.append(v)
    if bad:
        raise InputError(f"Token ids must be whole numbers (integers); got {', '.join(repr(b)[:20] for b in bad[:3])}.")
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
    max_tokens_variable: str = "capture's max_tokens argument",
    progress: Callable[[float], None] | None = None,
    before_store: Callable[[Run], None] | None = None,
) -> Run:
    """Run ``model`` on ``text_or_ids`` and capture patterns, loss, top-5 and optional q/k.

    Parameters
    ----------
    text_or_ids : text (tokenised by :func:`tokenize_input`: a BOS only where the model expects one)
        or token ids, used exactly as given.
    qk_layers : layers whose post-rotary q and k vectors (``hook_rot_q``/``hook_rot_k``) are kept.
    store : when given, a stored run with the same key is loaded instead of recomputed, and a new
        run is stored.
    pattern_dtype : ``float16`` (half the memory and disk) or ``float32`` (bit-exact to eager).
    max_tokens, max_tokens_variable : the longest input taken, and what a refusal tells the user to
        set to change it (the page passes ``HEADSCOPE_MAX_TOKENS`` with its value).
    before_store : called with a newly computed run before it is written to ``store`` (a run found
        in the store is not passed): the Attention page draws its grid from it while the patterns,
        127 MB at 512 tokens, are written. What it raises stops the capture.
    """
    if pattern_dtype not in ("float16", "float32"):
        raise InputError("pattern_dtype must be float16 or float32")
    layers = sorted({int(layer) for layer in qk_layers})
    for layer in layers:
        check_layer(model.n_layers, layer)
    ids = tokenize_input(model, text_or_ids, max_tokens, variable=max_tokens_variable)
    text = text_or_ids if isinstance(text_or_ids, str) else None
    settings = {"pattern_dtype": pattern_dtype, "qk_layers": layers}
    if model.facts.windowed:  # per-layer sliding windows (entropy's visible keys); absent: all full
        settings["layer_windows"] = model.facts.run_windows()
    key = run_key(model, ids, settings)
    if (stored := stored_result(store, key, load_run, progress)) is not None:
        return stored

    patterns, q, k, predicted = _forward(model, ids, layers, np.dtype(pattern_dtype), progress)
    token_loss, top_ids, top_probs = predicted.token_loss, predicted.top_ids, predicted.top_probs
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
        top_ids=top_ids,
        top_probs=top_probs,
        q=q,
        k=k,
    )
    if progress:
        progress(1.0)  # computed (what is left is storing it): before before_store, which may report last
    if before_store is not None:
        before_store(run)
    if store is not None:
        save_run(store, run)
    return run


def _forward(model: LoadedModel, ids: list[int], layers: list[int], dtype: np.dtype,
             progress: Callable[[float], None] | None):
    """One forward pass over ``ids`` keeping every layer's attention pattern and the post-rotary q/k
    of ``layers``: ``(patterns [layer, head, N, N] in dtype, q, k (layer → [head, N, d_head]),
    predictions)``, the per-token loss and top-k from the final hidden state in chunks
    (:func:`headscope.analysis.token_predictions.token_predictions`: no ``[N, vocab]`` logits array).
    ``progress`` hears of each layer's pattern."""
    n = len(ids)
    patterns = np.empty((model.n_layers, model.n_heads, n, n), dtype=dtype)
    q: dict[int, np.ndarray] = {}
    k: dict[int, np.ndarray] = {}

    # rounded to the kept dtype by torch, then copied: numpy's own float32 → float16 cast is a scalar
    # loop (175 ms a layer at 515 tokens against 4-8 ms; over 30 layers, most of a page's Run), and
    # both round to nearest even, bit for bit
    kept_dtype = torch.float16 if dtype == np.float16 else torch.float32

    def keep_pattern(layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            patterns[layer] = tensor[0].detach().to(kept_dtype).cpu().numpy()  # rounded where it was computed
            if progress:
                progress((layer + 1) / (model.n_layers + 1))

        return hook

    def keep(target: dict[int, np.ndarray], layer: int):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            # [batch, pos, head, d_head] → [head, pos, d_head]
            target[layer] = tensor[0].detach().permute(1, 0, 2).contiguous().cpu().numpy().astype(np.float32)

        return hook

    hooks = [(get_act_name("pattern", layer), keep_pattern(layer)) for layer in range(model.n_layers)]
    for layer in layers:
        hooks.append((get_act_name("rot_q", layer), keep(q, layer)))
        hooks.append((get_act_name("rot_k", layer), keep(k, layer)))
    tokens_t = torch.tensor([ids], dtype=torch.long, device=model.device)
    with model.lock, torch.inference_mode(), final_hidden_state(model) as kept:
        last = model.bridge.run_with_hooks(tokens_t, fwd_hooks=hooks, return_type="logits", logits_to_keep=1)
    return patterns, q, k, token_predictions(model, kept.hidden, ids, last_logits=last[0, -1])


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
    record = stored_record(store, key, "run")
    if record is None:
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

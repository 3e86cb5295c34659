"""Query and key vectors of one attention head (or a whole layer) over a probe set of sentences.

AttentionViz (Yeh et al. 2023, "AttentionViz: A Global View of Transformer Attention") looks at the
queries and keys of one head pooled over many short inputs. This module produces those vectors:

- every sentence is run on its own (batched with right padding, which a causal model never sees:
  a token only attends to the tokens before it), with exactly its own token ids, after the BOS
  token when the model expects one (``model.facts``; the BOS is then a point like any token);
- for the chosen layer it keeps post-rotary queries and keys (``hook_rot_q``/``hook_rot_k``, what
  the attention logits are made of: ``logit[i, j] = scale · q_i · k_j`` with the layer's own scale,
  soft-capped and windowed as the layer does) and pre-rotary ones
  (``hook_q``/``hook_k``), shapes ``[batch, pos, head, d_head]`` and ``[batch, pos, kv_head, d_head]``;
- with grouped-query attention the keys of query head ``h`` are those of its key-value head
  ``h // (H / H_kv)`` (``LoadedModel.kv_head``);
- one layer is stored per probe set (content key: model digest, layer, token ids), so asking again,
  for any head of that layer, loads from the store instead of running the model.

The probe sets shipped with headscope live in ``data/probes``: ``sentences.txt`` (one sentence a line,
``#`` starts a comment) and ``features.json`` (labelled tasks for the QK decomposition, see
:func:`load_probe_tasks` and :mod:`headscope.analysis.qk_decomposition`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformer_lens.utilities import get_act_name

from headscope.analysis.attention_statistics import layer_mask
from headscope.analysis.errors import InputError, check_head, check_head_index, check_layer, parse_json
from headscope.analysis.models import LoadedModel
from headscope.analysis.paths import DATA_DIR
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import loaded_by_prefix, stored_record

PROBES_DIR = DATA_DIR / "probes"
SENTENCES_FILE = PROBES_DIR / "sentences.txt"
FEATURES_FILE = PROBES_DIR / "features.json"

QK_VERSION = 2  # 2: the layer's scale, soft-cap and window are stored with the vectors
MAX_POINTS = 20_000  # the default; the app passes headscope.analysis.limits.limit("HEADSCOPE_MAX_QK_POINTS")
"""Most points (queries + keys of one head) collected at once; UMAP/t-SNE past this take minutes."""
MAX_SENTENCE_TOKENS = 256
"""Longest probe sentence: probes are short inputs pooled in numbers, not long documents."""

Progress = Callable[[float], None] | None


# ---------------------------------------------------------------------------------------------
# Probe sets


def load_sentences(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Sentences of a probe file: one per line, blank lines and lines starting with ``#`` skipped.

    Parameters
    ----------
    path : a text file; default ``data/probes/sentences.txt`` (341 sentences written for headscope).
    limit : keep only the first ``limit`` sentences.
    """
    path = Path(path) if path is not None else SENTENCES_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"Cannot read the probe sentences {path}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise InputError(f"The probe file {path} is not UTF-8 text.") from None
    sentences = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    if not sentences:
        raise InputError(f"The probe file {path} has no sentences (one sentence per line).")
    return sentences[:limit] if limit is not None else sentences


@dataclass(frozen=True)
class ProbeTask:
    """One labelled probe task from ``features.json``.

    Attributes
    ----------
    kind : ``category`` (words of ``lexicon`` carry a category; the feature is "the key's word has
        the query's category"), ``same_token`` (the key is the query's token, earlier) or
        ``previous_token`` (the key is at position i-1 for the query at position i).
    lexicon : category name → words (``category`` tasks only).
    """

    name: str
    kind: str
    description: str
    sentences: list[str]
    lexicon: dict[str, list[str]] = field(default_factory=dict)


TASK_KINDS = ("category", "same_token", "previous_token")


def load_probe_tasks(path: str | Path | None = None) -> dict[str, ProbeTask]:
    """Labelled probe tasks (``data/probes/features.json`` by default), by name.

    The file is ``{"format": "headscope-probe-features/1", "tasks": [...]}``; each task has
    ``name``, ``kind`` (one of ``category``, ``same_token``, ``previous_token``), ``description``,
    and either ``sentences`` (a list) or ``sentences_file`` (a file next to the JSON); ``category``
    tasks also have ``lexicon``: ``{"colour": ["red", "green", ...], ...}``.

    Raises
    ------
    InputError
        The file is missing, is not JSON, or a task lacks a field; the message names the task.
    """
    path = Path(path) if path is not None else FEATURES_FILE
    try:
        doc = parse_json(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"Cannot read the probe tasks {path}: {e.strerror or e}.") from None
    except ValueError as e:
        raise InputError(f"The probe task file {path} is not valid JSON: {e}.") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list):
        raise InputError(f'{path} must be a JSON object with a "tasks" list.')
    tasks: dict[str, ProbeTask] = {}
    for n, t in enumerate(doc["tasks"]):
        where = f"{path.name}, task {n + 1}"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise InputError(f'{where}: every task needs a "name".')
        where = f"{path.name}, task {t['name']!r}"
        kind = t.get("kind")
        if kind not in TASK_KINDS:
            raise InputError(f"{where}: kind {kind!r} is not one of {', '.join(TASK_KINDS)}.")
        if "sentences_file" in t:
            sentences = load_sentences(path.parent / str(t["sentences_file"]))
        else:
            sentences = t.get("sentences")
            if not isinstance(sentences, list) or not sentences or not all(isinstance(s, str) for s in sentences):
                raise InputError(f'{where}: "sentences" must be a non-empty list of strings.')
        lexicon = t.get("lexicon") or {}
        if kind == "category":
            if not isinstance(lexicon, dict) or len(lexicon) < 2 or not all(
                isinstance(w, list) and w and all(isinstance(x, str) for x in w) for w in lexicon.values()
            ):
                raise InputError(f'{where}: a category task needs a "lexicon" of at least two categories, '
                                 'each a non-empty list of words.')
        tasks[t["name"]] = ProbeTask(t["name"], kind, str(t.get("description", "")), list(sentences),
                                     {str(c): list(w) for c, w in lexicon.items()})
    return tasks


# ---------------------------------------------------------------------------------------------
# Collected vectors


@dataclass
class QKSet:
    """Queries and keys of every head of one layer over a probe set (one row per token).

    Attributes
    ----------
    q_rot, q_pre : ``[token, head, d_head]`` post-/pre-rotary queries of every query head.
    k_rot, k_pre : ``[token, kv_head, d_head]`` post-/pre-rotary keys of every key-value head.
    token_ids, positions, sentence_index : ``[token]`` the token, its position in its sentence
        (0-based, the position the model saw) and the sentence it belongs to.
    offsets : ``[sentence + 1]`` sentence ``s`` owns rows ``offsets[s]:offsets[s + 1]``.
    char_spans : ``[token, 2]`` start and end character of each token in its sentence (a leading
        space belongs to the token), for labelling words.
    scale, softcap, window : the layer's logit scale (Gemma: ``query_pre_attn_scalar ** -0.5``),
        soft-cap (Gemma 2; None) and sliding window (0: none), from
        :func:`headscope.analysis.attention_statistics.layer_mask`.
    """

    key: str
    model_name: str
    model_digest: str
    layer: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    scale: float
    softcap: float | None
    window: int
    sentences: list[str]
    tokens: list[str]
    token_ids: np.ndarray
    positions: np.ndarray
    sentence_index: np.ndarray
    offsets: np.ndarray
    char_spans: np.ndarray
    q_rot: np.ndarray
    k_rot: np.ndarray
    q_pre: np.ndarray
    k_pre: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def kv_head(self, head: int) -> int:
        """The key-value head that query head ``head`` reads: ``head // (H / H_kv)``."""
        return head // (self.n_heads // self.n_kv_heads)

    def head(self, head: int, rotary: bool = True) -> HeadQK:
        """One query head's queries and the keys of its key-value group.

        Parameters
        ----------
        rotary : ``True`` (default): post-rotary vectors, whose dot product is the attention logit.
            ``False``: pre-rotary ones (``hook_q``/``hook_k``), what ``W_Q``/``W_K`` produce before
            the position-dependent rotation; their dot product is *not* the logit.
        """
        head = check_head(self.n_heads, head, self.layer)
        kv = self.kv_head(head)
        q_rot = np.ascontiguousarray(self.q_rot[:, head, :], dtype=np.float32)
        k_rot = np.ascontiguousarray(self.k_rot[:, kv, :], dtype=np.float32)
        if rotary:
            q, k = q_rot, k_rot
        else:
            q = np.ascontiguousarray(self.q_pre[:, head, :], dtype=np.float32)
            k = np.ascontiguousarray(self.k_pre[:, kv, :], dtype=np.float32)
        return HeadQK(
            layer=self.layer, head=head, kv_head=kv, rotary=rotary, q=q, k=k, q_rot=q_rot, k_rot=k_rot,
            token_ids=np.asarray(self.token_ids), tokens=self.tokens, positions=np.asarray(self.positions),
            sentence_index=np.asarray(self.sentence_index), offsets=np.asarray(self.offsets),
            char_spans=np.asarray(self.char_spans), sentences=self.sentences, source_key=self.key,
            model_name=self.model_name, scale=self.scale, softcap=self.softcap, window=self.window,
        )


@dataclass
class HeadQK:
    """Queries of one head and the keys it reads, one row per probe token.

    ``q[i]`` and ``k[i]`` belong to the same token ``i``; attention only runs within a sentence and
    causally: query ``i`` sees keys ``j`` of its own sentence with ``positions[j] <= positions[i]``.
    ``q_rot``/``k_rot`` are always the post-rotary vectors (used for attention); ``q``/``k`` are the
    space chosen for analysis (post-rotary by default, the same arrays). ``scale``, ``softcap`` and
    ``window`` are the layer's (see :class:`QKSet`): :meth:`scores` applies them as the model does.
    """

    layer: int
    head: int
    kv_head: int
    rotary: bool
    q: np.ndarray
    k: np.ndarray
    q_rot: np.ndarray
    k_rot: np.ndarray
    token_ids: np.ndarray
    tokens: list[str]
    positions: np.ndarray
    sentence_index: np.ndarray
    offsets: np.ndarray
    char_spans: np.ndarray
    sentences: list[str]
    scale: float
    softcap: float | None = None
    window: int = 0
    source_key: str = ""
    model_name: str = ""

    @property
    def n_tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def n_points(self) -> int:
        """Points in a joint embedding: one query and one key per token."""
        return 2 * self.n_tokens

    @property
    def d_head(self) -> int:
        return int(self.q.shape[1])

    @property
    def q_norm(self) -> np.ndarray:
        return np.linalg.norm(self.q, axis=1)

    @property
    def k_norm(self) -> np.ndarray:
        return np.linalg.norm(self.k, axis=1)

    def rows(self, sentence: int) -> slice:
        """The token rows of sentence ``sentence``."""
        if not 0 <= sentence < len(self.sentences):
            raise InputError(f"Sentence {sentence} is out of range: the probe set has {len(self.sentences)}.")
        return slice(int(self.offsets[sentence]), int(self.offsets[sentence + 1]))

    def logits(self, sentence: int) -> np.ndarray:
        """``[query, key]`` attention logits of one sentence (post-rotary vectors, exactly what the
        model's softmax sees): :meth:`scores` of its queries and keys."""
        r = self.rows(sentence)
        return self.scores(self.q_rot[r], self.k_rot[r])

    def scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """``[query, key]`` logits of one sentence's queries ``q`` and keys ``k`` (rows = positions
        0..m−1): ``s_ij = scale · q_i · k_j``, soft-capped to ``c · tanh(s_ij / c)`` when the layer
        caps, ``-inf`` for ``j > i`` and, with a sliding window ``W``, for ``j ≤ i − W``."""
        s = np.asarray(q, dtype=np.float64) @ np.asarray(k, dtype=np.float64).T * self.scale
        if self.softcap is not None:
            s = self.softcap * np.tanh(s / self.softcap)
        s[np.triu_indices(s.shape[0], 1)] = -np.inf
        if self.window:
            s[np.tril_indices(s.shape[0], -self.window)] = -np.inf
        return s

    def attention(self, sentence: int) -> np.ndarray:
        """``[query, key]`` post-softmax attention of this head on one sentence (rows sum to 1)."""
        return causal_softmax(self.logits(sentence))

    def subset(self, sentences: Sequence[int]) -> HeadQK:
        """The same head restricted to some sentences (renumbered 0..len-1 in the given order)."""
        idx = [int(s) for s in sentences]
        rows = np.concatenate([np.arange(self.offsets[s], self.offsets[s + 1]) for s in idx]) if idx else np.zeros(0, int)
        lengths = [int(self.offsets[s + 1] - self.offsets[s]) for s in idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        sent_index = np.repeat(np.arange(len(idx)), lengths).astype(np.int32)
        same = self.q is self.q_rot
        q_rot, k_rot = self.q_rot[rows], self.k_rot[rows]
        return HeadQK(
            layer=self.layer, head=self.head, kv_head=self.kv_head, rotary=self.rotary,
            q=q_rot if same else self.q[rows], k=k_rot if same else self.k[rows], q_rot=q_rot, k_rot=k_rot,
            token_ids=self.token_ids[rows], tokens=[self.tokens[i] for i in rows],
            positions=self.positions[rows], sentence_index=sent_index, offsets=offsets,
            char_spans=self.char_spans[rows], sentences=[self.sentences[s] for s in idx], source_key=self.source_key, model_name=self.model_name,
            scale=self.scale, softcap=self.softcap, window=self.window,
        )

    def point_table(self) -> dict[str, list[Any]]:
        """Metadata of the ``2 n`` joint-embedding points, queries first then keys (column lists)."""
        n = self.n_tokens
        return {
            "kind": ["query"] * n + ["key"] * n,
            "token_index": list(range(n)) * 2,
            "token": list(self.tokens) * 2,
            "position": self.positions.tolist() * 2,
            "sentence": self.sentence_index.tolist() * 2,
            "text": [self.sentences[s] for s in self.sentence_index.tolist()] * 2,
            "norm": self.q_norm.tolist() + self.k_norm.tolist(),
        }


def causal_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``[query, key]`` logits whose masked entries are ``-inf``."""
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Collection


def _tokenize(model: LoadedModel, sentences: Sequence[str]) -> tuple[list[list[int]], list[np.ndarray]]:
    if not sentences:
        raise InputError("The probe set is empty: give at least one sentence.")
    ids: list[list[int]] = []
    spans: list[np.ndarray] = []
    for n, s in enumerate(sentences):
        if not isinstance(s, str) or not s.strip():
            raise InputError(f"Sentence {n + 1} is empty; remove it or write some text.")
        t = model.input_ids(s)  # after the BOS the model expects, if any (model.facts)
        plain = t[1:] if len(t) > len(model.encode(s)) else t
        if not plain:
            raise InputError(f"Sentence {n + 1} has no tokens.")
        if len(t) > min(MAX_SENTENCE_TOKENS, model.n_ctx):
            raise InputError(
                f"Sentence {n + 1} has {len(t)} tokens; probe sentences are limited to "
                f"{min(MAX_SENTENCE_TOKENS, model.n_ctx)}. Split it into shorter sentences."
            )
        ids.append(t)
        chars = _char_spans(model, s, plain)
        spans.append(chars if len(plain) == len(t) else np.vstack([np.zeros((1, 2), np.int32), chars]))  # BOS: no text
    return ids, spans


def _char_spans(model: LoadedModel, text: str, ids: list[int]) -> np.ndarray:
    """``[token, 2]`` character span of each token in ``text`` (a leading space belongs to its token)."""
    tok = model.tokenizer
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            return np.asarray(enc["offset_mapping"], dtype=np.int32).reshape(-1, 2)
    ends = [len(tok.decode(ids[: i + 1], clean_up_tokenization_spaces=False)) for i in range(len(ids))]
    starts = [0, *ends[:-1]]
    return np.asarray(list(zip(starts, ends, strict=True)), dtype=np.int32).reshape(-1, 2)


def _check_points(n_tokens: int, n_sentences: int, max_points: int) -> None:
    if 2 * n_tokens > max_points:
        per = n_tokens / n_sentences
        keep = max(1, int(max_points / 2 / per))
        raise InputError(
            f"The probe set has {n_tokens:,} tokens, i.e. {2 * n_tokens:,} query and key points per head, "
            f"over the limit of {max_points:,}. Use fewer sentences (about {keep:,} of these "
            f"{n_sentences:,}), or raise the limit (HEADSCOPE_MAX_QK_POINTS in the app)."
        )


def layer_key(model: LoadedModel, layer: int, token_ids: Sequence[Sequence[int]]) -> str:
    """Content key of one layer's q/k over a probe set: model digest + layer + token ids."""
    return content_key("qk_points", QK_VERSION, model.digest, int(layer), [list(map(int, t)) for t in token_ids])


def collect_layers(
    model: LoadedModel,
    sentences: Sequence[str] | None = None,
    layers: Sequence[int] = (0,),
    *,
    store: Store | None = None,
    max_points: int = MAX_POINTS,
    batch_size: int = 32,
    progress: Progress = None,
) -> dict[int, QKSet]:
    """Collect queries and keys of every head of some layers over a probe set, in one pass.

    Each sentence is run separately (token ids as encoded, after the BOS the model expects if any),
    batched with right padding (exact for a causal model), and the forward pass stops after the
    deepest layer asked for.
    Pre-rotary (``hook_q``, ``hook_k``) and post-rotary (``hook_rot_q``, ``hook_rot_k``) vectors are
    kept; a model without rotary embeddings has identical pre and post vectors.

    Parameters
    ----------
    sentences : the probe set; default :func:`load_sentences` (``data/probes/sentences.txt``).
    layers : layers to keep. Each is stored as its own record, so later requests for any head of
        a layer load from ``store`` and run nothing.
    max_points : limit on ``2 × tokens`` (the points of one head's joint embedding).
    progress : called with the fraction done (0..1) after each batch.

    Returns
    -------
    layer → :class:`QKSet`.

    Raises
    ------
    InputError
        Empty or over-long sentences, a layer out of range, more points than ``max_points``.
    """
    if isinstance(sentences, str):
        raise InputError("Pass a list of sentences, not one string (split it into sentences first).")
    sentences = list(load_sentences() if sentences is None else sentences)
    layers = sorted({int(layer) for layer in layers})
    if not layers:
        raise InputError("Name at least one layer to collect.")
    for layer in layers:
        check_layer(model.n_layers, layer)
    if max_points < 2:
        raise InputError("max_points must be at least 2.")
    ids, spans = _tokenize(model, sentences)
    _check_points(sum(map(len, ids)), len(ids), max_points)

    keys = {layer: layer_key(model, layer, ids) for layer in layers}
    out = _stored_layers(store, keys)
    todo = [layer for layer in layers if layer not in out]
    if not todo:
        if progress:
            progress(1.0)
        return out
    vectors = _run_probes(model, ids, todo, batch_size, progress)
    for layer, qk in _qk_sets(model, sentences, ids, spans, keys, vectors).items():
        if store is not None:
            _save(store, qk)
        out[layer] = qk
    return out


def _stored_layers(store: Store | None, keys: dict[int, str]) -> dict[int, QKSet]:
    """The layers of ``keys`` (layer → content key) already in ``store``."""
    out: dict[int, QKSet] = {}
    if store is not None:
        for layer, key in keys.items():
            got = _load(store, key)
            if got is not None:
                out[layer] = got
    return out


def _run_probes(model: LoadedModel, ids: list[list[int]], layers: list[int], batch_size: int,
                progress: Progress) -> dict[int, dict[str, np.ndarray]]:
    """Run the probe sentences ``ids`` through ``model`` and keep the q/k vectors of ``layers``.

    Returns layer → {``q_rot``, ``k_rot``, ``q_pre``, ``k_pre``}, each ``[token, head, d_head]``
    (queries: every query head; keys: every key-value head), the sentences' tokens one after the
    other. Batches of similar lengths, right-padded; the pass stops after the deepest layer.
    """
    lengths = np.array([len(t) for t in ids])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n, H, G, d = int(offsets[-1]), model.n_heads, model.n_kv_heads, model.d_head
    buf = {
        layer: {"q_rot": np.empty((n, H, d), np.float32), "k_rot": np.empty((n, G, d), np.float32),
                "q_pre": np.empty((n, H, d), np.float32), "k_pre": np.empty((n, G, d), np.float32)}
        for layer in layers
    }
    current: list[int] = []  # the sentences of the batch being run, in batch order

    def keep(layer: int, target: str):
        def hook(tensor: torch.Tensor, hook: Any = None) -> None:
            t = tensor.detach().to(torch.float32).cpu().numpy()  # [batch, pos, head, d]
            for b, s in enumerate(current):
                buf[layer][target][offsets[s]: offsets[s + 1]] = t[b, : lengths[s]]

        return hook

    hook_names = set(model.bridge.hook_dict) if hasattr(model.bridge, "hook_dict") else set()
    hooks = []
    for layer in layers:
        hooks += [(_rotary_hook_name(hook_names, "rot_q", layer), keep(layer, "q_rot")),
                  (_rotary_hook_name(hook_names, "rot_k", layer), keep(layer, "k_rot")),
                  (get_act_name("q", layer), keep(layer, "q_pre")), (get_act_name("k", layer), keep(layer, "k_pre"))]
    order = np.argsort(-lengths, kind="stable")  # similar lengths share a batch: little padding
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    batches = [order[s: s + batch_size] for s in range(0, len(order), batch_size)]
    stop = max(layers) + 1
    for done, batch in enumerate(batches):
        current[:] = [int(s) for s in batch]
        width = int(lengths[batch].max())
        tokens = torch.full((len(batch), width), int(pad), dtype=torch.long, device=model.device)
        for b, s in enumerate(current):
            tokens[b, : lengths[s]] = torch.tensor(ids[s], dtype=torch.long)
        with model.lock, torch.inference_mode():
            model.bridge.run_with_hooks(
                tokens, fwd_hooks=hooks, return_type=None,
                stop_at_layer=stop if stop < model.n_layers else None,
            )
        if progress:
            progress((done + 1) / len(batches))
    return buf


def _rotary_hook_name(hook_names: set[str], kind: str, layer: int) -> str:
    """The hook of ``kind`` (``rot_q``/``rot_k``) in ``layer``; when the model has no such hook
    (``hook_names``: its hooks), no rotary embedding: the pre-rotary hook (post == pre)."""
    name = get_act_name(kind, layer)
    if hook_names and name not in hook_names:
        return get_act_name(kind[4:], layer)
    return name


def _qk_sets(model: LoadedModel, sentences: list[str], ids: list[list[int]], spans: list[np.ndarray],
             keys: dict[int, str], vectors: dict[int, dict[str, np.ndarray]]) -> dict[int, QKSet]:
    """One :class:`QKSet` per layer of ``vectors``: its q/k vectors with the tokens they belong to."""
    lengths = np.array([len(t) for t in ids])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(m) for m in lengths]).astype(np.int32)
    sentence_index = np.repeat(np.arange(len(ids)), lengths).astype(np.int32)
    token_ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in ids])
    char_spans = np.concatenate(spans).astype(np.int32)
    tokens = model.token_strings(token_ids.tolist())
    masks = {layer: layer_mask(model.bridge.blocks[layer].attn.original_component) for layer in vectors}
    return {
        layer: QKSet(
            key=keys[layer], model_name=model.name, model_digest=model.digest, layer=layer,
            n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, d_head=model.d_head, sentences=sentences,
            scale=masks[layer].scale, softcap=masks[layer].softcap, window=masks[layer].window,
            tokens=tokens, token_ids=token_ids, positions=positions, sentence_index=sentence_index,
            offsets=offsets, char_spans=char_spans, **arrays,
        )
        for layer, arrays in vectors.items()
    }


def collect_layer(
    model: LoadedModel,
    sentences: Sequence[str] | None = None,
    layer: int = 0,
    *,
    store: Store | None = None,
    max_points: int = MAX_POINTS,
    batch_size: int = 32,
    progress: Progress = None,
) -> QKSet:
    """Queries and keys of every head of one layer over a probe set (see :func:`collect_layers`)."""
    return collect_layers(model, sentences, [layer], store=store, max_points=max_points,
                          batch_size=batch_size, progress=progress)[int(layer)]


def collect_head(
    model: LoadedModel,
    sentences: Sequence[str] | None = None,
    layer: int = 0,
    head: int = 0,
    *,
    rotary: bool = True,
    store: Store | None = None,
    max_points: int = MAX_POINTS,
    batch_size: int = 32,
    progress: Progress = None,
) -> HeadQK:
    """Queries of query head ``head`` of ``layer`` and the keys of its key-value group, over a probe set.

    AttentionViz (Yeh et al. 2023) pools one head's queries ``q_i`` and keys ``k_j`` over many inputs;
    here ``logit[i, j] = scale · q_i · k_j`` (the layer's scale, soft-cap and window applied) within
    each sentence (post-rotary vectors).
    The whole layer is collected and stored (one forward pass gives every head), so switching heads
    of a layer is instant.

    Parameters
    ----------
    rotary : post-rotary (default) or pre-rotary (``hook_q``/``hook_k``) vectors for analysis;
        attention (:meth:`HeadQK.attention`) always uses the post-rotary ones.

    Raises
    ------
    InputError
        A layer or head out of range, more than ``max_points`` points, empty or over-long sentences.
    """
    layer, head = check_head_index(model.n_layers, model.n_heads, layer, head)
    return collect_layer(model, sentences, layer, store=store, max_points=max_points,
                         batch_size=batch_size, progress=progress).head(head, rotary=rotary)


_ARRAYS = ("q_rot", "k_rot", "q_pre", "k_pre", "token_ids", "positions", "sentence_index", "offsets", "char_spans")


def _save(store: Store, qk: QKSet) -> None:
    meta = {
        "model_name": qk.model_name, "model_digest": qk.model_digest, "layer": qk.layer,
        "n_heads": qk.n_heads, "n_kv_heads": qk.n_kv_heads, "d_head": qk.d_head,
        "scale": qk.scale, "softcap": qk.softcap, "window": qk.window,
        "sentences": qk.sentences, "tokens": qk.tokens, "qk_version": QK_VERSION,
    }
    store.put(qk.key, "qk_points", meta, {a: getattr(qk, a) for a in _ARRAYS})


def _load(store: Store, key: str) -> QKSet | None:
    record = stored_record(store, key, "qk_points")
    if record is None:
        return None
    m = record.meta
    try:
        arrays = {a: record.array(a) for a in _ARRAYS}
    except Exception:  # a corrupt or incomplete record is recomputed, never served
        store.remove(key)
        return None
    return QKSet(
        key=key, model_name=m["model_name"], model_digest=m["model_digest"], layer=m["layer"],
        n_heads=m["n_heads"], n_kv_heads=m["n_kv_heads"], d_head=m["d_head"], sentences=m["sentences"],
        tokens=m["tokens"], scale=float(m["scale"]), softcap=m["softcap"], window=int(m["window"]), **arrays,
    )


def store_sentences(store: Store, sentences: Sequence[str], filename: str = "") -> str:
    """Keep a user's own probe sentences (they replace the built-in set); returns their key."""
    sentences = [str(t) for t in sentences]
    key = content_key("qk_sentences", sentences)
    store.put(key, "qk_sentences", {"sentences": sentences, "filename": filename}, {})
    return key


def stored_sentences(store: Store, key: str) -> list[str]:
    """Probe sentences stored by :func:`store_sentences` under ``key`` (or its prefix); an
    ``InputError`` when there are none."""
    found = loaded_by_prefix(store, key, partial(stored_record, kind="qk_sentences"))
    if found is None:
        raise InputError(f"No uploaded probe set has the id {key!r}: upload it again.")
    return list(found[1].meta["sentences"])

"""Circuits over heads, as a user asks for them: a text and two answers → what each head writes towards the
answer (direct logit attribution) and which earlier heads feed which (composition scores); one head's score
at a (query, key) cell → what builds it (QK attribution). Stored, so a page, a link and ``headscope figure``
read the same numbers back.

The numbers are those of :mod:`headscope.analysis.logit_attribution` (Elhage et al. 2021; Wang et al. 2022,
arXiv:2211.00593, §3.1), :mod:`headscope.analysis.composition` (Elhage et al. 2021, §"Composition") and
:mod:`headscope.analysis.qk_attribution`; this module adds only the store and the checks of what a user types:

- :func:`circuits`: the Circuits page's *Run* and ``headscope circuits``. Direct logit attribution at the
  last position (one hooked forward pass) stored under a key of the model digest, the token ids and the two
  answers; composition scores from the weights, stored once per model digest (:func:`stored_composition`:
  about 20-40 s on the embedded model on two CPU cores, read back in milliseconds afterwards).
- with a corrupted text (the Circuits page's *corrupted* field, ``headscope circuits --corrupted``),
  :func:`circuits` also runs edge attribution patching (:mod:`headscope.analysis.edge_attribution`, Syed et
  al. 2023: one forward and one backward pass on the clean text, one forward pass on the corrupted one) and
  stores every edge's score beside the attribution (:func:`load_edges`: names once, edges as index arrays).
- :func:`patch_edge`: a click on an edge of the Circuits page's graph. The exact effect of one head → head
  edge on the stored pair by path patching (:func:`headscope.analysis.path_patching.path_patching`, Wang et
  al. 2022), in the sign of edge attribution, beside the edge's stored estimate; stored under a key of the
  result and the edge.
- :func:`explain`: ``headscope explain``. The QK attribution of one cell, stored with its key.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headscope.analysis.answer_tokens import answer_id
from headscope.analysis.composition import KINDS, CompositionScores, composition_scores
from headscope.analysis.errors import InputError
from headscope.analysis.logit_attribution import LogitAttribution, direct_logit_attribution
from headscope.analysis.models import LoadedModel
from headscope.analysis.qk_attribution import QKAttribution, qk_attribution
from headscope.analysis.residual_components import LIMIT, check_tokens
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result

CIRCUITS_VERSION = 1
Progress = Callable[[float], None] | None


@dataclass
class CircuitResult:
    """Direct logit attribution of a text's last position for two answers, and the key of the model's
    composition scores (:func:`load_composition`)."""

    key: str
    attribution: LogitAttribution
    token_ids: list[int]
    tokens: list[str]
    answer_tokens: tuple[str, str]
    composition_key: str
    seconds: float
    edges_key: str | None = None
    """The key of the stored edge attribution (:func:`load_edges`), when a corrupted text was given."""


@dataclass
class StoredEdges:
    """Every edge of an edge attribution (:class:`headscope.analysis.edge_attribution.EdgeAttribution`) as
    stored, sorted by ``|score|``, largest first."""

    senders: list[str]
    receivers: list[str]
    sites: list[str]
    scores: np.ndarray
    clean: float
    corrupted: float
    corrupted_ids: list[int]
    seconds: float

    def rows(self, top: int | None = None) -> list[tuple[str, str, str, float]]:
        n = len(self.scores) if top is None else min(top, len(self.scores))
        return [(self.senders[i], self.receivers[i], self.sites[i], float(self.scores[i])) for i in range(n)]


@dataclass
class EdgePatch:
    """One edge of a stored edge attribution, path-patched exactly (:func:`patch_edge`).

    ``exact`` is ``m(clean with the edge corrupted) − m(clean)`` (logit difference, the sign of edge attribution),
    ``estimate`` the edge's stored edge-attribution score (None when the edge is not among the stored ones),
    ``clean`` and ``patched`` the metric on the clean prompt and with the edge corrupted."""

    key: str
    sender: str
    receiver: str
    site: str
    exact: float
    estimate: float | None
    clean: float
    patched: float
    seconds: float


@dataclass
class ExplainedCell:
    """The QK attribution of one cell (:func:`headscope.analysis.qk_attribution.qk_attribution`) and its key."""

    key: str
    attribution: QKAttribution
    token_ids: list[int]
    tokens: list[str]


def text_ids(model: LoadedModel, text: str | Sequence[int]) -> list[int]:
    """The ids the model sees for ``text`` (the BOS it expects added), within ``HEADSCOPE_MAX_TOKENS``."""
    from headscope.analysis.capture import tokenize_input
    from headscope.analysis.limits import limit

    if not isinstance(text, str):
        check_tokens(model, text)  # ids are said in the attributions' words (whole numbers, vocabulary, limit)
    return tokenize_input(model, text, limit(LIMIT))


def composition_key(model: LoadedModel) -> str:
    """The store key of the model's composition scores: its digest alone (they depend on the weights only)."""
    return content_key("composition", CIRCUITS_VERSION, model.digest)


def load_composition(store: Store, key: str) -> CompositionScores | None:
    """The stored composition scores under ``key``, or None."""
    record = stored_record(store, key, "composition")
    if record is None:
        return None
    return CompositionScores(**{kind: record.array(kind, mmap=False) for kind in KINDS})


def stored_composition(model: LoadedModel, store: Store | None, progress: Progress = None) -> CompositionScores:
    """:func:`headscope.analysis.composition.composition_scores` of ``model``, computed once per model digest
    and kept in ``store`` (float32: the scores lie in [0, 1] and are compared with each other, not summed)."""
    key = composition_key(model)
    if (found := stored_result(store, key, load_composition, progress)) is not None:
        return found
    scores = composition_scores(model)
    if store is not None:
        store.put(key, "composition", {"model_digest": model.digest, "version": CIRCUITS_VERSION},
                  {kind: scores.of(kind).astype(np.float32) for kind in KINDS})
        found = load_composition(store, key)
    if progress:
        progress(1.0)
    return found if found is not None else scores


def circuits_key(model: LoadedModel, ids: Sequence[int], answer: int, wrong: int,
                 corrupted: Sequence[int] | None = None) -> str:
    extra = [] if corrupted is None else [list(corrupted)]  # the key of a run without edges is as it always was
    return content_key("circuits", CIRCUITS_VERSION, model.digest, list(ids), answer, wrong, *extra)


def corrupted_ids(model: LoadedModel, ids: Sequence[int], corrupted: str | Sequence[int] | None) -> list[int] | None:
    """The corrupted text's ids (None when none is given); an :class:`InputError` that says what to change when
    it is not as long as the clean text in tokens, or is the clean text itself (every edge would score 0)."""
    if corrupted is None or (isinstance(corrupted, str) and not corrupted.strip()):
        return None
    try:
        bad = text_ids(model, corrupted)
    except InputError as e:
        raise InputError(f"The corrupted text: {e}") from None
    if len(bad) != len(ids):
        raise InputError(f"The corrupted text is {len(bad)} token{'s' * (len(bad) != 1)} and the text is {len(ids)}: "
                         "edge attribution "
                         "compares the two position by position, so they need the same number of tokens. Change "
                         "only words of the same token length (e.g. one name for another).")
    if list(bad) == list(ids):
        raise InputError("The corrupted text has the same tokens as the text: every edge would score 0. Change "
                         "a word that decides the answer (e.g. the repeated name).")
    return bad


def stored_edges(model: LoadedModel, ids: Sequence[int], bad: Sequence[int], answers: tuple[int, int],
                 store: Store | None) -> str:
    """Edge attribution of the pair ``(ids, bad)`` for ``answers`` (token ids), stored; returns its key
    (computed only when the store lacks it)."""
    from headscope.analysis.edge_attribution import edge_attribution

    key = content_key("circuit-edges", CIRCUITS_VERSION, model.digest, list(ids), list(bad), *answers)
    if store is not None and load_edges(store, key) is not None:
        return key
    started = time.perf_counter()
    edges = edge_attribution(model, list(ids), list(bad), list(answers))
    if store is not None:
        arrays, meta = {"scores": np.asarray(edges.scores, dtype=np.float64)}, {}
        for field in ("senders", "receivers", "sites"):
            names, index = np.unique(np.array(getattr(edges, field), dtype=object).astype(str), return_inverse=True)
            meta[field] = names.tolist()
            arrays[field] = index.astype(np.int32)
        meta.update({"clean": edges.clean, "corrupted": edges.corrupted, "corrupted_ids": list(bad),
                     "seconds": time.perf_counter() - started, "version": CIRCUITS_VERSION})
        store.put(key, "circuit_edges", meta, arrays)
    return key


def load_edges(store: Store, key: str) -> StoredEdges | None:
    """The stored edges under ``key``, or None."""
    record = stored_record(store, key, "circuit_edges")
    if record is None:
        return None
    m = record.meta
    named = [np.array(m[f], dtype=object)[record.array(f, mmap=False)].tolist() for f in ("senders", "receivers", "sites")]
    return StoredEdges(*named, record.array("scores", mmap=False), float(m["clean"]), float(m["corrupted"]),
                       list(m["corrupted_ids"]), float(m["seconds"]))


def circuits(model: LoadedModel, text: str | Sequence[int], answers: Sequence[str | int], store: Store | None = None,
             progress: Progress = None, composition: bool = True,
             corrupted: str | Sequence[int] | None = None) -> CircuitResult:
    """Direct logit attribution of ``answers[0]`` over ``answers[1]`` at the text's last position, stored, and
    the model's composition scores, stored once per model (module docstring).

    Parameters
    ----------
    model : the model.
    text : the text (the BOS the model expects is added) or token ids as given.
    answers : two answers, each one token as it follows the text (``" Mary"``, ``" John"``) or a token id
        (:func:`headscope.analysis.answer_tokens.answer_id`, as patching takes them).
    store : where the result is kept and looked up (None: computed, not kept).
    progress : hears 0.1 once the attribution is done, 1.0 at the end.
    composition : also the composition scores (``False``: the attribution alone).
    corrupted : a corrupted text of the same token length (None or empty: no edges): also the edge
        attribution of every sender → receiver edge on the pair (``edges_key``, :func:`load_edges`).

    Returns
    -------
    CircuitResult
        ``attribution.values`` sum to ``attribution.logit_diff``, the model's own (else :class:`InputError`).
    """
    if isinstance(answers, str) or len(answers) != 2:
        raise InputError("Give two answers: the one the text should lead to, then the one it is compared with.")
    ids = text_ids(model, text)
    answer, wrong = (answer_id(model, answers[0], "first", "direct logit attribution"),
                     answer_id(model, answers[1], "second", "direct logit attribution"))
    if answer == wrong:
        raise InputError(f"The two answers are the same token {answers[0]!r}: their logit difference is 0. "
                         "Give two different answers.")
    bad = corrupted_ids(model, ids, corrupted)
    key = circuits_key(model, ids, answer, wrong, bad)
    started = time.perf_counter()
    result = load_circuits(store, key) if store is not None else None
    if result is None:
        attribution = direct_logit_attribution(model, ids, answer, wrong)
        result = CircuitResult(key, attribution, ids, model.token_strings(ids),
                               tuple(model.token_strings([answer, wrong])), composition_key(model),
                               time.perf_counter() - started)
        if bad is not None:
            result.edges_key = stored_edges(model, ids, bad, (answer, wrong), store)
            result.seconds = time.perf_counter() - started
        if store is not None:
            save_circuits(store, result)
    if progress:
        progress(0.1)
    if composition:
        stored_composition(model, store)
    if progress:
        progress(1.0)
    return result


def save_circuits(store: Store, result: CircuitResult) -> None:
    a = result.attribution
    meta = {"names": a.names, "logit_diff": a.logit_diff, "answer": a.answer, "wrong": a.wrong,
            "position": a.position, "n_layers": a.n_layers, "n_heads": a.n_heads, "token_ids": result.token_ids,
            "tokens": result.tokens, "answer_tokens": list(result.answer_tokens),
            "composition_key": result.composition_key, "seconds": result.seconds, "edges_key": result.edges_key,
            "version": CIRCUITS_VERSION}
    store.put(result.key, "circuits", meta, {"values": np.asarray(a.values, dtype=np.float64)})


def load_circuits(store: Store, key: str) -> CircuitResult | None:
    """The stored :class:`CircuitResult` under ``key``, or None."""
    record = stored_record(store, key, "circuits")
    if record is None:
        return None
    m = record.meta
    attribution = LogitAttribution(names=list(m["names"]), values=record.array("values", mmap=False),
                                   logit_diff=float(m["logit_diff"]), answer=int(m["answer"]), wrong=int(m["wrong"]),
                                   position=int(m["position"]), n_layers=int(m["n_layers"]), n_heads=int(m["n_heads"]))
    return CircuitResult(key, attribution, list(m["token_ids"]), list(m["tokens"]), tuple(m["answer_tokens"]),
                         str(m["composition_key"]), float(m["seconds"]), m.get("edges_key"))


EDGE_NAME = re.compile(r"(0|[1-9]\d{0,3})\.(0|[1-9]\d{0,3})")  # as edges name heads: no sign, no leading 0
EXACT_SITES = ("q", "k", "v")


def not_exact(sender: str, receiver: str, site: str) -> str | None:
    """Why the edge ``sender → receiver (site)`` of an edge attribution has no exact path patch (one line), or
    None when it has one: :func:`headscope.analysis.path_patching.path_patching` patches head outputs into a
    later head's query, key or value, so the embedding and MLP senders and the logits receiver are left out."""
    if sender == "embed" or sender.startswith("mlp.") or receiver == "logits" or site == "logits":
        return (f"The edge {sender} → {receiver} ({site}) cannot be patched exactly: path patching sends from a "
                "head into a later head's query, key or value, not from the embedding or an MLP, nor into the "
                "logits. Its edge-attribution estimate is the score in the graph.")
    return None


def _edge_head(name: Any, what: str) -> tuple[int, int]:
    match = EDGE_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise InputError(f"The {what} {str(name)[:40]!r} is not a head: an edge joins heads named layer.head "
                         "(e.g. 3.7). Click an edge of the graph.")
    return int(match[1]), int(match[2])


def edge_patch_key(result: CircuitResult, sender: str, receiver: str, site: str) -> str:
    return content_key("edge-patch", CIRCUITS_VERSION, result.key, result.edges_key, sender, receiver, site)


def patch_edge(model: LoadedModel, result: CircuitResult, sender: str, receiver: str, site: str,
               store: Store | None, progress: Progress = None) -> EdgePatch:
    """The exact effect of the edge ``sender → receiver (site)`` on the pair of ``result``'s edge attribution,
    stored under a key of the result and the edge (a second call reads it back).

    Path patching (Wang et al. 2022, arXiv:2211.00593, :func:`headscope.analysis.path_patching.path_patching`)
    noising, with the MLPs frozen: the clean prompt receives, the sender's output on the corrupted prompt
    reaches only the receiver's ``site`` input, directly. ``exact = raw − clean`` is then the quantity edge
    attribution estimates to first order (:mod:`headscope.analysis.edge_attribution`: ``m(clean with the edge
    corrupted) − m(clean)``), as ``bench/edge_attribution_vs_path_patching.py`` compares them.

    Parameters
    ----------
    result : a stored :class:`CircuitResult` with edges (``edges_key``: it was run with a corrupted text).
    sender : a head ``L.H`` (a query head).
    receiver : a later head ``L.H``: a query head for ``q``, a key-value head for ``k``/``v`` (as edges name it).
    site : ``q``, ``k`` or ``v``.
    store : where the stored edges are read and the patch is kept.

    Raises
    ------
    InputError
        No stored edges; an edge :func:`not_exact` names (its one-line reason); a name that is no head; a layer or
        head out of range; a receiver not after the sender (:func:`headscope.analysis.path_patching.path_patching`).
    """
    from headscope.analysis.path_patching import path_patching

    if not all(isinstance(v, str) for v in (sender, receiver, site)):
        raise InputError("An edge is named by three strings: sender, receiver and site. Click an edge of the graph.")
    if site not in (*EXACT_SITES, "logits"):
        raise InputError(f"Unknown site {site[:20]!r}: an edge ends in a head's q, k or v, or in the logits.")
    if (reason := not_exact(sender[:40], receiver[:40], site)) is not None:
        raise InputError(reason)
    sends, receives = _edge_head(sender, "sender"), _edge_head(receiver, "receiver")
    edges = load_edges(store, result.edges_key) if store is not None and result.edges_key else None
    if edges is None:
        raise InputError("This result has no stored edges: give a corrupted text and run again.")
    key = edge_patch_key(result, sender, receiver, site)
    if (found := stored_result(store, key, load_edge_patch, progress)) is not None:
        return found
    started = time.perf_counter()
    a = result.attribution
    patched = path_patching(model, result.token_ids, edges.corrupted_ids, [a.answer, a.wrong], [sends], [receives],
                            site=site, direction="noise", freeze_mlps=True)
    estimate = next((float(edges.scores[i]) for i in range(len(edges.scores))
                     if (edges.senders[i], edges.receivers[i], edges.sites[i]) == (sender, receiver, site)), None)
    patch = EdgePatch(key, sender, receiver, site, patched.raw - patched.clean, estimate, patched.clean, patched.raw,
                      time.perf_counter() - started)
    if store is not None:
        meta = {f: getattr(patch, f) for f in ("sender", "receiver", "site", "exact", "estimate", "clean", "patched",
                                               "seconds")}
        store.put(key, "edge_patch", {**meta, "version": CIRCUITS_VERSION}, {})
    if progress:
        progress(1.0)
    return patch


def load_edge_patch(store: Store, key: str) -> EdgePatch | None:
    """The stored :class:`EdgePatch` under ``key``, or None."""
    record = stored_record(store, key, "edge_patch")
    if record is None:
        return None
    m = record.meta
    return EdgePatch(key, m["sender"], m["receiver"], m["site"], float(m["exact"]),
                     None if m["estimate"] is None else float(m["estimate"]), float(m["clean"]), float(m["patched"]),
                     float(m["seconds"]))


def explain(model: LoadedModel, text: str | Sequence[int], layer: int, head: int, query: int, key: int,
            store: Store | None = None) -> ExplainedCell:
    """The QK attribution of head ``(layer, head)`` at ``(query, key)`` of the text's tokens
    (:func:`headscope.analysis.qk_attribution.qk_attribution`), stored under a key of the model digest, the ids
    and the cell. Positions count the tokens the model sees (a BOS it expects is position 0)."""
    ids = text_ids(model, text)
    cell_key = content_key("qk-cell", CIRCUITS_VERSION, model.digest, ids, layer, head, query, key)
    found = load_explained(store, cell_key) if store is not None else None
    if found is not None:
        return found
    attribution = qk_attribution(model, ids, layer, head, query, key)
    cell = ExplainedCell(cell_key, attribution, ids, model.token_strings(ids))
    if store is not None:
        a = attribution
        meta = {"layer": a.layer, "head": a.head, "query": a.query, "key": a.key, "query_names": a.query_names,
                "key_names": a.key_names, "score": a.score, "capped_score": a.capped_score, "softcap": a.softcap,
                "scale": a.scale, "token_ids": ids, "tokens": cell.tokens, "version": CIRCUITS_VERSION}
        store.put(cell_key, "qk_cell", meta, {"terms": np.asarray(a.terms, dtype=np.float64)})
    return cell


def load_explained(store: Store, key: str) -> ExplainedCell | None:
    """The stored :class:`ExplainedCell` under ``key``, or None."""
    record = stored_record(store, key, "qk_cell")
    if record is None:
        return None
    m = record.meta
    a = QKAttribution(layer=int(m["layer"]), head=int(m["head"]), query=int(m["query"]), key=int(m["key"]),
                      query_names=list(m["query_names"]), key_names=list(m["key_names"]),
                      terms=record.array("terms", mmap=False), score=float(m["score"]),
                      capped_score=float(m["capped_score"]), softcap=None if m["softcap"] is None else float(m["softcap"]),
                      scale=float(m["scale"]))
    return ExplainedCell(key, a, list(m["token_ids"]), list(m["tokens"]))

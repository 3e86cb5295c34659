"""The QK attribution of one clicked cell of a run, fast after the first: one cached capture per run.

:func:`headscope.analysis.qk_attribution.qk_attribution` runs the model once per call (its forward pass is
most of its time). A page that explains cell after cell of the same run keeps one
:func:`headscope.analysis.residual_components.capture_components` of every position and every layer's
attention per (model, token ids) in a small in-process LRU (:data:`CACHED` captures, about 200 MB each at
512 tokens of SmolLM2-135M), so every later cell is a few matrix products (tens of ms). The numbers are those
of ``qk_attribution`` (same function, same checks); only where its capture comes from differs.

The capture is one forward pass with hooks (about 2 s at 512 tokens on two cores), too slow for the first
click to answer within a second. :func:`prefetch` makes it in a daemon thread as soon as a page shows a
run, so the first click usually finds it made; a click that comes sooner waits only for the rest of it
(:func:`run_capture` makes one capture at a time, and the click then finds it cached). The thread makes
the latest run asked for, one after another, never several at once. It runs torch as a request thread
would: in ``headscope serve`` every server thread runs OpenMP on one thread
(:func:`headscope.app.jobs.prepare_server_threads`), so a job forked meanwhile inherits no OpenMP pool,
and a model load inside it holds forks off like any load (:data:`headscope.analysis.fork_gate.MODEL_LOADS`).
A forked child starts with no prefetch thread and fresh locks.

:func:`grouped_by_layer` sums the ``[C_q, C_k]`` terms over the heads of each layer (Elhage et al. 2021,
"A Mathematical Framework for Transformer Circuits": the heads of a layer write into the residual stream
side by side, so their parts of the score add), for a readable whole-matrix view.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from headscope.analysis.limits import limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.qk_attribution import QKAttribution, qk_attribution
from headscope.analysis.residual_components import LIMIT, ComponentCapture, capture_components, check_tokens

CACHED = 1  # captures kept (each ~200 MB at 512 tokens): the run a page explains now

_captures: OrderedDict[tuple[str, tuple[int, ...]], ComponentCapture] = OrderedDict()
_lock = threading.Lock()  # one capture at a time: a second click on the same run waits for the first's


def run_capture(model: LoadedModel, token_ids: Sequence[int]) -> ComponentCapture:
    """Every position's components and every layer's attention for ``token_ids``, from the cache when the same
    model (by digest) ran the same ids last; else one hooked forward pass, then kept (the oldest dropped)."""
    ids = check_tokens(model, token_ids)
    key = (model.digest, tuple(ids))
    with _lock:
        found = _captures.get(key)
        if found is not None:
            _captures.move_to_end(key)
            return found
        while len(_captures) >= CACHED:  # drop before capturing: two would not fit beside each other
            _captures.popitem(last=False)
        capture = capture_components(model, ids, range(len(ids)), attention_layers=range(model.n_layers))
        _captures[key] = capture
        return capture


def is_cached(model: LoadedModel, token_ids: Sequence[int]) -> bool:
    """Whether :func:`run_capture` of these ids would be answered from the cache."""
    return (model.digest, tuple(int(t) for t in token_ids)) in _captures


def clear_captures() -> None:
    """Forget every cached capture (the next cell of any run makes its own)."""
    with _lock:
        _captures.clear()


ModelSource = Callable[[], LoadedModel]
_wanted: tuple[ModelSource, list[int]] | None = None  # the latest run a page showed, not yet captured
_prefetcher: threading.Thread | None = None
_prefetch_lock = threading.Lock()


def prefetch(model: ModelSource, digest: str, token_ids: Sequence[int]) -> bool:
    """Make :func:`run_capture` of ``token_ids`` in a daemon thread (module docstring); True if one is on its way.

    ``model`` is a function that returns the model whose digest is ``digest`` (called in the thread, so a
    page that shows a run never waits for a model load). Ids already captured, or that :func:`run_capture`
    would refuse for their number, start nothing; a capture the thread cannot make is left for the click,
    which makes it again and says what was wrong."""
    global _wanted, _prefetcher
    try:
        ids = [int(t) for t in token_ids]
    except (TypeError, ValueError):
        return False
    if not ids or len(ids) > limit(LIMIT) or (digest, tuple(ids)) in _captures:
        return False
    with _prefetch_lock:
        _wanted = (model, ids)
        if _prefetcher is None:
            _prefetcher = threading.Thread(target=_prefetch_in_turn, name="headscope-why-prefetch", daemon=True)
            _prefetcher.start()
    return True


def _prefetch_in_turn() -> None:
    """The prefetch thread: capture the latest run asked for until none is waiting."""
    global _wanted, _prefetcher
    while True:
        with _prefetch_lock:
            job, _wanted = _wanted, None
            if job is None:
                _prefetcher = None
                return
        source, ids = job
        try:
            run_capture(source(), ids)
        except Exception:  # noqa: BLE001 - the click makes the capture again and says what was wrong
            continue


def _fresh_in_child() -> None:
    global _lock, _prefetch_lock, _prefetcher, _wanted
    _lock, _prefetch_lock, _prefetcher, _wanted = threading.Lock(), threading.Lock(), None, None


os.register_at_fork(after_in_child=_fresh_in_child)


def cell_attribution(model: LoadedModel, token_ids: Sequence[int], layer: int, head: int, query: int,
                     key: int) -> QKAttribution:
    """:func:`headscope.analysis.qk_attribution.qk_attribution` of head ``(layer, head)`` at ``(query, key)``
    with the run's cached capture (:func:`run_capture`). Positions and head are checked before any capture
    is made, so a bad request costs no forward pass."""
    from headscope.analysis.errors import InputError, check_head_index

    ids = check_tokens(model, token_ids)
    check_head_index(model.n_layers, model.n_heads, layer, head)
    for value, what in ((query, "query"), (key, "key")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < len(ids):
            raise InputError(f"The {what} position {value!r} is outside the text: pick one in 0..{len(ids) - 1}.")
    if key > query:
        raise InputError(f"Key {key} comes after query {query}: a causal head never scores it. Pick a key ≤ the query.")
    return qk_attribution(model, ids, layer, head, query, key, capture=run_capture(model, ids))


def layer_group(name: str) -> str:
    """The group of component ``name`` by layer: a head ``L.H`` is ``attn L``; the others are their own."""
    first, _, rest = name.partition(".")
    return f"attn {first}" if first.isdigit() and rest.isdigit() else name


def _in_order(group: str, seen: int) -> tuple[float, int, int]:
    """Where ``group`` sits when the groups follow the residual stream: ``embed``; each layer's heads, then
    its MLP; then the biases (in the order first seen)."""
    kind, _, layer = group.replace("mlp.", "mlp ").partition(" ")
    if group == "embed":
        return (-1, 0, 0)
    if kind in ("attn", "mlp") and layer.isdigit():
        return (int(layer), 0 if kind == "attn" else 1, 0)
    return (float("inf"), 0, seen)


def grouped_by_layer(names: Sequence[str], terms: np.ndarray) -> tuple[list[str], np.ndarray]:
    """``terms [C, C']`` with query-side and key-side components ``names`` (the same on both sides) summed
    over each layer's heads (:func:`layer_group`): ``(group names, [G, G] terms)``, the groups in the order
    the residual stream receives them (``embed``, ``attn 0``, ``mlp.0``, ``attn 1``, …, the biases). The sum
    of the grouped terms is the sum of the terms."""
    seen = list(dict.fromkeys(layer_group(n) for n in names))
    groups = sorted(seen, key=lambda g: _in_order(g, seen.index(g)))
    index = {g: i for i, g in enumerate(groups)}
    member = np.zeros((len(groups), len(names)))
    for j, n in enumerate(names):
        member[index[layer_group(n)], j] = 1.0
    return groups, member @ np.asarray(terms, dtype=np.float64) @ member.T

"""Exact attention flow for decoder-only (causal) models.

Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers" (ACL 2020, arXiv:2005.00928),
section 4. The attention graph is layered: node (l, p) is position p after layer l, l = 0 being the
input embeddings; the edge (l−1, j) → (l, i) has capacity Â_l[i, j], the residual-augmented,
head-fused attention of :func:`headscope.analysis.rollout.augmented_attention` (the same matrices rollout
multiplies). The flow of input j to output i is the value of a maximum flow from (0, j) to (L, i).

How it is computed, and why it is exact
---------------------------------------
Causality means every edge goes from a position to the same or a later one, so every (0, j) →
(L, i) path stays inside positions j..i, and the problem for the pair (j, i) only involves
(L − 1)·(i − j + 1) + 2 nodes. Each pair is solved by a push-relabel maximum-flow algorithm
(Goldberg & Tarjan 1988; FIFO selection, exact-distance global relabelling) written for this
layered graph: arcs are enumerated from the Â matrices directly, no graph object is built, and it
is compiled with numba. Only the first phase is run: once no node that can still reach the sink
holds excess, the preflow is maximum and the sink's excess is the max-flow value (Cherkassky &
Goldberg 1997).

Floating point: the capacities are used as they are, in float64 — no scaling to integers (which
is what ``scipy.sparse.csgraph.maximum_flow`` would need, with an error of up to one rounding step
per cut edge), no tolerance, no early stop. Push-relabel's termination and correctness are
combinatorial: they only need a saturating push to remove its arc and a non-saturating push to
empty its node, and here both are exact (the residual or the excess is *set* to 0, not computed
as a difference; for floats a − b > 0 whenever a > b). So the run ends, as in exact arithmetic,
with no residual path from any node holding excess to the sink, i.e. at a saturated cut, and the
sink's excess is the max-flow value up to the rounding of the additions that moved flow. Every
excess is at most the source's out-capacity (≤ N), so each push adds at most 3·N·2⁻⁵³ of
rounding: a crude bound is (number of pushes)·3·N·2⁻⁵³ absolute. Measured: at most 5e-16 relative
against networkx on SmolLM2-135M patterns up to 128 tokens (``bench/flow.py``); the tests require
1e-9 relative.

Speed: 300–900× networkx on the same inputs at 32–128 tokens × 30 layers (one output row of
128 tokens: 0.2–0.7 s; all 128 × 128 pairs: 9–20 s, on 2 shared CPU cores).
Without numba (not expected: it comes with umap-learn) the same code runs as plain Python, about
50× slower than compiled and still faster than networkx.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from headscope.analysis.rollout import augmented_attention

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba ships with umap-learn

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f


@njit(cache=True, nogil=True)
def _global_relabel(rf, rr, j, i, n_nodes, label, cur, bfs):
    """Set ``label`` to the exact residual distance to the sink (BFS over reversed residual arcs).

    Nodes that cannot reach the sink, and the source, get ``n_nodes``: the first phase ignores them.
    Layout as in :func:`_pair_flow`.
    """
    n_layers = rf.shape[0]
    n = rf.shape[1]
    for layer in range(1, n_layers):
        for p in range(j, i + 1):
            label[layer * n + p] = n_nodes
            cur[layer * n + p] = 0
    label[j] = n_nodes
    sink = n_layers * n + i
    label[sink] = 0
    head = 0
    tail = 1
    bfs[0] = sink
    while head < tail:
        w = bfs[head]
        head += 1
        lw = w // n
        pw = w - lw * n
        dw = label[w] + 1
        # Forward arcs (lw−1, q) → (lw, pw), q ≤ pw, still unsaturated.
        if lw >= 2:
            for q in range(j, pw + 1):
                v = (lw - 1) * n + q
                if label[v] == n_nodes and rf[lw - 1, pw, q] > 0.0:
                    label[v] = dw
                    bfs[tail] = v
                    tail += 1
        # Reverse arcs (lw+1, p') → (lw, pw), p' ≥ pw, carrying flow.
        if 1 <= lw and lw + 1 <= n_layers - 1:
            for pp in range(pw, i + 1):
                v = (lw + 1) * n + pp
                if label[v] == n_nodes and rr[lw, pp, pw] > 0.0:
                    label[v] = dw
                    bfs[tail] = v
                    tail += 1


@njit(cache=True, nogil=True)
def _pair_flow(caps, j, i, rf, rr, excess, label, cur, queue, bfs, inqueue):
    """Max-flow value from (0, j) to (L, i) in the layered graph with capacities ``caps`` [L, N, N].

    Node (l, p) is stored at index l·N + p. The forward arc (l, p) → (l+1, p'), p ≤ p', has residual
    ``rf[l, p', p]`` (starts at ``caps[l, p', p]``); its reverse arc (l+1, p') → (l, p) has residual
    ``rr[l, p', p]`` (the flow; starts at 0). Layer 0 holds only the source (0, j), layer L only the
    sink (L, i); layers 1..L−1 hold positions j..i. The work arrays are passed in so that one
    allocation serves every pair.

    FIFO push-relabel, first phase: saturate the source's arcs (:func:`_saturate_source`), then
    discharge active nodes in FIFO order (:func:`_discharge`), with an exact global relabel
    (:func:`_global_relabel`) at the start and after every ``n_nodes`` relabels.
    """
    n_layers = caps.shape[0]
    n = caps.shape[1]
    if n_layers == 1:
        return caps[0, i, j]
    sink = n_layers * n + i
    n_nodes = (n_layers - 1) * (i - j + 1) + 2
    _reset_pair(caps, j, i, rf, rr, excess, inqueue)
    _global_relabel(rf, rr, j, i, n_nodes, label, cur, bfs)
    # FIFO of active nodes: circular, empty when head == tail (at most n_nodes − 2 are ever queued at
    # once, fewer than its length).
    qsize = queue.shape[0]
    qhead = 0
    qtail = _saturate_source(j, i, rf, rr, excess, queue, inqueue)
    relabels = 0
    while qhead != qtail:
        u = queue[qhead]
        qhead = (qhead + 1) % qsize
        inqueue[u] = False
        qtail, done = _discharge(u, j, i, n_nodes, rf, rr, excess, label, cur, queue, inqueue, qtail)
        relabels += done
        if relabels >= n_nodes:
            relabels = 0
            _global_relabel(rf, rr, j, i, n_nodes, label, cur, bfs)
    return excess[sink]


# The steps of _pair_flow are inlined into it by numba (``inline="always"``): compiled as separate
# calls, the FIFO loop runs 30–60 % slower. For the same reason the FIFO append is written out where
# nodes join it instead of being a function.
@njit(cache=True, nogil=True, inline="always")
def _reset_pair(caps, j, i, rf, rr, excess, inqueue):
    """No flow on the pair's subgraph (positions j..i): residuals back to the capacities, no excess,
    nothing queued. Layout as in :func:`_pair_flow`."""
    n_layers = caps.shape[0]
    n = caps.shape[1]
    for e in range(n_layers):
        for p in range(j, i + 1):
            for q in range(j, p + 1):
                rf[e, p, q] = caps[e, p, q]
                rr[e, p, q] = 0.0
    for layer in range(n_layers + 1):
        for p in range(j, i + 1):
            excess[layer * n + p] = 0.0
            inqueue[layer * n + p] = False


@njit(cache=True, nogil=True, inline="always")
def _saturate_source(j, i, rf, rr, excess, queue, inqueue):
    """Fill every arc out of the source (0, j) to capacity and queue the layer-1 nodes it reaches;
    the FIFO's tail after that (it starts empty, at 0)."""
    n = rf.shape[1]
    qtail = 0
    for p in range(j, i + 1):
        c = rf[0, p, j]
        if c > 0.0:
            v = n + p
            rf[0, p, j] = 0.0
            rr[0, p, j] = c
            excess[v] += c
            if not inqueue[v]:
                inqueue[v] = True
                queue[qtail] = v
                qtail = (qtail + 1) % queue.shape[0]
    return qtail


@njit(cache=True, nogil=True, inline="always")
def _push(res, rev, e, p, q, excess, u, v):
    """Push min(excess of u, residual ``res[e, p, q]``) along the arc u → v; ``rev[e, p, q]`` is the
    residual of its reverse arc. A saturating push *sets* the residual to 0, a non-saturating one the
    excess of u (why the run ends exactly; see the module docstring)."""
    r = res[e, p, q]
    if excess[u] < r:
        delta = excess[u]
        excess[u] = 0.0
        res[e, p, q] = r - delta
    else:
        delta = r
        excess[u] -= r
        res[e, p, q] = 0.0
    rev[e, p, q] += delta
    excess[v] += delta


@njit(cache=True, nogil=True, inline="always")
def _discharge(u, j, i, n_nodes, rf, rr, excess, label, cur, queue, inqueue, qtail):
    """Push the excess of node ``u`` along admissible arcs (from its current arc ``cur[u]`` on),
    relabelling it when its arcs run out, until it has no excess or cannot reach the sink.

    Arcs 0 .. n_fwd−1 go to layer lu+1 (only the sink from layer L−1), the rest to layer lu−1 (only the
    source from layer 1). Nodes that receive excess join the FIFO unless they are in it (never the
    source or the sink). Returns the FIFO's tail and the number of relabels.
    """
    n_layers = rf.shape[0]
    n = rf.shape[1]
    source = j
    sink = n_layers * n + i
    lu = u // n
    pu = u - lu * n
    to_sink = lu + 1 == n_layers
    from_source = lu == 1
    n_fwd = 1 if to_sink else i - pu + 1
    n_arcs = n_fwd + (1 if from_source else pu - j + 1)
    relabels = 0
    while excess[u] > 0.0 and label[u] < n_nodes:
        k = cur[u]
        if k == n_arcs:
            _relabel(u, j, i, n_fwd, n_arcs, n_nodes, rf, rr, label, cur)
            relabels += 1
            continue
        if k < n_fwd:
            pp = i if to_sink else pu + k
            v = (lu + 1) * n + pp
            if rf[lu, pp, pu] > 0.0 and label[u] == label[v] + 1:
                _push(rf, rr, lu, pp, pu, excess, u, v)
                if v != sink and not inqueue[v]:
                    inqueue[v] = True
                    queue[qtail] = v
                    qtail = (qtail + 1) % queue.shape[0]
            else:
                cur[u] = k + 1
        else:
            q = j if from_source else j + (k - n_fwd)
            v = (lu - 1) * n + q
            if rr[lu - 1, pu, q] > 0.0 and label[u] == label[v] + 1:
                _push(rr, rf, lu - 1, pu, q, excess, u, v)
                if v != source and not inqueue[v]:
                    inqueue[v] = True
                    queue[qtail] = v
                    qtail = (qtail + 1) % queue.shape[0]
            else:
                cur[u] = k + 1
    return qtail, relabels


@njit(cache=True, nogil=True, inline="always")
def _relabel(u, j, i, n_fwd, n_arcs, n_nodes, rf, rr, label, cur):
    """Lift node ``u`` to one more than its lowest residual neighbour (at most ``n_nodes``: then it
    no longer reaches the sink) and start its arcs again from the first."""
    n_layers = rf.shape[0]
    n = rf.shape[1]
    lu = u // n
    pu = u - lu * n
    to_sink = lu + 1 == n_layers
    from_source = lu == 1
    best = 2 * n_nodes
    for k2 in range(n_arcs):
        if k2 < n_fwd:
            pp = i if to_sink else pu + k2
            if rf[lu, pp, pu] > 0.0:
                best = min(best, label[(lu + 1) * n + pp])
        else:
            q = j if from_source else j + (k2 - n_fwd)
            if rr[lu - 1, pu, q] > 0.0:
                best = min(best, label[(lu - 1) * n + q])
    label[u] = min(best + 1, n_nodes)
    cur[u] = 0


class _Workspace:
    """Work arrays for :func:`_pair_flow`, sized once for a stack of capacities [L, N, N]."""

    def __init__(self, n_layers: int, n: int):
        size = (n_layers + 1) * n
        self.rf = np.zeros((n_layers, n, n))
        self.rr = np.zeros((n_layers, n, n))
        self.excess = np.zeros(size)
        self.label = np.zeros(size, dtype=np.int64)
        self.cur = np.zeros(size, dtype=np.int64)
        self.queue = np.zeros(size + 1, dtype=np.int64)
        self.bfs = np.zeros(size + 1, dtype=np.int64)
        self.inqueue = np.zeros(size, dtype=np.bool_)

    def flow(self, caps: np.ndarray, j: int, i: int) -> float:
        return float(
            _pair_flow(
                caps,
                j,
                i,
                self.rf,
                self.rr,
                self.excess,
                self.label,
                self.cur,
                self.queue,
                self.bfs,
                self.inqueue,
            )
        )


def _capacities(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer) -> np.ndarray:
    return augmented_attention(
        patterns,
        residual=residual,
        fusion=fusion,
        discard_ratio=discard_ratio,
        drop_sinks=drop_sinks,
        start_layer=start_layer,
        end_layer=end_layer,
    )


def _check_target(target: int | None, n: int) -> int:
    if target is None:
        return n - 1
    if not -n <= int(target) < n:
        raise ValueError(
            f"target must be an output position in 0 .. {n - 1} (or negative from the end), got {target}"
        )
    return int(target) % n


def _check_sources(sources: Sequence[int] | None, n: int, normalize: bool = False) -> list[int]:
    if sources is None:
        return list(range(n))
    if normalize:
        raise ValueError("normalize=True needs the flow of every input: leave sources=None")
    todo = sorted({int(j) for j in sources})
    bad = [j for j in todo if not 0 <= j < n]
    if bad:
        raise ValueError(f"sources {bad} are outside the sequence (valid: 0 .. {n - 1})")
    return todo


def relevance_shares(row: np.ndarray) -> np.ndarray:
    """Each input's share of one output's relevance: ``row / Σ row`` (the row unchanged when its sum
    is 0), float64.

    Flow needs it to be read beside rollout: a row of rollout (or of head-fused attention) sums to 1,
    being a row of a product of row-stochastic matrices, but max-flow values do not. Each input's flow
    is a maximum flow computed alone, and inputs share edges, so their sum is no total of anything.
    Divided by their sum, as the paper's released code does for its figures (``normalize=True``),
    flow is in rollout's unit, the share of the output's relevance each input holds, and the two can
    share one colour scale. For rollout and attention the division only absorbs rounding.
    """
    row = np.asarray(row, dtype=np.float64)
    total = row.sum()
    return row / total if total > 0 else row



def attention_flow(
    patterns: np.ndarray,
    target: int | None = None,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    sources: Sequence[int] | None = None,
    normalize: bool = False,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Attention flow of every input position to one output position, exactly.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 4: in the layered
    graph with nodes (l, p), l = 0..L, and capacities c((l−1, j) → (l, i)) = Â_l[i, j],
    ``flow[j] = maxflow((0, j) → (L, target))``. Â_l is
    :func:`headscope.analysis.rollout.augmented_attention` (``Â_l = r·I + (1 − r)·Ā_l``). Computed by
    push-relabel in float64 on the causal subgraph of positions j..target; exact up to float64
    rounding of sums (see the module docstring), and equal to :func:`flow_reference_networkx`.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention; may be float16, computation is float64.
    target : int or None
        Output position i (negative counts from the end); ``None``: the last position.
    residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer
        Build the capacities Â_l; see :func:`headscope.analysis.rollout.augmented_attention`. Layer 0 of the
        graph is the input of ``start_layer``, layer L the output of ``end_layer − 1``.
    sources : sequence of int or None
        Only these input positions (the others stay NaN); ``None``: all.
    normalize : bool
        Divide by the sum over inputs, as the paper's released code does for its figures. Max-flow
        values of different inputs share edges, so the raw values do not add up to 1. Needs all
        sources.
    progress : callable(float) or None
        Called with the fraction of inputs done.

    Returns
    -------
    np.ndarray, float64 [key]
        ``flow[j]`` for input positions j ≤ target; 0 for positions after the target (causal).
    """
    caps = _capacities(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    n = caps.shape[1]
    i = _check_target(target, n)
    todo = _check_sources(sources, n, normalize)[: i + 1 if sources is None else n]
    work = _Workspace(caps.shape[0], n)
    out = np.zeros(n)
    if sources is not None:
        out[:] = np.nan
    for k, j in enumerate(todo):
        out[j] = work.flow(caps, j, i) if j <= i else 0.0
        if progress is not None:
            progress((k + 1) / len(todo))
    return relevance_shares(out) if normalize else out


def attention_flow_all(
    patterns: np.ndarray,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    normalize: bool = False,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Attention flow of every input position to every output position, exactly.

    Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", section 4:
    ``flow[i, j] = maxflow((0, j) → (L, i))`` in the layered attention graph with capacities
    Â_l[i, j] (see :func:`attention_flow`). One max-flow per pair j ≤ i; the cost grows like
    N⁴·L/24 edge visits: at 128 tokens × 30 layers one row takes under a second, all rows 10–20 s.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention.
    residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer
        See :func:`headscope.analysis.rollout.augmented_attention`.
    normalize : bool
        Divide each row by its sum (the paper's released code does).
    progress : callable(float) or None
        Called with the fraction of the work done (weighted by each row's cost).

    Returns
    -------
    np.ndarray, float64 [query, key]
        Lower-triangular; row i is :func:`attention_flow` for target i.
    """
    caps = _capacities(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    n = caps.shape[1]
    work = _Workspace(caps.shape[0], n)
    # A row's cost is about the sum over j of (i − j + 1)² edges: (i + 1)³ / 3.
    cost = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** 3)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            out[i, j] = work.flow(caps, j, i)
        if normalize:
            out[i] = relevance_shares(out[i])
        if progress is not None:
            progress(cost[i] / cost[-1])
    return out


def flow_reference_networkx(
    patterns: np.ndarray,
    target: int | None = None,
    *,
    residual: float = 0.5,
    fusion: str = "mean",
    discard_ratio: float = 0.0,
    drop_sinks: Sequence[int] = (),
    start_layer: int = 0,
    end_layer: int | None = None,
    sources: Sequence[int] | None = None,
    progress: Callable[[float], None] | None = None,
) -> np.ndarray:
    """Attention flow by ``networkx.maximum_flow_value`` on the full layered graph (reference).

    Abnar & Zuidema 2020, section 4, computed the way the paper's released code does: build every
    node (l, p), l = 0..L, p = 0..N−1, and every causal edge (l−1, j) → (l, i), j ≤ i, with capacity
    Â_l[i, j], then run networkx's default max-flow (preflow-push) once per input. Slow (seconds
    per input at 64 tokens × 30 layers); for tests and ``bench/flow.py``.

    Parameters
    ----------
    patterns : float array [layer, head, query, key]
        Post-softmax causal attention.
    target : int or None
        Output position (``None``: the last).
    residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer
        See :func:`headscope.analysis.rollout.augmented_attention`.
    sources : sequence of int or None
        Only these input positions (the others stay NaN); ``None``: all.
    progress : callable(float) or None
        Called with the fraction of inputs done.

    Returns
    -------
    np.ndarray, float64 [key]
        ``flow[j]``; 0 after the target, NaN for inputs not in ``sources``.
    """
    import networkx as nx

    caps = _capacities(patterns, residual, fusion, discard_ratio, drop_sinks, start_layer, end_layer)
    n_layers, n, _ = caps.shape
    i = _check_target(target, n)
    graph = nx.DiGraph()
    for layer in range(1, n_layers + 1):
        for p in range(n):
            for q in range(p + 1):
                graph.add_edge((layer - 1, q), (layer, p), capacity=float(caps[layer - 1, p, q]))
    todo = _check_sources(sources, n)[: i + 1 if sources is None else n]
    out = np.zeros(n)
    if sources is not None:
        out[:] = np.nan
    for k, j in enumerate(todo):
        out[j] = nx.maximum_flow_value(graph, (0, j), (n_layers, i)) if j <= i else 0.0
        if progress is not None:
            progress((k + 1) / len(todo))
    return out

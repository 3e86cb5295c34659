"""Joint query-key embeddings of one attention head, as in AttentionViz.

Yeh, Chen, Wu, Zhao, Wattenberg & Viégas (2023), "AttentionViz: A Global View of Transformer
Attention" (IEEE VIS 2023) place the queries and keys of one head, pooled over many inputs, in one
2-D picture, after two normalisations that leave every attention row unchanged:

1. **Key translation.** Softmax over the keys of one query row is invariant to adding a constant to
   all of that row's logits. Adding a vector ``c`` to every key adds ``q_i · c`` to every logit of row
   ``i``: a per-row constant. So the keys are translated to share the queries' centroid.
2. **Norm balancing.** ``(a q) · (k / a) = q · k`` for any ``a > 0``: queries and keys are rescaled by
   reciprocal factors so their mean norms are equal (otherwise one cloud sits inside the other).

With both, a query lies near the keys it attends to, and the joint point set is projected to 2-D
with PCA (immediate), UMAP (McInnes et al. 2018) or t-SNE (van der Maaten & Hinton 2008), seeded and
deterministic.

UMAP here is given an exact k-nearest-neighbour graph (scikit-learn, milliseconds for thousands of
points) instead of letting it run pynndescent at ≥ 4,096 points: the result is deterministic, the
first call in a process compiles far less numba code, and one small warm-up
(:func:`warm_up_umap`) covers every size.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from headscope.analysis.errors import InputError
from headscope.analysis.qk_collect import HeadQK
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import stored_record, stored_result

EMBED_VERSION = 1
METHODS = ("pca", "umap", "tsne")
Progress = Callable[[float], None] | None


# ---------------------------------------------------------------------------------------------
# Normalisation


@dataclass
class JointQK:
    """Normalised queries and keys of one head, stacked for projection.

    Attributes
    ----------
    points : ``[n_q + n_k, d]`` queries ``scale · q`` first, then keys ``k / scale + key_shift``.
    is_key : ``[n_q + n_k]`` False for query rows, True for key rows.
    scale : the factor ``a`` on queries (keys get ``1 / a``).
    key_shift : ``[d]`` the translation added to the rescaled keys (``a μ_q − μ_k / a``).
    """

    points: np.ndarray
    is_key: np.ndarray
    scale: float
    key_shift: np.ndarray
    n_queries: int

    @property
    def queries(self) -> np.ndarray:
        return self.points[: self.n_queries]

    @property
    def keys(self) -> np.ndarray:
        return self.points[self.n_queries:]


def normalise_qk(q: np.ndarray, k: np.ndarray, *, translate: bool = True, balance: bool = True) -> JointQK:
    """AttentionViz's key translation and norm balancing (Yeh et al. 2023, Sec. 4).

    Returns ``q' = a q`` and ``k' = (k − μ_k) / a + a μ_q`` (``μ`` the centroids), so that

    - the keys' centroid equals the queries' centroid (``mean k' = a μ_q = mean q'``), and
    - the mean norms are equal, ``mean ‖q'‖ = mean ‖k'‖``.

    AttentionViz translates, then rescales; doing both exactly needs the scale to be solved
    *with* the translation: ``a`` is the root of ``mean ‖q‖ = mean ‖(k − μ_k)/a² + μ_q‖``, which
    exists and is unique (the right side is convex in ``1/a²``, equal to ``‖μ_q‖ ≤ mean ‖q‖`` at 0 and
    unbounded), found with Brent's method.

    Every attention row is unchanged: ``q'_i · k'_j = q_i · k_j + q_i · (a² μ_q − μ_k)``, a constant
    within row ``i``, and softmax ignores per-row constants.

    Parameters
    ----------
    q : ``[n_q, d]`` queries; k : ``[n_k, d]`` keys (post-rotary for the logit identity to hold).
    translate, balance : turn either step off (``balance`` alone uses ``a² = mean‖k‖ / mean‖q‖``).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.ndim != 2 or k.ndim != 2 or q.shape[1] != k.shape[1]:
        raise InputError(f"Queries and keys must be [n, d] arrays of the same width; got {q.shape} and {k.shape}.")
    if len(q) == 0 or len(k) == 0:
        raise InputError("There are no queries or no keys to embed.")
    if not (np.isfinite(q).all() and np.isfinite(k).all()):
        raise InputError("The queries or keys contain NaN or infinite values.")
    mu_q, mu_k = q.mean(0), k.mean(0)
    mean_q = np.linalg.norm(q, axis=1).mean()
    a = 1.0
    if balance and mean_q > 0:
        if translate:
            a = _balancing_scale(mu_q, k - mu_k, mean_q)
        else:
            mean_k = np.linalg.norm(k, axis=1).mean()
            a = float(np.sqrt(mean_k / mean_q)) if mean_k > 0 else 1.0
    shift = (a * mu_q - mu_k / a) if translate else np.zeros_like(mu_q)
    points = np.concatenate([a * q, k / a + shift]).astype(np.float32)
    is_key = np.concatenate([np.zeros(len(q), bool), np.ones(len(k), bool)])
    return JointQK(points=points, is_key=is_key, scale=float(a), key_shift=shift.astype(np.float32), n_queries=len(q))


def _balancing_scale(mu_q: np.ndarray, centred_k: np.ndarray, mean_q: float) -> float:
    from scipy.optimize import brentq

    spread = np.linalg.norm(centred_k, axis=1).mean()
    if spread == 0 or np.linalg.norm(mu_q) >= mean_q * (1 - 1e-12):
        return 1.0  # all keys equal, or all queries equal: no scale balances both exactly

    def gap(t: float) -> float:
        return float(np.linalg.norm(centred_k * t + mu_q, axis=1).mean() - mean_q)

    hi = (mean_q + np.linalg.norm(mu_q)) / spread
    while gap(hi) < 0:  # the bound above always holds; guard against rounding
        hi *= 2
    t = brentq(gap, 0.0, hi, xtol=1e-14, rtol=1e-12)
    return float(1 / np.sqrt(t))


# ---------------------------------------------------------------------------------------------
# Projections


@dataclass
class QKEmbedding:
    """A 2-D joint embedding of one head's queries and keys.

    Attributes
    ----------
    coords : ``[2 n, 2]`` queries first (row ``i`` is token ``i``'s query), then keys (row ``n + j``
        is token ``j``'s key), as in :meth:`headscope.analysis.qk_collect.HeadQK.point_table`.
    explained_variance : fraction of variance on each axis (PCA only).
    """

    coords: np.ndarray
    is_key: np.ndarray
    method: str
    params: dict[str, Any]
    seconds: float
    scale: float
    explained_variance: list[float] = field(default_factory=list)

    @property
    def n_queries(self) -> int:
        return int((~self.is_key).sum())

    def query_xy(self, token_index: int) -> np.ndarray:
        return self.coords[token_index]

    def key_xy(self, token_index: int) -> np.ndarray:
        return self.coords[self.n_queries + token_index]


def project(
    points: np.ndarray,
    method: str = "pca",
    *,
    seed: int = 0,
    n_neighbors: int = 15,
    min_dist: float = 0.1,
    n_epochs: int = 200,
    perplexity: float = 30.0,
    tsne_iter: int = 500,
    metric: str = "euclidean",
    progress: Progress = None,
) -> tuple[np.ndarray, list[float]]:
    """Project ``[n, d]`` points to ``[n, 2]`` with PCA, UMAP or t-SNE, deterministically.

    - ``pca``: scikit-learn PCA (exact, via the covariance's eigendecomposition), signs fixed by
      scikit-learn's ``svd_flip``.
    - ``umap``: McInnes, Healy & Melville (2018), on an exact ``n_neighbors`` graph (scikit-learn),
      ``random_state=seed`` (single-threaded layout, reproducible), ``n_epochs`` epochs (200, UMAP's
      own default above 10,000 points; its 500 for smaller sets costs 2.5× for little visible change),
      initialised from PCA (Kobak & Linderman 2021: an informative start keeps global structure; the
      spectral default's eigensolver alone takes 6 s on 8,000 query/key points, whose kNN graph falls
      apart into many components).
    - ``tsne``: van der Maaten & Hinton (2008), scikit-learn's Barnes-Hut t-SNE, PCA initialisation,
      ``random_state=seed``, one thread (reproducible), ``tsne_iter`` iterations (500: 250 with early
      exaggeration, then 250; scikit-learn's default 1,000 doubles the time).

    Returns
    -------
    (coords ``[n, 2]`` float32, explained variance ratios for PCA or ``[]``).
    """
    if method not in METHODS:
        raise InputError(f"Unknown projection {method!r}: choose one of {', '.join(METHODS)}.")
    x = np.ascontiguousarray(points, dtype=np.float32)
    if x.ndim != 2 or len(x) < 3:
        raise InputError(f"A projection needs at least 3 points; got {len(x)}.")
    if metric not in ("euclidean", "cosine"):
        raise InputError("metric must be 'euclidean' or 'cosine'.")
    if progress:
        progress(0.0)
    if method == "pca":
        from sklearn.decomposition import PCA
        from threadpoolctl import threadpool_limits

        # n ≫ d: the d × d covariance's eigendecomposition is exact and milliseconds; one BLAS
        # thread avoids the thread spin-up that dominates such small problems on a busy machine.
        pca = PCA(n_components=2, svd_solver="covariance_eigh")
        with threadpool_limits(1):
            coords = pca.fit_transform(x.astype(np.float64))
        out, ev = coords.astype(np.float32), [float(v) for v in pca.explained_variance_ratio_]
    elif method == "umap":
        out, ev = _umap_2d(x, seed=seed, n_neighbors=n_neighbors, min_dist=min_dist, n_epochs=n_epochs,
                           metric=metric, progress=progress), []
    else:
        from sklearn.manifold import TSNE

        perp = float(min(perplexity, (len(x) - 1) / 3))
        tsne = TSNE(n_components=2, perplexity=perp, init="pca", learning_rate="auto", random_state=seed,
                    metric=metric, max_iter=max(250, int(tsne_iter)), n_jobs=1)
        out, ev = tsne.fit_transform(x).astype(np.float32), []
    if progress:
        progress(1.0)
    return out, ev


def _exact_knn(x: np.ndarray, n_neighbors: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.neighbors import NearestNeighbors

    nn = NearestNeighbors(n_neighbors=n_neighbors, metric=metric, algorithm="brute").fit(x)
    dist, idx = nn.kneighbors(x)
    # UMAP expects each point as its own first neighbour; exact duplicates can displace it in ties.
    for i in np.flatnonzero(idx[:, 0] != np.arange(len(x))):
        others = idx[i] != i
        idx[i] = np.concatenate([[i], idx[i][others][: n_neighbors - 1]])
        dist[i] = np.concatenate([[0.0], dist[i][others][: n_neighbors - 1]])
    return idx.astype(np.int64), dist.astype(np.float32)


def _umap_2d(x: np.ndarray, *, seed: int, n_neighbors: int, min_dist: float, n_epochs: int, metric: str,
             progress: Progress = None) -> np.ndarray:
    import umap

    k = int(max(2, min(n_neighbors, len(x) - 1)))
    idx, dist = _exact_knn(x, k, metric)
    if progress:
        progress(0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "n_jobs overridden by random_state", precomputed-kNN notes
        reducer = umap.UMAP(n_components=2, n_neighbors=k, min_dist=min_dist, n_epochs=n_epochs, metric=metric,
                            init="pca", random_state=seed, precomputed_knn=(idx, dist, None), verbose=False)
        return reducer.fit_transform(x).astype(np.float32)


def _stored_embedding(store: Store, key: str, method: str, params: dict) -> QKEmbedding | None:
    rec = stored_record(store, key, "qk_embedding")
    if rec is None:
        return None
    m = rec.meta
    return QKEmbedding(coords=rec.array("coords", mmap=False), is_key=rec.array("is_key", mmap=False),
                       method=method, params=params, seconds=m["seconds"], scale=m["scale"],
                       explained_variance=m["explained_variance"])


def joint_embedding(
    head: HeadQK,
    method: str = "pca",
    *,
    translate: bool = True,
    balance: bool = True,
    seed: int = 0,
    n_neighbors: int = 15,
    min_dist: float = 0.1,
    n_epochs: int = 200,
    perplexity: float = 30.0,
    tsne_iter: int = 500,
    metric: str = "euclidean",
    store: Store | None = None,
    progress: Progress = None,
) -> QKEmbedding:
    """The AttentionViz joint query-key embedding of one head (Yeh et al. 2023).

    Queries and keys are normalised by :func:`normalise_qk` (keys translated to the queries'
    centroid, reciprocal scales balancing mean norms: attention unchanged), stacked, and projected
    to 2-D by :func:`project`. With ``store``, the result is kept under a key made of the vectors'
    sha256 and the settings, so asking again (e.g. revisiting a UMAP) is instant.
    """
    params = {"translate": translate, "balance": balance, "seed": seed, "metric": metric}
    if method == "umap":
        params |= {"n_neighbors": n_neighbors, "min_dist": min_dist, "n_epochs": n_epochs}
    elif method == "tsne":
        params |= {"perplexity": perplexity, "tsne_iter": tsne_iter}
    key = None
    if store is not None:
        h = hashlib.sha256(np.ascontiguousarray(head.q, np.float32).tobytes())
        h.update(np.ascontiguousarray(head.k, np.float32).tobytes())
        key = content_key("qk_embedding", EMBED_VERSION, h.hexdigest(), method, params)
        stored = stored_result(store, key, partial(_stored_embedding, method=method, params=params), progress)
        if stored is not None:
            return stored
    t0 = time.perf_counter()
    joint = normalise_qk(head.q, head.k, translate=translate, balance=balance)
    coords, ev = project(joint.points, method, seed=seed, n_neighbors=n_neighbors, min_dist=min_dist,
                         n_epochs=n_epochs, perplexity=perplexity, tsne_iter=tsne_iter, metric=metric,
                         progress=progress)
    emb = QKEmbedding(coords=coords, is_key=joint.is_key, method=method, params=params,
                      seconds=time.perf_counter() - t0, scale=joint.scale, explained_variance=ev)
    if store is not None and key is not None:
        store.put(key, "qk_embedding", {"method": method, "params": params, "seconds": emb.seconds,
                                        "scale": emb.scale, "explained_variance": ev,
                                        "layer": head.layer, "head": head.head, "source": head.source_key},
                  {"coords": coords, "is_key": joint.is_key})
    return emb


# ---------------------------------------------------------------------------------------------
# UMAP warm-up


_warm_lock = threading.Lock()
_warm_thread: threading.Thread | None = None
_warm_seconds: float | None = None


def warm_up_umap(progress: Progress = None) -> float:
    """Compile UMAP's numba code once in this process (about 10–20 s on 2 cores); returns seconds.

    Runs :func:`project` with ``method="umap"`` on 300 float32 points in 64 dimensions (three
    far-apart clusters, as query and key clouds often are), exactly the code path of real calls.
    Because :func:`project` gives UMAP
    an exact kNN graph, the path is the same at every size: there is no separate pynndescent path
    (≥ 4,096 points) left to compile. Later calls return 0 at once.
    """
    global _warm_seconds
    with _warm_lock:
        if _warm_seconds is not None:
            if progress:
                progress(1.0)
            return 0.0
        t0 = time.perf_counter()
        rng = np.random.default_rng(0)
        x = (rng.normal(size=(300, 64)) + np.repeat(np.eye(3, 64) * 100, 100, axis=0)).astype(np.float32)
        project(x, "umap", seed=0, n_epochs=20, progress=progress)
        _warm_seconds = time.perf_counter() - t0
        return _warm_seconds


def start_umap_warmup() -> bool:
    """Start :func:`warm_up_umap` in a daemon thread; True if this call started it (once per process).

    For a server that forks jobs (the app starts it when its QK page first asks for UMAP). A process
    forked while the thread compiles would inherit numba's compiler lock held by a thread that does
    not exist in the child, and hang at its first compile; so an at-fork hook, registered when this
    module is imported (before the server forks anything), makes a fork wait (at most two minutes)
    for the warm-up to finish, and the thread never starts while a fork is under way (Python runs the
    hooks registered when a fork began: a hook registered by the first start could miss a fork that was
    already waiting in another hook). Forked children then inherit the compiled code: their first UMAP
    costs no compilation.
    """
    global _warm_thread
    with _fork_lock, _warm_lock:
        if _warm_thread is not None:
            return False
        _warm_thread = threading.Thread(target=_warm_quietly, name="umap-warmup", daemon=True)
        _warm_thread.start()
        return True


_fork_lock = threading.Lock()  # held by a fork from its first hook to its end, and by a warm-up's start


def _before_fork() -> None:
    _fork_lock.acquire()
    thread = _warm_thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=120)


def _after_fork() -> None:
    _fork_lock.release()  # in the parent, and in the child (whose only thread is the one that forked)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


def _warm_quietly() -> None:
    try:
        warm_up_umap()
    except Exception:  # a failed warm-up only means the first real call compiles
        pass


def umap_is_warm() -> bool:
    return _warm_seconds is not None


# ---------------------------------------------------------------------------------------------
# Queries and the keys they attend to


@dataclass(frozen=True)
class KeyHit:
    """One key seen from one query: its attention weight and logit, and its distance in the embedding.

    ``weight``/``logit`` are NaN for a key the query cannot see (another sentence, or later).
    """

    token_index: int
    position: int
    sentence: int
    token: str
    weight: float
    logit: float
    distance: float


def _visible_keys(head: HeadQK, i: int) -> np.ndarray:
    s = int(head.sentence_index[i])
    start = int(head.offsets[s])
    return np.arange(start, i + 1)


def query_attention(head: HeadQK, token_index: int, *, top_k: int = 5,
                    embedding: QKEmbedding | None = None) -> list[KeyHit]:
    """The ``top_k`` keys query ``token_index`` attends to most, within its own sentence.

    Attention is the head's own softmax of its logits (:meth:`HeadQK.logits`) over keys ``j ≤ i`` of the
    sentence (post-rotary vectors). With ``embedding``, each hit carries the 2-D distance from the
    query's point to the key's point.
    """
    _check_token(head, token_index)
    s = int(head.sentence_index[token_index])
    r = head.rows(s)
    local = token_index - r.start
    logits = head.logits(s)[local, : local + 1]
    weights = np.exp(logits - logits.max())
    weights /= weights.sum()
    order = np.argsort(-weights, kind="stable")[: max(1, top_k)]
    hits = []
    for j in order:
        t = r.start + int(j)
        dist = float(np.linalg.norm(embedding.query_xy(token_index) - embedding.key_xy(t))) if embedding else float("nan")
        hits.append(KeyHit(t, int(head.positions[t]), s, head.tokens[t], float(weights[j]), float(logits[j]), dist))
    return hits


def nearest_keys(head: HeadQK, embedding: QKEmbedding, token_index: int, *, top_k: int = 5,
                 same_sentence: bool = False) -> list[KeyHit]:
    """The ``top_k`` keys nearest to query ``token_index`` in the 2-D embedding.

    Keys from anywhere in the probe set by default (what the picture shows); ``same_sentence``
    keeps only keys the query can attend to. Each hit carries the attention weight when the query
    can see that key (same sentence, not later), NaN otherwise.
    """
    _check_token(head, token_index)
    n = head.n_tokens
    if embedding.coords.shape[0] != 2 * n:
        raise InputError("The embedding does not belong to this head's probe set (point counts differ).")
    candidates = _visible_keys(head, token_index) if same_sentence else np.arange(n)
    d = np.linalg.norm(embedding.coords[n + candidates] - embedding.query_xy(token_index), axis=1)
    order = candidates[np.argsort(d, kind="stable")[: max(1, top_k)]]
    visible = {h.token_index: h for h in query_attention(head, token_index, top_k=n)}
    hits = []
    for t in order:
        t = int(t)
        v = visible.get(t)
        hits.append(KeyHit(t, int(head.positions[t]), int(head.sentence_index[t]), head.tokens[t],
                           v.weight if v else float("nan"), v.logit if v else float("nan"),
                           float(np.linalg.norm(embedding.key_xy(t) - embedding.query_xy(token_index)))))
    return hits


@dataclass(frozen=True)
class Agreement:
    """How often a query lies nearer its most-attended key than a random key (chance 0.5)."""

    fraction: float
    n_queries: int
    n_draws: int
    same_sentence: bool


def attention_agreement(head: HeadQK, coords: np.ndarray, *, seed: int = 0, n_draws: int = 10,
                        same_sentence: bool = False, min_position: int = 1) -> Agreement:
    """Fraction of (query, random key) draws where the query is nearer its top key than the random one.

    For each query ``i`` (position ≥ ``min_position``, so it sees at least two keys), ``j* = argmax_j
    A[i, j]`` over its own sentence; ``r`` is drawn uniformly from all other keys of the probe set
    (``same_sentence``: from the other keys the query sees). A draw counts 1 when
    ``‖x(q_i) − x(k_j*)‖ < ‖x(q_i) − x(k_r)‖`` and 0.5 on a tie. Chance is 0.5; AttentionViz's claim
    is that the joint embedding places queries near the keys they attend to (Yeh et al. 2023).

    Parameters
    ----------
    coords : ``[2 n, 2]`` (a :class:`QKEmbedding`'s ``coords``) or ``[2 n, d]`` (e.g. the normalised
        points, to check the claim before projection).
    """
    n = head.n_tokens
    coords = np.asarray(coords, dtype=np.float64)
    if coords.shape[0] != 2 * n:
        raise InputError(f"coords has {coords.shape[0]} rows; this head has {2 * n} points.")
    rng = np.random.default_rng(seed)
    wins = 0.0
    total = 0
    for s in range(len(head.sentences)):
        r = head.rows(s)
        att = head.attention(s)
        for local in range(min_position, r.stop - r.start):
            i = r.start + local
            top = r.start + int(np.argmax(att[local, : local + 1]))
            if same_sentence:
                pool = np.array([j for j in range(r.start, i + 1) if j != top])
            else:
                pool = None
            for _ in range(n_draws):
                if pool is not None:
                    other = int(rng.choice(pool))
                else:
                    other = int(rng.integers(n - 1))
                    other += other >= top
                d_top = np.linalg.norm(coords[i] - coords[n + top])
                d_other = np.linalg.norm(coords[i] - coords[n + other])
                wins += 1.0 if d_top < d_other else 0.5 if d_top == d_other else 0.0
                total += 1
    if total == 0:
        raise InputError("No query sees two keys: the probe sentences are too short.")
    return Agreement(fraction=wins / total, n_queries=total // n_draws, n_draws=n_draws, same_sentence=same_sentence)


def _check_token(head: HeadQK, token_index: int) -> None:
    if not isinstance(token_index, int | np.integer) or not 0 <= int(token_index) < head.n_tokens:
        raise InputError(f"Token {token_index} is out of range: this probe set has tokens 0..{head.n_tokens - 1}.")

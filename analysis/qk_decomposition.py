"""Contrastive covariance decomposition of a head's query-key space, and its weight-space spectra.

Lee, Belinkov, Viégas & Wattenberg (2026), "Decomposing Query-Key Feature Interactions Using
Contrastive Covariances" (arXiv:2602.04752). For a labelled feature ``z`` and a head with queries
``q_i`` and keys ``k_j``:

    C+(z) = E[q_i k_jᵀ | key j shares z with query i]
    C-(z) = E[q_i k_jᵀ | key j differs from query i in z]
    ΔC(z) = C+(z) − C-(z)                                            (d_head × d_head)

over valid causal pairs (``j`` before ``i`` in the same sentence). Whatever the two conditions share
cancels; what is left is the feature's interaction. ``ΔC = U Σ Vᵀ`` (SVD): the number of singular
values above noise is the feature's rank, the first ``r`` left singular vectors span its query
subspace and the first ``r`` right singular vectors its key subspace. Attention logits
``scale · q_i · k_j`` are then attributed to those subspaces (:func:`attribute_logits`), and
projecting the query subspace out shows what attention does without the feature
(:func:`ablate_query_subspace`).

Which pairs count
-----------------
A feature turns the causal pairs of a probe set into positives, negatives and ignored pairs
(:class:`FeaturePairs`). Only queries with at least one positive *and* one negative key take part,
so both expectations average over the same queries. The key is never the query's own token.

- ``category`` (``features.json``) and user label files: a token may carry a *query label* and a
  *key label*. Positive: the query's label equals the key's label. Negative: the key carries a
  different label (``negatives="labelled"``), or any key without the query's label
  (``negatives="all"``; the default when the feature has a single key label).
- ``same_token``: positive when the key is an earlier occurrence of the query's token id.
- ``previous_token``: positive when the key is at position ``i − 1``.

User label files (CSV)
----------------------
UTF-8, a header row ``feature,side,label,match``, one rule per row; lines starting with ``#`` are
comments. Example (``data/probes/labels_example.csv``)::

    feature,side,label,match
    colour,both,colour,word:red|green|blue
    agent_verb,query,agent,regex:(is|was|has)
    agent_verb,key,agent,word:cat|dog|fox

- ``feature``: the feature's name; rows with the same name form one feature.
- ``side``: ``query``, ``key`` or ``both``: which role the rule labels a token for.
- ``label``: the value of the feature the rule gives.
- ``match``: ``word:a|b|c`` (whole words, case-insensitive), ``regex:PATTERN`` (a Python regular
  expression matching a whole word, case-insensitive) or ``token:TEXT`` (a token's display text
  exactly, e.g. ``token:·the``, with ``·`` for a space).

Words are runs of letters, digits, apostrophes and hyphens; a word's label goes to its *last*
token, where a causal model has read the whole word (``token:`` rules label that token itself).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from headscope.analysis.errors import InputError, check_layer
from headscope.analysis.models import LoadedModel
from headscope.analysis.qk_collect import HeadQK, ProbeTask, causal_softmax
from headscope.analysis.store import Store, content_key
from headscope.analysis.stored_results import loaded_by_prefix, stored_record, stored_result

Progress = Callable[[float], None] | None
MAX_PAIRS = 5_000_000
"""Most (query, key) pairs one decomposition reads (two [pairs, d_head] float32 arrays: ~2.5 GB)."""


class LabelFileError(InputError):
    """A label file that does not parse; the message gives the line and what to write instead."""


# ---------------------------------------------------------------------------------------------
# Features: rules, labels, pairs


@dataclass(frozen=True)
class LabelRule:
    """One row of a label file: tokens matching ``match`` get ``label`` on ``side``."""

    side: str
    label: str
    kind: str
    pattern: str
    line: int = 0

    def matches_word(self, word: str) -> bool:
        if self.kind == "word":
            return word.casefold() in {w.casefold() for w in self.pattern.split("|")}
        if self.kind == "regex":
            return re.fullmatch(self.pattern, word, flags=re.IGNORECASE) is not None
        return False


@dataclass(frozen=True)
class LabelFeature:
    """A feature defined by label rules (from a CSV file or a ``category`` task's lexicon)."""

    name: str
    rules: tuple[LabelRule, ...]
    negatives: str = "auto"


SIDES = ("query", "key", "both")
MATCH_KINDS = ("word", "regex", "token")


def parse_label_csv(source: str | Path) -> dict[str, LabelFeature]:
    """Parse a label file (format in the module docstring) into features, by name.

    Parameters
    ----------
    source : a path, or the CSV text itself (anything containing a newline is read as text).

    Raises
    ------
    LabelFileError
        With the line number: wrong header, unknown side or match kind, an empty label, a regular
        expression that does not compile, no rules at all.
    """
    if isinstance(source, Path) or "\n" not in str(source):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise LabelFileError(f"Cannot read the label file {path}: {e.strerror or e}.") from None
        except UnicodeDecodeError:
            raise LabelFileError(f"The label file {path} is not UTF-8 text.") from None
        name = path.name
    else:
        text, name = str(source), "label file"
    rows = [(n + 1, line) for n, line in enumerate(text.splitlines()) if line.strip() and not line.lstrip().startswith("#")]
    if not rows:
        raise LabelFileError(f"The {name} has no rows: write a header 'feature,side,label,match' and one rule per row.")
    header_line, header = rows[0]
    cols = [c.strip().lower() for c in next(csv.reader([header]))]
    if cols != ["feature", "side", "label", "match"]:
        raise LabelFileError(
            f"{name}, line {header_line}: the header must be 'feature,side,label,match' (got {header.strip()!r})."
        )
    features: dict[str, list[LabelRule]] = {}
    for line_no, line in rows[1:]:
        try:
            fields = next(csv.reader([line]))
        except csv.Error as e:
            raise LabelFileError(f"{name}, line {line_no}: {e}.") from None
        if len(fields) != 4:
            raise LabelFileError(
                f"{name}, line {line_no}: expected 4 fields (feature,side,label,match), got {len(fields)}. "
                "Quote a field that contains a comma."
            )
        feat, side, label, match = (f.strip() for f in fields)
        if not feat:
            raise LabelFileError(f"{name}, line {line_no}: the feature name is empty.")
        if side.lower() not in SIDES:
            raise LabelFileError(f"{name}, line {line_no}: side {side!r} must be one of query, key, both.")
        if not label:
            raise LabelFileError(f"{name}, line {line_no}: the label is empty.")
        kind, sep, pattern = match.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in MATCH_KINDS or not pattern:
            raise LabelFileError(
                f"{name}, line {line_no}: match {match!r} must be word:a|b|c, regex:PATTERN or token:TEXT."
            )
        if kind == "regex":
            try:
                re.compile(pattern)
            except re.error as e:
                raise LabelFileError(f"{name}, line {line_no}: the regular expression {pattern!r} does not compile ({e}).") from None
        features.setdefault(feat, []).append(LabelRule(side.lower(), label, kind, pattern, line_no))
    if not features:
        raise LabelFileError(f"The {name} has a header but no rules.")
    return {f: LabelFeature(f, tuple(r)) for f, r in features.items()}


def feature_from_task(task: ProbeTask) -> LabelFeature | str:
    """A probe task as a feature: a :class:`LabelFeature` for ``category`` tasks (each lexicon
    category a label on both sides), else the pair kind (``same_token`` or ``previous_token``)."""
    if task.kind == "category":
        rules = tuple(LabelRule("both", cat, "word", "|".join(words)) for cat, words in task.lexicon.items())
        return LabelFeature(task.name, rules, negatives="labelled")
    return task.kind


_WORD = re.compile(r"[\w'’-]+")


def token_labels(head: HeadQK, feature: LabelFeature) -> tuple[list[str | None], list[str | None]]:
    """Query and key label of every token of a probe set (``None``: unlabelled).

    Word rules label the last token overlapping the word (character spans from collection);
    ``token:`` rules label tokens whose display text is exactly the pattern. The first matching
    rule of a side wins.
    """
    n = head.n_tokens
    q_lab: list[str | None] = [None] * n
    k_lab: list[str | None] = [None] * n
    word_rules = [r for r in feature.rules if r.kind != "token"]
    token_rules = [r for r in feature.rules if r.kind == "token"]

    def give(t: int, rule: LabelRule) -> None:
        if rule.side in ("query", "both") and q_lab[t] is None:
            q_lab[t] = rule.label
        if rule.side in ("key", "both") and k_lab[t] is None:
            k_lab[t] = rule.label

    for t in range(n):
        for rule in token_rules:
            if head.tokens[t] == rule.pattern:
                give(t, rule)
    if word_rules:
        for s, text in enumerate(head.sentences):
            r = head.rows(s)
            ends = head.char_spans[r, 1]
            starts = head.char_spans[r, 0]
            for m in _WORD.finditer(text):
                rules = [rule for rule in word_rules if rule.matches_word(m.group())]
                if not rules:
                    continue
                overlap = np.flatnonzero((starts < m.end()) & (ends > m.start()))
                if len(overlap) == 0:
                    continue
                t = r.start + int(overlap[-1])
                for rule in rules:
                    give(t, rule)
    return q_lab, k_lab


@dataclass
class FeaturePairs:
    """Positive and negative (query, key) pairs of one feature over a probe set.

    ``query_index[p]`` and ``key_index[p]`` are token rows of the same sentence with the key
    strictly before the query; ``positive[p]`` says which condition the pair is in.
    """

    name: str
    query_index: np.ndarray
    key_index: np.ndarray
    positive: np.ndarray

    @property
    def n_positive(self) -> int:
        return int(self.positive.sum())

    @property
    def n_negative(self) -> int:
        return int((~self.positive).sum())


def feature_pairs(head: HeadQK, feature: LabelFeature | ProbeTask | str, *, negatives: str | None = None,
                  max_pairs: int = MAX_PAIRS) -> FeaturePairs:
    """The positive and negative causal pairs of ``feature`` over ``head``'s probe set.

    Parameters
    ----------
    feature : a :class:`LabelFeature`, a :class:`~headscope.analysis.qk_collect.ProbeTask`, or
        ``"same_token"`` / ``"previous_token"``.
    negatives : ``labelled`` (key carries a different label), ``all`` (any key without the query's
        label) or ``None`` (the feature's own setting; ``auto`` means ``labelled`` when there are at
        least two key labels, else ``all``).

    Raises
    ------
    InputError
        No positive or no negative pair (the message says what to add), too many pairs, an
        unknown feature kind.
    """
    if isinstance(feature, ProbeTask):
        feature = feature_from_task(feature)
    name = feature.name if isinstance(feature, LabelFeature) else str(feature)
    if isinstance(feature, LabelFeature):
        q_lab, k_lab = token_labels(head, feature)
        mode = negatives or feature.negatives
        if mode == "auto":
            mode = "labelled" if len({r.label for r in feature.rules if r.side in ("key", "both")}) >= 2 else "all"
        if mode not in ("labelled", "all"):
            raise InputError("negatives must be 'labelled', 'all' or 'auto'.")
        codes = {lab: c for c, lab in enumerate(sorted({x for x in q_lab + k_lab if x is not None}))}
        qc = np.array([codes[x] if x is not None else -1 for x in q_lab])
        kc = np.array([codes[x] if x is not None else -1 for x in k_lab])

        def sentence_pairs(r: slice) -> tuple[np.ndarray, np.ndarray]:
            a, b = qc[r], kc[r]
            pos = (a[:, None] >= 0) & (a[:, None] == b[None, :])
            neg = (a[:, None] >= 0) & (a[:, None] != b[None, :])
            if mode == "labelled":
                neg &= b[None, :] >= 0
            return pos, neg
    elif feature == "same_token":
        def sentence_pairs(r: slice) -> tuple[np.ndarray, np.ndarray]:
            t = head.token_ids[r]
            pos = t[:, None] == t[None, :]
            return pos, ~pos
    elif feature == "previous_token":
        def sentence_pairs(r: slice) -> tuple[np.ndarray, np.ndarray]:
            m = r.stop - r.start
            pos = np.eye(m, k=-1, dtype=bool)
            return pos, ~pos
    else:
        raise InputError(f"Unknown feature {feature!r}: give a label feature, a probe task, 'same_token' or "
                         "'previous_token'.")

    qi, kj, sign = [], [], []
    for s in range(len(head.sentences)):
        r = head.rows(s)
        m = r.stop - r.start
        pos, neg = sentence_pairs(r)
        before = np.tril(np.ones((m, m), dtype=bool), k=-1)  # key strictly before the query
        pos, neg = pos & before, neg & before & ~pos
        usable = pos.any(1) & neg.any(1)
        pos &= usable[:, None]
        neg &= usable[:, None]
        for mask, flag in ((pos, True), (neg, False)):
            a, b = np.nonzero(mask)
            qi.append(a + r.start)
            kj.append(b + r.start)
            sign.append(np.full(len(a), flag))
    pairs = FeaturePairs(name, np.concatenate(qi).astype(np.int64), np.concatenate(kj).astype(np.int64),
                         np.concatenate(sign).astype(bool))
    if pairs.n_positive == 0:
        raise InputError(
            f"Feature {name!r} has no positive pairs in this probe set: no query has an earlier key that "
            "shares its value (and another that does not). Add sentences where two tokens with the same "
            "label occur, or check the labels."
        )
    if pairs.n_negative == 0:
        raise InputError(
            f"Feature {name!r} has no negative pairs: every labelled key shares the query's label. Add "
            "tokens with other labels, or use negatives='all'."
        )
    if len(pairs.positive) > max_pairs:
        raise InputError(f"Feature {name!r} has {len(pairs.positive):,} pairs, over the limit of {max_pairs:,}. "
                         "Use fewer or shorter sentences.")
    return pairs


# ---------------------------------------------------------------------------------------------
# The decomposition


@dataclass
class QKDecomposition:
    """The SVD of one feature's contrastive covariance ``ΔC = U Σ Vᵀ`` (Lee et al. 2026).

    Attributes
    ----------
    delta_c : ``[d, d]`` ``C+ − C-``; rows index query dimensions, columns key dimensions.
    singular_values : ``[d]`` ``Σ``, descending.
    rank : the feature's rank by ``rank_criterion``.
    query_basis : ``[d, rank]`` first left singular vectors (the query subspace, orthonormal).
    key_basis : ``[d, rank]`` first right singular vectors (the key subspace, orthonormal).
    null_threshold : the noise level singular values were compared with (criterion ``null``).
    """

    feature: str
    delta_c: np.ndarray
    c_positive: np.ndarray
    c_negative: np.ndarray
    singular_values: np.ndarray
    left: np.ndarray
    right: np.ndarray
    rank: int
    rank_criterion: str
    null_threshold: float
    null_top: np.ndarray
    n_positive: int
    n_negative: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def query_basis(self) -> np.ndarray:
        return self.left[:, : self.rank]

    @property
    def key_basis(self) -> np.ndarray:
        return self.right[:, : self.rank]

    @property
    def energy(self) -> np.ndarray:
        """Cumulative share of ``Σ σ²`` in the first 1, 2, ... singular values."""
        s2 = self.singular_values.astype(np.float64) ** 2
        return np.cumsum(s2) / max(s2.sum(), 1e-300)


def contrastive_covariance(q: np.ndarray, k: np.ndarray, pairs: FeaturePairs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ΔC, C+, C-)`` with ``C± = mean over ± pairs of q_i k_jᵀ`` (Lee et al. 2026, Eq. for ΔC).

    Parameters
    ----------
    q, k : ``[token, d]`` queries and keys (one head and its key-value group).
    pairs : from :func:`feature_pairs`.
    """
    qp = np.asarray(q, dtype=np.float64)[pairs.query_index]
    kp = np.asarray(k, dtype=np.float64)[pairs.key_index]
    return _delta(qp, kp, pairs.positive)


def _delta(qp: np.ndarray, kp: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w_pos = positive / positive.sum()
    w_neg = (~positive) / (~positive).sum()
    c_pos = qp.T @ (kp * w_pos[:, None])
    c_neg = qp.T @ (kp * w_neg[:, None])
    return c_pos - c_neg, c_pos, c_neg


RANK_CRITERIA = ("null", "energy")


def decompose(
    q: np.ndarray,
    k: np.ndarray,
    pairs: FeaturePairs,
    *,
    rank: int | None = None,
    criterion: str = "null",
    n_permutations: int = 20,
    energy: float = 0.9,
    seed: int = 0,
    progress: Progress = None,
) -> QKDecomposition:
    """Contrastive covariance decomposition of one feature (Lee et al. 2026).

    ``ΔC = C+ − C-`` (:func:`contrastive_covariance`), then ``ΔC = U Σ Vᵀ``. The rank is

    - ``rank`` when given;
    - criterion ``null`` (default): the number of singular values above the noise level, taken as
      the largest singular value of ``ΔC`` recomputed with the positive/negative labels shuffled
      among the same pairs, maximised over ``n_permutations`` seeded shuffles (a permutation
      version of Horn's 1965 parallel analysis; with 20 shuffles, a singular value this large
      arises by chance with probability about 1/21);
    - criterion ``energy``: the fewest singular values holding ``energy`` of ``Σ σ²``.

    Returns
    -------
    QKDecomposition, with the query subspace ``U[:, :r]`` and key subspace ``V[:, :r]``.
    """
    if criterion not in RANK_CRITERIA:
        raise InputError(f"Unknown rank criterion {criterion!r}: use one of {', '.join(RANK_CRITERIA)}.")
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.ndim != 2 or q.shape != k.shape:
        raise InputError(f"Queries and keys must be [token, d] arrays of one shape; got {q.shape} and {k.shape}.")
    if pairs.n_positive == 0 or pairs.n_negative == 0:
        raise InputError(f"Feature {pairs.name!r} needs positive and negative pairs "
                         f"(has {pairs.n_positive} and {pairs.n_negative}).")
    d = q.shape[1]
    qp, kp = q[pairs.query_index], k[pairs.key_index]
    delta, c_pos, c_neg = _delta(qp, kp, pairs.positive)
    u, s, vt = np.linalg.svd(delta)
    rng = np.random.default_rng(seed)
    null_top = np.zeros(0)
    threshold = float("nan")
    if criterion == "null" or rank is None:
        tops = []
        for n in range(n_permutations if criterion == "null" else 0):
            perm = rng.permutation(pairs.positive)
            tops.append(np.linalg.svd(_delta(qp, kp, perm)[0], compute_uv=False)[0])
            if progress:
                progress((n + 1) / (n_permutations + 1))
        null_top = np.asarray(tops)
        if criterion == "null":
            threshold = float(null_top.max()) if len(null_top) else 0.0
    if rank is not None:
        if not 0 <= int(rank) <= d:
            raise InputError(f"rank must be between 0 and {d}.")
        r, used = int(rank), "given"
    elif criterion == "null":
        r, used = int((s > threshold).sum()), "null"
    else:
        if not 0 < energy <= 1:
            raise InputError("energy must be in (0, 1].")
        cum = np.cumsum(s**2) / max((s**2).sum(), 1e-300)
        r, used = int(np.searchsorted(cum, energy - 1e-12) + 1), "energy"
    if progress:
        progress(1.0)
    return QKDecomposition(
        feature=pairs.name, delta_c=delta, c_positive=c_pos, c_negative=c_neg, singular_values=s, left=u,
        right=vt.T, rank=r, rank_criterion=used, null_threshold=threshold, null_top=null_top,
        n_positive=pairs.n_positive, n_negative=pairs.n_negative,
        params={"criterion": criterion, "n_permutations": n_permutations, "energy": energy, "seed": seed},
    )


def decompose_head(head: HeadQK, feature: LabelFeature | ProbeTask | str, *, negatives: str | None = None,
                   **kwargs: Any) -> QKDecomposition:
    """:func:`feature_pairs` then :func:`decompose` on one head's queries and keys.

    Post-rotary vectors (the default of :func:`~headscope.analysis.qk_collect.collect_head`) decompose the
    logits the model actually computes; pre-rotary ones, the interaction before position enters.
    """
    pairs = feature_pairs(head, feature, negatives=negatives)
    return decompose(head.q, head.k, pairs, **kwargs)


# ---------------------------------------------------------------------------------------------
# Attribution and intervention


@dataclass
class LogitAttribution:
    """Each logit split into feature terms, a cross term and a residual that sum to it exactly.

    ``logits = Σ_f terms[f] + cross + residual`` (all ``[pair]`` arrays, already multiplied by the
    layer's scale; before any soft-capping, which is not linear).
    """

    logits: np.ndarray
    terms: dict[str, np.ndarray]
    cross: np.ndarray
    residual: np.ndarray

    def total(self) -> np.ndarray:
        return sum(self.terms.values(), np.zeros_like(self.logits)) + self.cross + self.residual


def _orthogonalise(bases: Sequence[np.ndarray], d: int) -> list[np.ndarray]:
    """Gram-Schmidt of subspaces in order: each keeps only what is new relative to those before."""
    out: list[np.ndarray] = []
    acc = np.zeros((d, 0))
    for b in bases:
        b = np.asarray(b, dtype=np.float64).reshape(d, -1)
        if acc.shape[1]:
            b = b - acc @ (acc.T @ b)
        if b.shape[1] == 0:
            out.append(np.zeros((d, 0)))
            continue
        u, s, _ = np.linalg.svd(b, full_matrices=False)
        keep = u[:, s > 1e-8 * max(1.0, s.max(initial=0.0))]
        out.append(keep)
        acc = np.concatenate([acc, keep], axis=1)
    return out


def attribute_logits(
    q: np.ndarray,
    k: np.ndarray,
    decompositions: Sequence[QKDecomposition],
    *,
    scale: float,
) -> LogitAttribution:
    """Attribute logits ``q · k · scale`` to feature subspaces (Lee et al. 2026, Sec. on attribution).

    With query bases ``U_f`` and key bases ``V_f`` of features ``f`` (orthogonalised in the order
    given, so a later feature only gets what earlier ones do not span), write
    ``q = Σ_f P_f q + q_r`` and ``k = Σ_f Q_f k + k_r`` (``P_f``, ``Q_f`` orthogonal projectors). Then

        q · k = Σ_f (P_f q) · (Q_f k)              feature terms: both sides in feature f
              + Σ_{f≠g} (P_f q) · (Q_g k) + Σ_f [(P_f q) · k_r + q_r · (Q_f k)]     cross
              + q_r · k_r                          residual

    exactly. Parameters: ``q``, ``k`` are ``[pair, d]`` (row ``p`` of each makes logit ``p``);
    ``scale`` is the layer's logit scale (:attr:`HeadQK.scale`).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.shape != k.shape or q.ndim != 2:
        raise InputError(f"q and k must be [pair, d] arrays of one shape; got {q.shape} and {k.shape}.")
    d = q.shape[1]
    scale = float(scale)
    names = [dc.feature for dc in decompositions]
    if len(set(names)) != len(names):
        raise InputError("Two decompositions have the same feature name; attribute each feature once.")
    ub = _orthogonalise([dc.query_basis for dc in decompositions], d)
    vb = _orthogonalise([dc.key_basis for dc in decompositions], d)
    q_parts = [q @ u @ u.T for u in ub]
    k_parts = [k @ v @ v.T for v in vb]
    q_r = q - sum(q_parts, np.zeros_like(q))
    k_r = k - sum(k_parts, np.zeros_like(k))
    terms = {}
    cross = np.zeros(len(q))
    for f, qf in enumerate(q_parts):
        for g, kg in enumerate(k_parts):
            v = np.einsum("pd,pd->p", qf, kg) * scale
            if f == g:
                terms[names[f]] = v
            else:
                cross += v
        cross += np.einsum("pd,pd->p", qf, k_r) * scale
    for kg in k_parts:
        cross += np.einsum("pd,pd->p", q_r, kg) * scale
    residual = np.einsum("pd,pd->p", q_r, k_r) * scale
    logits = np.einsum("pd,pd->p", q, k) * scale
    return LogitAttribution(logits=logits, terms=terms, cross=cross, residual=residual)


def attribute_sentence(head: HeadQK, sentence: int, decompositions: Sequence[QKDecomposition]) -> dict[str, np.ndarray]:
    """:func:`attribute_logits` for every causal (query, key) pair of one sentence.

    Returns ``[query, key]`` arrays (NaN above the diagonal): ``logits``, one per feature name,
    ``cross`` and ``residual``. Uses the head's analysis vectors (``q``/``k``); with post-rotary
    vectors ``logits`` equals :meth:`HeadQK.logits`.
    """
    r = head.rows(sentence)
    m = r.stop - r.start
    a, b = np.tril_indices(m)
    att = attribute_logits(head.q[r][a], head.k[r][b], decompositions, scale=head.scale)
    out = {}
    for name, v in [("logits", att.logits), *att.terms.items(), ("cross", att.cross), ("residual", att.residual)]:
        grid = np.full((m, m), np.nan)
        grid[a, b] = v
        out[name] = grid
    return out


@dataclass
class Intervention:
    """One head's attention on one sentence before and after projecting a subspace out of the queries."""

    sentence: int
    before: np.ndarray
    after: np.ndarray


def ablate_query_subspace(head: HeadQK, basis: np.ndarray | QKDecomposition, sentence: int) -> Intervention:
    """Project a subspace out of the queries and recompute this head's attention on one sentence.

    ``q' = (I − U Uᵀ) q`` with ``U`` an orthonormal basis (a decomposition's query subspace);
    ``A' = softmax(scale · q' · k)`` over the causal keys (:meth:`HeadQK.scores`). Only this head's pattern changes:
    later layers are not recomputed. Needs post-rotary vectors (the subspace must live where the
    logits are computed).
    """
    if not head.rotary:
        raise InputError("Interventions need post-rotary queries and keys: collect the head with rotary=True.")
    u = basis.query_basis if isinstance(basis, QKDecomposition) else np.asarray(basis, dtype=np.float64)
    if u.ndim != 2 or u.shape[0] != head.d_head:
        raise InputError(f"The basis must be [d_head={head.d_head}, r]; got {u.shape}.")
    u = _orthogonalise([u], head.d_head)[0]
    r = head.rows(sentence)
    q = head.q_rot[r].astype(np.float64)
    q = q - (q @ u) @ u.T
    return Intervention(sentence, head.attention(sentence), causal_softmax(head.scores(q, head.k_rot[r])))


@dataclass(frozen=True)
class InterventionEffect:
    """Mean attention a query gives to its positive keys, before and after the intervention."""

    positive_before: float
    positive_after: float
    negative_before: float
    negative_after: float
    n_queries: int


def intervention_effect(head: HeadQK, decomposition: QKDecomposition, pairs: FeaturePairs) -> InterventionEffect:
    """Over the queries of ``pairs``: summed attention on positive (and negative) keys per query,
    averaged, before and after :func:`ablate_query_subspace` with the feature's query subspace."""
    pos_b, pos_a, neg_b, neg_a = [], [], [], []
    queries = np.unique(pairs.query_index)
    by_sentence: dict[int, list[int]] = {}
    for i in queries:
        by_sentence.setdefault(int(head.sentence_index[i]), []).append(int(i))
    for s, qs in by_sentence.items():
        iv = ablate_query_subspace(head, decomposition, s)
        start = int(head.offsets[s])
        for i in qs:
            sel = pairs.query_index == i
            keys, sign = pairs.key_index[sel] - start, pairs.positive[sel]
            row_b, row_a = iv.before[i - start], iv.after[i - start]
            pos_b.append(row_b[keys[sign]].sum())
            pos_a.append(row_a[keys[sign]].sum())
            neg_b.append(row_b[keys[~sign]].sum())
            neg_a.append(row_a[keys[~sign]].sum())
    return InterventionEffect(float(np.mean(pos_b)), float(np.mean(pos_a)), float(np.mean(neg_b)),
                              float(np.mean(neg_a)), len(queries))


# ---------------------------------------------------------------------------------------------
# Weight space


def wqk_spectra(model: LoadedModel, layers: Sequence[int] | None = None, *, fold_ln: bool = True,
                store: Store | None = None, progress: Progress = None) -> np.ndarray:
    """Singular values of ``W_QK = W_Q W_Kᵀ`` per layer and query head, ``[layer, head, d_head]``.

    ``W_Q[l, h]`` is ``[d_model, d_head]`` (the bridge's ``W_Q``); with grouped-query attention the
    key weights are those of head ``h``'s key-value group (``W_K[l, h // (H / H_kv)]``). The
    ``d_model × d_model`` product has rank ``d_head`` and is never formed: with ``W_Q = Q_q R_q`` and
    ``W_K = Q_k R_k`` (thin QR), ``W_QK = Q_q (R_q R_kᵀ) Q_kᵀ`` has the singular values of the
    ``d_head × d_head`` core ``R_q R_kᵀ``: the same numbers as TransformerLens'
    ``FactoredMatrix(W_Q, W_Kᵀ).S`` (checked in the tests), without its two full SVDs per head.
    ``fold_ln`` multiplies the rows of ``W_Q`` and ``W_K`` by the attention input norm's gain
    (RMSNorm/LayerNorm weight), so the form acts on the normalised residual stream; biases are
    left out. With ``store``, the result is kept under (model digest, layers, ``fold_ln``).

    Rotary position embeddings: the logit is ``x_iᵀ W_Q R_{i−j} W_Kᵀ x_j`` with a rotation
    ``R`` that depends on the offset ``i − j``, so the bilinear form is position-dependent and
    ``W_QK`` (``R = I``, offset 0) describes the *pre-rotary* interaction only.
    """
    import torch

    b = model.bridge
    layers = list(range(model.n_layers)) if layers is None else [int(x) for x in layers]
    for layer in layers:
        check_layer(model.n_layers, layer)
    key = content_key("wqk_spectra", 1, model.digest, layers, fold_ln)
    if (stored := stored_result(store, key, _stored_spectra, progress)) is not None:
        return stored
    out = np.zeros((len(layers), model.n_heads, model.d_head))
    with torch.no_grad():
        w_q_all, w_k_all = b.W_Q, b.W_K  # [L, H, d_model, d_head], [L, H_kv, d_model, d_head]
        kv = torch.tensor([model.kv_head(h) for h in range(model.n_heads)])
        for n, layer in enumerate(layers):
            w_q = w_q_all[layer].detach().to(torch.float64)
            w_k = w_k_all[layer].detach().to(torch.float64)[kv]
            if fold_ln:
                gain = _ln_gain(b, layer)
                if gain is not None:
                    w_q = w_q * gain[None, :, None]
                    w_k = w_k * gain[None, :, None]
            r_q = torch.linalg.qr(w_q, mode="r")[1]
            r_k = torch.linalg.qr(w_k, mode="r")[1]
            out[n] = torch.linalg.svdvals(r_q @ r_k.transpose(-1, -2)).numpy()
            if progress:
                progress((n + 1) / len(layers))
    if store is not None:
        store.put(key, "wqk_spectra", {"model_name": model.name, "layers": layers, "fold_ln": fold_ln},
                  {"spectra": out})
    return out


def _stored_spectra(store: Store, key: str) -> np.ndarray | None:
    rec = stored_record(store, key, "wqk_spectra")
    return None if rec is None else rec.array("spectra", mmap=False)


def _ln_gain(bridge: Any, layer: int):
    import torch

    ln = getattr(bridge.blocks[layer], "ln1", None)
    w = getattr(ln, "w", None) if ln is not None else None
    if w is None:
        w = getattr(getattr(ln, "original_component", None), "weight", None)
    return None if w is None else w.detach().to(torch.float64)


def effective_rank(singular_values: np.ndarray, axis: int = -1) -> np.ndarray:
    """Entropy effective rank (Roy & Vetterli 2007, "The effective rank: a measure of effective
    dimensionality"): ``exp(−Σ p_i log p_i)`` with ``p_i = σ_i / Σ_j σ_j``. Between 1 (one
    direction) and the number of non-zero singular values (all equal); 0 for an all-zero matrix."""
    s = np.abs(np.asarray(singular_values, dtype=np.float64))
    total = s.sum(axis=axis, keepdims=True)
    p = np.divide(s, total, out=np.zeros_like(s), where=total > 0)
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=axis)
    return np.where(np.squeeze(total, axis=axis) > 0, np.exp(h), 0.0)


def effective_rank_map(model: LoadedModel, *, fold_ln: bool = True, store: Store | None = None,
                       progress: Progress = None) -> np.ndarray:
    """``[layer, head]`` entropy effective rank (Roy & Vetterli 2007) of every head's ``W_QK``
    (:func:`wqk_spectra`; pre-rotary interaction only)."""
    return effective_rank(wqk_spectra(model, fold_ln=fold_ln, store=store, progress=progress))


def store_labels(store: Store, text: str, filename: str = "") -> tuple[str, dict[str, LabelFeature]]:
    """Parse a label file (:func:`parse_label_csv`) and keep its text; returns (key, features)."""
    features = parse_label_csv(text if "\n" in text else text + "\n")
    key = content_key("qk_labels", text)
    store.put(key, "qk_labels", {"text": text, "filename": filename, "features": list(features)}, {})
    return key, features


def stored_labels(store: Store, key: str) -> dict[str, LabelFeature]:
    """Features of a label file stored by :func:`store_labels` under ``key`` (or its prefix)."""
    found = loaded_by_prefix(store, key, partial(stored_record, kind="qk_labels"))
    if found is None:
        raise InputError(f"No uploaded label file has the id {key!r}: upload it again.")
    return parse_label_csv(found[1].meta["text"])

"""Two stored runs, head by head: the difference of a per-head score, and of one head's attention.

What changes between two prompts on one model (a clean and a corrupted prompt, a name swapped, a
fact changed), or between two models on one prompt (a base model and its fine-tune, which share a
tokenizer)? Activation patching (:mod:`analysis.patching`) says which heads *cause* a change in the
output; this says where each head's *behaviour* changes. Every difference is **second − first**.

Both runs must have the same number of tokens, so that position ``i`` is one position in both (as
activation patching needs, Heimersheim & Nanda 2024, §2), and models of the same shape (layers ×
query heads). Two different models must also have tokenized the text alike (equal token ids): the
same text under two tokenizers gives positions that do not correspond. The per-head score is any
:data:`analysis.head_summary.HEAD_METRICS` both runs can compute (full patterns or statistics mode,
:class:`analysis.runs.AttentionRun`); a head's attention difference is ``A₂[l, h] − A₁[l, h]``, of the
patterns, or of the block means when both runs kept pooled maps of the same block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.errors import InputError, check_head_index
from analysis.runs import AttentionRun

TWO_PROMPTS = "two prompts on one model"
TWO_MODELS = "one prompt on two models"
ONE_TEXT = "one text on one model"  # the same tokens on the same model: a rerun, or other settings
SAME_RUN = "one run with itself"


@dataclass(frozen=True)
class HeadChange:
    """One head's score in both runs and its change (second − first)."""

    layer: int
    head: int
    first: float
    second: float

    @property
    def change(self) -> float:
        return self.second - self.first


@dataclass(frozen=True)
class RunComparison:
    """A per-head score of two runs (``[layer, head]`` each) and where their tokens differ."""

    first: AttentionRun
    second: AttentionRun
    metric: str
    first_scores: np.ndarray
    second_scores: np.ndarray
    differ: tuple[int, ...]  # positions whose token ids differ
    kind: str  # TWO_PROMPTS, TWO_MODELS, ONE_TEXT or SAME_RUN

    @property
    def difference(self) -> np.ndarray:
        """``[layer, head]`` second − first (nan where either score is nan)."""
        return self.second_scores - self.first_scores

    def largest_changes(self, k: int = 10) -> list[HeadChange]:
        """The ``k`` heads whose score changed most (by absolute change; heads with a nan score last)."""
        diff = self.difference
        order = np.argsort(-np.nan_to_num(np.abs(diff), nan=-1.0), axis=None, kind="stable")[:k]
        return [HeadChange(int(i // diff.shape[1]), int(i % diff.shape[1]),
                           float(self.first_scores.flat[i]), float(self.second_scores.flat[i])) for i in order]


def _comparable(first: AttentionRun, second: AttentionRun) -> tuple[tuple[int, ...], str]:
    if (first.n_layers, first.n_heads) != (second.n_layers, second.n_heads):
        raise InputError(f"The runs' models differ in shape ({first.n_layers} layers × {first.n_heads} heads against "
                         f"{second.n_layers} × {second.n_heads}): their heads do not correspond.")
    if first.n_tokens != second.n_tokens:
        raise InputError(f"The runs have {first.n_tokens} and {second.n_tokens} tokens: compare runs of equal "
                         "length, so that each position is the same position in both (pad or shorten one text).")
    differ = tuple(int(i) for i in np.flatnonzero(np.asarray(first.token_ids) != np.asarray(second.token_ids)))
    same_model = first.model_digest == second.model_digest
    if not same_model and differ:
        raise InputError(f"The runs come from two models ({first.model_name}, {second.model_name}) and their tokens "
                         f"differ at {len(differ)} position(s): compare one text on two models that share a "
                         "tokenizer, or two texts on one model.")
    kind = (TWO_PROMPTS if differ else ONE_TEXT) if same_model else TWO_MODELS
    return differ, kind


def compare_runs(first: AttentionRun, second: AttentionRun, metric: str) -> RunComparison:
    """Per-head ``metric`` of both runs and its change; an ``InputError`` when the runs do not
    correspond position by position and head by head (see the module docstring) or a run cannot
    compute ``metric``."""
    differ, kind = _comparable(first, second)
    common = [m for m in first.metrics if m in second.metrics]
    for name, run in (("first", first), ("second", second)):
        if metric not in run.metrics:
            raise InputError(f"The {name} run ({run.mode}) cannot compute {metric!r}; "
                             + (f"choose one of: {', '.join(common)}." if common else
                                "no per-head score is computable on both runs."))
    if first.key == second.key:
        kind = SAME_RUN
    return RunComparison(first, second, metric, np.asarray(first.head_scores(metric), dtype=float),
                         np.asarray(second.head_scores(metric), dtype=float), differ, kind)


def attention_difference(first: AttentionRun, second: AttentionRun, layer: int, head: int) -> np.ndarray:
    """``A₂[l, h] − A₁[l, h]`` (float32): of the full patterns, or of the means per ``B × B`` block when
    both runs kept pooled maps of the same block size ``B``. Future keys are 0 in both runs, so 0 above
    the diagonal (figures blank them)."""
    _comparable(first, second)
    layer, head = check_head_index(first.n_layers, first.n_heads, layer, head)
    if first.block_size != second.block_size:
        raise InputError(f"One run keeps {first.mode} (blocks of {first.block_size}) and the other {second.mode} "
                         f"(blocks of {second.block_size}): their attention maps do not align. Run both in the "
                         "same mode.")
    return (np.asarray(second.attention_overview(layer, head), dtype=np.float32)
            - np.asarray(first.attention_overview(layer, head), dtype=np.float32))

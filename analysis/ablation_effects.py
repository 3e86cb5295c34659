"""The effects of ablating a set of heads on one text: the user action of the Ablation page's *Apply*
and of ``headscope ablate``.

:func:`apply` computes, in order:

1. the heads, from what a user writes (``12.3``, ``L12H3``, ``kv:12.1`` for a key-value group's query
   heads, ``12.*`` for a layer: :func:`headscope.analysis.ablation.parse_heads`), checked against the model;
2. the method's reference, where it needs one (:func:`prepare`), stored so that asking again loads it:

   - ``mean``: ``z̄[l, h] = (1/N) Σ_r Σ_i z_r[l, h]_i`` over every position of a reference set (Wang et
     al. 2022, "Interpretability in the Wild", arXiv:2211.00593, §3; :func:`headscope.analysis.ablation.head_means`),
     by default the first :data:`REFERENCE_SENTENCES` built-in probe sentences (:func:`builtin_reference`);
   - ``resample``: the clean run of a source input whose head outputs are patched in position by
     position (Chan et al. 2022, "Causal Scrubbing"); a source text is captured and stored, so a link
     can name it;

3. the effects (:func:`headscope.analysis.ablation.ablation_effects`, every method as its module docstring
   writes it): the per-token loss ``ℓ_i = −log p(t_i | t_<i)`` of the clean and the ablated model, the
   logit and probability of the clean model's next-token prediction after the last token, the top 5
   at every position, and greedy continuations of :data:`CONTINUATION_TOKENS` tokens;
4. the changes a user reads (:class:`AppliedAblation`): ``Δloss = mean_{i≥1} ℓ_i(ablated) − mean_{i≥1}
   ℓ_i(clean)`` and ``Δp = p_ablated − p_clean`` of that next token.

The page's job calls :func:`apply`; the CLI calls its two halves, :func:`prepare` and :func:`effects_on`
(the second only when it measures a text); both only translate inputs and draw or write the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from headscope.analysis.ablation import (
    LIMIT,
    AblationEffects,
    AblationSpec,
    Head,
    HeadMeans,
    ablation_effects,
    head_means,
    parse_heads,
)
from headscope.analysis.ablation_choices import METHODS
from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError, check_head_index, shown
from headscope.analysis.limits import limit
from headscope.analysis.models import LoadedModel
from headscope.analysis.runs import AttentionRun
from headscope.analysis.store import Store

Progress = Callable[[float], None]
CONTINUATION_TOKENS = 20  # the greedy continuations' length, clean and ablated
REFERENCE_SENTENCES = 100  # the built-in mean-ablation reference: the first sentences of data/probes


def builtin_reference() -> list[str]:
    """The default reference set of mean ablation: the first :data:`REFERENCE_SENTENCES` built-in probe
    sentences (``data/probes/sentences.txt``, its ``#`` header lines left out)."""
    from headscope.analysis.paths import DATA_DIR

    lines = (DATA_DIR / "probes" / "sentences.txt").read_text(encoding="utf-8").splitlines()
    return [t for t in lines if t.strip() and not t.startswith("#")][:REFERENCE_SENTENCES]


@dataclass(frozen=True)
class PreparedAblation:
    """An ablation ready to run: its spec (heads, method, reference) and the stored source run's key.

    Attributes
    ----------
    spec : the heads (sorted, without repeats), the method and what it needs, checked against the model.
    source_key : the store key of the source run captured from a source text (``resample``); None
        otherwise, and when the source was given as token ids.
    """

    spec: AblationSpec
    source_key: str | None = None

    @property
    def means_key(self) -> str | None:
        """The store key of the reference means (``mean``), else None."""
        return self.spec.means.key if self.spec.means is not None else None


@dataclass(frozen=True)
class AppliedAblation:
    """The effects of an ablation on one text, and the changes a user reads.

    Attributes
    ----------
    spec, source_key : as :class:`PreparedAblation` holds them.
    effects : per-token losses, top-k, the next token's logit and probability, continuations.
    """

    spec: AblationSpec
    effects: AblationEffects
    source_key: str | None = None

    @property
    def means_key(self) -> str | None:
        """The store key of the reference means (``mean``), else None."""
        return self.spec.means.key if self.spec.means is not None else None

    @property
    def loss_clean(self) -> float:
        """Mean next-token loss of the clean model, ``mean_{i≥1} −log p(t_i | t_<i)`` (nats)."""
        return self.effects.mean_loss_clean

    @property
    def loss_ablated(self) -> float:
        """The same with the heads ablated."""
        return self.effects.mean_loss_ablated

    @property
    def d_loss(self) -> float:
        """``loss_ablated − loss_clean``: how much worse (> 0) the text is predicted without the heads."""
        return self.loss_ablated - self.loss_clean

    @property
    def p_next_clean(self) -> float:
        """The clean model's probability of its own next-token prediction after the last token."""
        return self.effects.target_prob_clean

    @property
    def p_next_ablated(self) -> float:
        """The ablated model's probability of that same token."""
        return self.effects.target_prob_ablated

    @property
    def d_p_next(self) -> float:
        """``p_next_ablated − p_next_clean``."""
        return self.p_next_ablated - self.p_next_clean


def _heads(model: LoadedModel, heads: str | Sequence[Head]) -> list[Head]:
    """The query heads ``heads`` names (text as :func:`parse_heads` reads it, or ``(layer, head)`` pairs)."""
    if isinstance(heads, str):
        chosen = parse_heads(model, heads)
    else:
        try:
            pairs = [(layer, head) for layer, head in heads]
        except (TypeError, ValueError):
            raise InputError("Give the heads as text (e.g. 12.3, kv:14.1) or as (layer, head) pairs.") from None
        chosen = [check_head_index(model.n_layers, model.n_heads, layer, head) for layer, head in pairs]
    if not chosen:
        raise InputError("No heads to ablate: name one or more, e.g. 12.3, L14H1, kv:20.2 or 7.*.")
    return chosen


def _token_ids(ids: Sequence[int]) -> list[int]:
    """Token ids as given, each a whole number (a float or a bool is not a token id)."""
    try:
        out = list(ids)
    except TypeError:
        raise InputError("Give the source as a text or as a list of token ids.") from None
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int | np.integer)]
    if bad:
        raise InputError(f"Source token ids must be whole numbers, got {shown(bad[0])}.")
    return [int(i) for i in out]


def prepare(
    model: LoadedModel,
    heads: str | Sequence[Head],
    method: str = "zero",
    *,
    source: str | Sequence[int] | None = None,
    reference: Sequence[str | Sequence[int]] | None = None,
    means: HeadMeans | None = None,
    store: Store | None = None,
    progress: Progress | None = None,
) -> PreparedAblation:
    """The spec of ablating ``heads`` by ``method``, with the reference the method needs (module docstring).

    Parameters
    ----------
    heads : text (``"12.3, kv:14.1, 7.*"``) or ``(layer, head)`` pairs; at least one.
    method : one of :data:`headscope.analysis.ablation_choices.METHODS`.
    source : ``resample`` only, and required there: a source text (captured, at most
        ``HEADSCOPE_MAX_ABLATION_TOKENS`` tokens, and stored) or token ids (a stored run's, used as given).
    reference : ``mean`` only: the reference texts or token-id lists (None: :func:`builtin_reference`).
    means : ``mean`` only: means already computed (a stored set a link names), used instead of ``reference``.
    store : where the source run and the means are stored, and read back from.
    progress : ``progress(fraction)`` of the reference texts (``mean``) as each is run.

    Raises
    ------
    InputError
        An unknown method, no heads or heads outside the model, an option the method does not take,
        or an empty source.
    """
    if not isinstance(method, str) or method not in METHODS:
        raise InputError(f"Unknown ablation method {shown(method)}: choose one of {', '.join(METHODS)}.")
    chosen = _heads(model, heads)
    if source is not None and method != "resample":
        raise InputError("A source input is used only by resample ablation.")
    if (reference is not None or means is not None) and method != "mean":
        raise InputError("A reference set is used only by mean ablation.")
    source_ids = source_key = None
    if method == "resample":
        if source is None or isinstance(source, str) and not source.strip():
            raise InputError("Resample ablation needs a source input: another text, e.g. the same sentence "
                             "with other names.")
        if isinstance(source, str):
            run = capture(model, source, store=store, max_tokens=limit(LIMIT), max_tokens_variable=LIMIT)
            source_ids, source_key = tuple(run.token_ids), run.key
        else:
            source_ids = tuple(_token_ids(source))
    if method == "mean" and means is None:
        if isinstance(reference, str):
            raise InputError("Give the reference set as a list of texts, one per input.")
        means = head_means(model, builtin_reference() if reference is None else list(reference), store=store,
                           progress=progress)
    spec = AblationSpec(tuple(chosen), method, means=means, source_ids=source_ids)
    spec.validate(model)
    return PreparedAblation(spec, source_key)


def effects_on(
    model: LoadedModel,
    run: AttentionRun,
    prepared: PreparedAblation,
    *,
    max_new_tokens: int = CONTINUATION_TOKENS,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> AppliedAblation:
    """The effects of the ``prepared`` ablation on ``run``'s text (module docstring, steps 3 and 4).

    Parameters
    ----------
    run : the text's captured run: its token ids, and its top prediction after the last token, whose
        logit and probability the effects follow.
    max_new_tokens : the greedy continuations' length (0: none).
    progress : ``progress(fraction)`` of the steps (the clean and the ablated pass, then the two
        continuations), 0 as they begin.
    cancel : checked before and during the continuations; a cancelled run leaves them short.
    """
    if progress:
        progress(0.0)
    effects = ablation_effects(model, run.token_ids, prepared.spec, target_position=-1,
                               target_token=int(run.top_ids[-1, 0]), max_new_tokens=max_new_tokens,
                               progress=progress, cancel=cancel)
    return AppliedAblation(prepared.spec, effects, prepared.source_key)


def apply(
    model: LoadedModel,
    run: AttentionRun,
    heads: str | Sequence[Head],
    method: str = "zero",
    *,
    source: str | Sequence[int] | None = None,
    reference: Sequence[str | Sequence[int]] | None = None,
    means: HeadMeans | None = None,
    max_new_tokens: int = CONTINUATION_TOKENS,
    store: Store | None = None,
    progress: Progress | None = None,
    reference_progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> AppliedAblation:
    """Ablate ``heads`` by ``method`` on ``run``'s text: the reference the method needs (:func:`prepare`),
    then the effects and their changes (:func:`effects_on`).

    Parameters
    ----------
    heads, method, source, reference, means, store : as :func:`prepare` takes them.
    run, max_new_tokens, progress, cancel : as :func:`effects_on` takes them (``progress`` hears 0 once
        the reference is ready).
    reference_progress : ``progress(fraction)`` of the reference texts (``mean``).

    Returns
    -------
    :class:`AppliedAblation`.
    """
    prepared = prepare(model, heads, method, source=source, reference=reference, means=means, store=store,
                       progress=reference_progress)
    return effects_on(model, run, prepared, max_new_tokens=max_new_tokens, progress=progress, cancel=cancel)

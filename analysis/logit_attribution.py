"""Direct logit attribution: each component's share of the logit difference of two answers.

Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits" (§"Residual stream": the logits
are a linear function of the final residual stream once the final norm is frozen), and Wang et al. 2022,
"Interpretability in the Wild" (arXiv:2211.00593, §3.1, "direct logit attribution" of the IOI heads).

**Definition.** At position ``p`` (the last by default) the final residual stream is a sum of components
(:mod:`headscope.analysis.residual_components`): ``x = Σ_c x_c``. Freeze the final norm at its scale
``σ`` there, ``N(x) = γ ⊙ P(x) / σ + β`` (P the centring of LayerNorm, the identity for RMSNorm; γ with
Gemma's ``1 +`` offset), so the logit difference of answer ``A`` over answer ``B``

    LD = logit_A − logit_B = Σ_c x_c · ũ / σ  +  β · u + (b_U[A] − b_U[B]),
    u = W_U[:, A] − W_U[:, B],   ũ = P(γ ⊙ u)

is a sum of one term per component, ``DLA(c) = x_c · ũ / σ``; the constant terms (the final norm's bias,
the unembedding bias) join the output-projection biases in the component ``bias``. The terms add up to
the model's own logit difference at ``p`` (checked on every call, to 1e-4 of the terms' total absolute size:
a difference near 0 is a cancellation of larger terms, known no better than their float32 rounding).
A final logit soft-capping (Gemma 2) is not linear: LD here is the difference before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel
from headscope.analysis.residual_components import (
    BIAS,
    TOLERANCE,
    ComponentCapture,
    capture_components,
    check_tokens,
    frozen_norm,
)


@dataclass
class LogitAttribution:
    """Direct logit attribution of every component at one position.

    Attributes
    ----------
    names : component names: ``embed``, heads ``L.H``, MLPs ``mlp.L``, ``bias``.
    values : float64 ``[C]``, each component's share of ``logit_diff`` (in logits).
    logit_diff : the model's own ``logit[answer] − logit[wrong]`` at ``position``: the output of its final norm
        (hooked) through the unembedding, before any final soft-capping.
    answer, wrong : the two token ids.
    position : the position explained.
    n_layers, n_heads : the model's sizes (for :meth:`heads`).
    """

    names: list[str]
    values: np.ndarray
    logit_diff: float
    answer: int
    wrong: int
    position: int
    n_layers: int
    n_heads: int

    def heads(self) -> np.ndarray:
        """``[layer, head]`` the heads' values."""
        start = 1
        return self.values[start : start + self.n_layers * self.n_heads].reshape(self.n_layers, self.n_heads)

    def mlps(self) -> np.ndarray:
        """``[layer]`` the MLPs' values."""
        start = 1 + self.n_layers * self.n_heads
        return self.values[start : start + self.n_layers]

    def value(self, name: str) -> float:
        """One component's value by name."""
        return float(self.values[self.names.index(name)])


def direct_logit_attribution(model: LoadedModel, token_ids: Sequence[int], answer: int, wrong: int,
                             position: int | None = None, capture: ComponentCapture | None = None) -> LogitAttribution:
    """Each component's direct contribution to ``logit[answer] − logit[wrong]`` (module docstring).

    Parameters
    ----------
    model : the model.
    token_ids : the ids the model sees, as given.
    answer, wrong : token ids of the two answers.
    position : the position whose logits are explained (default: the last).
    capture : a :func:`headscope.analysis.residual_components.capture_components` of the same ids that
        kept ``position`` (its forward pass is then not run again).

    Returns
    -------
    LogitAttribution
        ``values`` sum to ``logit_diff``, the model's own, to 1e-4 (else :class:`InputError`).
    """
    ids = check_tokens(model, token_ids)
    if position is None:
        position = len(ids) - 1
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position < len(ids):
        raise InputError(f"Position {position!r} is outside the text: pick one in 0..{len(ids) - 1}.")
    position = int(position)
    for what, t in (("answer", answer), ("wrong answer", wrong)):
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= int(t) < model.vocab_size:
            raise InputError(f"The {what} token {t!r} is not in the model's vocabulary (0..{model.vocab_size - 1}).")
    answer, wrong = int(answer), int(wrong)
    if capture is None or capture.token_ids != ids or position not in capture.positions:
        capture = capture_components(model, ids, [position])
    names, vectors = capture.components(model.n_layers, [position])
    p = capture.index(position)
    norm = frozen_norm(model.bridge.ln_final)
    w_u = model.bridge.W_U.detach()[:, [answer, wrong]].double().cpu()  # [d_model, 2]: the two columns only
    u = w_u[:, 0] - w_u[:, 1]
    direction = norm.gain * u  # P(γ ⊙ u): P is symmetric, so x · P(γ ⊙ u) = P(x) · (γ ⊙ u)
    if norm.centred:
        direction = direction - direction.mean()
    values = (vectors[0] @ direction) / capture.final_sigma[p].double()
    b_u = getattr(model.bridge, "b_U", None)
    unembedding_bias = 0.0 if b_u is None else float(b_u.detach()[answer] - b_u.detach()[wrong])
    values[names.index(BIAS)] += float(norm.bias @ u) + unembedding_bias
    own = float(capture.final_out[p].double() @ u) + unembedding_bias  # the model's own normalised stream, unembedded
    total = float(values.sum())
    size = max(float(values.abs().sum()), abs(own), 1e-12)  # float32 rounding scales with the terms' total size
    if abs(total - own) > TOLERANCE * size:
        raise InputError(f"The direct logit attributions add up to {total:.6g}, not to the model's own logit difference "
                         f"{own:.6g}: this model's final norm or unembedding is not the linear map headscope freezes.")
    return LogitAttribution(names=names, values=values.numpy(), logit_diff=own, answer=answer, wrong=wrong,
                            position=position, n_layers=model.n_layers, n_heads=model.n_heads)

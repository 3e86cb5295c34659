"""The one-token answers a logit difference compares (patching, path patching, direct logit attribution).

``logit(answer) − logit(wrong)`` at the last position is defined for single next tokens, so an answer is
one token of the model's vocabulary: a string that tokenises to exactly one id as it follows the text
(``" Mary"`` keeps its space), or an id. Anything else is refused with what to type instead.
"""

from __future__ import annotations

import numpy as np

from headscope.analysis.errors import InputError
from headscope.analysis.models import LoadedModel


def answer_id(model: LoadedModel, answer: str | int, which: str, compares: str) -> int:
    """The token id of ``answer`` (``which``: "clean", "first", … as the message names it; ``compares``:
    what compares the logits, as the message says it).

    Raises
    ------
    InputError
        an empty answer, an id outside the vocabulary, or a string of several tokens (the message gives
        them, and the same word with a leading space when that is one token).
    """
    if isinstance(answer, int | np.integer) and not isinstance(answer, bool):
        if not 0 <= int(answer) < model.vocab_size:
            raise InputError(f"The {which} answer id {answer} is outside the vocabulary (0..{model.vocab_size - 1}).")
        return int(answer)
    if not isinstance(answer, str) or not answer:
        raise InputError(f"The {which} answer is empty: give the token that should follow the text.")
    ids = model.encode(answer)
    if len(ids) != 1:
        shown = " + ".join(repr(s) for s in model.token_strings(ids))
        hint = ""
        if not answer[:1].isspace() and len(model.encode(" " + answer)) == 1:
            hint = f" ({' ' + answer!r}, with its leading space, is one token.)"
        raise InputError(f"The {which} answer {answer[:40]!r} is {len(ids)} tokens ({shown[:120]}); {compares} "
                         f"compares the logits of single next tokens. Give one token, e.g. a word with the space "
                         f"before it.{hint}")
    return ids[0]

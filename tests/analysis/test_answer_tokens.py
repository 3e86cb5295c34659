"""The one-token answers of patching and direct logit attribution: one function, the same messages."""

import numpy as np
import pytest

from headscope.analysis.answer_tokens import answer_id
from headscope.analysis.errors import InputError


def test_a_one_token_answer_and_an_id_give_the_same_token(tiny_model):
    word = next(w for w in (" the", " a", " of", " and") if len(tiny_model.encode(w)) == 1)
    token = answer_id(tiny_model, word, "clean", "patching")
    assert tiny_model.encode(word) == [token]
    assert answer_id(tiny_model, token, "clean", "patching") == token
    assert answer_id(tiny_model, np.int64(token), "clean", "patching") == token


@pytest.mark.parametrize("answer, said", [
    ("", "first answer is empty"),
    (None, "first answer is empty"),
    (True, "first answer is empty"),      # a bool is not the id 1
    (10**9, "outside the vocabulary"),
    (-1, "outside the vocabulary"),
    (" Marylebone Johnson", "direct logit attribution compares the logits of single next tokens"),
])
def test_what_cannot_be_one_answer_token_is_refused_with_what_to_give(tiny_model, answer, said):
    with pytest.raises(InputError, match=said):
        answer_id(tiny_model, answer, "first", "direct logit attribution")


def test_a_word_without_its_space_is_told_the_spaced_token(tiny_model):
    word = next(w for w in ("drink", "Mary", "store", "house") if len(tiny_model.encode(w)) > 1
                and len(tiny_model.encode(" " + w)) == 1)
    with pytest.raises(InputError, match=f"' {word}', with its leading space, is one token"):
        answer_id(tiny_model, word, "clean", "patching")

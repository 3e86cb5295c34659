"""``circuits(..., corrupted=T2)``: the edge attribution of the pair, stored beside the direct logit attribution
(every edge, read back equal to :func:`headscope.analysis.edge_attribution.edge_attribution`), the key of a run
without a corrupted text unchanged, and a corrupted text that cannot be compared refused with a message."""

from __future__ import annotations

import pytest

from headscope.analysis.circuits import circuits, load_circuits, load_edges
from headscope.analysis.edge_attribution import edge_attribution
from headscope.analysis.errors import InputError

TEXT = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def _answers(model) -> list[str]:
    return [w for w in (" Mary", " John", " the", " a") if len(model.encode(w)) == 1][:2]


def test_the_edges_are_stored_with_the_result_and_read_back_as_computed(tiny_model, store):
    answers = _answers(tiny_model)
    plain = circuits(tiny_model, TEXT, answers, store=store, composition=False)
    assert plain.edges_key is None
    result = circuits(tiny_model, TEXT, answers, store=store, composition=False, corrupted=CORRUPTED)
    assert result.key != plain.key and result.edges_key
    assert load_circuits(store, result.key).edges_key == result.edges_key
    edges = load_edges(store, result.edges_key)
    expected = edge_attribution(tiny_model, TEXT, CORRUPTED, answers)
    assert edges.rows() == expected.rows()  # every edge, in rank order, the same numbers
    assert edges.clean == pytest.approx(expected.clean) and edges.corrupted == pytest.approx(expected.corrupted)
    assert edges.corrupted_ids == tiny_model.input_ids(CORRUPTED)
    assert circuits(tiny_model, TEXT, answers, store=store, corrupted=CORRUPTED).edges_key == result.edges_key
    assert circuits(tiny_model, TEXT, answers, store=store, composition=False, corrupted="  ").key == plain.key


@pytest.mark.parametrize("corrupted,said", [
    ("When Mary and John went to the store, Mary Elizabeth gave a drink to", "same number of tokens"),
    (TEXT, "same tokens"),
    ("Mary", "is 1 token and"),
    ("word " * 20_000, "The corrupted text: "),
    ([1.5] * 14, "The corrupted text: "),
])
def test_a_corrupted_text_that_cannot_be_compared_is_refused(tiny_model, store, corrupted, said):
    with pytest.raises(InputError, match=said):
        circuits(tiny_model, TEXT, _answers(tiny_model), store=store, composition=False, corrupted=corrupted)
    assert store.find("") == [] or all(store.get(k).kind != "circuit_edges" for k in store.find(""))


def test_token_ids_of_the_text_must_be_whole_numbers(tiny_model, store):
    with pytest.raises(InputError, match="whole numbers"):
        circuits(tiny_model, [1.5, 2.7, 300.2], _answers(tiny_model), store=store, composition=False)

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


def test_an_edge_patch_is_path_patching_in_the_sign_of_edge_attribution_and_is_read_back(tiny_model, store):
    """:func:`patch_edge` of a head → head edge equals path patching (noising, MLPs frozen: ``raw − clean``, the
    quantity edge attribution estimates), carries the edge's stored score, and a second call reads the stored
    patch back (the store is then the only source: the record's numbers are returned as kept)."""
    from headscope.analysis.circuits import load_edge_patch, patch_edge
    from headscope.analysis.path_patching import path_patching

    answers = _answers(tiny_model)
    result = circuits(tiny_model, TEXT, answers, store=store, composition=False, corrupted=CORRUPTED)
    edges = load_edges(store, result.edges_key)
    sender, receiver, site, score = next(r for r in edges.rows() if r[2] in "qkv" and r[0][:1].isdigit())
    patch = patch_edge(tiny_model, result, sender, receiver, site, store)
    heads = [tuple(int(x) for x in n.split(".")) for n in (sender, receiver)]
    exact = path_patching(tiny_model, TEXT, CORRUPTED, answers, [heads[0]], [heads[1]], site=site, direction="noise",
                          freeze_mlps=True)
    assert patch.exact == pytest.approx(exact.raw - exact.clean, abs=1e-6)
    assert patch.estimate == pytest.approx(score) and patch.clean == pytest.approx(exact.clean)
    assert load_edge_patch(store, patch.key) == patch
    assert patch_edge(tiny_model, result, sender, receiver, site, store) == patch


@pytest.mark.parametrize("edge,said", [
    (("embed", "1.0", "q"), "cannot be patched exactly"),
    (("mlp.0", "1.0", "v"), "cannot be patched exactly"),
    (("0.0", "logits", "logits"), "cannot be patched exactly"),
    (("1.0", "0.0", "q"), "No receiver lies in a layer after a sender"),
    (("0.0", "99.0", "q"), "Layer 99"),
    (("0.0", "1.99", "k"), "Head 99"),
    (("0.0", "1.0", "z"), "Unknown site"),
    (("00.0", "1.0", "q"), "not a head"),
    (("0.0", "1.0 ", "q"), "not a head"),
    (("-1.0", "1.0", "q"), "not a head"),
    (("9" * 5000, "1.0", "q"), "not a head"),
    ((0, 1, "q"), "three strings"),
])
def test_an_edge_that_cannot_be_patched_is_a_message(tiny_model, store, edge, said):
    from headscope.analysis.circuits import patch_edge

    result = circuits(tiny_model, TEXT, _answers(tiny_model), store=store, composition=False, corrupted=CORRUPTED)
    with pytest.raises(InputError, match=said):
        patch_edge(tiny_model, result, *edge, store)


def test_an_edge_patch_needs_stored_edges(tiny_model, store):
    from headscope.analysis.circuits import patch_edge

    result = circuits(tiny_model, TEXT, _answers(tiny_model), store=store, composition=False)
    with pytest.raises(InputError, match="no stored edges"):
        patch_edge(tiny_model, result, "0.0", "1.0", "q", store)

"""The built-in prompt pairs (data/patching/pairs.json): the file's schema checks, and on the embedded
model, that every shipped pair can be patched and is answered: the clean answer preferred on the
clean prompt, the corrupted one on the corrupted prompt (logit difference computed by hand)."""

from __future__ import annotations

import json

import pytest
import torch

from headscope.analysis.errors import InputError
from headscope.analysis.patching import prompt_pair
from headscope.analysis.patching_pairs import PAIR_KINDS, load_pairs, pair_by_id


def test_the_shipped_file_has_three_or_more_pairs_of_each_kind():
    pairs = load_pairs()
    for kind in PAIR_KINDS:
        assert sum(p.kind == kind for p in pairs) >= 3, kind
    assert len({p.id for p in pairs}) == len(pairs)
    assert pair_by_id("ioi-mary-john").answers == (" Mary", " John")


GOOD = {"id": "x", "kind": "ioi", "clean": "a b", "corrupted": "a c", "answers": [" b", " c"]}


@pytest.mark.parametrize("doc,message", [
    ("{not json", "Cannot read prompt pairs"),
    ([GOOD], "an object with a list 'pairs'"),
    ({"version": 2, "pairs": [GOOD]}, "version 2"),
    ({"version": 1, "pairs": []}, "empty list"),
    ({"version": 1, "pairs": ["x"]}, "Pair 0 in .* must be an object"),
    ({"version": 1, "pairs": [{**GOOD, "clean": ""}]}, "Pair 0 \\('x'\\) .* 'clean'"),
    ({"version": 1, "pairs": [{**GOOD, "kind": "poem"}]}, "kind 'poem'"),
    ({"version": 1, "pairs": [{**GOOD, "answers": [" b"]}]}, "needs 'answers'"),
    ({"version": 1, "pairs": [GOOD, GOOD]}, "repeats the id 'x'"),
])
def test_a_bad_pairs_file_is_explained(tmp_path, doc, message):
    path = tmp_path / "pairs.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(InputError, match=message):
        load_pairs(path)


def test_an_unknown_id_lists_the_ids():
    with pytest.raises(InputError, match="choose one of ioi-mary-john"):
        pair_by_id("no-such-pair")


@pytest.mark.integration
def test_the_embedded_model_answers_every_shipped_pair(real_model):
    rows = []
    for spec in load_pairs():
        pair = prompt_pair(real_model, spec.clean, spec.corrupted, list(spec.answers))  # lengths, single tokens
        assert pair.n_tokens == len(real_model.encode(spec.corrupted))
        assert [len(real_model.encode(a)) for a in spec.answers] == [1, 1]
        with torch.inference_mode():
            logits = real_model.bridge(torch.tensor([list(pair.clean_ids), list(pair.corrupted_ids)]),
                                       return_type="logits")[:, -1].double()
        a, b = pair.answers
        clean_ld, corrupted_ld = float(logits[0, a] - logits[0, b]), float(logits[1, a] - logits[1, b])
        rows.append((spec.id, clean_ld, corrupted_ld))
    wrong = [r for r in rows if not (r[1] > 0 > r[2])]
    assert not wrong, wrong

"""Needle-in-a-haystack prompts: exact needle spans, lengths, depths, shipped data, bad inputs."""

import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.niah import (
    Needle,
    build_prompt,
    find_span,
    load_haystack,
    load_needles,
    passkey_filler,
    split_sentences,
)
from headscope.analysis.retrieval import rouge1_recall

NEEDLE = Needle(
    needle="The combination for the blue locker is 4817.",
    question="What is the combination for the blue locker?",
    answer="4817",
)


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    """A random Llama with SmolLM2's tokenizer and chat template (weights do not matter here)."""
    return make_tiny_model(max_positions=4096, name="tiny-niah")


@pytest.fixture(scope="module")
def prose():
    return load_haystack("prose")


def decoded(model, ids):
    return model.tokenizer.decode(ids)


# -- shipped data ------------------------------------------------------------------------------


def test_shipped_needles_are_varied_and_answerable_from_the_needle(prose):
    needles = load_needles()
    assert len(needles) >= 8
    assert len({n.id for n in needles}) == len(needles)
    assert {"number", "name", "place"} <= {n.kind for n in needles}
    for n in needles:
        assert n.needle.endswith(".") and n.question.endswith("?")
        assert rouge1_recall(n.answer, n.needle) == 1.0, n.id  # the answer is in the needle
        assert n.needle not in prose


def test_prose_haystack_has_at_least_8000_tokens(tiny, prose):
    assert prose.startswith("On the Kitchen Drawer")
    assert len(tiny.encode(prose)) >= 8000


def test_haystack_file_header_is_not_haystack(tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text("# Written for a test. CC0.\n# Second header line.\n\nFirst sentence. Second one.\n")
    assert load_haystack(str(path)) == "First sentence. Second one.\n"
    assert not load_haystack("prose").startswith("#")


def test_split_sentences_keeps_every_character():
    text = 'Title line\n\nFirst one. Second! "Third?" he said.\nFourth.  Fifth'
    pieces = split_sentences(text)
    assert "".join(pieces) == text
    assert pieces == [
        "Title line",
        "\n\nFirst one.",
        " Second!",
        ' "Third?"',
        " he said.",
        "\nFourth.",
        "  Fifth",
    ]


def test_passkey_filler():
    text = passkey_filler(7)
    assert text == (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
        "\nThe grass is green. The sky is blue."
    )
    assert load_haystack("passkey").count("The sky is blue.") == 400
    with pytest.raises(InputError):
        passkey_filler(0)


# -- building prompts --------------------------------------------------------------------------


@pytest.mark.parametrize("length", [256, 512, 1000])
def test_needle_span_is_exact_and_length_is_respected(tiny, prose, length):
    p = build_prompt(tiny, NEEDLE, prose, length, 50)
    start, end = p.needle_span
    assert decoded(tiny, p.token_ids[start:end]).strip() == NEEDLE.needle
    qs, qe = p.question_span
    assert decoded(tiny, p.token_ids[qs:qe]).strip() == NEEDLE.question
    assert length - 40 <= p.n_tokens <= length  # whole sentences: at most one short of the target
    assert p.token_ids == tiny.chat_ids(p.text)  # the model's chat template, no extra BOS
    assert decoded(tiny, p.token_ids).startswith("<|im_start|>")
    assert abs(p.actual_depth - 50) < 100 * 40 / p.haystack_tokens  # within one sentence


def test_depth_zero_and_hundred_put_the_needle_first_and_last(tiny, prose):
    first = build_prompt(tiny, NEEDLE, prose, 300, 0)
    last = build_prompt(tiny, NEEDLE, prose, 300, 100)
    assert first.actual_depth == 0 and last.actual_depth == 100
    assert "\n\n" + NEEDLE.needle + " On the Kitchen Drawer" in first.text
    assert last.text.split("\n\nQuestion:")[0].endswith(" " + NEEDLE.needle)
    # depth grows monotonically with the requested depth
    depths = [build_prompt(tiny, NEEDLE, prose, 300, d).needle_span[0] for d in (0, 25, 50, 75, 100)]
    assert depths == sorted(depths) and len(set(depths)) == 5


def test_short_haystack_is_repeated_and_passkey_works(tiny):
    p = build_prompt(tiny, NEEDLE, "A short haystack sentence. Another one here.", 400, 50)
    assert 360 <= p.n_tokens <= 400
    assert p.text.count("A short haystack sentence.") > 10
    k = build_prompt(tiny, NEEDLE, load_haystack("passkey"), 400, 30)
    start, end = k.needle_span
    assert decoded(tiny, k.token_ids[start:end]).strip() == NEEDLE.needle


def test_bad_inputs_raise_input_error(tiny, prose):
    for depth in (-1, 100.5):
        with pytest.raises(InputError, match="depth must be between 0 and 100"):
            build_prompt(tiny, NEEDLE, prose, 300, depth)
    with pytest.raises(InputError, match="above the model's context of 4,096"):
        build_prompt(tiny, NEEDLE, prose, 5000, 50)
    with pytest.raises(InputError, match="haystack is empty"):
        build_prompt(tiny, NEEDLE, "  \n", 300, 50)
    with pytest.raises(InputError, match="too short"):
        build_prompt(tiny, NEEDLE, prose, 40, 50)
    with pytest.raises(InputError, match="already contains the needle"):
        build_prompt(tiny, NEEDLE, prose + " " + NEEDLE.needle, 300, 50)
    with pytest.raises(InputError, match="question is empty"):
        build_prompt(tiny, Needle("A fact.", " ", "fact"), prose, 300, 50)
    with pytest.raises(InputError, match="Unknown haystack"):
        load_haystack("no-such-haystack")


def test_needle_merged_by_tokenisation_is_reported(tiny, prose):
    # The template glues text onto the context's last word: at depth 100 "...the shed key is with" +
    # "out" tokenises as " without", so no run of tokens spells the needle.
    glued = Needle("The shed key is with", "Where is the shed key?", "with")
    with pytest.raises(InputError, match="tokenisation merges"):
        build_prompt(tiny, glued, prose, 300, 100, template="{context}out {question}")
    # the same needle mid-haystack, followed by a space, is found
    p = build_prompt(tiny, glued, prose, 300, 50)
    assert decoded(tiny, p.token_ids[slice(*p.needle_span)]).strip() == glued.needle


def test_find_span():
    assert find_span([1, 2, 3, 1, 2], [1, 2]) == [0, 3]
    assert find_span([1, 2], [1, 2, 3]) == []
    assert find_span(np.array([5, 6]).tolist(), [6]) == [1]


def test_own_needles_parse_from_lines_or_json_and_bad_ones_say_why():
    from headscope.analysis.niah import parse_needles

    lines = "# mine\nThe vault code is 7731. | What is the vault code? | 7731\n\nPip is a parrot. | Who is Pip? | a parrot"
    needles = parse_needles(lines)
    assert [(n.needle, n.question, n.answer) for n in needles] == [
        ("The vault code is 7731.", "What is the vault code?", "7731"), ("Pip is a parrot.", "Who is Pip?", "a parrot")]
    assert parse_needles('[{"needle": "A.", "question": "B?", "answer": "C", "id": "x"}]')[0].id == "x"
    for bad, why in [("", "No needles"), ("only | two", "line 1"), ("a | | c", "line 1"),
                     ('[{"needle": 1', "do not parse"), ('[{"needle": "A.", "question": "B?"}]', "needs the fields"),
                     ('[{"needle": "A.", "question": "B?", "answer": " "}]', "empty")]:
        with pytest.raises(InputError, match=why):
            parse_needles(bad)


def test_named_haystack_refuses_paths(tmp_path):
    """What a request may name: the shipped haystacks only; a path is refused, its file never read."""
    from headscope.analysis.niah import named_haystack

    secret = tmp_path / "secret.txt"
    secret.write_text("canary-word-in-a-file")
    assert named_haystack("prose") == load_haystack("prose")
    for value in (str(secret), str(tmp_path), "../../etc/passwd", "/etc/passwd", "~/.bashrc"):
        with pytest.raises(InputError, match="choose one of prose, passkey") as e:
            named_haystack(value)
        assert "canary-word" not in str(e.value)


def test_previous_depth_rule_never_places_the_needle_after_the_requested_depth(tiny, prose):
    """``nearest`` may round up to the next sentence end; ``previous`` takes the last boundary at or
    before the depth (Kamradt's rule), so it never lands later, and is at most one sentence earlier."""
    later = 0
    for depth in (10, 25, 33, 50, 66, 75, 90):
        near = build_prompt(tiny, NEEDLE, prose, 400, depth)
        prev = build_prompt(tiny, NEEDLE, prose, 400, depth, depth_rule="previous")
        assert prev.actual_depth <= depth and prev.actual_depth <= near.actual_depth
        assert depth - prev.actual_depth < 100 * 60 / prev.haystack_tokens  # within one sentence
        assert prev.settings()["depth_rule"] == "previous" and "depth_rule" not in near.settings()
        later += near.actual_depth > depth
    assert later  # the two rules differ on this haystack: nearest did land after the depth
    with pytest.raises(InputError, match="nearest, previous"):
        build_prompt(tiny, NEEDLE, prose, 400, 50, depth_rule="after")


# -- base models (no chat template) ------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(embedded_tokenizer):
    """A tiny random Gemma 3 whose tokenizer behaves like Gemma 3 270M's: it puts a BOS before a text
    and has no chat template (a base model; a copy, the session's tokenizer stays as it is)."""
    import copy

    from headscope.analysis.models import wrap_model
    from tests.tiny_families import tiny_family_model

    tok = copy.deepcopy(embedded_tokenizer)
    tok.add_bos_token = True
    tok.chat_template = None
    return wrap_model(tiny_family_model("gemma3", len(tok), max_positions=1024), tok, name="tiny-base",
                      digest="tiny-base-niah")


def test_a_base_model_prompt_ends_with_the_answer_cue(base_model, prose):
    """Without a chat template nothing marks where the answer goes; like the retrieval-head paper's
    base-model prompts, the question is followed by 'Answer:', so greedy decoding starts with it."""
    from headscope.analysis.niah import ANSWER_CUE

    p = build_prompt(base_model, NEEDLE, prose, 300, 50)
    tok = base_model.tokenizer
    assert p.text.endswith(f"Question: {NEEDLE.question} Answer in one short sentence.{ANSWER_CUE}")
    assert ANSWER_CUE == "\nAnswer:"
    assert p.token_ids == [tok.bos_token_id, *tok.encode(p.text, add_special_tokens=False)]
    assert tok.decode(p.token_ids[-3:]).endswith("\nAnswer:") and p.n_tokens <= 300
    assert tok.decode(p.token_ids[slice(*p.question_span)]).strip() == NEEDLE.question
    assert tok.decode(p.token_ids[slice(*p.needle_span)]).strip() == NEEDLE.needle


def test_a_chat_template_prompt_has_no_answer_cue(tiny, prose):
    """With a chat template the generation prompt (the assistant turn) is the cue: the message is as before."""
    p = build_prompt(tiny, NEEDLE, prose, 300, 50)
    assert p.text.endswith(f"Question: {NEEDLE.question} Answer in one short sentence.")
    assert p.token_ids == tiny.chat_ids(p.text)
    assert tiny.tokenizer.decode(p.token_ids).endswith("<|im_start|>assistant\n")


def test_json_needles_whose_fields_are_not_strings_are_refused_naming_the_field():
    """A needle's fields are text: null, a number, a boolean, a list or an object is refused with the
    field and what it was (``str()`` made them "None", "7731", "['a']" before)."""
    import json

    from headscope.analysis.niah import parse_needles

    good = {"needle": "The vault code is 7731.", "question": "What is the vault code?", "answer": "7731"}
    for field in ("needle", "question", "answer", "id", "kind"):
        for value, kind in ((None, "null"), (7731, "a number"), (1.5, "a number"), (True, "true"),
                            (False, "false"), (["7731"], "a list"), ({"a": 1}, "an object")):
            text = json.dumps([{**good, field: value}])
            with pytest.raises(InputError, match=f"field '{field}' must be a string, got {kind}"):
                parse_needles(text)
    for raw in ('{"needles": "x"}', '{"needles": [5]}', '[null]', '[[]]', '"needle"'):
        with pytest.raises(InputError):
            parse_needles(raw)
    # the shipped needles and well-formed own ones still read
    assert parse_needles(json.dumps({"needles": [{**good, "id": "v", "kind": "number"}]}))[0].id == "v"
    assert len(load_needles()) >= 1


def test_context_lengths_and_the_streaming_window_are_checked_before_anything_runs():
    """Whole numbers from 1 to MAX_LENGTH; S + W below the shortest length (the streaming score reads
    the rows after the first S + W). Neither needs torch."""
    import subprocess
    import sys

    from headscope.analysis.niah import MAX_LENGTH, check_lengths, check_streaming_window

    assert check_lengths([160, 2048]) == [160, 2048]
    for bad in ([-5], [0], [True], [MAX_LENGTH + 1], [10**300], ["512"], [2.0], [160, -1]):
        with pytest.raises(InputError, match="Context lengths must be whole numbers of tokens from 1 to") as refused:
            check_lengths(bad)
        assert len(str(refused.value)) < 120, refused.value
    with pytest.raises(InputError, match="at least one context length"):
        check_lengths([])
    check_streaming_window(4, 64, [69, 100])
    for sink, window, lengths in ((4, 64, [68]), (0, 160, [160, 512]), (100, 60, [160])):
        with pytest.raises(InputError, match=f"S \\+ W = {sink + window} leaves no query rows to score in a "
                                             f"{min(lengths)}-token prompt"):
            check_streaming_window(sink, window, lengths)
    code = "import sys, analysis.niah; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "checking a request imported torch"

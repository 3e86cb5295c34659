"""Layer and head numbers (and the CLI's other numbers) are read in ASCII digits only: ``٣``, ``３`` or ``𝟑``
are digits to Python's ``int()`` but a head number a user did not mean to type; and a numeral past
``int()``'s 4,300 digits is out of range, said plainly, never with Python's "int max digits" text."""

from __future__ import annotations

import pytest

from tests.app.command_line import assert_one_line, headscope

OTHER_DIGITS = ["٣", "３", "𝟑", "۳", "३"]  # Arabic-Indic, fullwidth, mathematical bold, Persian, Devanagari
LONG = "7" * 5000


@pytest.mark.parametrize("digit", OTHER_DIGITS)
def test_head_lists_take_ascii_digits_only(tiny_model, digit):
    from headscope.analysis.ablation import parse_heads
    from headscope.analysis.errors import InputError
    from headscope.analysis.patching_choices import parse_head_pairs

    assert parse_heads(tiny_model, "1.3") == [(1, 3)]
    for text in (f"{digit}.1", f"1.{digit}", f"L{digit}H1", f"kv:{digit}.0", f"{digit}.*", f"L1{digit}"):
        with pytest.raises(InputError, match="Cannot read"):
            parse_heads(tiny_model, text)
    with pytest.raises(InputError, match="is not a head"):
        parse_head_pairs(f"{digit}.1")


def test_a_5000_digit_layer_is_out_of_range(tiny_model):
    from headscope.analysis.ablation import parse_heads
    from headscope.analysis.errors import InputError

    for text, message in ((f"{LONG}.1", "Layer 7777777777…7777 (5,000 digits) is out of range"),
                          (f"L{LONG}", "Layer 7777777777…7777 (5,000 digits) is out of range"),
                          (f"1.{LONG}", "Head 7777777777…7777 (5,000 digits) is out of range in layer 1"),
                          (f"kv:1.{LONG}", "Key-value group 7777777777…7777 (5,000 digits) is out of range"),
                          (f"{'0' * 5000}1.2", None)):
        if message is None:
            assert parse_heads(tiny_model, text) == [(1, 2)]
            continue
        with pytest.raises(InputError) as e:
            parse_heads(tiny_model, text)
        assert str(e.value).startswith(message) and "digits" in str(e.value) and "sys." not in str(e.value), e.value
        assert len(str(e.value)) < 300


@pytest.mark.parametrize("digit", OTHER_DIGITS)
def test_links_take_ascii_digits_only(digit):
    from headscope.app.url_state import parse

    assert parse("?layer=3&head=1").layer == 3
    state = parse(f"?layer={digit}&head=1{digit}&region=0-{digit},0-4&heads={digit}.1")
    assert state.layer is None and state.head is None and state.region is None and state.heads is None
    assert len(state.problems) == 4, state.problems


FAST = [
    (["patch", "--pair", "ioi-mary-john", "--head", "٣.١"], "argument --head"),
    (["patch", "--pair", "ioi-mary-john", "--head", f"{LONG}.1"], "argument --head"),
    (["patch", "--pair", "ioi-mary-john", "--path-from", "３.1", "--path-to", "5.1"], "argument --path-from"),
    (["compare", "aaaa", "bbbb", "--head", "1.𝟑"], "argument --head"),
    (["ablate", "--text", "x", "--heads", "1.1", "--seeds", "٣"], "argument --seeds"),
    (["ablate", "--text", "x", "--heads", "1.1", "--seeds", LONG], "argument --seeds"),
    (["scan", "--lengths", "٣٠٠"], "argument --lengths"),
    (["scan", "--depths", "５0"], "argument --depths"),
    (["compress", "--fractions", "٠.٥"], "argument --fractions"),
    (["compress", "--tolerance", "٠.١"], "argument --tolerance"),
    (["compress", "--export", "random:0.5:٣"], "argument --export"),
    (["serve", "--port", "８０５０"], "argument --port"),
]


@pytest.mark.parametrize("argv, expected", FAST, ids=[" ".join(a)[:50] for a, _ in FAST])
def test_cli_numbers_take_ascii_digits_only(tmp_path, argv, expected):
    code, err, torch_loaded, _ = headscope(argv, tmp_path / "home")
    assert_one_line(code, err, expected)
    assert "sys.set_int_max_str_digits" not in err and len(err) < 400, err
    assert not torch_loaded


@pytest.mark.integration
def test_cli_heads_in_other_digits_or_5000_digits_are_one_line(tmp_path):
    for heads, expected in (("٣.١", "Cannot read"), (f"{LONG}.1", "(5,000 digits) is out of range")):
        code, err, _, _ = headscope(["ablate", "--text", "The cat sat.", "--heads", heads, "--formats", ""],
                                    tmp_path / "home")
        assert_one_line(code, err, "argument --heads", expected)
        assert "sys.set_int_max_str_digits" not in err and len(err) < 600, err


@pytest.mark.parametrize("digit", OTHER_DIGITS)
def test_page_number_lists_take_ascii_digits_only(digit):
    """The pages' comma-separated boxes (context lengths, depths, fractions) read ASCII digits only."""
    from headscope.analysis.errors import InputError
    from headscope.app.form_values import number_list

    assert number_list("256, 512", "Context lengths", int) == [256, 512]
    for text in (f"{digit}00", f"256,{digit}", f"0.{digit}"):
        with pytest.raises(InputError, match="digits 0-9"):
            number_list(text, "Context lengths", int if "." not in text else float)

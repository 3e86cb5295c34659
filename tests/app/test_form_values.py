"""The form parsers every page uses: what a user can type, and what a forged request can send."""

from __future__ import annotations

import pytest

from headscope.analysis.errors import InputError
from headscope.app.form_values import number_list, whole_number


def test_number_lists_take_commas_or_semicolons_and_refuse_the_rest_naming_the_field():
    assert number_list("1024; 2048,4096", "Context lengths", int) == [1024, 2048, 4096]
    assert number_list(" 0.25, 0.5 ", "Fractions") == [0.25, 0.5]
    for text, found in (("", "at least one value for depths"), ("1,a", "Depths must be numbers"),
                        (",".join(["1"] * 13), "At most 12 values for depths"), (None, "at least one value")):
        with pytest.raises(InputError, match=found):
            number_list(text, "Depths")
    with pytest.raises(InputError, match="Context lengths must be numbers"):
        number_list("2.5", "Context lengths", int)


def test_whole_numbers_refuse_fractions_text_booleans_and_values_below_the_floor():
    assert whole_number(3, "Seeds", 1) == 3 and whole_number(2.0, "Seeds", 1) == 2
    for bad in (2.5, "3", True, None, 0, [1]):
        with pytest.raises(InputError, match="Seeds must be a whole number of at least 1"):
            whole_number(bad, "Seeds", 1)


def test_whole_numbers_with_a_ceiling_say_the_range_and_never_echo_a_long_value():
    """A box's ``max`` past which the browser sends nothing (None): the message gives the range. A forged
    huge, infinite or not-a-number value is refused with at most 20 characters of it."""
    assert whole_number(0, "S", 0, 100) == 0 and whole_number(100.0, "S", 0, 100) == 100
    with pytest.raises(InputError, match=r"S must be a whole number from 0 to 1,000: the box is empty"):
        whole_number(None, "S", 0, 1000)
    hostile = (101, -1, 10**300, -(10**300), float("inf"), float("-inf"), float("nan"), 1e300, 2.5, True, "50", [1], {})
    for bad in hostile:
        with pytest.raises(InputError, match="S must be a whole number from 0 to 100") as refused:
            whole_number(bad, "S", 0, 100)
        assert len(str(refused.value)) < 100, refused.value

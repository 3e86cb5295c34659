"""The one layer/head range check (analysis/errors.py): what a user who names a wrong head is told."""

import numpy as np
import pytest

from headscope.analysis.capture import InputError as ReExported
from headscope.analysis.errors import InputError, check_head, check_head_index, check_layer


def test_valid_heads_come_back_as_ints():
    assert check_head_index(30, 9, 29, 8) == (29, 8)
    assert check_head_index(30, 9, np.int64(3), "4") == (3, 4)  # numpy ints and URL numerals
    assert type(check_head_index(30, 9, np.int64(3), 2.0)[1]) is int
    assert check_layer(2, 1) == 1 and check_head(4, 3) == 3


@pytest.mark.parametrize(
    "layer, head, message",
    [
        (30, 0, "Layer 30 is out of range: the model has layers 0..29."),
        (-1, 0, "Layer -1 is out of range: the model has layers 0..29."),
        (0, 9, "Head 9 is out of range in layer 0: the model has query heads 0..8."),
        (1.5, 0, "Layer and head must be whole numbers, got 1.5 and 0."),
        ("x", 0, "Layer and head must be whole numbers, got 'x' and 0."),
        (0, None, "Layer and head must be whole numbers, got 0 and None."),
        (True, 0, "Layer and head must be whole numbers, got True and 0."),
        ("²", 0, "Layer and head must be whole numbers, got '²' and 0."),  # a digit to isdigit(), not to int()
        # digits of other scripts are digits to int(), not to a user reading the page: ASCII only
        (0, "٣", "Layer and head must be whole numbers written with the digits 0-9, got 0 and '٣'."),
        ("３", 0, "Layer and head must be whole numbers written with the digits 0-9, got '３' and 0."),
        (0, "𝟑", "Layer and head must be whole numbers written with the digits 0-9, got 0 and '𝟑'."),
        # past int()'s 4,300 digits: out of range, said without Python's "int max digits" text
        ("9" * 5000, 0, "Layer 9999999999…9999 (5,000 digits) is out of range: the model has layers 0..29."),
        (0, "0" * 4999 + "9", "Head 9 is out of range in layer 0: the model has query heads 0..8."),
        (float("inf"), 0, "Layer and head must be whole numbers, got inf and 0."),
    ],
)
def test_wrong_heads_are_explained(layer, head, message):
    with pytest.raises(InputError) as e:
        check_head_index(30, 9, layer, head)
    assert str(e.value) == message


def test_layer_and_head_alone():
    with pytest.raises(InputError, match=r"^Layer must be a whole number, got '2\.5'\.$"):
        check_layer(4, "2.5")
    with pytest.raises(InputError, match=r"^Head 4 is out of range: the model has query heads 0\.\.3\.$"):
        check_head(4, 4)


def test_input_error_is_one_class_wherever_it_is_imported_from():
    assert ReExported is InputError and issubclass(InputError, ValueError)

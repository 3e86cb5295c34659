"""Callbacks with named outputs: missing keys stay as they are, the error goes to its named output."""

import pytest
from dash import no_update

from headscope.app.errors import guarded


def test_a_named_render_fills_the_outputs_it_does_not_return():
    @guarded(outputs=("figure", "table", "error"))
    def render(x):
        return {"figure": x}

    assert render(1) == {"figure": 1, "table": no_update, "error": no_update}


def test_a_failing_named_render_writes_only_its_named_error_output():
    @guarded(outputs=("figure", "problems", "table"), error="problems")
    def render(x):
        raise ValueError("The layer is out of range.")

    result = render(1)
    assert set(result) == {"figure", "problems", "table"}
    assert result["figure"] is no_update and result["table"] is no_update
    assert result["problems"][0].children == "The layer is out of range."


def test_a_named_render_that_returns_an_unknown_key_is_a_bug_reported_as_one(caplog):
    @guarded(outputs=("figure", "error"))
    def render(x):
        return {"figur": x}

    result = render(1)
    assert result["figure"] is no_update
    assert "Something went wrong" in result["error"][0].children
    assert "figur" in caplog.text


def test_the_error_output_must_be_one_of_the_names():
    with pytest.raises(ValueError, match="problems"):
        guarded(outputs=("figure", "error"), error="problems")


def test_positional_renders_still_work():
    @guarded(outputs=3, error_index=0)
    def render(x):
        raise ValueError("bad")

    result = render(1)
    assert result[1] is no_update and result[2] is no_update and result[0][0].children == "bad"

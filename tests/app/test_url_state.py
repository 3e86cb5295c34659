from urllib.parse import urlencode

import pytest

from app.url_state import PageState, parse


def test_round_trip():
    state = PageState(model="smollm2-135m", run="0123456789abcdef", layer=3, head=5, metric="first_token", query=7)
    again = parse(state.to_search())
    assert (again.model, again.run, again.layer, again.head, again.metric, again.query) == (
        "smollm2-135m", "0123456789abcdef", 3, 5, "first_token", 7)
    assert again.problems == []


@pytest.mark.parametrize(
    "search, problem",
    [
        ("?run=<script>alert(1)</script>", "run id"),
        ("?layer=-1", "layer"),
        ("?head=abc", "head"),
        ("?layer=99999999999", "layer"),
        ("?metric=bogus", "metric"),
        ("?model=%00%01", "model"),
    ],
)
def test_bad_values_are_dropped_and_reported(search, problem):
    state = parse(search)
    assert any(problem in p for p in state.problems)
    assert state.run is None or state.run.isalnum()


def test_unknown_keys_and_garbage_are_ignored():
    assert parse("?foo=bar&&&=&layer=2").layer == 2
    assert parse("%%%").problems == [] or parse("%%%").run is None
    assert parse(None).run is None


def test_link_model_must_be_offered_and_refusal_does_not_probe_paths(tmp_path, monkeypatch):
    """A link naming a model path gets the same refusal whether or not the path exists."""
    monkeypatch.delenv("HEADSCOPE_MODELS", raising=False)
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    refusals = []
    for spec in (str(folder), str(tmp_path / "missing"), "../../models/x.gguf"):
        state = parse("?" + urlencode({"model": spec}))
        assert state.model is None
        refusals.append(state.problems[0].split(" it is not offered")[1])  # all but the name
    assert len(set(refusals)) == 1 and refusals[0].startswith(" by this server")
    assert "HEADSCOPE_MODELS" in refusals[0]
    assert parse("?model=smollm2-135m").model == "smollm2-135m"
    monkeypatch.setenv("HEADSCOPE_MODELS", f"{folder}, other-model")
    assert parse("?" + urlencode({"model": str(folder)})).model == str(folder)

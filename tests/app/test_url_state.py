from urllib.parse import urlencode

import pytest

from headscope.app.url_state import PageState, parse


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


# Every field of the flat page state links were written from before it was composed per page (issue #15),
# with its default: old links must open the same state, and a page writes the same link for it.
OLD_FIELDS = {
    "model": None, "run": None, "layer": None, "head": None, "metric": "entropy", "query": None, "target": None,
    "fusion": "mean", "drop_sink": False, "sweep": None, "trial": None, "agg": "query", "method": "pca",
    "colour": "position", "feature": "previous_token", "sentences": None, "score": "streaming", "stat": "mean",
    "sink_size": None, "window": None, "heads": None, "ablate": "zero", "by": "retrieval", "k": None, "seed": None,
    "curve": None, "hsweep": None, "source": None, "ref": None, "labels": None, "texts": None, "find": None,
    "region": None,
}


@pytest.mark.parametrize("search, values", [
    ("?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5&metric=first_token&query=7",
     {"model": "smollm2-135m", "run": "0123456789abcdef", "layer": 3, "head": 5, "metric": "first_token", "query": 7}),
    ("?run=0123456789abcdef&target=4&fusion=max&sink=1",
     {"run": "0123456789abcdef", "target": 4, "fusion": "max", "drop_sink": True}),
    ("?layer=1&head=0&score=evidence&stat=std&sink_size=2&window=16&sweep=00112233445566778899&trial=2&agg=group_max",
     {"layer": 1, "head": 0, "sweep": "00112233445566778899", "trial": 2, "agg": "group_max", "score": "evidence",
      "stat": "std", "sink_size": 2, "window": 16}),
    ("?layer=16&head=0&query=5&method=umap&colour=kind&feature=determiner&sentences=20&labels=abcdef0123456789"
     "&texts=0123456789abcdef&find=the",
     {"layer": 16, "head": 0, "sentences": 20, "query": 5, "method": "umap", "colour": "kind", "feature": "determiner",
      "labels": "abcdef0123456789", "texts": "0123456789abcdef", "find": "the"}),
    ("?heads=12.3%2Ckv%3A14.1&ablate=mean&by=induction&k=5&seed=3&curve=aaaaaaaabbbbbbbb&hsweep=ccccccccdddddddd"
     "&source=eeeeeeeeffffffff&ref=0000000011111111&sweep=1234567812345678",
     {"heads": "12.3,kv:14.1", "ablate": "mean", "by": "induction", "k": 5, "seed": 3, "curve": "aaaaaaaabbbbbbbb",
      "hsweep": "ccccccccdddddddd", "source": "eeeeeeeeffffffff", "ref": "0000000011111111",
      "sweep": "1234567812345678"}),
    ("?run=0123456789abcdef&region=0-10%2C0-20", {"run": "0123456789abcdef", "region": "0-10,0-20"}),
])
def test_old_links_parse_to_the_same_values_and_are_written_back_unchanged(search, values):
    state = parse(search)
    assert {name: getattr(state, name) for name in OLD_FIELDS} == {**OLD_FIELDS, **values}
    assert state.problems == []
    assert state.to_search() == search
    assert parse(state.to_search()) == state


def test_a_mangled_old_link_reports_the_same_problems():
    state = parse("?metric=bogus&fusion=x&method=no&agg=zz&layer=-1&run=xyz&feature=%3Cb%3E&region=1-2")
    assert {name: getattr(state, name) for name in OLD_FIELDS} == OLD_FIELDS
    assert state.problems == [
        "The link's run id 'xyz' is not valid (8–64 hex digits).",
        "The link's layer '-1' is not a non-negative whole number.",
        "Unknown metric 'bogus'; showing entropy.", "Unknown head fusion 'x'; using mean.",
        "Unknown method 'no'; choose one of pca, umap, tsne.", "The link's feature '<b>' is not a valid feature name.",
        "The link's region must be written q0-q1,k0-k1 (token positions).", "Unknown aggregation 'zz'; showing query heads."]


def test_each_page_has_its_own_part_and_the_shared_fields_are_few():
    state = parse("?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5&metric=first_token&fusion=max"
                  "&agg=group_mean&method=umap&heads=1.2&ablate=mean")
    assert (state.attention.metric, state.flow.fusion, state.part("heads").agg, state.qk.method) == (
        "first_token", "max", "group_mean", "umap")
    assert (state.ablation.heads, state.ablation.ablate) == ("1.2", "mean")
    state.fusion = "min"  # a page field by its name is its part's field
    assert state.flow.fusion == "min"
    assert state.shared().to_search() == "?model=smollm2-135m&run=0123456789abcdef&layer=3&head=5"
    with pytest.raises(AttributeError):
        state.no_such_field = 1
    with pytest.raises(TypeError):
        PageState(no_such_field=1)


def test_compress_fields_round_trip_and_bad_ones_are_dropped():
    state = parse("?model=smollm2-135m&sweep=0123456789abcdef&compress=fedcba9876543210&tol=10&pick=random:0.25:1")
    assert (state.part("compress").compress, state.part("compress").tol, state.part("compress").pick, state.sweep) == (
        "fedcba9876543210", 10, "random:0.25:1", "0123456789abcdef")
    assert parse(state.to_search()) == state and state.problems == []
    bad = parse("?compress=zz&tol=101&pick=<b>:1")
    assert (bad.compress, bad.tol, bad.pick) == (None, None, None)
    assert sorted(bad.problems) == ["The link's compress id 'zz' is not valid (8–64 hex digits).",
                                    "The link's policy '<b>:1' is not RANKING:FRACTION[:SEED].",
                                    "The link's tolerance 101 is more than 100 NIAH points; using the default."]

"""app/views/attention.py: the Attention page's views, on both run kinds (full patterns and statistics)."""

import numpy as np
import pytest

from headscope.analysis.capture import capture
from headscope.analysis.errors import InputError
from headscope.analysis.statistics_run import capture_statistics
from headscope.app.views import attention as views
from headscope.app.views import flow


@pytest.fixture
def run(tiny_model):
    return capture(tiny_model, "The keys to the cabinet are on the table.", pattern_dtype="float32")


def test_sink_map_view_is_received_attention_averaged_over_heads(run):
    _, rows = views.sink_map_view(run, {})
    p = run.patterns.astype(float)
    n = run.n_tokens
    j = 2  # attention key 2 receives from queries 3..n-1, averaged, then over heads
    expected = p[1, :, j + 1 :, j].sum(-1).mean() / (n - 1 - j)
    got = next(r["mean_received"] for r in rows if r.get("layer") == 1 and r.get("pos") == j)
    assert got == pytest.approx(expected, rel=1e-6)


def test_a_long_sink_map_reaches_the_browser_as_binary_arrays_with_each_cells_token_and_value():
    """The map of 30 layers × 515 positions: its hover names the cell's token and exact value, its axis
    numbers round positions, and the figure travels as float32 blocks, not a token and a value per cell
    in JSON (0.86 MB and 0.3 s to build and encode before: a head click made while it was on its way
    waited for it, #16)."""
    import json

    from headscope.app import figures

    rng = np.random.default_rng(0)
    values = rng.random((30, 515)) ** 6
    values[:, -1] = np.nan  # the last position has no later query
    tokens = [f"w{i}" for i in range(515)]
    fig = figures.layer_position_heatmap(values, tokens, "sinks", "received attention", log=True)
    trace = fig.data[0]
    assert list(trace.x) == figures.token_labels(tokens)  # the hover's "token %{x}": "7 w7"
    np.testing.assert_allclose(np.asarray(trace.customdata, float), values, rtol=1e-6, equal_nan=True)
    assert "%{customdata" in trace.hovertemplate and "%{x}" in trace.hovertemplate and trace.hoverongaps is False
    np.testing.assert_allclose(np.asarray(trace.z, float), np.log10(np.maximum(values, np.nanquantile(values, 0.01))),
                               rtol=1e-5, equal_nan=True)
    assert list(fig.layout.xaxis.ticktext) == [str(p) for p in range(0, 515, 50)]
    sent = fig.to_json()
    data = json.loads(sent)["data"][0]
    assert "bdata" in data["z"] and "bdata" in data["customdata"]
    assert len(sent) < 300_000, len(sent)


@pytest.mark.integration
def test_sink_title_says_when_a_text_is_too_short_to_call_sinks(real_model):
    import re

    from headscope.analysis.streaming import SINK_MIN_LATER

    short = capture(real_model, "The cat sat on the mat by the door.")
    assert short.n_tokens <= SINK_MIN_LATER  # no position has enough later tokens
    fig, _ = views.sink_map_view(short, {})
    title = fig.layout.title.text
    assert "too short to call sinks" in title and "is a sink for 0 heads" not in title
    assert f"this one has {short.n_tokens}" in title and f"a text needs at least {SINK_MIN_LATER + 1} tokens" in title
    # at the boundary: 16 tokens leave position 0 with 15 later tokens (too short), 17 with 16 (checked)
    words = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    for text, n, said in ((words, 16, "too short to call sinks"), (words + " seventeen", 17, "positions 0–0 checked")):
        run = capture(real_model, text)
        assert run.n_tokens == n
        title = views.sink_map_view(run, {})[0].layout.title.text
        assert said in title and f"at least {SINK_MIN_LATER} later tokens" not in title, title

    text = ("When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat, "
            "and the dog slept by the door until the evening came.")
    long = capture(real_model, text)
    fig, _ = views.sink_map_view(long, {})
    title = fig.layout.title.text
    assert "too short" not in title
    assert int(re.search(r"position 0 is a sink for (\d+) heads", title)[1]) > 0  # SmolLM2 sinks on 0
    assert f"positions 0–{long.n_tokens - 1 - SINK_MIN_LATER} checked" in title


def test_sink_title_in_statistics_mode_says_the_same(tiny_model):
    from headscope.analysis.statistics_run import capture_statistics
    from headscope.analysis.streaming import SINK_MIN_LATER

    for text in ("The keys to the cabinet are on the table.",
                 "The keys to the cabinet are on the table, and the table stands in the hall by the door "
                 "that opens onto the garden."):
        full = capture(tiny_model, text, pattern_dtype="float32")
        stats = capture_statistics(tiny_model, text)
        titles = [views.sink_map_view(r, {})[0].layout.title.text for r in (full, stats)]
        if full.n_tokens <= SINK_MIN_LATER:
            assert all("too short to call sinks" in t for t in titles)
        else:
            checked = f"positions 0–{full.n_tokens - 1 - SINK_MIN_LATER} checked"
            assert all(checked in t and "too short" not in t for t in titles)
        assert titles[0].split(":")[0] == titles[1].split(":")[0]
    assert full.n_tokens > SINK_MIN_LATER  # the second text is long enough to check position 0


def test_the_grid_and_sinks_of_a_statistics_run_are_those_of_its_patterns(tiny_model, run):
    """Both run kinds draw through one interface: same grid values, same sink map, and a statistics
    run says why rollout needs full patterns instead of failing on a missing array."""
    stats = capture_statistics(tiny_model, run.token_ids)
    for metric in ("entropy", "first_token", "previous_token"):
        full = [r["value"] for r in views.head_grid_view(run, {"metric": metric, "layer": 0, "head": 1})[1]]
        long = [r["value"] for r in views.head_grid_view(stats, {"metric": metric, "layer": 0, "head": 1})[1]]
        np.testing.assert_allclose(long, full, atol=2e-6, err_msg=metric)
    full = [r["mean_received"] for r in views.sink_map_view(run, {})[1] if "mean_received" in r]
    long = [r["mean_received"] for r in views.sink_map_view(stats, {})[1] if "mean_received" in r]
    np.testing.assert_allclose(long, full, atol=5e-6)
    _, pooled = views.attention_view(stats, {"layer": 1, "head": 0})
    _, cells = views.attention_view(run, {"layer": 1, "head": 0})
    assert pooled[0]["block"] == 1 and len(pooled) == len(cells)  # one token per block at this length
    np.testing.assert_allclose([r["mean_weight"] for r in pooled], [r["weight"] for r in cells], atol=1e-6)
    with pytest.raises(InputError, match=f"needs full attention patterns; this {run.n_tokens:,}-token run"):
        flow.relevance_view(stats, {"target": 2, "method": "rollout"})
    with pytest.raises(InputError, match="Layer 9 is out of range"):
        views.head_grid_view(stats, {"metric": "entropy", "layer": 9, "head": 0})


@pytest.mark.parametrize("stats_mode", [False, True])
def test_head_grid_marks_sliding_window_layers(embedded_tokenizer, stats_mode):
    """Gemma 3 (tiny, random): layers 0 and 2 slide over 6 keys, layer 1 is global; the grid says
    so on its layer axis and in every cell's hover, in both run kinds, and the export rows carry it."""
    from headscope.analysis.models import wrap_model
    from tests.tiny_families import tiny_family_model

    model = wrap_model(tiny_family_model("gemma3", len(embedded_tokenizer)), embedded_tokenizer,
                       name="tiny-gemma3", digest="tiny-gemma3-grid")
    text = "The keys to the cabinet are on the table by the door of the hall."
    run = capture_statistics(model, text) if stats_mode else capture(model, text, pattern_dtype="float32")
    assert run.layer_windows == [6, None, 6]
    fig, rows = views.head_grid_view(run, {"metric": "entropy"})
    assert list(fig.layout.yaxis.ticktext) == ["0 w", "1", "2 w"]
    hover = fig.data[0].customdata
    assert hover[0][0] == "sliding window of 6 keys" and hover[1][3] == "full attention"
    assert {(r["layer"], r["attention_window"]) for r in rows} == {(0, 6), (1, None), (2, 6)}


def test_head_grid_of_a_model_without_windows_has_plain_layers(run):
    assert run.layer_windows is None
    fig, rows = views.head_grid_view(run, {"metric": "entropy"})
    assert fig.layout.yaxis.ticktext is None and fig.layout.yaxis.title.text == "layer"
    assert all(r["attention_window"] is None for r in rows)


def _tiny_gemma3(embedded_tokenizer, digest):
    from headscope.analysis.models import wrap_model
    from tests.tiny_families import tiny_family_model

    return wrap_model(tiny_family_model("gemma3", len(embedded_tokenizer)), embedded_tokenizer,
                      name="tiny-gemma3", digest=digest)


def _notes(fig):
    return " ".join(a.text.replace("<br>", " ") for a in fig.layout.annotations)  # wrapped lines


@pytest.mark.parametrize("stats_mode", [False, True])
def test_streaming_grid_and_sink_map_say_which_layers_the_model_windows(embedded_tokenizer, stats_mode):
    """On a windowed layer the streaming score is read before the window binds, and the sink map
    averages each key over the queries that see it: both figures say so under the plot, naming the
    window, and mark those layers 'w'."""
    model = _tiny_gemma3(embedded_tokenizer, "tiny-gemma3-notes")
    text = "The keys to the cabinet are on the table by the door of the hall, and the hall is dark."
    run = capture_statistics(model, text) if stats_mode else capture(model, text, pattern_dtype="float32")
    fig, _ = views.head_grid_view(run, {"metric": "streaming"})
    note = _notes(fig)
    assert "w: windowed by the model (W=6)" in note and "until the window binds" in note
    fig, _ = views.sink_map_view(run, {})
    assert list(fig.layout.yaxis.ticktext) == ["0 w", "1", "2 w"]
    assert "w: windowed by the model (W=6)" in _notes(fig) and "queries that see it" in _notes(fig)
    # the note sits under the two-line title, not over it: the top margin holds both
    lines = next(a.text for a in fig.layout.annotations if "windowed" in a.text).count("<br>") + 1
    assert fig.layout.margin.t == 80 + 6 + 15 * lines and fig.layout.title.yref == "container"


def test_figures_of_a_model_without_windows_carry_no_window_note(run):
    for fig, _ in (views.head_grid_view(run, {"metric": "streaming"}), views.sink_map_view(run, {})):
        assert "windowed" not in _notes(fig)

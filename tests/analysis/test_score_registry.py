"""The head-score registry is the one list of scores: every menu, link vocabulary, command-line choice,
statistics-mode dispatch and compression ranking is read from it, and a name it does not hold is refused
with a message wherever it arrives."""

import dash
import numpy as np
import pytest

from headscope.analysis.errors import InputError
from headscope.analysis.score_registry import (
    HEAD_METRICS,
    HEAD_SCORES,
    KV_SCORES,
    PATTERN_SCORES,
    RUN_SCORES,
    STATISTICS_SCORES,
    HeadScore,
    ScoreInput,
    head_score,
    score_run,
)


@pytest.fixture(scope="module")
def menus(tmp_path_factory):
    """Each page's menu of scores, read from the layouts a served app builds: id → offered values."""
    from headscope.analysis.store import Store
    from headscope.app import ids
    from headscope.app.context import AppContext
    from headscope.app.offers import option_values, walk
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path_factory.mktemp("registry-home"))))
    wanted = {ids.METRIC, ids.HEADS_SCORE, ids.CMP_METRIC, ids.ABL_BY, ids.KV_RANKINGS}
    found = {}
    for page in dash.page_registry.values():
        layout = page["layout"]
        for component in walk(layout() if callable(layout) else layout):
            if isinstance(getattr(component, "id", None), str) and component.id in wanted:
                found[component.id] = [o["value"] for o in component.options]
                assert set(found[component.id]) == option_values(component.options)
    assert set(found) == wanted, f"menus not found: {wanted - set(found)}"
    return found


def test_every_menu_offers_the_registry_scores_it_can_compute(menus):
    """Attention and Compare: the scores of one text; Heads: every score over a sweep's prompts;
    Ablation: retrieval, the single-head effect, then the scores of one text; Compress: retrieval, the
    scores that rank KV groups, then the fixed ends."""
    from headscope.app import ids

    assert menus[ids.METRIC] == list(RUN_SCORES) == menus[ids.CMP_METRIC]
    assert menus[ids.HEADS_SCORE] == list(HEAD_SCORES)
    assert menus[ids.ABL_BY] == ["retrieval", "effect", *RUN_SCORES]
    assert menus[ids.KV_RANKINGS] == ["retrieval", *KV_SCORES, "random", "all_full", "all_streaming"]
    assert "evidence" in HEAD_SCORES and "evidence" not in RUN_SCORES  # it needs a sweep prompt's spans


def test_links_commands_and_rankings_read_the_same_names():
    from headscope.analysis.kv_compression import RANKINGS
    from headscope.analysis.kv_compression_choices import RANKINGS as RANKING_NAMES
    from headscope.analysis.statistics_run import STATS_METRICS
    from headscope.app.cli import build_parser
    from headscope.app.url_state import RANK_BY, SCORES, parse

    assert SCORES == tuple(HEAD_SCORES) and RANK_BY == ("retrieval", "effect", *RUN_SCORES)
    assert tuple(RANKINGS) == RANKING_NAMES == ("retrieval", *KV_SCORES, "random", "all_full", "all_streaming")
    assert STATS_METRICS == STATISTICS_SCORES and set(HEAD_METRICS) == set(PATTERN_SCORES) <= set(STATISTICS_SCORES)
    for name in RUN_SCORES:
        state = parse(f"?metric={name}&by={name}&score={name}")
        assert (state.metric, state.by, state.score, state.problems) == (name, name, name, [])
        assert build_parser().parse_args(["ablate", "--text", "x", "--top-k", "2", "--by", name]).by == name
        assert build_parser().parse_args(["compare", "a" * 8, "b" * 8, "--metric", name]).metric == name
    state = parse("?metric=evidence&by=evidence&score=evidence")
    assert (state.metric, state.by, state.score) == ("entropy", "retrieval", "evidence") and len(state.problems) == 2


@pytest.mark.parametrize("name", ["", "ENTROPY", "entropy ", "evidence", "__class__", "<b>x</b>", "é" * 5000])
def test_a_name_the_registry_does_not_offer_is_refused_at_the_command_line(name, capsys):
    from headscope.app.cli import build_parser

    for argv in (["ablate", "--text", "x", "--top-k", "2", "--by", name], ["compare", "a" * 8, "b" * 8, "--metric", name]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert ("--by" in err or "--metric" in err) and len(err) < 800 and "Traceback" not in err


@pytest.mark.parametrize("name", [None, 3, "", "bogus", "evidence ", ["entropy"], "x" * 100_000])
def test_unknown_names_are_an_input_error_naming_what_to_choose(name):
    with pytest.raises(InputError, match="Unknown score .*choose one of: entropy, first_token") as e:
        head_score(name)
    assert len(str(e.value)) < 400


def test_a_declaration_with_an_unknown_need_or_rounding_is_refused():
    with pytest.raises(ValueError, match="unknown needs"):
        HeadScore("x", "X", "", frozenset({"weights"}), lambda s: None)
    with pytest.raises(ValueError, match="rounding"):
        HeadScore("x", "X", "", frozenset({"patterns"}), lambda s: None, rounding="loose")


def test_signed_scores_are_drawn_on_a_diverging_scale_centred_at_zero():
    from headscope.app.figures import head_grid

    scores = np.array([[-2.0, 0.5], [1.0, np.nan]])
    signed = head_grid(scores, "a signed score", signed=True).data[0]
    plain = head_grid(scores, "a share").data[0]
    assert signed.zmid == 0 and plain.zmid is None
    low, high = signed.colorscale[0][1], signed.colorscale[-1][1]
    assert low != high and signed.colorscale != plain.colorscale


def test_a_score_that_needs_the_model_is_given_it_and_one_that_needs_spans_says_where_it_lives(tiny_model,
                                                                                               monkeypatch):
    """A score declared with ``needs={"model"}`` receives the model the caller has at hand (here the
    run's patterns are not needed, so it is computed from the ids alone)."""
    from headscope.analysis.capture import capture

    seen = {}

    def of_run(s: ScoreInput):
        seen.update(model=s.model, ids=list(s.token_ids))
        return np.full((s.model.n_layers, s.model.n_heads), float(len(s.token_ids)))

    monkeypatch.setitem(HEAD_SCORES, "probe", HeadScore("probe", "Probe", "", frozenset({"model"}), of_run,
                                                        rounding="exact"))
    run = capture(tiny_model, "The cat sat on the mat.")
    np.testing.assert_array_equal(run.head_scores("probe", tiny_model), np.full((2, 4), run.n_tokens))
    assert seen == {"model": tiny_model, "ids": run.token_ids}
    with pytest.raises(InputError, match="question span and an evidence span.*Heads page"):
        run.head_scores("evidence")
    with pytest.raises(InputError, match="question span and an evidence span"):
        HEAD_SCORES["evidence"].compute(run.patterns, run.token_ids)


def test_scores_that_need_patterns_say_why_a_statistics_run_cannot_give_them(tiny_model, monkeypatch):
    from headscope.analysis.statistics_run import capture_statistics

    stats = capture_statistics(tiny_model, "The cat sat on the mat.")
    monkeypatch.setitem(HEAD_SCORES, "patterns_only", HeadScore(
        "patterns_only", "Patterns only", "", frozenset({"patterns"}), lambda s: s.patterns, rounding="exact"))
    with pytest.raises(InputError, match="Patterns only needs full attention patterns, which a 7-token run does not"):
        score_run(stats, "patterns_only")


def test_numbers_a_description_spells_out_are_the_analysis_constants():
    """The registry imports nothing heavy, so S, W and the sink rule's later-query count are written out in
    the menu's words; they must be the numbers the scores use."""
    from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW, SINK_MIN_LATER

    assert f"first {DEFAULT_SINK} tokens plus the last {DEFAULT_WINDOW}" in HEAD_SCORES["streaming"].description
    assert f"a window of {SINK_MIN_LATER} keys or fewer" in HEAD_SCORES["mid_sink"].windowed


def test_the_registry_loads_nothing_heavy():
    """The command line checks --by, --metric and --rankings against it before torch or numpy loads."""
    import subprocess
    import sys

    probe = ("import sys\nimport headscope.analysis.score_registry, headscope.analysis.kv_compression_choices\n"
             "print(sorted(m for m in ('numpy', 'torch', 'transformers', 'dash') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

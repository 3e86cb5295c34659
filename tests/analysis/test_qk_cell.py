"""analysis/qk_cell.py: the cached capture a page explains cell after cell from, and terms summed by layer."""

from __future__ import annotations

import numpy as np
import pytest

from headscope.analysis import qk_cell
from headscope.analysis.errors import InputError
from headscope.analysis.models import wrap_model
from headscope.analysis.qk_attribution import qk_attribution
from tests.analysis.circuit_reference import reference_score
from tests.tiny_families import tiny_family_model

IDS = [5, 17, 42, 8, 99, 23, 61, 7, 13, 77, 31, 50]


@pytest.fixture
def model(embedded_tokenizer, monkeypatch):
    monkeypatch.setattr(qk_cell, "_captures", type(qk_cell._captures)())
    hf = tiny_family_model("llama", len(embedded_tokenizer), seed=2)
    return wrap_model(hf, embedded_tokenizer, name="tiny-llama", digest="tiny-llama-seed2")


def test_cells_from_the_cached_capture_equal_a_fresh_attribution_and_a_plain_hook_score(model, embedded_tokenizer):
    first = qk_cell.cell_attribution(model, IDS, 1, 3, 11, 6)
    assert qk_cell.is_cached(model, IDS)
    score, _ = reference_score(tiny_family_model("llama", len(embedded_tokenizer), seed=2), IDS, 1, 3, 11, 6)
    assert first.score == pytest.approx(score, rel=1e-5)
    for cell in ((1, 3, 11, 6), (1, 0, 9, 2), (0, 1, 4, 4), (1, 2, 11, 0)):
        cached = qk_cell.cell_attribution(model, IDS, *cell)
        np.testing.assert_allclose(cached.terms, qk_attribution(model, IDS, *cell).terms, rtol=1e-9, atol=1e-12)


def test_the_cache_keeps_one_run_and_the_next_run_replaces_it(model):
    qk_cell.cell_attribution(model, IDS, 1, 0, 5, 2)
    other = IDS[::-1]
    qk_cell.cell_attribution(model, other, 1, 0, 5, 2)
    assert qk_cell.is_cached(model, other) and not qk_cell.is_cached(model, IDS)
    assert len(qk_cell._captures) == qk_cell.CACHED == 1


@pytest.mark.parametrize("cell, said", [((1, 0, 2, 5), "comes after query"), ((1, 0, 12, 0), "outside the text"),
                                        ((1, 0, -1, 0), "outside the text"), ((1, 0, True, 0), "outside the text"),
                                        ((1, 0, 3.0, 0), "outside the text"), ((9, 0, 3, 0), "ayer"),
                                        ((1, 99, 3, 0), "ead")])
def test_a_bad_cell_is_refused_before_any_forward_pass(model, cell, said):
    with pytest.raises(InputError, match=said):
        qk_cell.cell_attribution(model, IDS, *cell)
    assert not qk_cell.is_cached(model, IDS)


def test_grouping_by_layer_sums_each_layers_heads_and_keeps_the_total(model):
    a = qk_cell.cell_attribution(model, IDS, 1, 1, 10, 4)
    groups, terms = qk_cell.grouped_by_layer(a.query_names, a.terms)
    assert groups == ["embed", "attn 0", "mlp.0", "bias", "input_bias"]
    assert terms.sum() == pytest.approx(a.terms.sum(), rel=1e-12)
    heads = [i for i, n in enumerate(a.query_names) if n.startswith("0.")]
    assert len(heads) == model.n_heads
    assert qk_cell.grouped_by_layer(["embed", "0.0", "1.1", "mlp.0", "mlp.1", "bias"], np.eye(6))[0] == [
        "embed", "attn 0", "mlp.0", "attn 1", "mlp.1", "bias"]
    mlp = a.query_names.index("mlp.0")
    assert terms[groups.index("attn 0"), groups.index("mlp.0")] == pytest.approx(a.terms[heads, mlp].sum(), rel=1e-12)
    assert terms[0, 0] == a.terms[0, 0]


def _wait_for(condition, seconds: float = 120.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _counting_captures(monkeypatch) -> list[int]:
    """Count the forward passes :func:`qk_cell.run_capture` makes (each the real capture)."""
    made: list[int] = []
    real = qk_cell.capture_components

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(qk_cell, "capture_components", counted)
    return made


def test_a_prefetched_capture_answers_the_first_cell_without_a_forward_pass(model, monkeypatch):
    made = _counting_captures(monkeypatch)
    assert qk_cell.prefetch(lambda: model, model.digest, IDS)
    assert _wait_for(lambda: qk_cell.is_cached(model, IDS))
    assert not qk_cell.prefetch(lambda: model, model.digest, IDS)  # made already: nothing more starts
    first = qk_cell.cell_attribution(model, IDS, 1, 3, 11, 6)
    assert len(made) == 1  # the prefetch's; the click made none
    np.testing.assert_array_equal(first.terms, qk_attribution(model, IDS, 1, 3, 11, 6).terms)


def test_a_click_during_the_prefetch_waits_for_it_instead_of_capturing_again(model, monkeypatch):
    made = _counting_captures(monkeypatch)
    assert qk_cell.prefetch(lambda: model, model.digest, IDS)
    a = qk_cell.cell_attribution(model, IDS, 1, 0, 9, 2)
    assert len(made) == 1
    np.testing.assert_array_equal(a.terms, qk_attribution(model, IDS, 1, 0, 9, 2).terms)


def test_prefetch_starts_nothing_for_what_a_click_would_refuse_and_survives_a_failure(model, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_MAX_TOKENS", "8")
    assert not qk_cell.prefetch(lambda: model, model.digest, IDS)  # 12 tokens over the limit of 8
    assert not qk_cell.prefetch(lambda: model, model.digest, [])
    assert not qk_cell.prefetch(lambda: model, model.digest, ["a", None])
    monkeypatch.delenv("HEADSCOPE_MAX_TOKENS")

    def broken():
        raise InputError("The model this server loads is not the one that made this run.")

    assert qk_cell.prefetch(broken, "other-digest", IDS)
    assert qk_cell.prefetch(lambda: model, model.digest, [i + 1 for i in IDS])  # the latest run shown
    assert _wait_for(lambda: qk_cell._prefetcher is None)
    assert not qk_cell.is_cached(model, IDS) and qk_cell.is_cached(model, [i + 1 for i in IDS])
    assert qk_cell.prefetch(lambda: model, model.digest, IDS)  # a new thread after the last one ended
    assert _wait_for(lambda: qk_cell.is_cached(model, IDS))

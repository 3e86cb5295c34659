"""app/context.py: the server's in-memory runs stay within HEADSCOPE_RUN_CACHE_MB; the models on offer."""

from __future__ import annotations

import pytest

from headscope.analysis.capture import capture
from headscope.analysis.store import Store
from headscope.app.context import AppContext, run_bytes

TEXTS = [f"Sentence number {i} is about " + "the quick brown fox and the lazy dog " * 12 for i in range(4)]


def test_served_runs_are_kept_within_the_memory_budget_and_reread_verified(tiny_model, tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    runs = [capture(tiny_model, text, store=store) for text in TEXTS]
    size = run_bytes(runs[0])
    assert size >= runs[0].patterns.nbytes > 0
    # room for two of the four runs
    monkeypatch.setenv("HEADSCOPE_RUN_CACHE_MB", str(2.5 * size / 2**20))
    context = AppContext(store=Store(tmp_path / "store"))
    for run in runs:
        assert context.run(run.key[:12]).key == run.key
    kept = context.cached_keys()
    assert kept == [runs[2].key, runs[3].key]  # least recently used dropped first
    assert sum(run_bytes(context.run(k)) for k in kept) <= 2.5 * size
    # a dropped run is read again from the store (verified bytes), with the same numbers
    again = context.run(runs[0].key[:12])
    assert (again.patterns == runs[0].patterns).all()


def test_the_latest_run_is_kept_even_when_it_alone_exceeds_the_budget(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_RUN_CACHE_MB", "0.001")
    store = Store(tmp_path / "store")
    context = AppContext(store=store)
    run = capture(tiny_model, TEXTS[0], store=store)
    context.remember(run)
    assert context.cached_keys() == [run.key]


def test_a_run_made_with_a_model_not_on_offer_puts_the_default_in_the_dropdown_and_says_so():
    from headscope.app.context import dropdown_model, offered_model

    problems: list[str] = []
    assert dropdown_model("smollm2-135m", problems) == "smollm2-135m" and problems == []
    assert dropdown_model("/data/models/private-model", problems) == offered_model(None)
    assert len(problems) == 1 and "does not offer" in problems[0] and "private-model" not in problems[0]


def test_a_run_id_that_is_not_a_key_prefix_finds_no_run(tiny_model, tmp_path):
    """Run ids come from links and page stores, so from requests: a number, an empty or short string
    finds nothing (it raised TypeError for a number, and '' matched the first cached run)."""
    store = Store(tmp_path / "store")
    context = AppContext(store=store)
    run = capture(tiny_model, TEXTS[0], store=store)
    context.remember(run)
    for forged in (5, 1.5, None, [], {}, "", run.key[:3], "zzzzzzzzzz", "a" * 1_000_000, run.key + "0"):
        assert context.run(forged) is None, forged
    assert context.run(run.key[:8]).key == run.key


def test_an_opt_in_model_is_on_offer_only_when_installed_and_its_menu_label_carries_its_terms(monkeypatch, tmp_path):
    """gemma3-270m without its package: not in the menu, refused by request; installed (a small real
    package in its place): offered after the default, its option label naming the Gemma terms."""
    from dataclasses import replace

    import headscope.app.context
    from headscope.analysis.models import EMBEDDED, ModelError
    from headscope.app.context import offered_model

    context = AppContext(store=Store(tmp_path / "store"))
    monkeypatch.setitem(EMBEDDED, "gemma3-270m", replace(EMBEDDED["gemma3-270m"], package="headscope_absent_optin_pkg"))
    assert "gemma3-270m" not in context.allowed_models()
    assert [o["label"] for o in context.model_options()] == context.allowed_models()  # no terms: plain specs
    monkeypatch.setattr(headscope.app.context, "_context", context)  # the allowlist offered_model reads
    with pytest.raises(ModelError, match="not offered"):
        offered_model("gemma3-270m")
    (tmp_path / "site" / "headscope_fake_optin_ctx").mkdir(parents=True)
    (tmp_path / "site" / "headscope_fake_optin_ctx" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(EMBEDDED, "gemma3-270m", replace(EMBEDDED["gemma3-270m"], package="headscope_fake_optin_ctx"))
    assert context.allowed_models()[:2] == ["smollm2-135m", "gemma3-270m"]
    assert offered_model("gemma3-270m") == "gemma3-270m" and offered_model(None) == "smollm2-135m"
    option = next(o for o in context.model_options() if o["value"] == "gemma3-270m")
    assert option["label"].startswith("gemma3-270m — Gemma Terms of Use")
    assert "third party" in option["label"] and "no chat template" in option["label"]

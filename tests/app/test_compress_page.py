"""The Compress page (``/compress``) in real Chromium against a real ``headscope serve`` on the embedded
model, kept small (one needle at 192 tokens, two fractions, the retrieval and random rankings): Cancel,
Run with progress, the table and the Pareto figure against :func:`headscope.analysis.kv_compression.evaluate_policies`
computed here on the same sweep, the pattern-folder download read back with ``np.loadtxt``, and a copied
link reopening the curve from the store without a job."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from tests.app.browsing import cut_off_titles, select_option

NEEDLE, LENGTH, DEPTH = "locker-code", 192, 50
FRACTIONS, SEEDS, SINK, RECENT = (0.25, 0.5), 2, 4, 32
RANKINGS = ("retrieval", "random")
PARETO, TABLE = "#hs-kv-pareto", "#hs-kv-table"


@pytest.fixture(scope="module")
def reference(real_model):
    """The same sweep and policies, computed in this process (no store): the analysis's own numbers."""
    from headscope.analysis.head_scores import trial_prompts
    from headscope.analysis.kv_compression import evaluate_policies
    from headscope.analysis.niah import load_needles, named_haystack
    from headscope.analysis.retrieval import sweep, trial_prompt

    needle = [n for n in load_needles() if n.id == NEEDLE]
    swept = sweep(real_model, needle, [LENGTH], [DEPTH], named_haystack("prose"))
    return evaluate_policies(real_model, {"retrieval": swept.scores}, RANKINGS, FRACTIONS,
                             texts=[p.token_ids for p in trial_prompts(swept.trials)],
                             prompts=[trial_prompt(t) for t in swept.trials], seeds=list(range(SEEDS)),
                             sink_size=SINK, recent_size=RECENT)


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def column(page, name: str) -> list[str]:
    return page.locator(f"{TABLE} td[data-dash-column='{name}']").all_inner_texts()


def fill_form(page) -> None:
    for box in page.locator("#hs-kv-needles input").all():
        box.uncheck()
    page.check(f"#hs-kv-needles input[value='{NEEDLE}']")
    page.fill("#hs-kv-lengths", str(LENGTH))
    page.fill("#hs-kv-depths", str(DEPTH))
    for box in page.locator("#hs-kv-rankings input").all():
        if box.get_attribute("value") in RANKINGS:
            box.check()
        else:
            box.uncheck()
    page.fill("#hs-kv-fractions", ",".join(map(str, FRACTIONS)))
    for field, value in (("#hs-kv-seeds", SEEDS), ("#hs-kv-sink", SINK), ("#hs-kv-recent", RECENT)):
        page.fill(field, str(value))


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # a one-trial sweep and 7 policies, twice (page and reference), on a shared 2-core machine
def test_compress_journey(server, page, real_model, reference):
    url, proc, home = server
    page.goto(url + "compress")
    page.wait_for_selector("#hs-kv-run", timeout=240_000)
    fill_form(page)

    # S + W covering the whole prompt is refused before any sweep runs, with what to change
    page.fill("#hs-kv-sink", str(LENGTH))
    page.click("#hs-kv-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('nothing to compress')",
                           timeout=120_000)
    assert f"S + W = {LENGTH + RECENT} keeps every key of a {LENGTH}-token prompt" in page.inner_text("#hs-error")
    page.fill("#hs-kv-sink", str(SINK))
    page.wait_for_function("!document.querySelector('#hs-kv-run').disabled", timeout=60_000)

    # Cancel stops the job: no curve, the page says what was kept
    page.click("#hs-kv-run")
    page.wait_for_function("!document.querySelector('#hs-kv-cancel').disabled", timeout=120_000)
    # a progress line has come back, so the browser knows the job it cancels (a click before that was lost)
    page.wait_for_function("/trial|evaluating/.test(document.querySelector('#hs-kv-status')?.innerText || '')",
                           timeout=120_000)
    page.click("#hs-kv-cancel")
    page.wait_for_function("(document.querySelector('#hs-kv-status')?.innerText || '').startsWith('Cancelled')",
                           timeout=240_000)
    page.wait_for_function("!document.querySelector('#hs-kv-run').disabled", timeout=240_000)
    assert "compress=" not in page.url

    # Run: a background job with progress; the curve's id goes into the URL
    page.click("#hs-kv-run")
    page.wait_for_function("new URLSearchParams(location.search).has('compress')", timeout=400_000)
    page.wait_for_selector(f"{TABLE} td[data-dash-column='loss']")
    assert page.inner_text("#hs-error").strip() == ""
    assert "6 policies and the uncompressed model evaluated" in page.inner_text("#hs-kv-status")

    # the table: the uncompressed model, then every policy, equal to evaluate_policies run here
    want = [reference.baseline, *reference.evaluations]
    assert column(page, "ranking") == ["uncompressed", "retrieval", "retrieval", "random", "random", "random", "random"]
    for name, digits in (("kv_fraction", 4), ("loss", 4), ("agreement", 4), ("niah_accuracy", 3)):
        shown = [float(x) for x in column(page, name)]
        expected = [e.row()[name] for e in want]
        np.testing.assert_allclose(shown, expected, atol=0.5 * 10 ** -digits + 1e-6, err_msg=name)
    assert column(page, "seed") == ["", "", "", "0", "1", "0", "1"]

    # the Pareto figure: the retrieval curve's points, random as a band from the lowest to the highest seed
    data = plot_data(page, PARETO)
    accuracy = [t for t in data if t.get("yaxis", "y") == "y"]
    retrieval = next(t for t in accuracy if t["name"].startswith("Retrieval score"))
    mine = sorted((e for e in reference.evaluations if e.policy.ranking == "retrieval"), key=lambda e: e.memory.fraction)
    np.testing.assert_allclose(retrieval["x"], [e.memory.fraction for e in mine])
    np.testing.assert_allclose(retrieval["y"], [e.niah_accuracy for e in mine])
    band = next(t for t in accuracy if t["name"].startswith(f"Random groups: {SEEDS} seeds"))
    rand = [[e.niah_accuracy for e in reference.evaluations if e.policy.ranking == "random" and e.policy.fraction == f]
            for f in FRACTIONS]
    np.testing.assert_allclose(band["y"], [max(v) for v in rand] + [min(v) for v in rand][::-1])
    loss_curve = next(t for t in data if t.get("yaxis") == "y2" and t["name"].startswith("Retrieval score"))
    np.testing.assert_allclose(loss_curve["y"], [e.loss for e in mine], rtol=1e-5)
    best = reference.smallest_within("retrieval", 0.05)
    info = page.inner_text("#hs-kv-info")
    where = "none" if best is None else f"KV {best.memory.fraction:.3f}"
    assert f"Smallest KV within 5 NIAH points of full, Retrieval score (group max): {where}" in info
    assert cut_off_titles(page) == []  # the Pareto figure's and the policy map's titles fit

    # the map shows the retrieval policy the CLI would export (the smallest within the tolerance, else the
    # largest); the other retrieval policy, chosen from the menu, downloads as DuoAttention's pattern folder:
    # layers × KV heads as np.loadtxt reads it
    shown = best or reference.find("retrieval", max(FRACTIONS))
    np.testing.assert_array_equal(np.array(plot_data(page, "#hs-kv-policy")[0]["z"], dtype=float),
                                  shown.policy.full.astype(float))
    other_fraction = next(f for f in FRACTIONS if f != shown.policy.fraction)
    pick = f"retrieval:{other_fraction:g}"
    select_option(page, "hs-kv-pick", pick)
    page.wait_for_function("p => new URLSearchParams(location.search).get('pick') === p", arg=pick)
    with page.expect_download() as got:
        page.click("#hs-kv-download")
    with zipfile.ZipFile(got.value.path()) as z:
        table = np.loadtxt(io.BytesIO(z.read("pattern/full_attention_heads.tsv")), delimiter="\t")
        config = json.loads(z.read("pattern/config.json"))
    assert table.shape == (real_model.n_layers, real_model.n_kv_heads) == (30, 3)
    np.testing.assert_array_equal(table, reference.find("retrieval", other_fraction).policy.full.astype(float))
    assert (config["sink_size"], config["recent_size"]) == (SINK, RECENT)

    # a copied link reopens the curve and the chosen policy from the store: no job runs
    link = page.url
    other = page.context.new_page()
    other.goto(link)
    other.wait_for_selector(f"{TABLE} td[data-dash-column='loss']", timeout=240_000)
    assert column(other, "loss") == column(page, "loss")
    other.wait_for_selector("#hs-kv-policy .heatmaplayer .hm")
    z = np.array(plot_data(other, "#hs-kv-policy")[0]["z"], dtype=float)
    np.testing.assert_array_equal(z, table)
    assert other.inner_text("#hs-kv-status") == "" and other.get_attribute("#hs-kv-progress", "value") == "0"
    assert other.input_value("#hs-kv-fractions") == "0.25,0.5" and other.input_value("#hs-kv-sink") == str(SINK)
    other.close()
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_compress_inputs_have_bounds_and_say_them(server, page):
    """A negative context length, and an S of 300 digits (past the box's maximum, which the browser then
    does not send): each refused before anything runs, with the bound, never echoing what was typed."""
    url, proc, _ = server
    page.goto(url + "compress")
    page.wait_for_selector("#hs-kv-run", timeout=240_000)
    fill_form(page)

    def refused(before: str) -> str:
        """Run, and the banner's new message (not ``before``, the last one)."""
        page.wait_for_function("!document.querySelector('#hs-kv-run').disabled", timeout=120_000)
        page.click("#hs-kv-run")
        page.wait_for_function("b => { const t = (document.querySelector('#hs-error')?.innerText || '').trim(); "
                               "return (t && t !== b) || new URLSearchParams(location.search).has('compress'); }",
                               arg=before, timeout=240_000)
        assert "compress=" not in page.url
        return page.inner_text("#hs-error").strip()

    page.fill("#hs-kv-lengths", "-5")
    shown = refused("")
    assert "Context lengths must be whole numbers of tokens from 1 to 1,048,576, got -5" in shown
    assert "-5-token" not in shown and "−5-token" not in shown

    page.fill("#hs-kv-lengths", str(LENGTH))
    digits = "9" * 300
    page.fill("#hs-kv-sink", digits)
    shown = refused(shown)
    assert "S (sinks) must be a whole number from 0 to 1,048,576" in shown
    assert "999999999999" not in shown and len(shown) < 200, shown
    assert proc.poll() is None

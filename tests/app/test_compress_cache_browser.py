"""The Compress page on the cache backend (#42 item 1), in real Chromium against ``headscope serve``: the
backend chosen in the form runs the policies on caches as small as they say, and the table holds the
numbers the masking backend gives (computed here with ``evaluate_policies`` on eager); the link
reopens the curve with the backend in the form."""

from __future__ import annotations

import numpy as np
import pytest

from tests.app.browsing import select_option
from tests.app.test_compress_page import TABLE, column, fill_form
from tests.app.test_compress_page import reference as reference  # noqa: F401  (the module's fixture)


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(900)  # a one-trial sweep and 7 policies, twice (page and reference), on a shared 2-core machine
def test_the_cache_backend_gives_the_masks_numbers_on_the_page(server, page, real_model, reference):  # noqa: F811
    url, proc, _ = server
    page.goto(url + "compress")
    page.wait_for_selector("#hs-kv-run", timeout=240_000)
    fill_form(page)
    select_option(page, "hs-kv-backend", "cache")
    page.click("#hs-kv-run")
    page.wait_for_function("new URLSearchParams(location.search).has('compress')", timeout=600_000)
    page.wait_for_selector(f"{TABLE} td[data-dash-column='loss']")
    assert page.inner_text("#hs-error").strip() == ""
    assert "evaluated on the cache backend" in page.inner_text("#hs-kv-info")
    want = [reference.baseline, *reference.evaluations]
    assert column(page, "ranking") == ["uncompressed"] + [e.policy.ranking for e in reference.evaluations]
    for name, digits in (("kv_fraction", 4), ("loss", 4), ("agreement", 4), ("niah_accuracy", 3)):
        shown = [float(x) for x in column(page, name)]
        expected = [e.row()[name] for e in want]
        np.testing.assert_allclose(shown, expected, atol=0.5 * 10 ** -digits + 1e-5, err_msg=name)

    other = page.context.new_page()
    other.goto(page.url)
    other.wait_for_selector(f"{TABLE} td[data-dash-column='loss']", timeout=240_000)
    assert other.inner_text("#hs-kv-backend").strip().startswith("cache")
    other.close()
    assert proc.poll() is None

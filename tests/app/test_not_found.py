"""Unknown paths in real Chromium against a real server: the app's own 404 page (header, message,
links to every page), answered with status 404, for ordinary, hostile, very long and non-ASCII paths;
never a traceback."""

from __future__ import annotations

import http.client
import urllib.parse

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.integration]

PAGES = ["/", "/flow", "/heads", "/qk", "/ablation", "/patching", "/compare", "/compress"]


def assert_not_found_page(page, shown: str) -> None:
    page.wait_for_selector("#hs-not-found")
    text = page.locator("#hs-not-found").inner_text()
    assert "No page at" in text and shown in text, text
    hrefs = page.locator("#hs-not-found a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert set(PAGES) <= set(hrefs), hrefs
    assert page.locator("header.hs-header").count() == 1  # in the app's layout, with its navigation
    body = page.locator("body").inner_text()
    assert "404 - Page not found" not in body and "Traceback" not in body
    nav = page.locator("header .hs-nav").inner_text()
    assert "not found" not in nav.lower() and "404" not in nav  # the 404 page is no page of the navigation


@pytest.mark.parametrize("path, shown", [
    ("/nowhere", "/nowhere"),
    ("/heads/extra", "/heads/extra"),
    ("/../etc/passwd", "/etc/passwd"),  # the browser resolves the dots: the path asked is /etc/passwd
    ("/%3Cscript%3Ealert(1)%3C/script%3E", "<script>alert(1)</script>"),
    ("/страница-页面-ü", "/страница-页面-ü"),
    ("/" + "a" * 1500, "/" + "a" * 100),
    ("/" + "b" * 5000, "/" + "b" * 100),
], ids=["plain", "under-a-page", "dots", "script", "unicode", "long", "very-long"])
def test_an_unknown_path_shows_the_apps_404_page(server, page, path, shown):
    url, proc, _ = server
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    response = page.goto(url.rstrip("/") + path)
    assert response.status == 404  # a missing page says so to the browser too, not only in its text
    assert_not_found_page(page, shown)
    assert not dialogs  # a path is shown as text, never run
    page.click("#hs-not-found a[href='/heads']")
    page.wait_for_selector("#hs-heads-run")
    assert proc.poll() is None


@pytest.mark.parametrize("raw", ["/../etc/passwd", "/..%2f..%2fetc%2fpasswd", "/" + "c" * 5000, "/%00", "/%ff%fe"])
def test_a_hostile_raw_request_gets_no_file_and_no_traceback(server, raw):
    url, proc, _ = server
    host = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    conn.putrequest("GET", raw, skip_accept_encoding=True)  # sent as written, dots and all
    conn.endheaders()
    response = conn.getresponse()
    body = response.read().decode("utf-8", "replace")
    conn.close()
    assert response.status in (400, 404, 414), response.status
    assert "root:" not in body and "Traceback" not in body
    assert proc.poll() is None


def _status(url: str, path: str, method: str = "GET") -> int:
    host = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_missing_page_answers_404_and_every_page_200_over_raw_http(server):
    """What curl, a link checker or a crawler sees: 404 for a path no page has (it was 200: Dash
    Pages serves every path through one route), 200 for every page (with a query, a trailing slash),
    and for the app's own routes and assets."""
    url, proc, _ = server
    for path in ["/nowhere", "/heads/extra", "/not-found", "/flow.html", "/%3Cscript%3E", "/%D1%8F"]:
        assert _status(url, path) == 404, path
        assert _status(url, path, "HEAD") == 404, path
    for path in [*PAGES, "/flow/", "/ablation?run=0123456789abcdef&heads=3.1", "/patching?patching=0123456789abcdef", "/_dash-layout",
                 "/_dash-dependencies", "/assets/headscope.css", "/_favicon.ico"]:
        assert _status(url, path) == 200, path
    assert proc.poll() is None

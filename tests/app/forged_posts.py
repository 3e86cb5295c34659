"""Raw POSTs to a running server's Dash callbacks, as a hostile or broken client sends them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

UPDATE = "_dash-update-component"


def post(url: str, body: dict, query: str = "") -> tuple[int, dict | None, bytes]:
    """One POST of ``body`` to the server's callback endpoint: (status, JSON answer or None, raw bytes)."""
    req = urllib.request.Request(url + UPDATE + query, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            payload = r.read()
            return r.status, json.loads(payload) if payload else None, payload
    except urllib.error.HTTPError as e:
        return e.code, None, e.read()


def answer(url: str, body: dict, timeout: float = 120) -> tuple[int, dict | None, bytes]:
    """The callback's answer; a background callback's job is followed until it ends, as the renderer does."""
    status, data, raw = post(url, body)
    deadline = time.time() + timeout
    while status == 200 and data and "cacheKey" in data and time.time() < deadline:
        time.sleep(0.5)
        query = "?" + urllib.parse.urlencode({"cacheKey": data["cacheKey"], "job": data["job"]})
        status, got, raw = post(url, body, query)
        if status != 200 or (got and ("response" in got or "sideUpdate" in got)):
            return status, got, raw
    return status, data, raw

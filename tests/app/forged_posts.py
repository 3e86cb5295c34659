"""Raw POSTs to a running server's Dash callbacks, as a hostile or broken client sends them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

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


def outputs_of(output: str) -> list[dict]:
    """A dependency's ``output`` string (``id.prop`` or ``..id.prop...id.prop..``) as the request's outputs."""
    parts = output.strip(".").split("...") if output.startswith("..") else [output]
    out = []
    for part in parts:
        cid, _, prop = part.rpartition(".")
        out.append({"id": json.loads(cid) if cid.startswith("{") else cid, "property": prop})
    return out


def request_body(dep: dict, values: Mapping[str, Any]) -> dict:
    """``dep``'s (a ``/_dash-dependencies`` entry) request as the renderer sends it, with ``values`` keyed
    ``id.property`` (None where absent) and the first input as the one that changed."""
    def item(spec):
        return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

    outputs = outputs_of(dep["output"])
    return {"output": dep["output"], "outputs": outputs if dep["output"].startswith("..") else outputs[0],
            "inputs": [item(s) for s in dep["inputs"]], "state": [item(s) for s in dep["state"]],
            "changedPropIds": [f"{dep['inputs'][0]['id']}.{dep['inputs'][0]['property']}"]}

"""Every registered callback, fuzzed over HTTP against a real ``headscope serve``.

The callbacks are read from ``/_dash-dependencies`` (a new callback is fuzzed without editing this
file), the controls' own values from the app shell and every page's layout (through the pages
router, as a browser gets them). Each Input and State then gets, one at a time, values of the
wrong type, out of range, paths (absolute, relative, ``..``, a canary file and its folder outside
``HEADSCOPE_HOME``), a ~1 MB string and the values of other controls, posted straight to
``/_dash-update-component``. Asserts: no 500, no callback failing without a message, the server
still serves ``GET /``, and the canary file's unique word appears in no response, no file under
``HEADSCOPE_HOME`` and not the server log.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.app.forged_posts import outputs_of
from tests.app.registered_pages import registered_pages
from tests.app.servers import start_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
UPDATE = "_dash-update-component"
POLL_S = 10  # how long one background job is followed before the fuzzer moves on


class Served:
    def __init__(self, url: str, proc: subprocess.Popen, home: Path, log: Path, word: str, canary: Path):
        self.url, self.proc, self.home, self.log, self.word, self.canary = url, proc, home, log, word, canary
        self.sent = 0
        self.statuses: collections.Counter = collections.Counter()
        self.leaks: list[str] = []
        self.errors: list[str] = []
        self.end_id: str | None = None
        self.pages: list[dict] = []  # every registered page (tests/app/registered_pages.py)
        self.fetched: dict[str, set] = {}  # a page's path -> the ids of the layout the router answered with

    def request(self, path: str, body: object | None = None, timeout: float = 120) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        self.sent += 1
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        self.statuses[status] += 1
        if self.word.encode() in payload:
            self.leaks.append(f"{path} {json.dumps(body)[:300]}")
        return status, payload


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside-home")  # the canary lives outside HEADSCOPE_HOME
    word = "canary" + secrets.token_hex(8)
    canary = outside / "secret.txt"
    canary.write_text(f"The secret word is {word}. " * 400)
    (outside / "weights.gguf").write_text(word)
    (outside / "model").mkdir()
    (outside / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "note": word}))
    (outside / "model" / "model.safetensors").write_text(word)
    home = tmp_path_factory.mktemp("home")
    log = home.parent / f"{home.name}-server.log"  # beside, not inside, the home it scans
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1",
           "HEADSCOPE_MAX_SWEEP_TRIALS": "1", "HEADSCOPE_MAX_QK_POINTS": "64"}
    for name in ("HEADSCOPE_TOKEN", "HEADSCOPE_MODELS", "HEADSCOPE_REDIS_URL"):
        env.pop(name, None)
    pages = registered_pages()["pages"]
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, log)
    served = Served(url, proc, home, log, word, canary)
    served.pages = pages
    yield served
    proc.terminate()
    proc.wait(timeout=30)


def components(node, found: dict) -> None:
    """Collect id → props of every component in a layout's JSON, or in a callback's answer (the router's:
    ``{"_pages_content": {"children": layout}, …}``)."""
    if isinstance(node, list):
        for child in node:
            components(child, found)
    elif isinstance(node, dict) and "props" in node and "type" in node:
        props = node["props"]
        if "id" in props:
            key = props["id"] if isinstance(props["id"], str) else json.dumps(props["id"], sort_keys=True)
            found[key] = props
        for value in props.values():
            components(value, found)
    elif isinstance(node, dict):
        for value in node.values():
            components(value, found)


def concrete(dep_id, found: dict) -> list:
    """The concrete ids a (possibly pattern-matching) id stands for, among the layouts' components."""
    if isinstance(dep_id, str):
        return [dep_id]
    out = []
    for key in found:
        if key.startswith("{"):
            cid = json.loads(key)
            if all(cid.get(k) == v for k, v in dep_id.items() if not isinstance(v, list)) and cid.keys() == dep_id.keys():
                out.append(cid)
    return out


def page_layouts(served: Served, deps: list) -> dict:
    """id → props over the shell and every page of the app's page registry (none listed here: a new page is
    fuzzed as it is registered), each page's layout fetched through the pages router, as a browser gets it."""
    found: dict = {}
    _, shell = served.request("_dash-layout")
    components(json.loads(shell), found)
    router = next(d for d in deps if "_pages_content.children" in d["output"])
    for path in (page["path"] for page in served.pages):
        body = request_body(router, {"_pages_location.pathname": path, "_pages_location.search": ""}, {})
        status, payload = served.request(UPDATE, body)
        assert status == 200, payload[:500]
        own: dict = {}
        components(json.loads(payload)["response"], own)
        served.fetched[path] = set(own)
        found.update(own)
    return found


def request_body(dep: dict, values: dict, found: dict) -> dict:
    """A callback request as the renderer sends it, with ``values`` keyed ``id.property``."""

    def item(spec):
        ids = concrete(spec["id"], found) if not isinstance(spec["id"], str) else [spec["id"]]
        items = [{"id": i, "property": spec["property"],
                  "value": values.get(f"{i if isinstance(i, str) else json.dumps(i, sort_keys=True)}.{spec['property']}")}
                 for i in ids]
        return items if not isinstance(spec["id"], str) else items[0]

    inputs = [item(s) for s in dep["inputs"]]
    return {"output": dep["output"], "outputs": outputs_of(dep["output"]) if dep["output"].startswith("..")
            else outputs_of(dep["output"])[0], "inputs": inputs, "state": [item(s) for s in dep["state"]],
            "changedPropIds": [f"{s['id']}.{s['property']}" for s in dep["inputs"][:1] if isinstance(s["id"], str)]}


def fuzz_values(served: Served, others: list) -> list:
    canary = served.canary
    paths = [str(canary), str(canary.parent), str(canary.parent / "weights.gguf"), str(canary.parent / "model"),
             os.path.relpath(canary, ROOT), "../" * 8 + str(canary).lstrip("/"), "/etc/passwd", "file://" + str(canary)]
    links = ["?" + urllib.parse.urlencode({"model": p, "haystack": p, "labels": p}) for p in paths[:4]]
    upload = {"contents": "data:text/plain;base64," + base64.b64encode(str(canary).encode()).decode(),
              "filename": str(canary)}
    nested: list = []
    for _ in range(400):  # deep, yet within what the server's JSON parser takes
        nested = [nested]
    return [None, [], {}, [1, "a", None], {"a": {"b": [1]}}, -1, 1.5, 10**12, True, "",
            10**400, -(10**400), nested, "[" * 5000 + "]" * 5000, "9" * 5000, "²",  # past float, int() and recursion
            *paths, *links, upload, "A" * 1_000_000, *others]


def follow_job(served: Served, body: dict, first: dict) -> None:
    """Poll a background callback's job briefly, as the renderer does (its handles are signed)."""
    query = {"cacheKey": first["cacheKey"], "job": first["job"]}
    if served.end_id:
        query["endId"] = served.end_id
    deadline = time.time() + POLL_S
    while time.time() < deadline:
        status, payload = served.request(f"{UPDATE}?{urllib.parse.urlencode(query)}", body)
        assert status != 500, payload[:500]
        if status != 200 or b'"response"' in payload or b'"sideUpdate"' in payload:
            return  # 204: finished without an update; a response: finished
        time.sleep(0.3)


@pytest.mark.timeout(900)  # ~12,000 requests: 185 s on a 2-core machine at load 4, past the 300 s default at load 10
def test_every_callback_survives_forged_values_and_never_reads_a_path(served):
    t0 = time.time()
    _, index = served.request("")
    m = re.search(rb'"end_id":\s*"([^"]+)"', index)
    served.end_id = m and m[1].decode()
    _, deps_json = served.request("_dash-dependencies")
    registered = json.loads(deps_json)
    deps = [d for d in registered if not d.get("clientside_function")]
    assert len(deps) >= 20, "fewer callbacks than the pages register"
    found = page_layouts(served, deps)
    problems = []
    for dep in registered:  # browser-side callbacks: the server has nothing to run, and says so
        if dep.get("clientside_function"):
            status, payload = served.request(UPDATE, {**request_body(dep, {}, found), "inputs": [
                {"id": s["id"], "property": s["property"], "value": str(served.canary)} for s in dep["inputs"]
                if isinstance(s["id"], str)]})
            if status != 400:
                problems.append(f"{status} clientside {dep['output'][:80]}: {payload[:200]!r}")
    base = {f"{i}.{p}": v for i, props in found.items() for p, v in props.items()}
    others = sorted({v for k, v in base.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)
                     and k.endswith(".value")}, key=str)[:12]
    values = fuzz_values(served, others)
    fuzzed, failures, unexplained = 0, 0, {}
    for dep in deps:
        targets = dep["inputs"] + dep["state"]
        fuzzed += 1
        for spec in targets:
            for cid in concrete(spec["id"], found):
                key = f"{cid if isinstance(cid, str) else json.dumps(cid, sort_keys=True)}.{spec['property']}"
                for value in values:
                    body = request_body(dep, {**base, key: value}, found)
                    status, payload = served.request(UPDATE, body)
                    if status == 500 or b"Traceback" in payload:
                        problems.append(f"{status} {dep['output']} {key}={json.dumps(value)[:80]}: {payload[:300]!r}")
                    elif status == 200 and b'"cacheKey"' in payload:
                        follow_job(served, body, json.loads(payload))
                if not isinstance(spec["id"], str):
                    break  # one concrete id of a pattern stands for the rest
                # the same position under another id: Dash passes values by position, so a renamed item
                # must be refused as a whole (else its value skips the check of the control it replaces)
                for renamed, prop in (("no-such-control", spec["property"]), (cid, "value" if spec["property"] != "value"
                                                                              else "n_clicks")):
                    body = request_body(dep, {**base, key: str(served.canary)}, found)
                    for group in ("inputs", "state"):
                        body[group] = [{**item, "id": renamed, "property": prop}
                                       if isinstance(item, dict) and item["id"] == cid and item["property"] == spec["property"]
                                       else item for item in body[group]]
                    status, payload = served.request(UPDATE, body)
                    if status != 400:
                        problems.append(f"{status} {dep['output']} {key} sent as {renamed}.{prop}: not refused")
        status, _ = served.request("")
        assert status == 200, f"the server stopped serving after fuzzing {dep['output']}"
        failed = served.log.read_text(errors="replace").count("callback failed")
        if failed > failures:
            unexplained[dep["output"]] = failed - failures
            failures = failed
    seconds = time.time() - t0
    print(f"\nfuzzed {fuzzed} server callbacks and refused {len(registered) - fuzzed} browser-side ones "
          f"({len(registered)} registered) with {served.sent} requests in {seconds:.0f} s; statuses "
          f"{dict(served.statuses)}; errors without a message, by callback: {unexplained}")
    assert served.proc.poll() is None, "the server died"
    assert not problems, "\n".join(problems[:20])
    assert not unexplained, f"callbacks failed without a message: {unexplained}"
    assert not served.leaks, "the canary's word came back in:\n" + "\n".join(served.leaks[:10])
    for path in served.home.rglob("*"):
        if path.is_file():
            assert served.word.encode() not in path.read_bytes(), f"the canary's word was written to {path}"
    assert served.word not in served.log.read_text(errors="replace"), "the canary's word reached the server log"
    assert "Traceback" not in served.log.read_text(errors="replace")


def test_every_registered_page_is_fuzzed(served):
    """The fuzzer reads the layout of every page in the app's page registry, so each page's controls are
    sent their own values and its pattern-matching ids are made concrete (a page it does not read has
    its callbacks fuzzed with nothing but None). Each page answers through the router with its own
    layout, not the 404 page's."""
    _, deps_json = served.request("_dash-dependencies")
    page_layouts(served, json.loads(deps_json))
    registered = {page["path"]: page for page in served.pages}
    assert len(registered) >= 9 and "/compress" in registered  # the registry as the app has it
    assert sorted(served.fetched) == sorted(registered), "pages the fuzzer does not read"
    for path, page in registered.items():
        missing = set(page["ids"]) - served.fetched[path]
        assert page["ids"] and not missing, f"{page['module']}: the router's layout lacks {sorted(missing)[:5]}"


def test_sweep_with_a_haystack_path_reads_no_file(served):
    """Issue #14.1's attack: a valid one-trial sweep whose haystack choice is a server path."""
    _, deps_json = served.request("_dash-dependencies")
    dep = next(d for d in json.loads(deps_json) if any(s["id"] == "hs-heads-haystack" for s in d["state"]))
    found: dict = {}
    values = {"hs-heads-run.n_clicks": 1, "hs-heads-needles.value": ["locker-code"], "hs-heads-lengths.value": "128",
              "hs-heads-depths.value": "50", "hs-heads-sink.value": 4, "hs-heads-window.value": 64,
              "hs-heads-custom-needles.value": "", "heads-hs-url.search": ""}
    for path in (str(served.canary), str(served.canary.parent)):
        body = request_body(dep, {**values, "hs-heads-haystack.value": path,
                                  "hs-heads-custom-haystack.value": path}, found)
        status, payload = served.request(UPDATE, body)
        assert status == 400 and b"hs-heads-haystack.value is not one of its options" in payload, payload[:300]
    assert not served.leaks

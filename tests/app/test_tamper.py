"""Stored bytes are untrusted: what a server, the CLI and the job cache read back is verified first.

A real ``headscope serve`` on the embedded model, real HTTP posts to ``/_dash-update-component`` and
real Chromium; a real Dash background job through the JSON job cache; a real redis-server.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.app.browsing import run_prompt, wait_for_run
from tests.app.servers import start_server as start_served

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps."


class Bomb:
    """Unpickling it creates ``path``: the canary that tells a pickle was loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


# -- a real server --------------------------------------------------------------------------------


def start_server(home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("HEADSCOPE_REDIS_URL", None)
    return start_served([sys.executable, "-m", "headscope.app.cli", "serve"], env, log)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def render_attention(url: str, search: str) -> dict:
    """What the Attention page's ``render`` callback answers for ``search``, as the browser asks it."""
    from headscope.app import ids
    from headscope.app.page_shell import url_id

    location = url_id("attn")
    deps = json.load(urllib.request.urlopen(url + "_dash-dependencies", timeout=30))
    dep = next(d for d in deps if f"{ids.HEATMAP}.figure" in d["output"]
               and {"id": location, "property": "search"} in d["inputs"])
    outputs = []
    for part in dep["output"].strip(".").split("..."):
        cid, prop = part.rsplit(".", 1)
        outputs.append({"id": cid, "property": prop})
    state = [{**d, "value": None} for d in dep.get("state", [])]  # what a fresh page holds
    body = {"output": dep["output"], "outputs": outputs, "changedPropIds": [f"{location}.search"], "state": state,
            "inputs": [{"id": location, "property": "search", "value": search}]}
    req = urllib.request.Request(url + "_dash-update-component", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.load(r)["response"]


def heatmap(response: dict) -> np.ndarray:
    z = response["hs-heatmap"]["figure"]["data"][0]["z"]
    if isinstance(z, dict):  # plotly's typed-array encoding: {"dtype", "bdata" (base64), "shape"}
        import base64

        flat = np.frombuffer(base64.b64decode(z["bdata"]), dtype=np.dtype(z["dtype"]))
        shape = [int(n) for n in str(z["shape"]).split(",")] if "shape" in z else [len(flat)]
        return flat.reshape(shape).astype(np.float64)
    return np.array([[np.nan if v is None else v for v in row] for row in z], dtype=np.float64)


def error_text(response: dict) -> str:
    return json.dumps(next(v["children"] for k, v in response.items() if k.startswith("hs-error")))


def expected_heatmap(patterns: np.ndarray) -> np.ndarray:
    p = patterns[0, 0].astype(np.float64)
    return np.where(np.tril(np.ones(p.shape, dtype=bool)), p, np.nan)


def job_cache_rows(folder: Path) -> list[tuple]:
    with sqlite3.connect(folder / "cache.db") as db:
        return db.execute("SELECT key, raw, mode, filename, value FROM Cache").fetchall()


def assert_json_only(folder: Path) -> int:
    """Every job-cache entry is JSON (or the raw bytes of Dash's signing secret): no pickle."""
    from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT

    rows = job_cache_rows(folder)
    for key, raw, mode, filename, value in rows:
        assert raw == 1 and isinstance(key, str), key
        assert mode != MODE_PICKLE, key
        if mode == MODE_RAW and isinstance(value, str):
            json.loads(value)
        elif mode == MODE_TEXT:
            json.loads((folder / filename).read_text())
        else:
            assert mode in (MODE_RAW, MODE_BINARY) and key == "__dash_background_signing_secret__", key
    for path in folder.rglob("*.val"):
        json.loads(path.read_text())  # JSON text, never pickle protocol bytes
    return len(rows)


def run_id_of(page_url: str) -> str:
    return urllib.parse.parse_qs(urllib.parse.urlparse(page_url).query)["run"][0]


# -- the served case ------------------------------------------------------------------------------


@pytest.mark.browser
def test_tampered_run_files_never_reach_a_live_server_and_are_recomputed(tmp_path, page, real_model):
    """While a server holds a run it read from the store, its patterns file is flipped in place
    (same size and mtime), truncated, and deleted: each time the page shows the run's true numbers
    and the server lives (with the old memory map, flipped bytes were served and a truncation killed
    it with SIGBUS). A fresh server on that home, with its index garbled too, starts, rebuilds the
    index, says the tampered run is gone, and running the text again in the browser gives the true
    numbers back."""
    from headscope.analysis.capture import capture
    from headscope.analysis.store import Store

    home = tmp_path / "home"
    store = Store(home)
    key = capture(real_model, PROMPT, store=store).key  # the same key the page's Run button computes
    store.close()
    (patterns_file,) = home.glob(f"records/*/{key}-*/patterns.npy")
    pristine = patterns_file.read_bytes()
    true_map = expected_heatmap(np.load(patterns_file, allow_pickle=False))
    search = f"?run={key[:16]}"
    log = tmp_path / "server.log"
    proc, url = start_server(home, log)
    try:
        # the server reads the run from the store and keeps it
        np.testing.assert_allclose(heatmap(render_attention(url, search)), true_map, equal_nan=True)
        st = patterns_file.stat()
        data_start = len(pristine) - np.load(patterns_file).nbytes
        for tamper in ("flip", "truncate", "delete"):
            if tamper == "flip":  # patterns[0, 0], the map shown, bit-flipped in place
                raw = bytearray(pristine)
                raw[data_start:data_start + 2 * true_map.size] = bytes(
                    b ^ 0x55 for b in raw[data_start:data_start + 2 * true_map.size])
                with open(patterns_file, "r+b") as f:
                    f.write(raw)
                os.utime(patterns_file, ns=(st.st_atime_ns, st.st_mtime_ns))
            elif tamper == "truncate":
                with open(patterns_file, "r+b") as f:
                    f.truncate(data_start + 100)
            else:
                patterns_file.unlink()
            response = render_attention(url, search)
            assert proc.poll() is None, f"{tamper}: the server died\n" + log.read_text()
            np.testing.assert_allclose(heatmap(response), true_map, equal_nan=True, err_msg=tamper)
            patterns_file.write_bytes(pristine)
    finally:
        stop(proc)

    # a fresh server: the run's bytes flipped, the index garbled
    raw = bytearray(pristine)
    raw[data_start] ^= 0xFF
    patterns_file.write_bytes(bytes(raw))
    for suffix in ("-wal", "-shm"):  # a WAL holding page 1 would mask the garbled file: SQLite reads it there
        (home / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (home / "index.sqlite").write_bytes(b"this is not a database" * 200)
    before = len(log.read_text())
    proc, url = start_server(home, log)
    try:
        response = render_attention(url, search)
        assert "No stored run has the id" in error_text(response) and "Run the text again" in error_text(response)
        assert response["hs-heatmap"]["figure"].get("data", []) == []
        text = log.read_text()[before:]
        rebuilt = [line for line in text.splitlines() if "rebuilt" in line]
        assert len(rebuilt) == 1 and "index.sqlite is corrupt" in rebuilt[0], text
        assert "patterns.npy failed its checksum; dropped, it will be computed again" in text
        assert not patterns_file.exists()  # the tampered copy is gone

        page.goto(url + search)  # what a user who opens the link sees
        page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('No stored run')")
        run_prompt(page, url, PROMPT)  # the user runs the text again: recomputed, the same content key
        wait_for_run(page)
        assert key.startswith(run_id_of(page.url))
        assert "No stored run" not in page.locator("#hs-error").inner_text()
        assert len(list(home.glob(f"records/*/{key}-*/patterns.npy"))) == 1
        # recomputed in a job forked from the server (one thread: OMP_NUM_THREADS=1 above): equal to the stored
        # float16 within rounding
        np.testing.assert_allclose(heatmap(render_attention(url, search)), true_map, atol=2e-3, equal_nan=True)
        assert proc.poll() is None
    finally:
        stop(proc)


# -- the CLI on a corrupt index -------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "zero-length"])  # truncated: tests/analysis/test_store.py
def test_cli_reports_a_corrupt_index_in_one_line_and_lists_the_rebuilt_runs(tmp_path, real_model, damage):
    from headscope.analysis.capture import capture
    from headscope.analysis.store import Store

    home = tmp_path / "home"
    store = Store(home)
    keys = {capture(real_model, text, store=store).key for text in ("One fish, two fish.", "Red fish, blue fish.")}
    store.close()
    index = home / "index.sqlite"
    (home / "index.sqlite-wal").unlink(missing_ok=True)
    if damage == "garbage":
        index.write_bytes(os.urandom(4096))
    else:
        index.write_bytes(b"")
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "headscope.app.cli", "runs", "list"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "rebuilt 2 records from the record folders" in done.stderr and "Traceback" not in done.stderr
    assert {line.split()[0] for line in done.stdout.splitlines()} == {k[:16] for k in keys}
    assert ("index.sqlite is corrupt (file is not a database)" if damage == "garbage"
            else "index.sqlite was empty") in done.stderr


# -- the job cache holds JSON, and never loads a pickle --------------------------------------------


def test_job_cache_round_trips_a_real_background_job_as_json_and_never_unpickles(tmp_path):
    """A real Dash background callback (forked job process, progress, a figure and components as its
    result) through the app's manager: the cache holds only JSON and the page gets its result;
    pickles planted in the cache (small, in SQLite; large, in a file) are never loaded."""
    import diskcache
    import plotly.graph_objects as go
    from dash import Dash, DiskcacheManager, Input, Output, html, no_update

    from headscope.app.jobs import job_cache

    folder = tmp_path / "jobs"
    manager = DiskcacheManager(job_cache(folder), expire=600)
    app = Dash(__name__, background_callback_manager=manager)
    app.layout = html.Div([html.Button(id="go"), html.Div(id="out"), html.Div(id="fig"), html.Div(id="same"),
                           html.Progress(id="bar")])

    @app.callback(Output("out", "children"), Output("fig", "children"), Output("same", "children"),
                  Input("go", "n_clicks"), background=True, progress=[Output("bar", "value")],
                  prevent_initial_call=True)
    def job(set_progress, n):
        set_progress((50,))
        time.sleep(0.5)
        return html.B(f"done {n}"), [go.Figure(go.Heatmap(z=np.eye(3)), layout={"title": "eye"}).to_dict()], no_update

    client = app.server.test_client()
    body = {"output": "..out.children...fig.children...same.children..",
            "outputs": [{"id": "out", "property": "children"}, {"id": "fig", "property": "children"},
                        {"id": "same", "property": "children"}],
            "inputs": [{"id": "go", "property": "n_clicks", "value": 7}], "changedPropIds": ["go.n_clicks"],
            "state": []}
    first = client.post("/_dash-update-component", json=body)
    handles = first.get_json()
    assert first.status_code in (200, 202) and "cacheKey" in handles, first.data
    query = "?" + urllib.parse.urlencode({"cacheKey": handles["cacheKey"], "job": handles["job"]})
    deadline = time.time() + 180  # a forked job on a loaded machine can take long to start
    result_key = handles["cacheKey"].split("~")[0]  # the client's handle is the key plus Dash's signature
    while not manager.result_ready(result_key):
        assert_json_only(folder)  # progress entries too
        assert time.time() < deadline, "the job gave no result in 180 s"
        time.sleep(0.1)
    # The finished result sits in the cache until the page reads it (Dash then deletes it), so it is
    # checked here, before the read, and not after (where whether anything is left depends on timing).
    assert assert_json_only(folder) >= 1
    r = client.post("/_dash-update-component" + query, json=body)
    assert r.status_code == 200 and "response" in (r.get_json() or {}), (r.status_code, r.data[:300])
    response = r.get_json()["response"]
    assert response["out"]["children"]["props"]["children"] == "done 7"
    assert response["fig"]["children"][0]["layout"]["title"]["text"] == "eye"
    assert "same" not in response  # no_update survived the round trip
    assert_json_only(folder)

    canary = tmp_path / "canary"
    planter = diskcache.Cache(str(folder))  # diskcache's default disk: pickles
    planter.set("planted", Bomb(canary))
    planter.set("planted-large", [Bomb(canary), "x" * 100_000])
    planter.close()
    cache = job_cache(folder)
    assert cache.get("planted", "absent") == "absent"
    assert cache.get("planted-large", "absent") == "absent"
    assert manager.get_result("planted", None) is manager.UNDEFINED
    assert manager.get_progress("planted") is None
    assert not canary.exists()
    planted = {row[0]: row for row in job_cache_rows(folder)}
    assert pickle.PROTO in planted["planted"][4]  # the planted pickles really are there
    assert pickle.PROTO in (folder / planted["planted-large"][3]).read_bytes()


def test_shared_records_refuse_malformed_and_pickled_copies(redis_url, tmp_path, monkeypatch):
    """A record in Redis with a pickled object array (its checksum matching) or a malformed header is
    logged and not used: the store answers None, nothing is unpickled, nothing raises."""
    import hashlib
    import io

    import redis

    from headscope.analysis.store import Store

    monkeypatch.setenv("HEADSCOPE_REDIS_URL", redis_url)
    client = redis.Redis.from_url(redis_url)
    canary = tmp_path / "canary"
    arr = np.empty(1, dtype=object)
    arr[0] = Bomb(canary)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=True)
    data = buf.getvalue()
    pickled = "aa11" + "0" * 60
    header = {"kind": "run", "meta": {}, "created": 0.0,
              "arrays": {"a": {"sha256": hashlib.sha256(data).hexdigest(), "shape": [1], "dtype": "object"}}}
    client.hset(f"headscope:record:{pickled}", mapping={"header": json.dumps(header), "array:a": data})
    client.zadd("headscope:records", {pickled: 0})
    malformed = "bb22" + "0" * 60
    client.hset(f"headscope:record:{malformed}", mapping={"header": b"{not json"})
    store = Store(tmp_path / "home")
    assert store.get(pickled) is None and store.get(malformed) is None
    assert not canary.exists()

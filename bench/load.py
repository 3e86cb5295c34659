"""Load on one server, loopback only: page loads and small runs per second, p50/p95 latency, with
1, 5 and 10 concurrent clients, in one run.

Starts ``headscope serve`` on a free loopback port with a fresh store, then for each concurrency
level sends a bounded number of requests from that many threads:

- *page load*: ``GET /`` then ``GET /_dash-layout`` (what a browser fetches before rendering);
- *small run*: the Attention page's Run callback (``POST /_dash-update-component``, the exact
  payload the browser sends, built from ``/_dash-dependencies``) on a fresh ~20-token text, so
  every run is a real forward pass and capture (nothing cached).

The baseline is the same request from one client in the same run; the table gives each level's
throughput and latency against it. Bounded: ``--requests`` per kind and level, 120 s per request.

    .venv/bin/python bench/load.py [--levels 1,5,10] [--requests 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "river bridge orchard chapel quarry harbour meadow forge tower granary lantern kettle".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "headscope.app.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def run_payload(url: str) -> tuple[dict, callable]:
    deps = json.load(urllib.request.urlopen(url + "_dash-dependencies", timeout=30))
    cb = next(c for c in deps if any(i["id"] == "attn-hs-run" for i in c["inputs"]))
    outputs = []
    for part in cb["output"].strip(".").split("..."):
        ident, prop = part.rsplit(".", 1)
        outputs.append({"id": ident, "property": prop})

    def payload(text: str) -> dict:
        return {
            "output": cb["output"], "outputs": outputs,
            "inputs": [{"id": "attn-hs-run", "property": "n_clicks", "value": 1}],
            "changedPropIds": ["attn-hs-run.n_clicks"],
            "state": [{"id": "attn-hs-text", "property": "value", "value": text},
                      {"id": "attn-hs-model", "property": "value", "value": "smollm2-135m"},
                      {"id": "attn-hs-url", "property": "search", "value": ""}],
        }

    return cb, payload


def page_load(url: str) -> None:
    for path in ("", "_dash-layout"):
        with urllib.request.urlopen(url + path, timeout=120) as r:
            r.read()


def small_run(url: str, payload: dict) -> None:
    req = urllib.request.Request(url + "_dash-update-component", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    search = json.dumps(body)
    if "run=" not in search:
        raise RuntimeError(f"the run did not land: {search[:200]}")


def level(n_clients: int, n_requests: int, job) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    todo = list(range(n_requests))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            t0 = time.perf_counter()
            try:
                job(i)
                ok = True
            except Exception:
                ok = False
            dt = time.perf_counter() - t0
            with lock:
                if ok:
                    latencies.append(dt)
                else:
                    errors[0] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"per_s": len(lat) / wall, "p50": statistics.median(lat) if lat else float("nan"),
            "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan"), "errors": errors[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,5,10")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory() as home:
        proc, url = start_server(Path(home))
        try:
            _, payload = run_payload(url)
            counter = [0]
            lock = threading.Lock()

            def fresh_text(_i: int) -> str:
                with lock:
                    counter[0] += 1
                    k = counter[0]
                return f"Visitor {k} walks past the {WORDS[k % len(WORDS)]} and the {WORDS[(3 * k) % len(WORDS)]}."

            small_run(url, payload(fresh_text(0)))  # warm: model loaded, first capture done
            page_load(url)
            rows = []
            for kind, job in (("page load", lambda i: page_load(url)),
                              ("small run", lambda i: small_run(url, payload(fresh_text(i))))):
                base = None
                for n in levels:
                    r = level(n, args.requests, job)
                    base = base or r
                    rows.append((kind, n, r, base))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'kind':<10} {'clients':>7} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} {'errors':>6} "
          f"{'req/s ×base':>11} {'p50 ×base':>9}")
    for kind, n, r, base in rows:
        print(f"{kind:<10} {n:>7} {r['per_s']:>7.2f} {r['p50']:>7.3f} {r['p95']:>7.3f} {r['errors']:>6} "
              f"{r['per_s'] / base['per_s']:>11.2f} {r['p50'] / base['p50']:>9.2f}")


if __name__ == "__main__":
    main()

"""The ``headscope`` command: serve the app, run texts, list models and runs, rebuild figures."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

EXIT_USER_ERROR = 2


@contextlib.contextmanager
def progress_bar(desc: str, enabled: bool = True) -> Iterator:
    """A tqdm bar driven by a ``progress(fraction)`` callback; shown only when the work takes time."""
    from tqdm import tqdm

    bar = tqdm(total=100, desc=desc, disable=not enabled, leave=False, file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}", delay=1.0)

    def update(fraction: float) -> None:
        bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def _store(args):
    from analysis.store import Store

    return Store(args.home) if getattr(args, "home", None) else Store()


def cmd_serve(args) -> int:
    from app.access import new_token, protect
    from app.context import AppContext
    from app.server import create_app, warm_up

    host = args.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    token = args.token or os.environ.get("HEADSCOPE_TOKEN") or (None if loopback else new_token())
    if token is not None and len(token) < 16:
        print("headscope: an access token must have at least 16 characters.", file=sys.stderr)
        return EXIT_USER_ERROR
    from app.workers import redis_url

    context = AppContext(store=_store(args), default_model=args.model)
    if redis_url():
        from analysis.models import refuse_loading

        # jobs and every model-using callback run on `headscope worker`s: this process loads no model
        refuse_loading("This web front end loads no model: its jobs run on headscope workers "
                       "(HEADSCOPE_REDIS_URL is set), and this page asked it to load one. Please report it.")
        print(f"headscope: jobs run on Celery workers through {_redacted(redis_url())}; "
              "start them with `headscope worker`", file=sys.stderr)
    else:
        print(f"headscope: loading {args.model} …", file=sys.stderr)
        t = time.time()
        warm_up(args.model)
        print(f"headscope: model ready in {time.time() - t:.1f} s", file=sys.stderr)
        from analysis.joint_embedding import start_umap_warmup

        start_umap_warmup()  # compiles UMAP's numba code in the background (~15 s), before anyone asks
    app = create_app(context)
    if token is not None:
        protect(app.server, token)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(f"headscope: access token required; open http://{shown}:{args.port}/?token={token}", file=sys.stderr)
    print(f"headscope: serving on http://{host}:{args.port}  (store: {context.store.root})", file=sys.stderr)
    app.run(host=host, port=args.port, debug=False, threaded=True)
    return 0


def _redacted(url: str) -> str:
    """A Redis URL without its password, for messages."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def cmd_worker(args) -> int:
    """A Celery worker for the app's jobs (needs HEADSCOPE_REDIS_URL)."""
    from app.workers import redis_url, start_worker

    if not redis_url():
        print("headscope worker: set HEADSCOPE_REDIS_URL to the Redis server the web front end uses, e.g. "
              "HEADSCOPE_REDIS_URL=redis://127.0.0.1:6379/0 headscope worker", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.concurrency < 1 or args.page_concurrency < 0:
        print("headscope worker: --concurrency must be at least 1 and --page-concurrency at least 0",
              file=sys.stderr)
        return EXIT_USER_ERROR
    import redis

    from analysis.models import DEFAULT_MODEL

    try:
        redis.Redis.from_url(redis_url(), socket_connect_timeout=5).ping()
    except (redis.RedisError, ValueError) as e:
        print(f"headscope worker: cannot reach Redis at {_redacted(redis_url())}: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.home:
        os.environ["HEADSCOPE_HOME"] = args.home
    start_worker(models=args.model or [DEFAULT_MODEL], concurrency=args.concurrency, device=args.device,
                 name=args.name, page_concurrency=args.page_concurrency)
    return 0


def cmd_run(args) -> int:
    import numpy as np

    from analysis.limits import limit
    from analysis.models import load_model
    from analysis.statistics_run import (
        STATS_METRICS,
        StatsRun,
        capture_for_page,
        capture_statistics,
        statistics_score,
    )
    from app.export import write_files

    if args.file:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"headscope: cannot read {args.file}: {e}") from None
    else:
        text = args.text
    if text is None:
        print("headscope run: give a TEXT or --file F", file=sys.stderr)
        return EXIT_USER_ERROR
    store = _store(args)
    with progress_bar("loading model") as bar:
        model = load_model(args.model)
        bar(1.0)
    with progress_bar("capturing") as bar:
        if args.stats:
            run = capture_statistics(model, text, store=store, max_tokens=limit("HEADSCOPE_MAX_STATS_TOKENS"),
                                     progress=bar)
        else:
            run = capture_for_page(model, text, store, limit("HEADSCOPE_MAX_TOKENS"))
            bar(1.0)
    out = Path(args.out) if args.out else store.root / "exports" / run.short_id
    paths = write_files(run, "head_grid", {"metric": "entropy"}, out, tuple(args.formats.split(",")) if args.formats else ())
    if isinstance(run, StatsRun):
        # statistics mode: no patterns; the per-row statistics, column sums, pooled maps and scores
        arrays = {f"row_{name}": a for name, a in run.rows.items()}
        arrays.update(col_sum=run.col_sum, pooled=run.pooled)
        for name, arr in arrays.items():
            np.save(out / f"{name}.npy", arr, allow_pickle=False)
            paths.append(out / f"{name}.npy")
        with open(out / "scores.csv", "w", encoding="utf-8") as f:
            f.write("layer,head," + ",".join(STATS_METRICS) + "\n")
            tables = [statistics_score(run, name) for name in STATS_METRICS]
            for la in range(run.n_layers):
                for h in range(run.n_heads):
                    f.write(f"{la},{h}," + ",".join(f"{t[la, h]:.6g}" for t in tables) + "\n")
        paths.append(out / "scores.csv")
        mode = f"statistics mode, no patterns kept, pooled block {run.block_size}"
    else:
        np.save(out / "patterns.npy", np.asarray(run.patterns), allow_pickle=False)
        paths.append(out / "patterns.npy")
        mode = "full patterns"
    print(f"run {run.key}")
    loss = float(np.nanmean(run.token_loss)) if run.n_tokens > 1 else float("nan")  # one token: no loss
    print(f"{run.n_tokens} tokens, mean loss {loss:.4f} ({mode})")
    print(f"results in {out}")
    for p in dict.fromkeys(paths):
        print(f"  {p.name}")
    return 0


def cmd_models(args) -> int:
    from analysis.models import available_models

    for m in available_models():
        print(f"{m['spec']:<32} {m['status']:<8} {m['description']}")
    print("\nAlso loadable: a .gguf file, or a local folder with config.json and *.safetensors.")
    return 0


def cmd_runs(args) -> int:
    store = _store(args)
    if args.action == "list":
        records = store.list("run")
        if not records:
            print("no runs stored in", store.root)
        for r in records:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
            text = (r.meta.get("text") or "").replace("\n", " ")[:50]
            print(f"{r.key[:16]}  {when}  {r.meta['model_name']:<16} {r.meta['n_tokens']:>6} tok  {text}")
        return 0
    missing = 0
    for run_id in args.ids:
        keys = store.find(run_id)
        if len(keys) != 1:
            print(f"headscope runs rm: {run_id!r} matches {len(keys)} runs", file=sys.stderr)
            missing += 1
            continue
        store.remove(keys[0])
        print(f"removed {keys[0][:16]}")
    return EXIT_USER_ERROR if missing else 0


def cmd_figure(args) -> int:
    from app.export import FIGURE_FORMATS, read_manifest, regenerate, write_files

    manifest = read_manifest(Path(args.manifest))
    with progress_bar("rebuilding") as bar:
        run, _fig, _rows = regenerate(manifest, store=_store(args))
        bar(1.0)
    out = Path(args.out) if args.out else Path(args.manifest).resolve().parent / "regenerated"
    formats = tuple(args.formats.split(",")) if args.formats else FIGURE_FORMATS
    for p in write_files(run, manifest["view"], manifest["params"], out, formats):
        print(p)
    return 0


def cmd_scan(args) -> int:
    """Needle-in-a-haystack sweep → retrieval score tables and figures (re-running reuses trials)."""
    import json

    import numpy as np

    from analysis.models import load_model
    from analysis.niah import load_haystack, load_needles
    from analysis.retrieval import sweep
    from app.context import AppContext, set_context
    from app.export import write_files
    from app.heads_views import head_scores_of

    store = _store(args)
    set_context(AppContext(store=store, default_model=args.model))
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        print("headscope scan: --lengths and --depths take numbers separated by commas", file=sys.stderr)
        return EXIT_USER_ERROR
    needles = load_needles(args.needles_file) if args.needles_file else load_needles()
    if args.needles:
        wanted = [n.strip() for n in args.needles.split(",") if n.strip()]
        known = {n.id: n for n in needles}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            print(f"headscope scan: unknown needle ids {unknown}; known: {', '.join(known)}", file=sys.stderr)
            return EXIT_USER_ERROR
        needles = [known[w] for w in wanted]
    with progress_bar("loading model") as bar:
        model = load_model(args.model)
        bar(1.0)
    with progress_bar(f"sweep ({len(needles)} needles × {len(lengths)} lengths × {len(depths)} depths)") as bar:
        result = sweep(model, needles, lengths, depths, load_haystack(args.haystack), store=store, progress=bar)
    if not result.trials:
        print("headscope scan: no trial finished", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else store.root / "exports" / f"scan-{result.key[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    tables = {"scores": result.scores, "group_max": result.group_max, "group_mean": result.group_mean}
    for name, table in tables.items():
        np.savetxt(out / f"retrieval_{name}.csv", table, delimiter=",", fmt="%.6f")
    summary = {
        "sweep": result.key, "model": model.name, "model_digest": model.digest,
        "lengths": lengths, "depths": depths, "needles": [n.id for n in needles],
        "n_trials": result.n_trials, "n_counted": result.n_counted,
        "share_above_0.1": result.share_above(0.1),
        "accuracy": np.where(np.isfinite(result.accuracy), result.accuracy, None).tolist(),
        "reused_trials": sum(t.reused for t in result.trials),
    }
    params = {"model": args.model, "sweep": result.key[:16], "agg": "query", "score": "streaming", "stat": "mean",
              "sink_size": args.sink, "window": args.window, "trial": 0}
    with progress_bar(f"per-head scores on {len({tuple(t.prompt_ids) for t in result.trials})} prompts") as bar:
        scores = head_scores_of(result, params, progress=bar)
    for name in scores.names:
        np.savetxt(out / f"{name}_mean.csv", scores.mean[name], delimiter=",", fmt="%.6f")
        np.savetxt(out / f"{name}_std.csv", scores.std[name], delimiter=",", fmt="%.6f")
    summary["head_scores"] = {"n_prompts": scores.n_prompts, "sink_size": scores.sink, "window": scores.window,
                              "scores": scores.names}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    formats = tuple(args.formats.split(",")) if args.formats else ("svg", "html")
    for view in ("retrieval_grid", "retrieval_histogram", "retrieval_scatter", "niah_grid"):
        write_files(None, view, params, out, formats)
    for score in scores.names:
        write_files(None, "head_score_grid", {**params, "score": score}, out / score, formats)
    for score in ("retrieval", "evidence"):
        if score == "retrieval" or score in scores.names:
            write_files(None, "score_mass", {**params, "score": score}, out / f"mass_{score}", formats)
    print(f"sweep {result.key}")
    print(f"{result.n_counted}/{result.n_trials} trials answered ({summary['reused_trials']} reused); "
          f"{result.share_above(0.1):.1%} of heads score above 0.1")
    print(f"results in {out}")
    return 0


def cmd_ablate(args) -> int:
    """Ablate heads: effects on a text, retrieval accuracy on a needle-in-a-haystack sweep, and the
    top-k vs random curve; writes tables (CSV, JSON) and figures."""
    import json

    import numpy as np

    from analysis.ablation import (
        AblationSpec,
        StoredValues,
        format_heads,
        head_means,
        loss_metric_fn,
        parse_heads,
        rank_heads,
        retrieval_accuracy,
        retrieval_accuracy_fn,
        save_curve,
        topk_curve,
    )
    from analysis.capture import InputError, capture
    from analysis.models import load_model
    from analysis.niah import load_haystack, load_needles
    from analysis.retrieval import sweep, trial_prompt
    from analysis.store import content_key
    from app.ablation_views import builtin_reference
    from app.context import AppContext, set_context
    from app.export import write_files
    from app.views import metric_scores

    store = _store(args)
    set_context(AppContext(store=store, default_model=args.model))
    if bool(args.heads) == bool(args.top_k):
        raise InputError("Choose the heads with exactly one of --heads (e.g. 12.3,14.1) and --top-k N --by SCORE.")
    if not (args.text or args.file or args.sweep):
        raise InputError("Say what to measure on: --text, --file, or --sweep (needle-in-a-haystack prompts).")
    text = args.text
    if args.file:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"Cannot read {args.file} as UTF-8 text: {e}") from None
    with progress_bar("loading model") as bar:
        model = load_model(args.model)
        bar(1.0)
    run = capture(model, text, store=store) if text else None
    result = None
    if args.sweep:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
        needles = load_needles()
        if args.needles:
            known = {n.id: n for n in needles}
            unknown = [w for w in args.needles.split(",") if w.strip() and w.strip() not in known]
            if unknown:
                raise InputError(f"Unknown needle ids {unknown}; known: {', '.join(known)}")
            needles = [known[w.strip()] for w in args.needles.split(",") if w.strip()]
        with progress_bar("needle-in-a-haystack sweep") as bar:
            result = sweep(model, needles, lengths, depths, load_haystack(args.haystack), store=store, progress=bar)
    # the scores heads are ranked by
    scores, by_label = None, ""
    if args.top_k:
        if args.by == "retrieval":
            if result is None:
                raise InputError("--by retrieval needs --sweep (the retrieval scores come from its trials).")
            scores, by_label = np.nan_to_num(result.scores, nan=0.0), "Retrieval score"
        else:
            if run is None:
                raise InputError(f"--by {args.by} is computed on a text: give --text or --file.")
            from analysis.head_summary import HEAD_METRICS

            if args.by not in HEAD_METRICS:
                raise InputError(f"Unknown score {args.by!r}: use retrieval or one of {', '.join(HEAD_METRICS)}.")
            scores, by_label = metric_scores(run, args.by), HEAD_METRICS[args.by].label
        heads = rank_heads(scores)[: args.top_k]
        if len(heads) < args.top_k:
            raise InputError(f"Only {len(heads)} heads have a {by_label} here; --top-k must be at most that.")
    else:
        heads = parse_heads(model, args.heads)
    # the method and what it needs
    params = {"model": args.model, "heads": format_heads(heads), "ablate": args.method}
    means = source = None
    if args.method == "mean":
        texts = builtin_reference()
        if args.reference_file:
            texts = [t for t in Path(args.reference_file).read_text(encoding="utf-8").splitlines() if t.strip()]
        with progress_bar("reference means") as bar:
            means = head_means(model, texts, store=store, progress=bar)
        params["ref"] = means.key[:16]
    if args.method == "resample":
        if not args.source:
            raise InputError("--method resample needs --source TEXT (the input whose head outputs are patched in).")
        source_run = capture(model, args.source, store=store)
        source, params["source"] = tuple(source_run.token_ids), source_run.key[:16]
    spec = AblationSpec(tuple(heads), args.method, means=means, source_ids=source)
    spec.validate(model)
    out = Path(args.out) if args.out else store.root / "exports" / f"ablate-{content_key(params)[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    formats = tuple(f for f in args.formats.split(",") if f)
    summary: dict = {"model": model.name, "model_digest": model.digest, "heads": format_heads(heads),
                     "method": args.method, "by": args.by if args.top_k else None}
    if run is not None:
        fig_rows = write_files(run, "ablation_effects", params, out, formats)
        rows = json.loads(fig_rows[-2].read_text()) if fig_rows else []
        summary["text"] = rows[-1] if rows else {}
        print(f"loss {summary['text']['mean_loss_clean']:.4f} -> {summary['text']['mean_loss_ablated']:.4f}; "
              f"p(next {summary['text']['target_token']!r}) {summary['text']['target_prob_clean']:.4f} -> "
              f"{summary['text']['target_prob_ablated']:.4f}")
    if result is not None:
        prompts = [trial_prompt(t) for t in result.trials]
        from analysis.ablation import ablation_hooks

        with progress_bar("retrieval accuracy, clean and ablated") as bar:
            clean = retrieval_accuracy(model, prompts)
            bar(0.5)
            ablated = retrieval_accuracy(model, prompts, ablation_hooks(model, spec))
        summary["niah"] = {"sweep": result.key, "n_prompts": len(prompts), "accuracy_clean": clean.accuracy,
                           "accuracy_ablated": ablated.accuracy,
                           "responses_ablated": ablated.responses}
        print(f"NIAH accuracy over {len(prompts)} prompts: {clean.accuracy:.3f} -> {ablated.accuracy:.3f}")
    if args.curve:
        if scores is None:
            raise InputError("--curve needs --top-k and --by (the score whose top heads are ablated).")
        ks = sorted({int(k) for k in args.curve.split(",") if k.strip()})
        seeds = list(range(args.seeds))
        if result is not None:
            fn, metric_label, subject = retrieval_accuracy_fn(prompts), "NIAH accuracy", ("sweep", result.key)
        else:
            fn, metric_label, subject = loss_metric_fn(run.token_ids, model), "mean loss (nats)", ("run", run.key)
        key = content_key("ablation_curve", model.digest, subject, args.by, scores.round(6).tolist(), ks, seeds,
                          args.method, params.get("ref"), params.get("source"))
        known = StoredValues(store, (model.digest, subject, args.method, params.get("ref"), params.get("source")))
        with progress_bar(f"top-k vs random curve ({len(ks)} k × {1 + len(seeds)} sets)") as bar:
            curve = topk_curve(model, scores, ks, fn, spec, seeds, known=known, progress=bar)
        save_curve(store, key, curve, {"metric_label": metric_label, "by_label": by_label,
                                       "subject": list(subject), "model_digest": model.digest})
        write_files(None, "ablation_curve", {**params, "curve": key[:16]}, out, formats)
        summary["curve"] = {"k": ks, "top": curve.top.tolist(), "random": curve.random.tolist(),
                            "random_mean": curve.random_mean.tolist(), "random_std": curve.random_std.tolist(),
                            "metric": metric_label, "top_heads": format_heads(curve.order[: max(ks)])}
        print(f"{metric_label} vs k {ks}: top {np.round(curve.top, 3).tolist()}; "
              f"random {np.round(curve.random_mean, 3).tolist()} ± {np.round(curve.random_std, 3).tolist()}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"results in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from analysis.models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="headscope", description="A workbench for attention heads.")
    parser.add_argument("--home", help="store folder (default: $HEADSCOPE_HOME or the user data dir)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the web app")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--token", help="access token (default: a random one when --host is not a loopback address; "
                                   "also HEADSCOPE_TOKEN)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run the app's jobs as a Celery worker (needs HEADSCOPE_REDIS_URL)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="long jobs (sweeps, curves, embeddings) at once: pool processes (default 1)")
    p.add_argument("--page-concurrency", type=int, default=1,
                   help="page callbacks at once, beside the jobs, so a long job never blocks a page "
                        "(default 1; 0: this worker takes no page callbacks)")
    p.add_argument("--device", default="cpu", help="torch device for models, e.g. cuda:0 (default cpu)")
    p.add_argument("--model", action="append",
                   help=f"model to load before the pool forks (repeatable; default {DEFAULT_MODEL}); "
                        "the first is the default model of jobs")
    p.add_argument("--name", help="worker name (default headscope-<pid>); unique per host")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("run", help="run a text and write its results")
    p.add_argument("text", nargs="?")
    p.add_argument("--file")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out")
    p.add_argument("--formats", default="", help="figure formats to write, e.g. svg,png,html")
    p.add_argument("--stats", action="store_true",
                   help="statistics mode at any length (attention through the kernels, no patterns kept); "
                        "texts above HEADSCOPE_MAX_TOKENS use it anyway")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("scan", help="needle-in-a-haystack sweep: retrieval scores per head")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lengths", default="512", help="context lengths in tokens, e.g. 512,1024")
    p.add_argument("--depths", default="10,50,90", help="needle depths in percent, e.g. 0,50,100")
    p.add_argument("--needles", default="", help="needle ids (default: all shipped needles)")
    p.add_argument("--needles-file", help="a JSON file of needles (fields: needle, question, answer)")
    p.add_argument("--haystack", default="prose", help="prose, passkey, or a UTF-8 text file")
    p.add_argument("--sink", type=int, default=4, help="streaming score: S, the first tokens kept as sinks")
    p.add_argument("--window", type=int, default=64, help="streaming score: W, the recent window")
    p.add_argument("--out")
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_scan)

    p = sub.add_parser("ablate", help="ablate heads: effects on a text or on needle-in-a-haystack retrieval, "
                                      "and the top-k vs random curve")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--heads", help="e.g. 12.3,14.1 or kv:20.1 (a key-value group) or 7.* (a layer)")
    p.add_argument("--top-k", type=int, help="ablate the k heads with the highest --by score")
    p.add_argument("--by", default="retrieval", help="retrieval (needs --sweep) or a per-head score on the text")
    p.add_argument("--method", default="zero", choices=["zero", "mean", "resample", "uniform", "first_token"])
    p.add_argument("--text")
    p.add_argument("--file")
    p.add_argument("--source", help="resample: the text whose head outputs are patched in")
    p.add_argument("--reference-file", help="mean: reference texts, one per line (default: built-in sentences)")
    p.add_argument("--sweep", action="store_true", help="measure needle-in-a-haystack retrieval accuracy")
    p.add_argument("--lengths", default="512")
    p.add_argument("--depths", default="25,75")
    p.add_argument("--needles", default="", help="needle ids (default: all shipped needles)")
    p.add_argument("--haystack", default="prose")
    p.add_argument("--curve", default="", help="k values for the top-k vs random curve, e.g. 0,5,10,20")
    p.add_argument("--seeds", type=int, default=3, help="random head sets per k")
    p.add_argument("--out")
    p.add_argument("--formats", default="svg,html")
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("models", help="list what can be loaded offline")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("runs", help="list or remove stored runs")
    p.add_argument("action", choices=["list", "rm"])
    p.add_argument("ids", nargs="*")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("figure", help="rebuild a figure from an export's manifest.json")
    p.add_argument("manifest")
    p.add_argument("--out")
    p.add_argument("--formats", default="")
    p.set_defaults(func=cmd_figure)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    from analysis.capture import InputError
    from analysis.models import ModelError

    try:
        return args.func(args)
    except (InputError, ModelError) as e:
        print(f"headscope: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("headscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
